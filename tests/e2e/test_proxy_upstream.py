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
    assert (
        err["type"] == "InternalServerError"
        and err["code"] == 500
        and "mock failed mid-stream" in err["message"]
    )
    assert metric(proxy, "vllm_disagg_client_disconnects_total") == 0
    assert metric(proxy, "vllm_disagg_requests_total", 'status="5xx"') == 1
    assert metric(proxy, "vllm_disagg_requests_total", 'status="2xx"') == 0
    # The next request is served normally.
    ok = httpx.post(proxy.url + "/v1/completions", json={**body, "mock_fail_after": None}, timeout=30)
    assert ok.status_code == 200


@pytest.fixture
def two(tiny_model: str) -> Iterator[tuple[ProxyServer, str, str]]:
    with (
        mock_backend(tiny_model) as a,
        mock_backend(tiny_model) as b,
        ProxyServer(
            "unused",
            args=["--both", f"{a};id=a", "--both", f"{b};id=b", "--request-timeout-s", "1",
                  "--admin-key", "k", "--policy", "round-robin"],
        ) as p,
    ):  # fmt: skip
        yield p, a, b


def _errors(proxy: ProxyServer) -> dict[str, object]:
    r = httpx.get(proxy.url + "/admin/instances", headers={"x-admin-key": "k"}, timeout=10)
    return {i["id"]: i["last_error"] for i in r.json()["instances"]}


def test_a_non_streamed_generation_past_the_timeout_is_a_504_not_a_retry(
    two: tuple[ProxyServer, str, str], tiny_model: str
) -> None:
    """vLLM sends nothing of a non-streamed answer until generation ends: past request_timeout_s the instance may
    still be working, so the request is answered 504 (naming it) and not run again elsewhere; it counts against
    that instance only (a hung engine still answers /health)."""
    proxy, _, _ = two
    body = {"model": tiny_model, "prompt": "hello", "max_tokens": 4, "mock_complete_delay_s": 3}
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 504, r.text
    assert "request_timeout_s" in r.json()["error"]["message"]
    failed = [iid for iid, err in _errors(proxy).items() if err]
    assert len(failed) == 1 and failed[0] in r.json()["error"]["message"]  # not tried on the other instance
    assert metric(proxy, "vllm_disagg_requests_total", 'status="5xx"') == 1


def test_a_non_streamed_answer_cut_mid_body_goes_to_another_instance(
    two: tuple[ProxyServer, str, str], tiny_model: str
) -> None:
    """The client saw nothing of it: an answer cut while its body was read is a failure before the first token,
    served elsewhere, not a 500."""
    proxy, a, _ = two
    port = int(a.rsplit(":", 1)[1])
    body = {
        "model": tiny_model,
        "prompt": "hello",
        "max_tokens": 4,
        "mock_cut_body": True,
        "mock_http_error_port": port,
    }
    for _ in range(2):  # round-robin: one of the two lands on a first
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " t0 t1 t2 t3"
    assert _errors(proxy)["a"]  # the cut counted against a


def test_every_answer_counts_in_requests_total_by_status_class(
    two: tuple[ProxyServer, str, str], tiny_model: str
) -> None:
    """Error answers count as answered requests, whoever refused them (the proxy before any plan, or an instance
    whose own error is relayed), and an error that ends the request is not counted as another decision."""
    proxy, _, _ = two
    body = {"model": tiny_model, "prompt": "hello", "max_tokens": 2}

    def post(**extra: object) -> httpx.Response:
        return httpx.post(proxy.url + "/v1/completions", json={**body, **extra}, timeout=30)

    assert post().status_code == 200
    failed = post(mock_http_error=500)  # the instance's own 500 for this body: relayed, not retried
    assert failed.status_code == 500 and "x-disagg-path" in failed.headers, failed.headers
    assert post(model="no-such-model").status_code == 404
    assert httpx.post(proxy.url + "/v1/completions", content=b"{", timeout=30).status_code == 400
    text = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert metric(proxy, "vllm_disagg_requests_total", 'status="2xx"') == 1
    assert metric(proxy, "vllm_disagg_requests_total", 'status="5xx"') == 1
    assert metric(proxy, "vllm_disagg_requests_total", 'mode="none",status="4xx"') == 2
    decisions = metric(proxy, "vllm_disagg_decisions_total")
    assert decisions == 2, [ln for ln in text.splitlines() if ln.startswith("vllm_disagg_decisions_total")]


def test_a_prefill_legs_400_is_recomputed_on_decode(tiny_model: str) -> None:
    """A 4xx from the prefill instance alone may be that instance's own (another API key, a flag it lacks, a
    shorter context): decode, which answers a body it refuses with its own 4xx, serves the request."""
    with (
        mock_backend(tiny_model) as a,
        mock_backend(tiny_model) as b,
        ProxyServer("unused", args=["--prefill", f"{a};id=p", "--decode", f"{b};id=d", "--policy",
                                    "always-transfer"]) as proxy,
    ):  # fmt: skip
        port = int(a.rsplit(":", 1)[1])
        body = {"model": tiny_model, "prompt": "hello", "max_tokens": 2, "mock_http_error": 400,
                "mock_http_error_port": port}  # fmt: skip
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert "fallback=prefill_http_400:recompute" in r.headers["x-disagg-path"], r.headers
        assert metric(proxy, "vllm_disagg_requests_total", 'status="2xx"') == 1


def test_the_pool_skips_a_closing_connection_and_sweeps_idle_ones(tiny_model: str) -> None:
    """A pooled connection whose transport is closing (its peer died between two requests) is not handed out: the
    request goes on a fresh one instead of failing. Connections idle past the keep-alive go at the next sweep,
    whatever URL they belong to; ``forget`` closes a URL's at once."""
    import asyncio

    from vllm_disagg.router.upstream import UpstreamPool

    async def scenario(url: str) -> None:
        pool = UpstreamPool(2.0, 5.0, keepalive_s=0.3)
        try:
            assert (await pool.get(url, "/health"))[0] == 200
            (conn,) = pool._idle[url]
            assert conn.transport is not None
            conn.transport.close()  # closing: not yet seen as closed by the pool
            assert (await pool.get(url, "/health"))[0] == 200  # on a fresh connection
            assert pool._idle[url] and pool._idle[url][0] is not conn
            await asyncio.sleep(0.4)
            assert pool.sweep() == 1 and url not in pool._idle
            assert (await pool.get(url, "/health"))[0] == 200
            pool.forget(url)
            assert url not in pool._idle
        finally:
            pool.close()

    with mock_backend(tiny_model) as url:
        asyncio.run(scenario(url))
