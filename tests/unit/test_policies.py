"""The built-in baselines, ``load_policy`` for every spec form, and the example custom policy."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest
from support.paths import ROOT

from vllm_disagg.policy.cost_model import CostModelConfig
from vllm_disagg.policy.guard import PolicyGuard, plan_problem
from vllm_disagg.policy.loader import parse_policy_args, policy_builder
from vllm_disagg.router.cost_model import CostModel
from vllm_disagg.router.policies import (
    BUILTIN_POLICIES,
    AlwaysTransfer,
    LeastLoaded,
    PolicyLoadError,
    RoundRobinPairs,
    load_policy,
)
from vllm_disagg.router.policy import ClusterView, InstanceView, NoRoute, Plan, Policy, RequestView

EXAMPLE = ROOT / "examples" / "custom_policy.py"


def inst(id: str, role: str, **kw: object) -> InstanceView:
    return InstanceView(id, role, **kw)  # type: ignore[arg-type]


def req(tokens: int = 1000) -> RequestView:
    return RequestView(request_id="r", prompt_tokens=tokens)


PD = ClusterView(
    (
        inst("p0", "prefill", in_flight=2),
        inst("p1", "prefill"),
        inst("d0", "decode", running=3, cached_tokens=800),
        inst("d1", "decode", running=1),
    )
)
DEAD = ClusterView((inst("p0", "prefill"), inst("d0", "decode", healthy=False)))


def test_round_robin_cycles_over_pairs_and_always_transfers() -> None:
    policy = RoundRobinPairs()
    plans = [policy.plan(req(), PD) for _ in range(5)]
    assert [(pl.prefill, pl.decode) for pl in plans] == [
        ("p0", "d0"),
        ("p0", "d1"),
        ("p1", "d0"),
        ("p1", "d1"),
        ("p0", "d0"),
    ]
    assert all(pl.mode == "transfer" for pl in plans)
    assert plans[0].backup_prefill == "p1" and plans[2].backup_prefill == "p0"


def test_least_loaded_picks_least_loaded_pair() -> None:
    plan = LeastLoaded().plan(req(), PD)
    assert (plan.mode, plan.prefill, plan.decode, plan.backup_prefill) == ("transfer", "p1", "d1", "p0")


def test_always_transfer_prefers_the_cached_prefix() -> None:
    plan = AlwaysTransfer().plan(req(), PD)
    assert (plan.mode, plan.prefill, plan.decode) == ("transfer", "p1", "d0")


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_every_builtin_raises_no_route_when_nothing_can_serve(name: str) -> None:
    policy = load_policy(name)
    for view in (DEAD, ClusterView(())):
        with pytest.raises(NoRoute):
            policy.plan(req(), view)


@pytest.mark.parametrize("name", ["round-robin", "least-loaded", "always-transfer"])
def test_baselines_fall_back_explicitly_without_a_pair(name: str) -> None:
    view = ClusterView((inst("p0", "prefill", healthy=False), inst("d0", "decode")))
    plan = load_policy(name).plan(req(), view)
    assert (plan.mode, plan.decode, plan.reason) == ("recompute", "d0", "no_prefill")
    both = ClusterView((inst("c0", "both", in_flight=1), inst("c1", "both")))
    plan = load_policy(name).plan(req(), both)
    assert (plan.mode, plan.decode, plan.reason) == ("colocated", "c1", "no_pair")


def test_load_builtin_names_with_kwargs() -> None:
    assert set(BUILTIN_POLICIES) == {"cost", "round-robin", "least-loaded", "always-transfer"}
    for name, cls in BUILTIN_POLICIES.items():
        assert isinstance(load_policy(name), cls)
    cost = load_policy("cost", ttft_slo_s=0.5)
    assert isinstance(cost, CostModel) and cost.config.ttft_slo_s == 0.5


def test_load_module_class() -> None:
    policy = load_policy("vllm_disagg.router.policies:LeastLoaded")
    assert isinstance(policy, LeastLoaded) and isinstance(policy, Policy)


def test_load_example_file_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    policy = load_policy(
        "examples/custom_policy.py:PinLongPromptsPolicy", threshold_tokens=500, pin_prefix="d1"
    )
    assert isinstance(policy, Policy)
    assert load_policy(f"{EXAMPLE}:PinLongPromptsPolicy") is not policy


def test_example_policy_decisions() -> None:
    policy = load_policy(f"{EXAMPLE}:PinLongPromptsPolicy", threshold_tokens=500, pin_prefix="d1")
    long = policy.plan(req(1000), PD)
    assert (long.mode, long.prefill, long.decode, long.backup_prefill) == ("transfer", "p1", "d1", "p0")
    short = policy.plan(req(400), PD)
    assert (short.mode, short.decode) == ("recompute", "d0")  # the longest cached prefix
    no_pin = ClusterView(tuple(i for i in PD.instances if i.id != "d1"))
    assert policy.plan(req(1000), no_pin).mode == "recompute"
    with pytest.raises(NoRoute):
        policy.plan(req(), DEAD)


def test_example_imports_only_the_public_api() -> None:
    imports = [ln.strip() for ln in EXAMPLE.read_text().splitlines() if ln.startswith(("import ", "from "))]
    assert imports == [
        "from __future__ import annotations",
        "from vllm_disagg.router import ClusterView, NoRoute, Plan, Policy, RequestView",
    ]


def test_load_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "acme_policies.py").write_text(
        textwrap.dedent(
            """
            from vllm_disagg.router.policies import LeastLoaded

            class AcmePolicy(LeastLoaded):
                def __init__(self, tag: str = "") -> None:
                    self.tag = tag
            """
        )
    )
    dist = tmp_path / "acme_policies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-policies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[vllm_disagg.policies]\nacme = acme_policies:AcmePolicy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "acme_policies", raising=False)
    policy = load_policy("acme", tag="x")
    assert type(policy).__name__ == "AcmePolicy" and getattr(policy, "tag", None) == "x"
    with pytest.raises(PolicyLoadError, match="installed .*acme"):
        load_policy("acme2")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nope", "unknown policy 'nope'; built-ins: cost, round-robin"),
        ("", "empty policy spec"),
        ("no_such_module_xyz:Foo", "cannot import policy module 'no_such_module_xyz'"),
        ("vllm_disagg.router.policies:Nope", "has no 'Nope'; policy classes in it: .*LeastLoaded"),
        ("vllm_disagg.router.policies:", "expected module:Class"),
        ("missing/file.py:Foo", "policy file not found: missing/file.py"),
        ("vllm_disagg.router.policies:ENTRY_POINT_GROUP", "is not a class or factory"),
        ("vllm_disagg.router.cost_model:CostModelConfig", "CostModelConfig has no plan"),
    ],
)
def test_bad_specs_raise_clear_errors(spec: str, match: str) -> None:
    with pytest.raises(PolicyLoadError, match=match):
        load_policy(spec)


def test_bad_constructor_arguments_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError, match="does not take the arguments"):
        load_policy("round-robin", nope=1)
    with pytest.raises(PolicyLoadError, match="raised TypeError.*unknown CostModel option"):
        load_policy("cost", not_an_option=1)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PolicyLoadError, match="failed to load: boom"):
        load_policy(f"{broken}:X")
    assert isinstance(PolicyLoadError("x"), ValueError)


def test_the_views_keep_the_dataclass_contract() -> None:
    """The views, plans and outcomes have hand-written ``__init__``s (faster than a frozen dataclass's): each
    takes exactly the fields, in order, with their defaults; equality, repr and hashing are the dataclass's, the
    objects stay frozen, and ``dataclasses.replace`` works."""
    import dataclasses
    import inspect

    from vllm_disagg.policy.api import ClusterView, InstanceView, Outcome, Plan, RequestView

    for cls in (InstanceView, RequestView, ClusterView, Plan, Outcome):
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        fields = dataclasses.fields(cls)
        assert [p.name for p in params] == [f.name for f in fields], cls
        for p, f in zip(params, fields, strict=True):
            want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
            assert p.default == want, (cls, f.name)
        built = cls(*[p.default if p.default is not inspect.Parameter.empty else 1 for p in params])
        assert set(vars(built)) == {f.name for f in fields}, cls

    a = InstanceView("a", "both", True, 3, kv_usage=0.5)
    assert a == InstanceView(id="a", role="both", in_flight=3, kv_usage=0.5)
    assert a.waiting == 0 and a.cached_tokens == 0 and not a.kv_connector
    assert repr(a).startswith("InstanceView(id='a', role='both', healthy=True, in_flight=3,")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.in_flight = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        InstanceView("a")  # type: ignore[call-arg]
    cluster = ClusterView((a, InstanceView("b", "decode")), now_s=1.0)
    assert [i.id for i in cluster.decode] == ["a", "b"] and [i.id for i in cluster.prefill] == ["a"]
    plan = Plan.transfer("a", "b", reason="long_prompt")
    assert dataclasses.replace(plan, reason="x") == Plan("transfer", "b", "a", None, "x")
    assert hash(plan) == hash(Plan.transfer("a", "b", reason="long_prompt"))
    assert RequestView("r", 10).max_tokens == 16
    assert Outcome("r", plan, True, 10).e2e_s is None


def test_stream_lengths_count_the_shortest_and_the_sensitivity_to_a_stall() -> None:
    from vllm_disagg.policy.api import StreamLengths

    lengths = StreamLengths()
    assert (lengths.count, lengths.shortest, lengths.sensitivity) == (0, 0, 0.0)
    for n in (128, 16, 16, 1):
        lengths.add(n)
    assert (lengths.count, lengths.shortest) == (4, 1)
    assert lengths.sensitivity == pytest.approx(1 / 127 + 2 / 15 + 1)  # a 1-token stream counts as one gap
    lengths.remove(1)
    lengths.remove(16)
    assert (lengths.count, lengths.shortest) == (2, 16)
    with pytest.raises(ValueError, match="no stream of 64"):
        lengths.remove(64)
    lengths.remove(16)
    lengths.remove(128)
    assert (lengths.count, lengths.shortest, lengths.sensitivity) == (0, 0, 0.0)


# ------------------------------------------------------------------------------------- a user's policy, guarded


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _guarded(policy: object) -> tuple[PolicyGuard, list[logging.LogRecord]]:
    kept = _Kept()
    log = logging.getLogger("test.guard")
    log.propagate = False
    log.handlers = [kept]
    return PolicyGuard(policy, log), kept.records  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("plan", "problem"),
    [
        (Plan.transfer("p0", "d1"), ""),
        (Plan.recompute("d1"), ""),
        (Plan("transfer", decode="d1"), "a transfer plan without a prefill instance"),
        (Plan.transfer("d1", "p0"), "'p0' cannot serve a request .its role is prefill"),  # arguments swapped
        (Plan.recompute("p0"), "'p0' cannot serve a request"),
        (Plan.recompute("d0"), "'d0' cannot serve a request .it is unhealthy"),
        (Plan.recompute("d9"), "'d9', which it was not offered"),
        (Plan.transfer("p0", "d1", backup_prefill="d1"), "named 'd1' as its own backup prefill"),
        (Plan.transfer("p0", "d1", backup_prefill="p0"), "named 'p0' as its own backup prefill"),
        (Plan.transfer("p0", "d1", backup_prefill="d0"), "'d0', which it was not offered|cannot prefill"),
        (Plan.transfer("b0", "b1"), "two instances of role both pair only when both run a KV connector"),
        (Plan.transfer("b1", "b2"), ""),  # both run one
        (Plan("disaggregated", decode="d1"), "mode 'disaggregated'"),  # type: ignore[arg-type]
        (Plan.transfer("b0", "b0"), "from 'b0' to itself"),
        (("transfer", "p0", "d1"), "returned tuple, not a Plan"),
        (None, "returned NoneType, not a Plan"),
    ],
)
def test_a_plan_is_checked_against_the_cluster_its_policy_was_shown(plan: object, problem: str) -> None:
    cluster = ClusterView(
        (
            inst("p0", "prefill"),
            inst("d0", "decode", healthy=False),
            inst("d1", "decode"),
            inst("b0", "both"),
            inst("b1", "both", kv_connector=True),
            inst("b2", "both", kv_connector=True),
        )
    )
    found = plan_problem(plan, cluster)
    assert (found == "") if not problem else re.search(problem, found), found


def test_an_unservable_or_raising_plan_is_replaced_by_least_loaded_and_logged_once() -> None:
    """What the proxy and the simulator both do with a user's policy: the request is served (reason policy_error,
    the failure among the alternatives), the first failure of each kind is logged, the rest are counted."""

    class NoPrefill:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            return Plan("transfer", decode="d1")

    guard, records = _guarded(NoPrefill())
    for i in range(5):
        plan = guard.plan(RequestView(f"r{i}", 100), PD)
        assert plan.reason == "policy_error" and plan.mode == "transfer" and plan.prefill is not None
        assert plan.alternatives == ("NoPrefill returned a transfer plan without a prefill instance",)
    assert guard.failures == 5 and "without a prefill" in guard.first_failure
    assert len(records) == 2  # the first, then one summary of the repeats (the next is due in REPEAT_LOG_S)
    assert "request r0: policy NoPrefill" in records[0].getMessage()

    class Raises:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            raise ValueError(f"bad request {request.request_id}")  # a message that differs per request

    guard, records = _guarded(Raises())
    for i in range(3):
        assert guard.plan(RequestView(f"r{i}", 100), PD).reason == "policy_error"
    assert len(records) == 2 and records[0].exc_info is not None  # the traceback, once

    class Refuses:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            raise NoRoute("busy")

    with pytest.raises(NoRoute):
        _guarded(Refuses())[0].plan(req(), PD)


def test_a_slow_plan_is_warned_about_naming_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.2, 0.2, 1.0, 1.3, 1.3])
    guard, records = _guarded(LeastLoaded())
    guard.clock = lambda: next(clock)
    guard.plan(req(), PD)
    guard.plan(req(), PD)
    assert guard.slow_calls == 2 and len(records) == 1  # warned once per REPEAT_LOG_S
    assert "policy LeastLoaded took 200 ms" in records[0].getMessage()


def test_a_policy_that_cannot_work_is_refused_when_it_loads(tmp_path: Path) -> None:
    f = tmp_path / "mine.py"
    f.write_text(
        textwrap.dedent(
            """
            from vllm_disagg.router import Plan, ClusterView
            class Async:
                async def plan(self, request, cluster):
                    return Plan.recompute("d0")
            class Ctor:
                def __init__(self):
                    raise RuntimeError("cannot reach my config server")
                def plan(self, request, cluster):
                    return None
            """
        )
    )
    with pytest.raises(PolicyLoadError, match="Async.plan is async"):
        load_policy(f"{f}:Async")
    with pytest.raises(PolicyLoadError, match="constructing it raised RuntimeError.*config server"):
        load_policy(f"{f}:Ctor")
    with pytest.raises(PolicyLoadError, match=r"policy classes in it: Async, Ctor$"):  # not Plan, ClusterView
        load_policy(f"{f}:Nope")


def test_a_module_in_the_working_directory_loads_where_sys_path_lacks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A console script's sys.path starts at its bin directory: ``--policy my_module:Class`` as the README shows
    it must still find my_module.py where the user stands."""
    (tmp_path / "my_cwd_policy.py").write_text(
        "from vllm_disagg.router.policies import LeastLoaded\nclass Mine(LeastLoaded):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_policy", raising=False)
    assert type(load_policy("my_cwd_policy:Mine")).__name__ == "Mine"
    with pytest.raises(PolicyLoadError, match="put its directory on PYTHONPATH"):
        load_policy("no_such_cwd_module_xyz:Mine")


def test_a_builder_imports_once_and_a_cost_model_subclass_keeps_the_tools_targets(tmp_path: Path) -> None:
    f = tmp_path / "counted.py"
    f.write_text(
        textwrap.dedent(
            """
            import builtins
            builtins.counted_imports = getattr(builtins, "counted_imports", 0) + 1
            from vllm_disagg.policy import CostModel
            class Mine(CostModel):
                pass
            """
        )
    )
    import builtins

    cfg = CostModelConfig(ttft_slo_s=0.7, tpot_slo_s=0.03)
    build = policy_builder(f"{f}:Mine", parse_policy_args('{"prefill_tokens_per_s": 5000}'), cfg)
    a, b = build(), build()
    assert a is not b and vars(builtins)["counted_imports"] == 1
    assert isinstance(a, CostModel) and a.config.ttft_slo_s == 0.7 and a.config.prefill_tokens_per_s == 5000
    for bad in ("[1]", "{nope"):
        with pytest.raises(PolicyLoadError, match="--policy-args"):
            parse_policy_args(bad)


def test_failures_that_name_the_request_are_not_logged_one_by_one() -> None:
    class PerRequest:
        def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
            return Plan.recompute(request.request_id)  # a bug: each failure's text is new

    guard, records = _guarded(PerRequest())
    for i in range(300):
        assert guard.plan(RequestView(f"r{i}", 100), PD).reason == "policy_error"
    assert guard.failures == 300 and len(records) <= 64 + 1
