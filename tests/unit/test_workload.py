"""The demo's workload generator and statistics (pure)."""

from __future__ import annotations

import pytest

from vllm_disagg.tools.workload import RequestResult, RequestSpec, mixed_workload, percentile, summarize


def test_workload_is_deterministic_and_mixed() -> None:
    a = mixed_workload(30, short_rate=2, long_rate=0.5, seed=3)
    b = mixed_workload(30, short_rate=2, long_rate=0.5, seed=3)
    assert a == b
    kinds = {s.kind for s in a}
    assert kinds == {"short", "long"}
    assert all(0 <= s.at_s < 30 for s in a)
    assert [s.at_s for s in a] == sorted(s.at_s for s in a)
    assert all(len(s.prompt) == (32 if s.kind == "short" else 1800) for s in a)


def _result(kind: str, start: float, chunks: list[float], path: str = "transfer; x") -> RequestResult:
    r = RequestResult(
        spec=RequestSpec(0.0, kind, [1], 4), target="t", start=start, chunk_times=chunks, path=path
    )
    return r


def test_summary_pools_gaps_like_vllm_bench() -> None:
    rs = [
        _result("short", 0.0, [0.1, 0.2, 0.3]),  # ttft 0.1, gaps 0.1 0.1, tpot 0.1
        _result("short", 1.0, [1.3, 1.4, 2.4]),  # ttft 0.3, gaps 0.1 1.0, tpot 0.55
        _result("long", 0.0, [5.0], path="recompute; y"),
    ]
    s = summarize(rs)
    assert s.requests == 2 and s.errors == 0
    assert s.ttft_p50 == pytest.approx(0.2)
    assert s.itl_p50 == pytest.approx(0.1)
    assert s.itl_p99 == pytest.approx(0.973)  # gaps 0.1, 0.1, 0.1, 1.0: position 2.97
    assert s.tpot_p95 == pytest.approx(0.1 + 0.95 * 0.45)
    assert s.paths == {"transfer": 2, "recompute": 1}


def test_errors_are_counted_not_averaged() -> None:
    bad = _result("short", 0.0, [])
    bad.error = "HTTP 503"
    s = summarize([bad, _result("short", 0.0, [0.1, 0.2])])
    assert s.errors == 1 and s.ttft_p50 == pytest.approx(0.1)


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
