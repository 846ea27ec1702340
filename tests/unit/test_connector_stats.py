"""DisaggConnector's stats arithmetic (what reaches vLLM's logger and Prometheus)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_disagg.connectors.stats import DisaggStats  # noqa: E402
from vllm_disagg.transport.records import RecvRecord, SendOutcome, SendRecord  # noqa: E402


def _send(
    bytes_: int, t_first: float, t_last: float, t_fwd: float, outcome: SendOutcome = SendOutcome.LOADED
) -> SendRecord:
    return SendRecord(transfer_id="t", request_id="r", outcome=outcome, reason="", bytes=bytes_, t_begin=0.0,
                      t_first_send=t_first, t_last_send=t_last, t_forward_end=t_fwd)  # fmt: skip


def _recv(state: str, bytes_: int, t_done: float) -> RecvRecord:
    return RecvRecord(transfer_id="t", request_id="r", state=state, reason="", bytes=bytes_, blocks=1,  # type: ignore[arg-type]
                      first_block=0, t_start=0.0, t_first=0.0, t_done=t_done)  # fmt: skip


def test_overlap_and_tail_of_a_layerwise_send() -> None:
    st = DisaggStats()
    st.record(
        _send(1000, t_first=1.0, t_last=2.0, t_fwd=1.75)
    )  # 75% of the send window inside the forward pass
    assert st.data["send_overlap_ratio"] == [pytest.approx(0.75)]
    assert st.data["send_tail_seconds"] == [pytest.approx(0.25)]
    assert st.data["send_seconds"] == [pytest.approx(2.0)]


def test_aggregate_and_reduce() -> None:
    a, b = DisaggStats(), DisaggStats()
    a.record(_send(100, 1.0, 2.0, 2.0))
    b.record(_send(300, 1.0, 2.0, 1.0))
    b.record(_recv("failed", 0, t_done=1.0))
    b.record(_recv("done", 400, t_done=0.5))
    b.record(_send(0, 0.0, 0.0, 0.0, outcome=SendOutcome.LEASE_EXPIRED))
    deferred = _send(200, 1.0, 2.0, 1.5)
    deferred.writes_deferred = 3
    deferred.preemptions = 2
    a.record(deferred)
    agg = a.aggregate(b)
    red = agg.reduce()
    assert red["bytes_sent"] == 600 and red["transfers_sent"] == 3 and red["writes_deferred"] == 3
    assert red["sends_preempted"] == 2
    assert red["bytes_received"] == 400 and red["loads_failed"] == 1 and red["leases_expired"] == 1
    assert red["mean_send_overlap"] == pytest.approx(0.5)
    assert not agg.is_empty()
    agg.reset()
    assert agg.is_empty()
