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

DistKind = Literal["fixed", "uniform", "lognormal"]


@dataclass(frozen=True)
class LengthDist:
    """Token counts: ``fixed`` (a), ``uniform`` in [a, b], or ``lognormal`` with mean a and log-sigma b.

    Lognormal draws are clipped to [lo, hi] (hi 0: no upper bound); real prompt lengths are heavy-tailed.
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
        else:
            mu = math.log(self.a) - self.b**2 / 2  # so the mean is ``a``
            value = rng.lognormvariate(mu, self.b)
        n = max(self.lo, round(value))
        return min(n, self.hi) if self.hi else n

    @property
    def mean(self) -> float:
        """The nominal mean (before clipping)."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """``N``, ``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA[:MIN[:MAX]]``."""
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            kind, nums = parts[0], [float(x) for x in parts[1:]]
            if kind == "fixed" and len(nums) == 1:
                return cls("fixed", nums[0])
            if kind == "uniform" and len(nums) == 2 and nums[0] <= nums[1]:
                return cls("uniform", nums[0], nums[1])
            if kind == "lognormal" and 2 <= len(nums) <= 4:
                lo = int(nums[2]) if len(nums) > 2 else 1
                hi = int(nums[3]) if len(nums) > 3 else 0
                return cls("lognormal", nums[0], nums[1], lo, hi)
        except ValueError:
            pass
        raise ValueError(
            f"bad length spec {spec!r}: use N, fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA[:MIN[:MAX]]"
        )


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


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

    def __post_init__(self) -> None:
        if not (len(self.unit_arrivals) == len(self.prompts) == len(self.outputs)):
            raise ValueError("arrivals, prompts and outputs must have equal lengths")

    def __len__(self) -> int:
        return len(self.prompts)

    def at_rate(self, rate: float) -> list[Request]:
        if rate <= 0:
            raise ValueError("rate must be positive")
        return [
            Request(i, t / rate, p, o)
            for i, (t, p, o) in enumerate(zip(self.unit_arrivals, self.prompts, self.outputs, strict=True))
        ]

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompts) / max(len(self.prompts), 1)

    @property
    def mean_output(self) -> float:
        return sum(self.outputs) / max(len(self.outputs), 1)


def synthetic(
    n: int,
    prompt: LengthDist,
    output: LengthDist,
    *,
    arrival: Literal["poisson", "gamma"] = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """``n`` requests with Poisson (exponential gaps) or gamma arrivals.

    Gamma gaps have shape ``burstiness`` and mean 1 (as vLLM's ``--burstiness``): 1 is Poisson, < 1 burstier,
    > 1 more regular.
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
        prompts.append(prompt.sample(rng))
        outputs.append(max(1, output.sample(rng)))
    return Workload(tuple(times), tuple(prompts), tuple(outputs))


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
            rows.append(
                (float(rec["arrival_s"]), int(rec["prompt_tokens"]), max(1, int(rec["output_tokens"])))
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {lineno}: {exc!r}") from exc
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
