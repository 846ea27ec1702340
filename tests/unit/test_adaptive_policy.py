"""The default policy on "both" instances that run a KV connector (the adaptive design), and the simulator's
adaptive design driven by the same policy object."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from vllm_disagg.planner.cli import main as planner_main
from vllm_disagg.planner.costmodel import RooflineCost
from vllm_disagg.planner.hardware import InstanceSpec, Link, gpu_preset
from vllm_disagg.planner.model import preset_model
from vllm_disagg.planner.simulate import Adaptive, Colocated, simulate
from vllm_disagg.planner.workload import LengthDist, Request, synthetic
from vllm_disagg.policy.api import ClusterView, InstanceView, Outcome, Plan, RequestView
from vllm_disagg.policy.builtin import AlwaysTransfer
from vllm_disagg.policy.cost_model import MAX_DUTY, CostModel, transfer_pairs
from vllm_disagg.policy.regime import (
    MIN_SAMPLES,
    RECENT,
    WINDOW,
    Decision,
    Regime,
    RegimeConfig,
    RegimeTpots,
    wilson_lower,
)

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


FAST = {"prefill_tokens_per_s": 200_000.0, "ttft_slo_s": 0.5, "tpot_slo_s": 0.010, "decode_step_s": 0.003}
# pooled TPOTs where prefills stall streams: a quarter of them far past the 10 ms target, the rest at the step (the
# mean step stays well under the target, so a split's decode instance is predicted to meet it with every stream)
STALLED = (0.012, 0.003, 0.003, 0.003)


def drive(
    model: CostModel,
    start: float,
    seconds: float,
    rate: float,
    *,
    ttft: float,
    tpot: float | tuple[float, ...],
    split: tuple[float, float] | None = None,
    prompt: int = 2000,
    a_running: int = 4,
    b_running: int = 4,
) -> list[Plan]:
    """Requests at ``rate`` for ``seconds`` from ``start``, each observed at once with the given TTFT and TPOT (a
    tuple: the requests take its values in turn); ``split``: the (TTFT, TPOT) of requests planned split."""
    plans = []
    n = int(seconds * rate)
    tpots = tpot if isinstance(tpot, tuple) else (tpot,)
    for k in range(n):
        now = start + k / rate
        rid = f"t{now:.4f}"
        plan = model.plan(
            req(prompt, rid, 33), view(both("a", running=a_running), both("b", running=b_running), now=now)
        )
        ttft_k, tpot_k = (ttft, tpots[k % len(tpots)])
        if split is not None and plan.reason.startswith("split"):
            ttft_k, tpot_k = split
        model.observe(
            Outcome(
                rid, plan, True, prompt, prompt, ttft_s=ttft_k, e2e_s=ttft_k + 32 * tpot_k, output_tokens=33
            )
        )
        plans.append(plan)
    return plans


def test_group_splits_when_pooled_requests_miss_and_pools_again_when_load_falls() -> None:
    model = CostModel(**FAST)
    light = drive(model, 0.0, 6.0, 20.0, ttft=0.05, tpot=0.003)
    assert all(p.mode == "colocated" and p.reason.startswith("pooled") for p in light)
    # streams served pooled now see 12 ms a token against a 10 ms target (split ones 4 ms): split, prompts computed
    # on the instance with fewer streams (a), decoded on b; it stays split, missing nothing
    busy = drive(model, 6.0, 6.0, 20.0, ttft=0.05, tpot=0.012, split=(0.05, 0.004), a_running=1, b_running=6)
    split = [p for p in busy if p.mode == "transfer"]
    assert split and {(p.prefill, p.decode) for p in split} == {("a", "b")}
    assert busy[-1].mode == "transfer" and busy[-1].alternatives[0].startswith(
        "regime: split a (pooled_missed="
    )
    # a short prompt is not worth a hand-off: computed where it decodes, on b
    short = model.plan(req(100, "short", 33), view(both("a"), both("b", running=6), now=12.0))
    assert (short.mode, short.decode) == ("colocated", "b")
    assert short.reason.startswith("split,short_uncached_suffix")
    # load falls: split streams run at 2 ms a token and few prompts arrive, pooled serving is predicted well under
    # the target: pooled again
    calm = drive(model, 20.0, 15.0, 4.0, ttft=0.05, tpot=0.002)
    assert calm[-1].mode == "colocated" and calm[-1].reason.startswith("pooled")


def test_split_holds_for_its_minimum_then_yields_when_it_misses_more_than_pooled() -> None:
    model = CostModel(**FAST, min_regime_s=5.0)
    # a quarter of the pooled requests miss the TPOT target (streams a prefill stalled)
    drive(model, 0.0, 6.0, 20.0, ttft=0.02, tpot=STALLED, a_running=0)
    assert model.plan(req(2000, "x", 33), view(both("a"), both("b", running=4), now=6.0)).mode == "transfer"
    # every split request misses the 0.5 s TTFT target (more than pooled missed); within min_regime_s of the
    # switch the split holds
    switched = model._regime.since
    assert switched is not None
    held = drive(model, 6.0, switched + 4.0 - 6.0, 20.0, ttft=0.9, tpot=0.008, a_running=0)
    assert all(p.mode == "transfer" for p in held)
    later = drive(model, switched + 5.0, 3.0, 20.0, ttft=0.9, tpot=0.008, a_running=0)
    assert later[-1].mode == "colocated" and "split_missed=" in later[-1].alternatives[0]


def test_under_a_load_both_fail_the_group_keeps_the_one_that_fails_less() -> None:
    """Pooled misses a quarter of its requests, split all of them (on hardware where one decode instance is the
    bottleneck): after one try the group stays pooled, and tries the split again only once that memory is old."""
    model = CostModel(**FAST, min_regime_s=5.0, memory_s=60.0)
    plans = drive(model, 0.0, 60.0, 20.0, ttft=0.02, tpot=STALLED, split=(0.9, 0.012), a_running=0)
    tries = [
        k for k in range(1, len(plans)) if plans[k].mode == "transfer" and plans[k - 1].mode != "transfer"
    ]
    assert len(tries) == 1  # one exploration of the split in the first minute
    assert sum(p.mode == "transfer" for p in plans) < len(plans) * 0.2
    assert plans[-1].mode == "colocated"
    again = drive(model, 60.0, 30.0, 20.0, ttft=0.02, tpot=STALLED, split=(0.9, 0.012), a_running=0)
    assert any(p.mode == "transfer" for p in again)  # the memory of the failed split has expired: tried again


def test_no_regime_without_a_clock_or_beside_dedicated_instances() -> None:
    model = CostModel(**FAST)
    assert model.regime_for(view(both("a"), both("b"), now=None)) is None
    mixed = view(both("a"), both("b"), InstanceView("p", "prefill"), now=1.0)
    assert model.regime_for(mixed) is None
    assert model.regime_for(view(both("a"), both("b"), now=1.0)) is not None


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
    assert plan.reason.startswith("pooled") and plan.alternatives[0].startswith("regime: pooled")
    assert any(alt.startswith("colocated(") for alt in plan.alternatives[1:])


def _workload(n: int = 300, rate: float = 6.0) -> list[Request]:
    w = synthetic(n, LengthDist.parse("exp:2048:64:8192"), LengthDist.parse("exp:256:8:1024"), seed=3)
    return w.at_rate(rate)


def test_simulator_adaptive_design_uses_both_plans_and_serves_everything() -> None:
    model = preset_model("llama-3-8b")
    cost = RooflineCost(model, InstanceSpec(gpu_preset("h100-sxm")))
    requests = _workload(600, 8.0)
    # a TPOT target pooled serving misses at this load: the group splits for part of the run
    design = Adaptive(2, Link("100GbE", 12.5e9), ttft_slo_s=2.0, tpot_slo_s=0.012)
    res = simulate(requests, design, model, cost, rate=8.0)
    modes = Counter(r.mode for r in res.records)
    assert modes["dropped"] == 0 and sum(modes.values()) == len(requests)
    assert modes["transfer"] > 0 and modes["colocated"] > 0, modes
    # the same instances without a connector never transfer
    colo = simulate(requests, Colocated(2), model, cost, rate=8.0)
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


def _long_prefills_on(model: CostModel, instance: str, n: int) -> None:
    """``n`` long prompts planned onto ``instance`` (alone, so each lands there) in the last seconds: its duty."""
    for i in range(n):
        model.plan(req(1500, f"long-{instance}-{i}"), view(both(instance), now=float(i) * 0.2))


@pytest.mark.parametrize(("slope", "where"), [(0.0, "b"), (0.0006, "a")])
def test_short_streams_do_not_all_gather_where_no_long_prompt_runs(slope: float, where: str) -> None:
    """Pooled, with a's recent time spent on long prefills and the short streams on b: without a step that grows
    with the batch, the next short stream joins b's twelve (a split without the hand-off); with a CPU-like growth
    per stream it goes to a, whose batch is small."""
    model = CostModel(decode_step_s=0.005, decode_step_per_stream_s=slope, ttft_slo_s=2.0, tpot_slo_s=0.025)
    _long_prefills_on(model, "a", 15)
    cl = view(both("a", running=2, in_flight=2, connector=False), both("b", running=12, in_flight=12,
              connector=False), now=3.0)  # fmt: skip
    assert model.duty("a", 3.0) > 0.0
    plan = model.plan(req(64, "short", max_tokens=128), cl)
    assert (plan.mode, plan.decode) == ("colocated", where)


def test_pooled_every_instance_is_priced_at_the_groups_mean_prefill_duty() -> None:
    """The same state pooled: each instance computes its own share of the prompts, so a's history of long prefills
    (a split just left, say) is not held against it; even with no crowding term the short stream joins a's two
    streams, not b's twelve. Split, or with no regime, a's own duty still counts."""
    model = CostModel(decode_step_s=0.005, decode_step_per_stream_s=0.0, ttft_slo_s=2.0, tpot_slo_s=0.025)
    _long_prefills_on(model, "a", 15)
    cl = view(both("a", running=2, in_flight=2), both("b", running=12, in_flight=12), now=3.0)
    pooled = model.estimates(req(64, "short", max_tokens=128), cl, regime=Decision((), "test"))
    assert pooled[0].decode == "a"
    assert {e.decode: e.later_s for e in pooled}["a"] == pytest.approx(
        {e.decode: e.later_s for e in pooled}["b"]
    )
    alone = model.estimates(req(64, "short", max_tokens=128), cl)
    assert next(e for e in alone if e.mode == "colocated").decode == "b"


def test_step_growth_is_fitted_without_the_prefills_share_of_a_busy_instance() -> None:
    """a prefills long prompts and carries 1 stream, b carries 12 and prefills nothing: a's tokens are the slower
    ones, but only because of its prefills, so the fitted step still grows with the batch."""
    model = CostModel(decode_step_s=0.005, decode_step_per_stream_s=0.0001)

    def step(batch: int) -> float:
        return 0.005 + 0.0006 * batch

    for k in range(200):
        now = k * 0.25
        if k % 2 == 0:
            model.plan(req(1500, f"long{k}"), view(both("a", connector=False), now=now))
        instance, running = ("a", 1) if k % 4 == 0 else ("b", 12)
        duty = model.duty(instance, now)
        rid = f"s{k}"
        plan = model.plan(req(64, rid), view(both(instance, running=running, connector=False), now=now))
        tpot = step(running + 1) / (1.0 - duty)
        model.observe(Outcome(rid, plan, True, 64, 64, ttft_s=0.05, e2e_s=0.05 + 64 * tpot, output_tokens=65))
    assert model.duty("a", 50.0) > 0.2
    assert model.step_per_stream_s == pytest.approx(0.0006, rel=0.2)


CPU_LIKE = {
    "prefill_tokens_per_s": 5_000.0,
    "prefill_overhead_s": 0.0,
    "decode_step_s": 0.010,
    "ttft_slo_s": 1.5,
    "tpot_slo_s": 0.025,
}


def test_a_split_computes_a_prompt_on_its_decode_instance_only_as_overflow() -> None:
    """Split with ``a`` prefilling: a hand-off that meets the targets wins even where serving on ``b`` alone would
    be quicker (the TTFT target has room for the wait; ``b``'s future streams do not). Once ``a``'s queue would
    push the hand-off past the TTFT target, ``b`` computes the prompt itself: its streams absorb one stall."""
    model = CostModel(**CPU_LIKE)
    split = Decision(("a",), "test")
    quiet = model.estimates(req(2000), view(both("a"), both("b")), split)
    assert (quiet[0].mode, quiet[0].prefill, quiet[0].decode) == ("transfer", "a", "b") and quiet[0].meets_slo
    local = next(e for e in quiet if e.mode == "colocated")
    assert local.meets_slo and local.cost < quiet[0].cost  # cheaper, yet not chosen
    backed_up = model.estimates(req(2000), view(both("a", waiting=6), both("b", running=2)), split)
    assert (backed_up[0].mode, backed_up[0].decode) == ("colocated", "b") and backed_up[0].meets_slo
    assert next(e for e in backed_up if e.mode == "transfer").misses == ("ttft",)
    # the prefill instance is never a local candidate within the split
    assert all(e.decode == "b" for e in backed_up)


def test_a_stall_counts_against_the_tpot_target_spread_over_a_streams_tokens() -> None:
    """A TPOT target is a mean over the stream, as a goodput counts it: a 0.4 s prefill beside streams of ~128
    tokens adds ~3 ms to theirs, not 0.4 s. Streams fitted to 8 tokens take the same stall as 50 ms a token."""
    model = CostModel(**CPU_LIKE)
    cl = view(both("a", running=3), both("b", running=3))
    est = model.estimate(req(2000), cl, "colocated", cl.instances[0])
    stall = 2000 / 5_000.0
    assert est.tpot_s == pytest.approx(0.010 + stall / 128) and "tpot" not in est.misses
    for i in range(60):
        plan = model.plan(req(2000, f"s{i}", 8), cl)
        model.observe(Outcome(f"s{i}", plan, True, 2000, 2000, ttft_s=0.5, e2e_s=0.58, output_tokens=8))
    assert model.typical_output_tokens == pytest.approx(8, rel=0.05)
    assert "tpot" in model.estimate(req(2000), cl, "colocated", cl.instances[0]).misses


def test_ungated_a_split_is_tried_even_where_its_prefill_instance_could_not_keep_up_alone() -> None:
    """Arrivals beyond what one instance can prefill (2 s prompts, 20 a second): without ``split_ttft_gate`` the
    split is tried when pooled serving misses, and the measured misses decide."""
    model = CostModel(**CPU_LIKE, split_ttft_gate=False)
    drive(model, 0.0, 6.0, 20.0, ttft=0.9, tpot=(0.040, 0.010), prompt=10_000, a_running=1, b_running=3)
    plan = model.plan(req(10_000, "x", 33), view(both("a"), both("b", running=3), now=6.0))
    assert plan.alternatives[0].startswith("regime: split a (pooled_missed=")
    assert "prefill_util=" in plan.alternatives[0]


GATED = {**CPU_LIKE, "split_ttft_gate": True}
STALLED_CPU = (0.040, 0.008, 0.008, 0.008)  # STALLED against the 25 ms target


def test_no_split_is_tried_where_its_prefill_instance_could_not_keep_up_alone() -> None:
    """Arrivals beyond what one instance can prefill (2 s prompts, 20 a second): pooled serving misses, yet the
    group stays pooled, since every hand-off would queue behind the last on one instance; the reason says so."""
    model = CostModel(**GATED)
    drive(model, 0.0, 6.0, 20.0, ttft=0.9, tpot=(0.040, 0.010), prompt=10_000, a_running=1, b_running=3)
    plan = model.plan(req(10_000, "x", 33), view(both("a"), both("b", running=3), now=6.0))
    assert plan.mode == "colocated"
    head = "regime: pooled (pooled_missed=50%,split_missed_predicted="
    assert plan.alternatives[0].startswith(head)
    assert int(plan.alternatives[0][len(head) :].rstrip("%)")) >= 95  # nearly every arrival is a hand-off


def test_a_mix_is_split_past_its_prefill_instances_capacity_where_only_the_long_prompts_would_miss() -> None:
    """The same long prompts, a quarter of the arrivals among short streams: one prefill instance still cannot keep
    up with them (rho 10), but a split is predicted to miss only them (25%), where pooled serving missed half of
    everything (the long prefills stall the streams beside them): the group splits, and stays split while it misses
    less than pooled did."""
    model = CostModel(**GATED)
    rate = 20.0
    for k in range(int(6.0 * rate)):
        now = k / rate
        tokens = 10_000 if k % 4 == 0 else 64
        rid = f"m{k}"
        plan = model.plan(req(tokens, rid, 33), view(both("a"), both("b", running=3), now=now))
        ttft, tpot = (0.9, 0.040 if k % 2 else 0.010)
        if plan.reason.startswith("split"):  # the long prompts queue on a; the streams on b run at 10 ms
            ttft, tpot = (3.0 if tokens > 64 else 0.1, 0.010)
        model.observe(
            Outcome(rid, plan, True, tokens, tokens, ttft_s=ttft, e2e_s=ttft + 32 * tpot, output_tokens=33)
        )
    rho, share = model._regime.split_miss_predicted(6.0, 1 / 5_000.0)
    assert rho > 1.0 and share == pytest.approx(0.25, abs=0.03)
    plan = model.plan(req(10_000, "x", 33), view(both("a"), both("b", running=3), now=6.0))
    assert plan.mode == "transfer"
    head = "regime: split a (pooled_missed="
    assert plan.alternatives[0].startswith(head)
    assert int(plan.alternatives[0][len(head) :].split("%")[0]) >= 45


def test_a_split_is_left_at_once_when_its_prefill_instance_is_past_its_capacity_and_misses_confirm_it() -> (
    None
):
    """Entered at a load one prefill instance carries (0.1 s prompts at 2 a second; pooled missed a quarter), the split
    is left once the hand-offs arrive faster than it can prefill them (15 a second) and its requests since it was
    entered miss as often as pooled did: within 2 s, not after the regime's 30 s hold. Past capacity with no miss
    yet, it stays."""
    model = CostModel(
        **{**FAST, "prefill_tokens_per_s": 20_000.0, "prefill_overhead_s": 0.0, "ttft_slo_s": 1.0},
        min_regime_s=30.0,
        split_ttft_gate=True,
    )
    drive(model, 0.0, 8.0, 2.0, ttft=0.1, tpot=STALLED, split=(0.1, 0.004), a_running=1, b_running=4)
    assert model.plan(req(2000, "x", 33), view(both("a"), both("b", running=4), now=8.0)).mode == "transfer"
    unconfirmed = drive(
        model, 8.5, 1.0, 15.0, ttft=0.1, tpot=0.004, split=(0.1, 0.004), a_running=1, b_running=4
    )
    assert all(p.alternatives[0].startswith("regime: split a") for p in unconfirmed)
    busy = drive(model, 9.5, 3.0, 15.0, ttft=0.1, tpot=0.004, split=(1.5, 0.004), a_running=1, b_running=4)
    left = next(i for i, p in enumerate(busy) if p.alternatives[0].startswith("regime: pooled"))
    assert left <= 30
    why = busy[left].alternatives[0]
    assert why.startswith("regime: pooled (split_missed=")
    assert int(why.split("split_missed=")[1].split("%")[0]) >= 25  # as often as pooled did
    assert "prefill_util=" in busy[left].alternatives[0]


def mix(model: CostModel, start: float, seconds: float, *, missed: tuple[int, ...]) -> list[Plan]:
    """20 arrivals a second, every fourth a 10,000-token prompt (one prefill instance cannot keep up with them:
    rho 10), the rest 64-token streams; an arrival whose index mod 4 is in ``missed`` misses its TTFT target."""
    plans = []
    rate = 20.0
    for k in range(int(seconds * rate)):
        now = start + k / rate
        tokens = 10_000 if k % 4 == 0 else 64
        rid = f"x{now:.4f}"
        plan = model.plan(req(tokens, rid, 33), view(both("a"), both("b", running=3), now=now))
        ttft = 3.0 if k % 4 in missed else 0.1
        model.observe(
            Outcome(rid, plan, True, tokens, tokens, ttft_s=ttft, e2e_s=ttft + 32 * 0.010, output_tokens=33)
        )
        plans.append(plan)
    return plans


def test_a_mix_past_capacity_stays_split_while_it_misses_no_more_than_pooled_did() -> None:
    """Split because pooled missed half, the mix's long prompts a quarter of the arrivals and past the prefill
    instance's capacity: the split is predicted to miss them (25%), under what pooled missed, so a split that
    misses as much as pooled did (its backlog: the long prompts and one in four streams) is not left at once; only
    one that misses the margin more than pooled did is."""
    model = CostModel(**{**GATED, "min_regime_s": 30.0})
    entered = mix(model, 0.0, 6.0, missed=(0, 1))
    assert entered[-1].alternatives[0].startswith("regime: split a (pooled_missed=5")
    tie = mix(model, 6.0, 6.0, missed=(0, 1))
    assert all(p.alternatives[0].startswith("regime: split a") for p in tie)
    worse = mix(model, 12.0, 25.0, missed=(0, 1, 2))  # 75% missed: past 50% + the margin, after the 30 s hold
    left = next(i for i, p in enumerate(worse) if p.alternatives[0].startswith("regime: pooled"))
    assert worse[left].alternatives[0].startswith("regime: pooled (split_missed=75%")
    assert 12.0 + left / 20.0 >= 30.0


def mix_missing(model: CostModel, start: float, seconds: float, percent: int, rate: float) -> list[Plan]:
    """``rate`` arrivals a second, every fourth a 2,000-token prompt (0.4 s on one prefill instance), the rest
    64-token streams, ``percent`` of them (spread evenly) missing their TPOT target."""
    plans = []
    for k in range(int(seconds * rate)):
        now = start + k / rate
        tokens = 2_000 if k % 4 == 0 else 64
        rid = f"y{now:.4f}"
        plan = model.plan(req(tokens, rid, 33), view(both("a"), both("b", running=3), now=now))
        ttft = tokens / 5_000.0 + 0.01
        tpot = 0.040 if (k * percent) % 100 < percent else 0.010
        model.observe(
            Outcome(rid, plan, True, tokens, tokens, ttft_s=ttft, e2e_s=ttft + 32 * tpot, output_tokens=33)
        )
        plans.append(plan)
    return plans


def test_a_mix_past_capacity_is_not_left_on_a_tie_with_pooleds_record_from_a_lighter_load() -> None:
    """Split at 6 requests/s (its prefill instance at rho 0.6) where pooled missed ~10%; at 20 a second that instance
    is past its capacity (rho 2) and the split misses 15%: more than pooled's record, within the margin of it. It is
    predicted to miss only its hand-offs (a quarter of the arrivals), and pooled at this load would stall every
    stream with the same long prompts, so it stays split; a stream of long prompts alone is still left at once
    (``test_a_split_is_left_at_once_when_its_prefill_instance_is_past_its_capacity_and_misses_confirm_it``)."""
    model = CostModel(**{**GATED, "min_regime_s": 30.0})
    entered = mix_missing(model, 0.0, 15.0, 10, rate=6.0)
    head = "regime: split a (pooled_missed="
    assert entered[-1].alternatives[0].startswith(head)
    assert 10 <= int(entered[-1].alternatives[0][len(head) :].split("%")[0]) <= 15
    heavier = mix_missing(model, 15.0, 10.0, 15, rate=20.0)
    rho, share = model._regime.split_miss_predicted(25.0, 1 / 5_000.0)
    assert rho > 1.5 and share == pytest.approx(0.25, abs=0.03)
    assert all(p.alternatives[0].startswith("regime: split a") for p in heavier)


def test_a_regimes_record_still_counts_when_its_load_returns_after_an_idle_spell() -> None:
    """Pooled left at 20 requests/s missing 40%; after a minute with no arrivals the same load comes back. The
    decayed arrival rate needs a time constant to climb back; the record is kept until the latest arrivals show
    the load, and their own rate shows it at once: a split missing 30% (under 40% + the margin) is not left for
    pooled in the first seconds."""
    regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0), 1.0, 0.025, 0.9)
    arrive = Arrivals(regime, 0.1)
    assert not arrive(20.0, 10.0)[-1].split
    feed(regime, False, WINDOW, 24)
    assert arrive(20.0, 1.0)[-1].split
    arrive.now += 60.0
    feed(regime, True, WINDOW, 18)
    assert all(d.split for d in arrive(20.0, 2.0))
    assert regime.load(arrive.now) == pytest.approx(20.0, rel=0.1)


def feed(regime: Regime, split: bool, n: int, misses: int) -> None:
    """``n`` finished requests of one regime, ``misses`` of them (spread evenly) past the 1 s TTFT target."""
    for k in range(n):
        regime.observe(split, 2.0 if (k * misses) % n < misses else 0.1, 0.010)


def test_a_regime_is_left_only_when_it_misses_the_margin_more_than_the_other_did() -> None:
    """Pooled left with 36% missed: a split missing 40% is that share's noise between two windows of 60 and is
    held; one missing 50% (past 36% + the 10-point margin) is left. Back pooled, the same margin holds it."""
    group = [both("a"), both("b", running=2)]
    regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0), 1.0, 0.025, 0.9)
    feed(regime, False, WINDOW, 22)
    assert regime.decide(1.0, group, 0.1, 0.1).split
    feed(regime, True, WINDOW, 24)
    assert regime.decide(2.0, group, 0.1, 0.1).split
    feed(regime, True, WINDOW, 30)
    assert not regime.decide(3.0, group, 0.1, 0.1).split
    feed(regime, False, WINDOW, 33)  # 55% against the split's 50%: held
    assert not regime.decide(4.0, group, 0.1, 0.1).split
    feed(regime, False, WINDOW, 40)
    assert regime.decide(5.0, group, 0.1, 0.1).split


class Arrivals:
    """Arrivals at a rate, each one a ``Regime.decide`` over two instances (b runs two streams) on one clock;
    ``prefill_s``: the typical prompt's fitted time and its compute part. Evenly spaced, or Poisson with ``rng``."""

    def __init__(self, regime: Regime, prefill_s: float, rng: random.Random | None = None) -> None:
        self.regime, self.prefill_s, self.rng, self.now = regime, prefill_s, rng, 0.0
        self.group = [both("a"), both("b", running=2)]

    def __call__(self, rate: float, seconds: float) -> list[Decision]:
        out = []
        if self.rng is None:
            for _ in range(int(rate * seconds)):
                self.now += 1.0 / rate
                out.append(self.regime.decide(self.now, self.group, self.prefill_s, self.prefill_s))
            return out
        end = self.now + seconds
        while self.now < end:
            self.now += self.rng.expovariate(rate)
            out.append(self.regime.decide(self.now, self.group, self.prefill_s, self.prefill_s))
        return out


def test_what_a_regime_missed_at_a_heavier_load_does_not_keep_it_out_at_a_lighter_one() -> None:
    """The split, left at 20 requests/s missing 80%, is not re-entered while pooled misses half at that load; once
    the load falls to a quarter, what it missed then no longer counts, and pooled's misses bring it back."""
    regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0), 1.0, 0.025, 0.9)
    arrive = Arrivals(regime, 0.1)

    feed(regime, False, WINDOW, 30)
    assert arrive(20.0, 10.0)[-1].split
    feed(regime, True, WINDOW, 48)
    assert not arrive(20.0, 1.0)[-1].split
    feed(regime, False, WINDOW, 30)
    assert not any(d.split for d in arrive(20.0, 10.0))
    lighter = arrive(5.0, 30.0)
    assert lighter[-1].split and not lighter[0].split


def test_a_record_taken_in_a_burst_still_counts_at_the_steady_load() -> None:
    """At 10 requests/s, pooled is left (missing 40%) right after eight arrivals came within 0.2 s: the record is
    taken at the decayed rate, not the burst's, so back at the steady 10 a second it still counts and a split
    missing 30% (under 40% + the margin) is not left for pooled."""
    regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0), 1.0, 0.025, 0.9)
    arrive = Arrivals(regime, 0.1)
    assert not arrive(10.0, 10.0)[-1].split
    assert not arrive(40.0, 0.2)[-1].split
    feed(regime, False, WINDOW, 24)
    assert arrive(40.0, 0.025)[-1].split
    feed(regime, True, WINDOW, 18)
    assert all(d.split for d in arrive(10.0, 5.0))


def test_a_steady_load_does_not_forget_a_record_on_its_own_noise() -> None:
    """Poisson arrivals at 8 a second, pooled left missing 13%, then a split missing 13% (within the margin): over
    30 s the split is left for pooled in none of twenty seeded runs (the decayed rates' noise alone made the load
    look lighter than the record's in five of them at ``LOAD_KEPT`` 0.8)."""
    left = 0
    for seed in range(20):
        regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=5.0), 1.5, 0.025, 0.9)
        arrive = Arrivals(regime, 0.1, random.Random(seed))
        arrive(8.0, 10.0)
        feed(regime, False, WINDOW, 8)
        assert arrive(8.0, 1.0)[-1].split
        feed(regime, True, WINDOW, 8)
        left += not all(d.split for d in arrive(8.0, 30.0))
    assert left == 0


def test_a_split_is_not_left_as_load_having_fallen_to_a_pooled_regime_that_missed_at_this_load() -> None:
    """Split streams run at 2 ms a token and a prompt's compute is short, so pooled serving is predicted well under
    the 25 ms target; but pooled missed 90% when it was left, at this load: the split stays. At a quarter of the
    load (that record no longer counts) it is left as before."""
    regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0), 1.0, 0.025, 0.9)
    arrive = Arrivals(regime, 0.01)

    arrive(10.0, 10.0)
    feed(regime, False, WINDOW, 54)
    assert arrive(10.0, 1.0)[-1].split
    for _ in range(WINDOW):
        regime.observe(True, 0.1, 0.002)
    assert all(d.split for d in arrive(10.0, 10.0))
    lighter = arrive(2.5, 30.0)
    assert not lighter[-1].split and lighter[-1].why.startswith("pooled_tpot_predicted=")


def test_a_new_regime_is_not_judged_by_requests_sharing_the_instances_with_the_old_ones_backlog() -> None:
    """Requests planned split while pooled requests are still in flight miss (the pooled queues they wait behind)
    but are not counted against the split; once those finish, the split's requests count, and after twice the
    hold they count whatever is still in flight."""
    model = CostModel(**FAST, min_regime_s=5.0)
    cl = view(both("a"), both("b", running=4), now=0.0)
    for k in range(3):  # in flight across the switch
        assert model.plan(req(2000, f"old{k}", 33), cl).reason.startswith("pooled")
    drive(model, 0.1, 2.0, 10.0, ttft=0.9, tpot=0.004, a_running=0)
    assert model._regime.prefill  # split on pooled's misses

    def split_request(rid: str, now: float) -> None:
        plan = model.plan(req(2000, rid, 33), view(both("a"), both("b", running=4), now=now))
        assert plan.mode == "transfer"
        model.observe(
            Outcome(rid, plan, True, 2000, 2000, ttft_s=0.9, e2e_s=0.9 + 32 * 0.004, output_tokens=33)
        )

    for k in range(5):
        split_request(f"new{k}", 2.2 + 0.1 * k)
    assert len(model._regime.missed[True]) == 0
    for k in range(2):
        model.observe(
            Outcome(
                f"old{k}", Plan("colocated", "a"), True, 2000, 2000, ttft_s=0.9, e2e_s=1.0, output_tokens=33
            )
        )
    split_request("still", 3.0)
    assert len(model._regime.missed[True]) == 0
    model.observe(
        Outcome("old2", Plan("colocated", "a"), True, 2000, 2000, ttft_s=0.9, e2e_s=1.0, output_tokens=33)
    )
    split_request("alone", 3.1)
    assert len(model._regime.missed[True]) == 1

    capped = CostModel(**FAST, min_regime_s=5.0)
    capped.plan(req(2000, "stuck", 33), view(both("a"), both("b", running=4), now=0.0))
    drive(capped, 0.1, 2.0, 10.0, ttft=0.9, tpot=0.004, a_running=0)
    switched = capped._regime.since
    assert switched is not None
    for k, now in enumerate((switched + 1.0, switched + 10.5)):
        plan = capped.plan(req(2000, f"c{k}", 33), view(both("a"), both("b", running=4), now=now))
        capped.observe(Outcome(f"c{k}", plan, True, 2000, 2000, ttft_s=0.1, e2e_s=0.2, output_tokens=33))
    assert len(capped._regime.missed[True]) == 1


def test_a_burst_after_an_idle_spell_is_not_split_on_the_earlier_loads_misses() -> None:
    """Pooled requests missed at a load one prefill instance could not carry; after 40 s idle the decayed rates read
    almost nothing, yet the same load arriving again is not split: no split before the latest prompts show their
    rate, and then they show it is too high."""
    model = CostModel(**GATED)
    drive(model, 0.0, 8.0, 5.0, ttft=0.9, tpot=(0.040, 0.010), a_running=1, b_running=3)
    assert model._regime.miss_share(False) == pytest.approx(0.5, abs=0.05)
    burst = drive(model, 48.0, 4.0, 5.0, ttft=0.9, tpot=(0.040, 0.010), a_running=1, b_running=3)
    assert all(p.mode == "colocated" for p in burst)
    assert "split_missed_predicted=" in burst[-1].alternatives[0]


def repeated_prefixes(
    model: CostModel, start: float, seconds: float, rate: float, *, cold: int = 0, split_tpot: float = 0.010
) -> list[Plan]:
    """1,152-token prompts whose 1,024-token prefix both instances hold (nothing worth handing off: a 128-token
    suffix each), but for the first ``cold`` (a new prefix: cached nowhere); pooled streams alternate 40 and 10 ms
    a token (half miss the 25 ms target: the decode instances are full), split ones see ``split_tpot``."""
    plans = []
    for k in range(int(seconds * rate)):
        now = start + k / rate
        rid = f"p{now:.4f}"
        cached = 0 if k < cold else 1024
        cl = view(
            both("a", running=8, cached_tokens=cached), both("b", running=8, cached_tokens=cached), now=now
        )
        plan = model.plan(req(1152, rid, 33), cl)
        tpot = split_tpot if plan.reason.startswith("split") else (0.040, 0.010)[k % 2]
        model.observe(
            Outcome(rid, plan, True, 1152, 1152 - cached, ttft_s=0.2, e2e_s=0.2 + 32 * tpot, output_tokens=33)
        )
        plans.append(plan)
    return plans


def test_no_split_where_nearly_nothing_is_worth_handing_off() -> None:
    """Repeated prefixes cached on both instances: pooled misses half (the streams' own TPOT), and a split is
    predicted no TTFT miss, yet it would hand off nothing and crowd the streams onto one instance. A cold start
    (eight new prompts, a burst, then cached) does not change that: the group stays pooled and says why."""
    model = CostModel(**GATED)
    plans = repeated_prefixes(model, 0.0, 10.0, 14.0, cold=8)
    assert all(p.reason.startswith("pooled") for p in plans)
    assert model._regime.miss_share(False) == pytest.approx(0.5, abs=0.05)
    assert plans[-1].alternatives[0].startswith("regime: pooled (pooled_missed=50%,offered=0%)")


def test_a_split_is_left_once_nothing_is_worth_handing_off() -> None:
    """Split on long uncached prompts (pooled missed a quarter), the workload turns to cached prefixes: once under half
    of ``min_offered_share`` of the latest arrivals are worth handing off, the split is left after its hold,
    although it meets its targets."""
    model = CostModel(**GATED)
    drive(model, 0.0, 12.0, 3.0, ttft=0.3, tpot=STALLED_CPU, split=(0.3, 0.010), prompt=1152)
    assert model._regime.prefill == ("a",)
    plans = repeated_prefixes(model, 12.0, 20.0, 4.0)
    left = next(i for i, p in enumerate(plans) if p.alternatives[0].startswith("regime: pooled"))
    assert plans[left].alternatives[0].startswith("regime: pooled (offered=")
    # 60 arrivals remembered: under 7.5% offered after 56 cached ones, and not before the 5 s hold
    assert 50 <= left <= 60


def test_a_splits_predicted_misses_are_the_late_hand_offs_share_of_all_arrivals() -> None:
    """0.4 s prompts at 2 a second (rho ~0.8, mean wait ~0.8 s) among as many short ones: a hand-off misses a 1.5 s
    target when it waits past 1.1 s, P = rho exp(-1.1 rho / mean wait); half the arrivals are hand-offs. Past
    capacity every hand-off misses, so the share is theirs."""
    regime = Regime(RegimeConfig(window_s=10.0), 1.5, 0.025, 0.9)
    for k in range(400):
        regime.arrivals.add(k / 4.0)
        if k % 2 == 0:
            regime.offer(k / 4.0, 2000)
    rho, share = regime.split_miss_predicted(100.0, 0.0002)
    assert rho == pytest.approx(0.8, rel=0.05)
    mean_wait = rho * 0.4 / (2 * (1 - rho))  # Pollaczek-Khinchine, one prompt length: E[S^2] / E[S] = 0.4 s
    assert share == pytest.approx(0.5 * rho * math.exp(-1.1 * rho / mean_wait), rel=0.05)
    assert regime.split_miss_predicted(100.0, 0.0006) == (
        pytest.approx(2.4, rel=0.05),
        pytest.approx(0.5, rel=0.05),
    )
    assert Regime(RegimeConfig(), 1.5, 0.025, 0.9).split_miss_predicted(0.0, 0.0002) == (0.0, 0.0)


def test_the_split_ttft_reads_the_offered_prompts_at_the_lines_current_rate() -> None:
    """Prompts offered while the line still said 0.6 ms a token are read at the 0.2 ms it has learnt since: the
    prediction follows the calibration at once instead of after a time constant of arrivals."""
    regime = Regime(RegimeConfig(window_s=10.0), 1.5, 0.025, 0.9)
    for k in range(100):
        regime.offer(k / 1.0, 2000)
    assert regime.split_miss_predicted(100.0, 0.0006)[0] == pytest.approx(1.2, rel=0.05)
    assert regime.split_miss_predicted(100.0, 0.0002)[0] == pytest.approx(0.4, rel=0.05)


def test_a_split_hands_off_when_nothing_meets_the_targets() -> None:
    """A local prefill on the decode instance is overflow only where it meets the targets; when nothing does, the
    prompt still goes to the prefill instance (a local prefill would add to the stalls that made it miss)."""
    model = CostModel(**{**CPU_LIKE, "ttft_slo_s": 0.1})
    ranked = model.estimates(req(2000), view(both("a"), both("b")), Decision(("a",), "test"))
    assert not any(e.meets_slo for e in ranked)
    local = next(e for e in ranked if e.mode == "colocated")
    assert (ranked[0].mode, ranked[0].prefill) == ("transfer", "a") and local.cost < ranked[0].cost


class _Split(CostModel):
    """The cost model held in a split with ``a`` prefilling (the regime's choice is tested above)."""

    def regime_for(self, cluster: ClusterView) -> Decision | None:
        return Decision(("a",), "test")


def test_a_split_serves_a_long_prompt_whose_prefix_its_prefill_instance_holds_there_too() -> None:
    """Repeated prefixes, cached on both instances: nothing is worth handing off, and sending every prompt to the
    decode instance would leave the prefill instance idle. A long prompt cached on both goes where it is cheaper
    (here the idle prefill instance); a short new prompt still starts its stream on the decode instance."""
    model = _Split(**CPU_LIKE)
    busy_b = both("b", running=6, waiting=3, cached_tokens=1900)
    cached = model.plan(req(2000), view(both("a", cached_tokens=1900), busy_b))
    assert (cached.mode, cached.decode, cached.reason) == ("colocated", "a", "split,short_uncached_suffix")
    short = model.plan(req(100), view(both("a"), both("b", running=6, waiting=3)))
    assert (short.mode, short.decode) == ("colocated", "b")


def test_a_splits_local_plans_say_whether_they_are_overflow_or_a_short_suffix() -> None:
    model = _Split(**CPU_LIKE)
    overflow = model.plan(req(2000), view(both("a", waiting=6), both("b", running=2)))
    assert (overflow.mode, overflow.decode, overflow.reason) == ("colocated", "b", "split,overflow")
    # three instances: b holds all but 100 tokens of the prompt, so it computes the rest; no hand-off to c
    suffix = model.plan(req(2000), view(both("a"), both("b", cached_tokens=1900), both("c")))
    assert (suffix.mode, suffix.decode, suffix.reason) == ("colocated", "b", "split,short_uncached_suffix")


def test_most_of_a_few_requests_missing_switches_before_a_full_window() -> None:
    """A load step that makes most requests miss is acted on within ``RECENT`` finished requests (their misses'
    95% lower bound is past the level); one miss among as few is not evidence enough, and the full window's plain
    share still decides at the level."""
    group = [both("a"), both("b", running=2)]

    def regime() -> Regime:
        return Regime(RegimeConfig(switch_miss_share=0.05), 1.0, 0.025, 0.9)

    step = regime()
    for k in range(RECENT - 1):
        step.observe(False, 2.0, 0.010)
        assert not step.decide(0.1 * k, group, 0.1, 0.1).split
    step.observe(False, 2.0, 0.010)
    assert step.decide(1.0, group, 0.1, 0.1).prefill == ("a",)

    noise = regime()
    for k in range(RECENT):
        noise.observe(False, 2.0 if k == 0 else 0.1, 0.010)
    assert not noise.decide(1.0, group, 0.1, 0.1).split
    for _ in range(MIN_SAMPLES - RECENT - 1):
        noise.observe(False, 0.1, 0.010)
    noise.observe(False, 2.0, 0.010)  # 2 of 30: 6.7%, past 5%
    assert noise.decide(2.0, group, 0.1, 0.1).split


def test_wilson_lower_bound() -> None:
    assert wilson_lower(0.0, 8) == 0.0
    assert wilson_lower(1.0, 8) == pytest.approx(0.747, abs=0.002)
    assert 0.05 < wilson_lower(2 / 8, 8) < wilson_lower(2 / 8, 30) < 0.25
    assert wilson_lower(1 / 8, 8) < 0.05


def test_the_decode_step_is_fitted_without_the_prefill_duty_the_estimate_divides_by() -> None:
    """A stream that ran beside prefills (duty d when planned) was slowed by 1 / (1 - d), which ``estimate`` applies
    itself: the fit keeps the step without it, so a pooled instance's TPOT is not predicted at 1 / (1 - d)^2."""
    model = CostModel(prefill_tokens_per_s=5_000.0, prefill_overhead_s=0.0, decode_step_s=0.010)
    a = InstanceView("a", "both")
    for k in range(10):  # 1,000-token prompts (0.2 s) every 0.4 s
        model.plan(req(1000, f"p{k}"), view(a, now=0.4 * k))
    busy = InstanceView("a", "both", running=3)
    for k in range(60):
        rid = f"s{k}"
        duty = model.duty("a", 4.0)
        assert 0.1 < duty < MAX_DUTY
        plan = model.plan(req(100, rid), view(busy, now=4.0))
        tpot = 0.010 / (1.0 - duty)
        model.observe(Outcome(rid, plan, True, 100, 100, ttft_s=0.1, e2e_s=0.1 + 32 * tpot, output_tokens=33))
    assert model.decode_step_s == pytest.approx(0.010, rel=0.05)


def _backed_up_split(step_s: float, tpot_slo_s: float) -> list[str]:
    """Plans ranked for a 1,000-token prompt under a split whose prefill instance ``a`` has 8 prompts waiting
    (the hand-off misses TTFT) and whose decode instance ``b`` runs 4 streams."""
    model = CostModel(
        prefill_tokens_per_s=5_000.0, prefill_overhead_s=0.0, decode_step_s=step_s,
        ttft_slo_s=1.0, tpot_slo_s=tpot_slo_s, typical_uncached_tokens=1000,
    )  # fmt: skip
    cl = view(both("a", waiting=8), both("b", running=4), now=None)
    ranked = model.estimates(req(1000), cl, regime=Decision(("a",), "test"))
    assert "ttft" in ranked[[e.mode for e in ranked].index("transfer")].misses
    return [e.label for e in ranked]


def test_a_backed_up_split_overflows_where_the_local_plan_misses_only_part_of_what_the_hand_off_does() -> (
    None
):
    """Every plan misses TPOT (the step alone is past the target): computing the prompt on the decode instance
    still keeps the TTFT the queued hand-off loses, so it overflows."""
    assert _backed_up_split(0.030, 0.025)[0] == "colocated(b)"


def test_a_backed_up_split_still_hands_off_where_the_local_plan_trades_one_miss_for_another() -> None:
    """The hand-off misses TTFT, the local plan TPOT (its prefill stalls b's streams past a tight target): no
    target is kept by overflowing, so the prompt is handed off, as the split's streams are what it protects."""
    assert _backed_up_split(0.005, 0.006)[0] == "transfer(a->b)"


def test_no_split_where_its_decode_instance_would_stream_slower_than_pooled_and_near_the_target() -> None:
    """Pooled misses 40%. A split whose decode instance is predicted to settle slower than pooled streams and past 60%
    of the 25 ms target is not entered, and says both predictions; one predicted quicker than pooled (a GPU's step hardly
    grows with its batch), or well inside the target, is; without a prediction there is no TPOT gate."""
    group = [both("a"), both("b", running=2)]

    def missing() -> Regime:
        regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0), 1.0, 0.025, 0.9)
        feed(regime, False, WINDOW, 24)
        return regime

    held = missing().decide(1.0, group, 0.1, 0.1, tpots=RegimeTpots(0.013, 0.022))
    assert not held.split
    assert held.why == "pooled_missed=40%,split_tpot_predicted=22.0ms,pooled=13.0ms"
    assert missing().decide(1.0, group, 0.1, 0.1, tpots=RegimeTpots(0.024, 0.020)).split
    assert missing().decide(1.0, group, 0.1, 0.1, tpots=RegimeTpots(0.008, 0.012)).split
    assert missing().decide(1.0, group, 0.1, 0.1).split
    # a split whose decode instance never settles is not entered, even where pooled does not settle either
    unsettled = missing().decide(1.0, group, 0.1, 0.1, tpots=RegimeTpots(math.inf, math.inf))
    assert not unsettled.split and "split_tpot_predicted=unsettled,pooled=unsettled" in unsettled.why


def test_the_regimes_tpots_are_where_their_streams_settle_at_the_arrival_rate() -> None:
    """A step of 3 ms growing 1.5 ms a stream, 33-token streams: an instance fed lam a second settles at
    3 ms / (1 - 0.0015 * lam * 33). At 10 a second pooled gives each instance 5 (settling at ~4 ms), split the decode
    instance all 10 (~6 ms); at 30 the split's decode instance never settles, and pooled's carries the prefill
    duty and the KV usage."""
    model = CostModel(decode_step_s=0.003, decode_step_per_stream_s=0.0015, typical_output_tokens=33)
    group = [both("a"), both("b")]
    for k in range(80):
        model._regime.decide(k / 10.0, group, 0.01, 0.01)
    base = 0.003 - 0.0015 * 1.0  # the fitted step less the growth of the batch the instances carry now (none)
    pooled, split, _ = model.regime_tpots(group, 8.0)
    assert pooled == pytest.approx(base / (1.0 - 0.0015 * 5.0 * 33), rel=0.02)
    assert split == pytest.approx(base / (1.0 - 0.0015 * 10.0 * 33), rel=0.02)
    busy = CostModel(decode_step_s=0.003, decode_step_per_stream_s=0.0015, typical_output_tokens=33)
    _long_prefills_on(busy, "a", 15)
    for k in range(90):
        busy._regime.decide(3.0 + k / 30.0, group, 0.01, 0.01)
    loaded = [both("a", running=3, kv_usage=0.1), both("b", running=3, kv_usage=0.1)]
    now = 3.0 + 89 / 30.0
    duty = (busy.duty("a", now) + busy.duty("b", now)) / 2
    assert duty > 0.0
    pooled, split, _ = busy.regime_tpots(loaded, now)
    assert split == math.inf
    base = 0.003 - 0.0015 * 4.0
    assert pooled == pytest.approx(
        max(base, 0.25 * 0.003) / (1.0 - 0.0015 * 15.0 * 33) * 1.1 / (1.0 - duty), rel=0.05
    )


def test_streams_near_capacity_are_not_split_onto_one_instance_where_prefills_are_short() -> None:
    """Pooled misses a fifth at 30 and at 10 requests a second (every fifth stream 30 ms a token against 25), with a
    step that grows 1.5 ms a stream and short prefills. At 30 the split's decode instance would carry every stream
    and never settle: not entered, and it says so. At 10 it would settle well inside the target: entered."""
    cfg = {
        **GATED,
        "prefill_tokens_per_s": 100_000.0,
        "decode_step_s": 0.003,
        "decode_step_per_stream_s": 0.0015,
        "typical_output_tokens": 33,
    }
    for rate, tpot, running, splits in ((30.0, 0.0116, 6, False), (10.0, 0.004, 1, True)):
        model = CostModel(**cfg)
        plans = drive(
            model, 0.0, 10.0, rate, ttft=0.015, tpot=(0.030,) + (tpot,) * 4, prompt=1000,
            a_running=running, b_running=running,
        )  # fmt: skip
        whys = [p.alternatives[0] for p in plans]
        assert any(w.startswith("regime: split a (pooled_missed=") for w in whys) is splits
        if not splits:
            why = whys[-1]
            assert why.startswith("regime: pooled (pooled_missed=")
            assert "split_tpot_predicted=unsettled" in why


def test_a_split_waits_until_its_decode_instances_have_been_predicted_to_settle_for_the_hold() -> None:
    """At the decode capacity the gate's reading swings with the arrivals: one settling reading after one that
    never settles does not enter a split; settling readings through ``gate_hold_s`` do, and a prediction that
    never went unsettled holds nothing back."""
    group = [both("a"), both("b", running=2)]
    regime = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0, gate_hold_s=2.0), 1.0, 0.025, 0.9)
    feed(regime, False, WINDOW, 24)
    assert not regime.decide(1.0, group, 0.1, 0.1, tpots=RegimeTpots(0.010, math.inf)).split
    early = regime.decide(1.5, group, 0.1, 0.1, tpots=RegimeTpots(0.013, 0.012))
    assert not early.split and early.why.endswith("settled_for=0.5s")
    # a reading the TPOT gate refuses (slower than pooled, past 60% of the target) is no reason to wait longer
    assert not regime.decide(2.0, group, 0.1, 0.1, tpots=RegimeTpots(0.013, 0.022)).split
    assert not regime.decide(2.9, group, 0.1, 0.1, tpots=RegimeTpots(0.013, 0.012)).split
    assert regime.decide(3.1, group, 0.1, 0.1, tpots=RegimeTpots(0.013, 0.012)).split
    fresh = Regime(RegimeConfig(switch_miss_share=0.05, min_regime_s=0.0, gate_hold_s=2.0), 1.0, 0.025, 0.9)
    feed(fresh, False, WINDOW, 24)
    assert fresh.decide(1.0, group, 0.1, 0.1, tpots=RegimeTpots(0.013, 0.012)).split
