"""Hostile ``kv_transfer_params`` straight at the instances while well-formed traffic flows through the proxy.

vLLM's OpenAI server hands a request body's ``kv_transfer_params`` to DisaggConnector unchecked, so it is client
input. Whatever a client puts there, each request must get a normal answer (served locally, token-identical to a
plain request) or a clean 4xx from vLLM's own request validation: never a 5xx, never a hang, never a dead engine,
never a KV block left behind, and a value that fails validation never reaches a socket.

Two TCP listeners owned by the test: the *trap* is named only by params that must fail validation (it must never
see a connection); the *sink* is named by well-formed params (the pair runs without ``allowed_prefill_hosts``, so
dialing it is allowed) and answers whoever connects with garbage. The generator is seeded ``random.Random``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from support.listeners import Listener
from support.pd_pair import PDPair, decode_params_for, prefill_params, random_prompt
from support.vllm_servers import SECRET, complete, find_trace, metric, tokens, wait_kv_idle

from vllm_disagg.tools.harness import ProxyServer, VLLMServer, free_port
from vllm_disagg.transfer_params import (
    PROOF_KEY,
    RemotePrefill,
    TransferParamsError,
    parse_transfer_params,
    prefill_proof,
)

pytestmark = pytest.mark.vllm

SEED = int(os.environ.get("HOSTILE_SEED", "20250611"))  # another seed explores other hostile mixes
N_HOSTILE = 200
N_PROXY = 40
N_PLAIN = 20
CONCURRENCY = 8
CLIENT_TIMEOUT_S = 90.0  # the slowest legitimate hostile case waits load_timeout_s (15 s) before recomputing
MAX_TOKENS = 8
EXT = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
ABSENT = object()  # leave kv_transfer_params out of the body


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 2000) for _ in range(n)]


@dataclass(frozen=True)
class Ports:
    trap: int  # named only by params that must be refused: no connection may ever arrive
    sink: int  # named by well-formed params: dialing it is allowed (no allowed_prefill_hosts on the pair)
    closed: int  # nothing listens here
    p_side: int  # the prefill instance's real side channel
    d_side: int


# ----------------------------------------------------------------------------------------------- the generator


@dataclass
class Req:
    kind: str  # what the request exercises (named in failure messages)
    target: str  # "prefill" | "decode" | "proxy"
    prompt: int  # index into the prompt list
    max_tokens: int
    stream: bool
    params: Any = ABSENT
    expect: str = "ok"  # "ok": 200 + reference tokens; "4xx": refused by vLLM; "ok|4xx": either
    n: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        p = "<absent>" if self.params is ABSENT else json.dumps(self.params, default=repr)[:300]
        return f"{self.kind} -> {self.target} (n={self.n}, stream={self.stream}): {p}"


def _bad_ports(trap: int) -> list[Any]:
    """remote_port values that must fail validation; several would dial ``trap`` if parsed leniently."""
    return [
        "abc",
        "-1",
        "99999",
        "0",
        "",
        " ",
        "1e4",
        "0x50",
        "8_0",
        "true",
        0,
        -1,
        65536,
        99999,
        10**30,
        -(10**30),
        1.5,
        float(trap),
        f"{trap}.0",
        f" {trap}",
        f"{trap} ",
        f"+{trap}",
        f"0{trap}",
        f"{trap}\n",
        trap + 65536,  # == trap modulo 2**16
        trap - 65536,
        str(trap + 65536),
        [trap],
        {"port": trap},
        None,
        True,
        False,
        "\u00b2",  # str.isdigit() but not int(): see test_parser_raises_only_transfer_params_errors
        f"{trap}\u00b9",
    ]


BAD_HOSTS: list[Any] = [
    "bad host",
    "*",
    "%",
    "",
    " ",
    "127.0.0.1 ",
    " 127.0.0.1",
    "127.0.0.1\t",
    "127.0.0.1:5700",
    "tcp://127.0.0.1",
    "127.0.0.1/32",
    "[::1]:5700",
    "a" * 300,
    "x." * 130,
    "\u4f8b\u3048.jp",
    "caf\u00e9.example",
    "-leading-dash",
    "under_score",
    "127.0.0.1\u0000",
    "\u202e1.0.0.721",
    None,
    127,
    2130706433,
    ["127.0.0.1"],
    {"host": "127.0.0.1"},
    True,
]
BAD_TIDS: list[Any] = [
    "",
    "a b",
    "x" * 129,
    "x" * 50_000,
    "t\u00e9",
    "tid;rm -rf",
    "tid\u0000",
    12345,
    10**40,
    1.5,
    [],
    ["t"],
    {},
    {"id": "t"},
    True,
]
BAD_FLAGS: list[Any] = ["true", "True", "false", "1", 1, 0, 1.0, [], [True], {}, {"v": True}, "yes"]
NON_OBJECTS: list[Any] = [
    [],
    [{"do_remote_prefill": True}],
    "do_remote_prefill",
    '{"do_remote_prefill": true}',
    "",
    1,
    0,
    -1.5,
    True,
    False,
    [[[[[]]]]],
]
# Hosts that pass validation and all lead to 127.0.0.1 (or nowhere, for ::1: the sink listens on IPv4 only).
SINK_HOSTS = ["127.0.0.1", "localhost", "0.0.0.0", "127.1", "0x7f000001", "2130706433", "::1", "[::1]"]
JUNK_KEYS: dict[str, list[Any]] = {
    "remote_engine_id": [None, 5, {"a": [1]}, "x" * 1000],
    "remote_block_ids": ["x", [-1, 10**12], [[1]], None],
    "remote_num_tokens": [-5, 10**20, "many"],
    "remote_request_id": [[1, 2], {"r": 1}, ""],
    "tp_size": [0, -1, 10**9, "2"],
    "remote_prefill_cached_tokens": [-5, 10**20, "x", [1]],
    "unexpected": [{"nested": {"deeper": [1, 2, 3]}}, "\u2603"],
}


class Hostile:
    """Seeded hostile kv_transfer_params, each paired with what the instance must do with it."""

    def __init__(self, rng: random.Random, ports: Ports, n_prompts: int, same_len: tuple[int, int]) -> None:
        self.rng, self.ports, self.n_prompts, self.same_len = rng, ports, n_prompts, same_len
        self.dup_p = [f"dup-p-{i}" for i in range(3)]  # shared by concurrent do_remote_decode requests
        self.dup_d = [f"dup-d-{i}" for i in range(3)]  # shared by concurrent do_remote_prefill requests
        self.kinds = [
            (self.invalid_prefill, 40),
            (self.invalid_decode, 14),
            (self.non_object, 12),
            (self.harmless, 10),
            (self.valid_to_sink, 14),
            (self.valid_to_closed, 10),
            (self.dup_decode_tid, 18),
            (self.dup_prefill_tid, 8),
            (self.chaos, 30),
            (self.cached_tokens_junk, 4),
            (self.orphan, 3),
            (self.self_dial, 2),
            (self.cross_prompt_pair, 6),
        ]

    def _tid(self) -> str:
        return uuid.UUID(int=self.rng.getrandbits(128)).hex

    def _target(self) -> str:
        return self.rng.choice(["prefill", "decode"])

    def _junk(self, params: dict[str, Any]) -> dict[str, Any]:
        for key in self.rng.sample(sorted(JUNK_KEYS), self.rng.randrange(0, 3)):
            params[key] = self.rng.choice(JUNK_KEYS[key])
        return params

    def _req(self, kind: str, params: Any, target: str | None = None, **kw: Any) -> Req:
        req = Req(
            kind=kind,
            target=target or self._target(),
            prompt=kw.pop("prompt", self.rng.randrange(self.n_prompts)),
            max_tokens=self.rng.choice([4, 6, MAX_TOKENS]),
            stream=self.rng.random() < 0.4,
            params=params,
            **kw,
        )
        # vLLM's own request validation refuses these: n > 1 needs sampling; extra_args ints must fit 64 bits.
        if req.n > 1 or _out_of_range_int(params):
            req.expect = "4xx"
        return req

    def _prefill_params(self, host: Any, port: Any, tid: Any = None) -> dict[str, Any]:
        """Vouched for with the instances' secret wherever the fields have the types a proof covers: the storm is
        what a client holding the secret (or a compromised router) could send, past the proof."""
        params = {
            "do_remote_prefill": True,
            "transfer_id": self._tid() if tid is None else tid,
            "remote_host": host,
            "remote_port": port,
        }
        if isinstance(params["transfer_id"], str) and isinstance(host, str) and type(port) is int:
            params[PROOF_KEY] = prefill_proof(SECRET.encode(), params["transfer_id"], host, port)
        return params

    # Every variant below names the trap with a well-formed host and port, so only validation stands between it
    # and a connection.
    def invalid_prefill(self) -> list[Req]:
        trap, r = self.ports.trap, self.rng
        p = self._prefill_params("127.0.0.1", trap)
        what = r.choice(["flag", "both", "tid", "no-tid", "port", "no-port", "host", "no-host"])
        if what == "flag":
            p["do_remote_prefill"] = r.choice(BAD_FLAGS)
        elif what == "both":
            p["do_remote_decode"] = True
        elif what == "tid":
            p["transfer_id"] = r.choice(BAD_TIDS)
        elif what == "port":
            p["remote_port"] = r.choice(_bad_ports(trap))
        elif what == "host":
            p["remote_host"] = r.choice(BAD_HOSTS)
        else:
            del p[{"no-tid": "transfer_id", "no-port": "remote_port", "no-host": "remote_host"}[what]]
        if r.random() < 0.5 and what not in ("port", "no-port"):
            p["remote_port"] = str(trap)
        # n=2 with greedy sampling: vLLM answers 400 and hands the params to the connector in a pre-aborted request
        return [self._req(f"invalid-prefill:{what}", self._junk(p), n=2 if r.random() < 0.15 else 1)]

    def invalid_decode(self) -> list[Req]:
        r = self.rng
        if r.random() < 0.5:
            p: dict[str, Any] = {"do_remote_decode": r.choice(BAD_FLAGS), "transfer_id": self._tid()}
        else:
            p = {"do_remote_decode": True, "transfer_id": r.choice(BAD_TIDS)}
        return [self._req("invalid-decode", self._junk(p))]

    def non_object(self) -> list[Req]:
        return [self._req("non-object", self.rng.choice(NON_OBJECTS), expect="4xx")]

    def harmless(self) -> list[Req]:
        r = self.rng
        p = r.choice(
            [
                None,
                {},
                {"do_remote_prefill": False, "remote_host": "bad host", "remote_port": "abc"},
                {"do_remote_decode": False, "do_remote_prefill": None, "transfer_id": 5},
                {"do_remote_prefill": None, "remote_host": None, "remote_port": None},
            ]
        )
        return [self._req("harmless", p if p is None else self._junk(dict(p)))]

    def valid_to_sink(self) -> list[Req]:
        port = self.ports.sink if self.rng.random() < 0.7 else str(self.ports.sink)
        params = self._prefill_params(self.rng.choice(SINK_HOSTS), port)
        return [self._req("valid-to-sink", params, n=2 if self.rng.random() < 0.2 else 1)]

    def valid_to_closed(self) -> list[Req]:
        port = self.rng.choice([self.ports.closed, str(self.ports.closed), 1, 65535])
        host = self.rng.choice(["127.0.0.1", "localhost", "::1"])
        return [self._req("valid-to-closed", self._prefill_params(host, port))]

    def dup_decode_tid(self) -> list[Req]:
        p = {"do_remote_decode": True, "transfer_id": self.rng.choice(self.dup_p)}
        return [self._req("dup-decode-tid", p)]

    def dup_prefill_tid(self) -> list[Req]:
        port = self.rng.choice([self.ports.sink, self.ports.closed])
        p = self._prefill_params("127.0.0.1", port, tid=self.rng.choice(self.dup_d))
        return [self._req("dup-prefill-tid", p)]

    def chaos(self) -> list[Req]:
        r = self.rng
        pools: dict[str, list[Any]] = {
            "do_remote_decode": [True, False, None, *BAD_FLAGS],
            "do_remote_prefill": [True, True, False, None, *BAD_FLAGS],
            "transfer_id": [self._tid(), self._tid(), "dup-p-0", "dup-d-0", *BAD_TIDS],
            "remote_host": ["127.0.0.1", "localhost", *BAD_HOSTS],
            # never the trap: some of these combinations are well-formed and may dial
            "remote_port": [
                self.ports.closed,
                self.ports.sink,
                str(self.ports.sink),
                "abc",
                -1,
                1.5,
                None,
                [1],
            ],
        }
        p = {k: r.choice(v) for k, v in pools.items() if r.random() < 0.8}
        return [self._req("chaos", self._junk(p))]

    def cached_tokens_junk(self) -> list[Req]:
        p = self._prefill_params("127.0.0.1", self.ports.closed)
        p["remote_prefill_cached_tokens"] = self.rng.choice([-5, 10**20, "x", 2**63])
        return [self._req("cached-tokens-junk", p, target="decode")]

    def orphan(self) -> list[Req]:
        """The real prefill's side channel, a transfer id nobody prefills: decode waits load_timeout_s (15 s)."""
        return [self._req("orphan", self._prefill_params("127.0.0.1", self.ports.p_side), target="decode")]

    def self_dial(self) -> list[Req]:
        """The prefill instance told to load from its own side channel."""
        return [
            self._req("self-dial", self._prefill_params("127.0.0.1", self.ports.p_side), target="prefill")
        ]

    def cross_prompt_pair(self) -> list[Req]:
        """Prefill computes prompt A under T, decode loads T for a different prompt B: decode must not use A's KV."""
        a, b = self.same_len if self.rng.random() < 0.5 else self.rng.sample(range(self.n_prompts), 2)
        tid = self._tid()
        p_leg = self._req("cross-prompt:P", prefill_params(tid), "prefill", prompt=a)
        d_params = self._prefill_params("127.0.0.1", self.ports.p_side, tid=tid)
        d_leg = self._req("cross-prompt:D", d_params, "decode", prompt=b)
        return [d_leg, p_leg] if self.rng.random() < 0.5 else [p_leg, d_leg]

    def generate(self, count: int) -> list[Req]:
        makers = [m for m, _ in self.kinds]
        weights = [w for _, w in self.kinds]
        out: list[Req] = []
        while len(out) < count:
            out.extend(self.rng.choices(makers, weights)[0]())
        return out


def _out_of_range_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value <= 2**64 - 1
    if isinstance(value, dict):
        return any(_out_of_range_int(v) for v in value.values())
    if isinstance(value, list):
        return any(_out_of_range_int(v) for v in value)
    return False


def crashes_parser(params: Any) -> str | None:
    """What parse_transfer_params raises other than TransferParamsError. It runs inside vLLM's scheduler (add_request,
    then get_num_new_matched_tokens), where any other exception kills the engine."""
    if params is ABSENT:
        return None
    try:
        parse_transfer_params(params)
    except TransferParamsError:
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# -------------------------------------------------------------------------------------------------- the client


@dataclass
class Answer:
    status: int
    choices: dict[int, list[int]]
    headers: dict[str, str]
    error: str = ""
    seconds: float = 0.0


def send(client: httpx.Client, url: str, body: dict[str, Any]) -> Answer:
    if not body.get("stream"):
        r = client.post(url + "/v1/completions", json=body)
        if r.status_code != 200:
            return Answer(r.status_code, {}, dict(r.headers), r.text[:500])
        return Answer(200, {c["index"]: list(c["token_ids"]) for c in r.json()["choices"]}, dict(r.headers))
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return Answer(r.status_code, {}, dict(r.headers), r.text[:500])
        choices: dict[int, list[int]] = {}
        done, errors = False, []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(json.dumps(chunk)[:300])
            for c in chunk.get("choices", []):
                choices.setdefault(c["index"], []).extend(c.get("token_ids") or [])
        error = "; ".join(errors) or ("" if done else "stream ended without [DONE]")
        return Answer(200, choices, dict(r.headers), error)


def body_of(req: Req, prompt: list[int], model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": req.stream,
        "n": req.n,
        **req.extra,
    }
    if req.params is not ABSENT:
        body["kv_transfer_params"] = req.params
    return body


def check(req: Req, ans: Answer, ref: list[int]) -> str | None:
    """Why ``ans`` is wrong for ``req``, or None."""
    if ans.status >= 500 or ans.status == 0:
        return f"status {ans.status}: {ans.error}"
    if 400 <= ans.status < 500:
        return None if "4xx" in req.expect else f"status {ans.status}: {ans.error}"
    if ans.status != 200:
        return f"status {ans.status}"
    if req.expect == "4xx":
        return "answered 200; vLLM should refuse a non-object kv_transfer_params"
    if ans.error:
        return ans.error
    want = ref[: req.max_tokens]
    if sorted(ans.choices) != list(range(req.n)):
        return f"choices {sorted(ans.choices)} for n={req.n}"
    bad = {i: ids for i, ids in ans.choices.items() if ids != want}
    return f"tokens {bad} != reference {want}" if bad else None


def log_count(server: VLLMServer, needle: str) -> int:
    assert server.log_path is not None
    return server.log_path.read_text(errors="replace").count(needle)


# --------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def proxy(pd_pair: PDPair, tiny_model: str) -> Iterator[ProxyServer]:
    """The proxy in front of the shared pair; always-transfer, so every well-formed request moves KV."""
    args = [
        "--prefill",
        pd_pair.spec("prefill"),
        "--decode",
        pd_pair.spec("decode"),
        "--tokenizer",
        tiny_model,
        "--shared-secret",
        SECRET,
        "--policy",
        "always-transfer",
    ]
    with ProxyServer("unused", args=args, name="hostile-proxy") as server:
        yield server


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=2 * CONCURRENCY, max_keepalive_connections=2 * CONCURRENCY)
    with httpx.Client(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        yield client


def _healthy(client: httpx.Client, server: VLLMServer) -> bool:
    try:
        return server.alive() and client.get(server.url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------------------------------- tests


def test_the_review_crashes_are_served_locally_and_transfers_still_work(
    pd_pair: PDPair, tiny_model: str, http: httpx.Client
) -> None:
    rng = random.Random(SEED + 1)
    warned = log_count(pd_pair.decode, "ignoring kv_transfer_params")
    for host, port in (("127.0.0.1", "abc"), ("bad host", pd_pair.p_side)):
        prompt = _ids(rng, 150)
        ref = tokens(complete(pd_pair.prefill, tiny_model, prompt, max_tokens=MAX_TOKENS))
        req = Req("review", "decode", 0, MAX_TOKENS, False)
        params = {
            "do_remote_prefill": True,
            "transfer_id": uuid.uuid4().hex,
            "remote_host": host,
            "remote_port": port,
        }
        for stream in (False, True):
            req.stream = stream
            body = {**body_of(req, prompt, tiny_model), "kv_transfer_params": params}
            problem = check(req, send(http, pd_pair.decode.url, body), ref)
            assert problem is None, f"{params}: {problem}"
    # Four refusals, each logged by the connector's validation (before anything could dial).
    assert log_count(pd_pair.decode, "ignoring kv_transfer_params") >= warned + 4
    assert _healthy(http, pd_pair.decode) and _healthy(http, pd_pair.prefill)

    # A normal transfer through the same pair still moves every block (the transfer thread is alive).
    prompt = _ids(rng, 300)
    ref = tokens(complete(pd_pair.prefill, tiny_model, prompt, max_tokens=MAX_TOKENS))
    ext_before = metric(pd_pair.decode, *EXT)
    tid = uuid.uuid4().hex
    d_params = decode_params_for(pd_pair.p_side, tid)
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(complete, pd_pair.decode, tiny_model, prompt, MAX_TOKENS, kv_transfer_params=d_params)
        p_params = prefill_params(tid)
        ex.submit(complete, pd_pair.prefill, tiny_model, prompt, 1, kv_transfer_params=p_params).result()
        assert tokens(fd.result()) == ref
    recv = find_trace(pd_pair.trace, tid, "recv")
    assert recv["state"] == "done" and recv["bytes"] > 0, recv
    assert metric(pd_pair.decode, *EXT) - ext_before >= len(prompt) - 1
    wait_kv_idle(pd_pair.prefill)
    wait_kv_idle(pd_pair.decode)


def test_hostile_params_storm_leaves_the_pair_healthy_and_correct(
    pd_pair: PDPair, proxy: ProxyServer, tiny_model: str, http: httpx.Client
) -> None:
    t_start = time.monotonic()
    rng = random.Random(SEED)
    trap, sink = Listener(garbage=False, seed=SEED), Listener(garbage=True, seed=SEED)
    try:
        ports = Ports(
            trap=trap.port, sink=sink.port, closed=free_port(), p_side=pd_pair.p_side, d_side=pd_pair.d_side
        )
        # Prompts for the direct requests (two of the same length for cross-prompt pairs), then one fresh prompt per
        # proxied request, so each proxied request has KV that decode lacks and must transfer.
        lengths = [1, 3, 17, 60, 127, 128, 129, 200, 200, 257, 300]
        prompts = [_ids(rng, n) for n in lengths]
        n_pool = len(prompts)
        prompts += [_ids(rng, rng.randrange(1, 400)) for _ in range(N_PROXY + 1)]
        with cf.ThreadPoolExecutor(4) as ex:
            refs = list(
                ex.map(lambda p: tokens(complete(pd_pair.prefill, tiny_model, p, MAX_TOKENS)), prompts)
            )

        hostile = Hostile(rng, ports, n_pool, same_len=(7, 8)).generate(N_HOSTILE)
        withheld = [(r, why) for r in hostile if (why := crashes_parser(r.params)) is not None]
        hostile = [r for r in hostile if crashes_parser(r.params) is None]
        proxied = [
            Req("proxy", "proxy", n_pool + i, rng.choice([4, 6, MAX_TOKENS]), rng.random() < 0.5)
            for i in range(N_PROXY)
        ]
        plain = [
            Req(
                "plain",
                rng.choice(["prefill", "decode"]),
                rng.randrange(n_pool),
                MAX_TOKENS,
                rng.random() < 0.5,
            )
            for _ in range(N_PLAIN)
        ]
        # Interleave: the well-formed requests are spread through the hostile sequence.
        requests = list(hostile)
        for req in proxied + plain:
            requests.insert(rng.randrange(len(requests) + 1), req)
        ext_before = metric(pd_pair.decode, *EXT)
        urls = {"prefill": pd_pair.prefill.url, "decode": pd_pair.decode.url, "proxy": proxy.url}

        def one(req: Req) -> tuple[Req, Answer]:
            t0 = time.monotonic()
            try:
                ans = send(http, urls[req.target], body_of(req, prompts[req.prompt], tiny_model))
            except httpx.HTTPError as exc:  # a timeout or a dropped connection: reported below
                ans = Answer(0, {}, {}, f"{type(exc).__name__}: {exc}")
            ans.seconds = time.monotonic() - t0
            return req, ans

        with cf.ThreadPoolExecutor(CONCURRENCY) as ex:
            results = list(ex.map(one, requests))
        storm_s = time.monotonic() - t_start

        failures = [
            f"{req.describe()}\n    -> after {ans.seconds:.1f} s: {problem}"
            for req, ans in results
            if (problem := check(req, ans, refs[req.prompt])) is not None
        ]
        kinds: dict[str, int] = {}
        for req, ans in results:
            key = f"{req.kind.split(':')[0]} {ans.status}"
            kinds[key] = kinds.get(key, 0) + 1
        summary = ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))
        slowest = max(ans.seconds for _, ans in results)
        health = {s.name: _healthy(http, s) for s in (pd_pair.prefill, pd_pair.decode, proxy)}
        print(
            f"\n{len(results)} requests in {storm_s:.0f} s, slowest {slowest:.0f} s ({summary}); "
            f"sink saw {sink.accepted} connections, trap {trap.accepted}; healthy: {health}"
        )
        assert failures == [], f"{len(failures)} of {len(results)} requests went wrong:\n" + "\n".join(
            failures[:80]
        )
        assert sum(1 for req, ans in results if req.expect == "4xx" and 400 <= ans.status < 500) >= 1

        # The pair and the proxy are up and serving.
        for server in (pd_pair.prefill, pd_pair.decode, proxy):
            assert _healthy(http, server), f"{server.name} is not healthy after the storm"
        # No request whose params fail validation reached a socket.
        assert trap.accepted == 0, f"{trap.accepted} connections reached the trap port {trap.port}"

        # The proxied requests really transferred (decode got prompt tokens over the wire).
        paths = [ans.headers.get("x-disagg-path", "") for req, ans in results if req.target == "proxy"]
        transferred = [p for p in paths if p.startswith("transfer") and "fallback" not in p]
        assert len(transferred) >= N_PROXY // 2, paths
        wire = sum(len(prompts[req.prompt]) - 1 for req, _ in results if req.target == "proxy")
        assert metric(pd_pair.decode, *EXT) - ext_before >= wire // 2

        # A fresh well-formed greedy request after the storm: through the proxy, equal to a single instance's answer.
        last = prompts[-1]
        req = Req("after", "proxy", len(prompts) - 1, MAX_TOKENS, False)
        ans = send(http, proxy.url, body_of(req, last, tiny_model))
        assert check(req, ans, refs[-1]) is None, (ans, refs[-1])
        assert ans.headers.get("x-disagg-path", "").startswith("transfer"), ans.headers
        direct = tokens(complete(pd_pair.decode, tiny_model, last, max_tokens=MAX_TOKENS))
        assert ans.choices[0] == direct == refs[-1][:MAX_TOKENS]

        # Every KV block comes back: held prefills after their 15 s lease, parked loads after load_timeout_s.
        wait_kv_idle(pd_pair.prefill, timeout=45)
        wait_kv_idle(pd_pair.decode, timeout=45)
        print(f"storm test took {time.monotonic() - t_start:.0f} s")
        if withheld:  # test_parser_raises_only_transfer_params_errors fails on these
            warnings.warn(
                f"{len(withheld)} hostile requests were not sent: parse_transfer_params raises something other than "
                "TransferParamsError on them, which kills the engine (vLLM calls it in add_request), e.g. "
                + "; ".join(f"{why} for {r.describe()}" for r, why in withheld[:3]),
                stacklevel=1,
            )
    finally:
        trap.close()
        sink.close()


def test_parser_raises_only_transfer_params_errors() -> None:
    """Every hostile value the storm can generate, and more: parse_transfer_params returns or raises
    TransferParamsError (the connector catches only that; anything else escapes into vLLM's scheduler)."""
    ports = Ports(trap=23456, sink=23457, closed=23458, p_side=23459, d_side=23460)
    gen = Hostile(random.Random(SEED), ports, 10, same_len=(7, 8))
    samples = [r.params for r in gen.generate(5000)]
    samples += [
        {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1", "remote_port": p}
        for p in [*_bad_ports(23456), "\u00b3", "\u2460", "1\u00b2", "\u0663\u0660", "\U0001d7ea"]
    ]
    crashes: dict[str, Any] = {}  # error -> the first params that raised it
    for params in samples:
        why = crashes_parser(params)
        if why is not None:
            crashes.setdefault(why, params)
    for params in samples:  # the generator's own contract: only params that fail validation name the trap
        try:
            parsed = parse_transfer_params(params)
        except Exception:
            continue
        assert not (isinstance(parsed, RemotePrefill) and parsed.port == ports.trap), params
    listing = "\n".join(f"{why}  <- {json.dumps(p, default=repr)[:200]}" for why, p in crashes.items())
    assert crashes == {}, f"parse_transfer_params raised other errors (each kills the engine):\n{listing}"


def test_params_not_vouched_for_neither_dial_nor_pin_kv(pd_pair: PDPair, tiny_model: str) -> None:
    """A client calling the instances directly, without the shared secret: a well-formed do_remote_prefill naming
    its own listener is served locally and never dialled; a do_remote_decode keeps the prompt's KV only
    unvouched_lease_s (5 s), not lease_s (15 s here)."""
    trap = Listener(garbage=False)
    try:
        prompt = random_prompt(300, 17300)
        ref = tokens(complete(pd_pair.prefill, tiny_model, prompt, max_tokens=MAX_TOKENS))
        lure = {"do_remote_prefill": True, "transfer_id": uuid.uuid4().hex, "remote_host": "127.0.0.1"}
        lure["remote_port"] = trap.port
        out = complete(pd_pair.decode, tiny_model, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=lure)
        assert tokens(out) == ref
        assert log_count(pd_pair.decode, "is not vouched for") >= 1
        pin = {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex}
        complete(pd_pair.prefill, tiny_model, random_prompt(600, 17301), max_tokens=1, kv_transfer_params=pin)
        wait_kv_idle(
            pd_pair.prefill, timeout=11
        )  # the 5 s unvouched lease, with room; the 15 s lease fails this
    finally:
        trap.close()
    assert trap.accepted == 0
