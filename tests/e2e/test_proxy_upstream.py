"""How the proxy accounts for an upstream that fails mid-stream (a mock backend that cuts its connection).

The real version, a decode instance SIGKILLed mid-stream, is a row of the fault matrix; this pins the bookkeeping:
the client gets its tokens and an error event, and the proxy counts an upstream error, not a client disconnect.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from support.proxy_harness import mock_backend
from support.vllm_servers import metric

from vllm_disagg.tools.harness import ProxyServer


@pytest.fixture
def proxy(tiny_model: str) -> Iterator[ProxyServer]:
    with mock_backend(tiny_model) as url, ProxyServer("unused", args=["--both", f"{url};id=mock"]) as p:
        yield p


def test_a_stream_cut_by_the_upstream_is_an_upstream_error(proxy: ProxyServer, tiny_model: str) -> None:
    body = {"model": tiny_model, "prompt": "hello", "max_tokens": 8, "stream": True, "mock_fail_after": 3}
    events: list[str] = []
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    tokens = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert tokens == [" t0", " t1", " t2"]
    err = json.loads(events[-2])["error"]
    assert err["type"] == "upstream_error" and "mock failed mid-stream" in err["message"]
    assert metric(proxy, "vllm_disagg_client_disconnects_total") == 0
    assert metric(proxy, "vllm_disagg_requests_total", 'status="5xx"') == 1
    assert metric(proxy, "vllm_disagg_requests_total", 'status="2xx"') == 0
    # The next request is served normally.
    ok = httpx.post(proxy.url + "/v1/completions", json={**body, "mock_fail_after": None}, timeout=30)
    assert ok.status_code == 200
