"""The proxy's own HTTP/1.1 server (router/http_server.py) on real sockets: keep-alive, pipelining, chunked bodies,
caps, malformed input, disconnects, a slow reader, the ASGI bridge; and the proxy still served as an ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from support.proxy_harness import mock_backend, running_proxy, serve

from vllm_disagg.router.config import InstanceConfig, ProxySettings
from vllm_disagg.router.http_server import Connection, HttpServer, ServerRequest
from vllm_disagg.router.server import build_proxy


class _Served:
    def __init__(self) -> None:
        self.port = 0
        self.disconnects: list[bytes] = []
        self.seen: list[ServerRequest] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: HttpServer | None = None


@contextlib.contextmanager
def _server(
    max_body: int = 1000,
    keepalive_s: float = 5.0,
    write_stall_s: float = 600.0,
    read_request_s: float = 60.0,
    max_connections: int | None = None,
) -> Iterator[_Served]:
    """The server with two hot routes: /echo answers the body; /stream writes 200 chunks of 64 KiB, pacing itself
    by ``paused``/``drain`` as the proxy's relay does, and records a disconnect."""
    st = _Served()
    ready = threading.Event()
    stop: list[asyncio.Event] = []

    async def echo(req: ServerRequest, conn: Connection) -> None:
        st.seen.append(req)
        status = 413 if req.too_large else 200
        conn.respond(status, [(b"content-type", b"text/plain")], req.body)

    async def stream(req: ServerRequest, conn: Connection) -> None:
        st.seen.append(req)
        req.on_disconnect = lambda: st.disconnects.append(req.target)
        conn.start_stream(200, [(b"content-type", b"application/octet-stream")])
        for _ in range(200):
            conn.write(b"x" * 65536)
            if conn.paused:
                await conn.drain()
            if conn.closed:
                return
        conn.end_stream()

    async def ping(req: ServerRequest, conn: Connection) -> None:
        st.seen.append(req)
        conn.respond(200, [(b"content-type", b"text/plain")], b"pong")

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"data": [{"id": "m"}]})

    app = Starlette(routes=[Route("/v1/models", models)])

    def run() -> None:
        async def main() -> None:
            st.loop = asyncio.get_running_loop()
            ev = asyncio.Event()
            stop.append(ev)
            st.server = HttpServer(
                {"/echo": echo, "/stream": stream},
                app,
                max_body_bytes=max_body,
                keepalive_s=keepalive_s,
                get_routes={"/ping": ping},
                write_stall_s=write_stall_s,
                read_request_s=read_request_s,
                max_connections=max_connections,
            )
            await st.server.listen("127.0.0.1", 0)
            st.port = st.server.port()
            ready.set()
            await ev.wait()
            await st.server.shutdown(2)

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield st
    finally:
        assert st.loop is not None
        st.loop.call_soon_threadsafe(stop[0].set)
        thread.join(10)


def _read_all(s: socket.socket, until: bytes, limit: float = 5.0) -> bytes:
    data = b""
    deadline = time.monotonic() + limit
    s.settimeout(0.5)
    while until not in data and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_keep_alive_pipelining_and_chunked_bodies() -> None:
    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        # Two requests in one packet (pipelined), the second with a chunked body: answered in order, one connection.
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirst"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nsec\r\n3\r\nond\r\n0\r\n\r\n"
        )
        data = _read_all(s, b"second")
        assert data.count(b"HTTP/1.1 200 OK") == 2, data
        assert data.index(b"first") < data.index(b"second")
        assert b"connection: close" not in data
        # The connection is still usable.
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nthird")
        assert b"third" in _read_all(s, b"third")
    assert [r.body for r in st.seen] == [b"first", b"second", b"third"]


def test_a_client_that_expects_100_continue_is_told_to_send_its_body() -> None:
    """curl sends ``Expect: 100-continue`` with bodies over 1 KiB and waits a second for the interim answer."""
    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert _read_all(s, b"\r\n\r\n", limit=2.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"body")
        data = _read_all(s, b"body")
        assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b"body"), data
    assert [r.body for r in st.seen] == [b"body"]


def test_an_oversized_body_is_refused_at_once_and_the_connection_closes() -> None:
    with _server(max_body=100) as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        # Declared too large: answered before the body arrives (the rest is never read).
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\nabc")
        data = _read_all(s, b"\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 413"), data
        assert b"connection: close" in data
        assert s.recv(100) == b""  # closed
    with _server(max_body=100) as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        # Chunked past the cap: no Content-Length to check, the running size trips it.
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"64\r\n" + b"y" * 100
        )
        s.sendall(b"\r\n64\r\n" + b"y" * 100 + b"\r\n")
        assert _read_all(s, b"\r\n\r\n").startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    ],
)
def test_malformed_requests_get_a_400_and_a_closed_connection(raw: bytes) -> None:
    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.sendall(raw)
        data = _read_all(s, b"}")
        assert data.startswith(b"HTTP/1.1 400"), data
        assert b'"error"' in data
        assert s.recv(100) == b""


def test_http_1_0_closes_after_the_answer_and_idle_connections_are_closed() -> None:
    with _server(keepalive_s=0.5) as st:
        with socket.create_connection(("127.0.0.1", st.port)) as s:
            s.sendall(b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
            data = _read_all(s, b"hi")
            assert data.startswith(b"HTTP/1.1 200") and b"connection: close" in data
            assert s.recv(100) == b""
        with socket.create_connection(("127.0.0.1", st.port)) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            assert b"hi" in _read_all(s, b"hi")
            s.settimeout(5)
            assert s.recv(100) == b""  # idle past keepalive_s: the server closed it (within ~1.5 s)


def test_a_slow_reader_is_paced_and_a_disconnect_is_reported() -> None:
    """/stream writes 12.5 MiB; a client that reads slowly must not make the server buffer it all (writes wait on
    ``drain``), and closing mid-stream runs the request's ``on_disconnect``."""
    with _server() as st:
        s = socket.create_connection(("127.0.0.1", st.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        s.settimeout(10)
        assert s.recv(65536).startswith(
            b"HTTP/1.1 200"
        )  # the answer began; from here the client reads nothing
        deadline = time.monotonic() + 10
        conns: list[Connection] = []
        while time.monotonic() < deadline:
            conns = list(st.server.connections) if st.server else []
            if conns and conns[0].paused:
                break
            time.sleep(0.05)
        assert conns and conns[0].paused  # the handler is waiting for the client, not buffering
        buffered = conns[0].transport.get_write_buffer_size() if conns[0].transport else 0
        assert buffered < 2 * 2**20, buffered  # of the 12.5 MiB, what waits in the server is bounded
        s.close()
        deadline = time.monotonic() + 10
        while not st.disconnects and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st.disconnects == [b"/stream"]


def test_other_routes_go_to_the_asgi_app() -> None:
    with _server() as st:
        r = httpx.get(f"http://127.0.0.1:{st.port}/v1/models", timeout=5)
        assert r.status_code == 200 and r.json() == {"data": [{"id": "m"}]}
        assert httpx.get(f"http://127.0.0.1:{st.port}/nope", timeout=5).status_code == 404


def _sse_chunks(r: httpx.Response) -> list[str]:
    return [ln for ln in r.text.split("\n") if ln.startswith("data: ")]


def test_the_proxy_streams_the_same_through_its_server_and_as_an_asgi_app(tiny_model: str) -> None:
    """``Proxy.app`` (for embedding in another ASGI server) and the proxy's own server give the same answers; the
    stream's inter-chunk gaps reach the ITL histogram either way (chunks that arrive together are relayed as one:
    the mock spaces them)."""
    body = {
        "model": tiny_model,
        "prompt": "hello there",
        "max_tokens": 8,
        "stream": True,
        "mock_chunk_delay_s": 0.05,
    }
    with mock_backend(tiny_model) as backend:
        with running_proxy(backend, tiny_model) as rp:
            native = httpx.post(rp.url + "/v1/completions", json=body, timeout=30)
            metrics = httpx.get(rp.url + "/metrics", timeout=5).text
        settings = ProxySettings(instances=[InstanceConfig(url=backend, role="both")], tokenizer=tiny_model)
        proxy = build_proxy(settings)
        with serve(proxy.app) as url:
            deadline = time.monotonic() + 20
            while httpx.get(url + "/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            embedded = httpx.post(url + "/v1/completions", json=body, timeout=30)
            plain = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert native.status_code == embedded.status_code == plain.status_code == 200
    assert native.headers["content-type"].startswith("text/event-stream")
    assert _sse_chunks(native) == _sse_chunks(embedded) and _sse_chunks(native)[-1] == "data: [DONE]"
    assert plain.json()["choices"]
    count = next(ln for ln in metrics.splitlines() if ln.startswith("vllm_disagg_itl_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_get_routes_are_served_without_the_asgi_app() -> None:
    """A GET route (the proxy's /health) is answered by its handler; other methods on its path, and every other
    GET, go to the ASGI app."""
    with _server() as st:
        url = f"http://127.0.0.1:{st.port}"
        r = httpx.get(url + "/ping", timeout=5)
        assert (r.status_code, r.text) == (200, "pong")
        assert [req.target for req in st.seen] == [b"/ping"]
        assert httpx.post(url + "/ping", timeout=5).status_code == 404  # not a route of the ASGI app
        assert httpx.get(url + "/v1/models", timeout=5).json() == {"data": [{"id": "m"}]}
        assert len(st.seen) == 1


def test_a_request_head_over_the_cap_is_refused_before_it_is_buffered() -> None:
    """A request line or header that never ends: answered 431 and closed once the head passes MAX_HEAD_BYTES, with
    nothing held beyond one read more (no API key is needed to send one)."""
    from vllm_disagg.router.http_server import MAX_HEAD_BYTES

    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, data = 0, b""
        s.settimeout(5)
        with contextlib.suppress(OSError):
            while sent < 64 * MAX_HEAD_BYTES:
                s.sendall(b"a" * 16384)
                sent += 16384
        data = _read_all(s, b"}")
        assert data.startswith(b"HTTP/1.1 431"), data[:200]
        assert sent < 64 * MAX_HEAD_BYTES  # closed long before the client was done
        assert not st.seen
    with _server() as st:
        r = httpx.post(f"http://127.0.0.1:{st.port}/echo", content=b"ok", headers={"x-fine": "a" * 30000})
        assert r.status_code == 200 and r.content == b"ok"  # a large head under the cap is served


def test_head_gets_the_head_alone_and_the_connection_stays_usable() -> None:
    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.sendall(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        head = _read_all(s, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nafter")
        data = _read_all(s, b"after")
        assert data.startswith(b"HTTP/1.1 200"), data  # no stray body before the next answer
        s.sendall(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_all(s, b"\r\n\r\n").startswith(b"HTTP/1.1 200")
        s.sendall(b"BAD REQUEST\r\n\r\n")
        assert b"malformed" in _read_all(s, b"}")  # a later error answer keeps its body
    with _server() as st, httpx.Client(base_url=f"http://127.0.0.1:{st.port}") as client:
        assert client.head("/v1/models").status_code == 200
        assert client.get("/v1/models").json() == {"data": [{"id": "m"}]}  # the same kept-alive connection


def test_an_http_1_0_client_gets_a_stream_without_chunked_encoding() -> None:
    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.sendall(b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
        s.settimeout(10)
        data = b""
        while chunk := s.recv(1 << 20):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower() and b"connection: close" in head
        assert body == b"x" * (200 * 65536)  # unframed, ended by the close


def test_a_client_that_takes_nothing_for_write_stall_s_is_dropped() -> None:
    """A client that stays connected and stops reading would hold its request (admission slot, the instance's
    counts) for as long as it likes: past ``write_stall_s`` it is dropped, which ends the request as a disconnect."""
    with _server(write_stall_s=1.0) as st:
        s = socket.create_connection(("127.0.0.1", st.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        deadline = time.monotonic() + 15
        while not st.disconnects and time.monotonic() < deadline:
            time.sleep(0.1)
        assert st.disconnects == [b"/stream"]
        s.close()


def test_trailers_are_capped_and_never_become_headers() -> None:
    """A chunked body's trailer section is buffered by the parser like a header: it is held to the head's cap, and
    its fields (an API key, a request id) are dropped, not merged into the request's headers."""
    from vllm_disagg.router.http_server import MAX_HEAD_BYTES

    with _server() as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n"
            b"X-Request-Id: smuggled\r\n\r\n"
        )
        assert b"hi" in _read_all(s, b"hi")
        assert "x-request-id" not in st.seen[0].headers
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-Pad: "
        )
        sent = 0
        with contextlib.suppress(OSError):
            while sent < 64 * MAX_HEAD_BYTES:
                s.sendall(b"a" * 16384)
                sent += 16384
        assert _read_all(s, b"}").startswith(b"HTTP/1.1 431")
        assert sent < 64 * MAX_HEAD_BYTES


def test_a_request_that_trickles_in_is_cut_off() -> None:
    """One byte every few seconds keeps a connection from ever being idle: the whole request must arrive within
    ``read_request_s`` of its first byte."""
    with _server(read_request_s=1.0) as st, socket.create_connection(("127.0.0.1", st.port)) as s:
        s.settimeout(0.2)
        data = b""
        for byte in b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            with contextlib.suppress(OSError):
                s.sendall(bytes([byte]))
            with contextlib.suppress(TimeoutError, OSError):
                data += s.recv(4096)
            if data:
                break
        assert data.startswith(b"HTTP/1.1 408"), data
        assert not st.seen


def test_connections_past_the_cap_are_answered_503() -> None:
    with _server(max_connections=2) as st:
        held = [socket.create_connection(("127.0.0.1", st.port)) for _ in range(2)]
        try:
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", st.port)) as extra:
                assert _read_all(extra, b"}").startswith(b"HTTP/1.1 503")
            held[0].sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
            assert b"ok" in _read_all(held[0], b"ok")  # those within the cap are served
        finally:
            for c in held:
                c.close()


def test_pipelined_answers_wait_for_a_client_that_does_not_read() -> None:
    """Whole answers to pipelined requests are not piled up for a client that never reads them."""
    with _server(max_body=1 << 20) as st:
        s = socket.create_connection(("127.0.0.1", st.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        body = b"x" * (512 * 1024)
        one = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        s.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and sent < 200 * len(one):
            try:
                sent += s.send(one[sent % len(one) :])
            except BlockingIOError:
                time.sleep(0.01)
            except OSError:
                break
        time.sleep(0.5)
        conns = list(st.server.connections) if st.server else []
        assert conns
        buffered = conns[0].transport.get_write_buffer_size() if conns[0].transport else 0
        assert buffered < 4 * 2**20, buffered
        assert len(st.seen) < 40  # the server stopped taking requests it could not answer
        s.close()


@pytest.mark.parametrize(
    ("last", "gets_event"), [(b"data: 2\n\n", True), (b'data: {"par', False), (b"data: [DONE]\n\n", False)]
)
def test_shutdown_ends_an_event_stream_with_its_cut_event_only_on_an_event_boundary(
    last: bytes, gets_event: bool
) -> None:
    """Past the grace, an SSE answer that stands between events ends with the cut event and [DONE] (chunked
    framing intact); one that stands inside an event is only closed: an event in the middle would corrupt both."""

    async def sse(req: ServerRequest, conn: Connection) -> None:
        conn.start_stream(200, [(b"content-type", b"text/event-stream")], openai_events=True)
        conn.write(b"data: 1\n\n")
        conn.write(last)
        await asyncio.Event().wait()  # never ends: cut by the shutdown

    async def main() -> bytes:
        app = Starlette(routes=[])
        server = HttpServer({"/sse": sse}, app, max_body_bytes=1000, keepalive_s=5.0)
        await server.listen("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port())
        writer.write(b"POST /sse HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        got = b""
        while last not in got:
            got += await asyncio.wait_for(reader.read(65536), 5)
        assert await server.shutdown(0.2, b'{"error": "cut"}') == 1
        got += await asyncio.wait_for(reader.read(), 5)  # to EOF: the connection is closed
        writer.close()
        return got

    got = asyncio.run(main())
    tail = b'data: {"error": "cut"}\n\ndata: [DONE]\n\n'
    assert got.endswith(b"%x\r\n%b\r\n0\r\n\r\n" % (len(tail), tail)) is gets_event, got[-120:]
    assert (b'"cut"' in got) is gets_event
    if b"[DONE]" in last:  # a whole answer whose end had not gone out: ended, nothing added
        assert got.endswith(last + b"\r\n0\r\n\r\n"), got[-80:]
