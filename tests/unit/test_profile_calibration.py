"""Profile arithmetic the validation relies on: attention's quadratic prefill term and latency-based decode steps."""

from __future__ import annotations

import json
import math

import pytest

from vllm_disagg.planner.cli import describe_prefill_fit
from vllm_disagg.planner.costmodel import BatchShape, ProfileCost
from vllm_disagg.planner.profiledata import (
    DecodePoint,
    PrefillPoint,
    Profile,
    decode_step_from_latencies,
    fit_prefill,
    fit_prefill_attention,
)


def test_quadratic_fit_recovers_rate_attention_and_overhead() -> None:
    rate, pair_s, overhead = 40_000.0, 1e-8, 0.004
    pts = [
        PrefillPoint(prompt_tokens=n, seconds=overhead + n / rate + pair_s * n * n / 2)
        for n in (256, 768, 1500, 2000)
    ]
    got_rate, got_pair, got_overhead = fit_prefill_attention(pts)
    assert got_rate == pytest.approx(rate, rel=1e-6)
    assert got_pair == pytest.approx(pair_s, rel=1e-6)
    assert got_overhead == pytest.approx(overhead, rel=1e-6)


def test_a_bend_stronger_than_the_free_fit_allows_keeps_the_per_token_and_attention_terms() -> None:
    """Latencies a pinned tiny-model CPU instance measured (ms at 256..2000 tokens): the free three-term fit wants a
    negative per-token cost here, and the straight line it used to fall back to put 1,500 tokens at 656 ms."""
    measured = {256: 41.1, 768: 139.9, 1152: 279.1, 1500: 453.7, 2000: 809.0}
    pts = [PrefillPoint(prompt_tokens=n, seconds=ms / 1000) for n, ms in measured.items()]
    rate, pair_s, overhead = fit_prefill_attention(pts)
    assert rate > 0 and pair_s > 0 and overhead >= 0
    for n, ms in measured.items():
        fitted = overhead + n / rate + pair_s * n * n / 2
        assert fitted * 1000 == pytest.approx(ms, rel=0.5 if n == 256 else 0.1), n


def test_a_bend_as_strong_as_attention_alone_leaves_no_per_token_term() -> None:
    """Latencies a tiny-model CPU instance measured on 2026-12-03 (ms): from 1,500 to 2,000 tokens the time grew
    1.98x where attention alone grows 1.78x, so every fit with a positive per-token cost failed, and the straight
    line that used to replace them put 256 tokens at 2.3x and 1,500 at 1.6x what was measured."""
    measured = {256: 52.0, 768: 147.0, 1152: 272.0, 1500: 445.0, 2000: 882.0}
    pts = [PrefillPoint(prompt_tokens=n, seconds=ms / 1000) for n, ms in measured.items()]
    rate, pair_s, overhead = fit_prefill_attention(pts)
    assert math.isinf(rate) and pair_s > 0 and overhead > 0
    for n, ms in measured.items():
        fitted = overhead + n / rate + pair_s * n * n / 2
        assert fitted * 1000 == pytest.approx(ms, rel=0.55 if n == 256 else 0.1), n
    prof = Profile(
        prefill_tokens_per_s=rate,
        prefill_s_per_pair=pair_s,
        prefill_overhead_s=overhead,
        prefill_points=pts,
        decode_points=[DecodePoint(batch=1, step_s=0.01)],
    )
    step = ProfileCost(prof).step_s(BatchShape.prefill(1500))
    assert step == pytest.approx(0.01 + pair_s * 1500 * 750)
    assert describe_prefill_fit(prof).startswith("no per-token term")
    assert Profile.model_validate_json(json.dumps(prof.model_dump())).prefill_tokens_per_s == math.inf


def test_straight_or_short_data_falls_back_to_the_line() -> None:
    line = [PrefillPoint(prompt_tokens=n, seconds=0.002 + n / 50_000) for n in (256, 1024, 2048)]
    rate, pair_s, _ = fit_prefill_attention(line)
    assert pair_s == 0.0 and rate == pytest.approx(fit_prefill(line)[0])
    two = line[:2]
    assert fit_prefill_attention(two) == (*fit_prefill(two)[:1], 0.0, fit_prefill(two)[1])


def test_profile_cost_charges_attention_pairs() -> None:
    prof = Profile(
        prefill_tokens_per_s=50_000,
        prefill_s_per_pair=1e-8,
        decode_points=[DecodePoint(batch=1, step_s=0.002)],
    )
    cost = ProfileCost(prof)
    shape = BatchShape.prefill(1000)
    assert cost.step_s(shape) == pytest.approx(0.002 + 1000 / 50_000 + 1e-8 * 1000 * 500)
    old = Profile.model_validate(
        {"prefill_tokens_per_s": 50_000, "decode_points": [{"batch": 1, "step_s": 0.002}]}
    )
    assert old.prefill_s_per_pair == 0.0  # profiles written before the field load unchanged


def test_decode_step_from_latency_difference() -> None:
    short = [0.050 + 23 * 0.002, 0.051 + 23 * 0.002, 0.049 + 23 * 0.002]
    long = [0.050 + 95 * 0.002, 0.052 + 95 * 0.002, 0.048 + 95 * 0.002]
    assert decode_step_from_latencies(short, long, 72) == pytest.approx(0.002, rel=0.02)
    with pytest.raises(ValueError):
        decode_step_from_latencies([], long, 72)


def test_a_profile_is_refitted_from_its_points() -> None:
    measured = {256: 41.1, 768: 139.9, 1152: 279.1, 1500: 453.7, 2000: 809.0}
    pts = [PrefillPoint(prompt_tokens=n, seconds=ms / 1000) for n, ms in measured.items()]
    old = Profile(
        prefill_tokens_per_s=2287.0, prefill_points=pts, decode_points=[DecodePoint(batch=1, step_s=0.01)]
    )
    new = old.refitted()
    assert (
        new.prefill_tokens_per_s,
        new.prefill_s_per_pair,
        new.prefill_overhead_s,
    ) == fit_prefill_attention(pts)
    assert new.decode_points == old.decode_points
    two = old.model_copy(update={"prefill_points": pts[:2]})
    assert two.refitted() is two
