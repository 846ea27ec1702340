"""Small helpers for tests against real vLLM servers."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from vllm_disagg.tools.harness import VLLMServer, disagg_connector_args, tiny_model_args

SECRET = "test-secret-for-side-channel"


def disagg_args(side_port: int, trace: str | None = None, **extra: Any) -> list[str]:
    """vLLM flags for an instance running DisaggConnector (TCP, shared secret, short leases) on the tiny model."""
    cfg: dict[str, Any] = {"shared_secret": SECRET, "lease_s": 15, "load_timeout_s": 15}
    if trace:
        cfg["trace_path"] = trace
    cfg.update(extra)
    return [*tiny_model_args(), *disagg_connector_args(side_port, **cfg)]


def complete(
    server: VLLMServer, model: str, prompt: str | list[int], max_tokens: int = 12, **kw: Any
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def tokens(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def metric(server: VLLMServer, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_usage(server: VLLMServer) -> float:
    return metric(server, "vllm:kv_cache_usage_perc")


def wait_kv_idle(server: VLLMServer, timeout: float = 30.0) -> float:
    """Wait until no KV block is in use (requests done, held blocks released); returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        usage = kv_usage(server)
        running = metric(server, "vllm:num_requests_running") + metric(server, "vllm:num_requests_waiting")
        if usage == 0.0 and running == 0.0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(
                f"{server.name}: KV usage {usage} / {running} requests still held after {timeout} s"
            )
        time.sleep(0.2)


def read_trace(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def find_trace(path: str, transfer_id: str, side: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in read_trace(path):
            if rec["transfer_id"] == transfer_id and rec["side"] == side:
                return rec
        time.sleep(0.1)
    raise AssertionError(f"no {side} trace for transfer {transfer_id} in {path}")


def log_contains(server: VLLMServer, pattern: str) -> bool:
    assert server.log_path is not None
    return re.search(pattern, server.log_path.read_text(errors="replace")) is not None


@contextlib.contextmanager
def launched(config: Path, env: dict[str, str] | None = None, timeout: float = 400) -> Iterator[None]:
    """`vllm-disagg launch CONFIG` until it says it is ready; on exit Ctrl-C it and check that it stopped cleanly
    and left no process that names the config's folder behind."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_disagg.cli", "launch", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops everything" in line or proc.poll() is not None:
                break
        assert any("ready in" in x for x in lines), "".join(lines)
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGINT, out  # stopped by Ctrl-C, as a shell reports it
    assert "all processes stopped" in out
    left = subprocess.run(["pgrep", "-f", str(config.parent)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
