"""Fuzz the side channel: garbage into a real TransferEngine's ZMQ ROUTER (and into a decode, from a fake prefill).

What must hold whatever arrives: the I/O thread lives, every bad message is counted and answered with a Refuse,
nothing is remembered for a peer that never completed a handshake, a malicious prefill can never write outside the
blocks a load asked for, and a normal transfer still works afterwards. Plus property tests of ``wire.decode``.

Examples are fixed in number and derandomized; the engines use the TCP data path on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import zmq
import zmq.utils.monitor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.side_channel_peer import RawPeer, expect_refused, guarded_router, refusals
from support.transfer_engines import BLOCK_BYTES, BLOCKS, LAYERS, geometry, make, wait_results

from vllm_disagg import __version__
from vllm_disagg.transport.engine import TransferEngine
from vllm_disagg.transport.sender import REFUSALS_PER_PEER
from vllm_disagg.transport.zmq_auth import HANDSHAKE_FAILED
from vllm_disagg.wire import (
    MAGIC,
    MAX_CONTROL_BYTES,
    WIRE_VERSION,
    Abort,
    Describe,
    Description,
    Done,
    Heartbeat,
    Hello,
    HelloAck,
    LayerBlocks,
    Message,
    Posted,
    Refuse,
    Register,
    Release,
    WireError,
    decode,
    decode_layer_notice,
    encode,
    hello_ack_auth,
    make_describe,
    make_hello,
    make_release,
    pack_indices,
)

SECRET = b"fuzz-side-channel-secret"
MESSAGE_TYPES: tuple[type[Any], ...] = (
    Hello,
    HelloAck,
    Refuse,
    Register,
    Heartbeat,
    Done,
    Abort,
    LayerBlocks,
    Describe,
    Description,
    Release,
)
FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_ids = itertools.count()

# ----------------------------------------------------------------------------------------------- helpers


def state_sizes(engine: TransferEngine) -> dict[str, int]:
    return engine.snapshot()


def assert_transfer_works(
    p: TransferEngine, d: TransferEngine, p_blocks: list[int], d_blocks: list[int]
) -> None:
    """A complete layer-wise transfer P -> D with exact bytes, and P's blocks released afterwards."""
    n = next(_ids)
    tid, req_p, req_d = f"ok-{n}", f"req-p-{n}", f"req-d-{n}"
    prompt_len = 4 * len(p_blocks)
    p.begin_send(tid, req_p, prompt_len=prompt_len)
    d.start_load(req_d, tid, ("127.0.0.1", p.port), d_blocks, first_block=0, prompt_len=prompt_len)
    for layer in range(LAYERS):
        p.offer_blocks(tid, layer, list(enumerate(p_blocks)))
    res = wait_results(d, lambda r: req_d in r.finished_recving)
    assert res.failed_recving == set()
    for layer in range(LAYERS):
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert bytes(p.store.read(layer, pb)) == bytes(d.store.read(layer, db))
    p.finish_send(tid, aborted=False)
    wait_results(p, lambda r: req_p in r.finished_sending)


# ----------------------------------------------------------------------------------------------- strategies

INT64 = st.integers(-(2**63), 2**63 - 1)
# A non-ASCII proof kills the I/O thread (test_non_ascii_proof_does_not_kill_the_io_thread, a known bug): the
# fuzzers send ASCII proofs only, so that they keep checking everything else.
AUTH = st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=64)


def _from_type(t: mi.Type) -> st.SearchStrategy[Any]:
    """A value of a msgspec field type (ints kept encodable, strings short)."""
    if isinstance(t, mi.IntType):
        return st.one_of(st.integers(-3, 40), INT64)
    if isinstance(t, mi.FloatType):
        return st.floats()
    if isinstance(t, mi.StrType):
        return st.text(max_size=24)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=24)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(_from_type(t.item_type), max_size=5)
    if isinstance(t, mi.UnionType):
        return st.one_of([_from_type(x) for x in t.types])
    if isinstance(t, mi.StructType):
        cls = t.cls
        fields = {f.name: AUTH if f.name == "auth" else _from_type(f.type) for f in t.fields}
        return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))
    raise TypeError(f"no strategy for {t}")


def struct_of(cls: type[Any]) -> st.SearchStrategy[Any]:
    return _from_type(mi.type_info(cls))


def layer_frames(consistent: bool) -> st.SearchStrategy[list[bytes]]:
    """A LayerBlocks header with its payload frames; unless ``consistent``, their count or sizes disagree."""

    @st.composite
    def build(draw: st.DrawFn) -> list[bytes]:
        n = draw(st.integers(0, 4))
        size = draw(st.integers(0, 64))
        header = LayerBlocks(
            transfer_id=draw(st.text(max_size=12)),
            layer=draw(st.integers(-2, LAYERS + 1)),
            block_indices=pack_indices(draw(st.lists(st.integers(-3, 6), min_size=n, max_size=n))),
            block_bytes=size,
        )
        sizes = [size] * n
        if not consistent:
            sizes = draw(
                st.one_of(
                    st.lists(st.just(size), max_size=6).filter(lambda s: len(s) != n),  # wrong count
                    st.lists(st.integers(0, 70), min_size=max(n, 1), max_size=max(n, 1)).filter(
                        lambda s: any(x != size for x in s)  # a wrong size
                    ),
                )
            )
        return [*encode(header), *(b"\x07" * s for s in sizes)]

    return build()


MSGPACK_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=16),
    st.binary(max_size=16),
)
MSGPACK_JUNK = st.recursive(
    MSGPACK_SCALAR,
    lambda c: (
        st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), c, max_size=4)
    ),
    max_leaves=12,
)


def _struct_info(cls: type[Any]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


FIELD_NAMES = sorted({f.name for cls in MESSAGE_TYPES for f in _struct_info(cls).fields})
TAGS = [_struct_info(cls).tag for cls in MESSAGE_TYPES]
TAGGED_JUNK = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(TAGS), MSGPACK_SCALAR)},
    optional={
        name: MSGPACK_JUNK.filter(lambda v: not isinstance(v, str)) | AUTH if name == "auth" else MSGPACK_JUNK
        for name in FIELD_NAMES
    },
)
VALID_CONTROL = st.one_of([struct_of(cls) for cls in MESSAGE_TYPES if cls is not LayerBlocks])
VALID_FRAMES = st.one_of(VALID_CONTROL.map(encode), layer_frames(consistent=True))


def _truncated(frames: list[bytes], cut: float) -> list[bytes]:
    body = frames[1]
    return [MAGIC, body[: int(len(body) * cut) if len(body) > 1 else 0]]


@st.composite
def bad_hello(draw: st.DrawFn) -> list[bytes]:
    """Hellos a secret-protected prefill must refuse: wrong version, wrong/absent MAC, stale, tampered."""
    kind = draw(st.sampled_from(["version", "wrong-secret", "no-secret", "stale", "tampered"]))
    hello = make_hello(SECRET, "decode-x", geometry(), __version__)
    if kind == "version":
        version = draw(st.one_of(st.integers(-5, 5), INT64).filter(lambda v: v != WIRE_VERSION))
        hello = msgspec.structs.replace(hello, wire_version=version)
    elif kind == "wrong-secret":
        secret = draw(st.binary(min_size=1, max_size=32).filter(lambda s: s != SECRET))
        hello = make_hello(secret, "decode-x", geometry(), __version__)
    elif kind == "no-secret":
        hello = make_hello(None, "decode-x", geometry(), __version__)
    elif kind == "stale":
        skew = draw(st.floats(301, 1e7)) * draw(st.sampled_from([-1, 1]))
        hello = make_hello(SECRET, "decode-x", geometry(), __version__, now=time.time() + skew)
    else:
        hello = msgspec.structs.replace(
            hello, engine_id=draw(st.text(max_size=12).filter(lambda e: e != "decode-x"))
        )
    return encode(hello)


GARBAGE = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=6),  # random frames
    st.lists(st.binary(max_size=8), min_size=7, max_size=64),  # many frames
    st.tuples(st.just(MAGIC), st.binary(max_size=128)).map(list),  # right magic, random body
    MSGPACK_JUNK.map(lambda j: [MAGIC, msgspec.msgpack.encode(j)]),  # right magic, random msgpack
    TAGGED_JUNK.map(lambda j: [MAGIC, msgspec.msgpack.encode(j)]),  # a real tag, random fields
    st.tuples(VALID_FRAMES, st.floats(0, 0.999)).map(lambda t: _truncated(*t)),  # truncated valid message
    st.tuples(st.binary(max_size=8).filter(lambda m: m != MAGIC), VALID_FRAMES).map(
        lambda t: [t[0], *t[1][1:]]
    ),
    st.tuples(VALID_CONTROL.map(encode), st.lists(st.binary(max_size=8), min_size=1, max_size=3)).map(
        lambda t: [*t[0], *t[1]]  # a control message with payload frames
    ),
    layer_frames(consistent=False),  # payload count/sizes disagree with the header
    VALID_FRAMES,  # well-formed, but before any handshake
    bad_hello(),
    struct_of(Describe).map(encode),  # random proof
    st.builds(lambda s: encode(make_describe(s, "proxy")), st.binary(min_size=1, max_size=16)),
    struct_of(Release).map(encode),  # random proof
    st.builds(  # a wrong secret
        lambda s, t: encode(make_release(s, "proxy", t, "x")), st.binary(min_size=1, max_size=16), st.text()
    ),
)

# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def prefill() -> Iterator[TransferEngine]:
    p = make("P", seed=1, secret=SECRET, transport="tcp")
    yield p
    p.close()


@pytest.fixture
def decode_engine() -> Iterator[TransferEngine]:
    d = make("D", seed=None, secret=SECRET, transport="tcp")
    yield d
    d.close()


# ----------------------------------------------------------------------------------------------- engine fuzz


def test_unauthenticated_garbage_is_refused_counted_and_forgotten(
    prefill: TransferEngine, decode_engine: TransferEngine
) -> None:
    """500 bad messages from 8 identities at a time: each one Refuse and one count (a connection that used up its
    refusals is replaced by a new one); no transfer state kept; transfers still work."""
    p = prefill
    peers = [RawPeer(p.port, SECRET) for _ in range(8)]
    told = [0] * len(peers)
    sent = 0

    @settings(FUZZ, max_examples=500)
    @given(frames=GARBAGE, who=st.integers(0, len(peers) - 1))
    def run(frames: list[bytes], who: int) -> None:
        nonlocal sent
        if told[who] == REFUSALS_PER_PEER:
            peers[who].close()
            peers[who], told[who] = RawPeer(p.port, SECRET), 0
        expect_refused(p, peers[who], frames)
        told[who] += 1
        sent += 1

    try:
        run()
        assert sent >= 500
        assert refusals(p) == sent
        # nothing is held for peers that never completed a handshake
        assert state_sizes(p) == dict.fromkeys(state_sizes(p), 0)
        assert_transfer_works(p, decode_engine, [3, 7, 1], [5, 6, 2])
        assert state_sizes(p)["decodes"] == 1 and not state_sizes(p)["outgoing"]
    finally:
        for peer in peers:
            peer.close()


def test_a_peer_that_never_reads_is_refused_a_bounded_number_of_times(prefill: TransferEngine) -> None:
    """Messages without a handshake, sent without reading the answers: every one is counted, only the first
    REFUSALS_PER_PEER are answered, so the prefill's queue to that peer stays bounded."""
    p = prefill
    peer = RawPeer(p.port, SECRET)
    register = encode(Register(transfer_id="t", request_id="r", first_block=0, num_blocks=1, prompt_len=4))
    try:
        before = refusals(p)
        for _ in range(10 * REFUSALS_PER_PEER):
            peer.send(register)
        deadline = time.monotonic() + 10
        while refusals(p) < before + 10 * REFUSALS_PER_PEER and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refusals(p) == before + 10 * REFUSALS_PER_PEER
        replies = peer.drain(quiet=0.3)
        assert len(replies) == REFUSALS_PER_PEER and all(isinstance(r, Refuse) for r in replies)
        assert p._thread.is_alive()
    finally:
        peer.close()


def test_oversized_control_messages_are_refused(
    prefill: TransferEngine, decode_engine: TransferEngine
) -> None:
    """Just over the limit: refused with a reason. Far over it: zmq drops the connection before buffering the
    frame (MAXMSGSIZE on the ROUTER), so an unauthenticated peer cannot make prefill hold large frames."""
    p = prefill
    peer = RawPeer(p.port, SECRET)
    try:
        reply = expect_refused(p, peer, [MAGIC, b"\x00" * (MAX_CONTROL_BYTES + 1)])
        assert "exceeds" in reply.reason
        huge_hello = make_hello(SECRET, "d", geometry(), "x" * MAX_CONTROL_BYTES)  # valid, but too big
        for frames in (
            [MAGIC, b"\x91" * (8 * MAX_CONTROL_BYTES)],
            encode(huge_hello),
            [MAGIC, msgspec.msgpack.encode(["x" * MAX_CONTROL_BYTES])],
            [MAGIC, b"\x00" * (64 << 20)],
        ):
            big = RawPeer(p.port, SECRET)
            try:
                big.send(frames)
                replies = big.drain(quiet=0.5)  # just over: refused; far over: dropped unread
                assert all(isinstance(r, Refuse) and "exceeds" in r.reason for r in replies), replies
                if len(frames[1]) > 2 * MAX_CONTROL_BYTES:
                    assert replies == []
            finally:
                big.close()
            assert p._thread.is_alive()
        assert state_sizes(p) == dict.fromkeys(state_sizes(p), 0)
        assert_transfer_works(p, decode_engine, [0, 1], [8, 9])
    finally:
        peer.close()


def test_authenticated_peer_junk_is_survived_and_leases_bound_its_state(
    decode_engine: TransferEngine,
) -> None:
    """A peer that knows the secret, then misbehaves: Register for unknown transfers, Done/Heartbeat for made-up ids,
    messages only decode should get, garbage. The thread lives and what it made P hold expires with the lease."""
    p = make("P", seed=1, secret=SECRET, transport="tcp", lease_s=0.5)
    peer = RawPeer(p.port, SECRET)
    peer.handshake(SECRET)
    junk = st.one_of(
        struct_of(Register).map(encode),
        struct_of(Heartbeat).map(encode),
        struct_of(Done).map(encode),
        VALID_FRAMES,
        GARBAGE,
    )

    @settings(FUZZ, max_examples=150)
    @given(frames=junk)
    def run(frames: list[bytes]) -> None:
        peer.send(frames)
        peer.sync(f"sync-{next(_ids)}")  # everything before it was handled
        assert p._thread.is_alive()

    try:
        run()
        assert p.stats["messages_rejected"] > 0
        # and one Register for a transfer prefill never saw, whatever the examples held
        unknown = Register(
            transfer_id="never-seen", request_id="r", first_block=0, num_blocks=1, prompt_len=16
        )
        peer.send(encode(unknown))
        peer.sync(f"sync-{next(_ids)}")
        deadline = time.monotonic() + 5  # leases (0.5 s) expire, then their tombstones (0.5 s)
        while any(state_sizes(p)[k] for k in ("outgoing", "tombstones", "draining")):
            assert time.monotonic() < deadline, state_sizes(p)
            time.sleep(0.05)
        assert p.stats["leases_expired"] > 0  # Registers for unknown transfers were held, then let go
        assert state_sizes(p)["decodes"] == 1  # one handshake, however many Hellos followed it
        peer.drain()
        assert_transfer_works(p, decode_engine, [2, 4], [10, 11])
    finally:
        peer.close()
        p.close()


class FakePrefill:
    """A ROUTER that shakes hands like a prefill (proving ``secret``), then sends whatever the test wants."""

    def __init__(self, secret: bytes | None = SECRET, **geometry_changes: object) -> None:
        self.secret = secret
        self.geometry = geometry(**geometry_changes)
        self.sock: zmq.Socket[Any] = guarded_router(secret)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port: int = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def await_register(self, transfer_id: str, timeout: float = 5.0) -> bytes:
        """Answer Hellos, ignore the rest, until the decode registers ``transfer_id``; returns its identity."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(50):
                continue
            identity, *body = self.sock.recv_multipart()
            msg, _ = decode(body)
            if isinstance(msg, Hello):
                auth = hello_ack_auth(self.secret, "fake", msg.nonce)
                ack = HelloAck(engine_id="fake", geometry=self.geometry, auth=auth)
                self.sock.send_multipart([identity, *encode(ack)])
            elif isinstance(msg, Register) and msg.transfer_id == transfer_id:
                return identity
        raise AssertionError(f"decode never registered {transfer_id}")

    def close(self) -> None:
        self.sock.close(linger=0)


@st.composite
def hostile_layer(draw: st.DrawFn, transfer_id: str) -> list[bytes]:
    """Data for the right transfer, with a layer, indices, sizes or frame count a decode must not trust."""
    indices = draw(st.lists(st.integers(-2, 3), max_size=4))
    size = draw(st.sampled_from([BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES - 1, BLOCK_BYTES + 1, 0]))
    header = LayerBlocks(
        transfer_id=transfer_id,
        layer=draw(st.integers(-1, LAYERS)),
        block_indices=pack_indices(indices),
        block_bytes=size,
    )
    count = draw(st.sampled_from([len(indices), len(indices), len(indices) + 1, max(len(indices) - 1, 0)]))
    return [*encode(header), *(b"\xee" * size for _ in range(count))]


@st.composite
def honest_layer(draw: st.DrawFn, transfer_id: str) -> list[bytes]:
    """A well-formed layer message for the load's own blocks: the scripts also reach the write path."""
    indices = draw(st.lists(st.integers(0, 1), min_size=1, max_size=2, unique=True))
    header = LayerBlocks(
        transfer_id=transfer_id,
        layer=draw(st.integers(0, LAYERS - 1)),
        block_indices=pack_indices(indices),
        block_bytes=BLOCK_BYTES,
    )
    return [*encode(header), *(b"\xee" * BLOCK_BYTES for _ in indices)]


def test_hostile_prefill_never_writes_outside_the_destination_blocks(decode_engine: TransferEngine) -> None:
    """A fake prefill answers loads with garbage and lying layer headers: the decode stays up, every load ends
    (failed unless complete), and no block other than the load's destination blocks is ever written."""
    d = decode_engine
    fake = FakePrefill()
    dest = [5, 6]

    @st.composite
    def script(draw: st.DrawFn, tid: str) -> list[list[bytes]]:
        step = st.one_of(
            hostile_layer(tid),
            hostile_layer(tid),
            honest_layer(tid),
            GARBAGE,
            VALID_CONTROL.map(encode),
            st.builds(lambda r: encode(Abort(transfer_id=tid, reason=r)), st.text(max_size=8)),
            # writes announced that never come (or a nonsense count): decode polls for them until the load ends
            st.builds(lambda n: encode(Posted(transfer_id=tid, writes=n)), st.integers(-(2**40), 2**40)),
        )
        return draw(st.lists(step, max_size=6))

    @settings(FUZZ, max_examples=40)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        n = next(_ids)
        tid, req = f"hostile-{n}", f"req-{n}"
        steps = data.draw(script(tid))  # before the load starts: hypothesis may abandon an example mid-draw
        d.start_load(req, tid, ("127.0.0.1", fake.port), dest, first_block=0, prompt_len=8)
        identity = fake.await_register(tid)
        for frames in steps:
            fake.sock.send_multipart([identity, *frames])
        fake.sock.send_multipart([identity, *encode(Abort(transfer_id=tid, reason="end of script"))])
        wait_results(d, lambda r: req in r.finished_recving, timeout=5)
        assert d._thread.is_alive()
        for layer in range(LAYERS):
            for block in range(BLOCKS):
                if block not in dest:
                    assert not d.store.layers[layer][block].any(), (layer, block)  # type: ignore[attr-defined]

    def one_honest_layer_then_abort() -> None:
        """A script that surely writes: one well-formed layer for the load's own blocks, then an abort. (Whether
        the drawn scripts write depends on the draws, which also depend on what ran before in the session.)"""
        n = next(_ids)
        tid, req = f"hostile-{n}", f"req-{n}"
        d.start_load(req, tid, ("127.0.0.1", fake.port), dest, first_block=0, prompt_len=8)
        identity = fake.await_register(tid)
        header = LayerBlocks(
            transfer_id=tid, layer=0, block_indices=pack_indices([0, 1]), block_bytes=BLOCK_BYTES
        )
        fake.sock.send_multipart([identity, *encode(header), b"\xee" * BLOCK_BYTES, b"\xee" * BLOCK_BYTES])
        fake.sock.send_multipart([identity, *encode(Abort(transfer_id=tid, reason="end of script"))])
        wait_results(d, lambda r: req in r.finished_recving, timeout=5)

    try:
        one_honest_layer_then_abort()
        assert d.stats["bytes_received"] > 0  # hostile traffic below meets a decode that has written blocks
        run()
        for layer in range(LAYERS):
            for block in range(BLOCKS):
                if block not in dest:
                    assert not d.store.layers[layer][block].any(), (layer, block)  # type: ignore[attr-defined]
        assert d.stats["messages_rejected"] > 0 and d.stats["loads_failed"] > 0
        assert not d.snapshot()["incoming"]
        p = make("P", seed=3, secret=SECRET, transport="tcp")
        try:
            assert_transfer_works(p, d, [1, 2], dest)
        finally:
            p.close()
    finally:
        fake.close()


@pytest.mark.parametrize("kind", ["hello", "describe", "release"])
def test_non_ascii_proof_does_not_kill_the_io_thread(prefill: TransferEngine, kind: str) -> None:
    now = time.time()
    msg: Message = (
        Hello(
            wire_version=WIRE_VERSION,
            connector_version=__version__,
            engine_id="d",
            geometry=geometry(),
            nonce="n",
            ts=now,
            auth="\xe9",
        )
        if kind == "hello"
        else Describe(engine_id="proxy", nonce="n", ts=now, auth="\xe9")
        if kind == "describe"
        else Release(transfer_id="t", reason="r", engine_id="proxy", nonce="n", ts=now, auth="\xe9")
    )
    peer = RawPeer(prefill.port, SECRET)
    try:
        peer.send(encode(msg))
        deadline = time.monotonic() + 5
        while prefill._thread.is_alive() and not peer.sock.poll(20) and time.monotonic() < deadline:
            pass
        # (a dead thread has finished logging its traceback: no concurrent ast.parse with pytest's report)
        assert prefill._thread.is_alive(), "the side channel's I/O thread died"
        assert isinstance(peer.recv(), Refuse)
    finally:
        peer.close()


# ----------------------------------------------------------------------------------------------- wire.decode


ANY_FRAMES = st.one_of(
    st.lists(st.binary(max_size=64), max_size=6),
    GARBAGE,
    VALID_FRAMES,
)


@settings(FUZZ, max_examples=1000)
@given(frames=ANY_FRAMES, as_memoryview=st.booleans())
def test_decode_raises_only_wire_error(frames: list[bytes], as_memoryview: bool) -> None:
    arg: list[Any] = [memoryview(f) for f in frames] if as_memoryview else frames
    try:
        msg, payload = decode(arg)
    except WireError:
        return
    assert isinstance(msg, MESSAGE_TYPES)
    assert not payload or isinstance(msg, LayerBlocks)


@settings(FUZZ, max_examples=300)
@given(frames=VALID_FRAMES)
def test_valid_messages_round_trip(frames: list[bytes]) -> None:
    msg, payload = decode(frames)
    assert encode(msg)[1] == frames[1]  # re-encodes byte for byte (NaN-safe, unlike ==)
    assert [bytes(f) for f in payload] == frames[2:]


@settings(FUZZ, max_examples=200)
@given(frames=VALID_FRAMES, extra=st.binary(min_size=1, max_size=8))
def test_every_truncation_or_extension_of_a_valid_message_is_rejected(
    frames: list[bytes], extra: bytes
) -> None:
    body = frames[1]
    for cut in range(len(body)):
        with pytest.raises(WireError):
            decode([MAGIC, body[:cut], *frames[2:]])
    with pytest.raises(WireError):
        decode([MAGIC, body + extra, *frames[2:]])


def test_control_message_size_limit_is_exact() -> None:
    overhead = len(encode(Refuse(reason=""))[1]) + 4  # msgpack str32 header for a long reason
    at_limit = encode(Refuse(reason="x" * (MAX_CONTROL_BYTES - overhead)))
    assert len(at_limit[1]) == MAX_CONTROL_BYTES
    assert isinstance(decode(at_limit)[0], Refuse)
    over = encode(Refuse(reason="x" * (MAX_CONTROL_BYTES - overhead + 1)))
    with pytest.raises(WireError, match="exceeds"):
        decode(over)
    with pytest.raises(WireError, match="exceeds"):
        decode_layer_notice(b"\x00" * (MAX_CONTROL_BYTES + 1))


@settings(FUZZ, max_examples=300)
@given(
    body=st.one_of(
        st.binary(max_size=128), MSGPACK_JUNK.map(msgspec.msgpack.encode), VALID_FRAMES.map(lambda f: f[1])
    )
)
def test_decode_layer_notice_raises_only_wire_error(body: bytes) -> None:
    try:
        notice = decode_layer_notice(body)
    except WireError:
        return
    assert isinstance(notice, LayerBlocks)


def test_decode_refuses_a_prefill_that_cannot_prove_the_secret(decode_engine: TransferEngine) -> None:
    """Mutual authentication: a listener a client named, without the secret, gets no Register (and so no blocks,
    no destination ids); the load fails at once and decode recomputes."""
    fake = FakePrefill(secret=b"not the secret")
    try:
        decode_engine.start_load(
            "req-x", "t-x", ("127.0.0.1", fake.port), [5, 6], first_block=0, prompt_len=8
        )
        with pytest.raises(AssertionError, match="never registered"):
            fake.await_register("t-x", timeout=1.5)
        res = wait_results(decode_engine, lambda r: "req-x" in r.finished_recving)
        assert res.failed_recving == {"req-x"}
        assert decode_engine.stats["handshakes_refused"] == 1
    finally:
        fake.close()


def test_a_replayed_hello_is_refused(prefill: TransferEngine) -> None:
    """The same captured proof on a second connection is refused (nonces remembered for the skew window)."""
    hello = encode(make_hello(SECRET, "d", geometry(), __version__))
    first, second = RawPeer(prefill.port, SECRET), RawPeer(prefill.port, SECRET)
    try:
        first.send(hello)
        assert isinstance(first.recv(), HelloAck)
        second.send(hello)
        reply = second.recv()
        assert isinstance(reply, Refuse) and "replayed" in reply.reason
    finally:
        first.close()
        second.close()


def test_a_prefill_repeating_a_block_that_arrived_does_not_keep_the_load_alive() -> None:
    """The load's deadline counts from the last block that arrived for the first time: a block sent again is no
    progress (nor counted bytes), so a prefill that only repeats itself sees the load fail at load_timeout_s."""
    d = make("D", seed=None, secret=SECRET, transport="tcp", load_timeout_s=1.0)
    fake = FakePrefill()
    try:
        d.start_load("r-dup", "dup", ("127.0.0.1", fake.port), [5, 6], first_block=0, prompt_len=8)
        identity = fake.await_register("dup")
        header = LayerBlocks(
            transfer_id="dup", layer=0, block_indices=pack_indices([0]), block_bytes=BLOCK_BYTES
        )
        t0 = time.monotonic()
        failed = False
        while time.monotonic() - t0 < 6 and not failed:  # the same block every 0.4 s, well inside the timeout
            fake.sock.send_multipart([identity, *encode(header), b"\xee" * BLOCK_BYTES])
            time.sleep(0.4)
            failed = "r-dup" in d.poll_results().failed_recving
        assert failed, "a load fed only repeats never timed out"
        assert d.stats["bytes_received"] == BLOCK_BYTES  # the block once, however often it came
    finally:
        fake.close()
        d.close()


def test_a_heartbeat_naming_many_unknown_transfers_draws_a_bounded_number_of_aborts(
    prefill: TransferEngine, decode_engine: TransferEngine
) -> None:
    p = prefill
    peer = RawPeer(p.port, SECRET)
    peer.handshake(SECRET)
    try:
        peer.send(encode(Heartbeat(transfer_ids=[f"made-up-{i}" for i in range(20_000)])))
        seen = peer.sync(f"sync-{next(_ids)}")
        aborts = [m for m in seen if isinstance(m, Abort)]
        assert 0 < len(aborts) <= 1024
        assert_transfer_works(p, decode_engine, [0, 1], [8, 9])
    finally:
        peer.close()


def test_a_flood_on_the_side_channel_does_not_hold_the_io_loop(decode_engine: TransferEngine) -> None:
    """Junk arriving faster than it is refused: the loop still turns between batches of messages, so leases and
    loads keep their deadlines and a transfer still completes during the flood."""
    p = make("P", seed=1, secret=SECRET, transport="tcp")
    peers = [RawPeer(p.port, SECRET) for _ in range(4)]
    stop = threading.Event()

    def flood(peer: RawPeer) -> None:
        junk = [MAGIC, b"\xc1"]
        while not stop.is_set():
            with contextlib.suppress(zmq.Again):
                for _ in range(1000):
                    peer.sock.send_multipart(junk, zmq.NOBLOCK)

    threads = [threading.Thread(target=flood, args=(peer,), daemon=True) for peer in peers]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert_transfer_works(p, decode_engine, [0, 1], [8, 9])
        turns = p.stats["io_turns"]
        time.sleep(0.5)
        assert p.stats["io_turns"] > turns
        assert p.stats["messages_rejected"] > 0
    finally:
        stop.set()
        for t in threads:
            t.join()
        for peer in peers:
            peer.close()
        p.close()


def test_a_refused_peer_is_named_by_its_address_in_the_log(
    prefill: TransferEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator must be able to tell which host sends junk: the warning names the peer's IP address."""
    peer = RawPeer(prefill.port, SECRET)
    try:
        with caplog.at_level("WARNING", logger="vllm_disagg.transfer"):
            expect_refused(prefill, peer, [MAGIC, b"\xc1"])
            deadline = time.monotonic() + 5
            while "malformed message from 127.0.0.1" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.02)
    finally:
        peer.close()


def test_decode_refuses_a_prefill_whose_kv_layout_differs(
    decode_engine: TransferEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill checks decode's geometry; decode checks prefill's too (an older or broken prefill may not): the load
    fails at once, naming the field, instead of waiting for blocks it cannot use."""
    fake = FakePrefill(block_size=8)
    try:
        with caplog.at_level("ERROR", logger="vllm_disagg.transfer"):
            decode_engine.start_load(
                "r-geo", "geo", ("127.0.0.1", fake.port), [5, 6], first_block=0, prompt_len=8
            )
            deadline = time.monotonic() + 5
            while not fake.sock.poll(50):
                assert time.monotonic() < deadline, "decode never greeted"
            identity, *body = fake.sock.recv_multipart()
            hello, _ = decode(body)
            assert isinstance(hello, Hello)
            ack = HelloAck(
                engine_id="fake", geometry=fake.geometry, auth=hello_ack_auth(SECRET, "fake", hello.nonce)
            )
            fake.sock.send_multipart([identity, *encode(ack)])
            r = wait_results(decode_engine, lambda r: "r-geo" in r.finished_recving, timeout=5)
        assert "r-geo" in r.failed_recving
        assert "block_size is 8 on prefill but 4 here (decode)" in caplog.text
    finally:
        fake.close()


@pytest.mark.parametrize("credentials", [None, b"another secret"], ids=["none", "wrong"])
def test_a_peer_without_the_secrets_credentials_has_nothing_read(
    prefill: TransferEngine, credentials: bytes | None
) -> None:
    """With a shared secret, zmq's handshake must prove it before zmq reads a frame: a peer without it cannot make
    prefill buffer a multipart message (zmq holds one whole until its last frame, whatever the frame limit), nor
    reach the engine's message handling at all. The refusal is counted on both ends, and a peer with the secret is
    still served."""
    p = prefill
    before_rejected, before_refused = p.stats["messages_rejected"], p.stats["handshakes_refused"]
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    if credentials is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, b"vllm-disagg")
        sock.setsockopt(zmq.PLAIN_PASSWORD, credentials)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
    sock.connect(f"tcp://127.0.0.1:{p.port}")
    try:
        event = zmq.utils.monitor.recv_monitor_message(monitor) if monitor.poll(5000) else None
        assert event is not None and event["event"] & HANDSHAKE_FAILED, event
        with contextlib.suppress(zmq.Again):  # queued here at most: there is no connection for it to leave on
            sock.send_multipart([b"x" * 1024] * 64, zmq.NOBLOCK)
        deadline = time.monotonic() + 5
        while p.stats["handshakes_refused"] == before_refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.stats["handshakes_refused"] > before_refused
        peer = RawPeer(p.port, SECRET)
        peer.handshake(SECRET)
        peer.send([b"junk"])  # the same junk from a peer with the credentials is read (and refused)
        assert isinstance(peer.recv(), Refuse)
        peer.close()
        assert p.stats["messages_rejected"] == before_rejected + 1
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
