"""Two transfer engines in one process over real loopback TCP, with numpy-backed KV caches."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from support.listeners import Listener
from support.side_channel_peer import guarded_router
from support.transfer_engines import BLOCK_BYTES, LAYERS, geometry, make, wait_results

from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.transport.engine import TransferEngine
from vllm_disagg.transport.nixl import nixl_available
from vllm_disagg.wire import MAGIC, make_hello

TRANSPORTS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl absent")),
]


@pytest.fixture(params=TRANSPORTS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    p, d = make("P", seed=1, transport=request.param), make("D", seed=None, transport=request.param)
    assert p.data_path == d.data_path == request.param
    yield p, d
    p.close()
    d.close()


def _offer_all(p: TransferEngine, tid: str, p_blocks: list[int]) -> None:
    for layer in range(LAYERS):
        p.offer_blocks(tid, layer, list(enumerate(p_blocks)))


def _assert_moved(p: TransferEngine, d: TransferEngine, p_blocks: list[int], d_blocks: list[int]) -> None:
    """Every layer of each of prefill's blocks is in decode's corresponding block, byte for byte."""
    for layer in range(LAYERS):
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert bytes(p.store.read(layer, pb)) == bytes(d.store.read(layer, db))


def test_layerwise_transfer_moves_exact_bytes_and_frees_both(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    p, d = pair
    p_blocks, d_blocks = [3, 7, 1, 9], [5, 6, 2, 11]
    p.begin_send("t1", "req-p", prompt_len=15)
    d.start_load("req-d", "t1", ("127.0.0.1", p.port), d_blocks, first_block=0, prompt_len=15)
    time.sleep(0.2)  # D registered before P computes: the parallel flow
    _offer_all(p, "t1", p_blocks)
    res = wait_results(d, lambda r: "req-d" in r.finished_recving)
    assert res.failed_recving == set()
    _assert_moved(p, d, p_blocks, d_blocks)
    p.finish_send("t1", aborted=False)
    wait_results(p, lambda r: "req-p" in r.finished_sending)
    assert p.stats["bytes_sent"] == LAYERS * 4 * BLOCK_BYTES


@pytest.mark.skipif(not nixl_available(), reason="nixl absent")
def test_a_nixl_decode_waiting_for_prefill_polls_only_for_announced_writes() -> None:
    """NIXL's notices wake nothing, so decode must poll for them; registered long before prefill computes, it
    polls quickly only for the writes prefill announced (``Posted``) and slowly otherwise: half a second of waiting
    costs tens of I/O loop turns, not one a millisecond. The blocks then arrive as usual."""
    p, d = make("P", seed=1, transport="nixl"), make("D", seed=None, transport="nixl")
    try:
        p_blocks, d_blocks = [3, 7, 1, 9], [5, 6, 2, 11]
        p.begin_send("tw", "req-p", prompt_len=15)
        d.start_load("req-d", "tw", ("127.0.0.1", p.port), d_blocks, first_block=0, prompt_len=15)
        time.sleep(0.2)  # handshake and registration
        before = d.stats["io_turns"]
        time.sleep(0.5)
        assert d.stats["io_turns"] - before < 100  # polling every millisecond: ~500
        _offer_all(p, "tw", p_blocks)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == set()
        _assert_moved(p, d, p_blocks, d_blocks)
    finally:
        p.close()
        d.close()


def test_late_registration_is_served_from_held_blocks(pair: tuple[TransferEngine, TransferEngine]) -> None:
    p, d = pair
    p.begin_send("t2", "req-p", prompt_len=8)
    _offer_all(p, "t2", [0, 1])
    p.finish_send("t2", aborted=False)  # prefill finished long before decode shows up (sequential flow)
    time.sleep(0.3)
    d.start_load("req-d", "t2", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
    wait_results(d, lambda r: "req-d" in r.finished_recving)
    wait_results(p, lambda r: "req-p" in r.finished_sending)
    assert bytes(d.store.read(2, 5)) == bytes(p.store.read(2, 1))


def test_prefix_held_by_decode_is_not_sent(pair: tuple[TransferEngine, TransferEngine]) -> None:
    p, d = pair
    p.begin_send("t3", "req-p", prompt_len=16)
    d.start_load("req-d", "t3", ("127.0.0.1", p.port), [8, 9], first_block=2, prompt_len=16)
    time.sleep(0.2)
    _offer_all(p, "t3", [0, 1, 2, 3])
    res = wait_results(d, lambda r: "req-d" in r.finished_recving)
    assert not res.failed_recving
    assert d.stats["bytes_received"] == LAYERS * 2 * BLOCK_BYTES  # only blocks 2 and 3
    assert bytes(d.store.read(0, 8)) == bytes(p.store.read(0, 2))


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ({}, {"block_size": 8}),
        # another logical block shape is refused whatever the page order
        (
            {"kv_layout": "cuda:bfloat16:(2, 4, 64):order=0123"},
            {"kv_layout": "cuda:bfloat16:(4, 2, 64):order=0123"},
        ),
    ],
)
def test_incompatible_geometry_is_refused(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    p, d = make("P", 1, geo=geometry(**ours)), make("D", None, geo=geometry(**theirs))
    try:
        d.start_load("req-d", "t4", ("127.0.0.1", p.port), [1], first_block=0, prompt_len=4)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == {"req-d"}
        # refused in zmq's handshake (a peer without credentials), counted on both sides
        assert d.stats["handshakes_refused"] == 1
        deadline = time.monotonic() + 5
        while p.stats["handshakes_refused"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.stats["handshakes_refused"] >= 1
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(not nixl_available(), reason="nixl absent")
def test_pages_in_another_physical_order_pair_over_tcp_not_nixl() -> None:
    """FlashAttention's pages (LBNHC) and FlashInfer's (LBHNC) hold the same logical blocks in another dim order:
    TCP carries blocks in logical order and writes them through decode's own strides, so such a pair transfers over
    TCP; NIXL, which moves raw pages, is not chosen for it."""
    p = make("P", seed=1, transport="nixl", geo=geometry(kv_layout="cuda:bfloat16:(2, 4, 64):order=0123"))
    d = make("D", seed=None, transport="nixl", geo=geometry(kv_layout="cuda:bfloat16:(2, 4, 64):order=0213"))
    try:
        p.begin_send("to", "req-p", prompt_len=8)
        d.start_load("req-d", "to", ("127.0.0.1", p.port), [5, 6], first_block=0, prompt_len=8)
        time.sleep(0.2)
        _offer_all(p, "to", [3, 7])
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == set()
        _assert_moved(p, d, [3, 7], [5, 6])
        peer = d._receiver.peers[("127.0.0.1", p.port)]
        assert peer.path is not None and peer.path.name == "tcp"
        assert p.stats["handshakes_refused"] == 0
    finally:
        p.close()
        d.close()


def test_peer_without_secret_is_refused() -> None:
    p, d = make("P", 1, secret=b"s3cret"), make("D", None)
    try:
        d.start_load("req-d", "t5", ("127.0.0.1", p.port), [1], first_block=0, prompt_len=4)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == {"req-d"}
        assert p.stats["handshakes_refused"] == 1
    finally:
        p.close()
        d.close()


def test_matching_secret_is_accepted() -> None:
    p, d = make("P", 1, secret=b"s3cret"), make("D", None, secret=b"s3cret")
    try:
        p.begin_send("t6", "req-p", prompt_len=4)
        d.start_load("req-d", "t6", ("127.0.0.1", p.port), [1], first_block=0, prompt_len=4)
        p.offer_blocks("t6", 0, [(0, 2)])
        p.offer_blocks("t6", 1, [(0, 2)])
        p.offer_blocks("t6", 2, [(0, 2)])
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert not res.failed_recving
    finally:
        p.close()
        d.close()


def test_dead_prefill_mid_transfer_fails_the_load_fast() -> None:
    p, d = make("P", 1), make("D", None)
    try:
        p.begin_send("t7", "req-p", prompt_len=8)
        d.start_load("req-d", "t7", ("127.0.0.1", p.port), [1, 2], first_block=0, prompt_len=8)
        time.sleep(0.2)
        p.offer_blocks("t7", 0, [(0, 0), (1, 1)])  # one layer of three, then P dies
        time.sleep(0.2)
        t0 = time.monotonic()
        p.close()
        res = wait_results(d, lambda r: "req-d" in r.finished_recving, timeout=8)
        assert res.failed_recving == {"req-d"}
        assert time.monotonic() - t0 < 5.0  # well before load_timeout_s=10
    finally:
        d.close()


def test_decode_abort_frees_both_sides(pair: tuple[TransferEngine, TransferEngine]) -> None:
    p, d = pair
    p.begin_send("t8", "req-p", prompt_len=8)
    d.start_load("req-d", "t8", ("127.0.0.1", p.port), [1, 2], first_block=0, prompt_len=8)
    time.sleep(0.2)
    d.cancel_load("t8")
    res = wait_results(d, lambda r: "req-d" in r.finished_recving)
    assert res.failed_recving == set()  # cancelled, not failed: nothing to recompute
    p.finish_send("t8", aborted=False)
    wait_results(p, lambda r: "req-p" in r.finished_sending, timeout=3)


def test_prefill_abort_tells_decode_to_recompute(pair: tuple[TransferEngine, TransferEngine]) -> None:
    p, d = pair
    p.begin_send("t9", "req-p", prompt_len=8)
    d.start_load("req-d", "t9", ("127.0.0.1", p.port), [1, 2], first_block=0, prompt_len=8)
    time.sleep(0.2)
    p.finish_send("t9", aborted=True)
    wait_results(p, lambda r: "req-p" in r.finished_sending, timeout=3)
    res = wait_results(d, lambda r: "req-d" in r.finished_recving, timeout=3)
    assert res.failed_recving == {"req-d"}


def test_lease_expires_when_decode_never_registers() -> None:
    p = make("P", 1, lease_s=0.5)
    try:
        p.begin_send("t10", "req-p", prompt_len=4)
        p.offer_blocks("t10", 0, [(0, 0)])
        p.finish_send("t10", aborted=False)
        wait_results(p, lambda r: "req-p" in r.finished_sending, timeout=5)
        assert p.stats["leases_expired"] == 1
    finally:
        p.close()


def test_load_times_out_when_prefill_never_sees_the_request() -> None:
    p, d = make("P", 1), make("D", None, load_timeout_s=0.8)
    try:
        d.start_load("req-d", "t11", ("127.0.0.1", p.port), [1], first_block=0, prompt_len=4)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving, timeout=5)
        assert res.failed_recving == {"req-d"}
    finally:
        p.close()
        d.close()


def test_unreachable_prefill_fails_after_connect_timeout() -> None:
    d = make("D", None, connect_timeout_s=0.5)
    try:
        d.start_load("req-d", "t12", ("127.0.0.1", 1), [1], first_block=0, prompt_len=4)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving, timeout=5)
        assert res.failed_recving == {"req-d"}
    finally:
        d.close()


def test_a_send_with_no_connection_returns_instead_of_blocking() -> None:
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        hello = make_hello(None, "D", geometry(), "0")
        assert SideChannel(router).tell(dealer, hello) is False  # a DEALER with no peer: zmq would block here
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


def test_loads_from_a_port_that_answers_garbage_all_fail_and_the_engine_keeps_serving() -> None:
    """A port that answers the ZMTP greeting with junk: zmq tears that connection down, after which the DEALER has
    no peer to send to. Dialled again and again (as hostile params can make decode do), no send may wait for it."""
    sink = Listener(garbage=True)
    p, d = make("P", 1), make("D", None, connect_timeout_s=1.0, load_timeout_s=3.0)
    try:
        started: list[str] = []
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            for host in ("127.0.0.1", "localhost", "127.1"):
                rid = f"sink-{len(started)}"
                d.start_load(rid, f"t-{rid}", (host, sink.port), [1], first_block=0, prompt_len=4)
                started.append(rid)
            time.sleep(0.005)
        res = wait_results(d, lambda r: r.finished_recving >= set(started), timeout=8)
        assert res.failed_recving == set(started)
        assert sink.accepted > 0
        # The I/O thread still turns: a real transfer completes.
        p.begin_send("t-real", "req-p", prompt_len=4)
        d.start_load("req-d", "t-real", ("127.0.0.1", p.port), [2], first_block=0, prompt_len=4)
        _offer_all(p, "t-real", [3])
        ok = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert ok.failed_recving == set()
        assert bytes(p.store.read(0, 3)) == bytes(d.store.read(0, 2))
    finally:
        p.close()
        d.close()
        sink.close()


@pytest.mark.parametrize(
    "frames",
    [
        [b"garbage"],
        [MAGIC, b"\x00\x01\x02"],
        [b"XXXXX", b"{}"],
        [MAGIC, b"\xc1" * 100],
        [MAGIC, b"", b"x" * 10],
    ],
)
def test_malformed_side_channel_input_is_rejected_and_engine_keeps_serving(
    pair: tuple[TransferEngine, TransferEngine], frames: list[bytes]
) -> None:
    p, d = pair
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{p.port}")
    s.send_multipart(frames)
    deadline = time.monotonic() + 5
    while p.stats["messages_rejected"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    assert p.stats["messages_rejected"] >= 1
    test_late_registration_is_served_from_held_blocks((p, d))


@pytest.mark.skipif(not nixl_available(), reason="nixl absent")
def test_a_decode_keeps_its_nixl_offer_back_until_prefill_proves_the_secret() -> None:
    """NIXL's offer is what lets a prefill write into decode's cache (its agent metadata and every layer's address).
    With a shared secret, decode names the path without it, and offers it in full only after the prefill's HelloAck
    proves the secret: a host a request named as its prefill learns nothing of decode's memory otherwise."""
    from vllm_disagg.wire import HelloAck, PathOffer, decode, encode, hello_ack_auth

    secret = b"s3cret"
    fake = guarded_router(secret)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    d = make("D", None, secret=secret, transport="nixl")

    def hello() -> tuple[bytes, Any]:
        assert fake.poll(5000), "no hello from decode"
        identity, *frames = fake.recv_multipart()
        msg, _ = decode(frames)
        return identity, msg

    def offers(msg: Any) -> dict[str, bytes]:
        return {o.name: o.info for o in msg.data_paths if isinstance(o, PathOffer)}

    try:
        d.start_load("r1", "t1", ("127.0.0.1", port), [4, 5], first_block=0, prompt_len=8)
        identity, first = hello()
        assert offers(first)["nixl"] == b"" and "tcp" in offers(first)
        # a prefill that cannot prove the secret gets nothing more
        fake.send_multipart([identity, *encode(HelloAck(engine_id="P", geometry=geometry(), data_path="nixl",
                                                         auth="00" * 32))])  # fmt: skip
        assert not fake.poll(500)
        d.start_load("r2", "t2", ("127.0.0.1", port), [6, 7], first_block=0, prompt_len=8)
        identity, again = hello()
        assert offers(again)["nixl"] == b""
        ack = HelloAck(engine_id="P", geometry=geometry(), data_path="nixl",
                       auth=hello_ack_auth(secret, "P", again.nonce))  # fmt: skip
        fake.send_multipart([identity, *encode(ack)])
        _, full = hello()  # proved: greeted again, in full
        assert offers(full)["nixl"] != b"" and full.nonce != again.nonce
    finally:
        d.close()
        fake.close()


@pytest.mark.skipif(not nixl_available(), reason="nixl absent")
def test_with_a_secret_a_nixl_pair_still_transfers_over_nixl() -> None:
    p = make("P", seed=1, transport="nixl", secret=b"s3cret")
    d = make("D", seed=None, transport="nixl", secret=b"s3cret")
    try:
        p_blocks, d_blocks = [3, 7], [5, 6]
        p.begin_send("ts", "req-p", prompt_len=8)
        d.start_load("req-d", "ts", ("127.0.0.1", p.port), d_blocks, first_block=0, prompt_len=8)
        time.sleep(0.2)
        _offer_all(p, "ts", p_blocks)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == set()
        _assert_moved(p, d, p_blocks, d_blocks)
        peer = d._receiver.peers[("127.0.0.1", p.port)]
        assert peer.path is not None and peer.path.name == "nixl"
    finally:
        p.close()
        d.close()
