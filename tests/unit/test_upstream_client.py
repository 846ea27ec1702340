"""The proxy's upstream HTTP client against a real local socket server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from vllm_disagg.router.upstream import (
    ConnectFailed,
    ConnectionDropped,
    HTTPStatusError,
    UpstreamPool,
    UpstreamTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class Server:
    """Counts connections and requests; ``handler(reader, writer, n)`` answers the n-th request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests = 0
        self.disconnects = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await _read_request(reader)
                self.requests += 1
                await self.handler(reader, writer, self.requests)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects += 1
        finally:
            writer.close()


def _json(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def pool(read_timeout_s: float = 5.0) -> UpstreamPool:
    return UpstreamPool(connect_timeout_s=2.0, read_timeout_s=read_timeout_s, keepalive_s=30.0)


async def _ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    writer.write(_json(b'{"n": %d}' % n))
    await writer.drain()


def test_keep_alive_reuses_one_connection_and_reads_bodies() -> None:
    async def run() -> None:
        srv = Server(_ok)
        async with srv as url:
            p = pool()
            for i in range(1, 4):
                assert await p.post_json(url, "/v1/x", b"{}", {"x-request-id": "r"}) == b'{"n": %d}' % i
            assert srv.connections == 1 and srv.requests == 3
            p.close()

    asyncio.run(run())


def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            writer.write(_chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def run() -> None:
        srv = Server(stream)
        async with srv as url:
            p = pool()
            r = await p.request(url, p.build(url, "POST", "/s", b"{}", {}))
            assert r.status_code == 200
            got = [c async for c in r.chunks()]
            assert got == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]  # not coalesced: each as it came
            assert await r.next_chunk() is None
            # read to its end: the connection went back to the pool and serves the next request
            r2 = await p.request(url, p.build(url, "POST", "/s", b"{}", {}))
            assert len(await r2.read()) == 3 * len(b"data: 0\n\n") and srv.connections == 1
            p.close()

    asyncio.run(run())


def test_a_pooled_connection_closed_by_the_server_is_resent_once_on_a_fresh_one() -> None:
    """The instance closed an idle keep-alive connection (uvicorn does after 5 s): the request written into it was
    never read, so it goes out again on a new connection, and the caller never sees the failure."""

    async def close_after_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(_json(b'{"n": %d}' % n))  # says nothing about closing, then closes
        await writer.drain()
        writer.close()

    async def run() -> None:
        srv = Server(close_after_answer)
        async with srv as url:
            p = pool()
            assert await p.post_json(url, "/a", b"{}", {}) == b'{"n": 1}'
            await asyncio.sleep(0.1)  # the server's FIN arrives while the connection idles in the pool
            assert await p.post_json(url, "/a", b"{}", {}) == b'{"n": 2}'
            assert srv.connections == 2 and srv.requests == 2
            p.close()

    asyncio.run(run())


def test_a_fresh_connection_closed_before_any_byte_is_an_error_not_a_resend() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.close()

    async def run() -> None:
        srv = Server(hang_up)
        async with srv as url:
            p = pool()
            with pytest.raises(ConnectionDropped, match="before any response byte"):
                await p.post_json(url, "/a", b"{}", {})
            assert srv.requests == 1  # sent once: a fresh connection that dies may have been read
            p.close()

    asyncio.run(run())


def test_connect_failure_mid_body_cut_timeout_and_status() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"data: 0\n\n"))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()
        elif n == 2:
            await asyncio.sleep(1.0)  # longer than the read timeout
        else:
            writer.write(_json(b'{"error": "no"}', status=503))
            await writer.drain()

    async def run() -> None:
        p = pool()
        with pytest.raises(ConnectFailed):
            await p.post_json("http://127.0.0.1:1", "/a", b"{}", {})
        srv = Server(cut)
        async with srv as url:
            r = await p.request(url, p.build(url, "POST", "/s", b"{}", {}))
            assert await r.next_chunk() == b"data: 0\n\n"
            with pytest.raises(ConnectionDropped, match="mid-response"):
                await r.next_chunk()
            r.close()
            short = pool(
                read_timeout_s=0.3
            )  # only for the timeout: a stall could make the cut above read as one
            with pytest.raises(UpstreamTimeout):
                await short.post_json(url, "/a", b"{}", {})
            short.close()
            with pytest.raises(HTTPStatusError) as err:
                await p.post_json(url, "/a", b"{}", {})
            assert err.value.status == 503 and b"no" in err.value.body
        p.close()

    asyncio.run(run())


def test_closing_an_unfinished_answer_closes_its_connection() -> None:
    """That is how vLLM learns to abort the request and free its KV: the proxy must not keep it open or pool it."""
    gone = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(_chunk(b"data: x\n\n"))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            gone.set()
            raise

    async def run() -> None:
        srv = Server(endless)
        async with srv as url:
            p = pool()
            r = await p.request(url, p.build(url, "POST", "/s", b"{}", {}))
            assert await r.next_chunk()
            r.close()
            await asyncio.wait_for(gone.wait(), 5)
            assert not any(p._idle.values())  # not returned to the pool
            p.close()

    asyncio.run(run())


def test_a_cancelled_request_closes_its_connection() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(0.5)
        if not writer.is_closing():
            writer.write(_json(b"{}"))

    async def run() -> None:
        srv = Server(slow)
        async with srv as url:
            p = pool()
            task = asyncio.create_task(p.post_json(url, "/a", b"{}", {}))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):  # the instance sees the connection go
                if srv.disconnects:
                    break
                await asyncio.sleep(0.05)
            assert srv.disconnects == 1 and not any(p._idle.values())
            p.close()

    asyncio.run(run())


def test_chunks_that_arrived_together_are_relayed_as_one() -> None:
    async def burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"".join(_chunk(b"data: %d\n\n" % i) for i in range(5)))  # one TCP write, five chunks
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(b"data: late\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async def run() -> None:
        srv = Server(burst)
        async with srv as url:
            p = pool()
            r = await p.request(url, p.build(url, "POST", "/s", b"{}", {}))
            got = [c async for c in r.chunks()]
            assert got == [b"".join(b"data: %d\n\n" % i for i in range(5)), b"data: late\n\n"]
            p.close()

    asyncio.run(run())


def test_a_reader_slower_than_the_instance_stops_the_connection_reading() -> None:
    """A client slower than decode: the answer waits in the instance (its writes block), not in the proxy's memory;
    reading on, the reader gets every byte, and the connection's read timeout does not fire while it waits on the
    reader."""
    from vllm_disagg.router.upstream import QUEUED_HIGH

    total = 40 * 2**20
    sent = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = _chunk(b"x" * 65536)
        while sent[0] < total:
            writer.write(piece)
            await writer.drain()
            sent[0] += 65536
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def run() -> None:
        srv = Server(flood)
        async with srv as url:
            p = pool(read_timeout_s=0.5)
            r = await p.request(url, p.build(url, "POST", "/s", b"{}", {}))
            got = len(await r.next_chunk() or b"")
            await asyncio.sleep(1.5)  # the reader stalls for three read timeouts
            conn = r._conn
            assert conn._queued <= QUEUED_HIGH + 2**20, conn._queued  # at most one read past the mark
            assert sent[0] < total / 2  # the instance is held back, not drained into the proxy
            while conn._reading_paused:
                got += len(await r.next_chunk() or b"")
            # Reading resumed, and no byte can have come in since (this coroutine has not yielded): the read timer
            # firing now counts the instance's silence from the resume, not from its last byte before the stall.
            conn._disarm()
            conn._on_timer()
            while (chunk := await r.next_chunk()) is not None:
                got += len(chunk)
            assert got == total
            p.close()

    asyncio.run(run())


def test_an_interim_answer_is_not_taken_for_the_final_one() -> None:
    """A 1xx (100 Continue, 103 Early Hints) comes before the real answer on the same connection: taken for the
    answer, it left the real one to be read as the next request's answer on that connection."""

    async def interim_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(_json(b'{"for": %d}' % n))
        await writer.drain()

    async def run() -> None:
        srv = Server(interim_first)
        async with srv as url:
            p = pool()
            assert await p.post_json(url, "/a", b"{}", {}) == b'{"for": 1}'
            assert await p.post_json(url, "/b", b"{}", {}) == b'{"for": 2}'
            assert srv.connections == 1
            p.close()

    asyncio.run(run())
