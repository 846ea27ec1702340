"""The default policy on "both" instances that run a KV connector (the adaptive design), and the simulator's
adaptive design driven by the same policy object."""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_disagg.planner.cli import main as planner_main
from vllm_disagg.planner.costmodel import RooflineCost
from vllm_disagg.planner.hardware import InstanceSpec, Link, gpu_preset
from vllm_disagg.planner.model import preset_model
from vllm_disagg.planner.simulate import Adaptive, Colocated, simulate
from vllm_disagg.planner.workload import LengthDist, Request, synthetic
from vllm_disagg.policy.api import ClusterView, InstanceView, Plan, RequestView
from vllm_disagg.policy.builtin import AlwaysTransfer
from vllm_disagg.policy.cost_model import MAX_DUTY, CostModel, transfer_pairs

KV = 131_072
LINK = 12.5e9


def both(id: str, connector: bool = True, **kw: object) -> InstanceView:
    return InstanceView(id, "both", kv_connector=connector, **kw)  # type: ignore[arg-type]


def view(*insts: InstanceView, now: float | None = 0.0) -> ClusterView:
    return ClusterView(insts, kv_bytes_per_token=KV, link_bytes_per_s=LINK, now_s=now)


def req(tokens: int, rid: str = "r", max_tokens: int = 128) -> RequestView:
    return RequestView(request_id=rid, prompt_tokens=tokens, max_tokens=max_tokens, stream=True)


def test_both_instances_pair_only_when_both_run_a_connector() -> None:
    assert [(p.id, d.id) for p, d in transfer_pairs(view(both("a"), both("b")))] == [("a", "b"), ("b", "a")]
    assert transfer_pairs(view(both("a"), both("b", connector=False))) == []
    plan = CostModel().plan(req(4000), view(both("a", connector=False), both("b", connector=False)))
    assert plan.mode == "colocated" and plan.reason.startswith("no_pair")
    # the built-in transfer policy uses the same pairs
    assert AlwaysTransfer().plan(req(4000), view(both("a"), both("b"))).mode == "transfer"


def test_idle_pair_serves_alone_rather_than_pay_the_hand_off() -> None:
    plan = CostModel().plan(req(4000), view(both("a"), both("b")))
    assert plan.mode == "colocated"


def test_a_transfer_from_a_both_instance_stalls_its_own_streams() -> None:
    model = CostModel()
    busy_a, idle_b = both("a", running=6), both("b")
    cl = view(busy_a, idle_b)
    t = model.estimate(req(4000), cl, "transfer", idle_b, busy_a)
    assert t.streams == 6 and t.tpot_penalty_s > 0
    # so the prompt is computed where no stream waits for it: on b, alone
    plan = model.plan(req(4000), cl)
    assert (plan.mode, plan.decode) == ("colocated", "b")


def test_streams_move_off_an_instance_that_keeps_prefilling() -> None:
    """a has spent most of the last seconds prefilling; b decodes 4 streams. A long prompt is computed on a (no
    stream there to stall) and decoded on b, where later prefills will not interrupt it."""
    model = CostModel()
    for i in range(20):  # a's recent prefills, as this policy planned them
        model.plan(req(3000, f"w{i}"), view(both("a"), both("b", running=8, kv_usage=0.1), now=i * 0.2))
    assert model.duty("a", 4.0) > 0.3
    plan = model.plan(req(3000, "x"), view(both("a"), both("b", running=4), now=4.0))
    assert (plan.mode, plan.prefill, plan.decode) == ("transfer", "a", "b"), plan.alternatives


def test_duty_decays_and_needs_a_clock() -> None:
    model = CostModel()
    for i in range(10):
        model.plan(req(4000, f"w{i}"), view(both("a"), both("b", running=8), now=float(i)))
    hot = model.duty("a", 10.0)
    assert 0 < hot <= MAX_DUTY
    assert model.duty("a", 10.0 + 5 * model.config.duty_window_s) < hot / 100
    assert model.duty("a", None) == 0.0
    # without a clock in the view nothing accumulates
    fresh = CostModel()
    for i in range(10):
        fresh.plan(req(4000, f"w{i}"), view(both("a"), both("b"), now=None))
    assert fresh.duty("a", 0.0) == 0.0


def test_decisions_stay_explained() -> None:
    model = CostModel()
    plan = model.plan(req(3000), view(both("a", running=3), both("b", running=3)))
    assert plan.reason and plan.alternatives
    assert any(alt.startswith("transfer(") for alt in plan.alternatives)


def _workload(n: int = 300) -> list[Request]:
    w = synthetic(n, LengthDist.parse("exp:2048:64:8192"), LengthDist.parse("exp:256:8:1024"), seed=3)
    return w.at_rate(6.0)


def test_simulator_adaptive_design_uses_both_plans_and_serves_everything() -> None:
    model = preset_model("llama-3-8b")
    cost = RooflineCost(model, InstanceSpec(gpu_preset("h100-sxm")))
    requests = _workload()
    res = simulate(requests, Adaptive(2, Link("100GbE", 12.5e9)), model, cost, rate=6.0)
    modes = Counter(r.mode for r in res.records)
    assert modes["dropped"] == 0 and sum(modes.values()) == len(requests)
    assert modes["transfer"] > 0 and modes["colocated"] > 0, modes
    # the same instances without a connector never transfer
    colo = simulate(requests, Colocated(2), model, cost, rate=6.0)
    assert Counter(r.mode for r in colo.records)["transfer"] == 0


def test_simulator_adaptive_replays_any_policy_object() -> None:
    model = preset_model("llama-3-8b")
    cost = RooflineCost(model, InstanceSpec(gpu_preset("h100-sxm")))
    res = simulate(
        _workload(60), Adaptive(2, Link("100GbE", 12.5e9), policy=AlwaysTransfer()), model, cost, rate=6.0
    )
    assert {r.mode for r in res.records} == {"transfer"}


def test_cli_simulates_all_three_designs_and_names_a_winner(capsys: pytest.CaptureFixture[str]) -> None:
    assert planner_main(["simulate", "--design", "all", "--rates", "2,6", "--requests", "120"]) == 0
    out = capsys.readouterr().out
    for name in ("colocated x2", "disagg 1P1D", "adaptive x2"):
        assert name in out
    assert "rate 2: " in out and "within the SLOs" in out
