"""Goodput: the highest request rate at which a target share of requests meets every SLO (DistServe's metric).

The search is monotone by construction: it brackets the rate between a passing and a failing probe and only ever
moves the passing end up past other passes and the failing end down past other failures, so every probe below the
answer passed and every probe above it failed. Attainment measured with common random numbers (see
``workload.py``) is close to monotone in rate; where noise makes it dip, the answer is the first crossing found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GoodputResult:
    rate: float  # 0.0 when not even the lowest probed rate passes
    target: float
    probes: tuple[tuple[float, float], ...] = field(default=())  # (rate, attainment) in probe order
    # probed rates past a pool's capacity: counted as 0 attainment, but no measurement (shown as "unstable")
    unstable: tuple[float, ...] = field(default=())

    def curve(self) -> list[tuple[float, float]]:
        """Probes sorted by rate, attainment made non-increasing (the running minimum): the monotone envelope."""
        out: list[tuple[float, float]] = []
        low = 1.0
        for rate, att in sorted(self.probes):
            low = min(low, att)
            out.append((rate, low))
        return out


def search_goodput(
    attainment_at: Callable[[float], float],
    *,
    target: float = 0.9,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_rate: float = 1e-3,
    max_rate: float = 1e5,
    max_probes: int = 40,
) -> GoodputResult:
    """Exponential bracketing from ``start`` (doubling up or halving down), then bisection to ``rel_tol``."""
    if not 0 < target <= 1 or start <= 0:
        raise ValueError("target must be in (0, 1] and start > 0")
    probes: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        att = attainment_at(rate)
        probes.append((rate, att))
        return att >= target

    lo, hi = 0.0, 0.0
    rate = start
    if ok(rate):
        lo = rate
        while True:
            rate *= 2
            if rate > max_rate:
                return GoodputResult(lo, target, tuple(probes))
            if not ok(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        while True:
            rate /= 2
            if rate < min_rate:
                return GoodputResult(0.0, target, tuple(probes))
            if ok(rate):
                lo = rate
                break
            hi = rate
    while hi - lo > rel_tol * lo and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return GoodputResult(lo, target, tuple(probes))
