"""The proxy's default policy: choose transfer, recompute or colocated serving from an estimated time to first token.

Other routers decide with fixed thresholds (disaggregate when the uncached prompt is long, when prefill is busy).
This one estimates, for every candidate plan, what the request will wait for and what it costs the streams already
running, and picks the cheapest plan that meets the TTFT and TPOT targets. The whole cost function is one method,
``CostModel.estimate``, so that the decision can be read, logged and argued about in one place. Its two measured
inputs (prefill seconds per token plus a constant, and the decode step) are fitted online from ``Outcome``s.

Pure logic: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, overload

from mypy_extensions import mypyc_attr

from vllm_disagg.policy.api import ClusterView, InstanceView, Mode, NoRoute, Outcome, Plan, RequestView
from vllm_disagg.policy.decayed import DecayedRate
from vllm_disagg.policy.regime import Decision, Regime, RegimeConfig, RegimeTpots

# Exact ties are broken by plan shape (fewer moving parts first), then by instance id: the same view always gives
# the same plan, whatever order the instances are listed in.
_MODE_ORDER: dict[str, int] = {"recompute": 0, "colocated": 1, "transfer": 2}
_MAX_PENDING = 8192  # planned requests remembered for calibration
LIVED_SAMPLES = 4  # plans made while a stream ran, from which its batch is read as their mean
ALONE_BATCH = 1.5  # a stream whose lived batch was under this decoded alone (``CostModel.alone_step_s``)
MAX_DUTY = (
    0.9  # an instance's prefill duty as the cost model uses it: a stream there still gets a tenth of it
)


@dataclass(frozen=True)
class CostModelConfig:
    """Targets, starting values for the fitted parameters, and the few modelling knobs.

    The proxy's and the simulator's defaults (``vllm-disagg proxy --ttft-slo-s`` etc. are these fields).
    The defaults describe a mid-size model (Llama-3-8B class) on one modern GPU; calibration replaces
    the prefill and decode numbers after a few requests, and the cluster view's own KV geometry and link bandwidth
    replace ``kv_bytes_per_token`` and ``link_bytes_per_s`` whenever it reports them.
    """

    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    prefill_tokens_per_s: float = 12_000.0  # starting prefill rate (uncached tokens/s)
    prefill_overhead_s: float = (
        0.005  # starting per-request constant (scheduling, HTTP): does not occupy the GPU
    )
    decode_step_s: float = 0.03  # starting decode step with an empty KV cache (fitted online)
    # starting growth of the decode step per stream in the batch (fitted online from TPOT against the streams a
    # request joined; 0 turns the crowding term off): small on a GPU, where a step reads the weights once for the
    # whole batch; large on a CPU
    decode_step_per_stream_s: float = 0.0002
    link_bytes_per_s: float = 2e9  # used when the cluster reports 0 (unknown); a conservative TCP path
    # loading KV from the tier beneath an instance (LMCache's CPU memory over PCIe; a local-disk tier is slower):
    # used when the cluster reports 0 (unknown)
    tier_bytes_per_s: float = 10e9
    kv_bytes_per_token: int = 131_072  # used when the cluster reports 0 (unknown); Llama-3-8B, bf16
    num_layers: int = 32  # layer-wise push exposes ~1/num_layers of the bytes; 1 = no overlap
    transfer_setup_s: float = 0.002  # fixed per-transfer cost (post, notification, completion)
    interference_weight: float = 1.0  # cost of one second of stall on one running stream, in seconds of TTFT
    min_transfer_tokens: int = 256  # below this many uncached tokens on the decode side, never transfer
    # the prefill line learns only from prompts with at least this many uncached tokens: a shorter one's TTFT is
    # mostly the line's constant (HTTP, tokenization, the wait for a step) and the host's contention, and read
    # through the constant it sets the slope (17 ms over 65 tokens read as 260 us a token, 3.8k tokens/s, on a host
    # that prefills 95k)
    prefill_fit_min_tokens: int = 256
    reserved_decode_streams: int = 1  # streams a dedicated decode instance is assumed to carry even when idle
    kv_saturation: float = (
        0.95  # KV usage at or above which an instance cannot be expected to admit the request
    )
    typical_uncached_tokens: int = (
        1024  # size of one queued request, for queue-wait estimates (fitted online)
    )
    # output tokens of a typical stream (fitted online): a stream that waits out a prefill once spreads the stall
    # over its tokens, which is what its TPOT (time per output token, as a goodput counts it) sees
    typical_output_tokens: int = 128
    calibration_decay: float = (
        0.9  # weight kept by the past at each observation (0.9: ~10 requests of memory)
    )
    # the same for the step's growth per stream (the hardware's and the host's, which a load does not change) and
    # the mean output the TPOT gate reads with it: read off ~10 requests the growth swung from 1.4 ms to nothing
    # within a second of a steady load, and the gate with it
    step_growth_decay: float = 0.99
    prior_weight: float = (
        1.0  # starting weight of each of the configured line's two virtual points in the fit
    )
    max_alternatives: int = 8  # alternatives recorded in Plan.alternatives
    # time constant of each instance's prefill duty (the share of recent time it spent prefilling): long enough to
    # hold roles steady between requests, short enough to follow a change of load within a few windows
    duty_window_s: float = 10.0
    # A group of "both" instances with KV connectors runs pooled or split (vllm_disagg.policy.regime): it switches
    # when more than switch_miss_share of the latest requests of the current regime missed a target (TTFT or TPOT),
    # and switch_margin more than the other regime did when last left (within memory_s); requests planned while the
    # regime left still had requests in flight are not counted; back to pooled also when pooled is
    # predicted below pool_tpot_share of tpot_slo_s; each regime held at least min_regime_s. Split, a decode
    # instance computes a prompt only as overflow (no hand-off meets the targets) or for a short uncached suffix.
    switch_miss_share: float = 0.05
    switch_margin: float = 0.1  # hysteresis: a switch needs this much more missed than the other regime did
    pool_tpot_share: float = 0.35
    min_regime_s: float = 5.0
    memory_s: float = 300.0  # how long a regime left with more misses is not re-entered
    # Enter a split only where it is predicted to miss the TTFT target with fewer requests than pooled serving is
    # missing (its one prefill instance's queue, fed the prompts worth handing off), and leave it at once where
    # those prompts exceed that instance's capacity and its requests since it was entered miss as often as pooled did
    # (vllm_disagg.policy.regime). Without it a split is tried whenever pooled requests miss, also past what one
    # prefill instance carries.
    split_ttft_gate: bool = True
    # With the gate, a split is entered only where at least this share of the latest arrivals were worth handing off,
    # and left (after the hold) where under half of it is: a split that hands off nearly nothing gives up an
    # instance's decode capacity to protect streams from a few prefills (a workload of repeated, cached prefixes).
    min_offered_share: float = 0.15
    # No split where its decode instances, carrying every stream of the group, are predicted a mean TPOT above both
    # the pooled streams' and this share of tpot_slo_s: pooled misses there are the decode capacity's, which a split
    # only makes shorter (vllm_disagg.policy.regime, "the TPOT gate").
    split_tpot_share: float = 0.6
    # Nor until its decode instances have been predicted to settle through this many seconds of arrivals: the
    # arrival rate the gate reads swings with bursts, and at the decode capacity one low reading let a split in (0:
    # no wait).
    split_settle_hold_s: float = 2.0
    # Price a prefill's stall by the output lengths of the streams it hits (``InstanceView.stall_sensitivity``,
    # ``shortest_stream``): a stream of n tokens counts typical / (n - 1) streams, and the TPOT check spreads the
    # stall over the shortest one's gaps. Off: every stream counts one, and the stall is spread over a typical
    # stream's tokens.
    length_weighted_stall: bool = True

    def __post_init__(self) -> None:
        positive = (
            "ttft_slo_s",
            "tpot_slo_s",
            "prefill_tokens_per_s",
            "decode_step_s",
            "link_bytes_per_s",
            "tier_bytes_per_s",
            "kv_bytes_per_token",
            "num_layers",
            "typical_uncached_tokens",
            "typical_output_tokens",
            "prior_weight",
            "duty_window_s",
            "switch_miss_share",
            "pool_tpot_share",
            "split_tpot_share",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModelConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "prefill_overhead_s",
            "transfer_setup_s",
            "interference_weight",
            "min_transfer_tokens",
            "prefill_fit_min_tokens",
            "reserved_decode_streams",
            "decode_step_per_stream_s",
            "max_alternatives",
            "min_regime_s",
            "memory_s",
            "switch_margin",
            "split_settle_hold_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModelConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.min_offered_share <= 1.0:
            raise ValueError(
                f"CostModelConfig.min_offered_share must be in [0, 1], got {self.min_offered_share!r}"
            )
        if not 0.0 < self.kv_saturation <= 1.0:
            raise ValueError(f"CostModelConfig.kv_saturation must be in (0, 1], got {self.kv_saturation!r}")
        if not 0.0 <= self.step_growth_decay < 1.0:
            raise ValueError(
                f"CostModelConfig.step_growth_decay must be in [0, 1), got {self.step_growth_decay!r}"
            )
        if not 0.0 <= self.calibration_decay < 1.0:
            raise ValueError(
                f"CostModelConfig.calibration_decay must be in [0, 1), got {self.calibration_decay!r}"
            )


@dataclass(slots=True)
class Estimate:
    """One candidate plan with its estimated times (seconds) and whether it meets the targets."""

    mode: Mode
    decode: str
    prefill: str | None
    queue_s: float  # waiting before the prefill starts
    prefill_s: float  # the prefill itself, on whichever instance runs it (its tier load included)
    transfer_s: float  # the exposed KV transfer tail (transfer only)
    step_s: float  # one decode step on the decode instance
    ttft_s: float
    streams: int  # streams running on the instance that computes the prompt: the plan's prefill stalls them
    tpot_penalty_s: float  # stall each of those streams absorbs
    # TPOT (time per output token over a whole stream, as a goodput counts it) expected for the worst-off stream the
    # plan touches: the new one on its decode instance, or one running where the prompt is computed
    tpot_s: float
    cost: float
    misses: tuple[str, ...] = ()  # "ttft", "tpot", "kv_full": the targets this plan is expected to miss
    tier_tokens: int = 0  # prompt tokens the computing instance loads from its KV tier instead of computing
    tier_s: float = 0.0  # the time that load takes (part of prefill_s)
    later_s: float = 0.0  # what the new stream is expected to lose to later prefills on its decode instance
    crowd_s: float = (
        0.0  # what joining the decode instance's batch costs the new stream and the streams there
    )

    @property
    def meets_slo(self) -> bool:
        return not self.misses

    @property
    def label(self) -> str:
        return (
            f"transfer({self.prefill}->{self.decode})"
            if self.mode == "transfer"
            else f"{self.mode}({self.decode})"
        )

    def describe(self) -> str:
        """One entry of ``Plan.alternatives``."""
        s = f"{self.label}: ttft={self.ttft_s:.3f}s tpot_penalty={self.tpot_penalty_s:.3f}s cost={self.cost:.3f}"
        if self.later_s:
            s += f" later={self.later_s:.3f}s"
        if self.crowd_s:
            s += f" crowd={self.crowd_s:.3f}s"
        if self.tier_tokens:
            s += f" tier={self.tier_tokens}tok/{self.tier_s:.3f}s"
        return s + (f" miss={'+'.join(self.misses)}" if self.misses else "")

    def rank(self) -> tuple[bool, float, float, int, str, str]:
        """Sort key: plans meeting the targets first, then the cheapest, then deterministic tie-breaks."""
        return (
            not self.meets_slo,
            self.cost,
            self.ttft_s,
            _MODE_ORDER[self.mode],
            self.decode,
            self.prefill or "",
        )


class Alternatives(Sequence[str]):
    """``Plan.alternatives`` of a cost-model plan: the runners-up, described only when someone reads them (a log
    line or the admin API), not on every request."""

    __slots__ = ("_head", "_estimates", "_text")

    def __init__(self, head: str, estimates: list[Estimate]) -> None:
        self._head = head
        self._estimates = estimates
        self._text: tuple[str, ...] | None = None

    def _rendered(self) -> tuple[str, ...]:
        if self._text is None:
            described = tuple(e.describe() for e in self._estimates)
            self._text = (self._head, *described) if self._head else described
        return self._text

    def __len__(self) -> int:
        return len(self._estimates) + (1 if self._head else 0)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return self._rendered()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self._rendered() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._rendered())

    def __repr__(self) -> str:
        return repr(self._rendered())


def missing(request: RequestView, inst: InstanceView) -> int:
    """Prompt tokens not in ``inst``'s own cache: what a transfer must bring it (a P/D load bypasses its tier)."""
    return max(request.prompt_tokens - max(inst.cached_tokens, 0), 0)


def tier_hit(request: RequestView, inst: InstanceView) -> int:
    """Prompt tokens ``inst`` would load from the KV tier beneath it when it prefills the prompt itself."""
    return min(max(inst.tier_tokens, 0), missing(request, inst))


def uncached(request: RequestView, inst: InstanceView) -> int:
    """Prompt tokens ``inst`` would compute if it prefilled the prompt itself (its cache and its tier hold the rest)."""
    return missing(request, inst) - tier_hit(request, inst)


def can_pair(p: InstanceView, d: InstanceView) -> bool:
    """Whether a transfer from ``p`` to ``d`` is a candidate (see ``transfer_pairs``)."""
    if p.id == d.id:
        return False
    return not (p.role == "both" and d.role == "both") or (p.kv_connector and d.kv_connector)


def has_pair(cluster: ClusterView) -> bool:
    """Whether any usable (prefill, decode) pair exists, without listing them."""
    return any(can_pair(p, d) for d in cluster.decode for p in cluster.prefill)


def transfer_pairs(cluster: ClusterView) -> list[tuple[InstanceView, InstanceView]]:
    """Usable (prefill, decode) pairs, sorted by ids.

    Two instances of role "both" make a pair only when both run a KV connector (``InstanceView.kv_connector``): a
    colocated deployment need not run one. With it, either can prefill for the other.
    """
    pairs = [(p, d) for p in cluster.prefill for d in cluster.decode if can_pair(p, d)]
    return sorted(pairs, key=lambda pd: (pd[0].id, pd[1].id))


def no_pair_reason(cluster: ClusterView) -> str:
    """Why there is no usable pair: "no_pair" in a colocated deployment (only "both" instances), else "no_prefill"."""
    return "no_pair" if all(i.role == "both" for i in cluster.instances) else "no_prefill"


def local_plan(inst: InstanceView, reason: str) -> Plan:
    """Serve on one instance: ``recompute`` on a decode instance, ``colocated`` on one whose role is "both"."""
    return Plan.colocated(inst.id, reason) if inst.role == "both" else Plan.recompute(inst.id, reason)


class _EwLine:
    """Exponentially weighted least squares of y = a + b·x, starting from a prior line.

    The prior is two virtual points on the configured line, at ``x_lo`` and ``x_hi``, decaying like the
    observations but never below 1% of their starting weight: enough to keep the 2×2 system well posed when every
    observation has the same x, too little to bias a fit that has data.

    With ``pivot`` the point at ``x_hi`` (which carries the configured slope) is dropped at the first observation,
    and the one at ``x_lo`` = 0 (the configured constant) is the only prior left: observations that share one x
    then give the line through the configured constant and their level, and spread observations set both terms
    within a few. That is the prefill line's case: the constant (HTTP, scheduling) is about the same on any
    hardware, the per-token rate is not (a CPU is 100x slower than the default), and a benchmark's prompts often
    have one length. Kept, the configured slope's far point tilts such a fit to a slope of nothing, and the
    constant takes all the time: a line that says a prompt occupies no instance and stalls no stream.
    """

    __slots__ = ("decay", "x_lo", "y_lo", "x_hi", "y_hi", "w_lo", "w_hi", "prior_floor", "pivot",
                 "sw", "sx", "sy", "sxx", "sxy", "a", "b")  # fmt: skip

    def __init__(
        self,
        a: float,
        b: float,
        prior_weight: float,
        decay: float,
        x_lo: float,
        x_hi: float,
        pivot: bool = False,
    ) -> None:
        self.decay = decay
        # the prior's two virtual points and their weights
        self.x_lo, self.y_lo, self.x_hi, self.y_hi = x_lo, a + b * x_lo, x_hi, a + b * x_hi
        self.w_lo = self.w_hi = prior_weight
        self.prior_floor = prior_weight * 0.01
        self.pivot = pivot
        # Σw, Σwx, Σwy, Σwx², Σwxy of the observations
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.a, self.b = a, b

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.sw = ow = self.sw * d + 1.0
        self.sx = ox = self.sx * d + x
        self.sy = oy = self.sy * d + y
        self.sxx = oxx = self.sxx * d + x * x
        self.sxy = oxy = self.sxy * d + x * y
        floor = self.prior_floor
        self.w_lo = lo = max(self.w_lo * d, floor)
        self.w_hi = hi = 0.0 if self.pivot else max(self.w_hi * d, floor)
        px, py = self.x_lo, self.y_lo
        w, sx, sy, sxx, sxy = ow + lo, ox + lo * px, oy + lo * py, oxx + lo * px * px, oxy + lo * px * py
        px, py = self.x_hi, self.y_hi
        w, sx, sy, sxx, sxy = w + hi, sx + hi * px, sy + hi * py, sxx + hi * px * px, sxy + hi * px * py
        det = w * sxx - sx * sx
        if det <= 0.0:  # every point at one x (only with ``pivot``, observations at x_lo): no slope to fit
            return
        b = (w * sxy - sx * sy) / det
        a = (sy - b * sx) / w
        if a < 0.0:
            # no negative overhead: refit through the origin, on the observations alone when there are some (the
            # prior's far point would otherwise set the slope whenever they all share one x)
            qxx, qxy = (oxx, oxy) if oxx > 0 else (sxx, sxy)
            a, b = 0.0, qxy / qxx
        self.a, self.b = a, max(b, 1e-12)


class _Planned(NamedTuple):
    """What calibration needs to remember of a request's plan until its outcome arrives."""

    load_factor: float = (
        1.0  # the decode instance's (1 + kv_usage) when planned: normalises its observed TPOT
    )
    # served where it had no queue ahead: its TTFT is its prefill, with the steps it shared with the streams there
    # (the stall they see)
    unqueued_local: bool = False
    split: bool | None = None  # planned under a split (True) or pooled (False) regime; None: no regime
    at: float | None = None  # the view's clock when planned
    tail_s: float = 0.0  # the transfer's estimated exposed tail (part of a measured prefill leg)
    batch: int = 0  # streams on the decode instance when planned, the new one included (0: unknown)
    duty: float = 0.0  # the decode instance's prefill duty when planned (its TPOT is ~ step / (1 - duty))
    behind: bool = (
        False  # sent while the computing instance was still predicted busy with prompts sent before
    )
    judged: bool = True  # counts toward its regime's miss share: no request of the regime left was in flight
    # the decode instance's running streams summed over the plans made so far, and how many: the batch a stream saw
    # over its life is the mean of the samples taken while it ran (plans arrive at random, so they sample time)
    seen: tuple[float, int] = (0.0, 0)


_UNPLANNED = _Planned()


class _InstanceTerms:
    """What ``CostModel.estimate`` reads of one instance for one request, computed once per plan: an instance is
    in up to P + 1 candidate plans, and these terms do not depend on the plan."""

    __slots__ = ("inst", "missing", "tier_tokens", "tier_s", "uncached", "prefill_s", "queue_s", "step_s",
                 "streams", "stalled", "gaps", "batch", "queued", "duty", "kv_full")  # fmt: skip

    def __init__(self, model: CostModel, terms: _Terms, inst: InstanceView) -> None:
        self.inst = inst
        self.missing = m = missing(terms.request, inst)
        self.tier_tokens = tier = min(max(inst.tier_tokens, 0), m)
        self.tier_s = tier_s = (
            tier * terms.kv_bytes / terms.tier_bytes_per_s + terms.transfer_setup_s if tier else 0.0
        )
        self.uncached = u = m - tier
        self.prefill_s = model.prefill_time(u) + tier_s
        role = inst.role
        backlog = max(inst.in_flight, inst.waiting + inst.running) if role == "prefill" else inst.waiting
        self.queue_s = max(backlog, 0) * terms.typical_s
        self.step_s = terms.decode_step_s * (1.0 + min(max(inst.kv_usage, 0.0), 1.0))
        if role == "prefill":
            batch = queued = streams = 0
        else:
            # the streams a new one would join here, itself not counted (``running``: requests past their first
            # token; a prompt being computed, a transfer's prefill leg among them, is still waiting: InstanceView)
            batch = max(inst.running, 0)
            # prompts queued or being computed there: streams beside the new one by the time it decodes (crowding)
            queued = max(inst.waiting, 0)
            # with the floor a dedicated decode instance is assumed to carry, for the stall its prefill would cause
            streams = max(batch, terms.reserved_decode_streams) if role == "decode" else batch
        self.batch, self.queued, self.streams = batch, queued, streams
        # what a stall there costs its streams in TPOT, in streams of the typical length: a stream of n output
        # tokens counts typical / (n - 1) where its length is known, 1 where it is not; and the output gaps of the
        # stream a stall hurts most (its shortest), over which that stream spreads the stall
        known = min(max(inst.known_streams, 0), batch) if terms.length_weighted_stall else 0
        unknown = streams - known
        typical = terms.typical_output
        sensitivity = max(inst.stall_sensitivity, 0.0) if known else 0.0
        self.stalled = unknown + typical * sensitivity
        self.gaps = typical
        if known and inst.shortest_stream > 0:
            shortest = max(inst.shortest_stream - 1, 1)
            self.gaps = min(typical, shortest) if unknown else shortest
        self.duty = terms.pooled_duty if terms.pooled_duty is not None else model.duty(inst.id, terms.now_s)
        self.kv_full = inst.kv_usage >= terms.kv_saturation


class _Terms:
    """The per-plan constants of ``CostModel.estimate`` and each instance's terms, computed on first use."""

    __slots__ = ("model", "request", "now_s", "c1", "typical_s", "typical_output", "kv_bytes",
                 "tier_bytes_per_s", "link_bytes_per_s", "step_per_stream_s", "pooled_duty", "_by_id",
                 "decode_step_s", "transfer_setup_s", "reserved_decode_streams", "length_weighted_stall",
                 "kv_saturation")  # fmt: skip

    def __init__(
        self, model: CostModel, request: RequestView, cluster: ClusterView, regime: Decision | None = None
    ) -> None:
        cfg = model.config
        self.model = model
        self.request = request
        self.now_s = cluster.now_s
        self.c1 = model.prefill_s_per_token
        self.decode_step_s = model.decode_step_s
        self.transfer_setup_s = cfg.transfer_setup_s
        self.reserved_decode_streams = cfg.reserved_decode_streams
        self.length_weighted_stall = cfg.length_weighted_stall
        self.kv_saturation = cfg.kv_saturation
        self.typical_s = model.prefill_time(model.typical_uncached_tokens)
        self.typical_output = max(model.typical_output_tokens, 1.0)
        self.kv_bytes = cluster.kv_bytes_per_token or cfg.kv_bytes_per_token
        self.tier_bytes_per_s = cluster.tier_bytes_per_s or cfg.tier_bytes_per_s
        self.link_bytes_per_s = cluster.link_bytes_per_s or cfg.link_bytes_per_s
        self.step_per_stream_s = model.step_per_stream_s
        # Pooled, every instance computes its own share of the prompts: each one's prefill duty is the group's mean,
        # not its own history (a split just left, or prompts that went where few streams ran, would otherwise keep
        # the streams away from the instance that did the prefills: a split without the hand-off, which crowds every
        # stream onto the other instances)
        self.pooled_duty: float | None = None
        if regime is not None and not regime.split and cluster.decode:
            self.pooled_duty = model.mean_duty(cluster.decode, cluster.now_s)
        self._by_id: dict[str, _InstanceTerms] = {}

    def computed(self, instance_id: str) -> _InstanceTerms:
        """The terms already computed for an instance of this plan's candidates."""
        return self._by_id[instance_id]

    def of_instance(self, inst: InstanceView) -> _InstanceTerms:
        t = self._by_id.get(inst.id)
        if t is None or t.inst is not inst:
            t = self._by_id[inst.id] = _InstanceTerms(self.model, self, inst)
        return t


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy of one's own may extend the default one
class CostModel:
    """The default policy: estimate every candidate plan's TTFT and stall cost, take the best that meets targets.

    ``plan`` raises ``NoRoute`` when no healthy instance can decode. ``observe`` calibrates the prefill line and
    the decode step from finished requests.
    """

    def __init__(self, config: CostModelConfig | None = None, **overrides: float) -> None:
        cfg = config or CostModelConfig()
        if overrides:
            known = {f.name for f in fields(CostModelConfig)}
            unknown = sorted(set(overrides) - known)
            if unknown:
                raise TypeError(f"unknown CostModel option(s) {unknown}; known: {sorted(known)}")
            cfg = replace(cfg, **overrides)  # type: ignore[arg-type]
        self.config = cfg
        self._prefill = _EwLine(
            cfg.prefill_overhead_s,
            1.0 / cfg.prefill_tokens_per_s,
            cfg.prior_weight,
            cfg.calibration_decay,
            x_lo=0.0,
            x_hi=max(4 * cfg.typical_uncached_tokens, 4096),
            pivot=True,
        )
        self.decode_step_s = cfg.decode_step_s
        # the decode step (TPOT over the load factor) against the batch a request joined: only its slope is used
        self._batch = _EwLine(
            cfg.decode_step_s,
            cfg.decode_step_per_stream_s,
            cfg.prior_weight,
            cfg.step_growth_decay,
            x_lo=1,
            x_hi=64,
        )
        # The step of a stream decoding alone, as measured (streams whose lived batch was one: each step only its
        # own), and the batch the latest streams lived in, at the decode step's own memory: the TPOT gate reads the
        # step's growth per stream off the two where the fit reads less (``gate_growth``). None: none seen yet.
        self.alone_step_s: float | None = None
        self._lived_mean = 1.0
        self.typical_uncached_tokens = float(cfg.typical_uncached_tokens)
        self.typical_output_tokens = float(cfg.typical_output_tokens)
        # the same over the memory of the step's growth (the TPOT gate's decode load, ``regime_tpots``)
        self.mean_output_tokens = float(cfg.typical_output_tokens)
        self._planned: dict[str, _Planned] = {}  # request id -> what calibration needs from its plan
        self._recent: dict[
            str, collections.deque[float]
        ] = {}  # instance -> when prompts were last sent there
        # instance -> when the prompts sent there are predicted computed (each sent prompt adds its fitted prefill)
        self._busy_until: dict[str, float] = {}
        self._regime = Regime(
            RegimeConfig(
                switch_miss_share=cfg.switch_miss_share,
                switch_margin=cfg.switch_margin,
                pool_tpot_share=cfg.pool_tpot_share,
                min_regime_s=cfg.min_regime_s,
                memory_s=cfg.memory_s,
                window_s=cfg.duty_window_s,
                ttft_gate=cfg.split_ttft_gate,
                min_offered_share=cfg.min_offered_share,
                split_tpot_share=cfg.split_tpot_share,
                gate_hold_s=cfg.split_settle_hold_s,
            ),
            cfg.ttft_slo_s,
            cfg.tpot_slo_s,
            cfg.calibration_decay,
        )
        self._duty: dict[str, DecayedRate] = {}  # instance id -> its prefill seconds per second
        # instance id -> (its running streams summed over every plan, plans): see ``_batch_lived``
        self._running_seen: dict[str, tuple[float, int]] = {}
        # the regime of the latest plan; the requests planned under the one before it still in flight, and until
        # when a request planned beside them is not judged (``_judged``)
        self._split: bool | None = None
        self._carried: set[str] = set()
        self._carried_until = -math.inf

    # -- the fitted parameters ---------------------------------------------------------------------------------

    @property
    def step_per_stream_s(self) -> float:
        """The fitted growth of a decode step per stream in the batch (0 when configured 0: no crowding term)."""
        return self._batch.b if self.config.decode_step_per_stream_s > 0 else 0.0

    @property
    def prefill_overhead_s(self) -> float:
        return self._prefill.a

    @property
    def prefill_s_per_token(self) -> float:
        return self._prefill.b

    def prefill_time(self, tokens: int | float) -> float:
        """Fitted prefill duration of ``tokens`` uncached tokens (at least one token is always computed)."""
        return self._prefill.a + self._prefill.b * max(tokens, 1)

    # -- the cost function: the only place where time and cost are estimated ----------------------------------

    def estimate(
        self,
        request: RequestView,
        cluster: ClusterView,
        mode: Mode,
        decode: InstanceView,
        prefill: InstanceView | None = None,
    ) -> Estimate:
        """Estimate one candidate plan. All of the policy's arithmetic is here.

        With n = prompt tokens, m(X) = n − X.cached_tokens (missing from X's own cache), t(X) = min(X.tier_tokens,
        m(X)) (of those, held by the KV tier beneath X), u(X) = m(X) − t(X) (computed), c0 + c1·u the fitted prefill
        line, step the fitted decode step, ū the typical uncached size of one queued request, and C the instance
        that computes the prompt (P for a transfer, else D):

            ld(X)     = t(X) · kv_bytes_per_token / tier_bytes_per_s + transfer_setup_s   (0 when t(X) = 0)
            pf(X)     = c0 + c1·max(u(X), 1) + ld(X)      a tier hit costs a load, not a prefill
            q(X)      = backlog(X) · (c0 + c1·ū)      backlog = max(in_flight, waiting + running) on a prefill-role
                                                      instance (everything there is a prefill), else waiting
            st(X)     = step · (1 + X.kv_usage)        decode is memory-bound: more resident KV, slower steps
            streams(X)= max(X.running, reserved_decode_streams if X.role == "decode"),
                        0 for a prefill-role X (nothing decodes there)
            duty(X)   = the share of recent time X spent prefilling what this policy sent it (an exponentially
                        decayed sum of planned pf over duty_window_s; 0 without a clock in the view), at most 0.9

            transfer(P, D):
                wire  = m(D) · kv_bytes_per_token / link_bytes_per_s      (D loads all it misses from P)
                tail  = max(wire / num_layers, wire − pf(P)) + transfer_setup_s    (layer-wise push: one layer's
                        share is exposed, unless the link is slower than the prefill)
                ttft  = max(q(P), q(D)) + pf(P) + tail + st(D)                  (both queues drain in parallel)
            recompute(D) / colocated(D):
                ttft  = q(D) + pf(D)

            stall     = c1·max(u(C), 1) if streams(C) > 0 else 0   (each stream running on C waits ~the prefill's
                        compute; c0 is per-request overhead that does not occupy the engine)
            later     = max_tokens · st(D) · duty(D) / (1 − duty(D))   (what the new stream itself will lose to the
                        prefills D keeps doing while it decodes)
            crowd     = 2 · max_tokens · s · (b(D) + w(D))   (b(D) the streams running on D, without the reserved
                        floor, and w(D) the prompts queued or being computed there, which are streams by the time
                        the new one decodes; s the fitted growth of a step per stream in the batch: the new stream's
                        steps are s · (b + w) longer, and each stream there is slowed by s for ~max_tokens steps)
            k(X)      = the streams on X in streams of a typical length, for what a stall costs them: o ·
                        Σ 1/(n − 1) over those whose output length n is known (X.stall_sensitivity), plus one per
                        stream of unknown length, o being the fitted typical output tokens of a stream (a stall of
                        s seconds adds s/(n − 1) to the TPOT of a stream of n tokens: a long prefill that a
                        stream of 1,000 tokens hardly notices pushes one of 16 past a TPOT target)
            g(X)      = the output gaps of the stream on X a stall hurts most: its shortest stream's n − 1 where
                        lengths are known, o where none is, the smaller of the two where both kinds run
            tpot      = max(st(D) / (1 − duty(D)), st(C) / (1 − duty(C)) + stall / g(C) if streams(C) > 0)   (the
                        TPOT of the worst-off stream: the new one on D, or one on C that waits out this prefill
                        once, the stall spread over its output gaps; a TPOT target is a mean over the stream, as a
                        goodput counts it, not a bound on each gap)
            cost      = ttft + interference_weight · (k(C) · stall + later + crowd)
            misses: "ttft" if ttft > ttft_slo_s; "tpot" if tpot > tpot_slo_s;
                    "kv_full" if kv_usage ≥ kv_saturation on any instance the plan uses

        On two "both" instances this makes roles emerge from load: streams gather where little prefill runs, and
        prefills go where few streams would be stalled, so a transfer wins once one instance's prefill duty or
        stream count makes serving there cost more than the hand-off. ``crowd`` keeps streams from gathering past
        what the batch's step growth makes worth it (without it, short streams all went where no long prompt
        ran and long prompts all went to the other instance: a split without the hand-off).
        """
        terms = _Terms(self, request, cluster)
        return self._estimate(
            terms, mode, terms.of_instance(decode), terms.of_instance(prefill) if prefill else None
        )

    def _estimate(self, terms: _Terms, mode: Mode, d: _InstanceTerms, p: _InstanceTerms | None) -> Estimate:
        """``estimate`` over terms computed once per instance per plan (see ``_InstanceTerms``)."""
        cfg = self.config
        step = d.step_s
        if mode == "transfer":
            if p is None:
                raise ValueError("a transfer estimate needs a prefill instance")
            computing = p
            pf = p.prefill_s
            wire = d.missing * terms.kv_bytes / terms.link_bytes_per_s
            tail = max(wire / cfg.num_layers, wire - pf) + cfg.transfer_setup_s
            q = max(p.queue_s, d.queue_s)
            ttft = q + pf + tail + step
            kv_full = p.kv_full or d.kv_full
            prefill_id: str | None = p.inst.id
        else:
            computing = d
            pf = d.prefill_s
            tail = 0.0
            q = d.queue_s
            ttft = q + pf
            kv_full = d.kv_full
            prefill_id = None
        streams = computing.streams
        stall = terms.c1 * max(computing.uncached, 1) if streams > 0 else 0.0
        duty = d.duty
        later = terms.request.max_tokens * step * duty / (1.0 - duty)
        crowd = 2.0 * terms.request.max_tokens * terms.step_per_stream_s * (d.batch + d.queued)
        tpot = step / (1.0 - duty)
        if streams:
            tpot = max(tpot, computing.step_s / (1.0 - computing.duty) + stall / computing.gaps)
        cost = ttft + cfg.interference_weight * (computing.stalled * stall + later + crowd)
        misses: tuple[str, ...] = ()
        if ttft > cfg.ttft_slo_s or tpot > cfg.tpot_slo_s or kv_full:
            misses = tuple(
                name
                for name, missed in (
                    ("ttft", ttft > cfg.ttft_slo_s),
                    ("tpot", tpot > cfg.tpot_slo_s),
                    ("kv_full", kv_full),
                )
                if missed
            )
        return Estimate(
            mode, d.inst.id, prefill_id, q, pf, tail, step, ttft, streams, stall, tpot, cost, misses,
            computing.tier_tokens, computing.tier_s, later, crowd,
        )  # fmt: skip

    def _book(self, instance_id: str, now_s: float | None, prefill_s: float) -> bool:
        """Book a prompt's fitted prefill on the instance it is sent to; whether prompts sent there before were
        still predicted to be computing (the view's queue counts only prompts not yet started)."""
        if now_s is None:
            return False
        until = self._busy_until.get(instance_id, now_s)
        self._busy_until[instance_id] = max(until, now_s) + prefill_s
        return until > now_s

    def _shared(self, instance_id: str, start: float, end: float) -> bool:
        """Whether another prompt was sent to the instance close enough to one sent at ``start`` and done at ``end``
        to share its iterations or queue ahead of it (sent within its duration before it, or before it ended)."""
        lo = start - (end - start)
        return any(lo <= t <= end and t != start for t in self._recent.get(instance_id, ()))

    # -- prefill duty: how much of each instance's recent time went to prefills this policy sent it -------------

    def duty(self, instance_id: str, now_s: float | None) -> float:
        """The instance's recent prefill duty (0..MAX_DUTY) at ``now_s``; 0 without a clock."""
        acc = self._duty.get(instance_id)
        if now_s is None or acc is None:
            return 0.0
        return min(acc(now_s), MAX_DUTY)

    def mean_duty(self, instances: Sequence[InstanceView], now_s: float | None) -> float:
        """The instances' mean prefill duty: each one's under pooled serving, where all compute their share."""
        return sum(self.duty(i.id, now_s) for i in instances) / len(instances)

    def _add_duty(self, instance_id: str, now_s: float | None, prefill_s: float) -> None:
        if now_s is None:
            return
        acc = self._duty.get(instance_id)
        if acc is None:
            acc = self._duty[instance_id] = DecayedRate(self.config.duty_window_s)
        acc.add(now_s, prefill_s)

    # -- candidates and the decision ---------------------------------------------------------------------------

    def estimates(
        self, request: RequestView, cluster: ClusterView, regime: Decision | None = None
    ) -> list[Estimate]:
        """Every candidate plan, best first.

        Candidates: transfer(P, D) for every usable pair whose decode side misses at least ``min_transfer_tokens``
        in its own cache (moving less is not worth the setup and a whole prefill elsewhere; what D's tier holds still
        counts as missing, since loading it is priced, not free), and serving locally on every healthy
        decode-capable instance (recompute on a decode instance, colocated on a "both" one).

        A ``regime`` narrows them for a group of "both" instances (``vllm_disagg.policy.regime``): pooled, only
        local plans; split, transfers from its prefill instances to the others and local plans on the others, the
        hand-offs (and local plans for a short uncached suffix, on a prefill instance too where the prompt is long
        and its prefix cached there) first unless only a local plan meets the targets (overflow). When the
        narrowing leaves nothing (instances gone meanwhile), every candidate stays.
        """
        return self._ranked(_Terms(self, request, cluster, regime), cluster, regime)

    def _ranked(self, terms: _Terms, cluster: ClusterView, regime: Decision | None) -> list[Estimate]:
        """``estimates`` over terms the caller keeps (``plan`` reads the chosen decode instance's from them)."""
        request = terms.request
        of = terms.of_instance
        decodes = [d for d in cluster.decode if of(d).missing >= self.config.min_transfer_tokens]
        long_on = {d.id for d in decodes}
        transfers = [
            self._estimate(terms, "transfer", of(d), of(p))
            for p in (self.prefill_candidates(request, cluster) if decodes else ())
            for d in decodes
            if can_pair(p, d)
        ]
        local = [
            self._estimate(terms, "colocated" if inst.role == "both" else "recompute", of(inst), None)
            for inst in cluster.decode
        ]
        out = transfers + local
        if regime is not None:
            split = set(regime.prefill)
            if not split:
                out = local or out
            else:
                # Split, a decode instance computes a prompt only when no hand-off meets the targets (the prefill
                # instance is backed up: overflow), or when it holds all but a short suffix of it (nothing worth
                # handing off). A hand-off that meets them wins over a local plan that also does: the TTFT target
                # has room for the wait, and the streams a local prefill would stall do not (they are what the
                # split protects). When no hand-off meets them, a decode instance computes the prompt where that
                # keeps a target the best hand-off misses and misses none it keeps (the prefill instance's queue
                # has passed the TTFT target, and the decode instance's streams can take a prefill); otherwise it
                # is still handed off: a local prefill would add to the decode instance's prefill duty, which is
                # what made the hand-off miss its TPOT. A long prompt whose prefix a prefill instance holds may
                # also be served there: only its short suffix is computed, and sending every such prompt to the
                # decode instances (a workload of repeated prefixes, where all of them are cached everywhere) would
                # leave the prefill instance idle and put the whole load on the others.
                long_prompt = request.prompt_tokens >= self.config.min_transfer_tokens
                preferred = [e for e in transfers if e.prefill in split and e.decode not in split]
                preferred += [
                    e for e in local if e.decode not in long_on and (e.decode not in split or long_prompt)
                ]
                overflow = [e for e in local if e.decode not in split and e.decode in long_on]
                if preferred and not any(e.meets_slo for e in preferred):
                    handed = set(min(preferred, key=Estimate.rank).misses)
                    keeps = [e for e in overflow if set(e.misses) < handed]
                    rest = [e for e in overflow if not set(e.misses) < handed]
                    return (
                        sorted(keeps, key=Estimate.rank)
                        + sorted(preferred, key=Estimate.rank)
                        + sorted(rest, key=Estimate.rank)
                    )
                if preferred:
                    return sorted(preferred, key=Estimate.rank) + sorted(overflow, key=Estimate.rank)
                out = overflow or out
        return sorted(out, key=Estimate.rank)

    def prefill_candidates(self, request: RequestView, cluster: ClusterView) -> list[InstanceView]:
        """The prefill instances worth pairing: those no other prefill beats on every term that depends on it.

        A transfer's estimate depends on its prefill P only through P's queue q(P), its prefill time pf(P) (tier
        load included) and whether P is past KV saturation; TTFT grows with both times for any decode D, and a
        saturated P only adds a miss. So a P that another matches or beats on all three is never the best for any
        D: only the Pareto front is paired, plus the front of the rest (where each D's runner-up, the plan's backup
        prefill, is). Planning costs O(front x D) estimates instead of O(P x D); the fronts are a few instances
        in practice (all of them only when queues and prompt caches trade off perfectly)."""
        prefill = [p for p in cluster.prefill if any(can_pair(p, d) for d in cluster.decode)]
        if len(prefill) <= 2:
            return prefill
        typical = self.prefill_time(self.typical_uncached_tokens)
        kv_bytes = cluster.kv_bytes_per_token or self.config.kv_bytes_per_token
        tier_bw = cluster.tier_bytes_per_s or self.config.tier_bytes_per_s
        sat = self.config.kv_saturation

        def terms(p: InstanceView) -> tuple[bool, float, float]:
            backlog = max(p.in_flight, p.waiting + p.running) if p.role == "prefill" else p.waiting
            t = tier_hit(request, p)
            load = t * kv_bytes / tier_bw + self.config.transfer_setup_s if t else 0.0
            return (
                p.kv_usage >= sat,
                max(backlog, 0) * typical,
                self.prefill_time(uncached(request, p)) + load,
            )

        # Sorted by (terms, id): whatever dominates a point comes before it. Equal terms: the lower id dominates
        # (the ranking's own tie-break), so identical idle instances do not all stay.
        scored = sorted(((terms(p), p) for p in prefill), key=lambda tp: (tp[0], tp[1].id))

        def front(
            points: list[tuple[tuple[bool, float, float], InstanceView]],
        ) -> tuple[list[int], list[int]]:
            kept: list[int] = []
            rest: list[int] = []
            for i, (t, _) in enumerate(points):
                dominated = any(
                    points[j][0][0] <= t[0] and points[j][0][1] <= t[1] and points[j][0][2] <= t[2]
                    for j in kept
                )
                (rest if dominated else kept).append(i)
            return kept, rest

        first, rest = front(scored)
        remainder = [scored[i] for i in rest]
        second, _ = front(remainder)
        # The second layer holds each decode's runner-up prefill (the plan's backup) when the best one is taken.
        chosen = [scored[i][1] for i in first] + [remainder[i][1] for i in second]
        return sorted(chosen, key=lambda p: p.id)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        regime = self.regime_for(cluster)
        terms = _Terms(self, request, cluster, regime)
        ranked = self._ranked(terms, cluster, regime)
        if not ranked:
            raise NoRoute("no healthy instance can decode")
        best = ranked[0]
        if regime is None:
            reason = self._reason(request, cluster, best, ranked)
        else:  # the regime decided the mode; within a split, a local plan is a short suffix or overflow
            why = (
                "pooled"
                if not regime.split
                else "split"
                if best.mode == "transfer"
                else "split,overflow"
                if terms.computed(best.decode).missing >= self.config.min_transfer_tokens
                else "split,short_uncached_suffix"
            )
            reason = why if best.meets_slo else why + ",slo_miss"
        head = ""
        if regime is not None:
            head = (
                f"regime: {'split ' + '+'.join(regime.prefill) if regime.split else 'pooled'} ({regime.why})"
            )
        rest = Alternatives(head, ranked[1 : 1 + self.config.max_alternatives])
        if len(self._planned) >= _MAX_PENDING:  # outcomes that never come must not grow memory
            oldest = next(iter(self._planned))
            del self._planned[oldest]
            self._carried.discard(oldest)
        judged = self._judged(regime, cluster.now_s)
        # a local prefill with no queue ahead: its TTFT is the prefill itself, in steps shared with the streams there
        # (what they wait for while it runs). Only "no stream beside it" would leave no sample under a steady load,
        # and the line at its configured rate (a GPU's, 8x too slow for a CPU host's tiny model)
        unqueued_local = best.mode != "transfer" and best.queue_s == 0 and not best.tier_tokens
        self._sample_running(cluster)
        sent_to = best.prefill or best.decode
        behind = self._book(sent_to, cluster.now_s, best.prefill_s)
        self._planned[request.request_id] = _Planned(
            load_factor=best.step_s / self.decode_step_s,
            unqueued_local=unqueued_local,
            split=None if regime is None else regime.split,
            at=cluster.now_s,
            tail_s=best.transfer_s,
            batch=terms.computed(best.decode).batch + 1,
            duty=terms.computed(best.decode).duty,
            behind=behind,
            judged=judged,
            seen=self._running_seen.get(best.decode, (0.0, 0)),
        )
        if cluster.now_s is not None:
            recent = self._recent.get(sent_to)
            if recent is None:
                recent = self._recent[sent_to] = collections.deque(maxlen=64)
            recent.append(cluster.now_s)
        # the prompt's compute occupies the instance; the line's constant (HTTP, scheduling) does not
        self._add_duty(best.prefill or best.decode, cluster.now_s, max(best.prefill_s - self._prefill.a, 0.0))
        if regime is not None and cluster.now_s is not None and self.config.split_ttft_gate:
            # what a split's prefill instance would take on: the prompt's compute, where it is cached best, if worth a
            # hand-off (the line's constant is HTTP and scheduling: it does not occupy the instance)
            least = min(terms.computed(d.id).missing for d in cluster.decode)
            if least >= self.config.min_transfer_tokens:
                self._regime.offer(cluster.now_s, least)
        if best.mode == "transfer":
            assert best.prefill is not None
            backup = next(
                (e.prefill for e in ranked[1:] if e.mode == "transfer" and e.decode == best.decode),
                None,
            )
            return Plan("transfer", best.decode, best.prefill, backup, reason, rest)
        return Plan(best.mode, best.decode, reason=reason, alternatives=rest)

    def _sample_running(self, cluster: ClusterView) -> None:
        """Add each instance's running streams to its sum of samples (see ``_batch_lived``)."""
        seen = self._running_seen
        for inst in cluster.instances:
            total, count = seen.get(inst.id, (0.0, 0))
            seen[inst.id] = (total + max(inst.running, 0), count + 1)

    def _batch_lived(self, instance_id: str, planned: _Planned) -> float:
        """The batch a finished stream decoded in: the mean of its instance's running streams over the plans made
        while it ran (at least ``LIVED_SAMPLES`` of them; else the batch it joined). The batch it joined is one
        draw of a quantity that wanders over its life: fitted against it, the step's growth per stream comes out
        diluted toward nothing (a CPU host whose step grew ~0.5 ms a stream read 0.02)."""
        total, count = self._running_seen.get(instance_id, (0.0, 0))
        then_total, then_count = planned.seen
        if count - then_count >= LIVED_SAMPLES:
            return max((total - then_total) / (count - then_count), 1.0)
        return float(planned.batch)

    def _judged(self, regime: Decision | None, now_s: float | None) -> bool:
        """Whether a request planned now will count toward its regime's miss share: not while requests planned
        under the regime just left are still in flight (their queues and stalls are the old regime's doing), for at
        most twice the regime's hold after the switch."""
        if regime is None or now_s is None:
            return True
        if self._split is not None and regime.split != self._split:
            self._carried = {rid for rid, p in self._planned.items() if p.split == self._split}
            self._carried_until = now_s + 2.0 * self.config.min_regime_s
        self._split = regime.split
        if self._carried and now_s >= self._carried_until:
            self._carried.clear()
        return not self._carried

    def regime_for(self, cluster: ClusterView) -> Decision | None:
        """The pooled/split regime when the cluster is a group of "both" instances that all run a KV connector
        (and the view has a clock); None otherwise, where every plan is a candidate."""
        if cluster.now_s is None:
            return None
        live = [i for i in cluster.instances if i.healthy]
        group = [i for i in live if i.role == "both" and i.kv_connector]
        if len(group) < 2 or len(group) != len(live):
            return None
        typical = self.typical_uncached_tokens
        return self._regime.decide(
            cluster.now_s,
            group,
            self.prefill_time(typical),
            self._prefill.b * max(typical, 1),
            overhead_s=self._prefill.a,
            s_per_token=self._prefill.b,
            tpots=self.regime_tpots(group, cluster.now_s),
        )

    def gate_growth(self) -> float:
        """The step's growth per stream as the TPOT gate reads it: the fitted growth, or where more, the growth the
        step's level says, (fitted step - step alone) / (lived batch - 1) over the latest streams.

        The fit is a regression of each stream's TPOT on the batch it lived in, and under a steady load that batch
        hardly varies: the slope can tilt to nothing for seconds (streams that ran beside more prefills at a smaller
        batch), and a gate that read it let a split in whose decode instance then missed 88% of its streams (a
        CPU host, where a stream costs ~0.5 ms a step). The level needs no variation: a step of 18 ms where one
        stream alone took 4 and the streams lived in batches of 14 grew ~1 ms a stream, whatever the slope reads.
        It is known once a stream has decoded alone (a quiet moment, or a warm-up request)."""
        fitted = self.step_per_stream_s
        alone = self.alone_step_s
        if alone is None or self._lived_mean < ALONE_BATCH:
            return fitted
        return max(fitted, (self.decode_step_s - alone) / (self._lived_mean - 1.0))

    def regime_tpots(self, group: Sequence[InstanceView], now_s: float) -> RegimeTpots:
        """The mean TPOT the group's streams are predicted to settle at pooled, and on the decode
        instances were it split 1 : n - 1, at the arrival rate now.

        A step is ``s0 + g * b`` with b streams in the batch (``g``: the growth per stream, ``gate_growth``, which
        on a CPU host also carries the stack's CPU per emitted token). Streams last their output's tokens times the
        TPOT, so an instance fed ``lam`` requests a second of ``m`` output tokens carries ``b = lam * m * TPOT`` of
        them, and settles at ``TPOT = s0 / (1 - g * lam * m)``: past ``g * lam * m >= 1`` it does not settle (every
        stream slows the others until they time out). ``s0`` is read off the fitted step (the latest requests' TPOT without
        their prefill duty) less the growth of the batch the group's instances carry now. Pooled, each instance
        takes ``lam / n`` and its prefill duty; split, each decode instance ``lam / (n - 1)`` and no prefills. The
        current streams alone would hide the spiral: a split that starts at twice the batch runs slower, holds each
        stream longer and takes on more."""
        n = len(group)
        growth = self.gate_growth()
        batch = sum(max(i.running, 0) + max(i.waiting, 0) for i in group) / n + 1.0
        base = max(self.decode_step_s - growth * batch, 0.25 * self.decode_step_s)
        # what the arrivals ask of one instance's decode capacity (at 1 it never settles): the growth times the
        # arrival rate (the regime's: decayed, or the latest arrivals' where higher, so a step up in load counts at
        # once) times a stream's mean tokens over ~100 requests (``typical_output_tokens`` follows the latest ten,
        # which a mix of 16- and 128-token streams swings by half)
        load = growth * self._regime.load(now_s) * self.mean_output_tokens
        kv = sum(min(max(i.kv_usage, 0.0), 1.0) for i in group)
        duty = self.mean_duty(group, now_s)

        def settled(share: float) -> float:
            left = 1.0 - load * share
            return base / left if left > 0.0 else math.inf

        pooled = settled(1.0 / n) * (1.0 + kv / n) / (1.0 - duty)
        split = settled(1.0 / (n - 1)) * (1.0 + min(kv / (n - 1), 1.0))
        return RegimeTpots(pooled, split, load)

    def _reason(
        self, request: RequestView, cluster: ClusterView, best: Estimate, ranked: list[Estimate]
    ) -> str:
        """A short machine-readable reason: why this mode, plus ",slo_miss" when no plan met the targets."""
        if best.mode == "transfer":
            local = next((e for e in ranked if e.mode != "transfer"), None)
            why = "protect_tpot" if local is not None and "tpot" in local.misses else "long_prompt"
            if best.tier_tokens:
                why += ",tier_hit"
        elif best.tier_tokens:
            why = "tier_hit"  # the tier beneath the serving instance holds the prefix: load it there
        elif not has_pair(cluster):
            why = no_pair_reason(cluster)
        elif missing(request, cluster.get(best.decode)) < self.config.min_transfer_tokens:
            why = "short_uncached_suffix"
        else:
            transfer = next((e for e in ranked if e.mode == "transfer"), None)
            if transfer is None:
                why = "short_uncached_suffix"
            elif transfer.queue_s >= transfer.ttft_s / 2:
                why = "prefill_overloaded"
            elif best.streams == 0:
                why = "decode_idle"
            else:
                why = "cheaper_local"
        return why if best.meets_slo else why + ",slo_miss"

    def forget_instance(self, instance_id: str) -> None:
        """An instance left the pool: drop what is kept per instance (recent sends, predicted busy time, prefill
        duty, streams seen), which would otherwise grow with every instance id ever served."""
        self._recent.pop(instance_id, None)
        self._busy_until.pop(instance_id, None)
        self._duty.pop(instance_id, None)
        self._running_seen.pop(instance_id, None)

    # -- online calibration ------------------------------------------------------------------------------------

    def observe(self, outcome: Outcome) -> None:
        """Fit the prefill line to measured prefills and the decode step to measured TPOT.

        A prefill is measured by a transfer's prefill leg, or by the TTFT of a request served on an instance that
        had nothing queued ahead of it when it was planned (with streams beside it, its TTFT is the steps that stall
        them), of a prompt with at least ``prefill_fit_min_tokens`` uncached tokens; either counts only when the
        instance was sent no other prompt before this one's prefill ended (queue time, or other work sharing its
        iterations, would otherwise count as prefill time, and the line would drift up with load), or when it took
        less than the line predicts (a sojourn is never shorter than the service: the line is too slow). A TPOT is
        divided by the load factor its decode instance had when the request was planned, so the fitted step stays
        the empty-cache step that ``estimate`` scales by the current ``kv_usage``, and multiplied by (1 - duty), the
        share of time its decode instance had left from prefills when it was planned, which ``estimate`` divides by
        again (TPOT ~ step / (1 - duty)). The step's growth per stream is fitted from the same steps against the
        batch each stream lived in (``_batch_lived``).
        """
        planned = self._planned.pop(outcome.request_id, _UNPLANNED)
        self._carried.discard(outcome.request_id)
        factor, split, at = planned.load_factor, planned.split, planned.at
        if not outcome.ok:
            return
        prefill_s = outcome.prefill_s
        if prefill_s is not None:  # the leg also pushed the KV: its exposed tail is not prefill
            prefill_s = max(prefill_s - planned.tail_s, prefill_s / 2)
        elif planned.unqueued_local and outcome.plan.mode != "transfer":
            prefill_s = outcome.ttft_s
        computing = outcome.plan.computing or outcome.plan.decode
        if (
            prefill_s is not None
            and (planned.behind or (at is not None and self._shared(computing, at, at + prefill_s)))
            and prefill_s >= self.prefill_time(outcome.uncached_tokens)
        ):
            # it shared the instance with another prompt: a sojourn, not a service time. A sojourn is never shorter
            # than the service, though, so one under the line's prediction is kept: the line is too slow. Without
            # it a prior far slower than the hardware (a GPU prefilling 3x the configured rate) predicts every
            # instance busy, every prompt is "behind", and the line never learns while serving is pooled.
            prefill_s = None
        decay = self.config.calibration_decay
        if (
            prefill_s is not None
            and prefill_s > 0
            and outcome.uncached_tokens >= max(self.config.prefill_fit_min_tokens, 1)
        ):
            self._prefill.add(float(outcome.uncached_tokens), prefill_s)
        if outcome.uncached_tokens > 0:
            self.typical_uncached_tokens = (
                decay * self.typical_uncached_tokens + (1 - decay) * outcome.uncached_tokens
            )
        if outcome.output_tokens >= 2:
            self.typical_output_tokens = (
                decay * self.typical_output_tokens + (1 - decay) * outcome.output_tokens
            )
            slow = self.config.step_growth_decay
            self.mean_output_tokens = slow * self.mean_output_tokens + (1 - slow) * outcome.output_tokens
        if outcome.ttft_s is not None and outcome.e2e_s is not None and outcome.output_tokens >= 2:
            measured = (outcome.e2e_s - outcome.ttft_s) / (outcome.output_tokens - 1)
            if split is not None and planned.judged:
                self._regime.observe(split, outcome.ttft_s, measured)
            # without the prefills' share: ``estimate`` divides the step by (1 - duty) itself, and an instance busy
            # prefilling has few streams and slow tokens, which would otherwise read as a step that shrinks with
            # its batch
            tpot = measured / factor * (1.0 - planned.duty)
            if tpot > 0:
                self.decode_step_s = decay * self.decode_step_s + (1 - decay) * tpot
                batch = self._batch_lived(outcome.plan.decode, planned)
                if batch:
                    self._batch.add(batch, tpot)
                    self._lived_mean = decay * self._lived_mean + (1 - decay) * batch
                    if batch < ALONE_BATCH:
                        alone = self.alone_step_s
                        self.alone_step_s = tpot if alone is None else decay * alone + (1 - decay) * tpot
