"""How late the proxy's event loop runs a timer: the longest time any request waited for the loop to be free.

A callback that holds the loop (hashing a long prompt, parsing a large answer) delays every other stream's relay
by as long as it runs. A timer due every ``interval_s`` measures that delay where it happens, inside the process,
without a client whose own core's load would add to it. A timer due during a stall runs when the stall ends, so a
stall of D seconds shows as a lag of up to D (more stalls, closer to D). Idle, the lag is the selector's wake-up
granularity: up to 1 ms (epoll sleeps in whole milliseconds), so lags under ~1 ms are noise. The lag is read from
``time.perf_counter``, not ``loop.time()``: uvloop's loop clock is libuv's, in whole milliseconds and cached per
iteration, which turns idle sub-millisecond lags into 1-2 ms ones.

What a virtual machine adds is not the proxy's: a do-nothing loop on an idle core of the project's VM, at real-time
priority, records 1-3 % of its samples over 2 ms (the hypervisor pausing the virtual CPU). ``benchmarks/proxy.py``
runs such a loop (``benchmarks/lag_canary.py``) beside the proxy to show that floor in the same run.
"""

from __future__ import annotations

import asyncio
import time

from vllm_disagg.router.metrics import LAG_BUCKETS, BucketCounts


class LoopLagMonitor:
    """A timer chain on the running loop; ``counts`` holds the lags since the last ``BucketCounts.flush``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.counts = BucketCounts((*LAG_BUCKETS, float("inf")))
        self.max_s = 0.0  # the largest lag since start
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(
            self.interval_s, self._tick, time.perf_counter() + self.interval_s
        )

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self, due: float) -> None:
        loop = self._loop
        assert loop is not None
        now = time.perf_counter()
        lag = now - due if now > due else 0.0
        self.counts.observe(lag)
        if lag > self.max_s:
            self.max_s = lag
        self._handle = loop.call_later(self.interval_s, self._tick, now + self.interval_s)
