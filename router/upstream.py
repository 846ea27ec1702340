"""The proxy's HTTP/1.1 client to its instances: keep-alive pools, a C parser (httptools), nothing else.

Every request a user sends costs one or two upstream legs, so this path is paid per request and per streamed chunk.
General-purpose clients spend most of their time on what a proxy in front of known instances never needs (cookie
jars, redirects, decompression, proxies, per-request pool bookkeeping); this one writes a prebuilt request and hands
body bytes to the caller as they arrive.

What it guarantees, because the fallback ladder relies on it:
  * ``ConnectFailed``: no connection could be made (the instance is down) — nothing was sent.
  * A pooled connection the instance closed while idle is detected when a request written on it gets no response
    byte before the connection ends; the request is then sent once more on a fresh connection (it was never read).
  * ``UpstreamTimeout``: no byte for ``read_timeout_s`` while waiting for the head or the body.
  * ``ConnectionDropped``: the connection ended before the response did (mid-body: a stream cut).
  * ``close()`` of a response not read to its end closes the connection, which is how vLLM learns to abort it;
    a response read to its end returns its connection to the pool.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """A leg could not be completed; ``str()`` says what happened, for logs and breaker reasons."""


class ConnectFailed(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class ConnectionDropped(UpstreamError):
    pass


class HTTPStatusError(UpstreamError):
    """A non-2xx answer where the caller asked for success (``UpstreamPool.post_json``)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status, self.body = status, body


class UpstreamAnswer(Protocol):
    """What an exchange reads of one upstream answer: ``UpstreamResponse``, or a test's scripted one. The exchange
    types its answers with this protocol, not the class: this module and the exchange run compiled (mypyc), which
    checks a concrete class at run time."""

    status_code: int
    headers: list[tuple[bytes, bytes]]

    async def next_chunk(self) -> bytes | None: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    def pipe(self, direct: Callable[[bytes], bool] | None) -> None: ...

    def close(self) -> None: ...


class UpstreamClient(Protocol):
    """What the proxy's request path asks of its client to the instances (``UpstreamPool``; see ``UpstreamAnswer``
    for why a protocol)."""

    def build(self, base_url: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes: ...

    def forget(self, base_url: str) -> None: ...

    def sweep(self) -> int: ...

    async def request(self, base_url: str, raw: bytes) -> UpstreamAnswer: ...

    async def post_json(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> bytes: ...

    def close(self) -> None: ...


_EOF = b""
# Body bytes queued for a reader (the client is slower than the instance) past which the connection stops reading,
# and below which it reads again: an answer for a slow client waits in the instance, not in the proxy.
QUEUED_HIGH = 256 * 1024
QUEUED_LOW = 64 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses responses into a queue of body chunks (``_EOF`` ends a response)."""

    def __init__(self, read_timeout_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.read_timeout_s = read_timeout_s
        # The loop, kept: Python 3.11's asyncio.get_running_loop() makes a getpid() system call each time.
        self.loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._last_rx = 0.0
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._head: asyncio.Future[None] | None = None
        # Called with each body chunk as it is parsed; True means it was consumed there (see UpstreamResponse.pipe).
        self.direct: Callable[[bytes], bool] | None = None
        self._direct_batch: list[bytes] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0  # bytes in _chunks
        self._reading_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._got_byte = False
        self._complete = False
        self._interim = False  # the message being parsed is a 1xx: its end is not the answer's
        self._error: UpstreamError | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self._got_byte = True
        self._last_rx = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionDropped(f"malformed HTTP response: {exc}"))
            self._close_transport()
        finally:
            self._flush_direct()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if self._complete or (self._head is None and self._waiter is None and not self._chunks):
            return
        if not self._got_byte:
            self._fail(_Stale(f"connection closed before any response byte ({exc!r})"))
        else:
            self._fail(ConnectionDropped(f"connection closed mid-response ({exc!r})"))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints) precedes the final one on the same connection:
            # taking it for the answer would hand this request's real answer to the next request sent here.
            self.headers = []
            if status == 101:  # switching protocols: never asked for, and nothing HTTP can follow
                self._fail(ConnectionDropped("upstream switched protocols (101), unasked"))
                self._close_transport()
                return
            self._interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.direct is not None and not self._chunks:
            self._direct_batch.append(body)  # handed over once this read is parsed (see _flush_direct)
            return
        self._queue(body)

    def _flush_direct(self) -> None:
        """Give ``direct`` what one read carried, joined (one call, so one write downstream, however many
        chunks the instance sent); what it declines queues for the reader."""
        if not self._direct_batch:
            return
        batch, self._direct_batch = self._direct_batch, []
        data = batch[0] if len(batch) == 1 else b"".join(batch)
        direct = self.direct
        if direct is not None and not self._chunks and direct(data):
            return  # consumed in place: no queue, no task wake-up
        self._queue(data)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._flush_direct()
        self._complete = True
        self._chunks.append(_EOF)
        self._wake()

    # -- internals
    def _queue(self, data: bytes) -> None:
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > QUEUED_HIGH and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def _taken(self, n: int) -> None:
        """``n`` queued bytes went to the reader."""
        self._queued -= n
        if self._reading_paused and self._queued < QUEUED_LOW:
            self._reading_paused = False
            # The instance's silence is counted from here: the time spent waiting on the reader is not its.
            self._last_rx = time.monotonic()
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        self._error = err
        if self._head is not None and not self._head.done():
            self._head.set_exception(err)
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(err)

    def _close_transport(self) -> None:
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    # One timer per connection, re-armed lazily from the time of the last byte: a per-chunk timeout would cost a
    # timer per chunk, and streams have thousands of chunks. It outlives the request that armed it: the next request
    # on the connection finds it armed (it re-arms from that request's own bytes), and it lapses when it fires on an
    # idle connection, so a busy keep-alive connection creates a timer once per read timeout, not per request.
    def _arm(self, at: float) -> None:
        self._timer = self.loop.call_at(at, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._complete or self.closed:
            return
        idle = time.monotonic() - self._last_rx
        if self._reading_paused:  # waiting on the reader, not the instance
            self._arm(self.loop.time() + self.read_timeout_s)
            return
        if idle < self.read_timeout_s:
            self._arm(self.loop.time() + self.read_timeout_s - idle)
            return
        self._fail(UpstreamTimeout(f"no response byte for {self.read_timeout_s:g} s"))
        self._close_transport()

    def start(self, request: bytes) -> asyncio.Future[None]:
        """Write a request; the returned future resolves when the response head arrived."""
        loop = self.loop
        self._last_rx = time.monotonic()
        if self._timer is None:
            self._arm(loop.time() + self.read_timeout_s)
        self.parser = httptools.HttpResponseParser(self)
        self._head = loop.create_future()
        self.direct = None
        self._direct_batch = []
        self._chunks.clear()
        self._queued = 0
        if self._reading_paused:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        self._waiter = None
        self._got_byte = self._complete = self._interim = False
        self._error = None
        self.status, self.headers, self.keep_alive = 0, [], True
        assert self.transport is not None
        self.transport.write(request)
        return self._head

    async def next_chunk(self) -> bytes:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self._taken(len(chunk))
        return chunk


class _Stale(ConnectionDropped):
    """A request written on a connection that was already closing: never read, safe to send again."""


class UpstreamResponse:
    """The head of an answer and its body, read as it arrives (``chunks``) or whole (``read``)."""

    def __init__(self, pool: UpstreamPool, key: str, conn: _Connection) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status_code = conn.status
        self.headers = conn.headers
        self._done = False
        self._released = False

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as the instance sends them (chunked encoding already removed). Chunks that arrived together
        come out joined: the relay then pays one write for them, and none of them waited for the others."""
        return _Chunks(self)

    def pipe(self, direct: Callable[[bytes], bool] | None) -> None:
        """Hand body chunks to ``direct`` from the protocol callback as they are parsed, before any reader wakes
        up. It returns False to decline a chunk: that one and all after it queue for ``chunks()``/``next_chunk()``
        as usual until the queue is empty again. ``chunks()`` then only wakes for declined chunks, the end of the
        body, or an error. None stops it."""
        self._conn.direct = direct

    async def next_chunk(self) -> bytes | None:
        """The next body bytes (with any that arrived together, joined, like ``chunks``), or None at the end of
        the body."""
        if self._done:
            return None
        conn = self._conn
        chunk = await conn.next_chunk()
        if not chunk:
            self._done = True
            self._release()
            return None
        return _with_ready(conn, chunk)

    async def read(self) -> bytes:
        parts = [c async for c in self.chunks()]
        return b"".join(parts)

    def close(self) -> None:
        """Done with the answer: an unfinished one closes its connection (the instance aborts the request)."""
        self._conn.direct = None
        if not self._done:
            self._done = True
            self._conn._close_transport()
        self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool._put(self._key, self._conn)


def _with_ready(conn: _Connection, chunk: bytes) -> bytes:
    """``chunk`` joined with the body chunks already queued behind it (not the end of the body)."""
    queued = conn._chunks
    if not queued or not queued[0]:
        return chunk
    parts = [chunk]
    taken = 0
    while queued and queued[0]:
        part = queued.popleft()
        taken += len(part)
        parts.append(part)
    conn._taken(taken)
    return b"".join(parts)


class UpstreamPool:
    """Keep-alive connections per instance; ``request`` sends a prebuilt request and returns the answer's head."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[str, list[_Connection]] = {}
        self._addr: dict[str, tuple[str, int, bytes]] = {}

    def _address(self, base_url: str) -> tuple[str, int, bytes]:
        addr = self._addr.get(base_url)
        if addr is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"instance URL {base_url!r}: only http://HOST[:PORT] is supported")
            port = u.port or 80
            addr = (u.hostname, port, f"{u.hostname}:{port}".encode())
            self._addr[base_url] = addr
        return addr

    def build(self, base_url: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """The request bytes: one allocation, sent as is (and once more on a stale connection)."""
        _, _, host = self._address(base_url)
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), b"host: ", host, b"\r\n"]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        if body or method == "POST":
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        head.append(body)
        return b"".join(head)

    async def request(self, base_url: str, raw: bytes) -> UpstreamResponse:
        """Send ``raw`` (from ``build``) and wait for the answer's head; see the module docstring for errors."""
        for attempt in (0, 1):
            conn = self._get(base_url)
            if conn is None:
                conn = await self._connect(base_url)
            try:
                head = conn.start(raw)
            except RuntimeError:  # uvloop: the transport closed between the pool and this write (a peer died)
                conn._close_transport()
                if conn.reused and attempt == 0:
                    continue
                raise ConnectionDropped(
                    f"{base_url}: connection closed before the request was written"
                ) from None
            try:
                await head
            except _Stale:
                conn._close_transport()
                if conn.reused and attempt == 0:
                    continue  # the instance closed this idle connection as we wrote: send once more, fresh
                raise ConnectionDropped(f"{base_url}: connection closed before any response byte") from None
            except UpstreamError as exc:
                conn._close_transport()
                raise type(exc)(f"{base_url}: {exc}") from None
            except BaseException:  # cancelled mid-request: the connection is in an unknown state
                conn._close_transport()
                raise
            return UpstreamResponse(self, base_url, conn)
        raise AssertionError("unreachable")

    async def post_json(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """POST and read the whole answer; ``HTTPStatusError`` for a non-2xx."""
        r = await self.request(base_url, self.build(base_url, "POST", path, body, headers))
        data = await r.read()
        if not 200 <= r.status_code < 300:
            raise HTTPStatusError(r.status_code, data)
        return data

    async def get(self, base_url: str, path: str) -> tuple[int, bytes]:
        """GET and read the whole answer, whatever its status: (status, body)."""
        r = await self.request(base_url, self.build(base_url, "GET", path, b"", {}))
        try:
            return r.status_code, await r.read()
        finally:
            r.close()

    async def _connect(self, base_url: str) -> _Connection:
        host, port, _ = self._address(base_url)
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self.read_timeout_s, loop), host, port),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise ConnectFailed(f"{base_url}: connect timed out after {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{base_url}: cannot connect ({exc.strerror or exc})") from None
        return conn

    def _get(self, key: str) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not self._reusable(conn, now):
                conn._close_transport()
                continue
            conn.reused = True
            return conn
        return None

    def _reusable(self, conn: _Connection, now: float) -> bool:
        """An idle connection still open (its transport too: a peer that died closes it before the pool hears)
        and within the keep-alive."""
        transport = conn.transport
        return (
            not conn.closed
            and transport is not None
            and not transport.is_closing()
            and now - conn.idle_since <= self.keepalive_s
        )

    def forget(self, base_url: str) -> None:
        """Close the idle connections to ``base_url`` (an instance that left the pool): they are taken only by a
        request to the same URL, which a removed instance no longer gets. One in use still returns here when its
        request ends, and the next ``sweep`` closes it."""
        for conn in self._idle.pop(base_url, []):
            conn._close_transport()
        self._addr.pop(base_url, None)

    def sweep(self) -> int:
        """Close connections idle past the keep-alive (or closed meanwhile) whatever their URL; how many."""
        now, closed = time.monotonic(), 0
        for key in list(self._idle):
            keep = []
            for conn in self._idle[key]:
                if self._reusable(conn, now):
                    keep.append(conn)
                else:
                    conn._close_transport()
                    closed += 1
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        return closed

    def _put(self, key: str, conn: _Connection) -> None:
        # not kept for a URL forgotten while the request ran (``_address`` notes every URL a request is built for)
        if conn.closed or not conn.keep_alive or not conn._complete or key not in self._addr:
            conn._close_transport()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn._close_transport()
        self._idle.clear()


class _Chunks:
    """``UpstreamResponse.chunks()``: an iterator class, not an async generator (mypyc compiles this module)."""

    __slots__ = ("_response",)

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk
