"""The benchmarks' result arithmetic: ratios against a same-run baseline, percentiles, tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from report import cpu_ticks, percentile, ratio_rows, render_table, steal_share  # noqa: E402


def test_ratios_are_relative_to_the_baseline() -> None:
    rows = ratio_rows(
        {"memcpy": 10.0, "engine-tcp": 2.5, "engine-nixl": 11.0}, baseline="memcpy", unit="GB/s"
    )
    by = {r["path"]: r for r in rows}
    assert by["memcpy"]["vs memcpy"] == "1.00x"
    assert by["engine-tcp"]["vs memcpy"] == "0.25x"
    assert by["engine-nixl"]["vs memcpy"] == "1.10x"
    assert by["engine-tcp"]["GB/s"] == "2.5"


def test_missing_or_zero_baseline_is_an_error() -> None:
    with pytest.raises(KeyError):
        ratio_rows({"a": 1.0}, baseline="b")
    with pytest.raises(ValueError):
        ratio_rows({"a": 0.0}, baseline="a")


def test_percentile_matches_linear_interpolation() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_table_aligns_columns() -> None:
    out = render_table([{"a": "1", "b": "long value"}], ["a", "b"])
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].index("b") == lines[2].index("long")


def _run(
    design: str, rate: float, repeat: int, goodput: float, ttft: float, tpot: float
) -> dict[str, object]:
    bench = {"request_goodput": goodput, "p95_ttft_ms": ttft, "p95_tpot_ms": tpot}
    return {"design": design, "dataset": "chat-mix", "rate": rate, "repeat": repeat, "bench": bench}


def test_e2e_summary_medians_spreads_and_adaptive_verdicts() -> None:
    from e2e_summary import Spread, summary_rows, verdicts

    results = [
        # rate 2: colocated best (2.0); adaptive 1.96 = 0.98x: holds; TPOT 1 ms worse, within colocated's 2 ms range
        *(_run("pd", 2.0, k, 1.5, 300.0, 4.0) for k in range(3)),
        _run("colocated", 2.0, 0, 2.0, 100.0, 6.0),
        _run("colocated", 2.0, 1, 2.0, 100.0, 8.0),
        _run("colocated", 2.0, 2, 1.9, 100.0, 7.0),
        *(_run("adaptive", 2.0, k, 1.96, 110.0, 8.0) for k in range(3)),
        # rate 6: adaptive beats both by >= 1.1x
        *(_run("pd", 6.0, k, 3.0, 900.0, 5.0) for k in range(3)),
        *(_run("colocated", 6.0, k, 4.0, 200.0, 30.0) for k in range(3)),
        *(_run("adaptive", 6.0, k, 5.0, 300.0, 6.0) for k in range(3)),
        # rate 9: adaptive loses on goodput; pd has no run at rate 12, so no verdict there
        *(_run(d, 9.0, 0, g, 100.0, 5.0) for d, g in (("pd", 1.0), ("colocated", 4.0), ("adaptive", 3.0))),
        _run("adaptive", 12.0, 0, 1.0, 100.0, 5.0),
    ]
    got = {v.rate: v for v in verdicts(results)}
    assert sorted(got) == [2.0, 6.0, 9.0]
    assert got[2.0].holds_its_own and not got[2.0].beats_both
    assert got[2.0].vs_best_fixed == pytest.approx(0.98) and got[2.0].tpot_excess_ms == pytest.approx(1.0)
    assert got[6.0].beats_both and got[6.0].vs_worst_fixed == pytest.approx(5 / 3)
    assert not got[9.0].holds_its_own
    rows = {r["rate"]: r for r in summary_rows(results, ["pd", "colocated", "adaptive"])}
    assert rows["2"]["goodput colocated"] == "2.00 [1.90-2.00]" and rows["2"]["verdict"] == "holds"
    assert rows["6"]["verdict"] == "beats both" and rows["9"]["verdict"] == "LOSES"
    assert "verdict" not in rows["12"]
    assert Spread.of([3.0]).render() == "3.00"


def test_e2e_kind_rows_list_each_output_length_of_a_mix() -> None:
    from e2e_summary import kind_rows

    def entry(design: str, repeat: int, long_p95: float) -> dict[str, object]:
        kinds = {
            "16": {"requests": 75, "p50_ttft_ms": 900.0, "p95_ttft_ms": 2000.0, "p50_tpot_ms": 100.0,
                   "p95_tpot_ms": long_p95},
            "128": {"requests": 225, "p50_ttft_ms": 90.0, "p95_ttft_ms": 300.0, "p50_tpot_ms": 30.0,
                    "p95_tpot_ms": 60.0},
        }  # fmt: skip
        return {
            "design": design,
            "dataset": "chat-mix",
            "rate": 8.0,
            "repeat": repeat,
            "by_output_len": kinds,
        }

    one_kind = {"design": "pd", "dataset": "prefix-repetition", "rate": 4.0, "repeat": 0,
                "by_output_len": {"64": {"requests": 300, "p50_ttft_ms": 1.0, "p95_ttft_ms": 1.0, "p50_tpot_ms": 1.0,
                                         "p95_tpot_ms": 1.0}}}  # fmt: skip
    rows = kind_rows([entry("adaptive", 0, 600.0), entry("adaptive", 1, 700.0), entry("colocated", 0, 110.0),
                      one_kind], ["pd", "colocated", "adaptive"])  # fmt: skip
    assert [(r["design"], r["output tokens"]) for r in rows] == [
        ("colocated", "16"),
        ("colocated", "128"),
        ("adaptive", "16"),
        ("adaptive", "128"),
    ]
    assert rows[2]["p95 TPOT"] == "650.0 [600.0-700.0]" and rows[2]["requests"] == "75"
    assert rows[0]["p95 TPOT"] == "110.0"  # one repeat: no range


def test_cpu_description_names_the_model_and_widest_isa() -> None:
    from report import cpu_description

    amd = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2\n\nprocessor\t: 1\nmodel name\t: X\n"
    assert cpu_description(amd) == {"cpu_model": "AMD EPYC", "cpu_isa": "AVX2"}
    intel = "model name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: avx avx2 avx512f avx512bw\n"
    assert cpu_description(intel) == {"cpu_model": "Intel(R) Xeon(R) Platinum", "cpu_isa": "AVX-512"}
    assert cpu_description("") == {"cpu_model": "unknown", "cpu_isa": "unknown"}


def test_steal_share_is_the_hypervisors_part_of_the_cpu_time_between_two_readings() -> None:
    before = cpu_ticks("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    after = cpu_ticks("cpu  200 0 70 900 10 0 5 135 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert before == (35, 1000)
    assert steal_share(before, after) == 100 / 320
    assert steal_share(after, after) == 0.0
    assert cpu_ticks("") == (0, 0)
