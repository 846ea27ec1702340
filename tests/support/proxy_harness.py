"""Servers for proxy tests: benchmarks/mock_backend.py as a child process, any ASGI app or the proxy itself
served in-process (a daemon thread, so a test can read the proxy's state), and the OpenAI error-body check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from support.paths import ROOT
from vllm_disagg.router import server as proxy_server
from vllm_disagg.router.app import Proxy
from vllm_disagg.router.config import InstanceConfig, ProxySettings
from vllm_disagg.router.server import build_proxy
from vllm_disagg.tools.harness import free_port

ADMIN_KEY = "fuzz-admin-key"
MAX_BODY = 100_000


@contextlib.contextmanager
def mock_backend(model: str) -> Iterator[str]:
    """benchmarks/mock_backend.py as a child process serving ``model``; yields its base URL."""
    port = free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the child writes it; closed below
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "mock_backend.py"), str(port), model],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=1) as client:
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"mock backend did not start: {log.read().decode(errors='replace')}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


class _CaretFreeTracebacks(logging.Filter):
    """Render a record's traceback without CPython 3.11's ``^^^`` lines, which call ``ast.parse``: that is not
    thread-safe against the test thread's own ``ast.parse`` (pytest's failure reports, hypothesis' lambda
    analysis) and fails with "SystemError: AST constructor recursion depth mismatch"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            frames = [
                traceback.FrameSummary(f.filename, f.lineno, f.name, line=f.line)  # no columns: no carets
                for f in traceback.extract_tb(exc.__traceback__)
            ]
            text = "".join(traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc))
            record.msg, record.args = (
                f"{record.getMessage()}\nTraceback (most recent call last):\n{text}",
                None,
            )
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_carets() -> None:
    for name in ("uvicorn.error", "vllm_disagg.proxy"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _CaretFreeTracebacks) for f in log.filters):
            log.addFilter(_CaretFreeTracebacks())


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a daemon thread (lifespan included); yields its base URL."""
    _quiet_carets()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_proxy(proxy: Proxy) -> Iterator[str]:
    """Serve the proxy on its own HTTP server (as ``vllm-disagg proxy`` does) in a daemon thread."""
    _quiet_carets()
    ready: list[int] = []
    failed: list[BaseException] = []
    holder: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            holder["loop"] = asyncio.get_running_loop()
            holder["stop"] = stop = asyncio.Event()
            await proxy_server.serve(proxy, "127.0.0.1", 0, stop=stop, on_ready=ready.append, grace_s=5)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the waiting test
            failed.append(exc)

    thread = threading.Thread(target=run, name="proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not ready:
        if failed or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the proxy did not start: {failed[:1]}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{ready[0]}"
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(timeout=15)


@dataclass
class RunningProxy:
    url: str
    proxy: Proxy
    model: str


@contextlib.contextmanager
def running_proxy(backend_url: str, model: str, **overrides: Any) -> Iterator[RunningProxy]:
    """The proxy as ``vllm-disagg proxy --both URL --tokenizer MODEL ...`` builds it, served in-process."""
    fields: dict[str, Any] = {
        "instances": [InstanceConfig(url=backend_url, role="both")],
        "tokenizer": model,
        "admin_key": ADMIN_KEY,
        "max_body_bytes": MAX_BODY,
        "max_concurrency": 64,
        "health_interval_s": 0.5,
    }
    fields.update(overrides)
    proxy = build_proxy(ProxySettings(**fields))
    with serve_proxy(proxy) as url:
        deadline = time.monotonic() + 20
        with httpx.Client(timeout=5) as client:
            while client.get(url + "/health").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("proxy never became healthy")
                time.sleep(0.05)
        yield RunningProxy(url, proxy, model)


def assert_openai_error(r: httpx.Response) -> None:
    """A 4xx must say what was wrong the way OpenAI clients parse it: ``{"error": {"message": ...}}``."""
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"{r.status_code} with a non-JSON body: {r.text[:300]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], (
        f"{r.status_code} without an OpenAI-style error body: {r.text[:300]!r}"
    )
