"""benchmarks/layer_tail.py against the session's real P/D pair: every transfer yields a complete tail reading."""

from __future__ import annotations

import sys
from pathlib import Path

from support.pd_pair import PDPair
from support.vllm_servers import SECRET

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from layer_tail import measure, summary  # noqa: E402


def test_the_layer_tail_benchmark_reads_every_transfer_from_both_traces(pd_pair: PDPair) -> None:
    rows = measure(
        "unchunked",
        pd_pair.prefill,
        pd_pair.decode,
        pd_pair.p_side,
        Path(pd_pair.trace),
        [700],
        3,
        2.0,
        SECRET.encode(),
    )
    assert len(rows) == 3 and not [r for r in rows if "error" in r], rows
    for r in rows:
        assert r["bytes"] == 4 * 6 * 64 * 1024  # 4 layers x 6 blocks (5 full, one partial) x 64 KiB
        # decode's head start: every layer could leave as soon as it was computed
        assert r["registered_first"]
        assert len(r["per_layer_s"]) == 4 and all(t > 0 for t in r["per_layer_s"])
        assert r["tail_s"] > 0 and abs(sum(r["tail_parts_s"].values()) - r["tail_s"]) < 1e-9
    (row,) = summary(rows)
    assert row["judged"] == "3/3" and row["KiB/layer"] == "384"
