"""PNG plots of simulation results. matplotlib is imported lazily (Agg backend) so the planner runs without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_disagg.planner.engine import IterationRecord
from vllm_disagg.planner.metrics import Summary


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_vs_rate(
    series: Mapping[str, Sequence[tuple[float, Summary, bool]]],
    out: str | Path,
    *,
    percentile: int = 95,
    title: str = "",
) -> Path:
    """p95 TTFT and p95 TPOT against request rate, one line per design, SLOs dashed.

    Points are ``(rate, summary, stable)``; the line joins stable points only, and a point past a pool's capacity
    is a red cross labelled "unstable" at the top of the axes (its percentile measures only the run's length)."""
    plt = _pyplot()
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    slo_ttft = slo_tpot = None
    for name, points in series.items():
        pts = sorted(points, key=lambda p: p[0])
        stable = [(r, s) for r, s, ok in pts if ok]
        rates = [r for r, _ in stable]
        line = ax_ttft.plot(rates, [s.ttft_s[percentile] * 1e3 for _, s in stable], marker="o", label=name)
        ax_tpot.plot(rates, [s.tpot_s[percentile] * 1e3 for _, s in stable], marker="o", label=name)
        colour = line[0].get_color()
        for rate, _, ok in pts:
            if ok:
                continue
            for ax in (ax_ttft, ax_tpot):
                ax.plot(
                    [rate], [0.95], marker="x", color=colour, markersize=9, transform=ax.get_xaxis_transform()
                )
                ax.annotate("unstable", (rate, 0.95), xycoords=ax.get_xaxis_transform(), color="red",
                            fontsize=7, ha="center", va="bottom")  # fmt: skip
        if pts:
            slo_ttft, slo_tpot = pts[0][1].ttft_slo_s, pts[0][1].tpot_slo_s
    for ax, slo, what in ((ax_ttft, slo_ttft, "TTFT"), (ax_tpot, slo_tpot, "TPOT")):
        if slo:
            ax.axhline(slo * 1e3, color="grey", linestyle="--", linewidth=1, label=f"{what} SLO")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"p{percentile} {what} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_ttft.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _window(iters: Sequence[IterationRecord], start: float, span: float) -> list[IterationRecord]:
    return [it for it in iters if start <= it.start < start + span]


def plot_timeline(
    colocated: Sequence[IterationRecord],
    disaggregated: Sequence[IterationRecord],
    out: str | Path,
    *,
    start: float | None = None,
    span: float = 2.0,
    title: str = "",
) -> Path:
    """Per-iteration durations over ``span`` seconds: a colocated replica (iterations carrying prefill marked)
    above a disaggregated decode instance (decode steps only)."""
    plt = _pyplot()
    if start is None:
        end = max((it.start for it in colocated), default=0.0)
        start = max(0.0, end / 2 - span / 2)
    fig, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True, sharey=True)
    rows = (("colocated replica", colocated), ("disaggregated decode instance", disaggregated))
    for ax, (label, iters) in zip(axes, rows, strict=True):
        shown = _window(iters, start, span)
        for kind, color, pick in (
            ("decode step", "tab:blue", lambda it: it.prefill_tokens == 0),
            ("iteration with prefill", "tab:red", lambda it: it.prefill_tokens > 0),
        ):
            sel = [it for it in shown if pick(it)]
            if sel:
                ax.bar(
                    [it.start - start for it in sel],
                    [it.duration * 1e3 for it in sel],
                    width=[it.duration for it in sel],
                    align="edge",
                    color=color,
                    edgecolor="white",
                    linewidth=0.4,
                    label=kind,
                )
        ax.set_ylabel("iteration (ms)")
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="upper right")
    axes[-1].set_xlabel(f"time since t={start:.1f} s (s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
