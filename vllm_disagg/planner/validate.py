"""Hold the simulator against a measured run: replay each point of ``benchmarks/e2e.py --profile`` and compare.

A measured point is (design, dataset, rate) with ``vllm bench serve``'s percentiles. Its replay runs the same
design (``Colocated(2)`` or ``Disaggregated(1, 1)``) on ``ProfileCost``s built from the profiles the run took of its
own instances, with the engine settings it ran, on the arrivals each run had (its send times and token counts, as
``e2e.py`` records them), or, for runs recorded without them, Poisson arrivals of the dataset's lengths at the
same rate.

What the engines do is the simulator's business; what happens around them (client, proxy hop, tokenization, the
API server, and for P/D the hand-off to the decode instance) is not. That part is taken from the run's zero-load
measurement (evenly spaced requests through the proxy, each meeting an idle cluster, and a few streams at once per
decoding instance), compared with the same requests simulated: see ``ZeroLoad``. It is calibrated without load, so everything that grows with load (queueing, batching,
interference between iterations, the per-token overhead of more streams) is still the simulator's prediction.

Pure: takes the parsed results.json and the loaded profiles; reads no files.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from vllm_disagg.planner.costmodel import ProfileCost, StepModel
from vllm_disagg.planner.engine import EngineConfig, StackCpu
from vllm_disagg.planner.hardware import Link
from vllm_disagg.planner.metrics import RequestRecord, percentile
from vllm_disagg.planner.model import ModelSpec
from vllm_disagg.planner.profiledata import DecodePoint, PrefillPoint, Profile, tokens_per_s
from vllm_disagg.planner.simulate import (
    Adaptive,
    Colocated,
    Design,
    Disaggregated,
    SimResult,
    simulate,
    simulate_rate,
)
from vllm_disagg.planner.workload import LengthDist, Request, shared_prefixes, synthetic

# The P/D pair's KV path here: plain TCP over loopback moves ~2 GB/s (docs: vllm-on-cpu reference). Its fixed
# cost is part of the zero-load calibration, so the link carries none.
LOOPBACK_TCP = Link("loopback-tcp", 2e9, 0.0)

# Datasets whose measured latency depends on something the simulator does not model.
UNMODELLED: dict[str, str] = {}

# Zero-load draws per replayed run (each simulated request draws one zero-load request's excess).
ZERO_LOAD_DRAWS = 10

# Seeds per point: enough replays that their requests total about this many (see ``predict``), at most MAX_SEEDS.
TARGET_REQUESTS = 1000
MAX_SEEDS = 20

# The least a zero-load calibration may scale the profiled prefill time by (a smaller one means a broken profile).
MIN_PREFILL_SCALE = 0.5

# Other jobs' CPU use (cores, averaged over a point) above which a measured point is flagged as disturbed.
DISTURBED_CORES = 0.1

# Share of a point's prompt tokens served from the prefix cache above which the point is flagged (see ValidationRow).
CACHE_HIT_SHARE = 0.02

METRICS = ("p50_ttft_ms", "p95_ttft_ms", "p50_tpot_ms", "p95_tpot_ms")


@dataclass(frozen=True)
class Percentiles:
    p50_ttft_ms: float
    p95_ttft_ms: float
    p50_tpot_ms: float
    p95_tpot_ms: float

    def get(self, metric: str) -> float:
        return float(getattr(self, metric))


@dataclass(frozen=True)
class CpuUse:
    """A point's CPU by role as e2e.py recorded it (medians over the repeats): per emitted token for the stack
    (each instance's API server, the proxy, the client), and each engine's share of a core over the run, beside
    each core's busy share. The replay charges the stack's CPU per emitted token (``ZeroLoad.token_overhead_s``,
    ``measured_stack_cost``); these say how much there was and whose."""

    ms_per_token: dict[str, float]  # role -> CPU ms per emitted token ("<instance>/api", "proxy", "client")
    engine_cores: dict[str, float]  # instance -> its engine's CPU seconds per second of the run
    core_busy: tuple[float, ...]  # each CPU's busy share over the run

    @property
    def stack_ms_per_token(self) -> float:
        return sum(self.ms_per_token.values())

    def describe(self) -> str:
        roles = ", ".join(f"{k} {v:.3f}" for k, v in self.ms_per_token.items())
        engines = ", ".join(f"{k} {v:.2f}" for k, v in self.engine_cores.items())
        busy = " / ".join(f"{b:.2f}" for b in self.core_busy)
        return (
            f"stack {self.stack_ms_per_token:.3f} ms CPU per emitted token ({roles}); engine processes {engines} "
            f"of a core (vLLM's CPU engine spins when idle); cores busy {busy}"
        )


def cpu_use(entries: list[dict[str, Any]]) -> CpuUse | None:
    """The medians over a point's runs of what e2e.py recorded of its CPU (None where no run recorded it)."""
    per_token: dict[str, list[float]] = {}
    engines: dict[str, list[float]] = {}
    busy: list[list[float]] = []
    for e in entries:
        cpu, bench = e.get("cpu_s"), e.get("bench", {})
        tokens = float(bench.get("total_output_tokens") or 0)
        # the span the CPU was read over (the requests' window), else the bench's duration
        duration = float(e.get("cpu_window_s") or bench.get("duration") or 0)
        if not cpu or tokens <= 0 or duration <= 0:
            continue
        for role, seconds in cpu.items():
            if role.endswith("/engine"):
                engines.setdefault(role.removesuffix("/engine"), []).append(float(seconds) / duration)
            else:
                per_token.setdefault(role, []).append(float(seconds) * 1000 / tokens)
        if e.get("core_busy"):
            busy.append([float(b) for b in e["core_busy"]])
    if not per_token:
        return None
    return CpuUse(
        {k: statistics.median(v) for k, v in sorted(per_token.items())},
        {k: statistics.median(v) for k, v in sorted(engines.items())},
        tuple(statistics.median(col) for col in zip(*busy, strict=True)) if busy else (),
    )


@dataclass(frozen=True)
class ValidationRow:
    """One measured point and its replay; ``skipped`` says why there is no prediction."""

    design: str  # as results.json names it: "pd" or "colocated"
    dataset: str
    rate: float
    measured: Percentiles | None
    predicted: Percentiles | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    seeds: int = 0
    zero_load: str = ""  # how the zero-load calibration entered (``ZeroLoad.describe``)
    load: str = ""  # the simulator's busiest pool and its utilisation
    # every simulated pool under capacity at this point (None: not replayed); an unstable point's finite-run
    # percentiles measure the run's length, so the fidelity count leaves it out
    stable: bool | None = None
    skipped: str = ""
    # cores other jobs used while the point was measured (the most of any repeat)
    foreign_cpu_cores: float | None = None
    # share of the point's requests whose stream arrived in one burst at its end (TTFT = the whole request)
    late_share: float | None = None
    repeats: int = 1  # measured runs of this point; ``measured`` is their median, metric by metric
    measured_low: Percentiles | None = None  # the lowest and highest of the repeats, metric by metric
    measured_high: Percentiles | None = None
    # what the replay's arrivals were: "own arrivals" (each run's, recorded in results.json), or "poisson"
    # (samples at the point's rate, for runs recorded without them)
    arrivals: str = ""
    # share of the point's prompt tokens the instances found in their prefix caches (None: not recorded); the
    # replay finds only the dataset's shared prefixes (``prefixes``), so above CACHE_HIT_SHARE without them the
    # measured point is faster than any replay can be
    cache_hit_share: float | None = None
    prefixes: int = 0  # shared prefixes the replay gave the prompts (the dataset's num_prefixes; 0: none)
    # requests per second within the run's SLOs (vllm bench --goodput): the repeats' median and range, and the
    # replay's (its share within the SLOs times the run's measured request throughput); None without SLOs
    measured_goodput: float | None = None
    goodput_low: float | None = None
    goodput_high: float | None = None
    predicted_goodput: float | None = None
    # Mean TTFT inside the engines (ms): vLLM's own queue + prefill time per request (``measured_engine_ttft_ms``)
    # against the replay's first token less its wait for the iteration running at its arrival
    # (``engine_ttft_s``); the rest of a measured TTFT is the HTTP stack around the engines, which the replay has
    # only as its zero-load calibration; P/D's: its prefill instance's. None where a run mixed plans or recorded no
    # engine phases.
    measured_engine_ttft_ms: float | None = None
    predicted_engine_ttft_ms: float | None = None
    measured_mean_ttft_ms: float | None = None  # the client's mean TTFT over the same runs
    # vLLM's API servers' mean TTFT (a request's arrival there to its first token out)
    measured_api_ttft_ms: float | None = None
    # where the cores went while the point ran (e2e.py's ``cpu_s`` and ``core_busy``; None where not recorded)
    cpu: CpuUse | None = None

    @property
    def cached(self) -> bool:
        """The measured point prefilled a visible share of its prompts from vLLM's prefix cache, and the replay
        knew of no shared prefix to find there."""
        return (
            not self.prefixes and self.cache_hit_share is not None and self.cache_hit_share > CACHE_HIT_SHARE
        )

    @property
    def disturbed(self) -> bool:
        """Other jobs used a visible share of the machine while this point ran (its numbers are not ours alone)."""
        return self.foreign_cpu_cores is not None and self.foreign_cpu_cores > DISTURBED_CORES

    def ratio(self, metric: str) -> float | None:
        """Predicted / measured for one of ``METRICS`` (None without both, or with a zero measurement)."""
        if self.measured is None or self.predicted is None or self.measured.get(metric) <= 0:
            return None
        return self.predicted.get(metric) / self.measured.get(metric)


def measured_percentiles(bench: dict[str, Any]) -> Percentiles:
    """The percentiles from one ``vllm bench serve`` result JSON (p50 is its median)."""

    def pick(metric: str) -> float:
        p50 = metric.replace("p50_", "median_")
        return float(bench[metric] if metric in bench else bench[p50])

    return Percentiles(*(pick(m) for m in METRICS))


def slo_targets(results: dict[str, Any]) -> tuple[float, float] | None:
    """(TTFT, TPOT) targets in seconds from results.json's ``slo`` (vllm bench's ``--goodput`` form, "ttft:1500
    tpot:25" in ms); None where it names neither."""
    targets = {}
    for part in str(results.get("slo") or "").replace(",", " ").split():
        name, _, ms = part.partition(":")
        try:
            targets[name.strip()] = float(ms) / 1000
        except ValueError:
            continue
    if "ttft" not in targets and "tpot" not in targets:
        return None
    return targets.get("ttft", math.inf), targets.get("tpot", math.inf)


def across(runs: list[Percentiles], how: Callable[[list[float]], float]) -> Percentiles:
    """``how`` (median, min, max) of each metric over repeated runs of one point."""
    return Percentiles(*(float(how([r.get(m) for r in runs])) for m in METRICS))


def engine_config(replay: dict[str, Any], design: str | None = None) -> EngineConfig:
    """vLLM's scheduler settings as the run used them (a design's own ``max_num_batched_tokens`` over the run's);
    chunked prefill as its EngineCore logged it (V1's default, on, when the log did not say)."""
    eng = replay.get("engine", {})
    own = replay.get("designs", {}).get(design, {}) if design else {}
    chunked = eng.get("chunked_prefill")
    return EngineConfig(
        max_num_seqs=int(eng.get("max_num_seqs", 128)),
        max_batched_tokens=int(own.get("max_num_batched_tokens", eng.get("max_num_batched_tokens", 2048))),
        chunked_prefill=True if chunked is None else bool(chunked),
    )


def lengths(entry: dict[str, Any], replay: dict[str, Any]) -> tuple[int, int]:
    """(prompt, output) tokens per request: what the benchmark counted if it says (the tokenizer may shift a
    prompt by a token or two), else the dataset's nominal lengths."""
    bench = entry.get("bench", {})
    nominal = replay.get("datasets", {}).get(entry["dataset"], {})
    done = bench.get("completed") or 0
    prompt = round(bench["total_input_tokens"] / done) if done and bench.get("total_input_tokens") else 0
    output = round(bench["total_output_tokens"] / done) if done and bench.get("total_output_tokens") else 0
    return prompt or int(nominal.get("input_len", 0)), output or int(nominal.get("output_len", 0))


def mean_profile(profiles: list[Profile]) -> Profile:
    """One profile for interchangeable instances (the colocated replicas): the simulator times every replica
    with one cost model, so average their prefill time per token and their step time at each measured batch."""
    if len(profiles) == 1:
        return profiles[0]
    base = profiles[0].decode_context_tokens
    batches = sorted({p.batch for prof in profiles for p in prof.decode_points if p.context_tokens == base})
    decode = [
        DecodePoint(
            batch=b,
            step_s=statistics.fmean(prof.decode_step_s(b) for prof in profiles),
            context_tokens=base,
        )
        for b in batches
    ]
    # the points at a longer context, where every profile measured the same one
    longer = {(p.batch, p.context_tokens) for p in profiles[0].decode_points if p.context_tokens > base}
    for b, ctx in sorted(longer):
        steps = [
            p.step_s
            for prof in profiles
            for p in prof.decode_points
            if (p.batch, p.context_tokens) == (b, ctx)
        ]
        if len(steps) == len(profiles):
            decode.append(DecodePoint(batch=b, step_s=statistics.fmean(steps), context_tokens=ctx))
    lens = sorted({p.prompt_tokens for prof in profiles for p in prof.prefill_points})
    prefill = [
        PrefillPoint(
            prompt_tokens=n,
            seconds=statistics.fmean(
                p.seconds for prof in profiles for p in prof.prefill_points if p.prompt_tokens == n
            ),
        )
        for n in lens
    ]
    return profiles[0].model_copy(
        update={
            "source": " + ".join(p.source for p in profiles),
            "prefill_tokens_per_s": tokens_per_s(
                statistics.fmean(1.0 / p.prefill_tokens_per_s for p in profiles)
            ),
            "prefill_overhead_s": statistics.fmean(p.prefill_overhead_s for p in profiles),
            # each fitted latency is linear in (1/rate, per-pair, overhead): averaging each averages the curves
            "prefill_s_per_pair": statistics.fmean(p.prefill_s_per_pair for p in profiles),
            "prefill_points": prefill,
            "decode_points": decode,
        }
    )


def _profile(files: dict[str, str], instance: str, profiles: dict[str, Profile]) -> Profile | None:
    """The profile of one instance: by the file name results.json gives it, or the only one given."""
    name = files.get(instance)
    if name is not None and name in profiles:
        return profiles[name]
    return next(iter(profiles.values())) if len(profiles) == 1 else None


@dataclass(frozen=True)
class Replay:
    """What a design's replay runs on: the design, its cost models, the engine settings and the model."""

    design: Design
    cost: StepModel
    prefill_cost: StepModel | None
    engine: EngineConfig
    model: ModelSpec

    def run(self, requests: list[Request]) -> list[tuple[float, float]]:
        """(TTFT s, TPOT s) of each completed request."""
        res = simulate(
            requests, self.design, self.model, self.cost, self.engine, prefill_cost=self.prefill_cost
        )
        return [(r.ttft_s, r.tpot_s) for r in res.records if r.ttft_s is not None and r.tpot_s is not None]

    def alone(self, prompt: int, output: int, cached: int = 0) -> tuple[float, float]:
        """The simulated (TTFT s, TPOT s) of one request meeting an idle cluster; ``cached``: tokens of a prefix
        it shares with a request served long before (on every instance: one per instance, at once)."""
        if not cached:
            done = self.run([Request(0, 0.0, prompt, output)])
            return done[0] if done else (0.0, 0.0)
        warm = [Request(i, 0.0, prompt, 2, 0, cached) for i in range(self.instances)]
        done = self.run([*warm, Request(len(warm), 1000.0, prompt, output, 0, cached)])
        return done[-1] if len(done) > len(warm) else (0.0, 0.0)

    @property
    def instances(self) -> int:
        d = self.design
        return d.replicas if isinstance(d, Colocated | Adaptive) else d.prefill + d.decode

    def with_token_overhead(self, seconds: float) -> Replay:
        """This replay with every engine spending ``seconds`` per emitted token outside its forward pass."""
        return replace(self, engine=replace(self.engine, token_overhead_s=seconds))

    def with_decode_scale(self, factor: float) -> Replay:
        """This replay with every decode step taking ``factor`` times the profiled time."""
        return replace(
            self,
            cost=_scaled_decode(self.cost, factor),
            prefill_cost=None if self.prefill_cost is None else _scaled_decode(self.prefill_cost, factor),
        )

    def with_prefill_scale(self, factor: float) -> Replay:
        """This replay with every prompt's compute taking ``factor`` times the profiled time (where it is profiled):
        the prefill pool's for P/D, every instance's otherwise."""
        if self.prefill_cost is not None:
            return replace(self, prefill_cost=_scaled_prefill(self.prefill_cost, factor))
        return replace(self, cost=_scaled_prefill(self.cost, factor))


def _scaled_prefill(cost: StepModel, factor: float) -> StepModel:
    if not isinstance(cost, ProfileCost) or factor == 1.0:
        return cost
    p = cost.profile
    scaled = p.model_copy(
        update={
            "prefill_tokens_per_s": p.prefill_tokens_per_s / factor,
            "prefill_s_per_pair": p.prefill_s_per_pair * factor,
            "prefill_overhead_s": p.prefill_overhead_s * factor,
        }
    )
    return replace(cost, profile=scaled)


def _scaled_decode(cost: StepModel, factor: float) -> StepModel:
    if not isinstance(cost, ProfileCost) or factor == 1.0:
        return cost
    p = cost.profile
    points = [d.model_copy(update={"step_s": d.step_s * factor}) for d in p.decode_points]
    return replace(cost, profile=p.model_copy(update={"decode_points": points}))


def replay_for(
    design: str, results: dict[str, Any], profiles: dict[str, Profile], model: ModelSpec, link: Link
) -> Replay | str:
    """The replay of one measured design, or why there is none."""
    replay = results.get("replay", {})
    spec = replay.get("designs", {}).get(design)
    if spec is None:
        return f"results.json has no replay settings for design {design!r} (run e2e.py with --profile)"
    files: dict[str, str] = spec.get("profiles", {})
    engine = engine_config(replay, design)
    if "adaptive" in spec:
        instances = list(files) or ["instance"]
        found = [_profile(files, i, profiles) for i in instances]
        if not found or any(p is None for p in found):
            return f"no profile for {design}'s instances {instances}"
        slo = dict(part.split(":", 1) for part in str(results.get("slo", "")).split() if ":" in part)
        adaptive = Adaptive(
            int(spec["adaptive"]),
            link,
            ttft_slo_s=float(slo["ttft"]) / 1e3 if "ttft" in slo else None,
            tpot_slo_s=float(slo["tpot"]) / 1e3 if "tpot" in slo else None,
        )
        cost = ProfileCost(mean_profile([p for p in found if p is not None]))
        return Replay(adaptive, cost, None, engine, model)
    if "replicas" in spec:
        instances = list(files) or ["replica"]
        found = [_profile(files, i, profiles) for i in instances]
        if not found or any(p is None for p in found):
            return f"no profile for {design}'s instances {instances}"
        cost = ProfileCost(mean_profile([p for p in found if p is not None]))
        return Replay(Colocated(int(spec["replicas"])), cost, None, engine, model)
    prefill, decode = _profile(files, "prefill", profiles), _profile(files, "decode", profiles)
    if prefill is None or decode is None:
        return f"no profile for {design}'s prefill and decode instances"
    dis = Disaggregated(int(spec.get("prefill", 1)), int(spec.get("decode", 1)), link)
    return Replay(dis, ProfileCost(decode), ProfileCost(prefill), engine, model)


def profile_files(results: dict[str, Any]) -> list[str]:
    """The profile files results.json names (relative to its own directory): what ``validate``'s ``profiles``
    maps from."""
    designs = results.get("replay", {}).get("designs", {}).values()
    return sorted({f for spec in designs for f in spec.get("profiles", {}).values()})


def seeds_for(requests: int) -> int:
    return max(1, min(MAX_SEEDS, math.ceil(TARGET_REQUESTS / max(requests, 1))))


def run_arrivals(detailed: dict[str, Any]) -> dict[str, list[float] | list[int]] | None:
    """What a replay needs of one ``vllm bench serve --save-detailed`` result: each completed request's send time
    (seconds after the first, in send order) and its prompt and output tokens. None when the lists are missing.

    A run's p95 rests on its few slowest requests, which its own arrival bursts decide: two runs of 100 Poisson
    arrivals at one rate differed by 1.5x in p95 TTFT here. Replaying the arrivals the run had compares the
    simulator with the measurement on the same sample instead of with the mean over samples.
    """
    starts, prompts = detailed.get("start_times"), detailed.get("input_lens")
    outputs, errors = detailed.get("output_lens"), detailed.get("errors")
    if not starts or not prompts or not outputs or not (len(starts) == len(prompts) == len(outputs)):
        return None
    ok = [
        i
        for i in range(len(starts))
        if int(outputs[i]) > 0 and not (errors and i < len(errors) and errors[i])
    ]
    if not ok:
        return None
    ok.sort(key=lambda i: float(starts[i]))
    t0 = float(starts[ok[0]])
    return {
        "offsets_s": [round(float(starts[i]) - t0, 4) for i in ok],
        "prompt_tokens": [int(prompts[i]) for i in ok],
        "output_tokens": [int(outputs[i]) for i in ok],
    }


def arrival_requests(entry: dict[str, Any]) -> list[Request] | None:
    """The requests of one results.json entry as its run sent them (``run_arrivals``), or None if not recorded."""
    arr = entry.get("arrivals")
    if not arr:
        return None
    return [
        Request(i, float(t), int(p), int(o))
        for i, (t, p, o) in enumerate(
            zip(arr["offsets_s"], arr["prompt_tokens"], arr["output_tokens"], strict=True)
        )
    ]


@dataclass(frozen=True)
class ZeroLoad:
    """What the stack around the engines adds to a request, measured one request at a time.

    Where the run's stack shares the engines' cores (``stack_shares_engine_cores`` in results.json's replay
    section; e2e.py's CPU runs, and so the default), the median measured TPOT above the simulated TPOT alone is a
    cost per emitted token (``token_overhead_s``), or, where the design's batched zero-load run is recorded, split
    between that cost and a scale on the profiled decode step (``decode_scale``) so that both runs' median TPOTs
    come out as measured (``fit_decode``): the API server detokenizing and streaming, the proxy and client,
    on the cores the engines use. The replay's engines pay it per token of every running stream, so it grows with
    the batch, as CPU time does; a factor on the step would not. Where the stack has cores of its own (a GPU host),
    that work overlaps the forward pass and the excess stays a factor. Then per zero-load request j: a TTFT excess
    (measured TTFT - the simulated TTFT alone, overhead included) and a TPOT factor (measured TPOT / the simulated
    TPOT alone, ~1 at the median with the overhead); each replayed request draws one measured pair, so their
    spread enters the percentiles, not only the median.

    Streams delivered in one burst at their end (TTFT >= 90% of the request's latency) are left out: they are not
    a cost per request but a delivery stall whose share swung from 17% to 100% between identical P/D zero-load
    runs here (0% colocated), so carrying it over would make every prediction follow that run's luck. ``late``
    counts them; the benchmark points' own shares are in ``ValidationRow.late_share``. With only a median TTFT
    recorded, the excess is that median's and the factor 1.
    """

    ttft_excess_s: tuple[float, ...] = (0.0,)
    tpot_factor: tuple[float, ...] = (1.0,)
    late: int = 0
    token_overhead_s: float = 0.0
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    # concurrency of the batched zero-load run the per-token cost was fitted to (0: none recorded)
    batch_streams: int = 0
    # designs whose zero-load runs the per-token cost was fitted across (0: this design's alone)
    shared_by: int = 0
    # what the per-token cost was read from /proc over ("": fitted)
    measured_over: str = ""

    def applied(self, rp: Replay) -> Replay:
        """``rp`` with this calibration's engine changes (per-token cost, decode and prefill scales)."""
        return (
            rp.with_decode_scale(self.decode_scale)
            .with_token_overhead(self.token_overhead_s)
            .with_prefill_scale(self.prefill_scale)
        )

    def describe(self) -> str:
        if self == ZeroLoad(late=self.late) and self.late:
            return f"none usable (all {self.late} streams late): engines only"
        n = len(self.ttft_excess_s)
        med = statistics.median(self.ttft_excess_s) * 1000
        factor = statistics.median(self.tpot_factor)
        scale = (
            f", prefill at {self.prefill_scale:.2f}x the profile's time" if self.prefill_scale != 1.0 else ""
        )
        fitted = ""
        if self.measured_over:
            fitted = (
                f" (the stack's CPU, read from /proc over {self.measured_over}, spread over every engine's core; "
                f"this design's decode step at {self.decode_scale:.2f}x the profile's, to one stream alone)"
            )
        elif self.shared_by:
            fitted = (
                f" (fitted across {self.shared_by} designs' zero-load runs; this design's decode step at "
                f"{self.decode_scale:.2f}x the profile's, to one stream alone)"
            )
        elif self.batch_streams:
            fitted = (
                f" (fitted with the decode step at {self.decode_scale:.2f}x the profile's to one stream alone and "
                f"{self.batch_streams} at once)"
            )
        return (
            f"TTFT excess median {med:+.1f} ms, {self.token_overhead_s * 1000:.2f} ms per emitted token{fitted}"
            f"{scale}, "
            f"TPOT factor median {factor:.2f} (n={n}, {self.late} late left out)"
        )


def _zero_load_record(replay: dict[str, Any], design: str, dataset: str) -> dict[str, Any]:
    """results.json's zero-load record of (design, dataset); empty where there is none."""
    record: dict[str, Any] = replay.get("designs", {}).get(design, {}).get("zero_load", {}).get(dataset, {})
    return record


# One zero-load request as the calibration compares it: (TTFT ms, TPOT ms, prompt, output, cached prefix tokens).
ZeroLoadRequest = tuple[float, float, int, int, int]


def usable_zero_load(
    rp: Replay, replay: dict[str, Any], design: str, dataset: str, prompt: int, output: int
) -> tuple[list[ZeroLoadRequest], int] | None:
    """The zero-load requests of (design, dataset) the calibration uses, and how many were recorded; None where
    results.json records none one by one (or only their median).

    Each is compared with its own lengths alone where the record has them (``input_lens``, ``output_lens``: a mixed
    dataset's short and long prompts), else with the point's ``prompt`` and ``output``. Where the dataset's prompts
    share prefixes (``shared_prefix``), the first requests of each prefix computed it and the rest found it
    cached: each is compared with the same request alone cold or warm, whichever its TTFT is nearer
    (``cold_ones``). Streams delivered in one burst at their end are left out (``ZeroLoad``)."""
    zl = _zero_load_record(replay, design, dataset)
    ttfts, tpots = zl.get("ttfts_ms") or [], zl.get("tpots_ms") or []
    if not ttfts or len(tpots) != len(ttfts):
        return None
    _, prefix_tokens = shared_prefix(replay, dataset)
    ins, outs = zl.get("input_lens") or [], zl.get("output_lens") or []
    own = len(ins) == len(ttfts) == len(outs) and all(ins) and all(outs)
    lens = list(zip(ins, outs, strict=True)) if own else [(prompt, output)] * len(ttfts)
    cold = cold_ones(rp, ttfts, lens, prefix_tokens)
    normal = [
        (t, x, p, o, 0 if c else prefix_tokens)
        for t, x, (p, o), c in zip(ttfts, tpots, lens, cold, strict=True)
        if t < 0.9 * (t + x * max(o - 1, 1))
    ]
    return normal, len(ttfts)


def zero_load(
    rp: Replay,
    replay: dict[str, Any],
    design: str,
    dataset: str,
    prompt: int,
    output: int,
    shared_overhead: SharedOverhead | None = None,
) -> ZeroLoad:
    """The calibration from results.json's zero-load record of (design, dataset) (``usable_zero_load``); none
    recorded: no change.

    ``shared_overhead``: the per-emitted-token cost fitted across every design's zero-load runs at once
    (``shared_token_overhead``); this design's decode step is then scaled so that its TPOT alone comes out as
    measured. Without it the cost is fitted to this design's own two runs (``fit_decode``)."""
    usable = usable_zero_load(rp, replay, design, dataset, prompt, output)
    if usable is None:
        zl = _zero_load_record(replay, design, dataset)
        if zl.get("median_ttft_ms") is None:
            return ZeroLoad()
        _, prefix_tokens = shared_prefix(replay, dataset)
        return ZeroLoad((zl["median_ttft_ms"] / 1000 - rp.alone(prompt, output, prefix_tokens)[0],))
    normal, recorded = usable
    if not normal:
        return ZeroLoad(late=recorded)

    def alone(r: Replay) -> list[tuple[float, float]]:
        """Each normal request's simulated (TTFT, TPOT) alone on ``r`` (one simulation per distinct length)."""
        memo: dict[tuple[int, int, int], tuple[float, float]] = {}
        return [
            memo.get((p, o, c)) or memo.setdefault((p, o, c), r.alone(p, o, c)) for _, _, p, o, c in normal
        ]

    # Alone, each decode iteration emits one token: without a batched run, the TPOT above the engine's step is the
    # overhead per token; with one, the two runs split it between the step and the overhead (``fit_decode``).
    shared = bool(replay.get("stack_shares_engine_cores", True))
    overhead, dscale, streams, designs, measured = 0.0, 1.0, 0, 0, ""
    if shared and output > 1:
        batch = batch_record(replay, design)
        alone_tpot = statistics.median(x for _, x, _, _, _ in normal) / 1000
        if shared_overhead is not None:
            overhead, designs = shared_overhead.seconds, shared_overhead.designs
            measured = shared_overhead.measured
            dscale = decode_scale_for(rp, prompt, output, alone_tpot, overhead)
            streams = batch[2] if batch is not None else 0
        elif batch is not None:
            requests, batch_tpot, streams = batch
            overhead, dscale = fit_decode(rp, prompt, output, alone_tpot, requests, batch_tpot)
        elif rp.engine.stack_cpu == "serial":
            above = [x / 1000 - sim[1] for (_, x, _, _, _), sim in zip(normal, alone(rp), strict=True)]
            overhead = max(0.0, statistics.median(above))
        else:
            # spread over the cores, one stream's cost per token is (cores x its TPOT) at most
            overhead = _reaching(
                lambda s: rp.with_token_overhead(s).alone(prompt, output)[1],
                alone_tpot,
                0.0,
                rp.instances * alone_tpot,
            )
    rp = rp.with_decode_scale(dscale).with_token_overhead(overhead)
    # Requests alone faster than the simulated engines: the stack around them takes no negative time, so the
    # profile overstated the prompt's compute (profiled in another moment of a shared machine). Scale the prefill
    # until the simulated TTFT alone is the measured one at the median, over the longest prompts (at least half
    # the longest: with a mix of lengths the short ones say little about the prefill): bisection, as TTFT alone
    # never falls when the prefill slows (but bends where a transfer, not the prefill, ends last).
    longest = max(p - c for _, _, p, _, c in normal)
    long_ones = [k for k, (_, _, p, _, c) in enumerate(normal) if p - c >= longest / 2]

    def slower(r: Replay) -> float:
        sims = alone(r)
        return statistics.median(sims[k][0] - normal[k][0] / 1000 for k in long_ones)

    scale = 1.0
    if slower(rp) > 0:
        scale = _reaching(lambda f: slower(rp.with_prefill_scale(f)), 0.0, MIN_PREFILL_SCALE, 1.0)
        rp = rp.with_prefill_scale(scale)
    sims = alone(rp)
    excess = tuple(t / 1000 - sim[0] for (t, _, _, _, _), sim in zip(normal, sims, strict=True))
    factor = tuple(
        x / 1000 / sim[1] if sim[1] > 0 else 1.0 for (_, x, _, _, _), sim in zip(normal, sims, strict=True)
    )
    return ZeroLoad(
        excess, factor, recorded - len(normal), overhead, scale, dscale, streams, designs, measured
    )


def shared_prefix(replay: dict[str, Any], dataset: str) -> tuple[int, int]:
    """(prefixes, tokens of each) the dataset's prompts share, as results.json's replay records the dataset
    (``num_prefixes``, ``shared_prefix_len``); (0, 0) where they share none."""
    spec = replay.get("datasets", {}).get(dataset, {})
    n, tokens = int(spec.get("num_prefixes") or 0), int(spec.get("shared_prefix_len") or 0)
    return (n, tokens) if n > 0 and tokens > 0 else (0, 0)


def with_prefixes(requests: list[Request], prefixes: int, tokens: int, seed: int) -> list[Request]:
    """``requests`` beginning with one of ``prefixes`` shared prefixes of ``tokens`` each, in a shuffled order
    (``workload.shared_prefixes``; which prompt had which prefix is not recorded); unchanged without prefixes."""
    if not prefixes:
        return requests
    ids = shared_prefixes(len(requests), prefixes, seed)
    return [replace(r, prefix=k, prefix_tokens=tokens) for r, k in zip(requests, ids, strict=True)]


def cold_ones(
    rp: Replay, ttfts_ms: list[float], lens: list[tuple[int, int]], prefix_tokens: int
) -> list[bool]:
    """Which zero-load requests computed their shared prefix: those whose TTFT is nearer the median's plus the
    prefix's simulated compute (alone cold less alone warm) than the median (most requests find it cached). All
    False without a shared prefix."""
    if not prefix_tokens or not ttfts_ms:
        return [False] * len(ttfts_ms)
    p, o = statistics.median_low(lens)
    gap_ms = (rp.alone(p, o)[0] - rp.alone(p, o, prefix_tokens)[0]) * 1000
    mid = statistics.median(ttfts_ms) + gap_ms / 2
    return [t > mid for t in ttfts_ms]


def batch_record(replay: dict[str, Any], design: str) -> tuple[list[Request], float, int] | None:
    """The batched zero-load run of a design (``e2e.py``'s ``zero_load_batch``): its requests as sent, their
    median measured TPOT (s) and its concurrency; None where the run recorded none."""
    zb = replay.get("designs", {}).get(design, {}).get("zero_load_batch") or {}
    requests = arrival_requests(zb)
    tpots = zb.get("tpots_ms") or []
    if not requests or not tpots:
        return None
    return requests, statistics.median(tpots) / 1000, int(zb.get("concurrency") or 0)


def decode_scale_for(rp: Replay, prompt: int, output: int, alone_tpot: float, overhead: float) -> float:
    """The decode-step scale at which one stream of (``prompt``, ``output``) alone has the TPOT ``alone_tpot`` (s)
    with ``overhead`` s per emitted token."""
    tuned = rp.with_token_overhead(overhead)
    return _reaching(lambda k: tuned.with_decode_scale(k).alone(prompt, output)[1], alone_tpot, 0.01, 4.0)


def fit_decode(
    rp: Replay, prompt: int, output: int, alone_tpot: float, batch: list[Request], batch_tpot: float
) -> tuple[float, float]:
    """(seconds per emitted token, decode-step scale) that make the replay's TPOT match two measurements.

    One stream alone (``alone_tpot``, the dataset's request) fixes step(1) x scale + overhead; the batched run
    (``batch_tpot``, the median TPOT of ``batch`` replayed as it was sent) fixes how much each further stream
    adds. A profile of non-streamed requests cannot tell the two apart, and its one-stream step moved by 25%
    between two profiles an hour apart here while the streamed TPOT alone stayed within 5%. The overhead is
    searched in [0, 0.9 x alone_tpot]: the batched TPOT rises with it, as the step scale that keeps the alone
    TPOT falls.
    """
    anchor = DecodeAnchor("", rp, prompt, output, alone_tpot, batch, batch_tpot)
    overhead = _reaching(anchor.batch_tpot_at, batch_tpot, 0.0, 0.9 * alone_tpot, steps=20)
    return overhead, decode_scale_for(rp, prompt, output, alone_tpot, overhead)


@dataclass(frozen=True)
class DecodeAnchor:
    """One design's two zero-load TPOTs (s): one stream of a dataset's request alone, and its batched run."""

    design: str
    rp: Replay
    prompt: int
    output: int
    alone_tpot: float
    batch: list[Request]
    batch_tpot: float

    def batch_tpot_at(self, overhead: float) -> float:
        """The batched run's replayed median TPOT with ``overhead`` per emitted token and the decode step scaled
        to keep the TPOT alone as measured."""
        scale = decode_scale_for(self.rp, self.prompt, self.output, self.alone_tpot, overhead)
        tuned = self.rp.with_decode_scale(scale).with_token_overhead(overhead)
        return statistics.median(tpot for _, tpot in tuned.run(self.batch))


@dataclass(frozen=True)
class SharedOverhead:
    """The per-emitted-token cost of the stack, one for every design of a run: fitted across ``designs``
    designs' zero-load runs at once, or read from /proc (``measured`` says over what)."""

    seconds: float
    designs: int
    measured: str = ""


def measured_stack_cost(results: dict[str, Any], points: list[list[dict[str, Any]]]) -> SharedOverhead | None:
    """The stack's CPU per emitted token as e2e.py read it from /proc, one figure for the whole run: the median
    over the designs' batched zero-load runs, else (runs recorded before those read it) over the run's benchmark
    points (``points``: each point's runs, every design and rate); None where neither recorded it.

    The stack (each instance's API server, the proxy, the client) is the same code in every design, and its CPU
    per token is what its processes used, not a fit: fitted from each run's zero-load TPOTs it came out between
    0 and 1.45 ms for the same code, where /proc read 0.30-0.46 ms at every chat-mix point of 2026-12-05. The
    zero-load run comes first because it is a calibration taken before the points, as the profiles are; over 24
    points of four runs on one host it put as many within 25% as the points' own figure did (18 each)."""
    designs = results.get("replay", {}).get("designs", {})
    batches = []
    for spec in designs.values():
        zb = spec.get("zero_load_batch") or {}
        if zb.get("cpu_s") and zb.get("total_output_tokens"):
            use = cpu_use([{**zb, "bench": {"total_output_tokens": zb["total_output_tokens"]}}])
            if use is not None:
                batches.append(use.stack_ms_per_token)
    if batches:
        return SharedOverhead(statistics.median(batches) / 1000, len(designs), "the batched zero-load runs")
    uses = [u.stack_ms_per_token for runs in points if (u := cpu_use(runs)) is not None]
    if uses:
        return SharedOverhead(statistics.median(uses) / 1000, len(designs), "the run's benchmark points")
    return None


# Grid points and golden-section steps of ``shared_token_overhead``'s search.
OVERHEAD_GRID = 12
OVERHEAD_REFINE = 12


def shared_token_overhead(anchors: list[DecodeAnchor]) -> SharedOverhead | None:
    """The per-emitted-token cost that best fits every design's batched zero-load run at once, each design's decode
    step scaled to its own TPOT alone; None without anchors.

    The cost is the stack around the engines (the API server detokenizing and streaming, the proxy, the client)
    on the cores the engines use: the same code in every design of a run. Fitted per design from one batched run
    of ~24 requests each, it followed those runs' noise (a design's median batched TPOT moved 25-35% between two
    runs an hour apart here, and its fitted cost between 0 and 1.45 ms), which flipped the replay's design
    ordering. It minimises the sum over designs of the squared log ratio of replayed to measured batched TPOT:
    a grid over [0, 0.9 x the least TPOT alone], then a golden-section search around the best grid point.
    """
    if not anchors:
        return None
    hi = 0.9 * min(a.alone_tpot for a in anchors)

    def miss(overhead: float) -> float:
        return sum(math.log(max(a.batch_tpot_at(overhead), 1e-9) / a.batch_tpot) ** 2 for a in anchors)

    grid = [hi * k / (OVERHEAD_GRID - 1) for k in range(OVERHEAD_GRID)]
    misses = [miss(x) for x in grid]
    best = min(range(OVERHEAD_GRID), key=misses.__getitem__)
    lo, up = grid[max(best - 1, 0)], grid[min(best + 1, OVERHEAD_GRID - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = up - ratio * (up - lo), lo + ratio * (up - lo)
    fa, fb = miss(a), miss(b)
    for _ in range(OVERHEAD_REFINE):
        if fa <= fb:
            up, b, fb = b, a, fa
            a = up - ratio * (up - lo)
            fa = miss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (up - lo)
            fb = miss(b)
    found = min(((fa, a), (fb, b), (misses[best], grid[best])))[1]
    return SharedOverhead(found, len({x.design for x in anchors}))


def decode_anchors(
    replays: dict[str, Replay], replay: dict[str, Any], datasets: dict[str, tuple[int, int]]
) -> list[DecodeAnchor]:
    """Every (design, dataset) with a batched zero-load run and usable zero-load requests: the two TPOTs the
    shared per-token cost is fitted to. ``datasets``: each dataset's (prompt, output) lengths."""
    anchors = []
    for design, rp in sorted(replays.items()):
        batch = batch_record(replay, design)
        if batch is None:
            continue
        requests, batch_tpot, _ = batch
        for dataset, (prompt, output) in sorted(datasets.items()):
            usable = usable_zero_load(rp, replay, design, dataset, prompt, output)
            if usable is None or not usable[0] or output <= 1:
                continue
            alone_tpot = statistics.median(x for _, x, _, _, _ in usable[0]) / 1000
            anchors.append(DecodeAnchor(design, rp, prompt, output, alone_tpot, requests, batch_tpot))
    return anchors


def _reaching(f: Callable[[float], float], target: float, lo: float, hi: float, steps: int = 30) -> float:
    """The least x in [lo, hi] found by bisection where ``f`` (not falling) reaches ``target``; ``lo`` where f
    already does there, ``hi`` where it never does."""
    if f(lo) >= target:
        return lo
    if f(hi) < target:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


# The most of a core the stack's queue model lets its CPU take (``stack_queue_stretch``). The replay's stack CPU at
# one arrival follows that moment's streams, and at a burst's 0.7-0.8 cores the stretch (3-5x) turned one request's
# zero-load excess into the point's p95: the chat mix's colocated p95 TTFT at 18 and 26 req/s came out at 1.28x and
# 1.33x with a cap of 0.8, 1.10x and 1.16x with 0.6 (docs/results/validate-chat-mix-2026-12-06/).
STACK_QUEUE_CAP = 0.6


def stack_cores_at_arrivals(records: Sequence[RequestRecord], per_token_s: float) -> dict[int, float]:
    """The stack's CPU, in cores, when each request arrived: ``per_token_s`` for every token the replay's streams
    were emitting per second at that moment (each stream's tokens spread evenly from its first to its last)."""
    events: list[tuple[float, float]] = []
    for r in records:
        if r.ttft_s is None or r.e2e_s is None or r.e2e_s <= r.ttft_s or r.output_tokens < 2:
            continue
        rate = (r.output_tokens - 1) / (r.e2e_s - r.ttft_s)
        events += [(r.arrival_s + r.ttft_s, rate), (r.arrival_s + r.e2e_s, -rate)]
    events.sort()
    out: dict[int, float] = {}
    level, k = 0.0, 0
    for t, rid in sorted((r.arrival_s, r.id) for r in records):
        while k < len(events) and events[k][0] <= t:
            level += events[k][1]
            k += 1
        out[rid] = per_token_s * max(level, 0.0)
    return out


def stack_queue_stretch(cores: float) -> float:
    """How much longer the stack's part of a TTFT takes than alone when the stack's processes run ``cores`` of
    CPU: they share the engines' cores, and a request's own stack work waits behind the rest as in one server's
    queue at that load, 1 / (1 - cores), up to ``STACK_QUEUE_CAP``. On the AMX host the client's mean TTFT less
    vLLM's own queue + prefill time grew 1.07 / 1.10 / 1.13x (colocated, random prompts), 1.32 / 1.55 / 1.62x (prefix
    repetition) and 1.97 / 2.32 / 3.36x (chat mix) over zero load, at 0.06-0.57 cores of stack CPU."""
    return 1.0 / (1.0 - min(max(cores, 0.0), STACK_QUEUE_CAP))


def excess_stretches(res: Any, zl: ZeroLoad, rp: Replay) -> dict[int, float]:
    """Each replayed request's stretch of its zero-load excess (``stack_queue_stretch`` at the stack's CPU when it
    arrived), where the stack shares the engines' cores (``stack_cpu`` "shared"); empty (no stretch) otherwise.
    One simulation's, for all of its zero-load draws."""
    if rp.engine.stack_cpu != "shared" or zl.token_overhead_s <= 0:
        return {}
    cores = stack_cores_at_arrivals(res.records, zl.token_overhead_s)
    return {rid: stack_queue_stretch(c) for rid, c in cores.items()}


def _calibrated(
    res: Any, zl: ZeroLoad, seed: int, stretches: dict[int, float] | None = None
) -> tuple[list[float], list[float]]:
    """Each simulated request's (TTFT s, TPOT s) with one zero-load request's excess and factor drawn for it, the
    excess stretched by ``stretches`` (``excess_stretches``)."""
    rng = random.Random(seed)
    stretches = stretches or {}
    ttft, tpot = [], []
    for r in res.records:
        if r.ttft_s is None or r.tpot_s is None:
            continue
        j = rng.randrange(len(zl.ttft_excess_s))
        ttft.append(max(0.0, r.ttft_s + zl.ttft_excess_s[j] * stretches.get(r.id, 1.0)))
        tpot.append(r.tpot_s * zl.tpot_factor[j])
    return ttft, tpot


def _percentiles(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {
        "p50_ttft_ms": percentile(ttft, 50) * 1000,
        "p95_ttft_ms": percentile(ttft, 95) * 1000,
        "p50_tpot_ms": percentile(tpot, 50) * 1000,
        "p95_tpot_ms": percentile(tpot, 95) * 1000,
    }


class RunPrediction(NamedTuple):
    """One run's replay (``predict_run``)."""

    percentiles: Percentiles
    load: str  # the utilisation report
    within_slo: float | None  # share of requests within the SLOs
    engine_ttft_s: float | None  # ``engine_ttft_s``
    stable: bool | None = None  # every pool under capacity (None: the simulator reported no utilisation)


def _computing_instances(entry: dict[str, Any]) -> list[str] | None:
    """The instances whose vLLM phases (e2e.py's ``engine_phases``) time every request's prompt: all of them where
    each request was served where it was computed; P/D's prefill instance where every request was transferred
    (its decode instance's phases are a wait for the KV and one token's step). None otherwise: a mix splits the
    phases over instances that see different parts of different requests."""
    phases, decisions = entry.get("engine_phases"), set(entry.get("decisions") or {})
    if not phases:
        return None
    if decisions == {"colocated"}:
        return list(phases)
    if decisions == {"transfer"} and "prefill" in phases:
        return ["prefill"]
    return None


def _phase_mean_ms(entry: dict[str, Any], phases: tuple[str, ...]) -> float | None:
    """The sum of ``phases``' means (ms) per request, over the instances that computed the prompts
    (``_computing_instances``) weighted by their requests; None where there are none or none recorded them all."""
    instances = _computing_instances(entry)
    if instances is None:
        return None
    total = count = 0.0
    for inst in (entry["engine_phases"][name] for name in instances):
        got = [inst.get(name) for name in phases]
        if not all(got):
            continue
        n = float(got[-1]["count"])
        total += n * sum(float(g["mean"]) for g in got)
        count += n
    return total / count if count else None


def measured_engine_ttft_ms(entry: dict[str, Any]) -> float | None:
    """Mean queue + prefill time (ms) of one run's requests as vLLM's own histograms recorded them."""
    return _phase_mean_ms(entry, ("queue_ms", "prefill_ms"))


def measured_api_ttft_ms(entry: dict[str, Any]) -> float | None:
    """Mean TTFT (ms) as vLLM's API servers recorded it: from a request's arrival there to its first token there."""
    return _phase_mean_ms(entry, ("ttft_ms",))


def engine_ttft_s(res: SimResult) -> float | None:
    """Mean simulated TTFT inside the engines: from the first iteration boundary at or after each request's arrival
    on the instance that computed it (where vLLM's engine takes a request in and starts its queue time) to its first
    token there (a transfer's: the end of its prompt's compute on the prefill instance). Needs
    ``record_iterations``."""
    starts = {inst: [it.start for it in its] for inst, its in res.iterations.items()}
    spans = []
    for r in res.records:
        done = r.ttft_s if r.mode == "colocated" else r.prefill_done_s if r.mode == "transfer" else None
        if done is None or r.prefill_instance not in starts:
            continue
        st = starts[r.prefill_instance]
        k = bisect.bisect_left(st, r.arrival_s - 1e-12)
        taken = st[k] if k < len(st) else r.arrival_s
        spans.append(r.arrival_s + done - max(taken, r.arrival_s))
    return statistics.fmean(spans) if spans else None


def predict_run(
    rp: Replay,
    requests: list[Request],
    rate: float,
    draws: int,
    zl: ZeroLoad | None = None,
    slo: tuple[float, float] | None = None,
) -> RunPrediction:
    """Percentiles of one measured run replayed on its own arrivals (``arrival_requests``), its utilisation report,
    the share of its requests within ``slo`` (TTFT, TPOT in s; None without) and the TTFT inside its engines.

    The simulation is deterministic for a request list; what varies is which zero-load request's excess each
    replayed request draws, so the percentiles and the share are averaged over ``draws`` such draws.
    """
    zl = zl or ZeroLoad()
    rp = zl.applied(rp)
    res = simulate(
        requests,
        rp.design,
        rp.model,
        rp.cost,
        rp.engine,
        prefill_cost=rp.prefill_cost,
        rate=rate,
        record_iterations=True,
    )
    acc: dict[str, list[float]] = {m: [] for m in METRICS}
    within: list[float] = []
    stretches = excess_stretches(res, zl, rp)
    for seed in range(max(1, draws)):
        ttft, tpot = _calibrated(res, zl, seed, stretches)
        for m, x in _percentiles(ttft, tpot).items():
            acc[m].append(x)
        if slo is not None and res.records:
            good = sum(t <= slo[0] and p <= slo[1] for t, p in zip(ttft, tpot, strict=True))
            within.append(good / len(res.records))
    stability = getattr(res, "stability", None)
    return RunPrediction(
        Percentiles(*(statistics.fmean(acc[m]) for m in METRICS)),
        stability.describe() if stability is not None else "",
        statistics.fmean(within) if within else None,
        engine_ttft_s(res),
        stability.stable if stability is not None else None,
    )


def predict(
    rp: Replay,
    prompt: int,
    output: int,
    rate: float,
    requests: int,
    seeds: int,
    zl: ZeroLoad | None = None,
    prefixes: tuple[int, int] = (0, 0),
) -> tuple[Percentiles, str, bool | None]:
    """Percentiles of ``requests`` Poisson arrivals at ``rate``, each averaged over ``seeds`` arrival samples, with the
    first sample's utilisation report and whether it was stable.

    The measured run is one sample of ``requests`` arrivals, and its p95 rests on the few slowest requests (3 of
    60), so one simulated sample's p95 would scatter as much as the run's own. Averaging over samples predicts
    the percentile a run of that length gives on average: the number a measurement should land near.
    ``prefixes``: (how many, tokens of each) shared prefixes the prompts begin with.
    """
    zl = zl or ZeroLoad()
    rp = zl.applied(rp)
    count, tokens = prefixes
    dist_p, dist_o = LengthDist("fixed", prompt - (tokens if count else 0)), LengthDist("fixed", output)
    acc: dict[str, list[float]] = {m: [] for m in METRICS}
    load, stable = "", None
    for seed in range(seeds):
        wl = synthetic(requests, dist_p, dist_o, seed=seed, num_prefixes=count, prefix_tokens=tokens)
        res = simulate_rate(
            wl, rate, rp.design, rp.model, rp.cost, engine=rp.engine, prefill_cost=rp.prefill_cost
        )
        for m, x in _percentiles(*_calibrated(res, zl, seed, excess_stretches(res, zl, rp))).items():
            acc[m].append(x)
        stability = getattr(res, "stability", None)  # the utilisation report, where the simulator has one
        if seed == 0 and stability is not None:
            load, stable = stability.describe(), stability.stable
    return Percentiles(*(statistics.fmean(acc[m]) for m in METRICS)), load, stable


def validate(
    results: dict[str, Any],
    profiles: dict[str, Profile],
    *,
    seeds: int | None = None,
    link: Link = LOOPBACK_TCP,
    model: ModelSpec | None = None,
    shared_calibration: bool = True,
    stack_cpu: StackCpu = "shared",
) -> list[ValidationRow]:
    """Replay every measured (design, dataset, rate) point of an ``e2e.py --profile`` results.json.

    ``profiles`` maps the profile file names results.json records to the loaded profiles (one profile alone is
    used for every instance). ``model`` defaults to the run's recorded HF config (it sizes the KV transfer);
    ``seeds`` defaults to ``seeds_for(num_prompts)``. ``shared_calibration``: the per-emitted-token cost fitted
    across every design's zero-load runs at once (``shared_token_overhead``), else to each design's own; both
    only where the stack's CPU was not read from /proc (``measured_stack_cost``). ``stack_cpu``: where the
    replay's engines pay that cost (``EngineConfig.stack_cpu``); ``serial`` fits it rather than measuring it.
    """
    replay = results.get("replay", {})
    if model is None:
        cfg = replay.get("model_config")
        if cfg is None:
            raise ValueError("results.json has no replay.model_config: pass model= or rerun e2e.py --profile")
        model = ModelSpec.from_hf_config(cfg, name="measured")
    replays: dict[str, Replay | str] = {}
    slo = slo_targets(results)
    rows = []
    points: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for entry in results.get("results", []):
        points.setdefault((str(entry["dataset"]), float(entry["rate"]), str(entry["design"])), []).append(
            entry
        )
    for design in sorted({d for _, _, d in points}):
        found = replay_for(design, results, profiles, model, link)
        if isinstance(found, Replay):
            found = replace(found, engine=replace(found.engine, stack_cpu=stack_cpu))
        replays[design] = found
    lens = {
        dataset: lengths(entries[0], replay)
        for (dataset, _, _), entries in sorted(points.items())
        if dataset not in UNMODELLED
    }
    ready = {d: rp for d, rp in replays.items() if isinstance(rp, Replay)}
    # the stack's CPU as /proc read it, else (or with ``serial``) fitted
    overhead = measured_stack_cost(results, list(points.values())) if stack_cpu == "shared" else None
    if overhead is None and shared_calibration:
        overhead = shared_token_overhead(decode_anchors(ready, replay, lens))
    for (dataset, rate, design), entries in sorted(points.items()):
        # Repeats of a point are compared as one: their median against the prediction (itself a mean over
        # arrival samples), with their range beside it.
        runs = [measured_percentiles(e["bench"]) for e in entries]
        entry = entries[0]
        prompt, output = lengths(entry, replay)
        n = int(entry["bench"].get("completed") or replay.get("num_prompts") or 0)
        foreign = [f for e in entries if (f := e["bench"].get("foreign_cpu_cores")) is not None]
        late = [x for e in entries if (x := e.get("late_first_chunk_share")) is not None]
        caches = [e["prefix_cache"] for e in entries if e.get("prefix_cache")]
        queried = sum(float(c.get("queried_tokens") or 0) for c in caches)
        hit_share = sum(float(c.get("hit_tokens") or 0) for c in caches) / queried if queried else None
        goodputs = [float(g) for e in entries if (g := e["bench"].get("request_goodput")) is not None]
        goodputs = goodputs if slo is not None else []
        row = ValidationRow(
            design,
            dataset,
            rate,
            across(runs, statistics.median),
            None,
            prompt,
            output,
            n,
            foreign_cpu_cores=max(foreign) if foreign else None,
            late_share=statistics.fmean(late) if late else None,
            repeats=len(runs),
            measured_low=across(runs, min) if len(runs) > 1 else None,
            measured_high=across(runs, max) if len(runs) > 1 else None,
            cache_hit_share=hit_share,
            measured_goodput=statistics.median(goodputs) if goodputs else None,
            goodput_low=min(goodputs) if goodputs else None,
            goodput_high=max(goodputs) if goodputs else None,
            cpu=cpu_use(entries),
        )
        if dataset in UNMODELLED:
            rows.append(replace(row, skipped=UNMODELLED[dataset]))
            continue
        rp = replays[design]
        if isinstance(rp, str):
            rows.append(replace(row, skipped=rp))
            continue
        zl = zero_load(rp, replay, design, dataset, prompt, output, overhead)
        prefixes = shared_prefix(replay, dataset)
        row = replace(row, prefixes=prefixes[0])
        traces = [arrival_requests(e) for e in entries]
        if all(t is not None for t in traces):
            # Each run against its own replay, the point's median against the replays' median.
            k = seeds or ZERO_LOAD_DRAWS
            each = [
                predict_run(rp, with_prefixes(t, *prefixes, seed=j), rate, k, zl, slo)
                for j, t in enumerate(traces)
                if t is not None
            ]
            predicted, load = across([p.percentiles for p in each], statistics.median), each[0].load
            flags = [p.stable for p in each]
            stable = None if None in flags else all(flags)
            sample = "own arrivals"
            # the replayed share within the SLOs at the rate each run was served at
            served = [
                p.within_slo * float(e["bench"].get("request_throughput") or 0)
                for p, e in zip(each, entries, strict=True)
                if p.within_slo is not None
            ]
            if served:
                row = replace(row, predicted_goodput=statistics.median(served))
            engine = [
                (m, p.engine_ttft_s * 1000)
                for p, e in zip(each, entries, strict=True)
                if (m := measured_engine_ttft_ms(e)) is not None and p.engine_ttft_s is not None
            ]
            means = [float(e["bench"]["mean_ttft_ms"]) for e in entries if e["bench"].get("mean_ttft_ms")]
            api = [a for e in entries if (a := measured_api_ttft_ms(e)) is not None]
            if engine and means:
                row = replace(
                    row,
                    measured_engine_ttft_ms=statistics.median(m for m, _ in engine),
                    predicted_engine_ttft_ms=statistics.median(p for _, p in engine),
                    measured_mean_ttft_ms=statistics.median(means),
                    measured_api_ttft_ms=statistics.median(api) if api else None,
                )
        else:
            k = seeds or seeds_for(n)
            predicted, load, stable = predict(rp, prompt, output, rate, n, k, zl, prefixes)
            sample = "poisson"
        rows.append(
            replace(
                row,
                predicted=predicted,
                seeds=k,
                zero_load=zl.describe(),
                load=load,
                stable=stable,
                arrivals=sample,
            )
        )
    return rows


@dataclass(frozen=True)
class OrderCheck:
    """Which design was best on ``metric`` at one (dataset, rate), measured and predicted: the lowest p95 TTFT or
    TPOT, the highest goodput."""

    dataset: str
    rate: float
    metric: str
    measured_best: str
    predicted_best: str
    # the predicted best design's measured range reaches the measured best's: the repeats cannot tell them apart
    within_spread: bool = False

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "goodput"

    @property
    def matches(self) -> bool:
        return self.measured_best == self.predicted_best or self.within_spread


def orderings(rows: list[ValidationRow]) -> list[OrderCheck]:
    """For each (dataset, rate) replayed in two designs or more: which design is lowest on p95 TTFT and on p95
    TPOT, and highest on goodput (where the run had SLOs), measured and predicted."""
    by: dict[tuple[str, float], list[ValidationRow]] = {}
    for r in rows:
        if r.predicted is not None and r.measured is not None:
            by.setdefault((r.dataset, r.rate), []).append(r)
    out = []
    for (dataset, rate), group in sorted(by.items()):
        if len(group) < 2:
            continue
        for metric in ("p95_ttft_ms", "p95_tpot_ms"):
            m = min(group, key=lambda r: r.measured.get(metric) if r.measured else math.inf)
            p = min(group, key=lambda r: r.predicted.get(metric) if r.predicted else math.inf)
            out.append(OrderCheck(dataset, rate, metric, m.design, p.design))
        scored = [r for r in group if r.measured_goodput is not None and r.predicted_goodput is not None]
        if len(scored) >= 2:
            m = max(scored, key=lambda r: r.measured_goodput or 0.0)
            p = max(scored, key=lambda r: r.predicted_goodput or 0.0)
            # rows with a measured goodput have its range (a 0.0 low is a value, not a missing one)
            assert p.goodput_high is not None and m.goodput_low is not None
            tied = p.goodput_high >= m.goodput_low
            out.append(OrderCheck(dataset, rate, "goodput", m.design, p.design, p is not m and tied))
    return out


def within(row: ValidationRow, tol: float, metrics: tuple[str, ...] = ("p95_ttft_ms", "p95_tpot_ms")) -> bool:
    """Whether every ratio in ``metrics`` is within ``tol`` of 1."""
    ratios = [row.ratio(m) for m in metrics]
    return all(r is not None and abs(r - 1) <= tol for r in ratios)


def format_validation(rows: list[ValidationRow], tol: float = 0.25) -> str:
    """A text table: measured (the median of a point's repeats, their range in brackets), predicted and
    predicted/measured per metric; skipped points and the design ordering check below it."""
    head = ["design", "dataset", "rate", "load"]
    for m in METRICS:
        head += [f"{m} meas", "pred", "ratio"]
    head += [
        "goodput meas",
        "pred",
        f"p95 within {tol:.0%}",
        "late streams",
        "prefix-cache hits",
        "other jobs",
    ]
    table = [head]
    for r in rows:
        if r.predicted is None or r.measured is None:
            continue
        cells = [r.design, r.dataset, f"{r.rate:g}", r.load or "-"]
        for m in METRICS:
            ratio = r.ratio(m)
            spread = (
                f" [{r.measured_low.get(m):.1f}-{r.measured_high.get(m):.1f}]"
                if r.measured_low is not None and r.measured_high is not None
                else ""
            )
            cells += [
                f"{r.measured.get(m):.1f}{spread}",
                f"{r.predicted.get(m):.1f}",
                f"{ratio:.2f}" if ratio else "-",
            ]
        g = r.measured_goodput
        lo_hi = f" [{r.goodput_low:.2f}-{r.goodput_high:.2f}]" if r.goodput_low != r.goodput_high else ""
        cells.append("-" if g is None else f"{g:.2f}{lo_hi}")
        cells.append("-" if r.predicted_goodput is None else f"{r.predicted_goodput:.2f}")
        cells.append("yes" if within(r, tol) else "NO")
        cells.append("-" if r.late_share is None else f"{r.late_share:.0%}")
        hits = r.cache_hit_share
        cells.append("-" if hits is None else f"{hits:.1%}" + (" NOT MODELLED" if r.cached else ""))
        f = r.foreign_cpu_cores
        cells.append("-" if f is None else f"{f:.2f} cores" + (" DISTURBED" if r.disturbed else ""))
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    replayed = [r for r in rows if r.predicted is not None and r.measured is not None]
    if replayed:
        steady = [r for r in replayed if r.stable is not False]
        held = sum(within(r, tol) for r in steady)
        lines.append("")
        lines.append(
            f"p95 TTFT and p95 TPOT both within {tol:.0%} at {held} of {len(steady)} stable points"
            + (f" ({len(replayed) - len(steady)} unstable left out)" if len(steady) < len(replayed) else "")
        )
        calib = sorted({(r.design, r.dataset, r.zero_load, r.seeds, r.arrivals) for r in replayed})
        lines.append("")
        lines += [
            f"{d} {ds}: zero-load {z}; "
            + (
                f"each run replayed on its own arrivals, mean of {k} zero-load draws"
                if a == "own arrivals"
                else f"mean of {k} arrival samples"
            )
            for d, ds, z, k, a in calib
        ]
    inside = [
        r for r in rows if r.measured_engine_ttft_ms is not None and r.predicted_engine_ttft_ms is not None
    ]
    if inside:
        lines.append("")
        lines.append(
            "TTFT inside the engines (mean, on the instances that computed the prompts: P/D's prefill instance; "
            "measured: vLLM's queue + prefill time; predicted: the replay's, from the iteration boundary after "
            "arrival), with those API servers' and the client's mean TTFT beside it (the rest is the HTTP stack, "
            "and for P/D the transfer and the decode instance's first step):"
        )
        for r in inside:
            eng_m, eng_p = r.measured_engine_ttft_ms or 0.0, r.predicted_engine_ttft_ms or 0.0
            api = (
                f"; vLLM's API server {r.measured_api_ttft_ms:.1f}"
                if r.measured_api_ttft_ms is not None
                else ""
            )
            client = (
                f"{api}; client {r.measured_mean_ttft_ms:.1f} ms"
                if r.measured_mean_ttft_ms is not None
                else ""
            )
            lines.append(
                f"  {r.design} {r.dataset} rate {r.rate:g}: engines {eng_m:.1f} ms measured, {eng_p:.1f} predicted "
                f"({eng_p / eng_m:.2f}x){client}"
                if eng_m > 0
                else f"  {r.design} {r.dataset} rate {r.rate:g}: -"
            )
    cores = [r for r in rows if r.cpu is not None]
    if cores:
        lines.append("")
        lines.append(
            "Where the cores went (CPU read from /proc over each run, medians over the repeats; the replay charges "
            "the stack's CPU per emitted token, see its ms per token above):"
        )
        lines += [f"  {r.design} {r.dataset} rate {r.rate:g}: {r.cpu.describe()}" for r in cores if r.cpu]
    skipped = sorted({(r.dataset, r.design, r.skipped) for r in rows if r.skipped})
    if skipped:
        lines.append("")
        lines += [f"skipped {ds} ({d}): {why}" for ds, d, why in skipped]
    checks = orderings(rows)
    if checks:
        lines.append("")
        lines += [
            f"{c.dataset} rate {c.rate:g} {c.metric}: {'higher' if c.higher_is_better else 'lower'} measured "
            f"{c.measured_best}, predicted {c.predicted_best} "
            f"({'match' if c.measured_best == c.predicted_best else 'tie within the repeats' if c.matches else 'MISMATCH'})"
            for c in checks
        ]
    return "\n".join(lines)
