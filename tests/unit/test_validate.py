"""Replaying measured e2e points in the simulator (``vllm_disagg.planner.validate``), on synthetic results."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vllm_disagg.planner import validate as v
from vllm_disagg.planner.model import ModelSpec
from vllm_disagg.planner.profiledata import DecodePoint, PrefillPoint, Profile
from vllm_disagg.planner.simulate import Adaptive, Colocated, Disaggregated
from vllm_disagg.planner.workload import Request

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def prof(tokens_per_s: float, step_s: float, source: str = "") -> Profile:
    return Profile(
        source=source,
        prefill_tokens_per_s=tokens_per_s,
        prefill_points=[PrefillPoint(prompt_tokens=1000, seconds=1000 / tokens_per_s)],
        decode_points=[DecodePoint(batch=1, step_s=step_s), DecodePoint(batch=16, step_s=2 * step_s)],
    )


PROFILES = {
    "profile-pd-prefill.json": prof(40_000, 0.002, "p"),
    "profile-pd-decode.json": prof(20_000, 0.003, "d"),
    "profile-colocated-replica-a.json": prof(30_000, 0.002, "a"),
    "profile-colocated-replica-b.json": prof(30_000, 0.004, "b"),
}


def bench(ttft: float, tpot: float, completed: int = 20, prompt: int = 1502) -> dict[str, Any]:
    return {
        "completed": completed,
        "total_input_tokens": prompt * completed,
        "total_output_tokens": 64 * completed,
        "median_ttft_ms": ttft,
        "p95_ttft_ms": 2 * ttft,
        "median_tpot_ms": tpot,
        "p95_tpot_ms": 2 * tpot,
    }


def results(zero_load_ms: float | None = None) -> dict[str, Any]:
    zl = {} if zero_load_ms is None else {"random-long": {"median_ttft_ms": zero_load_ms}}
    return {
        "results": [
            {"design": "pd", "dataset": "random-long", "rate": 2.0, "bench": bench(100.0, 3.0)},
            {"design": "colocated", "dataset": "random-long", "rate": 2.0, "bench": bench(50.0, 2.0)},
            {"design": "colocated", "dataset": "random-long", "rate": 4.0, "bench": bench(60.0, 2.5)},
            {
                "design": "pd",
                "dataset": "prefix-repetition",
                "rate": 2.0,
                "bench": bench(40.0, 2.0, prompt=1152),
                "prefix_cache": {"hit_tokens": 800.0 * 20, "queried_tokens": 1152.0 * 20},
            },
        ],
        "replay": {
            "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "chunked_prefill": True},
            "datasets": {
                "random-long": {"input_len": 1500, "output_len": 64},
                "prefix-repetition": {
                    "input_len": 1152,
                    "output_len": 64,
                    "shared_prefix_len": 1024,
                    "num_prefixes": 4,
                },
            },
            "num_prompts": 20,
            "model_config": TINY,
            "designs": {
                "pd": {
                    "prefill": 1,
                    "decode": 1,
                    "profiles": {"prefill": "profile-pd-prefill.json", "decode": "profile-pd-decode.json"},
                    "zero_load": zl,
                },
                "colocated": {
                    "replicas": 2,
                    "profiles": {
                        "replica-a": "profile-colocated-replica-a.json",
                        "replica-b": "profile-colocated-replica-b.json",
                    },
                    "zero_load": zl,
                },
            },
        },
    }


def test_each_point_replays_its_design_rate_lengths_and_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    real = v.simulate_rate

    def spy(wl: Any, rate: float, design: Any, model: Any, cost: Any, **kw: Any) -> Any:
        seen.append({"design": design, "rate": rate, "wl": wl, "cost": cost, **kw})
        return real(wl, rate, design, model, cost, **kw)

    monkeypatch.setattr(v, "simulate_rate", spy)
    res = results()
    res["results"] = [e for e in res["results"] if e["dataset"] == "random-long"]
    rows = v.validate(res, PROFILES, seeds=2)
    replayed = [r for r in rows if r.predicted is not None]
    assert [(r.design, r.rate) for r in replayed] == [("colocated", 2.0), ("pd", 2.0), ("colocated", 4.0)]
    assert len(seen) == 6  # two arrival samples per point
    pd = [s for s in seen if isinstance(s["design"], Disaggregated)]
    co = [s for s in seen if isinstance(s["design"], Colocated)]
    assert {s["rate"] for s in pd} == {2.0} and {s["rate"] for s in co} == {2.0, 4.0}
    assert pd[0]["design"].prefill == 1 and pd[0]["design"].decode == 1 and co[0]["design"].replicas == 2
    # P/D: each pool timed by its own instance's profile; colocated: the replicas' mean
    assert pd[0]["prefill_cost"].profile.source == "p" and pd[0]["cost"].profile.source == "d"
    assert co[0]["cost"].profile.decode_step_s(1) == pytest.approx(0.003)
    eng = pd[0]["engine"]
    assert (eng.max_num_seqs, eng.max_batched_tokens, eng.chunked_prefill) == (64, 2048, True)
    # lengths as the benchmark counted them (1502 prompt tokens), 20 requests, Poisson arrivals per seed
    wl = pd[0]["wl"]
    assert len(wl) == 20 and set(wl.prompts) == {1502} and set(wl.outputs) == {64}
    assert pd[0]["wl"].unit_arrivals != pd[1]["wl"].unit_arrivals
    assert all(r.prompt_tokens == 1502 and r.output_tokens == 64 and r.requests == 20 for r in replayed)


def test_nominal_lengths_when_the_benchmark_did_not_count() -> None:
    entry = {"dataset": "random-long", "bench": {"completed": 0}}
    assert v.lengths(entry, results()["replay"]) == (1500, 64)


def test_ratios_are_predicted_over_measured() -> None:
    m = v.Percentiles(100.0, 200.0, 2.0, 4.0)
    p = v.Percentiles(110.0, 150.0, 2.0, 5.0)
    row = v.ValidationRow("pd", "random-long", 2.0, m, p)
    assert row.ratio("p50_ttft_ms") == pytest.approx(1.1)
    assert row.ratio("p95_ttft_ms") == pytest.approx(0.75)
    assert row.ratio("p95_tpot_ms") == pytest.approx(1.25)
    assert v.within(row, 0.25) and not v.within(row, 0.2)
    assert v.ValidationRow("pd", "random-long", 2.0, m).ratio("p50_ttft_ms") is None


def test_prefix_repetition_is_replayed_with_its_shared_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset's prompts begin with one of its 4 shared prefixes of 1,024 tokens, each as often: the replay
    gives them those, so its prefix caches find them (the measured hits are not flagged as unmodelled), and the
    prediction is faster than the same prompts with nothing shared."""
    seen: list[Any] = []
    real = v.simulate_rate

    def spy(wl: Any, *a: Any, **kw: Any) -> Any:
        seen.append(wl)
        return real(wl, *a, **kw)

    monkeypatch.setattr(v, "simulate_rate", spy)
    rows = v.validate(results(), PROFILES, seeds=1)
    row = next(r for r in rows if r.dataset == "prefix-repetition")
    assert row.predicted is not None and not row.skipped and row.prefixes == 4
    assert row.cache_hit_share == pytest.approx(800 / 1152) and not row.cached
    wl = seen[0]  # prefix-repetition sorts first
    assert wl.prefix_tokens == 1024 and set(wl.prompts) == {1152}
    assert sorted(Counter(wl.prefixes).values()) == [5, 5, 5, 5]
    res = results()
    res["replay"]["datasets"]["prefix-repetition"] = {"input_len": 1152, "output_len": 64}
    plain = next(r for r in v.validate(res, PROFILES, seeds=1) if r.dataset == "prefix-repetition")
    assert plain.cached and plain.predicted is not None
    assert row.predicted.p50_ttft_ms < plain.predicted.p50_ttft_ms
    assert "NOT MODELLED" not in v.format_validation(rows)


def test_missing_profile_is_a_stated_skip() -> None:
    two = {"a.json": prof(30_000, 0.002), "b.json": prof(30_000, 0.002)}  # neither named as results.json says
    rows = v.validate(results(), two, seeds=1)
    assert all(r.predicted is None for r in rows)
    assert any("no profile" in r.skipped for r in rows)


def test_one_profile_times_every_instance() -> None:
    rows = v.validate(results(), {"only.json": prof(30_000, 0.002)}, seeds=1)
    assert sum(r.predicted is not None for r in rows) == 4


def serial(rp: v.Replay) -> v.Replay:
    """``rp`` charging the stack's cost inside the emitting instance's iterations."""
    return replace(rp, engine=replace(rp.engine, stack_cpu="serial"))


def test_zero_load_median_shifts_every_ttft_and_leaves_tpot() -> None:
    base = {(r.design, r.rate): r for r in v.validate(results(), PROFILES, seeds=3)}
    shifted = {(r.design, r.rate): r for r in v.validate(results(zero_load_ms=500.0), PROFILES, seeds=3)}
    for key, row in shifted.items():
        before = base[key].predicted
        assert row.predicted is not None and before is not None
        excess = row.predicted.p50_ttft_ms - before.p50_ttft_ms
        assert 400 < excess < 500  # 500 ms measured alone, minus the engines' own share of it
        assert row.predicted.p95_ttft_ms == pytest.approx(before.p95_ttft_ms + excess)
        assert row.predicted.p95_tpot_ms == pytest.approx(before.p95_tpot_ms)
        assert "n=1" in row.zero_load
    assert base[("pd", 2.0)].zero_load.startswith("TTFT excess median +0.0 ms")


def test_zero_load_requests_each_lend_a_ttft_excess_and_tpot_factor() -> None:
    res = results()
    rp = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    rp = serial(rp)  # the stack's cost inside the emitting instance's iterations: exact arithmetic
    ttft0, tpot0 = rp.run([v.Request(0, 0.0, 1502, 64)])[0]
    res["replay"]["designs"]["colocated"]["zero_load"] = {
        "random-long": {"ttfts_ms": [ttft0 * 1000 + 10, ttft0 * 1000 + 30], "tpots_ms": [tpot0 * 2000] * 2}
    }
    zl = v.zero_load(rp, res["replay"], "colocated", "random-long", 1502, 64)
    # TPOT measured alone is twice the engine's step: the other half is a cost per emitted token. The first token
    # pays it too, so that much of the TTFT excess is the engine's.
    assert zl.token_overhead_s == pytest.approx(tpot0)
    assert zl.tpot_factor == pytest.approx((1.0, 1.0))
    assert zl.ttft_excess_s == pytest.approx((0.010 - tpot0, 0.030 - tpot0))
    assert zl.late == 0 and "ms per emitted token" in zl.describe()
    assert rp.with_token_overhead(zl.token_overhead_s).alone(1502, 64) == pytest.approx(
        (ttft0 + tpot0, 2 * tpot0)
    )
    plain, *_ = v.predict(rp, 1502, 64, 2.0, 20, 3)
    drawn, *_ = v.predict(rp, 1502, 64, 2.0, 20, 3, zl)
    assert drawn.p95_tpot_ms >= 2 * plain.p95_tpot_ms * 0.999  # more when streams overlap
    assert plain.p50_ttft_ms + 10 <= drawn.p50_ttft_ms <= plain.p50_ttft_ms + 30


def test_the_per_token_overhead_grows_with_the_streams_a_step_serves() -> None:
    """A cost per emitted token lengthens an iteration by one share per stream: under load TPOT rises by more
    than a fixed factor on the step would give, which is what a CPU-bound API server does to a shared core."""
    res = results()
    rp = v.replay_for("pd", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    rp = serial(rp)
    _, tpot0 = rp.alone(1502, 64)
    zl = v.ZeroLoad(token_overhead_s=tpot0)
    ratios = []
    for rate in (0.1, 6.0):
        plain, *_ = v.predict(rp, 1502, 64, rate, 40, 2)
        loaded, *_ = v.predict(rp, 1502, 64, rate, 40, 2, zl)
        ratios.append(loaded.p50_tpot_ms / plain.p50_tpot_ms)
    assert ratios[0] == pytest.approx(2.0, rel=0.05)
    assert ratios[1] > ratios[0] * 1.2, ratios


def test_points_measured_while_other_jobs_ran_are_flagged() -> None:
    res = results()
    res["results"][0]["bench"]["foreign_cpu_cores"] = 1.5
    res["results"][0]["late_first_chunk_share"] = 0.25
    rows = {(r.design, r.rate): r for r in v.validate(res, PROFILES, seeds=1)}
    assert rows[("pd", 2.0)].disturbed and not rows[("colocated", 2.0)].disturbed
    assert rows[("pd", 2.0)].late_share == 0.25
    text = v.format_validation(list(rows.values()))
    assert "25%" in text and "1.50 cores DISTURBED" in text


def test_few_requests_are_averaged_over_more_arrival_samples() -> None:
    assert v.seeds_for(60) == 17 and v.seeds_for(20) == v.MAX_SEEDS and v.seeds_for(5000) == 1
    rows = v.validate(results(), PROFILES)
    assert all(r.seeds == v.MAX_SEEDS for r in rows if r.predicted is not None)


def test_ordering_check_and_table() -> None:
    rows = v.validate(results(), PROFILES, seeds=2)
    checks = v.orderings(rows)
    assert {(c.rate, c.metric) for c in checks} == {(2.0, "p95_ttft_ms"), (2.0, "p95_tpot_ms")}
    ttft = next(c for c in checks if c.metric == "p95_ttft_ms")
    assert ttft.measured_best == "colocated"
    assert ttft.matches == (ttft.predicted_best == "colocated")
    text = v.format_validation(rows)
    assert text.splitlines()[0].startswith("design") and "p95_ttft_ms meas" in text
    assert "random-long rate 2 p95_ttft_ms: lower measured colocated" in text


def test_mean_profile_averages_interchangeable_instances() -> None:
    a, b = PROFILES["profile-colocated-replica-a.json"], PROFILES["profile-colocated-replica-b.json"]
    m = v.mean_profile([a, b])
    assert m.decode_step_s(1) == pytest.approx(0.003) and m.decode_step_s(16) == pytest.approx(0.006)
    assert m.prefill_tokens_per_s == pytest.approx(30_000)
    assert v.mean_profile([a]) is a
    # quadratic fits: the mean profile's prefill time is the mean of the two fitted curves
    qa = a.model_copy(update={"prefill_tokens_per_s": 50_000.0, "prefill_s_per_pair": 2e-8})
    qb = b.model_copy(update={"prefill_tokens_per_s": 100_000.0, "prefill_s_per_pair": 0.0})
    qm = v.mean_profile([qa, qb])

    def t(p: Profile, n: int) -> float:
        return n / p.prefill_tokens_per_s + p.prefill_s_per_pair * n * n / 2

    assert t(qm, 1500) == pytest.approx((t(qa, 1500) + t(qb, 1500)) / 2)


def test_profile_files_lists_what_results_json_names() -> None:
    assert v.profile_files(results()) == sorted(PROFILES)
    assert v.profile_files({}) == []


def test_streams_delivered_whole_are_left_out_of_the_zero_load_calibration() -> None:
    res = results()
    rp = v.replay_for("pd", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    ttft0, tpot0 = rp.run([v.Request(0, 0.0, 1502, 64)])[0]
    # one normal request 10 ms slower than the model; one whose 63 tokens all came with its first chunk
    late_ttft = ttft0 * 1000 + 63 * tpot0 * 1000
    res["replay"]["designs"]["pd"]["zero_load"] = {
        "random-long": {"ttfts_ms": [ttft0 * 1000 + 10, late_ttft], "tpots_ms": [tpot0 * 1000, 0.001]}
    }
    zl = v.zero_load(rp, res["replay"], "pd", "random-long", 1502, 64)
    assert (
        zl.late == 1
        and zl.ttft_excess_s == pytest.approx((0.010,))
        and zl.tpot_factor == pytest.approx((1.0,))
    )
    assert "1 late left out" in zl.describe()
    res["replay"]["designs"]["pd"]["zero_load"]["random-long"]["ttfts_ms"][0] = late_ttft
    res["replay"]["designs"]["pd"]["zero_load"]["random-long"]["tpots_ms"][0] = 0.001
    assert v.zero_load(rp, res["replay"], "pd", "random-long", 1502, 64) == v.ZeroLoad(late=2)
    assert v.ZeroLoad(late=2).describe() == "none usable (all 2 streams late): engines only"


def test_cli_validate_reads_results_and_the_profiles_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_disagg.planner.cli import main as planner_main

    r = results()
    (tmp_path / "results.json").write_text(json.dumps(r))
    for name in v.profile_files(r):
        (tmp_path / name).write_text(prof(20_000.0, 0.004).model_dump_json())
    assert planner_main(["simulate", "--validate", str(tmp_path / "results.json")]) == 0
    text = capsys.readouterr().out
    assert "colocated" in text and "pd" in text and "prefix-repetition" in text
    assert planner_main(["simulate", "--validate", str(tmp_path / "results.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 4 and {row["design"] for row in rows} == {"pd", "colocated"}
    (tmp_path / "empty.json").write_text(json.dumps({"results": []}))
    assert planner_main(["simulate", "--validate", str(tmp_path / "empty.json")]) == 2


def test_adaptive_design_replays_with_the_runs_targets_and_its_own_batch_budget() -> None:
    res = results()
    res["slo"] = "ttft:500 tpot:10"
    res["results"].append(
        {"design": "adaptive", "dataset": "random-long", "rate": 2.0, "bench": bench(60.0, 2.0)}
    )
    res["replay"]["designs"]["adaptive"] = {
        "adaptive": 2,
        "max_num_batched_tokens": 512,
        "profiles": {
            "both-a": "profile-colocated-replica-a.json",
            "both-b": "profile-colocated-replica-b.json",
        },
    }
    rp = v.replay_for("adaptive", res, PROFILES, ModelSpec.from_hf_config(TINY, name="t"), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay) and isinstance(rp.design, Adaptive)
    assert (rp.design.replicas, rp.design.ttft_slo_s, rp.design.tpot_slo_s) == (2, 0.5, 0.01)
    assert rp.engine.max_batched_tokens == 512  # the design's own, not the run's 2048
    rows = v.validate(res, PROFILES, seeds=2)
    assert {r.design for r in rows if r.predicted is not None and r.rate == 2.0} == {
        "pd",
        "colocated",
        "adaptive",
    }
    # three designs at one point: the ordering names the lowest of the three
    assert {c.metric for c in v.orderings(rows) if c.rate == 2.0 and c.dataset == "random-long"} == {
        "p95_ttft_ms",
        "p95_tpot_ms",
    }


def test_repeats_of_a_point_are_one_row_with_their_median_and_range() -> None:
    res = results()
    res["results"] += [
        {"design": "pd", "dataset": "random-long", "rate": 2.0, "repeat": 1, "bench": bench(140.0, 5.0)},
        {"design": "pd", "dataset": "random-long", "rate": 2.0, "repeat": 2, "bench": bench(300.0, 4.0)},
    ]
    res["results"][0]["bench"]["foreign_cpu_cores"] = 0.02
    res["results"][-1]["bench"]["foreign_cpu_cores"] = 0.3
    rows = [r for r in v.validate(res, PROFILES, seeds=1) if r.design == "pd" and r.dataset == "random-long"]
    assert len(rows) == 1
    row = rows[0]
    assert row.repeats == 3 and row.measured is not None
    assert (row.measured.p50_ttft_ms, row.measured.p95_tpot_ms) == (140.0, 8.0)  # medians, metric by metric
    assert row.measured_low == v.Percentiles(100.0, 200.0, 3.0, 6.0)
    assert row.measured_high == v.Percentiles(300.0, 600.0, 5.0, 10.0)
    assert row.disturbed  # the worst repeat counts
    assert "140.0 [100.0-300.0]" in v.format_validation([row])


def test_requests_alone_faster_than_the_profile_scale_its_prefill_down() -> None:
    """Measured alone, TTFT came in under the simulated engines' own time: the profile overstated the prompt's
    compute, so the replay's prefill is scaled until the simulated TTFT alone is the measured median."""
    res = results()
    rp = v.replay_for("pd", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    ttft0, tpot0 = rp.alone(1502, 64)
    fast = 0.8 * ttft0 * 1000
    res["replay"]["designs"]["pd"]["zero_load"] = {
        "random-long": {"ttfts_ms": [fast - 1, fast, fast + 1], "tpots_ms": [tpot0 * 1000] * 3}
    }
    zl = v.zero_load(rp, res["replay"], "pd", "random-long", 1502, 64)
    assert 0.5 < zl.prefill_scale < 1.0 and zl.token_overhead_s == pytest.approx(0.0, abs=1e-9)
    assert rp.with_prefill_scale(zl.prefill_scale).alone(1502, 64)[0] * 1000 == pytest.approx(fast, rel=1e-3)
    assert zl.ttft_excess_s == pytest.approx((-0.001, 0.0, 0.001), abs=1e-5)
    assert "prefill at" in zl.describe()
    # only the prefill pool is scaled; the decode instance's profile is untouched; colocated scales its one cost
    scaled = rp.with_prefill_scale(0.5)
    assert scaled.cost is rp.cost and scaled.prefill_cost is not rp.prefill_cost
    co = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(co, v.Replay)
    assert co.with_prefill_scale(0.5).alone(1502, 64)[0] < co.alone(1502, 64)[0]


def test_a_stack_with_cores_of_its_own_keeps_the_tpot_excess_a_factor() -> None:
    """On a GPU host the API server's work per token overlaps the forward pass: no cost per token is charged."""
    res = results()
    res["replay"]["stack_shares_engine_cores"] = False
    rp = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    ttft0, tpot0 = rp.alone(1502, 64)
    res["replay"]["designs"]["colocated"]["zero_load"] = {
        "random-long": {"ttfts_ms": [ttft0 * 1000 + 10] * 2, "tpots_ms": [tpot0 * 2000] * 2}
    }
    zl = v.zero_load(rp, res["replay"], "colocated", "random-long", 1502, 64)
    assert zl.token_overhead_s == 0.0 and zl.tpot_factor == pytest.approx((2.0, 2.0))


def detailed(starts: list[float], prompt: int = 1502, output: int = 64) -> dict[str, Any]:
    """The per-request lists of a ``vllm bench serve --save-detailed`` result (one request failed)."""
    n = len(starts)
    return {
        "start_times": [100.0 + s for s in starts] + [100.5],
        "input_lens": [prompt] * n + [prompt],
        "output_lens": [output] * n + [0],
        "errors": [""] * n + ["boom"],
    }


def test_a_runs_arrivals_are_recorded_in_send_order_without_failed_requests() -> None:
    arr = v.run_arrivals(detailed([0.3, 0.0, 1.25]))
    assert arr == {"offsets_s": [0.0, 0.3, 1.25], "prompt_tokens": [1502] * 3, "output_tokens": [64] * 3}
    reqs = v.arrival_requests({"arrivals": arr})
    assert reqs is not None and [(r.arrival_s, r.prompt_tokens) for r in reqs] == [
        (0.0, 1502),
        (0.3, 1502),
        (1.25, 1502),
    ]
    assert v.run_arrivals({"start_times": [1.0]}) is None and v.arrival_requests({}) is None


def test_each_run_is_replayed_on_its_own_arrivals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs at one rate: spread out, and in one burst. Each is replayed on what it had (the burst queues),
    not on Poisson samples, and the point's prediction is the median of the runs' replays."""
    res = results()
    spread, burst = [i * 0.5 for i in range(20)], [i * 0.001 for i in range(20)]
    res["results"] = [
        {"design": "pd", "dataset": "random-long", "rate": 2.0, "repeat": k, "bench": bench(100.0, 3.0),
         "arrivals": v.run_arrivals(detailed(starts))}
        for k, starts in enumerate((spread, burst))
    ]  # fmt: skip
    monkeypatch.setattr(v, "simulate_rate", None)  # no Poisson samples are drawn
    replayed: list[list[float]] = []
    real = v.simulate

    def spy(requests: Any, *a: Any, **kw: Any) -> Any:
        replayed.append([r.arrival_s for r in requests])
        return real(requests, *a, **kw)

    monkeypatch.setattr(v, "simulate", spy)
    rows = v.validate(res, PROFILES, seeds=2)
    assert [r.arrivals for r in rows] == ["own arrivals"]
    assert replayed[-2:] == [pytest.approx(spread), pytest.approx(burst)]
    rp = v.replay_for("pd", res, PROFILES, ModelSpec.from_hf_config(TINY, name="t"), v.LOOPBACK_TCP)
    assert not isinstance(rp, str)
    each = [v.predict_run(rp, r, 2.0, 2)[0] for r in (v.arrival_requests(e) for e in res["results"]) if r]
    assert each[1].p95_ttft_ms > 5 * each[0].p95_ttft_ms  # the burst queued
    assert rows[0].predicted == v.across(each, statistics.median)
    assert "each run replayed on its own arrivals" in v.format_validation(rows)


def test_a_mixed_datasets_zero_load_requests_are_each_compared_with_their_own_lengths() -> None:
    """Short streams and long prompts, each 5 ms slower than the replay alone: compared with their own lengths,
    every request lends a 5 ms excess and the prefill keeps the profile's time. Compared with the mean lengths (a
    record without them), the short ones' quick TTFTs would read as a prefill well under the profile's time."""
    res = results()
    rp = v.replay_for("pd", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    lens = [(64, 128)] * 6 + [(1500, 16)] * 2
    sims = [rp.alone(p, o) for p, o in lens]
    record = {
        "ttfts_ms": [t * 1000 + 5 for t, _ in sims],
        "tpots_ms": [x * 1000 for _, x in sims],
        "input_lens": [p for p, _ in lens],
        "output_lens": [o for _, o in lens],
    }
    res["replay"]["designs"]["pd"]["zero_load"] = {"chat-mix": record}
    zl = v.zero_load(rp, res["replay"], "pd", "chat-mix", 423, 100)
    assert zl.prefill_scale == 1.0 and zl.token_overhead_s == pytest.approx(0.0, abs=1e-6)
    assert zl.ttft_excess_s == pytest.approx((0.005,) * 8, abs=1e-4)
    assert zl.tpot_factor == pytest.approx((1.0,) * 8, abs=1e-3)
    del record["input_lens"], record["output_lens"]
    assert v.zero_load(rp, res["replay"], "pd", "chat-mix", 423, 100).prefill_scale < 0.7


def test_slo_targets_are_read_in_vllm_bench_form() -> None:
    assert v.slo_targets({"slo": "ttft:1500 tpot:25"}) == (1.5, 0.025)
    assert v.slo_targets({"slo": "tpot:25"}) == (math.inf, 0.025)
    assert v.slo_targets({}) is None and v.slo_targets({"slo": "e2el:900"}) is None


def test_goodput_is_replayed_and_the_best_design_compared() -> None:
    """With SLOs recorded, each run's replay gives the share of its requests within them, times the run's measured
    throughput: a design whose requests arrived in one burst queues past a 400 ms TTFT target, one whose requests
    were spread does not, so both the measurement and the replay put the spread one first on goodput."""
    res = results()
    res["slo"] = "ttft:400 tpot:50"
    spread, burst = [i * 0.5 for i in range(20)], [i * 0.001 for i in range(20)]
    res["results"] = [
        {"design": "colocated", "dataset": "random-long", "rate": 2.0, "repeat": 0,
         "bench": {**bench(100.0, 3.0), "request_goodput": 1.9, "request_throughput": 2.0},
         "arrivals": v.run_arrivals(detailed(spread))},
        {"design": "pd", "dataset": "random-long", "rate": 2.0, "repeat": 0,
         "bench": {**bench(900.0, 3.0), "request_goodput": 0.4, "request_throughput": 2.0},
         "arrivals": v.run_arrivals(detailed(burst))},
    ]  # fmt: skip
    rows = {r.design: r for r in v.validate(res, PROFILES, seeds=2)}
    assert rows["colocated"].measured_goodput == 1.9
    co, pd = rows["colocated"].predicted_goodput, rows["pd"].predicted_goodput
    assert co is not None and pd is not None and 0.0 <= pd < co <= 2.0
    check = next(c for c in v.orderings(list(rows.values())) if c.metric == "goodput")
    assert (check.measured_best, check.predicted_best, check.matches) == ("colocated", "colocated", True)
    assert "random-long rate 2 goodput: higher measured colocated, predicted colocated (match)" in (
        v.format_validation(list(rows.values()))
    )
    # the measured ranges overlap: a different predicted winner is a tie, not a mismatch
    swapped = [replace(rows["colocated"], predicted_goodput=0.1), replace(rows["pd"], goodput_high=2.0)]
    tie = next(c for c in v.orderings(swapped) if c.metric == "goodput")
    assert tie.predicted_best == "pd" and tie.within_spread and tie.matches
    no_slo = results()
    assert all(r.predicted_goodput is None for r in v.validate(no_slo, PROFILES, seeds=1))


def batch_run(rp: v.Replay, streams: int, waves: int = 3) -> list[v.Request]:
    """A batched zero-load run as e2e.py sends it: ``streams`` at once, the next wave as the last one ends."""
    one = rp.run([v.Request(0, 0.0, 128, 128)])[0]
    span = one[0] + 127 * one[1]
    return [
        v.Request(w * streams + i, w * span * 1.5, 128, 128) for w in range(waves) for i in range(streams)
    ]


def test_a_batched_zero_load_run_tells_the_per_token_cost_from_the_step() -> None:
    """Engines that split a stream's TPOT differently between their step and a per-token cost: one TPOT alone
    cannot say which part is which, a batched run beside it can, and the fit finds the split each had."""
    res = results()
    rp = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    batch = batch_run(rp, 8)
    for overhead, scale in ((0.0005, 1.6), (0.002, 0.9)):
        true = rp.with_decode_scale(scale).with_token_overhead(overhead)
        alone = true.alone(1502, 64)[1]
        batch_tpot = statistics.median(t for _, t in true.run(batch))
        got_overhead, got_scale = v.fit_decode(rp, 1502, 64, alone, batch, batch_tpot)
        assert got_overhead == pytest.approx(overhead, rel=0.1, abs=5e-5)
        assert got_scale == pytest.approx(scale, rel=0.1)


def test_zero_load_fits_the_per_token_cost_to_the_batched_run_when_recorded() -> None:
    res = results()
    rp = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    true = rp.with_decode_scale(1.5).with_token_overhead(0.0004)
    ttft, tpot = true.alone(1502, 64)
    spec = res["replay"]["designs"]["colocated"]
    spec["zero_load"] = {"random-long": {"ttfts_ms": [ttft * 1000] * 3, "tpots_ms": [tpot * 1000] * 3}}
    alone_only = v.zero_load(rp, res["replay"], "colocated", "random-long", 1502, 64)
    # alone, all of the TPOT above the profiled step reads as per-token cost
    assert alone_only.token_overhead_s > 0.0004 * 1.5 and alone_only.batch_streams == 0
    batch = batch_run(rp, 8)
    spec["zero_load_batch"] = {
        "concurrency": 8,
        "arrivals": {
            "offsets_s": [r.arrival_s for r in batch],
            "prompt_tokens": [r.prompt_tokens for r in batch],
            "output_tokens": [r.output_tokens for r in batch],
        },
        "tpots_ms": [t * 1000 for _, t in true.run(batch)],
    }
    zl = v.zero_load(rp, res["replay"], "colocated", "random-long", 1502, 64)
    assert zl.token_overhead_s == pytest.approx(0.0004, rel=0.15)
    assert zl.decode_scale == pytest.approx(1.5, rel=0.1)
    assert zl.batch_streams == 8 and "8 at once" in zl.describe()
    assert zl.applied(rp).alone(1502, 64)[1] == pytest.approx(tpot, rel=0.02)


def test_points_served_from_the_prefix_cache_are_flagged() -> None:
    res = results()
    res["results"][1]["prefix_cache"] = {"hit_tokens": 1408.0 * 9, "queried_tokens": 1502.0 * 100}
    res["results"][2]["prefix_cache"] = {"hit_tokens": 0.0, "queried_tokens": 1502.0 * 100}
    rows = {(r.design, r.rate): r for r in v.validate(res, PROFILES, seeds=1)}
    assert rows[("colocated", 2.0)].cached and rows[("colocated", 2.0)].cache_hit_share == pytest.approx(
        0.0844, 0.01
    )
    assert not rows[("colocated", 4.0)].cached and rows[("pd", 2.0)].cache_hit_share is None
    text = v.format_validation(list(rows.values()))
    assert "8.4% NOT MODELLED" in text and "0.0%" in text


def test_zero_load_of_shared_prefixes_compares_each_request_with_itself_cold_or_warm() -> None:
    """Four requests computed their prefix (~30 ms more than the rest): each is compared with the same request
    alone cold, the rest with it alone warm (its prefix cached), so neither kind reads the other's prefill as
    stack overhead: every excess is the 10 ms added."""
    res = results()
    rp = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    cold, tpot = rp.alone(1152, 64)
    warm, _ = rp.alone(1152, 64, 1024)
    assert cold - warm == pytest.approx(1024 / 30_000, rel=0.05)  # the prefix's compute on these replicas
    ttfts = [cold * 1000 + 10] * 4 + [warm * 1000 + 10] * 8
    res["replay"]["designs"]["colocated"]["zero_load"] = {
        "prefix-repetition": {"ttfts_ms": ttfts, "tpots_ms": [tpot * 1000] * 12}
    }
    assert v.cold_ones(rp, ttfts, [(1152, 64)] * 12, 1024) == [True] * 4 + [False] * 8
    zl = v.zero_load(rp, res["replay"], "colocated", "prefix-repetition", 1152, 64)
    assert zl.ttft_excess_s == pytest.approx((0.010,) * 12, abs=1e-4)
    assert v.cold_ones(rp, ttfts, [(1152, 64)] * 12, 0) == [False] * 12


def test_profiles_measured_at_a_longer_context_keep_it_in_their_mean() -> None:
    def with_context(step_s: float, long_s: float) -> Profile:
        p = prof(30_000, step_s)
        points = [*p.decode_points, DecodePoint(batch=8, step_s=long_s, context_tokens=1536)]
        return p.model_copy(
            update={
                "decode_points": [d.model_copy(update={"context_tokens": 128}) for d in p.decode_points]
                + points[-1:]
            }
        )

    mean = v.mean_profile([with_context(0.002, 0.010), with_context(0.004, 0.014)])
    assert mean.decode_context_tokens == 128 and mean.decode_step_s(1) == pytest.approx(0.003)
    longer = [d for d in mean.decode_points if d.context_tokens == 1536]
    assert [(d.batch, d.step_s) for d in longer] == [(8, pytest.approx(0.012))]
    assert mean.decode_s_per_kv_token > 0


def zero_load_record(
    rp: v.Replay, true: v.Replay, batch: list[v.Request], batch_noise: float
) -> dict[str, Any]:
    """A design's zero-load and batched zero-load records as ``true`` engines would measure them, the batched
    run's TPOTs off by ``batch_noise`` (a small run's luck)."""
    ttft, tpot = true.alone(1502, 64)
    return {
        "zero_load": {"random-long": {"ttfts_ms": [ttft * 1000] * 3, "tpots_ms": [tpot * 1000] * 3}},
        "zero_load_batch": {
            "concurrency": 8,
            "arrivals": {
                "offsets_s": [r.arrival_s for r in batch],
                "prompt_tokens": [r.prompt_tokens for r in batch],
                "output_tokens": [r.output_tokens for r in batch],
            },
            "tpots_ms": [t * 1000 * batch_noise for _, t in true.run(batch)],
        },
    }


def test_one_per_token_cost_fitted_across_designs_does_not_follow_one_batched_runs_noise() -> None:
    """Two designs whose stacks cost the same per emitted token but whose decode steps run at different speeds
    than profiled. Fitted alone, each design's cost follows its small batched run's error, one up and one down;
    fitted across both it lands near the cost both had, and each design keeps its own step scale."""
    res = results()
    model = ModelSpec.from_hf_config(TINY)
    replays = {d: v.replay_for(d, res, PROFILES, model, v.LOOPBACK_TCP) for d in ("colocated", "pd")}
    assert all(isinstance(rp, v.Replay) for rp in replays.values())
    overhead, scales, noise = 0.0006, {"colocated": 1.4, "pd": 0.9}, {"colocated": 1.25, "pd": 0.8}
    for d, rp in replays.items():
        assert isinstance(rp, v.Replay)
        true = rp.with_decode_scale(scales[d]).with_token_overhead(overhead)
        res["replay"]["designs"].setdefault(d, {}).update(
            zero_load_record(rp, true, batch_run(rp, 8), noise[d])
        )
    ready = {d: rp for d, rp in replays.items() if isinstance(rp, v.Replay)}
    anchors = v.decode_anchors(ready, res["replay"], {"random-long": (1502, 64)})
    assert sorted(a.design for a in anchors) == ["colocated", "pd"]
    own = {a.design: v.fit_decode(a.rp, 1502, 64, a.alone_tpot, a.batch, a.batch_tpot)[0] for a in anchors}
    assert own["colocated"] > 1.3 * overhead and own["pd"] < 0.8 * overhead
    shared = v.shared_token_overhead(anchors)
    assert shared is not None and shared.designs == 2
    assert shared.seconds == pytest.approx(overhead, rel=0.5)
    assert abs(shared.seconds - overhead) < min(abs(x - overhead) for x in own.values())
    for d, rp in ready.items():
        zl = v.zero_load(rp, res["replay"], d, "random-long", 1502, 64, shared)
        assert zl.token_overhead_s == shared.seconds and "across 2 designs" in zl.describe()
        true_tpot = rp.with_decode_scale(scales[d]).with_token_overhead(overhead).alone(1502, 64)[1]
        assert zl.applied(rp).alone(1502, 64)[1] == pytest.approx(true_tpot, rel=0.02)
    # validate fits the shared cost by default, and each design's own on request
    rows = v.validate(res, PROFILES, seeds=1)
    fitted = {r.zero_load for r in rows if r.dataset == "random-long" and r.zero_load}
    assert fitted and all("across 2 designs" in z for z in fitted)
    rows = v.validate(res, PROFILES, seeds=1, shared_calibration=False)
    assert not any("across" in (r.zero_load or "") for r in rows)


def test_the_stacks_cpu_read_from_proc_is_charged_instead_of_a_fit() -> None:
    """Where e2e.py read the stack's CPU from /proc, the replay charges that per emitted token (the batched
    zero-load runs' median first, else the run's points'), each design's decode step scaled to its TPOT alone."""
    res = results()
    model = ModelSpec.from_hf_config(TINY)
    rp = v.replay_for("colocated", res, PROFILES, model, v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay) and rp.engine.stack_cpu == "shared"
    true = rp.with_decode_scale(1.2).with_token_overhead(0.0003)
    res["replay"]["designs"]["colocated"].update(zero_load_record(rp, true, batch_run(rp, 8), 1.0))
    assert v.measured_stack_cost(res, []) is None
    # the points' CPU: 2 s of stack over 64 x 20 tokens is 1.5625 ms a token (the engine's CPU is not the stack's)
    for e in res["results"]:
        e["cpu_s"] = {"replica-a/api": 1.0, "replica-a/engine": 9.0, "proxy": 0.5, "client": 0.5}
        e["cpu_window_s"] = 10.0
    got = v.measured_stack_cost(res, [[e] for e in res["results"]])
    assert got is not None and got.seconds == pytest.approx(0.0015625)
    assert got.measured == "the run's benchmark points"
    # the batched zero-load runs' CPU comes first: 1.2 s over 4,000 tokens
    res["replay"]["designs"]["colocated"]["zero_load_batch"].update(
        {
            "cpu_s": {"replica-b/api": 0.6, "replica-b/engine": 5.0, "client": 0.6},
            "cpu_window_s": 6.0,
            "total_output_tokens": 4000,
        }
    )
    got = v.measured_stack_cost(res, [[e] for e in res["results"]])
    assert got is not None and got.seconds == pytest.approx(0.0003)
    assert got.measured == "the batched zero-load runs"
    zl = v.zero_load(rp, res["replay"], "colocated", "random-long", 1502, 64, got)
    assert zl.token_overhead_s == pytest.approx(0.0003) and "read from /proc" in zl.describe()
    assert zl.decode_scale == pytest.approx(1.2, rel=0.05)
    rows = v.validate(res, PROFILES, seeds=1)
    colocated = [r.zero_load for r in rows if r.design == "colocated" and r.dataset == "random-long"]
    assert colocated and all("read from /proc over the batched zero-load runs" in z for z in colocated)
    # serial charges a fitted cost, as before the CPU was read
    rows = v.validate(res, PROFILES, seeds=1, stack_cpu="serial")
    assert not any("/proc" in (r.zero_load or "") for r in rows)


def test_the_shared_fit_of_one_design_is_that_designs_own_fit() -> None:
    res = results()
    rp = v.replay_for("colocated", res, PROFILES, ModelSpec.from_hf_config(TINY), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    true = rp.with_decode_scale(1.2).with_token_overhead(0.0008)
    res["replay"]["designs"]["colocated"] = zero_load_record(rp, true, batch_run(rp, 8), 1.0)
    anchors = v.decode_anchors({"colocated": rp}, res["replay"], {"random-long": (1502, 64)})
    shared = v.shared_token_overhead(anchors)
    assert shared is not None and shared.designs == 1
    a = anchors[0]
    own, _ = v.fit_decode(rp, 1502, 64, a.alone_tpot, a.batch, a.batch_tpot)
    assert shared.seconds == pytest.approx(own, rel=0.05, abs=2e-5)
    assert shared.seconds == pytest.approx(0.0008, rel=0.15)
    assert v.shared_token_overhead([]) is None


def test_ttft_inside_the_engines_leaves_out_the_wait_for_the_iteration_running_at_arrival() -> None:
    rp = v.replay_for(
        "colocated", results(), PROFILES, ModelSpec.from_hf_config(TINY, name="t"), v.LOOPBACK_TCP
    )
    assert not isinstance(rp, str)
    alone = v.simulate([Request(0, 0.0, 500, 8)], Colocated(1), rp.model, rp.cost, record_iterations=True)
    assert v.engine_ttft_s(alone) == pytest.approx(alone.records[0].ttft_s)  # idle: taken in at once
    # a second request arriving 1 ms into the first one's prefill waits for that iteration to end
    both = v.simulate(
        [Request(0, 0.0, 500, 8), Request(1, 0.001, 500, 8)],
        Colocated(1),
        rp.model,
        rp.cost,
        record_iterations=True,
    )
    second = both.records[1]
    boundary = min(it.start for it in both.iterations["c0"] if it.start >= second.arrival_s)
    assert boundary > second.arrival_s
    inside = [alone.records[0].ttft_s, second.arrival_s + second.ttft_s - boundary]
    assert v.engine_ttft_s(both) == pytest.approx(statistics.fmean(inside))


def test_a_transfers_ttft_inside_the_engines_is_its_prompts_compute_on_the_prefill_instance() -> None:
    rp = v.replay_for("pd", results(), PROFILES, ModelSpec.from_hf_config(TINY, name="t"), v.LOOPBACK_TCP)
    assert isinstance(rp, v.Replay)
    res = v.simulate(
        [Request(0, 0.0, 1500, 8)],
        rp.design,
        rp.model,
        rp.cost,
        prefill_cost=rp.prefill_cost,
        record_iterations=True,
    )
    (rec,) = res.records
    assert rec.mode == "transfer" and rec.prefill_done_s is not None and rec.ttft_s is not None
    # the prompt's compute ends on the prefill instance before the decode instance's first token
    assert 0 < rec.prefill_done_s < rec.ttft_s
    assert v.engine_ttft_s(res) == pytest.approx(rec.prefill_done_s)
    assert rec.prefill_done_s == pytest.approx(sum(it.duration for it in res.iterations["p0"]))


def test_measured_ttft_inside_the_engines_is_vllms_queue_and_prefill_weighted_by_requests() -> None:
    phases = {
        "replica-a": {"queue_ms": {"count": 30, "mean": 2.0}, "prefill_ms": {"count": 30, "mean": 80.0}},
        "replica-b": {"queue_ms": {"count": 10, "mean": 10.0}, "prefill_ms": {"count": 10, "mean": 100.0}},
    }
    entry = {"decisions": {"colocated": 40}, "engine_phases": phases}
    assert v.measured_engine_ttft_ms(entry) == pytest.approx((30 * 82 + 10 * 110) / 40)
    # a mix splits the phases over instances that see different parts of different requests: no comparison
    assert v.measured_engine_ttft_ms({**entry, "decisions": {"colocated": 30, "transfer": 10}}) is None
    assert v.measured_engine_ttft_ms({"decisions": {"colocated": 40}}) is None
    # P/D: the prefill instance computes every prompt; the decode instance's phases wait for the KV
    pd = {
        "prefill": {"queue_ms": {"count": 40, "mean": 1.0}, "prefill_ms": {"count": 40, "mean": 20.0}},
        "decode": {"queue_ms": {"count": 40, "mean": 30.0}, "prefill_ms": {"count": 40, "mean": 5.0}},
    }
    assert v.measured_engine_ttft_ms({"decisions": {"transfer": 40}, "engine_phases": pd}) == pytest.approx(
        21.0
    )


def test_validation_prints_the_ttft_inside_the_engines_beside_the_clients() -> None:
    res = results()
    starts = [i * 0.5 for i in range(20)]
    phases = {
        "replica-a": {
            "queue_ms": {"count": 20, "mean": 1.0},
            "prefill_ms": {"count": 20, "mean": 40.0},
            "ttft_ms": {"count": 20, "mean": 48.0},
        }
    }
    res["results"] = [
        {"design": "colocated", "dataset": "random-long", "rate": 2.0, "repeat": 0,
         "bench": {**bench(50.0, 2.0), "mean_ttft_ms": 55.0}, "arrivals": v.run_arrivals(detailed(starts)),
         "decisions": {"colocated": 20}, "engine_phases": phases}
    ]  # fmt: skip
    (row,) = v.validate(res, PROFILES, seeds=2)
    assert row.measured_engine_ttft_ms == pytest.approx(41.0)
    assert row.measured_mean_ttft_ms == pytest.approx(55.0)
    assert row.measured_api_ttft_ms == pytest.approx(48.0)
    assert row.predicted_engine_ttft_ms is not None and row.predicted_engine_ttft_ms > 0
    text = v.format_validation([row])
    assert "TTFT inside the engines" in text
    assert "colocated random-long rate 2: engines 41.0 ms measured" in text
    assert "vLLM's API server 48.0; client 55.0 ms" in text


def test_cpu_use_is_per_emitted_token_for_the_stack_and_a_share_of_a_core_for_engines() -> None:
    def run(api: float, engine: float, busy: list[float]) -> dict[str, Any]:
        return {
            "cpu_s": {"a/api": api, "a/engine": engine, "proxy": 0.5, "client": 1.0},
            "core_busy": busy,
            "bench": {"total_output_tokens": 1000, "duration": 10.0},
        }

    got = v.cpu_use([run(2.0, 8.0, [0.9, 0.5]), run(4.0, 6.0, [0.7, 0.3]), {"bench": {}}])
    assert got is not None
    # medians over the two runs that recorded it: 3 s of API server CPU over 1,000 tokens is 3 ms a token
    assert got.ms_per_token == {"a/api": 3.0, "client": 1.0, "proxy": 0.5}
    assert got.engine_cores == {"a": 0.7}
    assert got.core_busy == (0.8, 0.4)
    assert got.stack_ms_per_token == 4.5
    assert "stack 4.500 ms CPU per emitted token" in got.describe()
    assert v.cpu_use([{"bench": {"total_output_tokens": 10, "duration": 1.0}}]) is None


def test_where_the_cores_went_is_printed_for_points_that_recorded_it() -> None:
    row = v.ValidationRow(
        "pd", "chat-mix", 8.0, v.Percentiles(1.0, 2.0, 3.0, 4.0), v.Percentiles(1.0, 2.0, 3.0, 4.0),
        cpu=v.CpuUse({"proxy": 0.1}, {"prefill": 0.9}, (1.0, 0.5)),
    )  # fmt: skip
    text = v.format_validation([row])
    assert "Where the cores went" in text
    assert (
        "pd chat-mix rate 8: stack 0.100 ms CPU per emitted token (proxy 0.100); engine processes prefill 0.90"
        in text
    )
    assert "Where the cores went" not in v.format_validation([replace(row, cpu=None)])


def test_the_stacks_cpu_at_each_arrival_counts_the_streams_emitting_then() -> None:
    """A stream emitting 100 tokens/s from 1 s to 2 s: a request arriving inside that window meets its stack CPU
    (0.5 ms a token: 0.05 cores), one arriving after it meets none; the stretch is one server's queue, capped."""

    def record(i: int, arrival: float, ttft: float, e2e: float, out: int) -> Any:
        return v.RequestRecord(i, arrival, 100, out, "colocated", "c0", "c0", ttft, 0.01, e2e)

    streams = [record(0, 0.5, 0.5, 1.5, 101), record(1, 1.5, 0.1, 0.2, 2), record(2, 2.5, 0.1, 0.2, 2)]
    cores = v.stack_cores_at_arrivals(streams, 0.0005)
    assert cores[1] == pytest.approx(0.05)
    assert cores[2] == pytest.approx(0.0)
    assert cores[0] == pytest.approx(0.0)  # nothing was emitting when the first arrived
    assert v.stack_queue_stretch(0.0) == 1.0
    assert v.stack_queue_stretch(0.5) == pytest.approx(2.0)
    assert v.stack_queue_stretch(5.0) == pytest.approx(1 / (1 - v.STACK_QUEUE_CAP))


def test_each_row_says_whether_its_replay_was_stable_and_the_count_leaves_unstable_points_out() -> None:
    rows = v.validate(results(), PROFILES, seeds=1)
    assert rows and all(r.stable is True for r in rows if r.predicted is not None)
    measured = rows[0].measured
    assert measured is not None
    exact = replace(rows[0], predicted=measured)  # a perfect prediction
    off = replace(exact, rate=9.0, predicted=replace(measured, p95_ttft_ms=measured.p95_ttft_ms * 2))
    past = replace(off, rate=12.0, stable=False)
    text = v.format_validation([exact, off, past])
    assert "both within 25% at 1 of 2 stable points (1 unstable left out)" in text
    res = results()  # P/D's prefill instance takes ~27 req/s of 1,500-token prompts
    res["results"].append(
        {"design": "pd", "dataset": "random-long", "rate": 100.0, "bench": bench(900.0, 3.0)}
    )
    overloaded = v.validate(res, PROFILES, seeds=1)
    assert [r.stable for r in overloaded if r.rate == 100.0] == [False]
    assert "(1 unstable left out)" in v.format_validation(overloaded)
