"""benchmarks/e2e.py's bookkeeping for replays: per-request zero-load numbers, burst-delivered streams, log flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from e2e import (  # noqa: E402
    by_output_len,
    late_share,
    load_previous,
    logged_flag,
    per_request_ms,
    phase_histograms,
    phase_summary,
    prefix_cache_counts,
    prompt_file,
)
from report import histogram, histogram_quantile  # noqa: E402


def test_per_request_ttft_and_tpot_as_vllm_bench_computes_them() -> None:
    bench = {
        "ttfts": [0.040, 0.150, 0.2],
        "latencies": [0.166, 0.152, 0.2],
        "output_lens": [64, 64, 1],
        "input_lens": [1500, 64, 90],
    }
    got = per_request_ms(bench)
    assert got["ttfts_ms"] == pytest.approx([40.0, 150.0])
    assert got["tpots_ms"] == pytest.approx([2.0, 2.0 / 63])
    # one-token requests have no TPOT and are left out with their lengths
    assert (got["input_lens"], got["output_lens"]) == ([1500, 64], [64, 64])
    empty = per_request_ms({})
    assert empty == {"ttfts_ms": [], "tpots_ms": [], "input_lens": [], "output_lens": []}


def test_each_output_length_gets_its_own_percentiles() -> None:
    # two 16-token answers that waited out prefills, three 128-token streams, one 1-token request (no TPOT)
    bench = {
        "ttfts": [1.0, 2.0, 0.1, 0.1, 0.2, 0.05],
        "latencies": [
            1.0 + 15 * 0.5,
            2.0 + 15 * 0.7,
            0.1 + 127 * 0.02,
            0.1 + 127 * 0.03,
            0.2 + 127 * 0.04,
            0.05,
        ],
        "output_lens": [16, 16, 128, 128, 128, 1],
        "input_lens": [1500, 1500, 64, 64, 64, 10],
    }
    got = by_output_len(bench)
    assert sorted(got) == ["128", "16"]
    assert got["16"]["requests"] == 2 and got["128"]["requests"] == 3
    assert got["16"]["p50_tpot_ms"] == pytest.approx(600.0)
    assert got["16"]["p95_tpot_ms"] == pytest.approx(690.0)
    assert got["128"]["p50_tpot_ms"] == pytest.approx(30.0)
    assert got["128"]["p95_ttft_ms"] == pytest.approx(190.0)
    many = {"ttfts": [0.1] * 9, "latencies": [1.0] * 9, "output_lens": list(range(2, 11))}
    assert by_output_len(many) == {}  # too many kinds to list


def test_streams_delivered_in_one_burst_are_counted() -> None:
    bench = {"ttfts": [0.040, 0.150, 0.300], "latencies": [0.166, 0.152, 0.301]}
    assert late_share(bench) == pytest.approx(2 / 3)
    assert late_share({}) is None


def test_engine_flag_read_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO ... with config: ..., enable_prefix_caching=True, enable_chunked_prefill=True, ...\n"
    )
    assert logged_flag(log, "enable_chunked_prefill") is True
    assert logged_flag(log, "enable_something_else") is None
    assert logged_flag(None, "enable_chunked_prefill") is None


def test_a_rerun_of_one_design_keeps_the_others_entries_and_replay_settings(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    assert load_previous(path, ["colocated"]) == ([], {})
    pd_spec = {"prefill": 1, "decode": 1, "profiles": {"prefill": "p.json"}, "zero_load": {"x": {}}}
    path.write_text(json.dumps({
        "results": [{"design": "pd", "rate": 1.0}, {"design": "colocated", "rate": 1.0}],
        "replay": {"designs": {"pd": pd_spec, "colocated": {"replicas": 2}}},
    }))  # fmt: skip
    assert load_previous(path, ["colocated"]) == ([{"design": "pd", "rate": 1.0}], {"pd": pd_spec})


def test_random_prompts_have_their_length_and_share_no_prefix(tiny_model: str, tmp_path: Path) -> None:
    """No prompt of any point may be served from the prefix cache, which the replay does not model: vllm bench's
    own random dataset repeated 9-36% of a point's prompts on this vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    heads, lengths = set(), []
    for seed in (0, 1):
        for line in prompt_file("random-long", 25, seed, tmp_path).read_text().splitlines():
            row = json.loads(line)
            ids = tok(row["prompt"], add_special_tokens=False).input_ids
            lengths.append(len(ids))
            heads.add(tuple(ids[:16]))
            assert row["output_tokens"] == 64
    assert len(heads) == 50
    assert min(lengths) >= 1500 and max(lengths) <= 1502, (min(lengths), max(lengths))
    short = [
        json.loads(x)["output_tokens"]
        for x in prompt_file("decode-batch", 4, 0, tmp_path).read_text().splitlines()
    ]
    assert short == [128] * 4


def test_prefix_cache_counters_summed_over_engines() -> None:
    text = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1.466499e+06
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 179072.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 5.0
"""
    assert prefix_cache_counts(text) == (179200.0, 1466499.0)
    assert prefix_cache_counts("") == (0.0, 0.0)


def _queue_histogram(counts: tuple[float, float, float], total: float) -> str:
    """vLLM's request_queue_time histogram of one engine, cumulative counts at le 0.01, 0.1 and +Inf."""
    a, b, c = counts
    return f"""# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{engine="0",le="0.01",model_name="m"}} {a}
vllm:request_queue_time_seconds_bucket{{engine="0",le="0.1",model_name="m"}} {b}
vllm:request_queue_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {c}
vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {c}
vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {total}
"""


def test_engine_phases_cover_only_the_requests_served_between_two_reads() -> None:
    before = phase_histograms(_queue_histogram((10, 10, 10), 0.05))
    # 10 more requests: 5 queued under 10 ms, 5 between 10 and 100 ms, 0.3 s between them
    after = phase_histograms(_queue_histogram((15, 20, 20), 0.35))
    got = phase_summary(before, after)
    assert set(got) == {"queue_ms"}  # the other phases saw no requests
    q = got["queue_ms"]
    assert q["count"] == 10
    assert q["mean"] == pytest.approx(30.0)
    assert q["p50"] == pytest.approx(10.0)  # the 5th of 10 is the first bucket's last
    assert q["p95"] == pytest.approx(10 + 90 * 4.5 / 5)  # linear within (10, 100] ms


def test_histogram_quantile_in_the_open_bucket_is_the_largest_finite_bound() -> None:
    h = histogram(_queue_histogram((0, 0, 4), 40.0), "vllm:request_queue_time_seconds")
    assert histogram_quantile(h, 0.5) == 0.1
    assert histogram_quantile(histogram("", "vllm:request_queue_time_seconds"), 0.5) is None
