"""Latency percentiles and SLO attainment, measured the way ``vllm bench serve`` does.

TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1), per request (0 for one-token
outputs). A request is good when both its TTFT and TPOT meet the SLOs; a dropped request is never good. Requests
arriving in the warm-up window (before ``warmup_s``) run but are left out of every statistic: they met an empty
cluster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestRecord:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    mode: str  # the plan's mode, or "dropped"
    prefill_instance: str | None
    decode_instance: str | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    exposed_transfer_s: float = 0.0
    dropped: str = ""
    cached_tokens: int = 0  # prompt tokens the computing instance's prefix cache held
    prefill_done_s: float | None = None  # arrival to the end of the prompt's last compute step

    def good(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        return (
            not self.dropped
            and self.ttft_s is not None
            and self.ttft_s <= ttft_slo_s
            and (self.tpot_s <= tpot_slo_s if self.tpot_s is not None else self.output_tokens <= 1)
        )


@dataclass(frozen=True)
class Summary:
    requests: int
    completed: int
    dropped: int
    ttft_s: dict[int, float]  # percentile -> seconds
    tpot_s: dict[int, float]
    attainment: float  # share of all requests meeting both SLOs
    ttft_slo_s: float
    tpot_slo_s: float
    duration_s: float  # first arrival to last finish
    output_tokens_per_s: float
    mean_exposed_transfer_s: float
    warmup_excluded: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("ttft_s", "tpot_s"):
            d[key] = {f"p{q}": (None if math.isnan(v) else v) for q, v in d[key].items()}
        return d


def summarize(
    records: Sequence[RequestRecord], ttft_slo_s: float, tpot_slo_s: float, warmup_s: float = 0.0
) -> Summary:
    everything = records
    records = [r for r in records if r.arrival_s >= warmup_s]
    done = [r for r in records if not r.dropped and r.e2e_s is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    good = sum(r.good(ttft_slo_s, tpot_slo_s) for r in records)
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.arrival_s + (r.e2e_s or 0.0) for r in done), default=start)
    duration = end - start
    transfers = [r.exposed_transfer_s for r in done if r.mode == "transfer"]
    return Summary(
        requests=len(records),
        completed=len(done),
        dropped=len(records) - len(done),
        ttft_s={q: percentile(ttfts, q) for q in PERCENTILES},
        tpot_s={q: percentile(tpots, q) for q in PERCENTILES},
        attainment=good / len(records) if records else 0.0,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        duration_s=duration,
        output_tokens_per_s=sum(r.output_tokens for r in done) / duration if duration > 0 else 0.0,
        mean_exposed_transfer_s=sum(transfers) / len(transfers) if transfers else 0.0,
        warmup_excluded=len(everything) - len(records),
    )
