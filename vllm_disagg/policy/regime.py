"""Pooled or split: how a group of "both" instances that all run a KV connector should share the work right now.

Pooled, each instance prefills and decodes its own requests (a colocated deployment). Split, some instances compute
prompts and hand the KV to the others, which only decode (a P/D deployment made of the same instances). Which is
better depends on load: pooled has twice the prefill capacity and no hand-off, split keeps prefills from stalling
running streams. The switch is made from measurements, with hysteresis, so that the group does not flap:

  * pooled -> split (one prefill instance, the one with the fewest streams) when the streams served pooled see a mean
    TPOT above ``split_tpot_share`` of the TPOT target, the prefill instance would stay below
    ``split_max_prefill_util`` busy, and the split's predicted p95 TTFT is below ``split_ttft_share`` of the target;
  * split -> pooled when the split's measured p95 TTFT (its latest requests) passes the TTFT target (before there
    are enough of them: when its prefill instance is predicted past capacity), or when pooled serving is predicted below ``pool_tpot_share`` of the TPOT
    target (the split's measured TPOT inflated by the prefill duty pooling would put on every instance);
  * either way only after the current regime has held ``min_regime_s``.

Before a split, its p95 TTFT is predicted M/D/1-like from the arrival rate and the fitted prefill time (the prefill
plus ~3x the mean wait); once split, it is measured. One prefill instance: on the groups this is built for (a few instances) a second one would be pooling.

Pure logic: the caller passes the clock (``ClusterView.now_s``), so a simulator replays it in simulated time.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_disagg.policy.api import InstanceView

TTFT_WINDOW = 40  # split-served TTFTs whose p95 decides whether the split still meets the TTFT target


@dataclass(frozen=True)
class RegimeConfig:
    split_tpot_share: float = 0.6
    pool_tpot_share: float = 0.35
    split_max_prefill_util: float = 0.9
    split_ttft_share: float = 0.8
    min_regime_s: float = 5.0
    window_s: float = 10.0  # time constant of the arrival rate


class _Rate:
    """Events per second, exponentially decayed with time constant ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.value = 0.0
        self.at: float | None = None
        self.start: float | None = None

    def _decayed(self, now: float) -> float:
        if self.at is None:
            return 0.0
        return self.value * math.exp(-max(now - self.at, 0.0) / self.window_s)

    def add(self, now: float) -> None:
        self.value = self._decayed(now) + 1.0 / self.window_s
        self.at = now
        if self.start is None:
            self.start = now

    def rate(self, now: float) -> float:
        """The decayed count over the window; early on, over the time seen so far (else it starts near 0)."""
        if self.start is None:
            return 0.0
        seen = now - self.start
        scale = 1.0 / (1.0 - math.exp(-seen / self.window_s)) if seen > 0 else 1.0
        return self._decayed(now) * min(scale, 10.0)


@dataclass(frozen=True)
class Decision:
    """The regime for one request: ``prefill`` empty when pooled, else the instances that compute prompts."""

    prefill: tuple[str, ...]
    why: str  # what the last switch (or the hold) was based on, for the decision's explanation

    @property
    def split(self) -> bool:
        return bool(self.prefill)


class Regime:
    """The group's regime, updated at each request from the arrival rate, the prefill line and measured TPOTs."""

    def __init__(self, cfg: RegimeConfig, ttft_target_s: float, tpot_target_s: float, decay: float) -> None:
        self.cfg = cfg
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.decay = decay
        self.arrivals = _Rate(cfg.window_s)
        self.prefill: tuple[str, ...] = ()
        self.since: float | None = None
        self.why = "start"
        self.tpot: dict[bool, float | None] = {
            False: None,
            True: None,
        }  # mean TPOT measured, by regime (split?)
        self.split_ttfts: collections.deque[float] = collections.deque(maxlen=TTFT_WINDOW)

    def observe(self, split: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        """A finished request of the group: its TTFT (kept for splits) and TPOT (averaged per regime)."""
        if split and ttft_s is not None:
            self.split_ttfts.append(ttft_s)
        if tpot_s is not None and tpot_s > 0:
            old = self.tpot[split]
            self.tpot[split] = tpot_s if old is None else self.decay * old + (1 - self.decay) * tpot_s

    def split_p95_ttft(self) -> float | None:
        """The measured p95 TTFT of the latest split-served requests (None until there are enough)."""
        if len(self.split_ttfts) < TTFT_WINDOW // 2:
            return None
        ordered = sorted(self.split_ttfts)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def decide(
        self,
        now: float,
        group: Sequence[InstanceView],
        prefill_s: float,
        compute_s: float,
    ) -> Decision:
        """The regime for a request arriving at ``now``.

        ``group``: the healthy instances of the group; ``prefill_s``: the fitted time of a typical prompt (what
        occupies a prefill instance), ``compute_s``: its compute part (what stalls streams when pooled).
        """
        self.arrivals.add(now)
        ids = {i.id for i in group}
        if len(group) < 2:
            return self._set((), now, "one instance")
        if self.prefill and not set(self.prefill) <= ids:
            self.prefill = ()  # a prefill instance left: re-decide from pooled
            self.why = "prefill instance gone"
        lam = self.arrivals.rate(now)
        rho = lam * prefill_s  # one prefill instance's utilisation if the group splits 1 : n - 1
        # a split's p95 TTFT, M/D/1-like: the prefill plus ~3x the mean wait for the prefill instance
        split_ttft = prefill_s * (1.0 + 1.5 * rho / (1.0 - rho)) if rho < 1.0 else math.inf
        held = self.since is None or now - self.since >= self.cfg.min_regime_s
        target = self.tpot_target_s
        if not self.prefill:
            measured = self.tpot[False]
            if (
                held
                and measured is not None
                and measured > self.cfg.split_tpot_share * target
                and rho < self.cfg.split_max_prefill_util
                and split_ttft < self.cfg.split_ttft_share * self.ttft_target_s
            ):
                chosen = min(group, key=lambda i: (max(i.running, 0), i.id))
                why = f"pooled_tpot={measured * 1e3:.1f}ms,prefill_util={rho:.2f}"
                return self._set((chosen.id,), now, why)
            return Decision((), self.why)
        duty = min(lam * compute_s / len(group), 0.9)
        split_tpot = self.tpot[True]
        predicted = split_tpot / (1.0 - duty) if split_tpot is not None else None
        measured_ttft = self.split_p95_ttft()
        over = rho >= 1.0 if measured_ttft is None else measured_ttft > self.ttft_target_s
        if held and over:
            ttft = "-" if measured_ttft is None else f"{measured_ttft * 1e3:.0f}ms"
            return self._set((), now, f"split_p95_ttft={ttft},prefill_util={rho:.2f}")
        if held and predicted is not None and predicted < self.cfg.pool_tpot_share * target:
            return self._set((), now, f"pooled_tpot_predicted={predicted * 1e3:.1f}ms")
        return Decision(self.prefill, self.why)

    def _set(self, prefill: tuple[str, ...], now: float, why: str) -> Decision:
        if prefill != self.prefill:
            self.prefill, self.since, self.why = prefill, now, why
            self.split_ttfts.clear()
        return Decision(self.prefill, self.why)
