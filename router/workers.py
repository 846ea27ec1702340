"""``vllm-disagg proxy --workers N``: N proxy processes on one port, so one proxy can use a whole node.

Each worker binds the port with SO_REUSEPORT (the kernel spreads new connections over them) and runs the whole
proxy: its own HTTP server, prober and KV-event subscriptions (an instance's PUB socket fans its events out to
every worker, so every worker's prefix index is the same and a prefix hit routes to the same instance whichever
worker takes the request). What must be one number across workers is shared: requests in flight per instance
(``SharedLoad``, shared memory), and the metrics (prometheus_client's multiprocess mode: any worker's /metrics
shows the whole proxy, with each worker's share in ``vllm_disagg_worker_requests_total``). Health is probed by
every worker on the same schedule, so their views agree within one interval.

The supervisor restarts a worker that dies and, on SIGTERM/SIGINT, lets the workers drain (their answers under way
finish) before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

from vllm_disagg.router.config import ProxySettings

logger = logging.getLogger("vllm_disagg.proxy")

_GRACE_S = 35.0  # the workers' own drain (30 s) plus start-up slack


def _bind(host: str, port: int) -> socket.socket:
    from vllm_disagg.router.http_server import bind_socket

    return bind_socket(host, port, reuse_port=True)


def _worker_main(settings: ProxySettings, worker: int, table_name: str, port: int) -> None:
    from vllm_disagg.router.server import _configure_logging, run_worker
    from vllm_disagg.router.shared_load import SharedLoad

    _configure_logging(settings)
    shared = SharedLoad.attach(table_name, settings.workers, worker)
    settings = settings.model_copy(update={"port": port})
    try:
        run_worker(settings, worker, shared, sock=_bind(settings.host, port))
    finally:
        shared.close()


def supervise(settings: ProxySettings) -> int:
    from vllm_disagg.router.shared_load import SharedLoad

    n = settings.workers
    metrics_dir = tempfile.mkdtemp(prefix="vllm-disagg-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the workers before they import it
    table = SharedLoad.create(n)
    # Port 0: pick one now. A bound, non-listening SO_REUSEPORT socket holds it without taking connections.
    anchor = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    anchor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    anchor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    anchor.bind((settings.host, settings.port))
    port = anchor.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, Any] = {}

    def start(i: int) -> None:
        proc = ctx.Process(
            target=_worker_main, args=(settings, i, table.name, port), name=f"proxy-worker-{i}"
        )
        proc.start()
        procs[i] = proc

    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(n):
            start(i)
        logger.info("proxy supervisor: %d workers on %s:%d", n, settings.host, port)
        while not stopping:
            time.sleep(0.5)
            for i, proc in list(procs.items()):
                if not proc.is_alive() and not stopping:
                    logger.error(
                        "proxy worker %d (pid %s) exited with %s; starting it again",
                        i,
                        proc.pid,
                        proc.exitcode,
                    )
                    _mark_dead(proc.pid)
                    start(i)
        for proc in procs.values():
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)  # each worker stops accepting and lets its answers finish
        deadline = time.monotonic() + _GRACE_S
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        anchor.close()
        table.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _mark_dead(pid: int | None) -> None:
    """Drop a dead worker's live gauges from the multiprocess metrics."""
    if pid is None:
        return
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
