"""The event-loop lag monitor: a callback that holds the loop shows as a timer's lateness, in the right bucket."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from vllm_disagg.router.loop_lag import LoopLagMonitor
from vllm_disagg.router.metrics import LAG_BUCKETS


def _lags(stall_s: float) -> tuple[LoopLagMonitor, bytes]:
    registry = CollectorRegistry()
    hist = Histogram("lag_seconds", "lag", buckets=LAG_BUCKETS, registry=registry)

    async def scenario() -> LoopLagMonitor:
        mon = LoopLagMonitor(0.001)
        mon.start()
        await asyncio.sleep(0.05)
        if stall_s:
            time.sleep(stall_s)  # one callback holding the loop
        await asyncio.sleep(0.05)
        mon.stop()
        return mon

    mon = asyncio.run(scenario())
    mon.counts.flush(hist)
    return mon, generate_latest(registry)


def test_a_stall_shows_as_a_lag_in_its_bucket() -> None:
    mon, text = _lags(0.03)
    # the timer pending when the stall began was due within 1 ms of its start, and ran after its end
    assert mon.max_s >= 0.029
    # the stall's sample sits in the (25 ms, 50 ms] bucket or the next, and nothing is lost in the flush
    assert b'lag_seconds_bucket{le="0.025"}' in text
    le_25 = float(text.split(b'lag_seconds_bucket{le="0.025"} ')[1].split(b"\n")[0])
    total = float(text.split(b"lag_seconds_count ")[1].split(b"\n")[0])
    assert total - le_25 >= 1
    assert total >= 2  # one sample per ms when idle: the chain goes on after the stall
