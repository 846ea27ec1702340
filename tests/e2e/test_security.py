"""Security properties: nothing on the network path deserializes code, the side channel and the admin API demand
their secrets, and the proxy bounds request size and concurrency.

The source scan runs first (file order): it parses with ``ast``, which must not overlap a server thread formatting a
traceback (CPython 3.11's traceback carets call ``ast.parse`` too, and the two are not thread-safe).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from support.paths import ROOT
from support.proxy_harness import (
    ADMIN_KEY,
    MAX_BODY,
    RunningProxy,
    assert_openai_error,
    mock_backend,
    running_proxy,
    serve,
)
from support.side_channel_peer import RawPeer, expect_refused
from support.transfer_engines import LAYERS, geometry, make, wait_results

from vllm_disagg import __version__
from vllm_disagg.transport.engine import TransferEngine
from vllm_disagg.wire import (
    Abort,
    Description,
    Heartbeat,
    HelloAck,
    Register,
    encode,
    make_describe,
    make_hello,
)

SCANNED = ("vllm_disagg", "router", "connectors")

# ----------------------------------------------------------------------------------------------- (a) source scan

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "jsonpickle", "joblib"}
UNSAFE_YAML = {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
YAML_LOADERS = {"load", "load_all"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}
CODE_BUILTINS = {"eval", "exec"}


def _terminal_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _kwarg(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


class _UnsafeFinder(ast.NodeVisitor):
    """Imports and calls that deserialize code or objects (pickle & co, unsafe YAML, marshal) or run strings."""

    def __init__(self) -> None:
        self.problems: list[tuple[int, str]] = []
        self.aliases: dict[str, str] = {}  # local name -> module it stands for (yaml, marshal, builtins, ...)
        self.yaml_functions: set[str] = set()  # names bound by `from yaml import load`

    def _flag(self, node: ast.AST, what: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in UNSAFE_MODULES:
                self._flag(node, f"import {alias.name}")
            self.aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            local = alias.asname or alias.name
            if module.split(".")[0] in UNSAFE_MODULES:
                self._flag(node, f"from {module} import {alias.name}")
            elif module == "marshal" and alias.name in ("load", "loads"):
                self._flag(node, f"from marshal import {alias.name}")
            elif module == "builtins" and alias.name in CODE_BUILTINS:
                self._flag(node, f"from builtins import {alias.name}")
            elif module == "yaml" and alias.name in UNSAFE_YAML:
                self._flag(node, f"from yaml import {alias.name}")
            elif module == "yaml" and alias.name in YAML_LOADERS:
                self.yaml_functions.add(local)
            elif module == "numpy" and alias.name == "load":
                self.aliases[local] = "numpy.load"
        self.generic_visit(node)

    def _check_yaml_load(self, call: ast.Call, what: str) -> None:
        loader = _kwarg(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if loader is None or _terminal_name(loader) not in SAFE_YAML_LOADERS:
            self._flag(call, f"{what} without a safe Loader")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in CODE_BUILTINS:
                self._flag(node, f"{func.id}()")
            elif func.id in self.yaml_functions:
                self._check_yaml_load(node, f"{func.id}()")
            elif func.id == "__import__" or self.aliases.get(func.id) == "numpy.load":
                self._check_dynamic(node, func.id)
        elif isinstance(func, ast.Attribute):
            base = (
                self.aliases.get(_terminal_name(func.value), "") if isinstance(func.value, ast.Name) else ""
            )
            if base == "yaml" and func.attr in UNSAFE_YAML:
                self._flag(node, f"yaml.{func.attr}()")
            elif base == "yaml" and func.attr in YAML_LOADERS:
                self._check_yaml_load(node, f"yaml.{func.attr}()")
            elif base == "marshal" and func.attr in ("load", "loads"):
                self._flag(node, f"marshal.{func.attr}()")
            elif base == "builtins" and func.attr in CODE_BUILTINS:
                self._flag(node, f"builtins.{func.attr}()")
            elif base == "torch" and func.attr == "load":
                weights_only = _kwarg(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    self._flag(node, "torch.load() without weights_only=True")
            elif base == "numpy" and func.attr == "load":
                self._check_dynamic(node, "numpy.load")
            elif base == "importlib" and func.attr == "import_module":
                self._check_dynamic(node, "importlib.import_module")
        self.generic_visit(node)

    def _check_dynamic(self, node: ast.Call, what: str) -> None:
        if what.startswith("numpy"):
            allow = _kwarg(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                self._flag(node, "numpy.load(allow_pickle=...)")
            return
        arg = node.args[0] if node.args else None
        if (
            isinstance(arg, ast.Constant)
            and isinstance(arg.value, str)
            and arg.value.split(".")[0] in UNSAFE_MODULES
        ):
            self._flag(node, f"{what}({arg.value!r})")


def unsafe_constructs(source: str) -> list[tuple[int, str]]:
    finder = _UnsafeFinder()
    finder.visit(ast.parse(source))
    return finder.problems


def _sources() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from dill import loads",
        "import shelve",
        "from _pickle import loads",
        "import marshal\nmarshal.loads(b'')",
        "from marshal import loads",
        "import yaml\nyaml.load(s)",
        "import yaml as y\ny.load(s, Loader=y.Loader)",
        "import yaml\nyaml.load(s, yaml.UnsafeLoader)",
        "import yaml\nyaml.unsafe_load(s)",
        "import yaml\nyaml.full_load(s)",
        "from yaml import load\nload(s)",
        "from yaml import unsafe_load",
        "eval('1')",
        "exec('x = 1')",
        "import builtins\nbuiltins.eval('1')",
        "__import__('pickle')",
        "import importlib\nimportlib.import_module('pickle')",
        "import torch\ntorch.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
    ],
)
def test_scanner_flags_unsafe_deserialization(snippet: str) -> None:
    assert unsafe_constructs(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import json\njson.loads(s)",
        "import yaml\nyaml.safe_load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
        "import yaml\nyaml.load(s, yaml.CSafeLoader)",
        "import msgspec\nmsgspec.msgpack.decode(b)",
        "import torch\ntorch.load(f, weights_only=True)",
        "import numpy as np\nnp.load(f)",
        "x.eval()",  # a method called eval (torch's module.eval()) is not the builtin
        "import importlib\nimportlib.import_module(name)",
    ],
)
def test_scanner_passes_safe_code(snippet: str) -> None:
    assert unsafe_constructs(snippet) == []


def test_no_unpickling_or_code_evaluation_in_the_network_path() -> None:
    files = _sources()
    assert len(files) >= 20, f"scanned only {len(files)} files: wrong root?"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        for line, what in unsafe_constructs(path.read_text(encoding="utf-8"))
    ]
    assert not found, "unsafe deserialization / code evaluation:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------- (b) side channel

SECRET = b"security-test-secret"


@pytest.fixture
def guarded() -> Iterator[TransferEngine]:
    p = make("P", seed=1, secret=SECRET, transport="tcp")
    yield p
    p.close()


def test_side_channel_refuses_missing_and_wrong_secrets_and_accepts_the_right_one(
    guarded: TransferEngine,
) -> None:
    """Past zmq's handshake (a peer with the credentials, test_fuzz_side_channel covers one without), each
    message must still prove the secret itself."""
    p = guarded
    peer = RawPeer(p.port, SECRET)
    try:
        for secret in (None, b"wrong-secret", SECRET[:-1]):
            reply = expect_refused(p, peer, encode(make_hello(secret, "intruder", geometry(), __version__)))
            assert reply.field == "shared_secret", reply
            # a refused handshake authenticates nothing: the same connection still may not register
            expect_refused(
                p,
                peer,
                encode(Register(transfer_id="t", request_id="r", first_block=0, num_blocks=1, prompt_len=4)),
            )
        stale = make_hello(SECRET, "replayer", geometry(), __version__, now=time.time() - 3600)
        assert "timestamp" in expect_refused(p, peer, encode(stale)).reason
        assert p.stats["handshakes_refused"] == 4 and not p.snapshot()["decodes"]
        for secret in (None, b"wrong-secret"):
            expect_refused(p, peer, encode(make_describe(secret, "proxy")))  # geometry is not told either
        peer.send(encode(make_describe(SECRET, "proxy")))
        assert isinstance(peer.recv(), Description)
        peer.send(encode(make_hello(SECRET, "decode", geometry(), __version__)))
        assert isinstance(peer.recv(), HelloAck)
        peer.send(encode(Heartbeat(transfer_ids=["unknown"])))
        assert isinstance(peer.recv(), Abort)  # now authenticated: answered, not refused
        assert p.snapshot()["decodes"] == 1
    finally:
        peer.close()


@pytest.mark.parametrize(
    ("decode_secret", "ok"),
    [(None, False), (b"not-the-secret", False), (SECRET, True)],
    ids=["no-secret", "wrong-secret", "right-secret"],
)
def test_engines_transfer_only_with_the_shared_secret(
    guarded: TransferEngine, decode_secret: bytes | None, ok: bool
) -> None:
    p = guarded
    d = make("D", seed=None, secret=decode_secret, transport="tcp")
    try:
        p.begin_send("t-sec", "req-p", prompt_len=8)
        d.start_load("req-d", "t-sec", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        for layer in range(LAYERS):
            p.offer_blocks("t-sec", layer, [(0, 2), (1, 3)])
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert (res.failed_recving == set()) is ok
        deadline = time.monotonic() + 5  # a refused zmq handshake is counted by prefill's I/O thread
        while not ok and p.stats["handshakes_refused"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (p.stats["handshakes_refused"] == 0) is ok
        copied = all(
            bytes(d.store.read(layer, 4)) == bytes(p.store.read(layer, 2)) for layer in range(LAYERS)
        )
        assert copied is ok
        if not ok:
            assert p.stats["bytes_sent"] == 0 and d.stats["bytes_received"] == 0
    finally:
        d.close()


# ----------------------------------------------------------------------------------------------- proxy fixtures


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module (building an httpx client loads CA certificates: ~0.1 s each)."""
    with httpx.Client(timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def backend(tiny_model: str) -> Iterator[str]:
    with mock_backend(tiny_model) as url:
        yield url


@pytest.fixture(scope="module")
def proxy(backend: str, tiny_model: str) -> Iterator[RunningProxy]:
    with running_proxy(backend, tiny_model, shared_secret="side-secret-not-to-leak") as rp:
        yield rp


@pytest.fixture(scope="module")
def open_proxy(backend: str, tiny_model: str) -> Iterator[RunningProxy]:
    with running_proxy(backend, tiny_model, admin_key=None) as rp:
        yield rp


# ----------------------------------------------------------------------------------------------- (c) admin API

ADMIN_CALLS = [
    ("GET", "/admin/instances", None),
    ("POST", "/admin/instances", {"url": "http://127.0.0.1:9", "id": "intruder"}),
    ("DELETE", "/admin/instances/{id}", None),
    ("POST", "/admin/instances/{id}/drain", None),
    ("POST", "/admin/instances/{id}/resume", None),
    ("GET", "/admin/decisions", None),
    ("GET", "/admin/transfers", None),
]


def _admin(
    http: httpx.Client, rp: RunningProxy, method: str, path: str, body: object, headers: dict[str, str]
) -> httpx.Response:
    iid = next(iter(rp.proxy.registry.instances))
    return http.request(method, rp.url + path.replace("{id}", iid), json=body, headers=headers, timeout=10)


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_admin_api_demands_the_key(
    proxy: RunningProxy, http: httpx.Client, method: str, path: str, body: object
) -> None:
    before = {i: inst.draining for i, inst in proxy.proxy.registry.instances.items()}
    for headers in (
        {},
        {"x-admin-key": "wrong"},
        {"x-admin-key": ADMIN_KEY[:-1]},
        {"x-admin-key": ADMIN_KEY + "x"},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Basic {ADMIN_KEY}"},
        {"x-api-key": ADMIN_KEY},  # the right key in a header the admin API does not read
        {"x-admin-key": ""},
    ):
        r = _admin(http, proxy, method, path, body, headers)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert_openai_error(r)
    # refused calls changed nothing
    assert {i: inst.draining for i, inst in proxy.proxy.registry.instances.items()} == before
    if method == "GET":
        for headers in ({"x-admin-key": ADMIN_KEY}, {"authorization": f"Bearer {ADMIN_KEY}"}):
            assert _admin(http, proxy, method, path, body, headers).status_code == 200


def test_admin_api_is_off_without_a_configured_key(open_proxy: RunningProxy, http: httpx.Client) -> None:
    before = sorted(open_proxy.proxy.registry.instances)
    for method, path, body in ADMIN_CALLS:
        for headers in (
            {},
            {"x-admin-key": ADMIN_KEY},
            {"x-admin-key": ""},
            {"authorization": "Bearer None"},
        ):
            r = _admin(http, open_proxy, method, path, body, headers)
            assert r.status_code == 403, (method, path, headers, r.status_code)
            assert_openai_error(r)
    assert sorted(open_proxy.proxy.registry.instances) == before
    assert not any(i.draining for i in open_proxy.proxy.registry.instances.values())


def test_secrets_do_not_leak_into_responses(proxy: RunningProxy, http: httpx.Client) -> None:
    auth = {"x-admin-key": ADMIN_KEY}
    pages = [http.get(proxy.url + p, timeout=10).text for p in ("/health", "/metrics", "/v1/models")]
    pages += [
        http.get(proxy.url + p, headers=auth, timeout=10).text
        for p in ("/admin/instances", "/admin/transfers")
    ]
    pages.append(http.post(proxy.url + "/admin/instances", content=b"{", headers=auth, timeout=10).text)
    for text in pages:
        assert ADMIN_KEY not in text and "side-secret-not-to-leak" not in text


# ----------------------------------------------------------------------------------------------- (d) body size


def _padded(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON allows trailing whitespace)."""
    body = b'{"prompt": "hello", "max_tokens": 2}'
    return body + b" " * (size - len(body))


def _chunks(data: bytes, n: int = 7) -> Iterator[bytes]:
    step = -(-len(data) // n)
    for i in range(0, len(data), step):
        yield data[i : i + step]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_size_limit_is_exact(proxy: RunningProxy, http: httpx.Client, chunked: bool) -> None:
    url = proxy.url + "/v1/completions"
    for size, status in ((MAX_BODY, 200), (MAX_BODY + 1, 413), (4 * MAX_BODY, 413)):
        data = _padded(size)
        r = http.post(url, content=_chunks(data) if chunked else data, timeout=30)
        assert r.status_code == status, (size, r.status_code, r.text[:200])
        if status == 413:
            assert_openai_error(r)


def _raw_request(base: str, head: bytes, body: bytes, then: bytes = b"") -> int:
    """Send hand-written HTTP (lies included); returns the first response's status. ``then`` is sent after that
    response arrived (sending it before could make the server close on unread data, which resets the socket)."""
    parts = urlsplit(base)
    assert parts.hostname is not None and parts.port is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(head + b"\r\n" + body)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        if then:
            with contextlib.suppress(OSError):
                s.sendall(then)
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split(b" ", 2)[1])


def test_a_lying_content_length_cannot_smuggle_a_large_body(proxy: RunningProxy, http: httpx.Client) -> None:
    host = urlsplit(proxy.url).netloc.encode()
    start = b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n"
    # claims 1 GB, sends 40 bytes: refused at once from the header, without waiting for (or buffering) a body
    t0 = time.monotonic()
    status = _raw_request(proxy.url, start + b"Content-Length: 1000000000\r\n", b'{"prompt": "x"' + b" " * 26)
    assert status == 413 and time.monotonic() - t0 < 5
    # claims 40 bytes, then sends 200 kB more: the body is the 40 declared bytes (a complete request: 200); the
    # rest is never appended to it (it can only be a next request, which is garbage)
    payload = _padded(2 * MAX_BODY)
    status = _raw_request(proxy.url, start + b"Content-Length: 40\r\n", payload[:40], then=payload[40:])
    assert status == 200
    # both framings at once (a smuggling attempt) or an invalid length: never accepted
    for extra in (
        b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n",
        b"Content-Length: abc\r\n",
        b"Content-Length: -1\r\n",
    ):
        status = _raw_request(proxy.url, start + extra + b"Connection: close\r\n", b"5\r\nhello\r\n0\r\n\r\n")
        assert 400 <= status < 500, (extra, status)
    assert http.get(proxy.url + "/health", timeout=10).status_code == 200
    ok = http.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200


# ----------------------------------------------------------------------------------------------- (d) concurrency


class SlowBackend:
    """A fake vLLM whose completions wait (up to 10 s) until the test opens the gate; counts requests in flight."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.gate = threading.Event()
        self.in_flight = 0
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/metrics", self.metrics),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "max_model_len": 4096}]})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    async def _wait(self) -> None:
        deadline = time.monotonic() + 10
        while not self.gate.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.in_flight += 1
        if not body.get("stream"):
            try:
                await self._wait()
            finally:
                self.in_flight -= 1
            return JSONResponse({"choices": [{"index": 0, "text": " slow", "finish_reason": "length"}]})

        async def events() -> Any:
            try:
                yield b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
                await self._wait()
                yield b"data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def slow_proxy(tiny_model: str) -> Iterator[tuple[RunningProxy, SlowBackend]]:
    slow = SlowBackend(tiny_model)
    with (
        serve(slow.app) as url,
        # no queue: requests over the limit are refused at once (test_admission.py covers waiting)
        running_proxy(url, tiny_model, max_concurrency=2, max_queued=0, policy="least-loaded") as rp,
    ):
        yield rp, slow
        slow.gate.set()


def _wait_for(pred: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _assert_429(r: httpx.Response) -> None:
    assert r.status_code == 429, (r.status_code, r.text)
    assert int(r.headers["retry-after"]) >= 1
    assert_openai_error(r)


def test_concurrency_limit_answers_429_with_retry_after(
    slow_proxy: tuple[RunningProxy, SlowBackend], http: httpx.Client
) -> None:
    rp, slow = slow_proxy
    url = rp.url + "/v1/completions"
    request = {"prompt": "hi", "max_tokens": 2}
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(http.post, url, json=request) for _ in range(2)]
        _wait_for(
            lambda: slow.in_flight == 2 and rp.proxy.active == 2, "two requests never reached the backend"
        )
        extra = list(pool.map(lambda _: http.post(url, json=request, timeout=30), range(3)))
        for r in extra:
            _assert_429(r)
        assert slow.in_flight == 2  # the refused ones never reached the backend
        slow.gate.set()
        assert [f.result().status_code for f in held] == [200, 200]
    _wait_for(lambda: rp.proxy.active == 0, "slots not released")
    assert http.post(url, json=request, timeout=30).status_code == 200  # freed slots admit again
    metrics = http.get(rp.url + "/metrics", timeout=10).text
    assert any("queue_full" in line and line.rstrip().endswith(" 3.0") for line in metrics.splitlines()), (
        metrics
    )


def test_streams_hold_their_slot_until_they_end(
    slow_proxy: tuple[RunningProxy, SlowBackend], http: httpx.Client
) -> None:
    """A stream that already sent tokens still counts: N open streams cannot exceed max_concurrency."""
    rp, slow = slow_proxy
    url = rp.url + "/v1/completions"
    clients = [httpx.Client(timeout=30) for _ in range(2)]
    streams: list[httpx.Response] = []
    pending: list[Iterator[bytes]] = []
    try:
        for c in clients:
            req = c.build_request("POST", url, json={"prompt": "hi", "max_tokens": 2, "stream": True})
            r = c.send(req, stream=True)
            streams.append(r)
            assert r.status_code == 200
            chunks = r.iter_bytes()
            assert next(chunks).startswith(b"data: ")  # the first token arrived: the stream is open
            pending.append(chunks)
        _assert_429(http.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30))
        slow.gate.set()
        for chunks in pending:
            assert b"".join(chunks).rstrip().endswith(b"data: [DONE]")
    finally:
        for r in streams:
            r.close()
        for c in clients:
            c.close()
    _wait_for(lambda: rp.proxy.active == 0, "stream slots not released")
