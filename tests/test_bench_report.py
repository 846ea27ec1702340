"""The benchmarks' result arithmetic: ratios against a same-run baseline, percentiles, tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from report import percentile, ratio_rows, render_table  # noqa: E402


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
