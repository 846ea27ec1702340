"""Start and stop real vLLM OpenAI servers as child processes (tests, the demo, benchmarks, the launcher).

Why a harness of our own: a vLLM server is three processes (API server, EngineCore, worker). A test that fails or
is interrupted must not leave them running, each holding ~3 GiB. Every server gets its own session (process
group) and is killed as a group: at interpreter exit and on SIGTERM by this process, and, when this process is
killed outright (SIGKILL: nothing of it runs), by a reaper process that holds a pipe from it and kills every group
it was told of once that pipe closes. The kernel's parent-death signal alone reaches only the API server, whose
EngineCore and worker then live on with the GPU or KV memory and the ports.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import httpx

_LIVE: set[VLLMServer] = set()
_LIVE_LOCK = threading.Lock()


class ServerStartError(RuntimeError):
    """A vLLM server did not become healthy; the message carries the tail of its log."""


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, below the kernel's ephemeral range.

    Ports the OS hands out for port 0 come from the ephemeral range, the same range outgoing connections draw from,
    so one picked that way can be taken by some client's socket before the server binds it. Listening ports here
    come from 20000-32767 instead, never the same one twice in a process.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# The reaper: reads "+PGID" / "-PGID" lines; at end of input (the process that started it is gone, however it
# died) it stops every group still listed: SIGTERM, a short grace, then SIGKILL. Its own session keeps it out of
# the terminal's Ctrl-C and out of any group it kills.
_REAPER = """
import os, signal, sys, time
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line[:1] in "+-" and line[1:].isdigit():
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
def signal_all(sig):
    for g in list(groups):
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            groups.discard(g)
        except PermissionError:
            pass
signal_all(signal.SIGTERM)
deadline = time.monotonic() + 5
while groups and time.monotonic() < deadline:
    time.sleep(0.1)
    signal_all(0)
signal_all(signal.SIGKILL)
"""


class _Reaper:
    """The reaper process (started with the first server) and the pipe that tells it which groups to stop."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread writing to the reaper now

    def _tell(self, line: str) -> None:
        if self._owner == threading.get_ident():
            return  # a signal handler interrupted this thread's own write: waiting would hang it for good
        with self._lock:
            self._owner = threading.get_ident()
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-c", _REAPER],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                assert self._proc.stdin is not None
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:  # no reaper: the parent-death signal and atexit remain
                self._proc = None
            finally:
                self._owner = None

    def guard(self, pgid: int) -> None:
        self._tell(f"+{pgid}")

    def release(self, pgid: int) -> None:
        if self._proc is not None:
            self._tell(f"-{pgid}")


_reaper = _Reaper()


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec: die with the parent even if the parent is SIGKILLed.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def cpu_list(spec: str) -> set[int]:
    """CPU ids of a Linux cpu-list ("0", "0-3", "0,2-3"), as VLLM_CPU_OMP_THREADS_BIND takes them; ValueError
    naming the spec for anything else."""
    cores: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise ValueError(f"{spec!r} is not a cpu-list such as '0', '0-3' or '0,2-3'")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def _start_child(cores: set[int] | None) -> Callable[[], None]:
    """What runs in the child between fork and exec: die with the parent, and stay on ``cores`` when given.

    The whole instance is pinned, not only its OMP threads: vLLM's EngineCore busy-polls (sched_yield) on its
    queue to the worker, and left free on another core it starves whatever runs there (the API server, a client),
    which then reads a whole stream in one burst at its end.
    """

    def run() -> None:
        _set_pdeathsig()
        if cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cores)

    return run


def tail(path: Path, lines: int = 60) -> str:
    """The log's last lines, preceded by its distinct error lines (the root cause is often far above the tail)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    all_lines = text.splitlines()
    errors: list[str] = []
    for line in all_lines:
        if ("Error" in line or "ERROR" in line) and line not in errors:
            errors.append(line)
    head = "errors in the log:\n" + "\n".join(errors[-20:]) + "\n--- log tail:\n" if errors else ""
    return head + "\n".join(all_lines[-lines:])


@dataclass(eq=False)
class VLLMServer:
    """One `vllm serve` process on the CPU build (or GPU build), managed as a process group.

    ``cpu_cores`` (a cpu-list, "0" or "0-3") pins the whole instance, its OMP threads (VLLM_CPU_OMP_THREADS_BIND)
    and its processes (API server, EngineCore, worker), so two instances on a 2-core machine don't fight and no
    busy-polling EngineCore starves the other core; ``kv_cache_gib`` sets VLLM_CPU_KVCACHE_SPACE.
    """

    model: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    cpu_cores: str | None = None
    kv_cache_gib: int = 1
    log_path: Path | None = None
    name: str = "vllm"
    proc: subprocess.Popen[bytes] | None = None
    # no Hugging Face downloads (tests, benchmarks: what they need is local); the launcher lets vLLM fetch a model
    offline: bool = True
    health_path: ClassVar[str] = "/health"  # answers 200 once the server serves

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"{self.name}-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.offline:
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        if self.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        env.update(self.env)
        return env

    def pinned_cores(self) -> set[int] | None:
        """The CPUs the instance is pinned to: ``cpu_cores`` where this process may run, None when not pinned."""
        if self.cpu_cores is None:
            return None
        return cpu_list(self.cpu_cores) & os.sched_getaffinity(0) or None

    def start(self) -> Self:
        assert self.log_path is not None
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=_start_child(self.pinned_cores()),
            )
        finally:
            log.close()
        _reaper.guard(self.proc.pid)  # its own session: the group id is its pid
        with _LIVE_LOCK:
            _LIVE.add(self)
        return self

    def wait_healthy(self, timeout: float = 240.0) -> Self:
        """Poll ``health_path`` until it answers 200; raise ServerStartError with the log tail on exit or deadline."""
        wait_all_healthy([self], timeout)
        return self

    def healthy_now(self, client: httpx.Client) -> bool:
        """One health check: True once it answers 200; ServerStartError (it is stopped) if it exited."""
        assert self.proc is not None, "start() first"
        code = self.proc.poll()
        if code is not None:
            self.stop()
            raise ServerStartError(
                f"{self.name} exited with code {code} before becoming healthy; log {self.log_path}\n"
                f"{tail(self.log_path)}\n--- command: {' '.join(self.command())}"  # type: ignore[arg-type]
            )
        try:
            return client.get(self.url + self.health_path).status_code == 200
        except httpx.HTTPError:
            return False

    def not_healthy_in_time(self, timeout: float) -> ServerStartError:
        self.stop()
        return ServerStartError(
            f"{self.name} on {self.url} not healthy after {timeout:.0f} s; log {self.log_path}\n"
            f"{tail(self.log_path)}"  # type: ignore[arg-type]
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after ``grace`` seconds."""
        proc = self.proc
        if proc is None:
            with _LIVE_LOCK:
                _LIVE.discard(self)
            return
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        # Children (EngineCore, workers) may outlive the API server: kill the group unconditionally.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        _wait_group_gone(pgid, 5.0)
        with _LIVE_LOCK:  # only once it is gone: an interrupted stop leaves it to stop_all
            _LIVE.discard(self)
        _reaper.release(pgid)

    def kill(self) -> None:
        """SIGKILL the group at once (fault tests)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            _wait_group_gone(self.proc.pid, 5.0)
            _reaper.release(self.proc.pid)

    def __enter__(self) -> Self:
        return self.start().wait_healthy()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_all() -> None:
    """Stop every server this process started and has not stopped (atexit and signal handlers call this)."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        server.stop(grace=3.0)


def _on_signal(signum: int, frame: object) -> None:
    stop_all()
    raise SystemExit(128 + signum)


atexit.register(stop_all)
if threading.current_thread() is threading.main_thread():
    with contextlib.suppress(ValueError):
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_signal)


def wait_all_healthy(servers: Sequence[VLLMServer], timeout: float) -> None:
    """Poll every server until all answer healthy: the first to exit fails the wait at once, whichever it is (one
    slow to start does not hide another's death for the whole timeout)."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            pending = [s for s in pending if not s.healthy_now(client)]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise pending[0].not_healthy_in_time(timeout)
            time.sleep(0.5)


def start_many(servers: Sequence[VLLMServer], timeout: float = 300.0) -> list[VLLMServer]:
    """Start servers together (startup overlaps) and wait for all; on any failure stop them all."""
    try:
        for s in servers:
            s.start()
        wait_all_healthy(servers, timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return list(servers)


@contextlib.contextmanager
def running(*servers: VLLMServer, timeout: float = 300.0) -> Iterator[list[VLLMServer]]:
    started = start_many(servers, timeout)
    try:
        yield started
    finally:
        for s in started:
            s.stop()


@dataclass(eq=False)
class ProxyServer(VLLMServer):
    """`vllm-disagg proxy` as a child process, managed like a vLLM server (``model`` is unused)."""

    name: str = "proxy"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm_disagg.cli",
            "proxy",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]


@dataclass(eq=False)
class LMCacheServer(VLLMServer):
    """`lmcache server` (LMCache's multi-process mode: a KV tier in its own process) managed like a vLLM server;
    ``port`` is its HTTP port, ``zmq_port`` the one vLLM's LMCacheMPConnector connects to. Runs from this Python
    environment (lmcache must be installed in it: docs/lmcache.md)."""

    name: str = "lmcache"
    health_path: ClassVar[str] = "/healthcheck"
    zmq_port: int = 0
    l1_size_gb: float = 0.5  # allocated eagerly on CPU (pinning is unsupported there)
    chunk_size: int = 256  # a multiple of vLLM's block size; only whole chunks are stored and served
    # 0 turns the server's own KV-event log off. In engine-driven mode (the only one a CPU worker can use) the server
    # never learns the token ids of what it stores, so its log announces nothing ("unbound_stores" in /status); with
    # the log off, each vLLM worker publishes its own completed stores as medium="CPU" KV events instead.
    kv_event_log_size: int = 0
    # extra server flags, e.g. a local-disk tier: ["--l2-adapter", '{"type":"fs","base_path":"/path"}']
    l2: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.zmq_port:
            self.zmq_port = free_port(self.host)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.setdefault("LMCACHE_DISABLE_BANNER", "1")
        env.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage reports from a test or an offline host
        return env

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            self.host,
            "--port",
            str(self.zmq_port),
            "--http-host",
            self.host,
            "--http-port",
            str(self.port),
            # The server's default, lmcache_driven, has no handler for a CPU worker's registration: vLLM then
            # hangs at start-up until lmcache.mp.mq_timeout. CPU workers use the engine-driven path.
            "--supported-transfer-mode",
            "engine_driven",
            "--l1-size-gb",
            str(self.l1_size_gb),
            "--eviction-policy",
            "LRU",
            "--chunk-size",
            str(self.chunk_size),
            "--kv-event-log-size",
            str(self.kv_event_log_size),
            *self.l2,
        ]

    def mp_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{self.host}",
                "lmcache.mp.port": self.zmq_port,
            },
        }


def disagg_connector_args(side_port: int, host: str = "127.0.0.1", **extra: object) -> list[str]:
    """vLLM flags running DisaggConnector (kv_both, recompute on load failure) with its side channel on ``host``."""
    cfg = {"transport": "tcp", "side_channel_host": host, "side_channel_port": side_port, **extra}
    ktc = {
        "kv_connector": "DisaggConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": cfg,
    }
    return ["--kv-transfer-config", json.dumps(ktc)]


def kv_events_args(port: int, replay_port: int, host: str = "*") -> list[str]:
    """vLLM flags publishing KV-cache events; vLLM binds wildcard endpoints and the proxy connects to them."""
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{host}:{port}",
        "replay_endpoint": f"tcp://{host}:{replay_port}",
        "topic": "kv",
    }
    return ["--kv-events-config", json.dumps(cfg)]


def tiny_model_args(max_model_len: int = 2048, dtype: str = "float32") -> list[str]:
    """The vLLM flags this project runs the tiny model with on CPU."""
    return ["--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager"]
