"""One request's exchange, in-process against a scripted upstream: the fallback ladder's rungs, what each leg
carried, and what is left behind (nothing). The same ladder runs over real sockets and real vLLM in
test_proxy_faults.py and test_fault_matrix.py; here each rung is reached deterministically."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
from starlette.responses import Response

from vllm_disagg.policy.builtin import AlwaysTransfer
from vllm_disagg.router.app import Proxy
from vllm_disagg.router.config import InstanceConfig, ProxySettings
from vllm_disagg.router.exchange import Exchange, Stream
from vllm_disagg.router.instances import Instance
from vllm_disagg.router.intake import RequestContext
from vllm_disagg.router.interrupts import Interrupts
from vllm_disagg.router.upstream import ConnectFailed, UpstreamError
from vllm_disagg.wire import Release, decode

SSE = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'


class _Answer:
    """A scripted upstream answer: status, body chunks, optionally a wait before the head (until cancelled)."""

    def __init__(self, status: int = 200, chunks: tuple[bytes, ...] = (SSE,), hang: bool = False) -> None:
        self.status_code = status
        self.headers = [(b"content-type", b"application/json")]
        self._chunks = list(chunks)
        self.hang = hang
        self.closed = False

    async def next_chunk(self) -> bytes | None:
        return self._chunks.pop(0) if self._chunks else None

    async def chunks(self) -> AsyncIterator[bytes]:
        while self._chunks:
            yield self._chunks.pop(0)

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def pipe(self, direct: Any) -> None:
        pass  # no fast path: every chunk takes the async path

    def close(self) -> None:
        self.closed = True


class _Upstream:
    """Stands in for UpstreamPool: ``script(url, body)`` returns an answer or raises an UpstreamError."""

    def __init__(self, script: Callable[[str, dict[str, Any]], _Answer]) -> None:
        self.script = script
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answers: list[_Answer] = []

    def build(self, url: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        return json.dumps({"url": url, "body": json.loads(body)}).encode()

    async def request(self, url: str, raw: bytes) -> _Answer:
        body = json.loads(raw)["body"]
        self.calls.append((url, body))
        answer = self.script(url, body)
        self.answers.append(answer)
        if answer.hang:
            try:
                await asyncio.Event().wait()  # until the exchange is interrupted
            except asyncio.CancelledError:
                answer.close()  # as UpstreamPool does: a leg cancelled before its head closes its connection
                raise
        return answer

    def close(self) -> None:
        pass

    def forget(self, base_url: str) -> None:
        pass

    def sweep(self) -> int:
        return 0


class _Sink:
    paused = False

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def end(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


def _proxy(upstream: _Upstream, *instances: tuple[str, str], **settings: Any) -> Proxy:
    cfgs = [
        InstanceConfig(url=f"http://{n}:1", role=role, id=n, side_channel=f"{n}:2") for n, role in instances
    ]  # type: ignore[arg-type]
    proxy = Proxy(ProxySettings(instances=cfgs, **settings), AlwaysTransfer())
    proxy.upstream = upstream  # type: ignore[assignment]
    for cfg in cfgs:
        proxy.registry.instances[cfg.id] = Instance(cfg=cfg, id=cfg.id, healthy=True, registered=True)
    return proxy


def _ctx(ix: Interrupts) -> RequestContext:
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}
    return RequestContext(
        request_id="req-1",
        kind="completions",
        body=body,
        tokens=list(range(300)),
        index_keys=list(range(300)),
        prompt_tokens=300,
        max_tokens=4,
        stream=True,
        stream_tokens=4,
        headers={},
        t0=0.0,
        cached={},
        interrupts=ix,
    )


async def _serve(proxy: Proxy) -> tuple[Response | Stream, bytes, RequestContext]:
    ix = Interrupts(asyncio.current_task())
    ctx = _ctx(ix)
    resp = await Exchange(proxy, ctx, None).serve()
    sink = _Sink()
    if isinstance(resp, Stream):
        await resp.run(sink)
    return resp, sink.data, ctx


def _is_transfer(body: dict[str, Any]) -> bool:
    return "kv_transfer_params" in body


def test_a_prefill_that_cannot_be_reached_aborts_decode_and_recomputes_there() -> None:
    def script(url: str, body: dict[str, Any]) -> _Answer:
        if url == "http://p:1":
            raise ConnectFailed("p: connection refused")
        # decode's transfer leg waits for KV that never comes; its recompute leg answers
        return _Answer(hang=_is_transfer(body))

    upstream = _Upstream(script)
    proxy = _proxy(upstream, ("p", "prefill"), ("d", "decode"))
    resp, data, ctx = asyncio.run(_serve(proxy))
    assert isinstance(resp, Stream) and data == SSE
    path = dict(resp.headers)[b"x-disagg-path"].decode()
    assert path.startswith("recompute; instance=d") and "fallback=prefill_unreachable:recompute" in path
    legs = [(url, _is_transfer(body)) for url, body in upstream.calls]
    # both legs of the transfer at once (in either order), then decode alone
    assert sorted(legs[:2]) == [("http://d:1", True), ("http://p:1", True)]
    assert legs[2:] == [("http://d:1", False)]
    prefill_body = next(body for url, body in upstream.calls if url == "http://p:1")
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] and prefill_body["max_tokens"] == 1
    waiting = [a for a in upstream.answers if a.hang]
    assert (
        len(waiting) == 1 and waiting[0].closed
    )  # the decode leg waiting for KV was aborted (its connection closed)
    assert proxy.ledger.in_flight() == 0 and not proxy.legs
    assert all(i.in_flight == 0 for i in proxy.registry.instances.values())
    assert proxy.registry.get("p").failures == 1


def test_a_failed_prefill_goes_to_the_backup_prefill_first() -> None:
    decode_legs: list[str] = []

    def script(url: str, body: dict[str, Any]) -> _Answer:
        if url == "http://p0:1":
            return _Answer(status=503, chunks=(b"{}",))
        if url == "http://p1:1":
            return _Answer(chunks=(b'{"choices": [], "kv_transfer_params": null}',))
        decode_legs.append(body["kv_transfer_params"]["transfer_id"])
        return _Answer(hang=len(decode_legs) == 1)  # the first waits for p0's KV; the second gets p1's

    upstream = _Upstream(script)
    proxy = _proxy(upstream, ("p0", "prefill"), ("p1", "prefill"), ("d", "decode"))
    resp, data, _ = asyncio.run(_serve(proxy))
    assert isinstance(resp, Stream) and data == SSE
    path = dict(resp.headers)[b"x-disagg-path"].decode()
    assert "prefill=p1; decode=d" in path and "fallback=prefill_failed:backup" in path
    transfer_ids = {body["kv_transfer_params"]["transfer_id"] for _, body in upstream.calls}
    assert len(transfer_ids) == 2  # the backup attempt is a new hand-off
    assert proxy.ledger.in_flight() == 0 and not proxy.legs


@pytest.mark.parametrize("leg", ["decode", "prefill"])
def test_an_internal_error_before_the_first_token_is_relayed_not_sent_elsewhere(leg: str) -> None:
    """A 500 may be the request's own doing (vLLM's engine dies on some requests): sending the same request to the
    next instance, or recomputing it on decode, could take every instance down in turn."""
    error = b'{"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError"}}'

    def script(url: str, body: dict[str, Any]) -> _Answer:
        if url == ("http://d0:1" if leg == "decode" else "http://p:1"):
            return _Answer(status=500, chunks=(error,))
        if url.startswith("http://p"):
            return _Answer(chunks=(b"{}",))
        return _Answer(hang=leg == "prefill" and _is_transfer(body))

    upstream = _Upstream(script)
    proxy = _proxy(upstream, ("p", "prefill"), ("d0", "decode"), ("d1", "decode"))
    resp, _, ctx = asyncio.run(_serve(proxy))
    assert isinstance(resp, Response) and resp.status_code == 500 and resp.body == error
    assert {url for url, _ in upstream.calls} <= {"http://p:1", "http://d0:1"}  # d1 never tried
    assert not any(
        url == "http://d0:1" and not _is_transfer(body) for url, body in upstream.calls
    )  # no recompute
    assert ctx.fallbacks == [f"{leg}_http_500"]
    assert proxy.ledger.in_flight() == 0 and not proxy.legs
    assert all(i.in_flight == 0 and i.failures == 0 for i in proxy.registry.instances.values())


@pytest.mark.parametrize("prefill_answers", [False, True])
def test_a_prefill_leg_decode_streams_without_is_aborted_after_the_grace_period(
    prefill_answers: bool,
) -> None:
    """Decode gave up waiting for KV and recomputed while the prompt still waits in prefill's queue: the stream is
    served, and the prefill leg is aborted there rather than left to compute a prompt nobody reads. A prefill that
    answers within the grace period is left alone."""

    def script(url: str, body: dict[str, Any]) -> _Answer:
        if url == "http://p:1":
            return _Answer(chunks=(b"{}",), hang=not prefill_answers)
        return _Answer()

    upstream = _Upstream(script)
    proxy = _proxy(upstream, ("p", "prefill"), ("d", "decode"), prefill_leg_grace_s=0.05)

    async def serve_then_wait() -> tuple[Response | Stream, bytes, bool]:
        resp, data, _ = await _serve(proxy)
        await asyncio.sleep(0.2)
        prefill_answer = next(
            a for (url, _), a in zip(upstream.calls, upstream.answers, strict=True) if url == "http://p:1"
        )
        return resp, data, prefill_answer.closed  # before asyncio.run cancels what is left

    resp, data, prefill_closed = asyncio.run(serve_then_wait())
    assert isinstance(resp, Stream) and data == SSE
    assert dict(resp.headers)[b"x-disagg-path"].decode().startswith("transfer; prefill=p; decode=d")
    abandoned = proxy.metrics.prefill_legs_abandoned.labels("p")._value.get()
    assert prefill_closed and abandoned == (0 if prefill_answers else 1)
    assert proxy.ledger.in_flight() == 0 and not proxy.legs
    assert all(i.in_flight == 0 for i in proxy.registry.instances.values())


def _d0_fails(failure: str) -> Callable[[str, dict[str, Any]], _Answer]:
    """Prefill answers, decode d0 fails before its first token (503, or a reset connection), d1 streams."""

    def script(url: str, body: dict[str, Any]) -> _Answer:
        if url == "http://d0:1":
            if failure == "unreachable":
                raise UpstreamError("d0: connection reset")
            return _Answer(status=503, chunks=(b"{}",))
        if url.startswith("http://p"):
            return _Answer(chunks=(b"{}",))
        return _Answer()

    return script


@pytest.mark.parametrize("failure", ["http_503", "unreachable"])
def test_a_decode_that_fails_before_its_first_token_sends_the_request_elsewhere(failure: str) -> None:
    upstream = _Upstream(_d0_fails(failure))
    proxy = _proxy(upstream, ("p", "prefill"), ("d0", "decode"), ("d1", "decode"))
    resp, data, ctx = asyncio.run(_serve(proxy))
    assert isinstance(resp, Stream) and data == SSE
    path = dict(resp.headers)[b"x-disagg-path"].decode()
    reason = "decode_http_503" if failure == "http_503" else "decode_unreachable"
    assert "decode=d1" in path and f"fallback={reason}" in path, path
    assert ctx.fallbacks == [reason]
    assert proxy.ledger.in_flight() == 0 and not proxy.legs
    assert all(i.in_flight == 0 for i in proxy.registry.instances.values())


def test_a_stream_counts_as_running_on_its_instance_from_its_first_token_until_it_ends() -> None:
    """The load a balancer sees between /metrics probes: the proxy's own request waits until its first token, then
    runs, then leaves (vLLM's last report said nothing of it)."""
    upstream = _Upstream(lambda url, body: _Answer(chunks=(SSE[:20], SSE[20:])))
    proxy = _proxy(upstream, ("d", "both"))
    d = proxy.registry.get("d")
    d.report_load(waiting=1, running=2, kv_usage=0.1)  # another sender's 3 requests, before this one
    seen: list[tuple[int, int]] = []
    views: list[tuple[int, int, float]] = []

    class _Watching(_Sink):
        def write(self, data: bytes) -> None:
            seen.append((d.waiting_now, d.running_now))
            v = d.view(0.0)
            views.append((v.known_streams, v.shortest_stream, v.stall_sensitivity))
            super().write(data)

    async def serve() -> None:
        ix = Interrupts(asyncio.current_task())
        resp = await Exchange(proxy, _ctx(ix), None).serve()
        assert isinstance(resp, Stream)
        await resp.run(_Watching())

    asyncio.run(serve())
    assert seen and seen[0] == (1, 3)  # streaming: one more running, the queue as reported
    assert views[0] == (1, 4, 1 / 3)  # its length (max_tokens 4) is known; the others' are not
    assert (d.waiting_now, d.running_now, d.in_flight) == (1, 2, 0)  # ended: back to the report
    v = d.view(0.0)
    assert (v.known_streams, v.shortest_stream, v.stall_sensitivity) == (0, 0, 0.0)


def test_a_removed_instance_leaves_no_series_behind() -> None:
    """A deleted pod's last KV usage stayed in /metrics and in the averages autoscalers read."""
    from prometheus_client import generate_latest

    proxy = _proxy(_Upstream(lambda url, body: _Answer()), ("a", "both"), ("b", "both"))
    proxy.registry.get("a").report_load(waiting=0, running=3, kv_usage=0.9)
    proxy.export_instance_metrics()
    assert b'instance="a"' in generate_latest(proxy.metrics.registry)
    proxy.discovery.remove("a")
    proxy.export_instance_metrics()
    text = generate_latest(proxy.metrics.registry)
    assert b'instance="a"' not in text and b'instance="b"' in text
    assert b'vllm_disagg_pool_queued_prefill_tokens{pool="prefill"} 0.0' in text  # there before any transfer


@pytest.mark.parametrize("extra", [{"cache_salt": "tenant-7"}, {"model": "my-adapter"}])
def test_salted_and_adapter_requests_match_no_plain_prefix(tiny_model: str, extra: dict[str, Any]) -> None:
    """vLLM keys a salted request's blocks, or a LoRA adapter's, apart from the same tokens' plain ones: the proxy
    once counted the plain request's cached prefix for them."""
    from vllm_disagg.router.intake import admit
    from vllm_disagg.router.prefix_index import PrefixIndex

    cfg = InstanceConfig(url="http://a:1", role="both", id="a")
    proxy = Proxy(
        ProxySettings(instances=[cfg], tokenizer=tiny_model), AlwaysTransfer(), index=PrefixIndex(16)
    )
    proxy.registry.instances["a"] = inst = Instance(cfg=cfg, id="a", healthy=True, registered=True)
    inst.models = ["m", "my-adapter"]
    inst.model_cards = [{"id": "m"}, {"id": "my-adapter", "parent": "m"}]
    proxy.registry.catalog_version += 1
    prompt = "The quick brown fox jumps over the lazy dog. " * 20

    async def cached(body: dict[str, Any]) -> dict[str, int]:
        ctx = await admit(proxy, {}, json.dumps(body).encode(), "completions", Interrupts(None), 0.0)
        assert not isinstance(ctx, Response), ctx.body
        return dict(ctx.cached)

    async def run() -> tuple[dict[str, int], dict[str, int]]:
        plain = {"model": "m", "prompt": prompt, "max_tokens": 2}
        ctx = await admit(proxy, {}, json.dumps(plain).encode(), "completions", Interrupts(None), 0.0)
        assert not isinstance(ctx, Response)
        proxy.index.record_routed("a", ctx.index_keys)
        return await cached(plain), await cached({**plain, **extra})

    plain_hits, apart_hits = asyncio.run(run())
    assert plain_hits.get("a", 0) > 0 and apart_hits.get("a", 0) == 0


def test_a_whole_answer_whose_load_failed_is_reported_as_a_recompute_on_decode() -> None:
    """Prefill froze (its leg never answers); decode's load failed and it computed the prompt, saying so in its
    answer's kv_transfer_params. The client gets the answer with those params cleared, and the header, decisions,
    ledger and log say what happened instead of a transfer that did not."""
    answer = {
        "choices": [{"text": "hi"}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 1},
        "kv_transfer_params": {"disagg_load": "failed"},
    }

    def script(url: str, body: dict[str, Any]) -> _Answer:
        if url == "http://p:1":
            return _Answer(hang=True)
        return _Answer(chunks=(json.dumps(answer).encode(),))

    upstream = _Upstream(script)
    proxy = _proxy(upstream, ("p", "prefill"), ("d", "decode"))

    async def serve() -> tuple[Response | Stream, RequestContext]:
        ix = Interrupts(asyncio.current_task())
        ctx = _ctx(ix)
        ctx.body["stream"], ctx.stream = False, False
        return await Exchange(proxy, ctx, None).serve(), ctx

    resp, ctx = asyncio.run(serve())
    assert isinstance(resp, Response) and resp.status_code == 200
    path = resp.headers["x-disagg-path"]
    assert path.startswith("transfer;") and "fallback=decode_load_failed:recompute" in path
    body = json.loads(bytes(resp.body))
    assert body["kv_transfer_params"] is None and body["choices"] == answer["choices"]
    assert proxy.metrics.decisions.labels("recompute", "decode_load_failed")._value.get() == 1
    assert proxy.ledger.counts == {"failed": 1}


@pytest.mark.parametrize("failure", ["http_503", "unreachable"])
def test_a_hand_off_abandoned_after_prefill_answered_is_released_on_prefills_side_channel(
    failure: str,
) -> None:
    """Prefill's leg finished (its KV is held for decode) and decode failed before loading: closing the prefill
    connection frees nothing now, so the proxy tells prefill's side channel (a real socket here) to release that
    transfer, and only that one: the retry on d1 loads its own."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    upstream = _Upstream(_d0_fails(failure))
    proxy = _proxy(upstream, ("p", "prefill"), ("d0", "decode"), ("d1", "decode"))
    proxy.registry.instances["p"].cfg = InstanceConfig(
        url="http://p:1", role="prefill", id="p", side_channel=f"127.0.0.1:{port}"
    )

    async def scenario() -> None:
        await _serve(proxy)
        await asyncio.gather(*proxy._bg)  # the release is sent in the background

    try:
        asyncio.run(scenario())
        assert router.poll(5000), "no Release reached prefill's side channel"
        _, *frames = router.recv_multipart()
        msg, _ = decode(frames)
        assert not router.poll(300)  # one Release: the transfer d1 loaded is not touched
    finally:
        router.close()
    tids = [body["kv_transfer_params"]["transfer_id"] for url, body in upstream.calls if url == "http://d0:1"]
    assert isinstance(msg, Release) and [msg.transfer_id] == tids
    assert ("HTTP 503" if failure == "http_503" else "decode unreachable") in msg.reason, msg.reason


def test_a_bug_while_serving_is_answered_500_with_the_request_id_and_counted(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception that escapes the exchange (a bug) still gives the client an OpenAI-shaped 500 naming its request
    id, is logged with that id, and counts in vllm_disagg_requests_total (an error-rate alert reads it)."""

    def script(url: str, body: dict[str, Any]) -> _Answer:
        raise RuntimeError("a bug in the exchange")

    proxy = _proxy(_Upstream(script), ("a", "both"))
    proxy.settings.tokenizer = tiny_model
    body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 2}).encode()

    async def run() -> Response | Stream:
        return await proxy.serve({"x-request-id": "my-id-1"}, body, "completions", Interrupts(None), 0.0)

    with caplog.at_level("ERROR", logger="vllm_disagg.proxy"):
        resp = asyncio.run(run())
    assert isinstance(resp, Response) and resp.status_code == 500
    assert resp.headers["x-request-id"] == "my-id-1"
    assert "my-id-1" in json.loads(bytes(resp.body))["error"]["message"]
    # the formatted log (records may be handed on with their traceback already rendered into the text)
    assert "request my-id-1 (/v1/completions): unhandled error" in caplog.text and "Traceback" in caplog.text
    from prometheus_client import generate_latest

    text = generate_latest(proxy.metrics.registry).decode()
    assert 'vllm_disagg_requests_total{mode="none",status="5xx"} 1.0' in text
    assert proxy.active == 0  # its admission slot was given back


def test_a_request_refused_at_intake_carries_an_id_and_has_its_request_done_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Malformed JSON or an unknown model is answered by the proxy itself: the answer carries x-request-id (the
    client's, or one made up) and the per-request log has its line with the status, as every other request has."""
    proxy = _proxy(_Upstream(lambda url, body: _Answer()), ("a", "both"))
    proxy.request_log_level = logging.INFO

    async def run(headers: dict[str, str], body: bytes) -> Response | Stream:
        return await proxy.serve(headers, body, "completions", Interrupts(None), 0.0)

    with caplog.at_level("INFO", logger="vllm_disagg.proxy"):
        mine = asyncio.run(run({"x-request-id": "my-id-2"}, b"{not json"))
        made = asyncio.run(run({}, b"{not json"))
    assert (
        isinstance(mine, Response) and mine.status_code == 400 and mine.headers["x-request-id"] == "my-id-2"
    )
    assert isinstance(made, Response) and made.headers["x-request-id"].startswith("vd-")
    done = [r for r in caplog.records if getattr(r, "event", None) == "request_done"]
    assert [(r.request_id, r.status) for r in done] == [
        ("my-id-2", 400),
        (made.headers["x-request-id"], 400),
    ]


@pytest.mark.parametrize("failure", ["http_400", "unreachable"])
def test_an_unserved_request_carries_its_id_and_has_its_request_done_line(
    failure: str, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request no instance served (an instance's 4xx relayed, every instance unreachable) is answered with its
    x-request-id and logged once with its status, the instances tried and its fallbacks, as a served one is."""

    def script(url: str, body: dict[str, Any]) -> _Answer:
        if failure == "unreachable":
            raise ConnectFailed("connection refused")
        return _Answer(400, (b'{"error": {"message": "max_tokens is too large", "code": 400}}',))

    proxy = _proxy(_Upstream(script), ("a", "both"), ("b", "both"), tokenizer=tiny_model)
    proxy.request_log_level = logging.INFO
    body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 2}).encode()

    async def run() -> Response | Stream:
        return await proxy.serve({"x-request-id": "my-id-3"}, body, "completions", Interrupts(None), 0.0)

    with caplog.at_level("INFO", logger="vllm_disagg.proxy"):
        resp = asyncio.run(run())
    assert isinstance(resp, Response) and resp.headers["x-request-id"] == "my-id-3"
    assert resp.status_code == (400 if failure == "http_400" else 503), resp.status_code
    done = [r for r in caplog.records if getattr(r, "event", None) == "request_done"]
    assert [(r.request_id, r.ok, r.status) for r in done] == [("my-id-3", False, resp.status_code)]
    if failure == "unreachable":
        assert done[0].fallbacks, "the failed attempts are in the line"
        steps = [
            r.getMessage().rpartition("; ")[2] for r in caplog.records if "failed before its first" in r.msg
        ]
        assert steps == ["retrying elsewhere", "no other instance is available to try it"], steps
    assert proxy.active == 0


def test_the_retry_log_says_retrying_only_when_a_retry_follows(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Three attempts at most, and only on an instance that can decode: the log's next step says what happens."""

    def script(url: str, body: dict[str, Any]) -> _Answer:
        raise ConnectFailed("connection refused")

    instances = [("a", "both"), ("b", "both"), ("c", "both"), ("d", "both"), ("p", "prefill")]
    proxy = _proxy(_Upstream(script), *instances, tokenizer=tiny_model)
    body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 2}).encode()
    with caplog.at_level("WARNING", logger="vllm_disagg.proxy"):
        asyncio.run(proxy.serve({}, body, "completions", Interrupts(None), 0.0))
    steps = [r.getMessage().rpartition("; ")[2] for r in caplog.records if "failed before its first" in r.msg]
    assert steps[:-1] == ["retrying elsewhere"] * (len(steps) - 1) and len(steps) == 3, steps
    assert steps[-1] == "no other instance is available to try it"


def test_unknown_routes_and_methods_answer_json_as_vllm_does() -> None:
    """vLLM (FastAPI) answers an unknown route or method with {"detail": ...}; the proxy answered plain text."""
    from starlette.testclient import TestClient

    proxy = _proxy(_Upstream(lambda url, body: _Answer()), ("a", "both"))
    client = TestClient(proxy.admin_app)  # not entered: no lifespan, nothing started
    r = client.get("/v1/foo")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = client.get("/v1/completions")
    assert (
        r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"} and "POST" in r.headers["allow"]
    )
