"""Instances added and removed while the proxy serves: a watched instances file and the admin API (mock backends)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.proxy_harness import mock_backend

from vllm_disagg.tools.harness import ProxyServer

ADMIN = "k"


def _wait(pred, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.fixture
def backends(tiny_model: str) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(mock_backend(tiny_model)) for _ in range(2)]


def _ids(proxy: ProxyServer) -> set[str]:
    r = httpx.get(proxy.url + "/admin/instances", headers={"x-admin-key": ADMIN}, timeout=5)
    return {i["id"] for i in r.json()["instances"]}


def test_watched_instances_file_and_admin_api(backends: list[str], tiny_model: str, tmp_path: Path) -> None:
    f = tmp_path / "instances.json"
    f.write_text(json.dumps([{"url": backends[0], "role": "both", "id": "a"}]))
    proxy = ProxyServer(
        "unused",
        args=[
            "--instances-file",
            str(f),
            "--tokenizer",
            tiny_model,
            "--admin-key",
            ADMIN,
            "--policy",
            "least-loaded",
        ],
        env={"VLLM_DISAGG_PROXY_HEALTH_INTERVAL_S": "0.3"},
    )
    with proxy:
        assert _ids(proxy) == {"a"}
        time.sleep(0.05)
        f.write_text(json.dumps([{"url": backends[0], "id": "a"}, {"url": backends[1], "id": "b"}]))
        _wait(lambda: _ids(proxy) == {"a", "b"})
        f.write_text(json.dumps([{"url": backends[1], "id": "b"}]))
        _wait(lambda: _ids(proxy) == {"b"})
        body = {"model": tiny_model, "prompt": "hi", "max_tokens": 2}
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and "instance=b" in r.headers["x-disagg-path"]
        # Admin API: add, drain, remove.
        h = {"x-admin-key": ADMIN}
        r = httpx.post(
            proxy.url + "/admin/instances", headers=h, json={"url": backends[0], "id": "c"}, timeout=10
        )
        assert r.status_code == 201 and r.json()["healthy"]
        assert httpx.post(proxy.url + "/admin/instances/b/drain", headers=h, timeout=5).json()["draining"]
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
        assert "instance=c" in r.headers["x-disagg-path"]  # the drained instance takes no new requests
        assert httpx.delete(proxy.url + "/admin/instances/c", headers=h, timeout=5).status_code == 200
        assert httpx.delete(proxy.url + "/admin/instances/zzz", headers=h, timeout=5).status_code == 404
        r = httpx.post(proxy.url + "/admin/instances", headers=h, json={"url": "not-a-url"}, timeout=5)
        assert r.status_code == 400
        # Only a draining instance is left: nothing can serve, and /health says so.
        assert httpx.get(proxy.url + "/health", timeout=5).status_code == 503
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.headers.get("retry-after")
        # Resumed, it serves again; another method on an inference route is 405, as vLLM answers.
        assert not httpx.post(proxy.url + "/admin/instances/b/resume", headers=h, timeout=5).json()[
            "draining"
        ]
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and "instance=b" in r.headers["x-disagg-path"]
        r = httpx.get(proxy.url + "/v1/completions", timeout=5)
        assert r.status_code == 405 and "POST" in r.headers.get("allow", "")


def test_a_removed_instance_leaves_nothing_behind(backends: list[str], tiny_model: str) -> None:
    """An instance removed after it served keeps no idle connection, prefix-index entry, metric series or policy
    state in the proxy: each rollout replaces pods, and all of these were keyed by instances never seen again."""
    from prometheus_client import generate_latest
    from support.proxy_harness import ADMIN_KEY, running_proxy

    body = {"model": tiny_model, "prompt": "hello there " * 40, "max_tokens": 2}
    with running_proxy(backends[0], tiny_model) as rp:
        proxy, h = rp.proxy, {"x-admin-key": ADMIN_KEY}
        (first,) = proxy.registry.instances
        assert httpx.post(rp.url + f"/admin/instances/{first}/drain", headers=h, timeout=5).status_code == 200
        for n in range(3):
            r = httpx.post(rp.url + "/admin/instances", headers=h, json={"url": backends[1], "id": f"x{n}"})
            assert r.status_code == 201, r.text
            for _ in range(4):
                r = httpx.post(rp.url + "/v1/completions", json=body, timeout=10)
                assert r.status_code == 200 and f"instance=x{n}" in r.headers["x-disagg-path"]
            assert backends[1] in proxy.upstream._idle  # type: ignore[attr-defined]
            assert f"x{n}" in proxy.index.stats()["instances"]  # type: ignore[union-attr]
            assert any(f"x{n}" in getattr(proxy.policy, k) for k in ("_recent", "_duty", "_running_seen"))
            assert httpx.delete(rp.url + f"/admin/instances/x{n}", headers=h, timeout=5).status_code == 200
        assert backends[1] not in proxy.upstream._idle  # type: ignore[attr-defined]
        assert backends[1] not in proxy.probes._idle  # type: ignore[attr-defined]
        assert proxy.index is not None and set(proxy.index.stats()["instances"]) == {first}
        proxy.export_instance_metrics()
        assert 'instance="x' not in generate_latest(proxy.metrics.registry).decode()
        for kept in ("_recent", "_busy_until", "_duty", "_running_seen"):
            assert not any(k.startswith("x") for k in getattr(proxy.policy, kept)), kept
