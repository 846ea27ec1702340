"""The built-in baselines, ``load_policy`` for every spec form, and the example custom policy."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from support.paths import ROOT

from vllm_disagg.router.cost_model import CostModel
from vllm_disagg.router.policies import (
    BUILTIN_POLICIES,
    AlwaysTransfer,
    LeastLoaded,
    PolicyLoadError,
    RoundRobinPairs,
    load_policy,
)
from vllm_disagg.router.policy import ClusterView, InstanceView, NoRoute, Policy, RequestView

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
    with pytest.raises(LookupError):
        policy.plan(req(), DEAD)


def test_example_imports_only_the_public_api() -> None:
    imports = [ln.strip() for ln in EXAMPLE.read_text().splitlines() if ln.startswith(("import ", "from "))]
    assert imports == [
        "from __future__ import annotations",
        "from vllm_disagg.router import ClusterView, Plan, Policy, RequestView",
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
        ("vllm_disagg.router.policies:Nope", "has no 'Nope'; classes it defines: .*LeastLoaded"),
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
    with pytest.raises(PolicyLoadError, match="cannot construct"):
        load_policy("round-robin", nope=1)
    with pytest.raises(PolicyLoadError, match="cannot construct"):
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
