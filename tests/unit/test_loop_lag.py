"""The event-loop lag monitor: a callback that holds the loop shows as a timer's lateness, in the right bucket."""

from __future__ import annotations

import asyncio
import time

import pytest
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


def test_a_metrics_render_lets_other_callbacks_run_and_renders_what_a_whole_render_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A /metrics scrape costs ms of CPU: rendered in one go it stalls every stream once per scrape."""
    from vllm_disagg.router import metrics

    registry = CollectorRegistry()
    for i in range(40):
        h = Histogram(f"family_{i}_seconds", "h", ["instance"], buckets=LAG_BUCKETS, registry=registry)
        for j in range(5):
            h.labels(f"http://10.0.0.{j}:8000").observe(0.001 * i)
    monkeypatch.setattr(metrics, "RENDER_SLICE_S", 0.0)  # yield after every family

    async def scenario() -> tuple[bytes, int]:
        ran = 0
        done = False

        def other() -> None:  # stands for every other stream's callbacks
            nonlocal ran
            ran += 1
            if not done:
                asyncio.get_running_loop().call_soon(other)

        asyncio.get_running_loop().call_soon(other)
        text = await metrics.render(registry)
        done = True
        return text, ran

    text, ran = asyncio.run(scenario())
    assert ran >= 40  # the loop ran other work between families
    assert text == generate_latest(registry)  # the same exposition, byte for byte
