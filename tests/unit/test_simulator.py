"""The discrete-event simulator: determinism, the qualitative P/D behaviour, goodput search, policy replay."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_disagg.planner.cli import MAX_REQUESTS
from vllm_disagg.planner.cli import main as planner_main
from vllm_disagg.planner.costmodel import BatchShape, ProfileCost, RooflineCost
from vllm_disagg.planner.engine import EngineConfig
from vllm_disagg.planner.goodput import search_goodput
from vllm_disagg.planner.hardware import (
    MEASURED_ENGINE_FIXED_S,
    MEASURED_PROXY_HOP_S,
    InstanceSpec,
    gpu_preset,
    link_preset,
)
from vllm_disagg.planner.metrics import percentile
from vllm_disagg.planner.model import preset_model
from vllm_disagg.planner.plan import decode_rate, prefill_rate
from vllm_disagg.planner.profiledata import DecodePoint, Profile
from vllm_disagg.planner.simulate import (
    Colocated,
    Disaggregated,
    HostCores,
    SimResult,
    goodput,
    simulate,
    simulate_rate,
)
from vllm_disagg.planner.workload import (
    LengthDist,
    Request,
    Workload,
    load_trace,
    parse_trace,
    requests_for_duration,
    synthetic,
)
from vllm_disagg.router.policy import ClusterView, NoRoute, Outcome, Plan, RequestView

MODEL = preset_model("llama-3-8b")
COST = RooflineCost(MODEL, InstanceSpec(gpu_preset("h100-sxm")))
RDMA = link_preset("rdma-400g")


def fixed(n: int, prompt: int, output: int, seed: int = 0) -> Workload:
    return synthetic(n, LengthDist("fixed", prompt), LengthDist("fixed", output), seed=seed)


def p95(res: SimResult, what: str) -> float:
    s = res.summary(1e9, 1e9)
    return (s.ttft_s if what == "ttft" else s.tpot_s)[95]


# -- workloads -------------------------------------------------------------------------------------------------
def test_length_distributions_and_arrivals() -> None:
    assert LengthDist.parse("512") == LengthDist("fixed", 512)
    assert LengthDist.parse("uniform:10:20") == LengthDist("uniform", 10, 20)
    assert LengthDist.parse("lognormal:1000:0.5:16:4096") == LengthDist("lognormal", 1000, 0.5, 16, 4096)
    with pytest.raises(ValueError):
        LengthDist.parse("zipf:3")
    w = synthetic(4000, LengthDist.parse("lognormal:1000:0.5"), LengthDist.parse("uniform:10:20"), seed=3)
    assert statistics.fmean(w.prompts) == pytest.approx(1000, rel=0.05)
    assert min(w.outputs) >= 10 and max(w.outputs) <= 20
    # unit-rate arrivals: mean gap 1; at rate r every arrival is divided by r (common random numbers)
    assert w.unit_arrivals[-1] / len(w) == pytest.approx(1.0, rel=0.05)
    assert [r.arrival_s for r in w.at_rate(4)] == pytest.approx([t / 4 for t in w.unit_arrivals])
    bursty = synthetic(4000, LengthDist("fixed", 1), LengthDist("fixed", 1), arrival="gamma", burstiness=0.25)
    gaps = [b - a for a, b in zip(bursty.unit_arrivals, bursty.unit_arrivals[1:], strict=False)]
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1 / 0.25, rel=0.25)  # gamma shape k: squared CV = 1/k


def test_trace_replays_at_its_own_rate(tmp_path: Path) -> None:
    lines = [
        json.dumps({"arrival_s": 10.0 + i * 0.5, "prompt_tokens": 100 + i, "output_tokens": 8})
        for i in range(5)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(reversed(lines)) + "\n")
    w = load_trace(path)
    assert w.native_rate == pytest.approx(2.0)
    reqs = w.at_rate(w.native_rate)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert [r.prompt_tokens for r in reqs] == [100, 101, 102, 103, 104]
    with pytest.raises(ValueError, match="line 1"):
        parse_trace(['{"arrival_s": 1}'])
    res = simulate_rate(w, 2.0, Disaggregated(1, 1, RDMA), MODEL, COST)
    assert all(r.ttft_s is not None for r in res.records)
    assert planner_main(["simulate", "--trace", str(path), "--json", "--design", "disagg"]) == 0


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)


# -- determinism -----------------------------------------------------------------------------------------------
def test_simulation_is_deterministic_for_a_seed() -> None:
    def run(seed: int) -> list[object]:
        w = synthetic(
            150, LengthDist.parse("lognormal:1500:0.6"), LengthDist.parse("lognormal:100:0.5"), seed=seed
        )
        return [
            simulate_rate(w, 6.0, d, MODEL, COST).records for d in (Colocated(2), Disaggregated(1, 1, RDMA))
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


# -- qualitative behaviour -------------------------------------------------------------------------------------
def test_colocated_tpot_grows_with_prompt_and_rate_disaggregated_stays_flat() -> None:
    colo, dis = Colocated(2), Disaggregated(1, 1, RDMA)
    tpot = {}
    for prompt in (256, 2048):
        w = fixed(200, prompt, 64)
        for rate in (2.0, 8.0):
            tpot[("colo", prompt, rate)] = p95(simulate_rate(w, rate, colo, MODEL, COST), "tpot")
            tpot[("dis", prompt, rate)] = p95(simulate_rate(w, rate, dis, MODEL, COST), "tpot")
    # colocated: prefill iterations stall every running decode, more of them for longer prompts and higher rates
    assert tpot[("colo", 2048, 2.0)] > tpot[("colo", 256, 2.0)]
    assert tpot[("colo", 2048, 8.0)] > 1.4 * tpot[("colo", 256, 8.0)]
    assert tpot[("colo", 2048, 8.0)] > 1.3 * tpot[("colo", 2048, 2.0)]
    # disaggregated: decode steps only; the prompt length only adds the KV it reads
    for prompt in (256, 2048):
        assert tpot[("dis", prompt, 8.0)] < 1.1 * tpot[("dis", prompt, 2.0)]
    assert tpot[("dis", 2048, 8.0)] < 1.25 * tpot[("dis", 256, 2.0)]
    assert tpot[("dis", 2048, 8.0)] < 0.8 * tpot[("colo", 2048, 8.0)]


def test_disaggregated_ttft_rises_sharply_once_prefill_pool_saturates() -> None:
    prompt = 2048
    capacity = prefill_rate(COST, prompt) / prompt  # requests/s one prefill instance sustains
    w = fixed(300, prompt, 32)
    design = Disaggregated(1, 4, RDMA)  # plenty of decode: only the prefill pool can saturate
    below = p95(simulate_rate(w, 0.5 * capacity, design, MODEL, COST), "ttft")
    near = p95(simulate_rate(w, 0.8 * capacity, design, MODEL, COST), "ttft")
    above = p95(simulate_rate(w, 1.3 * capacity, design, MODEL, COST), "ttft")
    assert below < near < above
    assert above > 10 * below
    tpots = [p95(simulate_rate(w, f * capacity, design, MODEL, COST), "tpot") for f in (0.5, 1.3)]
    assert tpots[1] < 1.2 * tpots[0]  # decode unaffected by the prefill queue


def test_disaggregated_tpot_flat_until_decode_pool_saturates() -> None:
    prompt, output = 1024, 128
    cfg = EngineConfig(max_num_seqs=64)
    capacity = decode_rate(COST, prompt, output, 1.0, cfg.max_num_seqs).tokens_per_s / output
    w = fixed(300, prompt, output)
    design = Disaggregated(4, 1, RDMA)  # prefill to spare
    runs = {f: simulate_rate(w, f * capacity, design, MODEL, COST, engine=cfg) for f in (0.05, 0.3, 0.6, 1.5)}
    low = p95(runs[0.05], "tpot")
    assert p95(runs[0.3], "tpot") < 1.2 * low
    # saturated: the batch is full (TPOT at its ceiling) and new requests queue for a decode slot
    assert p95(runs[1.5], "ttft") > 10 * p95(runs[0.6], "ttft")


def test_timeline_colocated_prefill_spikes_disaggregated_flat() -> None:
    w = fixed(200, 3000, 64)
    colo = simulate_rate(w, 5.0, Colocated(2), MODEL, COST, record_iterations=True)
    dis = simulate_rate(w, 5.0, Disaggregated(1, 1, RDMA), MODEL, COST, record_iterations=True)
    c_iters, d_iters = colo.iterations["c0"], dis.iterations["d0"]
    decode_steps = [it.duration for it in c_iters if it.prefill_tokens == 0]
    spikes = [it.duration for it in c_iters if it.prefill_tokens > 0]
    assert spikes and min(spikes) > 5 * statistics.median(decode_steps)
    assert all(it.prefill_tokens == 0 for it in d_iters)
    d_durations = [it.duration for it in d_iters]
    assert max(d_durations) < 1.6 * statistics.median(d_durations)


def test_chunked_prefill_bounds_iterations_and_lowers_tail_tpot() -> None:
    w = fixed(200, 4096, 128)
    plain = simulate_rate(w, 8.0, Colocated(2), MODEL, COST, engine=EngineConfig(max_batched_tokens=2048))
    chunked_cfg = EngineConfig(max_batched_tokens=2048, chunked_prefill=True)
    chunked = simulate_rate(w, 8.0, Colocated(2), MODEL, COST, engine=chunked_cfg, record_iterations=True)
    assert all(it.prefill_tokens + it.decode_seqs <= 2048 for it in chunked.iterations["c0"])
    assert any(it.prefill_tokens > 0 and it.decode_seqs for it in chunked.iterations["c0"])  # mixed batches
    assert chunked.summary(1e9, 1e9).tpot_s[99] < plain.summary(1e9, 1e9).tpot_s[99]


def test_layerwise_overlap_shortens_exposed_transfer() -> None:
    w = fixed(100, 4096, 16)
    slow = link_preset("100gbe")
    lw = simulate_rate(w, 2.0, Disaggregated(1, 1, slow, layerwise=True), MODEL, COST)
    whole = simulate_rate(w, 2.0, Disaggregated(1, 1, slow, layerwise=False), MODEL, COST)
    s_lw, s_whole = lw.summary(1e9, 1e9), whole.summary(1e9, 1e9)
    # whole: 4096 x 128 KiB / 12.5 GB/s = 43 ms + 2 ms link setup + the engine's and proxy's fixed cost;
    # layer-wise: only the tail is exposed
    per_transfer = Disaggregated(1, 1, slow).transfer_fixed_s
    assert per_transfer == MEASURED_ENGINE_FIXED_S + MEASURED_PROXY_HOP_S
    expected = 4096 * 131072 / 12.5e9 + 0.002 + per_transfer
    assert s_whole.mean_exposed_transfer_s == pytest.approx(expected, rel=0.01)
    assert s_lw.mean_exposed_transfer_s < 0.5 * s_whole.mean_exposed_transfer_s
    assert s_lw.ttft_s[50] < s_whole.ttft_s[50]


def test_requests_larger_than_kv_capacity_are_dropped_not_stuck() -> None:
    reqs = [Request(0, 0.0, 100, 10), Request(1, 0.1, 5000, 10)]
    res = simulate(reqs, Colocated(1), MODEL, COST, EngineConfig(kv_capacity_tokens=1000))
    assert res.records[0].mode == "colocated" and res.records[1].dropped
    assert res.summary(10, 10).dropped == 1 and res.summary(10, 10).attainment == 0.5


# -- goodput ---------------------------------------------------------------------------------------------------
def test_goodput_search_is_monotone() -> None:
    # a noisy, non-monotone attainment curve: the search still returns a rate with every lower probe passing
    def noisy(rate: float) -> float:
        return 1.0 if rate < 7 else (0.95 if 9 < rate < 10 else 0.5)

    g = search_goodput(noisy, start=1.0, rel_tol=0.01)
    passed = [r for r, a in g.probes if a >= 0.9]
    failed = [r for r, a in g.probes if a < 0.9]
    assert g.rate == max(passed) and all(r < min(failed) for r in passed)
    assert 6.9 < g.rate < 7.0
    assert all(a1 >= a2 for (_, a1), (_, a2) in zip(g.curve(), g.curve()[1:], strict=False))
    assert search_goodput(lambda r: 0.0, start=1.0).rate == 0.0
    assert search_goodput(lambda r: 1.0 if r <= 0.3 else 0.0, start=8.0).rate == pytest.approx(0.3, rel=0.05)


def test_simulated_goodput_is_monotone_in_slo_and_resources() -> None:
    w = fixed(120, 1024, 64)
    one = goodput(w, Disaggregated(1, 1, RDMA), MODEL, COST, 0.5, 0.05, start_rate=8.0, rel_tol=0.05)
    tight = goodput(w, Disaggregated(1, 1, RDMA), MODEL, COST, 0.1, 0.05, start_rate=8.0, rel_tol=0.05)
    two = goodput(w, Disaggregated(2, 1, RDMA), MODEL, COST, 0.5, 0.05, start_rate=8.0, rel_tol=0.05)
    assert 0 < tight.rate <= one.rate < two.rate
    for g in (one, tight, two):
        for rate, att in g.probes:
            assert (att >= 0.9) == (rate <= g.rate)


# -- policy replay ---------------------------------------------------------------------------------------------
class AlwaysLast:
    """A plain class with plan(): always p1 -> d1, and records what it observed."""

    def __init__(self) -> None:
        self.seen: list[ClusterView] = []
        self.outcomes: list[Outcome] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.seen.append(cluster)
        return Plan.transfer("p1", "d1", reason="pinned")

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


class ShortPromptsRecompute:
    """Recompute prompts under 512 tokens on d0, colocate on d1 when d0 is busy, transfer the rest."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        if request.prompt_tokens < 512:
            return Plan.recompute("d0")
        if request.prompt_tokens > 3000:
            raise NoRoute("too long")
        return Plan.transfer("p0", "d0")


def test_custom_policy_changes_routing() -> None:
    w = synthetic(80, LengthDist("uniform", 100, 2000), LengthDist("fixed", 32), seed=1)
    default = simulate_rate(w, 4.0, Disaggregated(2, 2, RDMA), MODEL, COST)
    assert {r.prefill_instance for r in default.records} == {"p0", "p1"}
    assert {r.decode_instance for r in default.records} == {"d0", "d1"}

    pinned = AlwaysLast()
    res = simulate_rate(w, 4.0, Disaggregated(2, 2, RDMA, policy=pinned), MODEL, COST)
    assert {(r.prefill_instance, r.decode_instance) for r in res.records} == {("p1", "d1")}
    assert len(pinned.seen) == 80 and len(pinned.outcomes) == 80
    view = pinned.seen[-1]
    assert [i.id for i in view.instances] == ["p0", "p1", "d0", "d1"]
    assert view.kv_bytes_per_token == 131072 and view.link_bytes_per_s == 50e9
    assert any(i.in_flight > 0 for i in view.instances if i.id in ("p1", "d1"))
    assert all(i.in_flight == 0 for i in view.instances if i.id in ("p0", "d0"))
    assert all(o.ok and o.ttft_s is not None and o.prefill_s is not None for o in pinned.outcomes)
    assert p95(res, "ttft") > p95(default, "ttft")  # one pair does the work of two

    mixed = simulate_rate(w, 4.0, Disaggregated(1, 1, RDMA, policy=ShortPromptsRecompute()), MODEL, COST)
    modes = {r.id: r.mode for r in mixed.records}
    prompts = {r.id: r.prompt_tokens for r in mixed.records}
    assert all(modes[i] == "recompute" for i in modes if prompts[i] < 512)
    assert all(modes[i] == "transfer" for i in modes if 512 <= prompts[i] <= 3000)
    assert all(r.exposed_transfer_s == 0 for r in mixed.records if r.mode == "recompute")


def test_policy_colocated_plan_and_errors() -> None:
    class Colo:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            return Plan.colocated("d0")

    class Bad:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            return Plan.transfer("p9", "d0")

    class WrongRole:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            return Plan.recompute("p0")  # a prefill-only instance

    class Refuse:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            raise NoRoute("down")

    w = fixed(20, 500, 8)
    res = simulate_rate(w, 2.0, Disaggregated(1, 1, RDMA, policy=Colo()), MODEL, COST)
    assert {(r.mode, r.decode_instance) for r in res.records} == {("colocated", "d0")}
    assert res.policy_failures == 0
    # what the proxy does with a plan it cannot serve: least-loaded serves the request instead, and it is counted
    for policy, why in (
        (Bad(), "'p9', which it was not offered"),
        (WrongRole(), "'p0' cannot serve a request"),
    ):
        replaced = simulate_rate(w, 2.0, Disaggregated(1, 1, RDMA, policy=policy), MODEL, COST)
        assert {(r.mode, r.prefill_instance, r.decode_instance) for r in replaced.records} == {
            ("transfer", "p0", "d0")
        }
        assert replaced.policy_failures == 20 and why in replaced.policy_first_failure
    refused = simulate_rate(w, 2.0, Disaggregated(1, 1, RDMA, policy=Refuse()), MODEL, COST)
    assert all(r.dropped.startswith("no route") for r in refused.records)
    assert refused.summary(1, 1).attainment == 0.0


def test_cli_policy_replay_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy_file = tmp_path / "mypolicy.py"
    policy_file.write_text(
        "from vllm_disagg.router.policy import Plan\n"
        "class Pin:\n"
        "    def plan(self, request, cluster):\n"
        "        return Plan.recompute('d0', reason='replayed')\n"
    )
    argv = ["simulate", "--design", "disagg", "--requests", "30", "--rates", "2", "--json"]
    assert planner_main([*argv, "--policy", f"{policy_file}:Pin"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["results"][0]["design"] == "disagg 1P1D"
    assert data["results"][0]["summary"]["mean_exposed_transfer_s"] == 0.0


# -- profile feeds simulate --------------------------------------------------------------------------------------
def test_profile_file_feeds_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile(
        model="measured",
        prefill_tokens_per_s=10_000,
        decode_points=[DecodePoint(batch=1, step_s=0.010), DecodePoint(batch=64, step_s=0.010)],
        kv_capacity_tokens=500_000,
    )
    path = tmp_path / "profile.json"
    prof.save(path)
    cost = ProfileCost(Profile.load(path))
    w = fixed(50, 1000, 20)
    res = simulate_rate(w, 1.0, Disaggregated(1, 1, RDMA), MODEL, cost)
    s = res.summary(1e9, 1e9)
    assert s.tpot_s[50] == pytest.approx(0.010, rel=0.01)  # the measured step, not the roofline's
    # TTFT: prefill (base step + 1000 / 10,000 tok/s) + exposed transfer + the first decode step
    assert s.ttft_s[50] == pytest.approx(0.010 + 0.1 + s.mean_exposed_transfer_s + 0.010, rel=0.05)
    argv = ["simulate", "--profile", str(path), "--requests", "40", "--rates", "1,2", "--json"]
    assert planner_main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["results"]) == 4
    assert planner_main(["plan", "--profile", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == f"profile {path}"


# -- CLI and plots ------------------------------------------------------------------------------------------------
def test_cli_simulate_table_goodput_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    argv = ["simulate", "--requests", "60", "--rates", "2,6", "--prompt", "1024", "--output", "32"]
    assert planner_main([*argv, "--goodput", "--plot-dir", str(tmp_path), "--timeline-span", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "colocated x2" in out and "disagg 1P1D" in out and "TPOT p95" in out
    assert out.count("goodput ") == 2
    for name in ("latency_vs_rate.png", "timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_policy_observes_drops_with_the_reason() -> None:
    pinned = AlwaysLast()
    reqs = [Request(0, 0.0, 100, 10), Request(1, 0.1, 5000, 10)]
    design = Disaggregated(2, 2, RDMA, policy=pinned)
    simulate(reqs, design, MODEL, COST, EngineConfig(kv_capacity_tokens=1000))
    by_id = {o.request_id: o for o in pinned.outcomes}
    assert by_id["0"].ok and not by_id["1"].ok and "KV capacity" in by_id["1"].error


@pytest.mark.parametrize("policy", ["cost", "least-loaded"])
def test_simulate_loads_policies_by_the_proxys_names(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One loader for proxy and simulator: a built-in name works in both (``simulate --policy cost`` once failed)."""
    argv = ["simulate", "--model", "llama-3-8b", "--policy", policy, "--requests", "30", "--design", "disagg"]
    assert planner_main(argv) == 0
    assert "disagg 1P1D" in capsys.readouterr().out


def _rows(out: str, design: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(design)]


def test_a_rates_result_does_not_depend_on_the_rates_run_before_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A policy that learns (the cost model) starts each run fresh, and aims at the command line's SLOs."""
    argv = ["simulate", "--model", "llama-3-8b", "--design", "disagg", "--prompt", "exp:2048", "--output", "64",
            "--requests", "80", "--seed", "0", "--policy", "cost", "--tpot-slo-ms", "12"]  # fmt: skip
    assert planner_main([*argv, "--rates", "12"]) == 0
    alone = _rows(capsys.readouterr().out, "disagg 1P1D")
    assert planner_main([*argv, "--rates", "4,12,12"]) == 0
    after = _rows(capsys.readouterr().out, "disagg 1P1D")
    assert after[1] == after[2] == alone[0]


def test_goodput_with_a_warm_up_samples_every_probe_past_it(capsys: pytest.CaptureFixture[str]) -> None:
    """200 requests span 10 s at 20 req/s: a probe above that once had none left after a 10 s warm-up and read
    as failing, so goodput came out at the warm-up's rate, not the design's."""
    argv = ["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--prompt", "512", "--output", "128",
            "--requests", "200", "--rates", "5", "--goodput", "--design", "colocated", "--json"]  # fmt: skip
    assert planner_main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["goodput"]["colocated x2"]["rate"]
    assert planner_main([*argv, "--warmup", "10"]) == 0
    warm = json.loads(capsys.readouterr().out)["goodput"]["colocated x2"]["rate"]
    assert plain > 40 and abs(warm - plain) <= 0.1 * plain


def test_plan_sizes_decode_by_the_kv_capacity_given(capsys: pytest.CaptureFixture[str]) -> None:
    """50,000 KV tokens hold 21 requests of 2,304 tokens: decode's batch (and so its rate) is capped there."""
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--prompt", "2048", "--output", "256",
            "--rate", "12", "--json"]  # fmt: skip
    assert planner_main(argv) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert planner_main([*argv, "--kv-capacity-tokens", "50000"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["decode_batch"] <= 50000 // (2048 + 128) < roomy["decode_batch"]


# -- workload shapes, run length, overload, balancers -------------------------------------------------------------
def test_exponential_and_gamma_lengths() -> None:
    assert LengthDist.parse("exp:2048") == LengthDist("exp", 2048)
    assert LengthDist.parse("exp:2048:16:8192") == LengthDist("exp", 2048, 0.0, 16, 8192)
    assert LengthDist.parse("gamma:512:2") == LengthDist("gamma", 512, 2)
    assert LengthDist.parse("gamma:512:0.5:8:4096") == LengthDist("gamma", 512, 0.5, 8, 4096)
    for bad in ("exp:0", "exp:-5", "exp:100:50:10", "gamma:512", "gamma:512:0", "exp:1:2:3:4"):
        with pytest.raises(ValueError, match="bad length spec"):
            LengthDist.parse(bad)
    for spec, cv in (("exp:2048", 1.0), ("gamma:2048:0.5", 0.5), ("gamma:2048:2", 2.0)):
        xs = synthetic(20000, LengthDist.parse(spec), LengthDist("fixed", 1), seed=5).prompts
        mean = statistics.fmean(xs)
        assert mean == pytest.approx(2048, rel=0.05), spec
        assert statistics.pstdev(xs) / mean == pytest.approx(cv, rel=0.08), spec
    clipped = synthetic(5000, LengthDist.parse("exp:2048:100:3000"), LengthDist("fixed", 1), seed=5).prompts
    assert min(clipped) == 100 and max(clipped) == 3000


def test_duration_and_warmup_window(capsys: pytest.CaptureFixture[str]) -> None:
    w = fixed(requests_for_duration(60, 4.0), 256, 16, seed=2)
    assert w.covers(4.0, 60) and w.covers(1.0, 60)
    for rate in (1.0, 4.0):
        reqs = w.at_rate(rate, 60)
        assert reqs and max(r.arrival_s for r in reqs) <= 60 < w.at_rate(rate)[len(reqs)].arrival_s
        assert len(reqs) == pytest.approx(60 * rate, rel=0.35)
    res = simulate_rate(w, 4.0, Colocated(2), MODEL, COST, duration_s=60)
    full = res.summary(1e9, 1e9)
    warm = res.summary(1e9, 1e9, warmup_s=10)
    early = sum(r.arrival_s < 10 for r in res.records)
    assert early > 0 and warm.warmup_excluded == early and warm.requests == full.requests - early
    argv = ["simulate", "--duration", "20", "--warmup", "5", "--rates", "2", "--prompt", "exp:512", "--json"]
    assert planner_main([*argv, "--output", "exp:64"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert all(r["summary"]["warmup_excluded"] > 0 for r in rows)
    assert all(r["summary"]["requests"] == pytest.approx(30, rel=0.5) for r in rows)  # 2/s x (20 - 5) s
    assert planner_main(["simulate", "--duration", "5", "--warmup", "5"]) == 2


def test_overloaded_pool_is_flagged_not_reported_as_a_latency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1P4D with the prefill instance at 1.2x its token rate: the run's p95 TTFT grows with its length (no steady
    state), and the result says so instead of presenting it as a latency."""
    prompt = 2048
    capacity = prefill_rate(COST, prompt) / prompt
    design = Disaggregated(1, 4, RDMA)
    w = fixed(2000, prompt, 32)
    over = [simulate_rate(fixed(n, prompt, 32), 1.2 * capacity, design, MODEL, COST) for n in (200, 2000)]
    assert p95(over[1], "ttft") > 3 * p95(over[0], "ttft")  # the number only measures the run's length
    for res in over:
        assert not res.stability.stable
        load = {x.pool: x.utilization for x in res.stability.loads}
        assert load["prefill"] == pytest.approx(1.2, rel=0.05) and load["decode"] < 1
        assert res.stability.bottleneck is not None and res.stability.bottleneck.pool == "prefill"
    fine = simulate_rate(w, 0.7 * capacity, design, MODEL, COST)
    assert fine.stability.stable and {x.pool: x.utilization for x in fine.stability.loads}["prefill"] == (
        pytest.approx(0.7, rel=0.05)
    )
    # colocated: one pool of replicas carrying prefill and decode work
    colo = simulate_rate(w, 3 * capacity, Colocated(2), MODEL, COST)
    assert not colo.stability.stable and colo.stability.loads[0].pool == "replicas"
    # goodput never counts an overloaded rate as met
    g = goodput(w, design, MODEL, COST, ttft_slo_s=1e9, tpot_slo_s=1e9, start_rate=capacity)
    assert g.rate < capacity
    # text, JSON and plot
    rate = f"{1.2 * capacity:.4g}"
    argv = [
        "simulate",
        "--design",
        "disagg",
        "--decode",
        "4",
        "--requests",
        "300",
        "--rates",
        f"{0.5 * capacity:.4g},{rate}",
    ]
    assert planner_main([*argv, "--prompt", str(prompt), "--output", "32"]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("disagg 1P4D") and f" {rate} " in x)
    assert "unstable" in line and "prefill UNSTABLE" in line and "UNSTABLE: offered load" in text
    calm = next(x for x in text.splitlines() if x.startswith("disagg 1P4D") and "unstable" not in x.lower())
    assert "prefill" in calm
    assert planner_main([*argv, "--prompt", str(prompt), "--output", "32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["stable"] for r in rows] == [True, False]
    assert rows[1]["bottleneck"] == "prefill" and rows[1]["utilization"]["prefill"] > 1
    pytest.importorskip("matplotlib")
    from vllm_disagg.planner.plots import plot_latency_vs_rate

    s_ok, s_over = fine.summary(1e9, 1e9), over[0].summary(1e9, 1e9)
    path = plot_latency_vs_rate({"1P4D": [(1.0, s_ok, True), (2.0, s_over, False)]}, tmp_path / "p.png")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_colocated_and_pool_balancers(capsys: pytest.CaptureFixture[str]) -> None:
    w = fixed(400, 1024, 64, seed=4)
    rate = 0.7 * 2 * prefill_rate(COST, 1024) / 1024 / 4
    runs = {
        kind: simulate_rate(w, rate, Colocated(4, kind), MODEL, COST, seed=1)  # type: ignore[arg-type]
        for kind in ("least-loaded", "round-robin", "random")
    }
    rr = [r.decode_instance for r in runs["round-robin"].records]
    assert rr[:8] == ["c0", "c1", "c2", "c3"] * 2  # blind to load, in turn
    spread = {
        i: [r.decode_instance for r in runs["random"].records].count(i) for i in ("c0", "c1", "c2", "c3")
    }
    assert min(spread.values()) > 60 and spread != {i: 100 for i in spread}  # random, not in turn
    # a load-blind balancer sends requests to busy replicas: a longer TTFT tail than least-loaded
    assert p95(runs["random"], "ttft") > p95(runs["least-loaded"], "ttft")
    again = simulate_rate(w, rate, Colocated(4, "random"), MODEL, COST, seed=1)
    assert [r.decode_instance for r in again.records] == [r.decode_instance for r in runs["random"].records]
    dis = simulate_rate(
        w, 2.0, Disaggregated(2, 3, RDMA, prefill_routing="round-robin", decode_routing="random"), MODEL, COST
    )
    assert [r.prefill_instance for r in dis.records][:4] == ["p0", "p1", "p0", "p1"]
    assert {r.decode_instance for r in dis.records} == {"d0", "d1", "d2"}
    argv = ["simulate", "--requests", "50", "--replicas", "3", "--colocated-routing", "random", "--json"]
    assert planner_main([*argv, "--prefill-routing", "round-robin", "--decode-routing", "random"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 2


def test_simulator_and_proxy_share_default_slos() -> None:
    import argparse

    from vllm_disagg.planner.cli import add_subcommands
    from vllm_disagg.policy.cost_model import CostModelConfig

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="command"))
    for cmd in ("simulate", "plan"):
        ns = parser.parse_args([cmd])
        assert ns.tpot_slo_ms / 1e3 == CostModelConfig().tpot_slo_s
    assert parser.parse_args(["simulate"]).ttft_slo_ms / 1e3 == CostModelConfig().ttft_slo_s


def test_a_serial_token_overhead_lengthens_each_iteration_by_the_tokens_it_emits() -> None:
    """Four requests arriving together decode as one batch: each iteration pays the overhead once per stream."""
    from vllm_disagg.planner.engine import Engine, SimRequest
    from vllm_disagg.planner.workload import Request

    def durations(overhead: float) -> list[float]:
        e = Engine(
            "e", "both", COST, EngineConfig(token_overhead_s=overhead, stack_cpu="serial"), record=True
        )
        for i in range(4):
            e.submit(SimRequest(Request(i, 0.0, 100, 8)))
        now = 0.0
        while (d := e.start_iteration(now)) is not None:
            now += d
            e.finish_iteration(now)
        return [it.duration for it in e.iterations]

    plain, taxed = durations(0.0), durations(0.001)
    assert len(plain) == len(taxed) == 8  # one prefill iteration, then seven decode steps of the four
    assert [t - p for p, t in zip(plain, taxed, strict=True)] == pytest.approx([0.004] * 8)


def test_host_cores_give_the_stack_its_share_of_every_core() -> None:
    """1,000 tokens a second at 0.5 ms of stack CPU each is half a core of two: each engine keeps 3/4 of its
    core, so its iterations take 4/3 as long; a few windows after the tokens stop, nothing is taken."""
    host = HostCores(2, 0.0005)
    now = 0.0
    while now < 5.0:
        now += 0.01
        host.emitted(now, 10)
    assert host.slowdown(now) == pytest.approx(4 / 3, rel=0.02)
    assert host.slowdown(now + 10.0) == pytest.approx(1.0, abs=1e-3)
    assert HostCores(2, 1.0).slowdown(0.0) == 1.0
    flooded = HostCores(2, 1.0)
    flooded.emitted(0.0, 1000)
    assert flooded.slowdown(0.0) == pytest.approx(1 / (1 - HostCores.MAX_SHARE))


def test_the_stacks_cpu_shared_over_the_cores_slows_prefill_beside_many_streams_and_decode_less() -> None:
    """A P/D pair on one CPU host, sixteen streams decoding and a long prompt arriving among them: the stack's CPU
    for the streams' tokens runs on both cores, so it lengthens the prefill instance's iterations too (it does not
    when charged inside the decode instance's iterations), and decode's TPOT is lower than that serial charge makes
    it (the decode instance pays a share of the cost, not all of it)."""
    reqs = [Request(i, 0.001 * i, 200, 400) for i in range(16)] + [Request(16, 1.0, 4000, 8)]
    tpot_step = 0.0004  # stack CPU per emitted token

    def run(cfg: EngineConfig) -> tuple[float, float]:
        res = simulate(reqs, Disaggregated(1, 1, RDMA), MODEL, COST, cfg, record_iterations=True)
        long_prefill = sum(it.duration for it in res.iterations["p0"] if it.start >= 1.0)
        streams = [r.tpot_s for r in res.records if r.id < 16 and r.tpot_s is not None]
        return long_prefill, statistics.median(streams)

    alone_prefill, alone_tpot = run(EngineConfig())
    shared_prefill, shared_tpot = run(EngineConfig(token_overhead_s=tpot_step, stack_cpu="shared"))
    serial_prefill, serial_tpot = run(EngineConfig(token_overhead_s=tpot_step, stack_cpu="serial"))
    assert serial_prefill == pytest.approx(alone_prefill + tpot_step)  # its one token, the prompt's first
    assert shared_prefill > 1.1 * alone_prefill
    assert alone_tpot < shared_tpot < serial_tpot


def test_the_stacks_share_of_the_cores_counts_against_every_pools_capacity() -> None:
    """A point whose engines have time to spare alone is past capacity once the stack's CPU for its tokens takes
    half the host: the utilisation is the engines' work over what each keeps of its core."""
    w = fixed(200, 512, 64)
    rate = 20.0
    plain = simulate_rate(w, rate, Disaggregated(1, 1, RDMA), MODEL, COST).stability
    # 20 req/s x 64 tokens x 0.78 ms is one core of the two: each engine keeps half of its core
    cfg = EngineConfig(token_overhead_s=1 / (rate * 64))
    shared = simulate_rate(w, rate, Disaggregated(1, 1, RDMA), MODEL, COST, engine=cfg).stability
    top, busy = plain.bottleneck, shared.bottleneck
    assert top is not None and busy is not None and top.pool == busy.pool
    assert busy.utilization == pytest.approx(2 * top.utilization, rel=1e-6)
    assert plain.stable
    assert not simulate_rate(
        w, rate, Disaggregated(1, 1, RDMA), MODEL, COST, engine=replace(cfg, token_overhead_s=2 / (rate * 64))
    ).stability.stable


def test_a_prompt_being_computed_waits_and_only_decoding_requests_are_streams() -> None:
    """The policy's view of an engine, as the proxy builds it: a prompt being computed (a transfer's prefill leg
    or a local one) has not begun its answer; only decoding requests are streams."""
    from vllm_disagg.planner.engine import Engine, SimRequest
    from vllm_disagg.planner.workload import Request

    e = Engine("e", "both", COST, EngineConfig(chunked_prefill=True, max_batched_tokens=4096))
    e.submit(SimRequest(Request(0, 0.0, 2000, 8), prefill_only=True))
    e.submit(SimRequest(Request(1, 0.0, 100, 8)))
    e.start_iteration(0.0)  # both prompts are admitted into one iteration
    assert len(e.prefilling) == 2 and (e.prompts, e.streams) == (2, 0)
    now = 0.0
    while e.prefilling:
        now += 1.0
        e.finish_iteration(now)
        if e.prefilling:
            e.start_iteration(now)
    assert (e.prompts, e.streams) == (0, 1)  # the leg is done here; the local one decodes


# -- prefix cache ------------------------------------------------------------------------------------------------
def cpu_profile(context_step_s: float | None = None) -> Profile:
    """10,000 prefill tokens/s; a 5 ms step at 128 context tokens (+1 ms a stream); optionally 8 streams of 1,152
    context tokens measured at ``context_step_s``."""
    points = [DecodePoint(batch=b, step_s=0.005 + 0.001 * (b - 1), context_tokens=128) for b in (1, 8)]
    if context_step_s is not None:
        points.append(DecodePoint(batch=8, step_s=context_step_s, context_tokens=1152))
    return Profile(prefill_tokens_per_s=10_000.0, decode_points=points)


def test_shared_prefixes_are_equally_often_and_lengthen_the_prompt() -> None:
    w = synthetic(
        40, LengthDist("fixed", 128), LengthDist("fixed", 8), seed=1, num_prefixes=4, prefix_tokens=1024
    )
    assert set(w.prompts) == {1152} and w.prefix_tokens == 1024
    assert sorted(w.prefixes.count(k) for k in range(4)) == [10, 10, 10, 10]
    assert w.prefixes != tuple(sorted(w.prefixes))  # shuffled
    reqs = w.at_rate(2.0)
    assert {(r.prefix_tokens, r.prefix >= 0) for r in reqs} == {(1024, True)}
    assert {r.prefix for r in fixed(5, 100, 8).at_rate(1.0)} == {-1}


def test_a_prompt_whose_prefix_an_instance_holds_computes_only_the_rest() -> None:
    """The second request of a prefix, on the instance that computed the first, computes 128 tokens, not 1,152:
    its TTFT is the suffix's prefill; a prompt of another prefix computes everything."""
    cost = ProfileCost(cpu_profile())
    reqs = [
        Request(0, 0.0, 1152, 8, prefix=0, prefix_tokens=1024),
        Request(1, 10.0, 1152, 8, prefix=0, prefix_tokens=1024),
        Request(2, 20.0, 1152, 8, prefix=1, prefix_tokens=1024),
    ]
    res = simulate(reqs, Colocated(1), MODEL, cost, EngineConfig(chunked_prefill=True))
    ttft = [r.ttft_s for r in res.records]
    assert ttft[0] == pytest.approx(0.005 + 1152 / 10_000) and ttft[2] == pytest.approx(ttft[0])
    assert ttft[1] == pytest.approx(0.005 + 128 / 10_000)
    assert [r.cached_tokens for r in res.records] == [0, 1024, 0]


def test_a_transfer_moves_only_what_the_decode_instance_misses_and_both_then_hold_the_prefix() -> None:
    """P/D: the first request of a prefix computes it on p0 and moves all of it; the second finds it on both (p0
    computed it, d0 received it): it computes 128 tokens and moves 128 tokens' KV."""
    cost = ProfileCost(cpu_profile())
    link = link_preset("100gbe")
    reqs = [Request(i, 10.0 * i, 1152, 8, prefix=0, prefix_tokens=1024) for i in range(2)]
    res = simulate(reqs, Disaggregated(1, 1, link, layerwise=False), MODEL, cost, EngineConfig())
    first, second = res.records
    assert second.cached_tokens == 1024
    wire = link.wire_s(MODEL.kv_bytes(1152)) - link.wire_s(MODEL.kv_bytes(128))
    assert first.exposed_transfer_s - second.exposed_transfer_s == pytest.approx(wire, rel=1e-6)


def test_a_decode_step_reads_its_streams_context_where_the_profile_measured_it() -> None:
    """8 streams of 1,152 context tokens measured 12 ms more than the batch curve's 12 ms at 128: 12 ms / (8 x
    1,024) a context token. A profile without such a point keeps the step flat in context."""
    prof = cpu_profile(context_step_s=0.024)
    assert prof.decode_context_tokens == 128 and prof.decode_step_s(8) == pytest.approx(0.012)
    assert prof.decode_s_per_kv_token == pytest.approx(0.012 / (8 * 1024))
    cost = ProfileCost(prof)
    assert cost.step_s(BatchShape.decode(8, 1152)) == pytest.approx(0.024)
    assert cost.step_s(BatchShape.decode(4, 128)) == pytest.approx(prof.decode_step_s(4))
    flat = ProfileCost(cpu_profile())
    assert flat.step_s(BatchShape.decode(8, 1152)) == pytest.approx(0.012)


def test_the_policy_sees_a_new_prefix_where_its_first_prompt_was_sent_before_it_is_computed() -> None:
    """As the proxy's index counts a routed prompt's blocks on its instances at once (pending), the simulator's
    policy view does: the prompts of the same new prefix that arrive while the first is computed see it there
    (and so are not prompts worth handing off), a prompt of another prefix sees it nowhere."""
    from vllm_disagg.planner.simulate import Adaptive
    from vllm_disagg.policy.cost_model import CostModel

    seen: list[dict[str, int]] = []

    class Spy(CostModel):
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            seen.append({i.id: i.cached_tokens for i in cluster.instances})
            return super().plan(request, cluster)

    cost = ProfileCost(cpu_profile())
    reqs = [Request(i, 0.01 * i, 1152, 8, prefix=0, prefix_tokens=1024) for i in range(3)]
    reqs.append(Request(3, 0.03, 1152, 8, prefix=1, prefix_tokens=1024))
    design = Adaptive(2, link_preset("100gbe"), policy=Spy())
    res = simulate(reqs, design, MODEL, cost, EngineConfig(chunked_prefill=True))
    first = res.records[0].decode_instance
    assert seen[0] == {"a0": 0, "a1": 0}
    assert seen[1][first] == 1024 and seen[2][first] == 1024
    assert seen[3] == {"a0": 0, "a1": 0}


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--rate", "10", "--max-util", "0"],
        ["plan", "--link-gbs", "-1"],
        ["plan", "--link-gbs", "0"],
        ["plan", "--link-setup-ms", "-5"],
        ["plan", "--max-util", "-1"],
        ["simulate", "--rates", "nan"],
        ["simulate", "--replicas", "0"],
        ["simulate", "--duration", "0"],
        ["simulate", "--max-batched-tokens", "0"],
    ],
)
def test_nonsense_numbers_are_refused_by_name(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Once these printed negative transfer times, a negative break-even or a traceback."""
    with pytest.raises(SystemExit) as exit_:
        planner_main(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["inf", "exp:inf", "0", "-5", "uniform:0:5", "lognormal:nan:0.5"])
def test_length_specs_must_be_finite_and_at_least_one_token(spec: str) -> None:
    with pytest.raises(ValueError, match="bad length spec"):
        LengthDist.parse(spec)


def test_a_trace_with_empty_prompts_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 100, "output_tokens": 5}\n'
                     '{"arrival_s": 1, "prompt_tokens": -100, "output_tokens": 5}\n')  # fmt: skip
    with pytest.raises(ValueError, match="trace line 2"):
        load_trace(str(trace))


def test_one_token_answers_have_no_tpot_and_count_as_meeting_it(capsys: pytest.CaptureFixture[str]) -> None:
    """As vllm bench serve counts them: left out of the TPOT percentiles (they once read 0.0), within the target."""
    argv = [
        "simulate",
        "--output",
        "1",
        "--requests",
        "50",
        "--rates",
        "2",
        "--design",
        "colocated",
        "--json",
    ]
    assert planner_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)["results"][0]["summary"]
    assert summary["tpot_s"]["p50"] is None and summary["attainment"] == 1.0


def test_cli_reports_a_policy_whose_plans_were_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy_file = tmp_path / "buggy.py"
    policy_file.write_text(
        "from vllm_disagg.router.policy import Plan\n"
        "class NoPrefill:\n"
        "    def plan(self, request, cluster):\n"
        "        return Plan('transfer', decode='d0')\n"
    )
    argv = ["simulate", "--design", "disagg", "--requests", "20", "--rates", "2"]
    assert planner_main([*argv, "--policy", f"{policy_file}:NoPrefill"]) == 0
    out = capsys.readouterr().out
    assert "replaced by least-loaded's for 20 request(s)" in out and "without a prefill instance" in out


def test_a_run_that_drops_every_request_is_not_stable(capsys: pytest.CaptureFixture[str]) -> None:
    """Requests larger than the KV cache are all dropped: nothing was served, which is flagged, never a plain row."""
    argv = ["simulate", "--model", "llama-3-70b", "--tp", "2", "--prompt", "40000", "--output", "256",
            "--max-model-len", "131072"]  # fmt: skip
    assert planner_main([*argv, "--requests", "20", "--rates", "0.5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert rows and all(r["all_dropped"] and not r["stable"] for r in rows)
    assert planner_main([*argv, "--requests", "20", "--rates", "0.5"]) == 0
    assert "no request fits an instance's KV cache" in capsys.readouterr().out


def test_a_warm_up_leaves_every_rate_its_requests(capsys: pytest.CaptureFixture[str]) -> None:
    """With --warmup, each rate of the table is --requests after its own warm-up, as the goodput probes are."""
    argv = ["simulate", "--design", "colocated", "--requests", "100", "--warmup", "10", "--rates", "2,10,20"]
    assert planner_main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    # (the warm-up's arrivals are sampled with headroom, so a few more than --requests may be left)
    assert all(r["summary"]["requests"] >= 100 for r in rows), [r["summary"]["requests"] for r in rows]


def test_goodput_probes_past_capacity_are_named_unstable(capsys: pytest.CaptureFixture[str]) -> None:
    """A probe past a pool's capacity counts as 0 attainment for the search, but it is no measurement: the text and
    the JSON say "unstable", never 0.0%."""
    argv = [
        "simulate",
        "--design",
        "disagg",
        "--requests",
        "200",
        "--rates",
        "14",
        "--goodput",
        "--seed",
        "0",
    ]
    argv += ["--ttft-slo-ms", "1000", "--tpot-slo-ms", "15"]
    assert planner_main([*argv, "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["goodput"]["disagg 1P1D"]
    assert g["unstable_probes"] and all(any(r == u for r, _ in g["probes"]) for u in g["unstable_probes"])
    assert planner_main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("goodput"))
    assert ":unstable" in line and ":0.0%" not in line


def test_a_trace_shorter_than_the_duration_is_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival_s": i, "prompt_tokens": 200, "output_tokens": 20}) + "\n" for i in range(30)
        )
    )
    assert (
        planner_main(
            [
                "simulate",
                "--design",
                "colocated",
                "--trace",
                str(trace),
                "--duration",
                "100",
                "--rates",
                "1",
                "--json",
            ]
        )
        == 0
    )
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any("arrivals end before --duration 100 s" in w for w in warnings), warnings


def test_the_cost_policy_replayed_knows_the_simulated_model_and_fixed_transfer_cost() -> None:
    """``simulate --policy cost`` builds the proxy's cost model with the simulated model's layers and the fixed cost
    per transfer the simulator charges, not the proxy's defaults (32 layers, 2 ms)."""
    import argparse

    from vllm_disagg.planner.cli import _policy
    from vllm_disagg.planner.hardware import link_preset
    from vllm_disagg.planner.model import preset_model

    ns = argparse.Namespace(
        policy="cost", policy_args="", no_layerwise=False, transfer_fixed_ms=1.2, proxy_hop_ms=2.0
    )
    policy = _policy(ns, 1.0, 0.05, preset_model("llama-3-70b"), link_preset("rdma-400g"))()
    assert policy.config.num_layers == 80
    assert policy.config.transfer_setup_s == pytest.approx(0.001 + 0.0032)


def test_equal_attainment_is_a_tie(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--requests",
        "100",
        "--rates",
        "0.5",
        "--ttft-slo-ms",
        "100000",
        "--tpot-slo-ms",
        "100000",
    ]
    assert planner_main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("rate 0.5:"))
    assert line.startswith("rate 0.5: tie, ") and "each serve 100.0%" in line


def test_a_huge_sample_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--requests 1e9 once allocated until a MemoryError traceback; --duration 1e12 the same."""
    assert MAX_REQUESTS == 1_000_000
    with pytest.raises(SystemExit):
        planner_main(["simulate", "--requests", "1000000000", "--rates", "1"])
    assert "1000000000 must be at most 1,000,000" in capsys.readouterr().err
    assert planner_main(["simulate", "--duration", "1e12", "--rates", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "over the simulator's limit of 1,000,000" in err
    assert planner_main(["simulate", "--requests", "10", "--warmup", "1e9", "--rates", "1"]) == 2
    assert "over the simulator's limit" in capsys.readouterr().err


def test_odd_inputs_are_refused_not_coerced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these once ran: 2048.5 rounded to 2048, MIN 1.5 to 1, --rates "" fell back to 1 req/s, --policy-args
    without --policy were ignored; vLLM's fp8_e4m3 was an unknown dtype, and usage errors came after 30 lines of
    usage text."""
    for spec in ("2048.5", "fixed:2048.5", "uniform:1:10.5", "lognormal:2048:0.5:1.5", "exp:512:1:100.5"):
        with pytest.raises(ValueError, match="whole numbers"):
            LengthDist.parse(spec)
    assert LengthDist.parse("lognormal:2048.5:0.5:16:8192").a == 2048.5  # a mean need not be whole
    sim = ["simulate", "--requests", "5", "--design", "colocated"]
    assert planner_main([*sim, "--prompt", "2048.5", "--rates", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: --prompt: bad length spec '2048.5'")
    with pytest.raises(SystemExit):
        planner_main([*sim, "--rates", ""])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rates: '' lists no values" in err
    assert planner_main([*sim, "--rates", "1", "--policy-args", "{bad"]) == 2
    assert "give --policy too" in capsys.readouterr().err
    assert preset_model("llama-3-8b").with_overrides(kv_dtype="fp8_e4m3").kv_bytes_per_token == 65536
    assert planner_main(["plan", "--json", "--kv-dtype", "fp8_e5m2"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 65536
    assert planner_main(["plan", "--json", "--kv-dtype", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 131072
    not_json = tmp_path / "passwd"
    not_json.write_text("root:x:0:0\n")
    assert planner_main(["plan", "--hf-config", str(not_json)]) == 2
    assert f"{not_json}: not a JSON config" in capsys.readouterr().err


def test_json_results_record_their_inputs_and_units(capsys: pytest.CaptureFixture[str]) -> None:
    """A saved simulate --json once held only results, and plan --json did not say which rates are per GPU."""
    argv = ["simulate", "--json", "--requests", "20", "--rates", "1,2", "--seed", "7", "--link", "100gbe",
            "--prompt", "exp:512:1:4096", "--policy", "cost", "--model", "qwen3-8b"]  # fmt: skip
    assert planner_main(argv) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["model"] == "qwen3-8b" and inputs["gpu"] == "H100-SXM" and inputs["tp"] == 1
    assert inputs["link"]["bytes_per_s"] == 12.5e9 and inputs["policy"] == "cost"
    w = inputs["workload"]
    assert (w["prompt"], w["output"], w["seed"], w["requests"]) == (
        "exp:512:1:4096",
        "lognormal:256:0.5:4:2048",
        7,
        20,
    )
    assert inputs["engine"]["max_batched_tokens"] == 8192 and inputs["ttft_slo_s"] > 0
    assert planner_main(["plan", "--json"]) == 0
    units = json.loads(capsys.readouterr().out)["units"]
    assert "per GPU" in units["prefill_tokens_per_s"] and "per GPU" in units["decode_tokens_per_s"]
    assert "per instance" in units["kv_capacity_tokens"]


def test_the_default_prompt_stays_inside_a_short_context_window(capsys: pytest.CaptureFixture[str]) -> None:
    """The default --prompt reaches 8,192 tokens: on a model with a 2,048-token window (the project's own tiny model
    profiled on CPU) simulate refused its own default. The default's mean and maximum follow the window."""
    argv = ["simulate", "--model", "llama-3-8b", "--max-model-len", "2048", "--requests", "40", "--rates", "1",
            "--output", "16", "--design", "colocated", "--json"]  # fmt: skip
    assert planner_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["workload"]["prompt"] == "lognormal:1024:0.5:16:2048"
    assert planner_main(["simulate", "--model", "llama-3-8b", "--requests", "40", "--rates", "1", "--output", "16",
                         "--design", "colocated", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["inputs"]["workload"]["prompt"] == "lognormal:2048:0.5:16:8192"
