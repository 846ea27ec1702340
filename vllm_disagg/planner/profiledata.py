"""A measured performance profile of one serving instance, and the pure arithmetic that turns timings into it.

The HTTP side lives in ``profile.py``; everything here is deterministic and unit-tested with synthetic timings.
A profile replaces the roofline estimates in ``plan`` and ``simulate``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

PROFILE_VERSION = 1


class PrefillPoint(BaseModel):
    prompt_tokens: int
    seconds: float  # median latency of a max_tokens=1 request with this prompt


class DecodePoint(BaseModel):
    batch: int
    step_s: float  # median inter-token gap while ``batch`` streams run together
    context_tokens: int = 0  # prompt length of the streams (decode steps read their KV)


class Profile(BaseModel):
    """What a serving instance measurably does: prefill tokens/s and decode step time vs batch size."""

    version: int = PROFILE_VERSION
    source: str = ""
    model: str = ""
    tp: int = 1  # GPUs behind the measured instance (per-GPU rates divide by it)
    prefill_tokens_per_s: float
    prefill_overhead_s: float = 0.0  # fixed part of a prefill request (HTTP, scheduling, the one decode step)
    prefill_points: list[PrefillPoint] = Field(default_factory=list)
    decode_points: list[DecodePoint]
    kv_capacity_tokens: int | None = None
    created_unix: float = 0.0

    def decode_step_s(self, batch: int) -> float:
        """Step time at ``batch``: linear between measured points, the last slope beyond them, flat below (and flat
        everywhere with a single point)."""
        pts = sorted((p.batch, p.step_s) for p in self.decode_points)
        if not pts:
            raise ValueError("profile has no decode points")
        if batch <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:], strict=False):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        slope = max(0.0, (s1 - s0) / (b1 - b0))
        return s1 + slope * (batch - b1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.model_validate_json(Path(path).read_text())


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x``; returns (intercept, slope)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need at least two (x, y) points")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("x values must not all be equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def fit_prefill(points: Sequence[PrefillPoint]) -> tuple[float, float]:
    """(tokens/s, overhead s) from latency vs prompt length: ``t = overhead + P / rate``.

    Fitting the slope (rather than dividing P by t at one length) cancels the fixed HTTP + scheduling cost that
    dominates short prompts.
    """
    intercept, slope = fit_line([p.prompt_tokens for p in points], [p.seconds for p in points])
    if slope <= 0:
        raise ValueError("prefill latency does not grow with prompt length; use longer prompts")
    return 1.0 / slope, max(0.0, intercept)


def steady_gaps(streams: Sequence[Sequence[float]]) -> list[float]:
    """Inter-token gaps from chunk arrival times, kept only while every stream is running.

    The window starts when the last stream got its first token (all of them are in the batch) and ends when the
    first stream got its last token (the batch starts shrinking); gaps outside it are measured at a smaller batch.
    Falls back to all gaps after each stream's first token when the window holds none.
    """
    live = [list(s) for s in streams if len(s) >= 2]
    if not live:
        return []
    start = max(s[0] for s in live)
    end = min(s[-1] for s in live)
    gaps = [b - a for s in live for a, b in zip(s, s[1:], strict=False) if a >= start and b <= end]
    return gaps or [b - a for s in live for a, b in zip(s, s[1:], strict=False)]


def decode_step_from_streams(streams: Sequence[Sequence[float]]) -> float:
    """The median steady-state inter-token gap: one decode step at this batch size."""
    gaps = steady_gaps(streams)
    if not gaps:
        raise ValueError("no stream produced two or more tokens")
    return statistics.median(gaps)


def parse_kv_capacity(metrics_text: str) -> int | None:
    """KV capacity in tokens from vLLM's ``/metrics``: ``num_gpu_blocks`` x ``block_size`` of cache_config_info."""
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:cache_config_info{"):
            continue
        labels = dict(
            part.split("=", 1)
            for part in line[line.index("{") + 1 : line.rindex("}")].split(",")
            if "=" in part
        )
        try:
            blocks = int(labels.get("num_gpu_blocks", "").strip('"'))
            block_size = int(labels.get("block_size", "").strip('"'))
        except ValueError:
            return None
        return blocks * block_size
    return None
