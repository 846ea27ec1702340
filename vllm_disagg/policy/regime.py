"""Pooled or split: how a group of "both" instances that all run a KV connector should share the work right now.

Pooled, each instance prefills and decodes its own requests (a colocated deployment). Split, one instance computes
prompts and hands the KV to the others, which decode; a decode instance computes a prompt itself only when no
hand-off would meet the targets and serving it there would (the prefill instance is backed up: overflow), or the
prompt is all but a short suffix in its cache (a prefill instance, too, serves a long prompt whose prefix it holds;
``CostModel`` narrows the plans to these). Which is better depends
on the hardware and the load: pooled has more prefill capacity, spreads the streams and needs no hand-off; split
keeps prefills from stalling running streams, and its overflow spends the decode instances' TPOT slack only where
the TTFT target needs it. Neither wins everywhere, so the regime is chosen by what each delivers: the share of its
latest requests that missed a target (TTFT or TPOT, as a goodput counts them).

  * pooled -> split (the prefill instance: the one with the fewest streams) when more than ``switch_miss_share`` of
    the latest pooled requests missed, and more than ``switch_margin`` above what the split missed when it was last
    left, within ``memory_s``;
  * split -> pooled when more than ``switch_miss_share`` of the latest split requests missed, and more than
    ``switch_margin`` above what pooled missed when it was last left, within ``memory_s``; or when pooled serving is
    predicted to need well under the TPOT target (the split's mean TPOT inflated by the prefill duty pooling would
    put on every instance, below ``pool_tpot_share`` of the target: load has fallen);
  * either way only after the current regime has held ``min_regime_s``.

The margin is hysteresis: two miss shares read off 60 requests each differ by ~0.09 (one standard deviation, at a
third missing) with nothing changed, and a switch on that noise costs the backlog each regime leaves the other.
That backlog is why a regime is judged only by the requests it served alone: one planned while requests of the
regime it replaced were still in flight (``CostModel`` tracks them) is not counted, up to ``2 * min_regime_s``
after the switch, so the new regime is not blamed for the queues and stalls the old one left behind.

A miss share is read from ``MIN_SAMPLES`` requests on; from ``RECENT`` on, a switch is also made where the misses'
one-sided 95% lower bound (Wilson's) already passes the level, so a load step that makes most requests miss is acted
on within a few finished requests, not after ``MIN_SAMPLES`` of them (at 3 requests/s with streams of a few
seconds that was ~14 s, most of a short benchmark run and every stream started in it).

So under a load that both regimes fail, the group settles on the one that fails less, and tries the other again
once its memory is older than ``memory_s``. One prefill instance: on the small groups this is built for, a second
one would be pooling.

The TTFT gate (``RegimeConfig.ttft_gate``; the cost model's ``split_ttft_gate``). Past its one prefill instance's
capacity a split's hand-offs queue without bound and every one of them misses, while the decode instances take a
prompt themselves only where that still meets the targets, which at such a load none does; pooled serving has every
instance's prefill capacity. Whether that loses depends on the mix: where every prompt is long, the split misses
everything; where the long prompts are a few among short streams, it misses only them, and pooled serving may miss
more (each long prefill stalls the streams beside it). So the gate predicts the share of all arrivals a split would
miss the TTFT target with (the share of them worth handing off, times the chance that a hand-off waits past what
the target leaves after its prefill), enters a split only where that is below the share pooled serving is missing,
and leaves it at once (without the hold) where the prompts offered exceed the prefill instance's capacity (rho >= 1),
the split is predicted to miss the margin more than pooled missed when it was left and at least ``TIE_LEAVE_SHARE``
of all arrivals (past capacity: every hand-off, the offered share, so workloads of mostly long prompts), and its
requests since it was entered (at least ``RECENT``) miss at least as often as pooled did. A mix whose hand-offs are
a minority is predicted to miss only them and stays: pooled serving stalls every stream with the same long prefills,
and what it missed at a lighter load is only a floor on what it would miss at this one (at 11 requests/s of the
chat mix, a split missing 10% left for a pooled regime remembered at 7% from 8 requests/s, which then missed 85%).
The prediction reads the prompts worth handing off as they arrive (``offer``): their tokens to compute as a decayed
rate and a decayed rate of squared tokens, read at the prefill line's current per-token time (so a calibration that
moves moves the prediction at once): the instance's utilisation rho and the mean wait of a single queue with Poisson arrivals
(Pollaczek-Khinchine: the squared-work rate over 2 (1 - rho)); the wait's tail is taken as exponential beyond the
share rho that waits at all. A decayed rate lags a step in load by its time constant, so rho is also read off the
latest ``RECENT`` prompts alone, the larger of the two counting, and no split is entered before that many prompts
arrived within one time constant: after an idle spell the misses in the window are an earlier load's.

The TPOT gate. A split puts every stream on the decode instances, which then take ``n / (n - 1)`` times the
arrivals each takes pooled, free of prefills. Where pooled requests miss because the group's decode capacity is what
runs short (the streams' own step, not the prefills stalling them), that only makes every stream slower: on a host
that prefills a long prompt in ~45 ms against a 25 ms TPOT target, a chat mix near capacity missed 7% pooled and
75-100% split. ``CostModel`` predicts the mean TPOT each regime's streams settle at (``decide``'s ``tpots``: a step
that grows with the batch holds each stream longer, so an instance takes on more, and past its capacity never
settles), and no split is entered whose decode instances would not settle, or would settle above both the pooled
streams and ``split_tpot_share`` of the target. Either bound alone blocks splits that win: on a GPU a split's step
hardly grows with its batch and it beats a pooled regime near the target, and a split well under the target is not
ruled out by pooled streams that are quicker on average (its gain is the stalled tail the mean does not show).
The gate reads the arrival rate now, which swings with Poisson bursts: at 40 req/s of the chat mix (AMX host) the
predicted decode load read 1.04, 1.20, 1.00, 1.11 and 0.65 within 0.4 s, and the one low reading let a split in
whose prefill instance ran at 1.38 of its capacity five seconds later (44% of requests missed; the other repeat,
pooled throughout, beat colocated by 1.09-1.20x). So a split also waits until its decode instances have been
predicted to settle through ``gate_hold_s`` of arrivals (a reading near the ``split_tpot_share`` bound may flicker
either way; one that never settles says the load is at the decode capacity).

A split also needs something to hand off. Where fewer than ``min_offered_share`` of the latest arrivals are worth
it (prompts whose prefix is cached nearly everywhere), the gate predicts it no TTFT miss, yet it gives up an
instance's decode capacity to protect the streams from a few prefills; pooled misses there are the streams' own
(the decode instances are full), and a split would only crowd them onto fewer instances. So no split is entered
there, and one is left (after the hold) where the share falls under half of it. A cold start of such a workload
offers a short burst (each new prefix once, and whatever arrives before its KV is known), which the share over the
latest ``WINDOW`` arrivals dilutes.

Pure logic: the caller passes the clock (``ClusterView.now_s``), so a simulator replays it in simulated time.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from vllm_disagg.policy.api import InstanceView
from vllm_disagg.policy.decayed import DecayedRate

WINDOW = 60  # the latest requests of a regime whose misses are counted
MIN_SAMPLES = WINDOW // 2  # the miss share is read as it is from this many requests on
RECENT = 8  # the latest prompts worth handing off whose arrival rate is read alone; the fewest requests switched on
# a regime's misses when left count while the arrival rate is at least this share of the rate then: two rates
# decayed over 10 s at 8 requests/s differ by 20% now and then with nothing changed (a steady load forgot a record
# within 30 s in a quarter of simulated runs at 0.8, one in twenty at 0.7)
LOAD_KEPT = 0.7
# past its prefill instance's capacity a split is left on a tie with pooled only where it is predicted to miss at
# least this share of all arrivals (its hand-offs are most of them)
TIE_LEAVE_SHARE = 0.5
Z_ONE_SIDED_95 = (
    1.645  # on fewer than MIN_SAMPLES requests a switch needs the misses' 95% lower bound past the level
)


@dataclass(frozen=True)
class RegimeConfig:
    switch_miss_share: float = 0.05
    switch_margin: float = (
        0.1  # how much more than the other regime (when last left) the current one must miss
    )
    pool_tpot_share: float = 0.35
    min_regime_s: float = 5.0
    memory_s: float = 300.0  # how long the miss share a regime was left with still counts against going back
    window_s: float = 10.0  # time constant of the arrival rate and of the offered prefill work
    ttft_gate: bool = (
        False  # gate the split on its TTFT misses predicted from the prompts offered (``offer``)
    )
    # with the gate: no split where under this share of the latest arrivals were worth handing off; a split left
    # (after the hold) where under half of it are
    min_offered_share: float = 0.15
    # no split where the decode instances, carrying every stream, are predicted a mean TPOT above this share of the
    # target and above the pooled streams' (``decide``'s ``tpots``)
    split_tpot_share: float = 0.6
    # nor until the decode instances have been predicted to settle for this long: the arrival rate the gate reads
    # swings with the arrivals' bursts, and at the decode capacity one low reading would let a split in
    gate_hold_s: float = 2.0


class RegimeTpots(NamedTuple):
    """The mean TPOT each regime's streams are predicted to settle at (``math.inf``: never), for the TPOT gate."""

    pooled_s: float
    split_s: float  # on the decode instances, every stream on them
    decode_load: float | None = (
        None  # what the arrivals ask of one instance's decode capacity, for the explanation
    )


@dataclass(frozen=True)
class Decision:
    """The regime for one request: ``prefill`` empty when pooled, else the instances that compute prompts."""

    prefill: tuple[str, ...]
    why: str  # what the last switch (or the hold) was based on, for the decision's explanation

    @property
    def split(self) -> bool:
        return bool(self.prefill)


class Regime:
    """The group's regime, updated at each request from the arrival rate, the prefill line and the misses measured
    under each regime."""

    def __init__(self, cfg: RegimeConfig, ttft_target_s: float, tpot_target_s: float, decay: float) -> None:
        self.cfg = cfg
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.decay = decay
        self.arrivals = DecayedRate(cfg.window_s)
        # the arrival rate as the load a regime's record is compared at (``load``): measured afresh after an idle
        # spell, where ``arrivals`` keeps decaying with the offered prompts' rates it is divided into
        self.load_rate = DecayedRate(cfg.window_s)
        self.arrived: collections.deque[float] = collections.deque(maxlen=RECENT)  # the latest arrival times
        # the prompts worth handing off: count, tokens to compute and squared tokens, per second (in tokens, not
        # seconds, so the prediction reads them at the prefill line's current rate, not the one each arrived at)
        self.offered_n = DecayedRate(cfg.window_s)
        self.offered_t = DecayedRate(cfg.window_s)
        self.offered_t2 = DecayedRate(cfg.window_s)
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=RECENT)  # (at, tokens)
        # whether each of the latest arrivals was worth handing off (``decide`` appends, ``offer`` marks)
        self.latest: collections.deque[bool] = collections.deque(maxlen=WINDOW)
        self.prefill: tuple[str, ...] = ()
        self.since: float | None = None
        self.why = "start"
        self.split_tpot: float | None = None  # mean TPOT of split-served requests
        # per regime (split?): whether each of its latest requests missed a target
        self.missed: dict[bool, collections.deque[bool]] = {
            False: collections.deque(maxlen=WINDOW),
            True: collections.deque(maxlen=WINDOW),
        }
        # per regime (split?): the share of its requests that missed when it was last left, when, and the arrival
        # rate then
        self.left: dict[bool, tuple[float, float, float]] = {
            False: (0.0, -math.inf, 0.0),
            True: (0.0, -math.inf, 0.0),
        }
        self.unsettled_at = -math.inf  # when a split's decode instances were last predicted never to settle

    def observe(self, split: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        """A finished request of the group, planned ``split`` or pooled: its TTFT and TPOT."""
        missed = (ttft_s is not None and ttft_s > self.ttft_target_s) or (
            tpot_s is not None and tpot_s > self.tpot_target_s
        )
        self.missed[split].append(missed)
        if split and tpot_s is not None and tpot_s > 0:
            old = self.split_tpot
            self.split_tpot = tpot_s if old is None else self.decay * old + (1 - self.decay) * tpot_s

    def offer(self, now: float, tokens: float) -> None:
        """A prompt worth handing off arrived; ``tokens``: what it leaves to compute, the work a split's prefill
        instance would take on. It is the arrival ``decide`` was last called for."""
        if self.latest:
            self.latest[-1] = True
        self.offered_n.add(now)
        self.offered_t.add(now, tokens)
        self.offered_t2.add(now, tokens * tokens)
        self.recent.append((now, tokens))

    def _queue(self, now: float, s_per_token: float) -> tuple[float, float, float]:
        """(rho, mean prefill s, mean wait s) of one prefill instance fed the prompts offered lately, computed at
        ``s_per_token``: a single queue with Poisson arrivals (Pollaczek-Khinchine; the wait is inf at rho >= 1)."""
        decayed = self.offered_t.warmed(now) * s_per_token
        rho = max(decayed, self._recent_rho(now) * s_per_token)
        if rho <= 0.0:
            return 0.0, 0.0, 0.0
        mean_s = decayed / max(self.offered_n.warmed(now), 1e-9)
        if rho >= 1.0:
            return rho, mean_s, math.inf
        # lambda E[S^2] at this rho: the decayed rates' E[S^2] / E[S], times rho
        mean_wait = (
            rho * self.offered_t2.warmed(now) * s_per_token**2 / max(decayed, 1e-12) / (2.0 * (1.0 - rho))
        )
        return rho, mean_s, mean_wait

    def split_miss_predicted(
        self, now: float, s_per_token: float, overhead_s: float = 0.0
    ) -> tuple[float, float]:
        """(rho, share): one prefill instance's utilisation by the prompts offered lately, computed at
        ``s_per_token``, and the share of all the requests arriving that a split is predicted to miss the TTFT
        target with: the share of them worth handing off, times the chance that a hand-off's wait passes what the
        target leaves after its prefill. A mix of
        short streams and a few long prompts can miss less split past that instance's capacity (the long prompts
        queue, the streams do not) than pooled, where every long prefill stalls the streams beside it."""
        rho, mean_s, mean_wait = self._queue(now, s_per_token)
        if rho <= 0.0:
            return 0.0, 0.0
        offered = min(self.offered_n.warmed(now) / max(self.arrivals.warmed(now), 1e-9), 1.0)
        slack = self.ttft_target_s - overhead_s - mean_s
        if rho >= 1.0 or slack <= 0.0:
            return rho, offered
        late = rho * math.exp(-slack * rho / mean_wait) if mean_wait > 0.0 else 0.0
        return rho, offered * min(late, 1.0)

    def _recent_rho(self, now: float) -> float:
        """The tokens per second of the latest prompts alone (0 until there are ``RECENT``): all but the oldest,
        over the time since it arrived."""
        recent = self.recent
        if len(recent) < RECENT:
            return 0.0
        span = now - recent[0][0]
        return sum(s for _, s in itertools.islice(recent, 1, None)) / span if span > 0 else math.inf

    def load(self, now: float) -> float:
        """The arrival rate now: the decayed rate (measured afresh after an idle spell, warmed up over the time
        seen), or the latest ``RECENT`` arrivals' alone where that is higher (the warm-up's scale is capped, so in
        its first second it reads low)."""
        rate = self.load_rate.warmed(now)
        arrived = self.arrived
        if len(arrived) == RECENT and now > arrived[0]:
            rate = max(rate, (RECENT - 1) / (now - arrived[0]))
        return rate

    def _arrivals_known(self, now: float) -> bool:
        """Whether the load now is known: ``RECENT`` arrivals within one time constant. Until then (after an idle
        spell) a regime's record is not forgotten for a load that only looks lighter."""
        return len(self.arrived) == RECENT and now - self.arrived[0] <= self.cfg.window_s

    def _load_seen(self, now: float) -> bool:
        """Whether the prompts now arriving have been seen long enough to judge a split by: ``RECENT`` of them
        within one time constant."""
        return len(self.recent) == RECENT and now - self.recent[0][0] <= self.cfg.window_s

    def offered_share(self) -> float:
        """The share of the latest ``WINDOW`` arrivals that were worth handing off (arrivals not seen yet count as
        not: a cold start's burst of new prompts is not read as the workload)."""
        return sum(self.latest) / WINDOW

    def miss_share(self, split: bool) -> float | None:
        """The share of the regime's latest requests that missed a target; None on too few."""
        window = self.missed[split]
        if len(window) < MIN_SAMPLES:
            return None
        return sum(window) / len(window)

    def misses_over(self, split: bool, level: float) -> float | None:
        """The regime's miss share where its latest requests show it above ``level``, else None: from
        ``MIN_SAMPLES`` requests the share itself, from ``RECENT`` the lower bound of its one-sided 95% interval."""
        window = self.missed[split]
        n = len(window)
        if n < RECENT:
            return None
        share = sum(window) / n
        if n >= MIN_SAMPLES:
            return share if share > level else None
        return share if wilson_lower(share, n) > level else None

    def decide(
        self,
        now: float,
        group: Sequence[InstanceView],
        prefill_s: float,
        compute_s: float,
        overhead_s: float = 0.0,
        s_per_token: float = 0.0,
        tpots: RegimeTpots | None = None,
    ) -> Decision:
        """The regime for a request arriving at ``now``.

        ``group``: the healthy instances of the group; ``prefill_s``: the fitted time of a typical prompt (what
        occupies a prefill instance: the reason's utilisation without the gate); ``compute_s``: its compute part
        (what stalls streams when pooled); ``overhead_s``: the fitted prefill's part that occupies no instance (HTTP,
        scheduling), added to the gate's predicted TTFT; ``s_per_token``: the fitted prefill time per token, at
        which the gate reads the tokens offered; ``tpots``: the mean TPOT each regime is predicted to settle at
        (None: not predicted, no TPOT gate).
        """
        self.arrivals.add(now)
        if self.load_rate.at is not None and now - self.load_rate.at > self.cfg.window_s:
            # after an idle spell the load is measured afresh, warmed up from this arrival, rather than climbing
            # back from what decayed over the spell for a time constant
            self.load_rate = DecayedRate(self.cfg.window_s)
        self.load_rate.add(now)
        self.arrived.append(now)
        self.latest.append(False)
        ids = {i.id for i in group}
        if len(group) < 2:
            return self._set((), now, "one instance")
        if self.prefill and not set(self.prefill) <= ids:
            self.prefill = ()  # a prefill instance left: re-decide from pooled
            self.why = "prefill instance gone"
        lam = self.arrivals.warmed(now)
        # the load a record is taken at: the decayed rate alone, where ``_remembered`` compares it with ``load``
        # (which also counts the latest arrivals' rate): a burst does not inflate what a record was taken at
        kept = self.load_rate.warmed(now)
        # one prefill instance's utilisation if the group splits 1 : n - 1 (and, with the gate, the share of
        # arrivals a split is predicted to miss)
        gate = self.cfg.ttft_gate
        offered = self.offered_share()
        rho, split_missed = (
            self.split_miss_predicted(now, s_per_token, overhead_s) if gate else (lam * prefill_s, 0.0)
        )
        held = self.since is None or now - self.since >= self.cfg.min_regime_s
        if not self.prefill:
            # read at every pooled arrival, so a split waits through ``gate_hold_s`` of them predicted to settle
            if tpots is not None and tpots.split_s == math.inf:
                self.unsettled_at = now
            missed = self.misses_over(False, self._bar(True, now))
            if held and missed is not None:
                if gate and not self._load_seen(now):
                    return Decision((), self.why)
                if gate and offered < self.cfg.min_offered_share:
                    self.why = f"pooled_missed={missed:.0%},offered={offered:.0%}"
                    return Decision((), self.why)
                if gate and split_missed >= missed:
                    self.why = f"pooled_missed={missed:.0%},split_missed_predicted={split_missed:.0%}"
                    return Decision((), self.why)
                if tpots is not None and self._split_slower(tpots):
                    self.why = f"pooled_missed={missed:.0%}{_tpots_why(tpots)}"
                    return Decision((), self.why)
                if tpots is not None and now - self.unsettled_at < self.cfg.gate_hold_s:
                    settled = now - self.unsettled_at
                    self.why = f"pooled_missed={missed:.0%}{_tpots_why(tpots)},settled_for={settled:.1f}s"
                    return Decision((), self.why)
                chosen = min(group, key=lambda i: (max(i.running, 0), i.id))
                self.left[False] = (missed, now, kept)
                why = f"pooled_missed={missed:.0%},prefill_util={rho:.2f}{_tpots_why(tpots)}"
                return self._set((chosen.id,), now, why)
            return Decision((), self.why)
        missed = self.misses_over(True, self._bar(False, now))
        if held and missed is not None:
            self.left[True] = (missed, now, kept)
            return self._set((), now, f"split_missed={missed:.0%},prefill_util={rho:.2f}")
        latest = self.missed[True]  # the split's requests since it was entered, up to ``WINDOW``
        pooled_missed = self._recent_miss(False, now)
        tie_bar = max(pooled_missed + self.cfg.switch_margin, TIE_LEAVE_SHARE)
        if gate and rho >= 1.0 and len(latest) >= RECENT and split_missed >= tie_bar:
            # past capacity the hand-offs' queue only grows, so where they are most arrivals and the margin more
            # than pooled missed, a tie with it is left too
            share = sum(latest) / len(latest)
            if share > self.cfg.switch_miss_share and share >= pooled_missed:
                self.left[True] = (share, now, kept)
                return self._set((), now, f"split_missed={share:.0%},prefill_util={rho:.2f}")
        if held and gate and offered < self.cfg.min_offered_share / 2:
            self.left[True] = (self.miss_share(True) or 0.0, now, kept)
            return self._set((), now, f"offered={offered:.0%}")
        # "load has fallen" is not taken back to a pooled regime remembered (at a comparable load) missing the
        # margin more than the split is now: it would be re-entered to miss more than it did
        calm = held and pooled_missed <= (self.miss_share(True) or 0.0) + self.cfg.switch_margin
        duty = min(lam * compute_s / len(group), 0.9)
        predicted = self.split_tpot / (1.0 - duty) if self.split_tpot is not None else None
        if calm and predicted is not None and predicted < self.cfg.pool_tpot_share * self.tpot_target_s:
            self.left[True] = (self.miss_share(True) or 0.0, now, kept)
            return self._set((), now, f"pooled_tpot_predicted={predicted * 1e3:.1f}ms")
        return Decision(self.prefill, self.why)

    def _split_slower(self, tpots: RegimeTpots) -> bool:
        """The TPOT gate: a split's decode instances would never settle, or settle slower than the pooled streams
        and past ``split_tpot_share`` of the target."""
        if tpots.split_s == math.inf:
            return True
        return tpots.split_s > max(tpots.pooled_s, self.cfg.split_tpot_share * self.tpot_target_s)

    def _bar(self, other: bool, now: float) -> float:
        """The miss share the current regime must pass to switch to ``other``: ``switch_miss_share``, and
        ``switch_margin`` above what ``other`` missed when it was last left, while that is recent."""
        if not self._remembered(other, now):
            return self.cfg.switch_miss_share
        share = self.left[other][0]
        return max(self.cfg.switch_miss_share, share + self.cfg.switch_margin)

    def _recent_miss(self, split: bool, now: float) -> float:
        """The miss share a regime had when it was last left, while that still counts (``_remembered``; else 0): a
        regime is not re-entered to miss more than it did."""
        return self.left[split][0] if self._remembered(split, now) else 0.0

    def _remembered(self, split: bool, now: float) -> bool:
        """Whether what a regime missed when it was last left still counts: within ``memory_s``, and while the
        arrival rate is at least ``LOAD_KEPT`` of what it was then (a regime that missed at one load may meet the
        targets at a lighter one), as far as the rate is known (``_arrivals_known``)."""
        _, at, lam = self.left[split]
        if now - at > self.cfg.memory_s:
            return False
        return not self._arrivals_known(now) or self.load(now) >= LOAD_KEPT * lam

    def _set(self, prefill: tuple[str, ...], now: float, why: str) -> Decision:
        if prefill != self.prefill:
            self.prefill, self.since, self.why = prefill, now, why
            for window in self.missed.values():
                window.clear()
        return Decision(self.prefill, self.why)


def _tpots_why(tpots: RegimeTpots | None) -> str:
    """The TPOT gate's figures for a decision's explanation ("" where not predicted)."""
    if tpots is None:
        return ""
    pooled, split = (
        f"{t * 1e3:.1f}ms" if t < math.inf else "unsettled" for t in (tpots.pooled_s, tpots.split_s)
    )
    why = f",split_tpot_predicted={split},pooled={pooled}"
    return why if tpots.decode_load is None else why + f",decode_load={tpots.decode_load:.2f}"


def wilson_lower(share: float, n: int, z: float = Z_ONE_SIDED_95) -> float:
    """The lower end of Wilson's score interval for a share seen in ``n`` trials (one-sided at ``z``): small
    samples with many misses pass a low level, a few misses among few requests do not."""
    z2 = z * z
    centre = share + z2 / (2 * n)
    spread = z * math.sqrt(share * (1.0 - share) / n + z2 / (4 * n * n))
    return max((centre - spread) / (1.0 + z2 / n), 0.0)
