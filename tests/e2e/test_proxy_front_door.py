"""The proxy as a front door, on real sockets against mock OpenAI backends: routing by model (LoRA adapters
included, refreshed by the probes), the pass-through routes, API keys, HTTPS, and draining on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.proxy_harness import mock_backend, running_proxy

from vllm_disagg.router import server as proxy_server
from vllm_disagg.router.config import InstanceConfig, ProxySettings
from vllm_disagg.router.server import build_proxy
from vllm_disagg.router.upstream import UpstreamAnswer, UpstreamClient


def _instance(path_header: str) -> str:
    fields = dict(f.strip().split("=", 1) for f in path_header.split(";")[1:] if "=" in f)
    return fields.get("instance") or fields["decode"]


def _wait(pred: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@contextlib.contextmanager
def _two_models(tiny_model: str, **overrides: Any) -> Iterator[tuple[str, str, Any]]:
    with mock_backend("alpha") as a, mock_backend("beta") as b:
        instances = [InstanceConfig(url=a, role="both", id="a"), InstanceConfig(url=b, role="both", id="b")]
        with running_proxy(a, tiny_model, instances=instances, **overrides) as rp:
            _wait(lambda: rp.proxy.served_models() == {"alpha", "beta"}, "both instances probed")
            yield a, b, rp


def test_requests_go_only_to_instances_that_serve_their_model_lora_adapters_included(tiny_model: str) -> None:
    with _two_models(tiny_model) as (a, _b, rp):
        for model, where in (("alpha", "a"), ("beta", "b")) * 3:
            body = {"model": model, "prompt": "hello there", "max_tokens": 2, "stream": True}
            r = httpx.post(rp.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert _instance(r.headers["x-disagg-path"]) == where
        models = httpx.get(rp.url + "/v1/models", timeout=10).json()
        assert sorted(m["id"] for m in models["data"]) == ["alpha", "beta"]  # the union, once each
        r = httpx.post(rp.url + "/v1/completions", json={"model": "gamma", "prompt": "x"}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        # An adapter loaded on "a" after registration: served there once a probe has seen it (every 0.5 s here).
        assert httpx.post(
            a + "/v1/load_lora_adapter", json={"lora_name": "alpha-sql", "lora_path": "/x"}
        ).is_success
        _wait(lambda: "alpha-sql" in rp.proxy.served_models(), "the probe never saw the adapter")
        body = {"model": "alpha-sql", "prompt": "select", "max_tokens": 2}
        r = httpx.post(rp.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and _instance(r.headers["x-disagg-path"]) == "a"
        lora = next(m for m in httpx.get(rp.url + "/v1/models").json()["data"] if m["id"] == "alpha-sql")
        assert lora["parent"] == "alpha"


def test_pass_through_routes_reach_an_instance_that_serves_the_model(tiny_model: str) -> None:
    with _two_models(tiny_model) as (a, b, rp):
        for path, body, direct_url in (
            ("/v1/embeddings", {"model": "beta", "input": "hello"}, b),
            ("/tokenize", {"model": "alpha", "prompt": "four score"}, a),
            ("/detokenize", {"model": "alpha", "tokens": [5, 6]}, a),
            ("/v1/responses", {"model": "alpha", "input": "hi"}, a),
        ):
            via, direct = httpx.post(rp.url + path, json=body), httpx.post(direct_url + path, json=body)
            assert (via.status_code, via.json()) == (direct.status_code, direct.json()), (
                path
            )  # as a direct call
        r = httpx.post(rp.url + "/v1/embeddings", json={"model": "beta", "input": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["served_by"] == "beta"
        assert r.headers["x-disagg-path"] == "passthrough; instance=b"
        r = httpx.post(rp.url + "/tokenize", json={"model": "alpha", "prompt": "four score"}, timeout=10)
        assert r.status_code == 200 and r.json()["tokens"]
        r = httpx.post(rp.url + "/detokenize", json={"model": "alpha", "tokens": [1, 2]}, timeout=10)
        assert r.status_code == 200 and r.json()["prompt"] == "t1 t2"
        r = httpx.post(
            rp.url + "/v1/responses", json={"model": "beta", "input": "hi", "stream": True}, timeout=10
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert "response.completed" in r.text and '"served_by": "beta"' in r.text
        r = httpx.post(rp.url + "/v1/embeddings", json={"model": "gamma", "input": "hi"}, timeout=10)
        assert r.status_code == 404
        assert httpx.post(rp.url + "/v1/embeddings", content=b"{nope", timeout=10).status_code == 400
        assert all(i.in_flight == 0 for i in rp.proxy.registry.instances.values())
        # every answer carries the request's id, the client's when it is plain, errors and streams included
        for body, content in (
            ({"model": "alpha", "prompt": "x"}, None),
            (None, b"{nope"),
            ({"model": "z"}, None),
        ):
            sent = httpx.post(
                rp.url + "/tokenize", json=body, content=content, headers={"x-request-id": "pt-7"}, timeout=10
            )
            made = httpx.post(rp.url + "/tokenize", json=body, content=content, timeout=10)
            assert sent.headers["x-request-id"] == "pt-7", sent.status_code
            assert made.headers["x-request-id"].startswith("vd-"), made.status_code
        with httpx.stream(
            "POST",
            rp.url + "/v1/responses",
            json={"model": "alpha", "input": "hi", "stream": True},
            timeout=10,
        ) as r:
            assert r.headers["x-request-id"].startswith("vd-")


class _Recording:
    """The proxy's upstream client, telling ``seen`` the path and headers of each request it builds (the pool is a
    compiled class: its methods cannot be replaced on the instance)."""

    def __init__(self, inner: UpstreamClient, seen: Callable[[str, dict[str, str]], object]) -> None:
        self.inner, self.seen = inner, seen

    def build(self, url: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        self.seen(path, headers)
        return self.inner.build(url, method, path, body, headers)

    async def request(self, base_url: str, raw: bytes) -> UpstreamAnswer:
        return await self.inner.request(base_url, raw)

    async def post_json(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        return await self.inner.post_json(base_url, path, body, headers)

    def close(self) -> None:
        self.inner.close()

    def forget(self, base_url: str) -> None:
        self.inner.forget(base_url)

    def sweep(self) -> int:
        return self.inner.sweep()


def test_api_keys_are_checked_before_anything_else(tiny_model: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team b\nkey-from-file\n")
    with _two_models(tiny_model, api_key="k1, k2", api_key_file=str(keys)) as (_a, _b, rp):
        body = {"model": "alpha", "prompt": "hi", "max_tokens": 2}
        upstream_calls: list[str] = []
        rp.proxy.upstream = _Recording(rp.proxy.upstream, lambda path, headers: upstream_calls.append(path))
        for headers in (
            {},
            {"authorization": "Bearer nope"},
            {"authorization": "k1x", "x-request-id": "r-9"},
        ):
            r = httpx.post(rp.url + "/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"], r.text
            assert r.headers["x-request-id"] == headers.get("x-request-id", r.headers["x-request-id"])
            assert r.headers["x-request-id"].startswith(("vd-", "r-9"))  # refused, and still named
        # Checked before the body is read: garbage with no key is a 401, not a 400.
        assert httpx.post(rp.url + "/v1/completions", content=b"{nope", timeout=10).status_code == 401
        assert httpx.get(rp.url + "/v1/models", timeout=10).status_code == 401
        assert httpx.post(rp.url + "/v1/embeddings", json={"model": "alpha"}, timeout=10).status_code == 401
        # a trailing slash is not redirected to the client's own Host header (before the key check, it used to be)
        slash = httpx.post(rp.url + "/v1/embeddings/", json={}, headers={"host": "evil.example"}, timeout=10)
        assert slash.status_code == 404 and "location" not in slash.headers
        assert upstream_calls == []  # refused before any call to an instance
        for key in ("k1", "k2", "key-from-file"):
            r = httpx.post(rp.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert httpx.get(rp.url + "/health", timeout=10).status_code == 200  # probes need no key
        metrics = httpx.get(rp.url + "/metrics", timeout=10).text
        assert re.search(r"vllm_disagg_rejected_total\{reason=\"unauthorized\"\} 6.0", metrics), metrics[
            -3000:
        ]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https(tiny_model: str, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    with mock_backend("alpha") as a:
        settings = ProxySettings(
            instances=[InstanceConfig(url=a, role="both")],
            tokenizer=tiny_model,
            ssl_certfile=str(cert),
            ssl_keyfile=str(key),
            health_interval_s=0.5,
        )
        with _served(settings) as (port, _stop):
            url = f"https://127.0.0.1:{port}"
            trust = ssl.create_default_context(cafile=str(cert))
            _wait(lambda: httpx.get(url + "/health", verify=trust).status_code == 200, "healthy over https")
            body = {"model": "alpha", "prompt": "hi", "max_tokens": 3, "stream": True}
            r = httpx.post(url + "/v1/completions", json=body, verify=trust, timeout=30)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not spoken


@contextlib.contextmanager
def _served(settings: ProxySettings) -> Iterator[tuple[int, Any]]:
    """The proxy on its own server in a thread; yields its port and a function that starts its shutdown."""
    proxy = build_proxy(settings)
    ready: list[int] = []
    holder: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            holder["loop"] = asyncio.get_running_loop()
            holder["stop"] = asyncio.Event()
            await proxy_server.serve(proxy, "127.0.0.1", 0, stop=holder["stop"], on_ready=ready.append)

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _wait(lambda: bool(ready), "the proxy did not start")

    def stop() -> None:
        with contextlib.suppress(RuntimeError):  # already stopped: its loop is closed
            holder["loop"].call_soon_threadsafe(holder["stop"].set)

    try:
        yield ready[0], stop
    finally:
        stop()
        thread.join(20)


class _Stream:
    """A streamed completion from the mock backend (a chunk every 0.1 s) read on a thread; it has begun when this
    returns."""

    def __init__(self, url: str, max_tokens: int) -> None:
        body = {
            "model": "alpha",
            "prompt": "hi",
            "max_tokens": max_tokens,
            "stream": True,
            "mock_chunk_delay_s": 0.1,
        }
        self.pieces: list[str] = []
        self.status = 0
        started = threading.Event()

        def read() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                self.status = r.status_code
                for piece in r.iter_text():
                    self.pieces.append(piece)
                    started.set()

        self._thread = threading.Thread(target=read)
        self._thread.start()
        assert started.wait(30), "the stream never began"

    def join(self) -> str:
        """Everything the client read, once the stream ended (whole or cut)."""
        self._thread.join(30)
        return "".join(self.pieces)


@contextlib.contextmanager
def _draining_proxy(tiny_model: str, **drain: float) -> Iterator[tuple[str, Callable[[], None]]]:
    """A served proxy over one mock backend, healthy; ``stop`` begins its shutdown (``drain``: its delay and grace)."""
    with mock_backend("alpha") as a:
        settings = ProxySettings(
            instances=[InstanceConfig(url=a, role="both")],
            tokenizer=tiny_model,
            health_interval_s=0.5,
            **drain,
        )
        with _served(settings) as (port, stop):
            url = f"http://127.0.0.1:{port}"
            _wait(lambda: httpx.get(url + "/health").status_code == 200, "healthy")
            yield url, stop


def test_shutdown_flips_health_then_lets_streams_finish(tiny_model: str) -> None:
    """On shutdown /health answers 503 at once (load balancers stop sending), new requests still work for
    drain_delay_s, then the listener closes; a stream under way finishes whole."""
    with _draining_proxy(tiny_model, drain_delay_s=3.0, shutdown_grace_s=20) as (url, stop):
        stream = _Stream(url, max_tokens=20)
        stop()
        _wait(lambda: httpx.get(url + "/health").status_code == 503, "health never flipped")
        assert httpx.get(url + "/health").json()["status"] == "draining"
        text = stream.join()
        assert stream.status == 200
        assert text.count("data: ") == 21 and text.endswith("data: [DONE]\n\n")
        _wait(lambda: _refused(url), "the listener never closed", timeout=10)


def test_a_stream_cut_at_the_end_of_the_shutdown_grace_ends_with_an_error_event(tiny_model: str) -> None:
    """A stream still under way when the shutdown grace ends is cut; its client gets an OpenAI-shaped error event
    and [DONE] after the last whole event, so it cannot take the tokens so far for a whole answer."""
    with _draining_proxy(tiny_model, drain_delay_s=0.2, shutdown_grace_s=1.0) as (url, stop):
        stream = _Stream(url, max_tokens=200)
        stop()
        events = stream.join().split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
        error = json.loads(events[-3].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shut down and cut this stream" in error["message"]
        tokens = [json.loads(e.removeprefix("data: ")) for e in events[:-3]]
        assert 0 < len(tokens) < 200 and all("choices" in t for t in tokens)  # whole events before it


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_one_log_line_per_request_in_json_mode_none_at_info_in_text(
    tiny_model: str, fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_disagg.router.logs import JsonFormatter

    with mock_backend("alpha") as a, running_proxy(a, tiny_model, log_format=fmt) as rp:
        caplog.set_level(logging.INFO, logger="vllm_disagg.proxy")
        body = {"model": "alpha", "prompt": "hi", "max_tokens": 2, "stream": True}
        r = httpx.post(rp.url + "/v1/completions", json=body, headers={"x-request-id": "req-42"}, timeout=30)
        assert r.status_code == 200
        _wait(
            lambda: any(getattr(x, "event", "") == "request_done" for x in caplog.records) or fmt == "text",
            "log",
        )
        done = [x for x in caplog.records if getattr(x, "event", "") == "request_done"]
    if fmt == "text":
        assert not done  # at DEBUG in text mode: no line per request in a default log
        return
    (record,) = done
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "req-42" and line["ok"] is True and line["level"] == "info"
    assert line["mode"] == "colocated" and line["decode"] and line["e2e_s"] > 0 and line["ttft_s"] > 0
    assert line["output_tokens"] == 2 and line["fallbacks"] == []


def test_a_traced_request_is_one_trace_from_the_client_through_both_legs(tiny_model: str) -> None:
    """With tracing on, a transfer request is a server span under the client's traceparent, with intake, plan,
    prefill_leg, decode_leg and relay children; each leg sent the instance a traceparent of its own span."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_disagg.router.tracing import make_tracing

    exporter = InMemorySpanExporter()
    with mock_backend("alpha") as p_url, mock_backend("alpha") as d_url:
        instances = [
            InstanceConfig(url=p_url, role="prefill", id="p"),  # sequential flow: prefill answers first
            InstanceConfig(url=d_url, role="decode", id="d"),
        ]
        with running_proxy(p_url, tiny_model, instances=instances, policy="always-transfer") as rp:
            rp.proxy.tracing = make_tracing(None, exporter)
            sent: list[dict[str, str]] = []
            rp.proxy.upstream = _Recording(
                rp.proxy.upstream, lambda path, headers: sent.append(dict(headers))
            )
            trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
            headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
            body = {"model": "alpha", "prompt": "hello there", "max_tokens": 3, "stream": True}
            r = httpx.post(rp.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200 and r.headers["x-disagg-path"].startswith("transfer"), r.headers
            _wait(lambda: len(exporter.get_finished_spans()) >= 6, "spans never finished")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"proxy.request", "intake", "plan", "prefill_leg", "decode_leg", "relay"} <= set(spans)
    root = spans["proxy.request"]
    assert f"{root.context.trace_id:032x}" == trace_id  # joined the client's trace
    assert root.parent is not None and f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"
    for name in ("intake", "plan", "prefill_leg", "decode_leg", "relay"):
        assert spans[name].parent is not None and spans[name].parent.span_id == root.context.span_id, name
    assert spans["plan"].attributes["mode"] == "transfer"
    legs = {f"{spans[n].context.span_id:016x}" for n in ("prefill_leg", "decode_leg")}
    carried = {h["traceparent"].split("-")[2] for h in sent if "traceparent" in h}
    assert carried == legs and all(h["traceparent"].split("-")[1] == trace_id for h in sent)
    assert spans["relay"].attributes["outcome"] == "done"


def test_sigterm_during_20_streams_finishes_them_refuses_new_ones_and_exits(tiny_model: str) -> None:
    """`vllm-disagg proxy --log-format json` as its own process: SIGTERM while 20 streams run. All 20 finish whole,
    /health says draining, new connections are refused once the drain delay is over, the process exits 0 with no
    connection to the backend left open, and every line it logged is a JSON object (20 of them request_done)."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    from vllm_disagg.tools.harness import ProxyServer

    with mock_backend("alpha") as a:
        args = ["--both", a, "--tokenizer", tiny_model, "--log-format", "json", "--drain-delay-s", "1"]
        proxy = ProxyServer("unused", args=args, name="drain-proxy")
        with proxy:
            assert proxy.proc is not None and proxy.log_path is not None
            body = {
                "model": "alpha",
                "prompt": "hi",
                "max_tokens": 20,
                "stream": True,
                "mock_chunk_delay_s": 0.1,
            }
            with ThreadPoolExecutor(20) as pool:
                streams = [
                    pool.submit(httpx.post, proxy.url + "/v1/completions", json=body, timeout=60)
                    for _ in range(20)
                ]
                _wait(lambda: "vllm_disagg_worker_requests_total" in httpx.get(proxy.url + "/metrics").text
                      and _taken(proxy.url) >= 20, "20 streams never started")  # fmt: skip
                os.kill(proxy.proc.pid, signal.SIGTERM)
                _wait(lambda: _health(proxy.url) == 503, "health never flipped to draining")
                answers = [f.result() for f in streams]
            assert [r.status_code for r in answers] == [200] * 20
            assert all(r.text.count("data: ") == 21 and r.text.endswith("data: [DONE]\n\n") for r in answers)
            _wait(lambda: _refused(proxy.url), "new connections still accepted")
            assert proxy.proc.wait(30) == 0
            backend_port = int(a.rsplit(":", 1)[1])
            owners = {
                c.pid for c in psutil.net_connections("tcp") if c.raddr and c.raddr.port == backend_port
            }
            assert proxy.proc.pid not in owners
            lines = [ln for ln in proxy.log_path.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line parses
    assert sum(r.get("event") == "request_done" for r in records) == 20
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    said = [r["message"] for r in records]  # each shutdown phase is in the log (it said nothing)
    assert any(m.startswith("proxy stopping: /health answers 503") and "20 requests" in m for m in said), said
    assert any(m.startswith("proxy draining: no new connections") for m in said), said
    assert "proxy stopped: every answer under way finished" in said


def _taken(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(ln.split()[-1])
        for ln in metrics.splitlines()
        if ln.startswith("vllm_disagg_worker_requests_total")
    )


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_a_client_request_id_is_repeated_only_when_it_is_plain(tiny_model: str) -> None:
    """x-request-id goes into the answer, the logs and both legs: one with a byte a log viewer takes for a line break
    (NEL, 0x85), or 60 KB long, is replaced by an id the proxy makes; a plain one is kept."""
    with mock_backend("alpha") as a, running_proxy(a, tiny_model) as rp:
        body = {"model": "alpha", "prompt": "hi", "max_tokens": 2}
        for sent, kept in (("req-42", True), ("req\x85WARNING forged", False), ("r" * 60_000, False)):
            r = httpx.post(
                rp.url + "/v1/completions",
                json=body,
                headers={"x-request-id": sent.encode("latin-1")},
                timeout=30,
            )
            assert r.status_code == 200
            assert (r.headers["x-request-id"] == sent) is kept
            if not kept:
                assert r.headers["x-request-id"].startswith("vd-")
