"""The host's own event-loop lag: a loop that does nothing but measure, beside the proxy on the proxy's core.

The proxy's ``vllm_disagg_event_loop_lag_seconds`` counts how late its timer ran. On a virtual machine part of that
is not the proxy's: the hypervisor pauses the virtual CPU (steal), and interrupts run before any task. This script
runs the proxy's own monitor (``LoopLagMonitor``, same interval, same buckets, uvloop) in a process with no other
work, at real-time priority (``SCHED_FIFO``, taken after its imports, where the host allows it) so the proxy cannot
delay it: whatever lag it records, the proxy could not have avoided. It prints ``ready realtime|plain`` once it
measures, runs until its stdin closes, then prints one JSON object: the samples per bucket (upper bound in ms) and
their total.

    taskset -c 0 python benchmarks/lag_canary.py 0.01 < some-pipe
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import uvloop

from vllm_disagg.router.loop_lag import LoopLagMonitor


def realtime() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:  # not permitted here
        return False
    return True


async def measure(interval_s: float) -> dict[str, float]:
    monitor = LoopLagMonitor(interval_s)
    rt = realtime()
    monitor.start()
    print("ready", "realtime" if rt else "plain", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.buffer.read)  # until the benchmark closes the pipe
    monitor.stop()
    bounds, counts = monitor.counts.bounds, monitor.counts.counts
    return {f"{1000 * b:g}": float(n) for b, n in zip(bounds, counts, strict=True)}


def main() -> int:
    interval_s = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        counts = runner.run(measure(interval_s))
    print(json.dumps({"counts": counts, "samples": sum(counts.values())}), flush=True)
    return 0


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown: at real-time priority it would hold the proxy's core
