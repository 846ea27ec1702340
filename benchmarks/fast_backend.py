"""A very cheap fake vLLM OpenAI server for router-overhead benchmarks (asyncio + uvloop + httptools, raw HTTP/1.1).

    python benchmarks/fast_backend.py --port PORT [--model NAME] [--side PORT] [--max-model-len N]

Unlike ``mock_backend.py`` (Starlette + uvicorn, which the tests drive with failure knobs), this one costs a few
tens of microseconds per request, so two of them and a load generator on one core can feed a router at thousands
of requests per second. It serves what the proxy and vllm-router read from vLLM:

* ``GET /health``, ``GET /v1/models`` (with ``max_model_len``), ``GET /metrics`` (vLLM's load gauges at 0),
  ``POST /tokenize``, ``GET /mock/stats`` (requests per route and per kind, to check what a router sent);
* ``POST /v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` SSE chunks (one HTTP chunk and one
  ``write`` each), a last chunk with ``finish_reason``, a usage chunk when ``stream_options.include_usage``, then
  ``data: [DONE]``; or one JSON answer with ``usage`` (``prompt_tokens_details.cached_tokens``);
* a prefill leg (``kv_transfer_params.do_remote_decode``): a non-streamed one-token answer with usage and
  ``kv_transfer_params`` naming the transfer id and this instance's side channel (``remote_host``/``remote_port``),
  as vLLM with DisaggConnector answers; a decode leg (``do_remote_prefill``) streams like any request;
* ``--side PORT``: a ZMQ side channel that answers the proxy's ``Describe`` with a KV geometry (the tiny model's),
  so the proxy accepts this instance as a transfer source and plans transfers to it.

Streams of at least ``--gap-min-tokens`` tokens space their chunks ``--gap-ms`` apart, as a real decode does, so a
router receives (and relays) every chunk on its own read: the long-stream cell measures per-chunk relay cost.
Short streams write their chunks back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sys
import threading
import time
from typing import Any, cast

import httptools
import msgspec

_DECODER = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder().encode
_STATUS = {200: b"200 OK", 400: b"400 Bad Request", 404: b"404 Not Found"}


class Backend:
    def __init__(
        self, model: str, max_model_len: int, side_port: int | None, gap_ms: float, gap_min_tokens: int
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.side_port = side_port
        self.gap_s = gap_ms / 1000
        self.gap_min_tokens = gap_min_tokens
        self.stats: collections.Counter[str] = collections.Counter()
        self.created = int(time.time())
        self._models = _ENCODE(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "vllm",
                        "root": model,
                        "max_model_len": max_model_len,
                    }
                ],
            }
        )
        self._metrics = (
            b"# TYPE vllm:num_requests_waiting gauge\n"
            b'vllm:num_requests_waiting{model_name="' + model.encode() + b'"} 0.0\n'
            b"# TYPE vllm:num_requests_running gauge\n"
            b'vllm:num_requests_running{model_name="' + model.encode() + b'"} 0.0\n'
            b"# TYPE vllm:kv_cache_usage_perc gauge\n"
            b'vllm:kv_cache_usage_perc{model_name="' + model.encode() + b'"} 0.0\n'
        )
        self._chunk_cache: dict[tuple[bool, int, tuple[int, int] | None], list[bytes]] = {}

    # -- answers -------------------------------------------------------------------------------------------------

    def stream_chunks(self, chat: bool, n: int, usage: dict[str, Any] | None) -> list[bytes]:
        """The HTTP chunks (already chunk-framed) of a streamed answer of ``n`` tokens."""
        key = (
            chat,
            n,
            None
            if usage is None
            else (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]),
        )
        cached = self._chunk_cache.get(key)
        if cached is not None:
            return cached
        obj = "chat.completion.chunk" if chat else "text_completion"
        events: list[bytes] = []
        head = {"id": "cmpl-mock", "object": obj, "created": self.created, "model": self.model}
        for i in range(n):
            last = i == n - 1
            if chat:
                delta: dict[str, Any] = {"content": f" t{i}"}
                if i == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
            else:
                choice = {"index": 0, "text": f" t{i}", "logprobs": None}
            choice["finish_reason"] = "length" if last else None
            choice["stop_reason"] = None
            events.append(b"data: " + _ENCODE({**head, "choices": [choice]}) + b"\n\n")
        if usage is not None:
            events.append(b"data: " + _ENCODE({**head, "choices": [], "usage": usage}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        framed = [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
        if len(self._chunk_cache) < 256:
            self._chunk_cache[key] = framed
        return framed

    def complete(self, body: dict[str, Any], chat: bool, n: int, usage: dict[str, Any]) -> dict[str, Any]:
        text = "".join(f" t{i}" for i in range(n))
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason="length", stop_reason=None)
        answer: dict[str, Any] = {
            "id": "cmpl-mock",
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):
            # A prefill leg, answered as vLLM with DisaggConnector/NIXL does: where decode loads the KV from.
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": params.get("transfer_id"),
                "remote_engine_id": f"mock-{os.getpid()}",
                "remote_block_ids": [0],
                "remote_host": "127.0.0.1",
                "remote_port": self.side_port or 9,
                "tp_size": 1,
            }
        return answer


def _prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt) or 1
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) // 4 + 1
    return 1


class HttpServerProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. Requests are answered in order; a spaced stream holds later ones."""

    def __init__(self, app: Backend) -> None:
        self.app = app
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.keep_alive = True
        self.queue: collections.deque[tuple[bytes, bytes, bytes, bool]] = collections.deque()
        self.busy = False

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write(400, b"text/plain", b"bad request")
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        req = (method, self.url, b"".join(self.body), self.parser.should_keep_alive())
        if self.busy:
            self.queue.append(req)
        else:
            self._handle(*req)

    # answers
    def _write(self, status: int, ctype: bytes, payload: bytes, extra: bytes = b"") -> None:
        if self.transport is None:
            return
        self.transport.write(
            b"HTTP/1.1 %b\r\ncontent-type: %b\r\ncontent-length: %d\r\n%b\r\n%b"
            % (_STATUS.get(status, b"%d X" % status), ctype, len(payload), extra, payload)
        )

    def _json(self, obj: Any, status: int = 200) -> None:
        self._write(status, b"application/json", obj if isinstance(obj, bytes) else _ENCODE(obj))

    def _handle(self, method: bytes, url: bytes, raw: bytes, keep_alive: bool) -> None:
        app = self.app
        path = url.split(b"?", 1)[0]
        app.stats[path.decode("latin-1")] += 1
        if not keep_alive:
            self.keep_alive = False
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            self._completion(raw, chat=path == b"/v1/chat/completions")
        elif path == b"/health":
            self._write(200, b"text/plain", b"")
        elif path == b"/v1/models":
            self._json(app._models)
        elif path == b"/metrics":
            self._write(200, b"text/plain; version=0.0.4", app._metrics)
        elif path == b"/tokenize" and method == b"POST":
            body = _DECODER.decode(raw) if raw else {}
            n = _prompt_tokens(body)
            self._json({"count": n, "max_model_len": app.max_model_len, "tokens": list(range(n))})
        elif path == b"/mock/stats":
            self._json(dict(app.stats))
        else:
            self._json({"error": {"message": "not found", "type": "not_found", "code": 404}}, 404)
        if not self.busy:
            self._done()

    def _done(self) -> None:
        if not self.keep_alive and self.transport is not None:
            self.transport.close()
            return
        while self.queue and not self.busy:
            self._handle(*self.queue.popleft())

    def _completion(self, raw: bytes, chat: bool) -> None:
        app = self.app
        try:
            body = _DECODER.decode(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except (msgspec.DecodeError, ValueError) as exc:
            self._json({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}, 400)
            return
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        n = max(1, int(n))
        params = body.get("kv_transfer_params")
        prefill = isinstance(params, dict) and bool(params.get("do_remote_decode"))
        remote = isinstance(params, dict) and bool(params.get("do_remote_prefill"))
        if prefill:
            n = 1  # a prefill leg computes one token
        app.stats["kind:prefill" if prefill else "kind:decode" if remote else "kind:plain"] += 1
        prompt = _prompt_tokens(body)
        cached = prompt if remote else 0  # decode loaded the whole prompt's KV
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + n,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if body.get("stream") and not prefill:
            opts = body.get("stream_options")
            with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            chunks = app.stream_chunks(chat, n, usage if with_usage else None)
            if self.transport is None:
                return
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            if n >= app.gap_min_tokens and app.gap_s > 0:
                self.busy = True
                asyncio.get_running_loop().create_task(self._spaced(chunks))
                return
            write = self.transport.write
            for c in chunks:
                write(c)
            write(b"0\r\n\r\n")
            return
        self._json(app.complete(body, chat, n, usage))

    async def _spaced(self, chunks: list[bytes]) -> None:
        try:
            for c in chunks:
                if self.transport is None:
                    return
                self.transport.write(c)
                await asyncio.sleep(self.app.gap_s)
            if self.transport is not None:
                self.transport.write(b"0\r\n\r\n")
        finally:
            self.busy = False
            self._done()


def _side_channel(port: int, model: str) -> None:
    """Answer the proxy's Describe requests (a thread: ZMQ ROUTER, blocking)."""
    import zmq

    from vllm_disagg import __version__
    from vllm_disagg.kv_layout import KVGeometry
    from vllm_disagg.wire import Describe, Description, decode, encode

    # The tiny model's geometry: 4 layers, 2 KV heads of 32, float32, 128-token blocks.
    geometry = KVGeometry(
        model=model,
        num_layers=4,
        num_kv_heads=2,
        head_size=32,
        block_size=128,
        dtype="float32",
        kv_layout="NHD",
        block_bytes=2 * 128 * 2 * 32 * 4,
    )
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        identity, *frames = sock.recv_multipart()
        try:
            msg, _ = decode(frames)
        except Exception:  # noqa: BLE001 - a mock: ignore what it does not understand
            continue
        if isinstance(msg, Describe):
            answer = Description(
                engine_id=f"mock-{port}", geometry=geometry, connector_version=__version__, data_paths=["tcp"]
            )
            sock.send_multipart([identity, *encode(answer)])


async def serve(args: argparse.Namespace) -> None:
    app = Backend(args.model, args.max_model_len, args.side, args.gap_ms, args.gap_min_tokens)
    if args.side:
        threading.Thread(target=_side_channel, args=(args.side, args.model), daemon=True).start()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpServerProtocol(app), args.host, args.port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="mock")
    ap.add_argument("--max-model-len", type=int, default=1_000_000)
    ap.add_argument("--side", type=int, default=None, help="ZMQ side-channel port answering Describe")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="spacing of the chunks of long streams")
    ap.add_argument("--gap-min-tokens", type=int, default=256, help="streams this long or longer are spaced")
    args = ap.parse_args(argv)
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with contextlib.suppress(KeyboardInterrupt):
        loop.run_until_complete(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
