"""benchmarks/e2e.py's designs: each is the two instances and proxy flags its name promises (the ablations take
adaptive's two changes from colocated one at a time, so their flags are what the comparison rests on)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import e2e  # noqa: E402

SLO = "ttft:500 tpot:10"


def _connector(args: list[str]) -> bool:
    return "--kv-transfer-config" in args


@pytest.mark.parametrize(
    ("design", "connector", "side_channels", "policy", "slo_flags"),
    [
        ("colocated", False, False, "least-loaded", False),
        ("colocated-cost", False, False, None, True),
        ("adaptive-ll", True, False, "least-loaded", False),
        ("adaptive", True, True, None, True),
        ("adaptive-ungated", True, True, None, True),
        ("adaptive-count", True, True, None, True),
        ("pd", True, True, "always-transfer", False),
    ],
)
def test_design_flags(
    design: str, connector: bool, side_channels: bool, policy: str | None, slo_flags: bool
) -> None:
    servers, specs = e2e.design_servers(design, 2048, SLO)
    assert len(servers) == 2
    assert {_connector(list(s.args)) for s in servers} == {connector}
    assert [s.cpu_cores for s in servers] == ["0", "1"]  # one core each, whole instance pinned
    instance_specs = [specs[i + 1] for i, a in enumerate(specs) if a in ("--both", "--prefill", "--decode")]
    assert len(instance_specs) == 2
    assert all(("side=" in s) == side_channels for s in instance_specs)
    assert (specs[specs.index("--policy") + 1] if "--policy" in specs else None) == policy
    assert ("--ttft-slo-s" in specs and "--tpot-slo-s" in specs) == slo_flags
    if slo_flags:
        assert specs[specs.index("--ttft-slo-s") + 1] == "0.5"
        assert specs[specs.index("--tpot-slo-s") + 1] == "0.01"


def test_unknown_design_is_refused() -> None:
    with pytest.raises(ValueError, match="colocated-cost"):
        e2e.design_servers("colocated-fast", 2048, SLO)


def test_only_the_ungated_design_turns_the_split_gate_off() -> None:
    for design in ("adaptive", "adaptive-ungated"):
        _, specs = e2e.design_servers(design, 2048, SLO)
        assert ("--no-split-ttft-gate" in specs) == (design == "adaptive-ungated")
        assert "--split-ttft-gate" not in specs


def test_interleaved_runs_serve_each_repeat_with_every_design_in_abba_order() -> None:
    points = [("random-long", r, k) for k in range(3) for r in (1.0, 2.0)]
    plain = e2e.run_order(["a", "b"], points, interleave=False)
    assert [(d, len(todo)) for d, todo in plain] == [("a", 6), ("b", 6)]
    order = e2e.run_order(["a", "b"], points, interleave=True)
    assert [d for d, _ in order] == ["a", "b", "b", "a", "a", "b"]
    assert [{p[2] for p in todo} for _, todo in order] == [{0}, {0}, {1}, {1}, {2}, {2}]
    # every design serves every point exactly once either way
    for runs in (plain, order):
        for design in ("a", "b"):
            assert sorted(p for d, todo in runs if d == design for p in todo) == sorted(points)


def test_only_the_count_design_turns_the_length_weighted_stall_off() -> None:
    for design in ("adaptive", "adaptive-ungated", "adaptive-count"):
        _, specs = e2e.design_servers(design, 2048, SLO)
        assert ("--no-length-weighted-stall" in specs) == (design == "adaptive-count")


def test_placements_count_each_kind_of_request_where_it_was_served() -> None:
    decisions = [
        {"path": "colocated; instance=both-a; reason=pooled,slo_miss", "prompt_tokens": 1501},
        {"path": "colocated; instance=both-a; reason=pooled", "prompt_tokens": 1499},
        {"path": "transfer; prefill=both-a; decode=both-b; reason=split", "prompt_tokens": 1502},
        {"path": "colocated; instance=both-b; reason=pooled", "prompt_tokens": 65},
        {
            "path": "colocated; instance=replica-a; reason=no_pair; fallback=decode_http_503",
            "prompt_tokens": 64,
        },
    ]
    assert e2e.placements(decisions) == {
        "~100 tok colocated->both-b pooled": 1,
        "~100 tok colocated->replica-a no_pair": 1,
        "~1500 tok colocated->both-a pooled": 2,
        "~1500 tok transfer->both-b split": 1,
    }
    assert e2e.placements([]) == {}
