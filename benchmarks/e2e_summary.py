"""The arithmetic of benchmarks/e2e.py's comparison of designs: medians and spreads over repeats, and whether the
adaptive design beats the fixed ones (issue #18's criteria). Pure: tests/test_e2e_summary.py checks it.

Each result entry is ``{"design", "dataset", "rate", "repeat", "bench": <vllm bench serve json>}``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

FIXED = ("pd", "colocated")
METRICS = ("request_goodput", "p95_ttft_ms", "p95_tpot_ms")


@dataclass(frozen=True)
class Spread:
    """A metric over a point's repeats: the median and the range."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        vs = sorted(values)
        if not vs:
            raise ValueError("no values")
        return cls(statistics.median(vs), vs[0], vs[-1], len(vs))

    @property
    def width(self) -> float:
        return self.hi - self.lo

    def render(self, fmt: str = ".2f") -> str:
        if self.n == 1:
            return format(self.median, fmt)
        return f"{self.median:{fmt}} [{self.lo:{fmt}}-{self.hi:{fmt}}]"


def metric(bench: dict[str, Any], key: str) -> float:
    """One metric of a vllm bench serve result; goodput absent (no --goodput) or None counts as 0."""
    return float(bench.get(key) or 0.0)


def spreads(results: Sequence[dict[str, Any]]) -> dict[tuple[str, float, str], dict[str, Spread]]:
    """(dataset, rate, design) -> metric -> its spread over the repeats."""
    runs: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((str(r["dataset"]), float(r["rate"]), str(r["design"])), []).append(r["bench"])
    return {
        key: {m: Spread.of(metric(b, m) for b in benches) for m in METRICS} for key, benches in runs.items()
    }


@dataclass(frozen=True)
class Verdict:
    """Adaptive against the fixed designs at one (dataset, rate)."""

    dataset: str
    rate: float
    vs_best_fixed: (
        float  # adaptive goodput / the better fixed design's (medians); inf when both are 0 and it isn't
    )
    vs_worst_fixed: float  # ... / the worse fixed design's
    tpot_excess_ms: float  # adaptive p95 TPOT - colocated's (medians)
    tpot_allowance_ms: float  # the run-to-run spread both show: the larger of their ranges

    @property
    def holds_its_own(self) -> bool:
        """Goodput >= 0.95x the better fixed design's and p95 TPOT no worse than colocated's beyond the spread."""
        return self.vs_best_fixed >= 0.95 and self.tpot_excess_ms <= self.tpot_allowance_ms

    @property
    def beats_both(self) -> bool:
        return self.vs_best_fixed >= 1.1


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 1.0 if a == 0 else float("inf")


def verdicts(results: Sequence[dict[str, Any]]) -> list[Verdict]:
    """One verdict per (dataset, rate) measured in all three designs."""
    sp = spreads(results)
    out = []
    for dataset, rate in sorted({(d, r) for d, r, _ in sp}):
        got = {design: sp.get((dataset, rate, design)) for design in ("adaptive", *FIXED)}
        a, pd_, co = got["adaptive"], got["pd"], got["colocated"]
        if a is None or pd_ is None or co is None:
            continue
        fixed = sorted((pd_["request_goodput"].median, co["request_goodput"].median))
        mine = a["request_goodput"].median
        excess = a["p95_tpot_ms"].median - co["p95_tpot_ms"].median
        allowance = max(a["p95_tpot_ms"].width, co["p95_tpot_ms"].width)
        out.append(Verdict(dataset, rate, _ratio(mine, fixed[1]), _ratio(mine, fixed[0]), excess, allowance))
    return out


def summary_rows(results: Sequence[dict[str, Any]], designs: Sequence[str]) -> list[dict[str, str]]:
    """The printed table: per (dataset, rate), each design's goodput and p95 TTFT/TPOT (median [range])."""
    sp = spreads(results)
    by_point = {v.dataset + f"@{v.rate:g}": v for v in verdicts(results)}
    rows = []
    for dataset, rate in sorted({(d, r) for d, r, _ in sp}):
        row = {"dataset": dataset, "rate": f"{rate:g}"}
        for design in designs:
            s = sp.get((dataset, rate, design))
            if s is None:
                continue
            row[f"goodput {design}"] = s["request_goodput"].render()
            row[f"p95 TTFT {design}"] = s["p95_ttft_ms"].render(".0f")
            row[f"p95 TPOT {design}"] = s["p95_tpot_ms"].render(".1f")
        steal = [e["bench"]["steal_share"] for e in results
                 if e["dataset"] == dataset and e["rate"] == rate and "steal_share" in e.get("bench", {})]  # fmt: skip
        if steal:  # the hypervisor's share of the CPUs while the point's runs ran: min-max over them
            row["steal %"] = f"{100 * min(steal):.0f}-{100 * max(steal):.0f}"
        v = by_point.get(f"{dataset}@{rate:g}")
        if v is not None:
            row["adaptive/best fixed"] = f"{v.vs_best_fixed:.2f}x"
            row["verdict"] = ("beats both" if v.beats_both else "holds") if v.holds_its_own else "LOSES"
        rows.append(row)
    return rows


def kind_rows(results: Sequence[dict[str, Any]], designs: Sequence[str]) -> list[dict[str, str]]:
    """Per (dataset, rate, design) of a mix of request kinds (entries whose ``by_output_len`` lists two or more
    output lengths), each kind's p50 and p95 TPOT and p95 TTFT (ms), median [range] over the repeats: a p95 over
    all requests is the worst kind's, and which kind pays is what tells a policy's trade-off."""
    groups: dict[tuple[str, float, str], list[dict[str, dict[str, float]]]] = {}
    for e in results:
        kinds = e.get("by_output_len") or {}
        if len(kinds) >= 2:
            groups.setdefault((e["dataset"], e["rate"], e["design"]), []).append(kinds)
    order = {d: i for i, d in enumerate(designs)}
    rows = []
    for (dataset, rate, design), runs in sorted(
        groups.items(), key=lambda g: (g[0][0], g[0][1], order.get(g[0][2], 99))
    ):
        for length in sorted({n for r in runs for n in r}, key=int):
            got = [r[length] for r in runs if length in r]
            rows.append({
                "dataset": dataset, "rate": f"{rate:g}", "design": design, "output tokens": length,
                "requests": f"{statistics.median(g['requests'] for g in got):g}",
                "p50 TPOT": Spread.of(g["p50_tpot_ms"] for g in got).render(".1f"),
                "p95 TPOT": Spread.of(g["p95_tpot_ms"] for g in got).render(".1f"),
                "p95 TTFT": Spread.of(g["p95_ttft_ms"] for g in got).render(".0f"),
            })  # fmt: skip
    return rows
