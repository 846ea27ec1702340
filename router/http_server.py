"""The proxy's HTTP/1.1 server: asyncio + httptools, the inference routes served without an ASGI layer.

Every request a user sends passes through here, so the per-request work is what the routes need and no more: the
parser's callbacks collect the head and body, a hot route's handler gets them as bytes, and its answer goes out in
as few ``transport.write`` calls as it has pieces (a streamed answer's head leaves with its first chunk). Every other
route (admin, metrics, models, health) is handed to an ASGI app through a small bridge, so those keep Starlette.

What a client can rely on:
  * keep-alive (HTTP/1.1's default; HTTP/1.0 with ``Connection: keep-alive``); pipelined requests answered in order;
  * bodies with ``Content-Length`` or chunked encoding, capped at ``max_body_bytes`` (the handler answers 413 and
    the connection closes); a malformed request gets a 400 and the connection closes;
  * an idle keep-alive connection closes after ``keepalive_s``; a request must arrive whole (head and body) within
    ``read_request_s`` of its first byte (else 408), its head and any framing between body bytes (chunk lines,
    trailers) within ``MAX_HEAD_BYTES`` (else 431); trailer fields are dropped, never merged into the headers;
  * at most ``max_connections`` clients at once: one more is answered 503 and closed, so file descriptors are left
    for the connections to the instances;
  * streamed answers use chunked encoding and follow the client's pace (writers wait while its socket is full); a
    client that takes nothing for ``write_stall_s`` is dropped, which ends its request like a disconnect;
  * a client that disconnects is noticed at once: the request's ``on_disconnect`` runs (the proxy aborts its legs).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import httptools

logger = logging.getLogger("vllm_disagg.proxy")

_REASONS = {
    200: b"OK",
    201: b"Created",
    204: b"No Content",
    307: b"Temporary Redirect",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    429: b"Too Many Requests",
    499: b"Client Closed Request",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
# The error ``type`` vLLM's OpenAI server names for each status it answers with; other statuses (the proxy's own
# 401, 413, 429, 502, 504, a gateway's 520) are named by their HTTP phrase, as vLLM names those it has no class for.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """An error answer's ``type``, as vLLM names it: one table for every error the proxy answers itself."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # not a registered status (a gateway's 520, say)
        return "Error"


def error_body(status: int, message: bytes) -> bytes:
    """An error answer's JSON, shaped as vLLM's (``message`` holds no double quote or backslash)."""
    return b'{"error": {"message": "%s", "type": "%s", "param": null, "code": %d}}' % (
        message,
        error_type(status).encode(),
        status,
    )


_MAX_PIPELINED = 16  # requests parsed ahead of the one being served before reading pauses
_BUSY_BODY = error_body(503, b"too many connections to the proxy; retry shortly")
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)
# a request's line and headers together (uvicorn's h11 allows 16 KiB, nginx 32): past it the request is answered 431
# and the connection closed, before the parser has buffered more than one read beyond it
MAX_HEAD_BYTES = 64 * 1024


# Chunk-size lines of HTTP/1.1 chunked encoding for the sizes a token stream's chunks have, made once: formatting
# ``%x`` per chunk was a measurable share of relaying one.
_CHUNK_HEADS = [b"%x\r\n" % n for n in range(4096)]


def chunk_frame(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    n = len(data)
    head = _CHUNK_HEADS[n] if n < 4096 else b"%x\r\n" % n
    return b"".join((head, data, b"\r\n"))


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))


class ServerRequest:
    """One parsed request: method, target, headers (lower-cased names, latin-1 text), body, disconnect hook."""

    __slots__ = (
        "method",
        "target",
        "headers",
        "raw_headers",
        "body",
        "keep_alive",
        "http_version",
        "too_large",
        "on_disconnect",
    )

    def __init__(
        self,
        method: str,
        target: bytes,
        headers: dict[str, str],
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.raw_headers = raw_headers
        self.body = body
        self.keep_alive = True
        self.http_version = "1.1"
        self.too_large = False  # the body was over max_body_bytes and was dropped
        self.on_disconnect: Callable[[], None] | None = None

    @property
    def path(self) -> str:
        return self.target.split(b"?", 1)[0].decode("latin-1")


HotHandler = Callable[[ServerRequest, "Connection"], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection; its requests are served one at a time, in arrival order, by one task."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.last_active = time.monotonic()
        self.peer: Any = None
        self.sockname: Any = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._discard = False  # an oversized request is being answered: the rest of its bytes are ignored
        self._in_head = True  # the parser is inside a request's line and headers
        self._framing = 0  # bytes past the head received without body progress (chunk lines, trailers)
        self._progress = False  # the last read carried body bytes or ended the request
        self._began = 0.0  # when the request being received began (0: none)
        # bytes received since that head began (at most one read more than the head itself)
        self._head_seen = 0
        self._raw_body = False  # the current streamed answer goes unframed (HTTP/1.0: no chunked encoding)
        self._no_body = False  # the current request is HEAD: its answer is the head alone
        self._queue: collections.deque[ServerRequest] = collections.deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.current: ServerRequest | None = None
        self._paused = False  # the client's socket buffer is full: writers wait on _drain
        self._paused_since = 0.0
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._head: bytes | None = None  # a streamed answer's head, sent with its first chunk
        self.started = False  # the current request's answer has begun
        self._ended = False  # the current streamed answer has ended
        self._sse = False  # the current streamed answer is an OpenAI event stream (see ``cut``)
        # its last chunk written (an answer cut at shutdown ends on an event boundary)
        self._last: bytes = b""
        self._keep_alive = True

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task serving this connection's requests (the one that runs the route handlers)."""
        return self._task

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        self.peer = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")
        server = self.server
        if len(server.connections) >= server.max_connections:
            self.closed = True
            transport.write(_BUSY)  # type: ignore[attr-defined]
            transport.close()
            logger.warning(
                "refused a connection from %s: %d clients connected (the cap: --max-connections)",
                self.peer, len(server.connections),
            )  # fmt: skip
            return
        server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._discard:
            return
        in_head = self._in_head
        if in_head:
            self._head_seen += len(data)
        self._progress = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, b"protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._fail(400, b"malformed HTTP request: " + str(exc).encode("latin-1", "replace"))
        else:
            if self._in_head and self._head_seen > MAX_HEAD_BYTES:
                # the parser buffers a head until it ends (and copies what it holds on every read): no head is
                # let grow without bound, and no API key is needed to send one
                self._fail(431, b"request line and headers over %d bytes" % MAX_HEAD_BYTES)
            elif not in_head and not self._in_head:
                # past the head: a read with no body bytes is framing, and the parser buffers a trailer as it does
                # a header
                self._framing = 0 if self._progress else self._framing + len(data)
                if self._framing > MAX_HEAD_BYTES:
                    self._fail(431, b"chunk framing or trailers over %d bytes" % MAX_HEAD_BYTES)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._queue.clear()
        if self.current is not None and self.current.on_disconnect is not None:
            self.current.on_disconnect()
        for fut in (self._drain, self._wakeup):
            if fut is not None and not fut.done():
                fut.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True
        self._paused_since = time.monotonic()

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._began = time.monotonic()
        self._framing = 0
        self._url = b""
        self._headers = {}
        self._raw_headers = []
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer field: dropped (an API key or request id sent there is not the request's)
        key = name.lower()
        self._raw_headers.append((key, value))
        k, v = key.decode("latin-1"), value.decode("latin-1")
        prev = self._headers.get(k)
        self._headers[k] = v if prev is None else f"{prev}, {v}"

    def on_headers_complete(self) -> None:
        self._in_head = False
        declared = self._headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.server.max_body_bytes:
            self._oversized()
        elif (
            self._headers.get("expect", "").lower() == "100-continue"
            and self.current is None
            and not self._queue
            and self.transport is not None
            and self.parser.get_http_version() == "1.1"
        ):
            # The client waits for this before sending the body (curl: 1 s). Only between answers: an interim
            # answer must not land inside another request's.
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._progress = True
        if self._discard:
            return
        self._size += len(body)
        if self._size > self.server.max_body_bytes:
            self._oversized()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_head, self._head_seen = True, 0
        self._progress, self._began = True, 0.0
        if self._discard:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = ServerRequest(
            self.parser.get_method().decode("latin-1"), self._url, self._headers, self._raw_headers, body
        )
        req.keep_alive = self.parser.should_keep_alive()
        req.http_version = self.parser.get_http_version()
        self._enqueue(req)

    def _oversized(self) -> None:
        """A body over the cap: answer at once (the handler says 413) and ignore whatever else arrives; the
        connection closes after the answer."""
        req = ServerRequest(
            self.parser.get_method().decode("latin-1"), self._url, self._headers, self._raw_headers, b""
        )
        req.too_large = True
        req.keep_alive = False
        req.http_version = self.parser.get_http_version()
        self._discard = True
        self._body = []
        self._enqueue(req)

    def _enqueue(self, req: ServerRequest) -> None:
        self._queue.append(req)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_loop())
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        if len(self._queue) > _MAX_PIPELINED and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    # -- serving

    async def _serve_loop(self) -> None:
        loop = asyncio.get_running_loop()
        server = self.server
        while not self.closed:
            if self._paused:
                # earlier answers wait in the client's socket: none more until it reads them
                await self.drain()
                continue
            if not self._queue:
                if self._reading_paused and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
                continue
            req = self._queue.popleft()
            self.current = req
            self.started = False
            self._head = None
            self._no_body = req.method == "HEAD"
            self._keep_alive = req.keep_alive and not server.shutting_down
            try:
                path = req.path
                routes = server.routes.get(req.method)
                hot = routes.get(path) if routes is not None else None
                if hot is not None:
                    await hot(req, self)
                else:
                    await server.bridge(req, self, path)
            except asyncio.CancelledError:
                if server.shutting_down or self.closed:
                    self._close()
                    return
                raise
            except Exception:
                logger.exception("%s %s: unhandled error serving the request", req.method, req.path)
                if not self.started and not self.closed:
                    self._keep_alive = False
                    self.respond(
                        500,
                        [(b"content-type", b"application/json")],
                        error_body(500, b"internal proxy error (see the proxy log)"),
                    )
                self._close()
                return
            finally:
                self.current = None
                self._no_body = self._raw_body = False
            self.last_active = time.monotonic()
            if not self._keep_alive:
                self._close()
                return

    def _fail(self, status: int, message: bytes) -> None:
        """A request that cannot be parsed: answer it (unless an answer is under way) and close, ignoring whatever
        else arrives meanwhile."""
        self._discard = True
        if self.closed:
            return
        if self.current is None and self.transport is not None:
            body = error_body(status, message.replace(b"\\", b"\\\\").replace(b'"', b"'"))
            self._keep_alive = False
            self.respond(status, [(b"content-type", b"application/json")], body)
        self._close()

    def _close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()  # what is written still goes out: a client stuck on it is dropped at the stall

    # -- answering (the current request)

    def _head_bytes(self, status: int, headers: list[tuple[bytes, bytes]], extra: bytes) -> bytes:
        parts = [status_line(status)]
        parts.extend(b"%s: %s\r\n" % (k, v) for k, v in headers)
        parts.append(self.server.date_header)
        if not self._keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(extra)
        return b"".join(parts)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer in one write (the head alone for HEAD, with the length a GET's body would have)."""
        self.started = True
        if self.transport is None or self.closed:
            return
        head = self._head_bytes(status, headers, b"content-length: %d\r\n\r\n" % len(body))
        self.transport.write(head if self._no_body else head + body)

    def start_stream(
        self, status: int, headers: list[tuple[bytes, bytes]], openai_events: bool = False
    ) -> None:
        """Begin a streamed answer; its head is written with the first chunk. Chunked for HTTP/1.1; an HTTP/1.0
        client may not be sent chunked encoding, so its answer goes unframed and ends when the connection closes.
        ``openai_events``: an OpenAI completions stream (``data:`` events ending in ``[DONE]``), which ``cut`` may
        end with an error event."""
        self.started = True
        self._ended = False
        self._sse = openai_events
        self._last = b""
        self._raw_body = self.current is not None and self.current.http_version == "1.0"
        if self._raw_body:
            self._keep_alive = False
            self._head = self._head_bytes(status, headers, b"\r\n")
        else:
            self._head = self._head_bytes(status, headers, b"transfer-encoding: chunked\r\n\r\n")
        if self._no_body and self.transport is not None and not self.closed:
            self.transport.write(self._head)
            self._head = None
            self._ended = True

    def write(self, data: bytes) -> None:
        """One chunk of a streamed answer (empty data writes nothing: an empty chunk would end the answer)."""
        if not data or self._ended or self.closed or self.transport is None:
            return
        frame = data if self._raw_body else chunk_frame(data)
        if self._head is not None:
            frame = self._head + frame
            self._head = None
        self._last = data
        self.transport.write(frame)

    def cut(self, event: bytes) -> bool:
        """End a streamed OpenAI event answer with ``event`` and ``[DONE]``, when what was written so far
        ends on an event boundary (an event written into the middle of an instance's would corrupt both). Whether
        it did: a client that reads the error event can tell a cut answer from a complete one."""
        if not self._sse or self._ended or self.current is None or not self.started:
            return False
        if self._last and not self._last.endswith(b"\n\n"):
            return False
        if b"data: [DONE]" in self._last:  # the answer is whole; only its end did not go out
            self.end(b"")
            return False
        self.end(b"data: %b\n\ndata: [DONE]\n\n" % event)
        return True

    @property
    def paused(self) -> bool:
        return self._paused

    async def drain(self) -> None:
        """Wait until the client's socket takes more (after a write while ``paused``)."""
        if self._paused and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain
            self._drain = None

    def end(self, data: bytes) -> None:
        """The last chunk and the end of the answer, in one write; later writes are dropped."""
        if self._ended or self.closed or self.transport is None:
            return
        if self._raw_body:
            frame = data
        else:
            frame = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        if self._head is not None:
            frame = self._head + frame
            self._head = None
        self._ended = True
        self.transport.write(frame)

    def end_stream(self) -> None:
        self.end(b"")


def shutdown_cut_event(grace_s: float) -> bytes:
    """The error event a stream still under way at the end of the shutdown grace ends with (OpenAI-shaped, as
    vLLM writes an error into a stream), so that its client does not take the tokens so far for a whole answer."""
    message = (
        b"the proxy shut down and cut this stream after its shutdown grace (%s s): the answer is incomplete; "
        b"send the request again"
    )
    return error_body(503, message % f"{grace_s:g}".encode())


def default_max_connections() -> int:
    """Half the file descriptors this process may open (raised to the hard limit where allowed): the other half
    is for the connections to the instances, KV-event sockets and files."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
        if soft == resource.RLIM_INFINITY:
            return 1 << 20
        return max(16, soft // 2)
    except ImportError:  # not a POSIX host
        return 1 << 20


class HttpServer:
    """Listens, tracks connections, closes idle ones, and shuts down without cutting answers short."""

    def __init__(
        self,
        hot_routes: dict[str, HotHandler],
        asgi_app: Any,
        *,
        max_body_bytes: int,
        keepalive_s: float = 5.0,
        get_routes: dict[str, HotHandler] | None = None,
        write_stall_s: float = 600.0,
        read_request_s: float = 60.0,
        max_connections: int | None = None,
    ) -> None:
        # method -> path -> handler: routes served here, not through the ASGI app (POST: the inference routes; GET: a
        # load balancer's health probe)
        self.routes: dict[str, dict[str, HotHandler]] = {"POST": hot_routes, "GET": get_routes or {}}
        self.asgi_app = asgi_app
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.write_stall_s = write_stall_s
        self.read_request_s = read_request_s
        self.max_connections = max_connections if max_connections is not None else default_max_connections()
        self.connections: set[Connection] = set()
        self.shutting_down = False
        self.scheme = "http"
        self.date_header = b""
        self._servers: list[asyncio.base_events.Server] = []
        self._ticker: asyncio.Task[None] | None = None
        self._tick()

    def _tick(self) -> None:
        self.date_header = b"date: %s\r\n" % email.utils.formatdate(usegmt=True).encode()

    async def _housekeeping(self) -> None:
        """Once a second: refresh the Date header, close keep-alive connections idle past ``keepalive_s``, and drop
        clients that took nothing of an answer for ``write_stall_s`` (their request, its slot and its instance's
        counts would otherwise be held for as long as they keep the connection open)."""
        while True:
            await asyncio.sleep(1.0)
            self._tick()
            now = time.monotonic()
            cutoff = now - self.keepalive_s
            stalled = now - self.write_stall_s
            late = now - self.read_request_s
            for conn in list(self.connections):
                if conn._paused and conn._paused_since < stalled and conn.transport is not None:
                    logger.warning(
                        "client %s took nothing of its answer for %g s; dropping the connection",
                        conn.peer, self.write_stall_s,
                    )  # fmt: skip
                    conn.transport.abort()  # close() would wait for the buffer the client never reads
                elif conn.current is None and not conn._paused and 0.0 < conn._began < late:
                    # a request trickled in (a byte every few seconds keeps a connection from being idle)
                    conn._fail(408, b"the request did not arrive whole within %g s" % self.read_request_s)
                elif (
                    conn.current is None
                    and not conn._queue
                    and not conn._paused
                    and conn.last_active < cutoff
                ):
                    conn._close()

    async def listen(
        self,
        host: str,
        port: int,
        *,
        sock: socket.socket | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.scheme = "https" if ssl_context is not None else "http"
        if sock is not None:
            server = await loop.create_server(
                lambda: Connection(self), sock=sock, ssl=ssl_context, backlog=2048
            )
        else:
            server = await loop.create_server(
                lambda: Connection(self), host, port, ssl=ssl_context, backlog=2048, reuse_address=True
            )
        self._servers.append(server)
        if self._ticker is None:
            self._ticker = loop.create_task(self._housekeeping())

    def port(self) -> int:
        """The port the first listener is bound to (useful with port 0)."""
        # read untyped: uvloop's is a list where typeshed says tuple, which a compiled (mypyc) caller would reject
        sockets: list[Any] = list(getattr(self._servers[0], "sockets")) if self._servers else []  # noqa: B009
        return int(sockets[0].getsockname()[1]) if sockets else 0

    async def shutdown(self, grace_s: float, cut_event: bytes = b"") -> int:
        """Stop accepting; close idle connections; give answers under way up to ``grace_s`` to finish. Returns how
        many were still under way and cut; a streamed event answer among them ends with ``cut_event`` (one SSE
        event's data, an OpenAI-style error) where it stands on an event boundary."""
        self.shutting_down = True
        for server in self._servers:
            server.close()
        deadline = time.monotonic() + grace_s
        while True:
            for conn in list(self.connections):
                if conn.current is None and not conn._queue:
                    conn._close()
            if not self.connections or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        cut = sum(1 for conn in self.connections if conn.current is not None)
        for conn in list(self.connections):
            if cut_event and conn.current is not None:
                conn.cut(cut_event)
            conn._close()
            if conn._paused and conn.transport is not None:
                conn.transport.abort()  # past the grace: not waiting on a client that is not reading
            if conn._task is not None:
                conn._task.cancel()
        if self._ticker is not None:
            self._ticker.cancel()
        return cut

    # -- everything that is not a hot route: the ASGI app

    async def bridge(self, req: ServerRequest, conn: Connection, path: str) -> None:
        if req.too_large:
            conn.respond(
                413,
                [(b"content-type", b"application/json")],
                error_body(413, b"request body too large"),
            )
            return
        raw_path, _, query = req.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": req.http_version,
            "method": req.method,
            "scheme": self.scheme,
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": req.raw_headers,
            "client": conn.peer if isinstance(conn.peer, tuple) else None,
            "server": conn.sockname if isinstance(conn.sockname, tuple) else None,
        }
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def disconnected() -> None:
            if not gone.done():
                gone.set_result(None)

        req.on_disconnect = disconnected
        body_given = False
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        sized = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers, sized
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
                headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
                sized = any(k == b"content-length" for k, _ in headers)
                if sized:
                    headers = [(k, v) for k, v in headers if k != b"content-length"]
            elif kind == "http.response.body":
                body = message.get("body", b"")
                more = message.get("more_body", False)
                if sized and not more and not conn.started:
                    conn.respond(status, headers, body)
                    return
                if not conn.started:
                    conn.start_stream(status, headers)
                conn.write(body)
                if not more:
                    conn.end_stream()
                elif conn.paused:
                    await conn.drain()

        await self.asgi_app(scope, receive, send)
        if not conn.started:
            raise RuntimeError(f"the app sent no answer to {req.method} {path}")


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket, optionally with SO_REUSEPORT so several worker processes each accept on the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock
