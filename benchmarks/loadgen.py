"""A cheap closed-loop HTTP/1.1 load generator: asyncio Protocol + httptools, keep-alive, prebuilt request bytes.

Each of ``concurrency`` workers owns one keep-alive connection and sends prebuilt requests back to back until
``total`` requests have been sent. Per request it records the time to the first response-body byte (TTFT for a
stream) and to the end of the response, the status, the SSE events counted in the body and, when asked, one
response header (e.g. ``x-disagg-path``). httpx or aiohttp would cost more core time than the routers measured.

``probe``: a side stream of tiny GETs (one at a time, every ``interval`` seconds) on its own connection, recording
each latency: the event-loop lag of the server while the main load runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import httptools

T = TypeVar("T")


def build_request(url: str, path: str, body: bytes | None = None, method: str = "POST") -> bytes:
    """Raw HTTP/1.1 request bytes (keep-alive) for ``url`` (scheme://host:port) + ``path``."""
    host = urlsplit(url).netloc
    if body is None:
        return f"{method} {path} HTTP/1.1\r\nhost: {host}\r\naccept: */*\r\n\r\n".encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nhost: {host}\r\naccept: */*\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Result:
    start: float
    ttft: float  # seconds to the first body byte (nan if none)
    total: float  # seconds to the end of the response
    status: int
    events: int  # SSE "data:" events in the body, [DONE] included
    body_bytes: int
    header: str = ""  # the value of the header asked for
    body: bytes = b""  # kept only when asked (keep_body)


@dataclass
class RunStats:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class _ClientProtocol(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, header: bytes, keep_body: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.want_header = header
        self.keep_body = keep_body
        self.waiter: asyncio.Future[Result] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reset(0.0)

    def _reset(self, t0: float) -> None:
        self.t0 = t0
        self.first = float("nan")
        self.events = 0
        self.nbytes = 0
        self.header_value = b""
        self._name = b""
        self.chunks: list[bytes] = []
        self.tail = b""  # the last bytes of the previous body piece, to count "data:" split across pieces
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass
        except httptools.HttpParserError as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(ConnectionError(f"bad response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.want_header and name.lower() == self.want_header:
            self.header_value = value

    def on_body(self, body: bytes) -> None:
        if self.nbytes == 0:
            self.first = time.perf_counter()
        self.nbytes += len(body)
        joined = self.tail + body
        self.events += joined.count(b"data:")  # the 4-byte tail cannot hold a whole "data:" itself
        self.tail = joined[-4:]
        if self.keep_body:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        end = time.perf_counter()
        self.keep_alive = self.parser.should_keep_alive()
        res = Result(
            start=self.t0,
            ttft=self.first - self.t0,
            total=end - self.t0,
            status=self.parser.get_status_code(),
            events=self.events,
            body_bytes=self.nbytes,
            header=self.header_value.decode("latin-1"),
            body=b"".join(self.chunks),
        )
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(res)

    async def request(self, raw: bytes) -> Result:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self._reset(time.perf_counter())
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(raw)
        return await self.waiter


class Connection:
    """A reconnecting keep-alive client connection to one host:port."""

    def __init__(self, url: str, header: str = "", keep_body: bool = False) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.header = header.lower().encode()
        self.keep_body = keep_body
        self.proto: _ClientProtocol | None = None

    async def _connect(self) -> _ClientProtocol:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            lambda: _ClientProtocol(self.header, self.keep_body), self.host, self.port
        )
        return proto

    async def request(self, raw: bytes) -> Result:
        for attempt in range(2):
            if self.proto is None or self.proto.transport is None:
                self.proto = await self._connect()
            try:
                res = await self.proto.request(raw)
            except ConnectionError:
                self.proto = None
                if attempt:
                    raise
                continue
            if not self.proto.keep_alive and self.proto.transport is not None:
                self.proto.transport.close()
                self.proto = None
            return res
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        self.proto = None


async def closed_loop(
    urls: Sequence[str],
    requests: Sequence[bytes],
    concurrency: int,
    total: int,
    header: str = "",
    keep_body: bool = False,
) -> RunStats:
    """``total`` requests at ``concurrency`` in flight; worker i talks to ``urls[i % len(urls)]`` and request k is
    ``requests[k % len(requests)]``. Failed requests are recorded in ``errors`` and not retried."""
    stats = RunStats()
    sent = 0
    conns = [Connection(urls[i % len(urls)], header, keep_body) for i in range(concurrency)]

    async def worker(conn: Connection) -> None:
        nonlocal sent
        while sent < total:
            k = sent
            sent += 1
            try:
                stats.results.append(await conn.request(requests[k % len(requests)]))
            except (ConnectionError, OSError) as exc:
                stats.errors.append(f"{type(exc).__name__}: {exc}")

    t = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        stats.wall_s = time.perf_counter() - t
        for c in conns:
            c.close()
    return stats


async def probe(url: str, path: str, interval: float, stop: asyncio.Event) -> list[tuple[float, float]]:
    """GET ``path`` one at a time every ``interval`` s until ``stop``: [(start, latency)]."""
    conn = Connection(url)
    raw = build_request(url, path, method="GET")
    out: list[tuple[float, float]] = []
    try:
        while not stop.is_set():
            res = await conn.request(raw)
            out.append((res.start, res.total))
            await asyncio.sleep(interval)
    finally:
        conn.close()
    return out


def new_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop (the stock one when uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return cast(asyncio.AbstractEventLoop, uvloop.new_event_loop())


def run(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``coro_fn()`` to completion on a fresh uvloop loop."""
    loop = new_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
