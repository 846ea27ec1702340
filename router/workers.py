"""``vllm-disagg proxy --workers N``: N proxy processes on one port, so one proxy can use a whole node.

Each worker binds the port with SO_REUSEPORT (the kernel spreads new connections over them) and runs the whole
proxy: its own HTTP server, prober and KV-event subscriptions (an instance's PUB socket fans its events out to
every worker, so every worker's prefix index is the same and a prefix hit routes to the same instance whichever
worker takes the request). Admin changes (add, remove, drain, resume) reach every worker through one journal
(``admin_journal.py``), which a restarted worker replays. What must be one number across workers is shared:
requests in flight per instance (``SharedLoad``, shared memory), and the metrics (prometheus_client's multiprocess
mode: any worker's /metrics shows the whole proxy, with each worker's share in
``vllm_disagg_worker_requests_total``). Health is probed by every worker on the same schedule, so their views
agree within one interval.

The supervisor restarts a worker that dies (after a back-off that doubles while it keeps dying young) and gives up,
exiting non-zero, when one dies young ``_YOUNG_DEATHS`` times in a row: a setting only a worker evaluates (a policy
that does not load, a missing certificate) fails the proxy as it would with one worker, instead of a crash loop
behind a live pid. On SIGTERM/SIGINT it lets the workers drain (``--drain-delay-s``, then answers under way get
``--shutdown-grace-s``) before it exits. A worker dies with its supervisor (SIGTERM on the parent's death), so a
supervisor that was killed leaves no workers serving the port beside its replacement.
"""

from __future__ import annotations

import contextlib
import ctypes
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

_SLACK_S = 5.0  # beyond the workers' own drain delay and grace, before they are killed
_YOUNG_S = 10.0  # a worker that exits sooner than this after its start died young
_YOUNG_DEATHS = 3  # in a row (any worker), and the supervisor gives up
_BACKOFF_MAX_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies (Linux), and exit now if it already has."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit("proxy worker: the supervisor is gone; exiting")


def _bind(host: str, port: int) -> socket.socket:
    from vllm_disagg.router.http_server import bind_socket

    return bind_socket(host, port, reuse_port=True)


def _worker_main(
    settings: ProxySettings, worker: int, table_name: str, port: int, parent: int, journal_dir: str
) -> None:
    from vllm_disagg.router.server import _configure_logging, run_worker
    from vllm_disagg.router.shared_load import SharedLoad

    _die_with_parent(parent)
    _configure_logging(settings)
    shared = SharedLoad.attach(table_name, settings.workers, worker)
    settings = settings.model_copy(update={"port": port})
    try:
        run_worker(settings, worker, shared, sock=_bind(settings.host, port), journal_dir=journal_dir)
    finally:
        shared.close()


def _anchor(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket that holds the workers' port (port 0: one picked now) without
    taking connections. The port is first bound without SO_REUSEPORT: Linux lets any process of the same user join
    a SO_REUSEPORT group, so another proxy left running on the port would otherwise silently get half the clients."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    anchor = socket.socket(family, socket.SOCK_STREAM)
    try:
        anchor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        anchor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        anchor.bind((host, port))
    except OSError:
        anchor.close()
        raise
    return anchor


def supervise(settings: ProxySettings) -> int:
    from vllm_disagg.router.shared_load import SharedLoad

    n = settings.workers
    try:
        anchor = _anchor(settings.host, settings.port)
    except OSError as exc:
        raise SystemExit(
            f"error: cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc}); stop what holds it "
            "or choose another --port / --host"
        ) from None
    port = anchor.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="vllm-disagg-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the workers before they import it
    table = SharedLoad.create(n)
    journal_dir = tempfile.mkdtemp(prefix="vllm-disagg-admin-")  # the admin changes every worker applies
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, Any] = {}
    started: dict[int, float] = {}
    restart_at: dict[int, float] = {}  # worker -> when its back-off ends
    young_deaths = 0

    def start(i: int) -> None:
        proc = ctx.Process(
            target=_worker_main,
            args=(settings, i, table.name, port, os.getpid(), journal_dir),
            name=f"proxy-worker-{i}",
        )
        proc.start()
        procs[i] = proc
        started[i] = time.monotonic()

    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(n):
            start(i)
        logger.info("proxy supervisor: %d workers on %s:%d", n, settings.host, port)
        failed = False
        while not stopping and not failed:
            time.sleep(0.5)
            now = time.monotonic()
            for i, proc in list(procs.items()):
                if stopping:
                    break
                if i in restart_at:
                    if now >= restart_at[i]:
                        del restart_at[i]
                        start(i)
                    continue
                if proc.is_alive():
                    continue
                _mark_dead(proc.pid)
                young = now - started[i] < _YOUNG_S
                young_deaths = young_deaths + 1 if young else 0
                if young_deaths >= _YOUNG_DEATHS:
                    logger.error(
                        "proxy worker %d (pid %s) exited with %s within %.0f s of its start, %d times in a row: "
                        "giving up. Its log above says why (a policy that does not load, a certificate file); "
                        "fix it and start the proxy again",
                        i, proc.pid, proc.exitcode, _YOUNG_S, young_deaths,
                    )  # fmt: skip
                    failed = True
                    break
                delay = min(0.5 * 2**young_deaths, _BACKOFF_MAX_S) if young else 0.0
                logger.error(
                    "proxy worker %d (pid %s) exited with %s; starting it again in %.1f s",
                    i, proc.pid, proc.exitcode, delay,
                )  # fmt: skip
                restart_at[i] = now + delay
        if stopping:
            logger.info(
                "proxy supervisor: %s: stopping %d workers (each drains as --drain-delay-s and "
                "--shutdown-grace-s say)",
                signal.Signals(stopping[0]).name,
                len(procs),
            )
        for proc in procs.values():
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)  # each worker stops accepting and lets its answers finish
        deadline = time.monotonic() + settings.drain_delay_s + settings.shutdown_grace_s + _SLACK_S
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        return 1 if failed else 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        anchor.close()
        table.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(journal_dir, ignore_errors=True)


def _mark_dead(pid: int | None) -> None:
    """Drop a dead worker's live gauges from the multiprocess metrics."""
    if pid is None:
        return
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
