"""Seeded request streams: arrival processes, length distributions, and JSONL traces.

Arrivals are drawn once at unit rate and scaled by 1/rate, and lengths are drawn once, so runs at different rates
see the same requests in the same order (common random numbers): latency-vs-rate curves and the goodput search
then move only because the rate moved, not because the sample did.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DistKind = Literal["fixed", "uniform", "lognormal", "exp", "gamma"]


@dataclass(frozen=True)
class LengthDist:
    """Token counts: ``fixed`` (a), ``uniform`` in [a, b], ``lognormal`` with mean a and log-sigma b, ``exp`` with
    mean a (CV 1: the textbook M/M queueing workload), or ``gamma`` with mean a and coefficient of variation b.

    Lognormal, exponential and gamma draws are clipped to [lo, hi] (hi 0: no upper bound); real prompt lengths are
    heavy-tailed.
    """

    kind: DistKind
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "exp":
            value = rng.expovariate(1.0 / self.a)
        elif self.kind == "gamma":
            shape = 1.0 / self.b**2  # CV = 1/sqrt(shape)
            value = rng.gammavariate(shape, self.a / shape)
        else:
            mu = math.log(self.a) - self.b**2 / 2  # so the mean is ``a``
            value = rng.lognormvariate(mu, self.b)
        n = max(self.lo, round(value))
        return min(n, self.hi) if self.hi else n

    @property
    def upper(self) -> float:
        """The longest length this can draw (``inf``: unbounded)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return self.b
        return self.hi or math.inf

    @property
    def mean(self) -> float:
        """The nominal mean (before clipping)."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """``N``, ``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA[:MIN[:MAX]]``, ``exp:MEAN[:MIN[:MAX]]``,
        ``gamma:MEAN:CV[:MIN[:MAX]]``; every mean, sigma and CV positive."""
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                parts = ["fixed", parts[0]]
            kind, nums = parts[0], [float(x) for x in parts[1:]]
            if not all(math.isfinite(x) for x in nums):
                raise ValueError("not finite")
            # token counts (N, LO, HI, MIN, MAX) are whole: 2048.5 is a typo, not a length to round
            counts = nums if kind in ("fixed", "uniform") else nums[{"exp": 1}.get(kind, 2) :]
            if any(x != int(x) for x in counts):
                raise ValueError("not whole")
            if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
                return cls("fixed", nums[0])
            if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
                return cls("uniform", nums[0], nums[1])
            shaped = {"lognormal": 2, "gamma": 2, "exp": 1}.get(kind)
            if shaped and shaped <= len(nums) <= shaped + 2 and min(nums[:shaped]) > 0:
                bounds = nums[shaped:]
                lo = int(bounds[0]) if bounds else 1
                hi = int(bounds[1]) if len(bounds) > 1 else 0
                if lo >= 1 and (hi == 0 or hi >= lo):
                    return cls(kind, nums[0], nums[1] if shaped == 2 else 0.0, lo, hi)  # type: ignore[arg-type]
        except ValueError:
            pass
        raise ValueError(
            f"bad length spec {spec!r}: use N, fixed:N, uniform:LO:HI, lognormal:MEAN:SIGMA[:MIN[:MAX]], "
            "exp:MEAN[:MIN[:MAX]] or gamma:MEAN:CV[:MIN[:MAX]] (finite; N, LO, HI, MIN, MAX whole numbers; "
            "N, LO >= 1; positive mean, sigma and CV; 1 <= MIN <= MAX)"
        )


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    # the shared prefix the prompt begins with (-1: none) and its tokens: an instance whose prefix cache holds it
    # computes only the rest
    prefix: int = -1
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    """A fixed sample of requests whose arrival times can be replayed at any rate.

    ``unit_arrivals`` are the arrival times at 1 request/s (synthetic) or at the trace's own mean rate scaled to 1
    (traces); ``at_rate(r)`` divides them by r.
    """

    unit_arrivals: tuple[float, ...]
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]
    native_rate: float = 0.0  # a trace's own mean rate (0 for synthetic workloads)
    # each request's shared prefix (empty: none share one) and the tokens of every prefix
    prefixes: tuple[int, ...] = ()
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not (len(self.unit_arrivals) == len(self.prompts) == len(self.outputs)):
            raise ValueError("arrivals, prompts and outputs must have equal lengths")
        if self.prefixes and len(self.prefixes) != len(self.prompts):
            raise ValueError("prefixes must name one prefix per request")

    def __len__(self) -> int:
        return len(self.prompts)

    def at_rate(self, rate: float, duration_s: float | None = None) -> list[Request]:
        """The requests at ``rate``; with ``duration_s``, only those arriving within it (a fixed-length run)."""
        if rate <= 0:
            raise ValueError("rate must be positive")
        horizon = duration_s * rate if duration_s is not None else math.inf
        prefixes = self.prefixes or (-1,) * len(self.prompts)
        return [
            Request(i, t / rate, p, o, k, self.prefix_tokens if k >= 0 else 0)
            for i, (t, p, o, k) in enumerate(
                zip(self.unit_arrivals, self.prompts, self.outputs, prefixes, strict=True)
            )
            if t <= horizon
        ]

    def covers(self, rate: float, duration_s: float) -> bool:
        """Whether the sample's arrivals reach ``duration_s`` at ``rate`` (else a run at that rate ends early)."""
        return bool(self.unit_arrivals) and self.unit_arrivals[-1] / rate >= duration_s

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompts) / max(len(self.prompts), 1)

    @property
    def mean_output(self) -> float:
        return sum(self.outputs) / max(len(self.outputs), 1)


def requests_for_duration(duration_s: float, max_rate: float) -> int:
    """A sample size whose Poisson arrivals at ``max_rate`` outlast ``duration_s`` (mean + 6 sigma, + 10)."""
    mean = duration_s * max_rate
    return math.ceil(mean + 6 * math.sqrt(mean) + 10)


def synthetic(
    n: int,
    prompt: LengthDist,
    output: LengthDist,
    *,
    arrival: Literal["poisson", "gamma"] = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
    num_prefixes: int = 0,
    prefix_tokens: int = 0,
) -> Workload:
    """``n`` requests with Poisson (exponential gaps) or gamma arrivals.

    Gamma gaps have shape ``burstiness`` and mean 1 (as vLLM's ``--burstiness``): 1 is Poisson, < 1 burstier,
    > 1 more regular. With ``num_prefixes``, every prompt begins with one of that many shared prefixes of
    ``prefix_tokens`` (``shared_prefixes``), its length drawn as the rest of it.
    """
    if n <= 0:
        raise ValueError("need at least one request")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    rng = random.Random(seed)
    t, times, prompts, outputs = 0.0, [], [], []
    for _ in range(n):
        gap = rng.expovariate(1.0) if arrival == "poisson" else rng.gammavariate(burstiness, 1.0 / burstiness)
        t += gap
        times.append(t)
        prompts.append(prompt.sample(rng) + (prefix_tokens if num_prefixes else 0))
        outputs.append(max(1, output.sample(rng)))
    if not num_prefixes:
        return Workload(tuple(times), tuple(prompts), tuple(outputs))
    return Workload(
        tuple(times),
        tuple(prompts),
        tuple(outputs),
        0.0,
        shared_prefixes(n, num_prefixes, seed),
        prefix_tokens,
    )


def shared_prefixes(n: int, num_prefixes: int, seed: int = 0) -> tuple[int, ...]:
    """Which of ``num_prefixes`` shared prefixes each of ``n`` prompts begins with: each prefix as often as the
    others, in a shuffled order (vLLM's prefix-repetition dataset: prompts per prefix, then shuffled)."""
    if num_prefixes < 1:
        raise ValueError("need at least one prefix")
    ids = [i % num_prefixes for i in range(n)]
    random.Random(seed).shuffle(ids)
    return tuple(ids)


def parse_trace(lines: list[str]) -> Workload:
    """JSONL records ``{"arrival_s", "prompt_tokens", "output_tokens"}``; arrivals are sorted and rebased to 0.

    The unit arrivals are the trace's times x its mean rate, so ``at_rate(native_rate)`` replays it verbatim.
    """
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            row = (float(rec["arrival_s"]), int(rec["prompt_tokens"]), int(rec["output_tokens"]))
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise ValueError(f"trace line {lineno}: {exc!r}") from exc
        if not math.isfinite(row[0]) or row[1] < 1 or row[2] < 1:
            raise ValueError(
                f"trace line {lineno}: needs a finite arrival_s and prompt_tokens, output_tokens >= 1, got {rec}"
            )
        rows.append(row)
    if not rows:
        raise ValueError("empty trace")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    span = rows[-1][0] - t0
    native = (len(rows) - 1) / span if span > 0 and len(rows) > 1 else 1.0
    return Workload(
        tuple((t - t0) * native for t, _, _ in rows),
        tuple(p for _, p, _ in rows),
        tuple(o for _, _, o in rows),
        native_rate=native,
    )


def load_trace(path: str | Path) -> Workload:
    return parse_trace(Path(path).read_text().splitlines())
