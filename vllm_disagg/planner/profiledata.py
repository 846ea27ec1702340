"""A measured performance profile of one serving instance, and the pure arithmetic that turns timings into it.

The HTTP side lives in ``profile.py``; everything here is deterministic and unit-tested with synthetic timings.
A profile replaces the roofline estimates in ``plan`` and ``simulate``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

PROFILE_VERSION = 1


class PrefillPoint(BaseModel):
    prompt_tokens: int = Field(ge=1)
    seconds: float = Field(gt=0)  # median latency of a max_tokens=1 request with this prompt


class DecodePoint(BaseModel):
    batch: int = Field(ge=1)
    step_s: float = Field(gt=0)  # median inter-token gap while ``batch`` streams run together
    context_tokens: int = Field(default=0, ge=0)  # prompt length of the streams (decode steps read their KV)


class Profile(BaseModel):
    """What a serving instance measurably does: prefill tokens/s and decode step time vs batch size."""

    version: int = PROFILE_VERSION
    source: str = ""
    model: str = ""
    tp: int = Field(default=1, ge=1)  # GPUs behind the measured instance (per-GPU rates divide by it)
    prefill_tokens_per_s: float = Field(gt=0)  # inf: no per-token term beside attention's
    # fixed part of a prefill request (HTTP, scheduling, the one decode step)
    prefill_overhead_s: float = Field(default=0.0, ge=0)
    # Attention's quadratic share: seconds per query-key pair of a prefill (0: prefill time linear in tokens).
    prefill_s_per_pair: float = Field(default=0.0, ge=0)
    prefill_points: list[PrefillPoint] = Field(default_factory=list)
    decode_points: list[DecodePoint] = Field(min_length=1)
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    created_unix: float = 0.0

    @property
    def decode_context_tokens(self) -> int:
        """The context of the decode points the batch curve is read from (the shortest measured)."""
        return min((p.context_tokens for p in self.decode_points), default=0)

    @property
    def decode_s_per_kv_token(self) -> float:
        """What each context token a decoding stream reads adds to a step: from the points measured at a longer
        context than the batch curve's, their step less the curve's at their batch, per stream and extra context
        token (the median over them; 0 without such points). A step reads every stream's KV, so on a host whose
        attention is not hidden under the weight pass, long streams decode slower than short ones at one batch."""
        base = self.decode_context_tokens
        slopes = [
            max(0.0, (p.step_s - self.decode_step_s(p.batch)) / (p.batch * (p.context_tokens - base)))
            for p in self.decode_points
            if p.context_tokens > base and p.batch > 0
        ]
        return statistics.median(slopes) if slopes else 0.0

    def decode_step_s(self, batch: int) -> float:
        """Step time at ``batch`` at the shortest measured context: linear between measured points, the last slope
        beyond them, flat below (and flat everywhere with a single point)."""
        base = self.decode_context_tokens
        pts = sorted((p.batch, p.step_s) for p in self.decode_points if p.context_tokens == base)
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
        """The profile in ``path``; a malformed one (profiles are also written by hand) is a one-line error naming
        the field, so a zero rate or a negative step never reaches the arithmetic."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except ValidationError as exc:
            first = exc.errors()[0]
            if first["type"] == "json_invalid":
                raise ValueError(f"profile {path}: not JSON ({first['msg']})") from None
            field = ".".join(str(part) for part in first["loc"]) or "(the file)"
            got = "" if first["type"] == "missing" else f", got {first['input']!r}"
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            raise ValueError(f"profile {path}: {field}: {first['msg'].lower()}{got}{more}") from None

    def refitted(self) -> Profile:
        """This profile with its prefill terms fitted again from its measured points by the current
        ``fit_prefill_attention`` (a profile written by an older version keeps that version's fit otherwise);
        unchanged without three measured lengths."""
        if len({p.prompt_tokens for p in self.prefill_points}) < 3:
            return self
        rate, per_pair, overhead = fit_prefill_attention(self.prefill_points)
        return self.model_copy(
            update={
                "prefill_tokens_per_s": rate,
                "prefill_s_per_pair": per_pair,
                "prefill_overhead_s": overhead,
            }
        )


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


def tokens_per_s(seconds_per_token: float) -> float:
    """A prefill rate from its per-token cost; ``inf`` where a fit has no per-token term."""
    return 1.0 / seconds_per_token if seconds_per_token > 0 else math.inf


def fit_prefill_attention(points: Sequence[PrefillPoint]) -> tuple[float, float, float]:
    """(tokens/s, s per attention pair, overhead s) from ``t = overhead + P / rate + c * P^2 / 2``.

    A prompt of P tokens attends P^2/2 query-key pairs, so on hardware where attention is a visible share (long
    prompts on a small model) latency bends upwards and a straight line overstates the per-token cost at the
    lengths in the middle. Least squares with every term non-negative: each subset of the three terms is fitted and
    the one with the smallest squared error among those whose terms all come out positive wins. A bend at least as
    strong as attention's alone leaves no per-token term (rate ``inf``: what a token costs beside its attention
    is below what these lengths resolve), where falling back to a straight line would double the short prompts'
    time. Without three lengths, ``fit_prefill`` (c = 0).
    """
    xs = sorted({p.prompt_tokens for p in points})
    if len(xs) >= 3:
        ys = [p.seconds for p in points]
        rows = [(1.0, float(p.prompt_tokens), p.prompt_tokens**2 / 2) for p in points]
        best: tuple[float, list[float]] | None = None
        # which of (overhead, per token, per pair) are fitted; at least one of the two that grow with P
        for terms in ((0, 1, 2), (1, 2), (0, 2), (2,), (0, 1), (1,)):
            coef = _least_squares([[r[i] for i in terms] for r in rows], ys)
            if coef is None or any(c <= 0 for c in coef):
                continue
            full = [0.0, 0.0, 0.0]
            for i, c in zip(terms, coef, strict=True):
                full[i] = c
            sse = sum(
                (y - sum(f * x for f, x in zip(full, r, strict=True))) ** 2
                for r, y in zip(rows, ys, strict=True)
            )
            if best is None or sse < best[0]:
                best = (sse, full)
        if best is not None:
            overhead, per_token, per_pair = best[1]
            return tokens_per_s(per_token), per_pair, overhead
    rate, overhead = fit_prefill(points)
    return rate, 0.0, overhead


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Coefficients minimising the squared error of ``rows @ coef`` against ``ys``; None if singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    return _solve(a, b)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    out = [0.0] * n
    for r in reversed(range(n)):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


def decode_step_from_latencies(short: Sequence[float], long: Sequence[float], extra_tokens: int) -> float:
    """One decode step from request latencies at two output lengths: the median difference per extra token.

    Robust where chunk gaps are not: an API server that falls behind delivers a stream's chunks in a burst (gaps
    near 0, then one long one), but a request's latency still ends when its last token is out.
    """
    if not short or not long or extra_tokens <= 0:
        raise ValueError("need latencies at two output lengths")
    return max(0.0, (statistics.median(long) - statistics.median(short)) / extra_tokens)


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
