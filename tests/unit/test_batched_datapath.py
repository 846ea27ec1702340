"""The data path's per-layer batching: Python work per layer, not per block, on both sides and every path.

Counts calls and frames instead of timing anything (benchmarks/transport.py measures the CPU): a layer's offer is
one write, a layer message is a few frames, decode writes each frame with one scatter, the gather ring stays
bounded and reuses its memory, NIXL merges adjacent blocks, and the device store gathers and scatters once per
layer on vLLM-shaped views.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from support.transfer_engines import geometry

from vllm_disagg.transport import engine as engine_mod
from vllm_disagg.transport import sender as sender_mod
from vllm_disagg.transport import tcp as tcp_mod
from vllm_disagg.transport.block_store import HostBlockStore, block_runs
from vllm_disagg.transport.datapath import WriteDeferred
from vllm_disagg.transport.engine import EngineSettings, TransferEngine
from vllm_disagg.transport.nixl import merged_runs, nixl_available
from vllm_disagg.transport.tcp import GatherRing, TcpPath
from vllm_disagg.wire import (
    MAX_FRAME_BYTES,
    LayerBlocks,
    WireError,
    block_views,
    decode,
    decode_layer_notice,
    encode,
    pack_indices,
)


def host_store(layers: int, blocks: int, bb: int, seed: int | None = 0) -> HostBlockStore:
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(0, 255, (blocks, bb), dtype=np.uint8)
        if seed is not None
        else np.zeros((blocks, bb), np.uint8)
        for _ in range(layers)
    ]
    return HostBlockStore(arrays)


class _Done:
    done = True


class _Busy:
    done = False


class RecordingChannel:
    """The side channel's send, recorded: what a layer message looks like on the wire."""

    def __init__(self, tracker: Any = None) -> None:
        self.sent: list[list[Any]] = []
        self.tracker = tracker

    def send_layer(self, identity: bytes, frames: list[Any]) -> Any:
        self.sent.append([bytes(f) for f in frames])
        return self.tracker


def tcp_path(store: HostBlockStore, channel: RecordingChannel, verify: bool = False) -> TcpPath:
    return TcpPath(store, channel, verify)  # type: ignore[arg-type]


@contextlib.contextmanager
def tcp_engines(
    src: HostBlockStore, dst: HostBlockStore, **settings: Any
) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """A prefill engine over ``src`` and a decode engine over ``dst`` on loopback, TCP data path."""
    geo = geometry(num_layers=src.num_layers, block_bytes=src.block_bytes)
    opts: dict[str, Any] = dict(bind_host="127.0.0.1", transport="tcp", load_timeout_s=20.0, **settings)
    p = TransferEngine(src, geo, "P", EngineSettings(**opts))
    d = TransferEngine(dst, geo, "D", EngineSettings(**opts))
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def wait_loaded(d: TransferEngine, loads: set[str], timeout: float = 20.0) -> None:
    """Until decode finished ``loads``; none may fail."""
    deadline = time.monotonic() + timeout
    done: set[str] = set()
    while done != loads and time.monotonic() < deadline:
        r = d.poll_results()
        assert not r.failed_recving
        done |= r.finished_recving
        time.sleep(0.01)
    assert done == loads


# --------------------------------------------------------------------------------------------- block store


def test_block_runs_finds_adjacent_ids() -> None:
    assert block_runs([]) == []
    assert block_runs([4]) == [(0, 1)]
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3), (3, 5), (5, 6)]


def test_host_store_reads_runs_zero_copy_and_gathers_into_out() -> None:
    s = host_store(2, 16, 8)
    runs = s.read_blocks(1, [2, 3, 4, 9])
    assert len(runs) == 2 and bytes(runs[0]) == s.layers[1][2:5].tobytes()
    assert np.shares_memory(np.frombuffer(runs[0], np.uint8), s.layers[1])  # a view, not a copy
    out = memoryview(bytearray(64))
    got = s.read_blocks(1, [9, 2, 7], out=out)
    assert len(got) == 1 and bytes(got[0]) == s.layers[1][[9, 2, 7]].tobytes()


def test_host_store_writes_multi_block_frames_to_scattered_blocks() -> None:
    s = host_store(1, 16, 8, seed=None)
    data = np.arange(5 * 8, dtype=np.uint8)
    s.write_blocks(0, [7, 1, 12, 3, 4], [data[:24].tobytes(), data[24:].tobytes()])
    assert s.layers[0][[7, 1, 12, 3, 4]].tobytes() == data.tobytes()
    assert not s.layers[0][[0, 2, 5, 6, 8]].any()
    with pytest.raises(ValueError):
        s.write_blocks(0, [1, 2, 3], [data[:16].tobytes()])


def test_host_store_moves_the_same_blocks_of_several_layers_as_one_frame() -> None:
    """A multi-layer message's frame is the layers' gathers back to back, and decode scatters it layer by layer."""
    src, dst = host_store(5, 16, 8), host_store(5, 16, 8, seed=None)
    ids, dest = [9, 2, 7], [1, 15, 4]
    out = memoryview(bytearray(3 * 3 * 8))
    src.read_layers(1, 3, ids, "t", out)
    assert bytes(out) == b"".join(src.layers[layer][ids].tobytes() for layer in (1, 2, 3))
    dst.write_layers(1, 3, dest, [out])
    assert all(dst.layers[layer][dest].tobytes() == src.layers[layer][ids].tobytes() for layer in (1, 2, 3))
    assert not dst.layers[0].any() and not dst.layers[4].any()
    with pytest.raises(ValueError):
        dst.write_layers(1, 2, dest, [out])  # not the frame of two layers


# --------------------------------------------------------------------------------------------- wire


def test_layer_frames_may_hold_several_blocks_but_exactly_the_headers() -> None:
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2]), block_bytes=4)
    msg, payload = decode([*encode(header), b"a" * 8, b"b" * 4])
    assert isinstance(msg, LayerBlocks) and [bytes(b) for b in block_views(payload, 4)] == [
        b"aaaa",
        b"aaaa",
        b"bbbb",
    ]
    for bad in ([b"a" * 8], [b"a" * 12, b"b" * 4], [b"a" * 6, b"b" * 6], [b"a" * 12, b""]):
        with pytest.raises(WireError):
            decode([*encode(header), *bad])


def test_layer_indices_travel_packed_and_a_partial_index_is_refused() -> None:
    header = LayerBlocks(
        transfer_id="t", layer=0, block_indices=pack_indices([5, 0, 2**31 - 1]), block_bytes=4
    )
    msg, _ = decode([*encode(header), b"x" * 12])
    assert (
        isinstance(msg, LayerBlocks) and msg.indices().tolist() == [5, 0, 2**31 - 1] and msg.num_blocks == 3
    )
    bad = LayerBlocks(transfer_id="t", layer=0, block_indices=b"\x01\x00\x00", block_bytes=4)
    with pytest.raises(WireError, match="whole int32"):
        decode([*encode(bad), b"x" * 4])
    with pytest.raises(WireError, match="whole int32"):
        decode_layer_notice(encode(bad)[1])


def test_host_store_zero_byte_blocks_take_only_empty_frames() -> None:
    s = HostBlockStore([np.zeros((4, 0), np.uint8)])
    s.write_blocks(0, [1, 2], [b"", b""])
    with pytest.raises(ValueError):
        s.write_blocks(0, [1], [b"x"])


# --------------------------------------------------------------------------------------------- TCP path


def test_small_scattered_blocks_are_gathered_into_one_frame_per_layer() -> None:
    s, ch = host_store(2, 64, 1024), RecordingChannel(_Done())
    path = tcp_path(s, ch)
    src = [40, 3, 17, 9, 22, 5, 60, 31]
    header = LayerBlocks(
        transfer_id="t", layer=1, block_indices=pack_indices(list(range(8))), block_bytes=1024
    )
    path.write(b"d", "t", "o", 1, src, None, header)
    frames = ch.sent[0][2:]
    assert len(frames) == 1 and frames[0] == s.layers[1][src].tobytes()


def test_a_run_of_adjacent_blocks_is_one_zero_copy_frame() -> None:
    s, ch = host_store(1, 64, 1024), RecordingChannel(_Done())
    path = tcp_path(s, ch)
    header = LayerBlocks(
        transfer_id="t", layer=0, block_indices=pack_indices(list(range(6))), block_bytes=1024
    )
    path.write(b"d", "t", "o", 0, [10, 11, 12, 13, 14, 15], None, header)
    assert [len(f) for f in ch.sent[0][2:]] == [6 * 1024]
    assert path.ring.in_use() == 0  # nothing gathered


def test_large_blocks_go_zero_copy_one_frame_per_run() -> None:
    bb = 512 << 10
    s, ch = host_store(1, 8, bb), RecordingChannel(_Done())
    path = tcp_path(s, ch)
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2]), block_bytes=bb)
    path.write(b"d", "t", "o", 0, [5, 1, 2], None, header)
    assert [len(f) for f in ch.sent[0][2:]] == [bb, 2 * bb] and path.ring.in_use() == 0


def test_checksums_stay_per_block_when_frames_hold_several() -> None:
    s, ch = host_store(1, 32, 256), RecordingChannel(_Done())
    path = tcp_path(s, ch, verify=True)
    src = [4, 9, 1, 20]
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2, 3]), block_bytes=256)
    path.write(b"d", "t", "o", 0, src, None, header)
    msg, payload = decode(ch.sent[0])
    assert isinstance(msg, LayerBlocks) and len(msg.crc32) == 4
    import zlib

    assert msg.crc32 == [zlib.crc32(s.layers[0][b].tobytes()) for b in src]


def test_gather_ring_is_bounded_and_reused_once_zmq_let_go() -> None:
    ring = GatherRing(capacity=100)
    a = ring.take(60)
    assert a is not None
    assert ring.take(60) is None  # full while the first slot is in flight
    slot, _ = a
    slot.sent, slot.tracker = True, _Busy()
    assert ring.take(50) is None
    slot.tracker = _Done()  # type: ignore[assignment]
    b = ring.take(50)
    assert b is not None and ring.in_use() == 50
    c = ring.take(40)  # after b: [50, 90)
    assert c is not None and c[0].start == 50
    b[0].sent = True  # b done: the next slot wraps to the front, before c
    d = ring.take(45)
    assert d is not None and d[0].start == 0
    assert ring.take(10) is None  # [45, 50) and [90, 100) are too small or behind c
    assert ring.take(101) is None


class _Tracker:
    """A zmq tracker the test finishes by hand."""

    def __init__(self) -> None:
        self.done = False


def test_a_full_ring_defers_a_write_until_zmq_lets_go() -> None:
    """While other writes hold the ring, a write that does not fit sends nothing and raises WriteDeferred (the
    sender retries it): sending its blocks one frame each would cost more CPU per byte just when the socket is
    the bottleneck. Once zmq lets go of the slot, the retry is gathered as usual."""
    tracker = _Tracker()
    s, ch = host_store(1, 64, 1024), RecordingChannel(tracker)
    path = tcp_path(s, ch)
    path.ring = GatherRing(capacity=4096)  # room for one 4-block gather
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2, 3]), block_bytes=1024)
    path.write(b"d", "t", "o", 0, [1, 7, 3, 9], None, header)
    with pytest.raises(WriteDeferred):
        path.write(b"d", "t", "o", 0, [2, 8, 4, 10], None, header)  # first slot still held by zmq
    assert len(ch.sent) == 1 and path.ring.in_use() == 4096
    tracker.done = True
    path.write(b"d", "t", "o", 0, [2, 8, 4, 10], None, header)
    assert [len(m) - 2 for m in ch.sent] == [1, 1]  # header (2 frames) + one gathered frame each
    assert ch.sent[1][2] == s.layers[0][[2, 8, 4, 10]].tobytes()


def test_a_deferred_write_gives_back_the_slots_it_took(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_mod, "MAX_FRAME_BYTES", 2048)  # two blocks per gathered frame
    s, ch = host_store(1, 64, 1024), RecordingChannel(_Tracker())
    path = tcp_path(s, ch)
    path.ring = GatherRing(capacity=6144)
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1]), block_bytes=1024)
    path.write(b"d", "t", "o", 0, [1, 7], None, header)  # holds 2 KiB
    header4 = LayerBlocks(
        transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2, 3]), block_bytes=1024
    )
    path.write(b"d", "t", "o", 0, [2, 8, 4, 10], None, header4)  # holds 4 KiB more: the ring is full
    with pytest.raises(WriteDeferred):  # its first frame's slot is taken before the second's does not fit
        path.write(b"d", "t", "o", 0, [3, 9, 5, 11], None, header4)
    assert path.ring.in_use() == 6144 and len(ch.sent) == 2


def test_a_write_too_big_for_an_idle_ring_goes_zero_copy() -> None:
    """An idle ring that cannot hold a write never will: its blocks go one frame per run instead of waiting."""
    s, ch = host_store(1, 64, 1024), RecordingChannel(_Busy())
    path = tcp_path(s, ch)
    path.ring = GatherRing(capacity=2048)
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2, 3]), block_bytes=1024)
    path.write(b"d", "t", "o", 0, [1, 7, 3, 9], None, header)
    assert [len(m) - 2 for m in ch.sent] == [4]
    assert b"".join(ch.sent[0][2:]) == s.layers[0][[1, 7, 3, 9]].tobytes()


def test_engines_finish_a_transfer_whose_writes_wait_for_the_ring() -> None:
    """Layers offered before decode registered are all written at registration, back to back, on a ring that
    holds one layer (3 MiB, which zmq cannot have sent by the next write): the later layers are deferred and go
    out as the ring drains, and every block lands where decode asked for it."""
    layers, blocks, bb, n = 4, 128, 64 << 10, 48
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst) as (p, d):
        (path,) = p._paths
        assert isinstance(path, TcpPath)
        path.ring = GatherRing(capacity=n * bb)
        ids, dest = list(range(0, 2 * n, 2)), list(range(blocks - n, blocks))
        p.begin_send("t", "r", n * 16)
        for layer in range(layers):
            p.offer_blocks("t", layer, [(i, b) for i, b in enumerate(ids)])
        d.start_load("rd", "t", ("127.0.0.1", p.port), dest, 0, n * 16)
        wait_loaded(d, {"rd"})
        assert p.stats["writes_deferred"] > 0
        for layer in range(layers):
            assert dst.layers[layer][dest].tobytes() == src.layers[layer][ids].tobytes()


# --------------------------------------------------------------------------------------------- sender


class CountingPath:
    """A DataPath that records its writes (prefill side only)."""

    name = "count"
    remote_writes = False
    polled = False
    multi_layer_writes = False
    multi_layer_max_bytes = 1 << 20
    max_write_bytes = 0

    def __init__(self) -> None:
        self.writes: list[tuple[int, list[int], list[int] | None, list[int], int]] = []

    def write(self, peer: bytes, tid: str, owner: str, layer: int, src: Any, dst: Any, header: Any) -> None:
        self.writes.append((layer, list(src), dst, header.indices().tolist(), header.layer_count))

    def in_flight(self, transfer_id: str) -> bool:
        return False

    def blocked(self, transfer_id: str) -> bool:
        return False


def registered_sender(store: HostBlockStore, path: CountingPath, dest: list[int]) -> sender_mod.Sender:
    """A Sender with transfer "t" begun (request "r") and registered by a decode that needs ``dest`` (logical
    blocks 0.. in order), writing through ``path``."""
    from vllm_disagg.transport.parts import EngineParts
    from vllm_disagg.transport.records import Reports
    from vllm_disagg.wire import Register

    s = sender_mod.Sender(
        EngineParts(store, None, "p", EngineSettings(), None, (), Reports(None))  # type: ignore[arg-type]
    )
    n = len(dest)
    s.begin("t", "r", n * 16, "")
    out = s.outgoing["t"]
    out.dest, out.dest_identity, out.path = (
        Register(
            transfer_id="t", request_id="d", first_block=0, num_blocks=n, dest_blocks=dest, prompt_len=n * 16
        ),
        b"d",
        path,  # type: ignore[assignment]
    )
    out.dest_arr = np.asarray(dest)
    return s


def test_an_offer_is_one_write_per_layer_and_its_list_is_converted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers, n = 6, 40
    conversions = 0
    real_array = np.array

    def counting_array(*a: Any, **k: Any) -> Any:
        nonlocal conversions
        if a and isinstance(a[0], list) and a[0] and isinstance(a[0][0], tuple):  # an offer list (numpy calls
            conversions += 1  # np.array itself for other things)
        return real_array(*a, **k)

    monkeypatch.setattr(sender_mod.np, "array", counting_array)
    path = CountingPath()
    dest = list(range(100, 100 + n))
    s = registered_sender(host_store(layers, 64, 8), path, dest)
    for chunk in range(4):  # four prefill chunks of 10 blocks, every layer offered the chunk's one list
        blocks = [(i, 2 * i) for i in range(chunk * 10, chunk * 10 + 10)]
        for layer in range(layers):
            s.offer("t", layer, blocks, 0.0, "r")
            s.flush_offered()
    assert conversions == 4  # once per chunk, not per layer or block
    assert len(path.writes) == 4 * layers
    layer0 = [w for w in path.writes if w[0] == 0]
    assert [w[3] for w in layer0] == [list(range(c * 10, c * 10 + 10)) for c in range(4)]
    assert layer0[1][1] == [2 * i for i in range(10, 20)] and layer0[1][2] == dest[10:20]
    # an offer of blocks already sent, or outside decode's registration, writes nothing
    s.offer("t", 0, [(3, 6), (n + 5, 9)], 0.0, "r")
    s.flush_offered()
    assert len(path.writes) == 4 * layers


def test_layers_offered_together_go_as_one_write_where_the_path_takes_several() -> None:
    """Offers that queued up before a flush (the I/O thread was busy) leave as one write per run of consecutive
    layers sending the same blocks; a layer with other blocks, or after a gap, starts a new write."""
    path = CountingPath()
    path.multi_layer_writes = True
    s = registered_sender(host_store(8, 64, 8), path, list(range(100, 120)))
    step1 = [(i, 2 * i) for i in range(10)]
    step2 = [(i, 2 * i) for i in range(10, 20)]
    for layer in (0, 1, 2, 4, 5):  # layer 3 not computed yet
        s.offer("t", layer, step1, 0.0, "r")
    s.offer("t", 6, step2, 0.0, "r")
    s.flush_offered()
    assert [(w[0], w[4]) for w in path.writes] == [(0, 3), (4, 2), (6, 1)]
    assert path.writes[0][3] == list(range(10)) and path.writes[2][3] == list(range(10, 20))
    for layer in (0, 1, 2, 4, 5, 6):
        s.offer("t", layer, step2 if layer < 6 else step1, 0.0, "r")
    s.flush_offered()
    # layers 0-2 and 4-5 now send step 2 (one write each); layer 6 sends step 1; all as offered, nothing twice
    assert [(w[0], w[4]) for w in path.writes[3:]] == [(0, 3), (4, 2), (6, 1)]
    assert s.stats["bytes_sent"] == 2 * 6 * 10 * 8


class DeferringPath(CountingPath):
    """Defers its next ``defer`` writes (no room yet), then records writes as CountingPath does."""

    multi_layer_writes = True

    def __init__(self, defer: int) -> None:
        super().__init__()
        self.defer = defer

    def write(self, peer: bytes, tid: str, owner: str, layer: int, src: Any, dst: Any, header: Any) -> None:
        if self.defer:
            self.defer -= 1
            raise WriteDeferred
        super().write(peer, tid, owner, layer, src, dst, header)


def test_a_deferred_write_parks_its_layers_and_the_later_ones_until_the_path_has_room() -> None:
    path = DeferringPath(defer=1)
    s = registered_sender(host_store(8, 64, 8), path, list(range(100, 120)))
    step1 = [(i, 2 * i) for i in range(10)]
    for layer in (0, 1, 2):
        s.offer("t", layer, step1, 0.0, "r")
    s.offer("t", 3, [(i, 2 * i) for i in range(10, 20)], 0.0, "r")
    s.flush_offered()  # layers 0-2 are deferred as one write: nothing is sent, layer 3 waits behind them
    assert path.writes == [] and set(s.outgoing["t"].pending) == {0, 1, 2, 3} and "t" in s.parked
    assert s.stats["writes_deferred"] == 1 and s.stats["bytes_sent"] == 0
    s.flush_parked()  # the I/O loop's next turn: room now
    assert [(w[0], w[4]) for w in path.writes] == [(0, 3), (3, 1)] and not s.parked
    assert s.stats["bytes_sent"] == 4 * 10 * 8


def test_a_layer_sends_each_index_once_whatever_order_its_offers_come_in() -> None:
    """Chunks offer rising indices (each layer's mask is then not looked at); an offer below what a layer sent is
    checked against the mask: what was sent is not sent again, the rest is."""
    path = CountingPath()
    s = registered_sender(host_store(2, 16, 8), path, list(range(10)))
    for blocks in ([(4, 4), (5, 5)], [(6, 6)], [(0, 0), (5, 9)], [(1, 1)]):
        for layer in range(2):
            s.offer("t", layer, blocks, 0.0, "r")
        s.flush_offered()
    assert [(w[0], w[1], w[3]) for w in path.writes] == [
        (0, [4, 5], [4, 5]),
        (1, [4, 5], [4, 5]),
        (0, [6], [6]),
        (1, [6], [6]),
        (0, [0], [0]),
        (1, [0], [0]),
        (0, [1], [1]),
        (1, [1], [1]),
    ]


def test_a_multi_layer_write_stays_within_its_byte_budget() -> None:
    """Large layers are not coalesced past COALESCE_MAX_BYTES: decode writes a message only once all of it arrived,
    so a bigger one would only delay its first write."""
    bb = 64 << 10
    per_layer = 6 * bb  # 384 KiB: two layers fit 1 MiB, three do not
    assert 2 * per_layer <= sender_mod.COALESCE_MAX_BYTES < 3 * per_layer
    path = CountingPath()
    path.multi_layer_writes = True
    s = registered_sender(host_store(5, 8, bb), path, list(range(6)))
    step = [(i, i) for i in range(6)]
    for layer in range(5):
        s.offer("t", layer, step, 0.0, "r")
    s.flush_offered()
    assert [(w[0], w[4]) for w in path.writes] == [(0, 2), (2, 2), (4, 1)]


def test_decode_cuts_a_frame_that_spans_layers_at_the_boundary() -> None:
    from vllm_disagg.transport.receiver import _layer_slices

    payload = [b"aaaabb", b"bbcccc"]  # three layers of 4 bytes: the frames straddle the boundaries
    got = _layer_slices(payload, 4, 3)
    assert [b"".join(bytes(x) for x in layer) for layer in got] == [b"aaaa", b"bbbb", b"cccc"]
    assert _layer_slices(payload, 12, 1) == [payload]


def test_engines_move_layers_queued_before_registration_as_multi_layer_messages() -> None:
    """Every layer offered before decode registers goes out on registration: the TCP path sends a step's layers
    as one message (one gathered frame), and decode writes each layer's blocks where they belong."""
    layers, blocks, bb = 4, 64, 512
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst, verify_checksums=True) as (p, d):
        s_ids = [int(x) for x in np.random.default_rng(3).permutation(blocks)[:12]]
        d_ids = [int(x) for x in np.random.default_rng(4).permutation(blocks)[:12]]
        p.begin_send("t", "r", 12 * 16)
        offer = list(enumerate(s_ids))
        for chunk in (offer[:5], offer[5:]):
            for layer in range(layers):
                p.offer_blocks("t", layer, chunk)
        time.sleep(0.2)  # held on prefill: nobody registered yet
        d.start_load("rd", "t", ("127.0.0.1", p.port), d_ids, 0, 12 * 16)
        wait_loaded(d, {"rd"})
        for layer in range(layers):
            assert dst.layers[layer][d_ids].tobytes() == src.layers[layer][s_ids].tobytes()


def wait_registered(p: TransferEngine, timeout: float = 10.0) -> None:
    """Until a decode registered with one of prefill's sends."""
    deadline = time.monotonic() + timeout
    while not any(o.dest_identity for o in list(p._sender.outgoing.values())):
        assert time.monotonic() < deadline, "decode did not register"
        time.sleep(0.01)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _count_writes(p: TransferEngine, name: str = "tcp") -> list[int]:
    """The layer count of each write prefill's ``name`` data path makes from now on."""
    (path,) = [one for one in p._paths if one.name == name]
    counts: list[int] = []
    write = path.write

    def counted(*a: Any) -> None:
        counts.append(a[-1].layer_count)
        write(*a)

    path.write = counted  # type: ignore[method-assign]
    return counts


def test_offers_gather_in_the_window_and_a_forward_end_or_the_last_layer_sends_them() -> None:
    """A layer offered after a quiet spell goes at once; layers offered within a window of the last send (a
    forward pass's pace) wait, and go as one message at the forward pass's end; the model's last layer goes at
    once, so the transfer's tail never waits for the window."""
    layers, blocks, bb = 4, 8, 64
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst, offer_batch_ms=600_000, offer_hold_bytes=0) as (p, d):
        writes = _count_writes(p)
        p.begin_send("t", "r", 64)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [4, 5, 6, 7], 0, 64)
        wait_registered(p)
        step = [(0, 0), (1, 1), (2, 2), (3, 3)]
        p.offer_blocks("t", 0, step)  # after a quiet spell: at once
        wait_until(lambda: bool(dst.layers[0][4:].any()), f"layer 0 was held ({writes})")
        for layer in (1, 2):  # within the window of that send: they wait
            p.offer_blocks("t", layer, step)
        time.sleep(0.1)
        assert writes == [1] and not dst.layers[1].any()
        p.mark_forward_end([])
        deadline = time.monotonic() + 10
        while writes != [1, 2]:
            assert time.monotonic() < deadline, writes
            time.sleep(0.01)
        p.offer_blocks("t", layers - 1, step)
        wait_loaded(d, {"rd"}, timeout=10)
        assert writes == [1, 2, 1]
        assert all(dst.layers[i][4:].tobytes() == src.layers[i][:4].tobytes() for i in range(layers))


def test_offers_go_when_the_window_is_over_or_hold_a_message_worth_of_bytes() -> None:
    """No forward end: offers leave once the window is over; offers of a message's worth of bytes (1 MiB) leave
    at once, however long the window."""
    layers, blocks, bb = 3, 40, 64 << 10
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst, offer_batch_ms=50, offer_hold_bytes=0) as (p, d):
        p.begin_send("t", "r", 32)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [20, 21], 0, 32)
        time.sleep(0.3)
        for layer in range(layers):
            p.offer_blocks("t", layer, [(0, 0), (1, 1)])
        wait_loaded(d, {"rd"}, timeout=10)
    dst = host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst, offer_batch_ms=600_000, offer_hold_bytes=0) as (p, d):
        writes = _count_writes(p)
        p.begin_send("t", "r", 16 * 20)
        dest = list(range(20, 40))
        d.start_load("rd", "t", ("127.0.0.1", p.port), dest, 0, 16 * 20)
        time.sleep(0.3)
        p.offer_blocks("t", 0, [(16, 16)])  # after a quiet spell: goes at once, and opens the window
        p.offer_blocks("t", 1, [(i, i) for i in range(16)])  # exactly 1 MiB: goes at once too
        deadline = time.monotonic() + 10
        while not dst.layers[1][dest[:16]].any():
            assert time.monotonic() < deadline, (
                f"a message's worth of offers waited for the window ({writes})"
            )
            time.sleep(0.01)
        assert dst.layers[1][dest[:16]].tobytes() == src.layers[1][:16].tobytes()


def test_small_offers_wait_for_the_step_end_or_the_hold_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offers under ``offer_hold_bytes`` together do not leave every window, nor at once after a quiet spell: they
    wait for the forward pass's end or the step's last layer. Once offers pass the floor the worker thread wakes
    the I/O thread, and they leave with the window (at once after a quiet spell)."""
    monkeypatch.setattr(engine_mod, "_SMALL_OFFERS_HOLD_S", 600.0)  # no fallback send within the test
    layers, blocks, bb = 6, 8, 1024
    step = [(0, 0), (1, 1)]  # 2 KiB per layer
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst, offer_batch_ms=5, offer_hold_bytes=5 * 1024) as (p, d):
        writes = _count_writes(p)
        p.begin_send("t", "r", 32)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [4, 5], 0, 32)
        wait_registered(p)
        time.sleep(0.05)  # a quiet spell
        for layer in range(2):
            p.offer_blocks("t", layer, step)
            time.sleep(0.05)  # ten windows each: small offers still wait
        assert writes == [] and not dst.layers[0].any()
        p.mark_forward_end([])
        deadline = time.monotonic() + 10
        while writes != [2]:
            assert time.monotonic() < deadline, writes
            time.sleep(0.01)
        time.sleep(0.05)  # a quiet spell: the next offers past the floor go at once
        for layer in range(2, 5):
            p.offer_blocks("t", layer, step)  # 2, 4, then 6 KiB: the third passes the floor
        while writes != [2, 3]:
            assert time.monotonic() < deadline, f"offers past the floor waited ({writes})"
            time.sleep(0.01)
        p.offer_blocks("t", layers - 1, step)
        wait_loaded(d, {"rd"}, timeout=10)
        assert writes == [2, 3, 1]
        assert all(dst.layers[i][4:6].tobytes() == src.layers[i][:2].tobytes() for i in range(layers))


@contextlib.contextmanager
def one_registered_send(
    layers: int, blocks: int = 8, dest: tuple[int, ...] = (4, 5)
) -> Iterator[tuple[TransferEngine, TransferEngine, HostBlockStore, HostBlockStore, list[int]]]:
    """Prefill over ``src`` with send "t" (request "r") that decode over ``dst`` registered for (into ``dest``), a
    5 ms offer window; and the layer count of each write prefill makes."""
    src, dst = host_store(layers, blocks, 64), host_store(layers, blocks, 64, seed=None)
    with tcp_engines(src, dst, offer_batch_ms=5) as (p, d):
        writes = _count_writes(p)
        p.begin_send("t", "r", 16 * len(dest))
        d.start_load("rd", "t", ("127.0.0.1", p.port), list(dest), 0, 16 * len(dest))
        wait_registered(p)
        yield p, d, src, dst, writes


def test_an_unrelated_command_keeps_the_wake_up_armed_for_the_next_offers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After offers went, the I/O thread arms a wake-up for when the next step's offers would be due (they send
    none of their own); a command that offers nothing (another request's send beginning, a heartbeat) must not
    cancel it, or the next step's first offer wakes the thread again."""
    monkeypatch.setattr(engine_mod, "_SMALL_OFFERS_HOLD_S", 600.0)
    layers = 4
    with one_registered_send(layers) as (p, _, _, _, writes):
        step = [(0, 0)]
        p.offer_blocks("t", 0, step)
        p.mark_forward_end([])
        deadline = time.monotonic() + 10
        while writes != [1]:
            assert time.monotonic() < deadline, writes
            time.sleep(0.01)
        wait_until(lambda: p._offers_due is not None, "no wake-up armed after the send")
        armed = p._offers_due
        assert armed is not None and armed > time.monotonic()
        p.begin_send("u", "r2", 16)  # an unrelated command
        wait_until(lambda: "u" in p._sender.outgoing, "the command did not run")
        assert p._offers_due == armed


def test_an_offer_queued_as_an_armed_wake_up_lapses_is_not_left_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker sends no wake-up for an offer while a wake-up is armed. If the armed one lapses with nothing to
    send just as such an offer is queued (after the I/O thread last found the queue empty), the I/O thread hands
    the offer over in the same turn instead of leaving it for a later one."""
    import queue
    import threading

    monkeypatch.setattr(engine_mod, "_SMALL_OFFERS_HOLD_S", 0.05)
    layers = 4
    with one_registered_send(layers) as (p, _, _, _, writes):
        real = p._cmds
        hook: dict[str, Any] = {"armed": False, "turn": None}

        class RacingQueue:
            """The real queue; once armed, an offer is queued the moment the I/O thread finds it empty after the
            armed wake-up lapsed."""

            def put(self, item: Any) -> None:
                real.put(item)

            def empty(self) -> bool:
                return real.empty()

            def get_nowait(self) -> Any:
                try:
                    return real.get_nowait()
                except queue.Empty:
                    due = p._offers_due
                    if hook["armed"] and due is not None and time.monotonic() >= due:
                        hook["armed"] = False
                        worker = threading.Thread(target=lambda: p.offer_blocks("t", 0, [(1, 1)], "r"))
                        worker.start()
                        worker.join()
                        hook["turn"] = p.stats["io_turns"]
                    raise

        p._cmds = RacingQueue()  # type: ignore[assignment]
        step = [(0, 0)]
        for layer in range(layers):
            p.offer_blocks("t", layer, step, "r")
        p.mark_forward_end(["t"])
        wait_until(lambda: writes == [4], f"the step did not go ({writes})")
        hook["armed"] = True
        wait_until(lambda: hook["turn"] is not None, "the armed wake-up never lapsed")
        out = p._sender.outgoing["t"]
        wait_until(lambda: len(out.layer_offer_times) == layers + 1, "the offer never reached the sender")
        assert p.stats["io_turns"] == hook["turn"]  # handed over in the turn that found the wake-up lapsed


def test_small_offers_leave_after_the_hold_without_a_forward_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that never marks a forward end does not hold small offers for ever: they leave after the hold."""
    monkeypatch.setattr(engine_mod, "_SMALL_OFFERS_HOLD_S", 0.2)
    layers = 3
    with one_registered_send(layers, blocks=4, dest=(2,)) as (p, d, src, dst, writes):
        p.offer_blocks("t", 0, [(0, 0)])
        deadline = time.monotonic() + 10
        while not dst.layers[0][2].any():
            assert time.monotonic() < deadline, f"a small offer was held past the hold ({writes})"
            time.sleep(0.01)
        assert writes == [1] and dst.layers[0][2].tobytes() == src.layers[0][0].tobytes()


def test_small_offers_hold_longer_once_the_caller_marks_forward_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The short hold of small offers is for a caller that never marks a forward end; once one is marked, a
    step's small offers wait for its last layer or end (up to the longer hold), so a long step is not split into
    many tiny messages."""
    monkeypatch.setattr(engine_mod, "_SMALL_OFFERS_HOLD_S", 0.05)
    monkeypatch.setattr(engine_mod, "_SMALL_OFFERS_HOLD_MARKED_S", 3.0)
    layers = 4
    with one_registered_send(layers, blocks=4, dest=(2,)) as (p, d, src, dst, writes):
        p.mark_forward_end([])  # a caller that marks its forward passes' ends
        time.sleep(0.05)
        step = [(0, 0)]  # one list for the step's layers, as the connector offers
        p.offer_blocks("t", 0, step)
        p.offer_blocks("t", 1, step)
        time.sleep(0.4)  # many short holds: still held
        assert writes == [] and not dst.layers[0].any()
        deadline = time.monotonic() + 10
        while writes != [2]:  # the longer hold is a bound: they leave without a step end too
            assert time.monotonic() < deadline, writes
            time.sleep(0.01)
        p.offer_blocks("t", 2, step)
        p.offer_blocks("t", layers - 1, step)  # the step's last layer: what gathered goes with it
        wait_loaded(d, {"rd"}, timeout=10)
        assert writes == [2, 2]
        assert all(dst.layers[i][2].tobytes() == src.layers[i][0].tobytes() for i in range(layers))


def test_a_store_that_reads_and_writes_blocks_its_own_way_is_used_for_multi_layer_messages() -> None:
    """The one-pass gather and scatter of a multi-layer message are HostBlockStore's own: a store that overrides
    ``read_blocks``/``write_blocks`` still sees every layer of such a message through them."""

    class RecordingStore(HostBlockStore):
        def __init__(self, layers: list[np.ndarray]) -> None:
            super().__init__(layers)
            self.read: set[int] = set()
            self.written: set[int] = set()

        def read_blocks(
            self, layer: int, block_ids: list[int], owner: str = "", out: memoryview | None = None
        ) -> list[memoryview]:
            self.read.add(layer)
            return super().read_blocks(layer, block_ids, owner, out)

        def write_blocks(self, layer: int, block_ids: Any, data: list[Any]) -> None:
            self.written.add(layer)
            super().write_blocks(layer, block_ids, data)

    layers, blocks, bb = 4, 16, 256
    rng = np.random.default_rng(0)
    src = RecordingStore([rng.integers(0, 255, (blocks, bb), dtype=np.uint8) for _ in range(layers)])
    dst = RecordingStore([np.zeros((blocks, bb), np.uint8) for _ in range(layers)])
    with tcp_engines(src, dst) as (p, d):
        writes = _count_writes(p)
        p.begin_send("t", "r", 48)
        step = [(0, 3), (1, 9), (2, 5)]  # scattered: gathered into one frame
        for layer in range(layers):
            p.offer_blocks("t", layer, step)
        time.sleep(0.2)  # held: nobody registered yet
        d.start_load("rd", "t", ("127.0.0.1", p.port), [1, 2, 3], 0, 48)
        wait_loaded(d, {"rd"})
        assert max(writes) > 1  # a multi-layer message went
        assert src.read == dst.written == set(range(layers))
        assert all(
            dst.layers[i][[1, 2, 3]].tobytes() == src.layers[i][[3, 9, 5]].tobytes() for i in range(layers)
        )


def test_unsent_keeps_the_latest_offer_of_an_index() -> None:
    sent = np.zeros(10, dtype=bool)
    sent[2] = True
    parts = [np.array([[5, 50], [2, 20], [3, 30]]), np.array([[3, 31], [12, 1]])]
    idx, src = sender_mod._unsent(parts, 0, 10, sent)
    assert idx.tolist() == [3, 5] and src.tolist() == [31, 50]


# --------------------------------------------------------------------------------------------- NIXL


def test_nixl_merges_blocks_adjacent_on_both_sides() -> None:
    src = np.array([3, 4, 5, 9, 10, 20])
    dst = np.array([7, 8, 9, 1, 3, 40])
    s, d, n = merged_runs(src, dst)
    assert s.tolist() == [3, 9, 10, 20] and d.tolist() == [7, 1, 3, 40] and n.tolist() == [3, 1, 1, 1]


def test_nixl_prepared_lists_write_the_right_blocks() -> None:
    pytest.importorskip("nixl._api")
    from vllm_disagg.transport.nixl import NixlAgent

    src, dst = host_store(3, 32, 256), host_store(3, 32, 256, seed=None)
    a = NixlAgent("batch-a", src.region(), 256, 32)
    b = NixlAgent("batch-b", dst.region(), 256, 32)
    try:
        peer = a.add_peer(b.info())
        s_ids, d_ids = [3, 4, 5, 9, 31], [7, 8, 9, 0, 30]
        for layer in range(3):
            a.write_blocks("x", peer, layer, s_ids, d_ids, b"n")
        while a.pending:
            a.progress()
            b.notifications()
        for layer in range(3):
            assert dst.layers[layer][d_ids].tobytes() == src.layers[layer][s_ids].tobytes()
            assert not dst.layers[layer][[1, 2, 10, 29, 31]].any()
    finally:
        a.close()
        b.close()


def test_zmq_tracker_type_is_what_the_ring_expects() -> None:
    assert hasattr(zmq.MessageTracker, "done") and tcp_mod.RING_BYTES > MAX_FRAME_BYTES


# --------------------------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("verify", [False, True])
def test_engines_move_gathered_and_split_frames_larger_than_a_control_message(verify: bool) -> None:
    """64 KiB blocks: a scattered layer is gathered into one multi-MiB frame, a long run is cut into frames of
    MAX_FRAME_BYTES, and decode's socket accepts both (its message limit follows the frame size, not the block's)."""
    layers, blocks, bb = 2, 300, 64 << 10
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst, verify_checksums=verify) as (p, d):
        n = 180
        s_ids = [int(x) for x in np.random.default_rng(5).permutation(blocks)[:40]] + list(range(100, 240))
        d_ids = list(range(n))
        p.begin_send("t", "r", n * 16)
        d.start_load("rd", "t", ("127.0.0.1", p.port), d_ids, 0, n * 16)
        offer = list(enumerate(s_ids))
        # scattered (gathered: one 2.5 MiB frame), then one long run (split)
        for chunk in (offer[:40], offer[40:]):
            for layer in range(layers):
                p.offer_blocks("t", layer, chunk)
        wait_loaded(d, {"rd"})
        for layer in range(layers):
            assert dst.layers[layer][:n].tobytes() == src.layers[layer][s_ids].tobytes()


def test_two_loads_named_by_the_same_indices_each_land_in_their_own_blocks() -> None:
    """Decode maps a step's indices once and reuses the mapping for the step's other layers: messages of two
    loads with the same logical indices, interleaved layer by layer, still land in each load's own blocks."""
    layers, blocks, bb = 3, 32, 256
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    src_ids = {"a": [3, 9, 1, 20], "b": [7, 30, 12, 5]}
    dst_ids = {"a": [0, 1, 2, 3], "b": [10, 11, 12, 13]}
    with tcp_engines(src, dst) as (p, d):
        for tid in ("a", "b"):
            p.begin_send(tid, "r" + tid, 4 * 16)
            d.start_load("d" + tid, tid, ("127.0.0.1", p.port), dst_ids[tid], 0, 4 * 16)
        time.sleep(0.3)  # both registered: each layer message goes out as offered
        offers = {tid: list(enumerate(ids)) for tid, ids in src_ids.items()}
        for layer in range(layers):
            for tid in ("a", "b"):
                p.offer_blocks(tid, layer, offers[tid])
        wait_loaded(d, {"da", "db"})
        for layer in range(layers):
            for tid in ("a", "b"):
                assert dst.layers[layer][dst_ids[tid]].tobytes() == src.layers[layer][src_ids[tid]].tobytes()


def test_a_layer_whose_device_copies_have_not_run_is_parked_not_waited_for() -> None:
    """The I/O thread queries staging (``staged``) instead of blocking on it: an unready layer waits in the
    sender while the loop keeps turning, and goes out once its copies have run."""

    class SlowStagingStore(HostBlockStore):
        ready = False
        waits = 0

        def staged(self, owner: str, layer: int) -> bool:
            return self.ready or layer == 0

        def wait_staged(self, owner: str, layer: int) -> None:
            SlowStagingStore.waits += 1

    layers, blocks, bb = 3, 8, 64
    rng = np.random.default_rng(0)
    src = SlowStagingStore([rng.integers(0, 255, (blocks, bb), dtype=np.uint8) for _ in range(layers)])
    dst = host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst) as (p, d):
        p.begin_send("t", "r", 16)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [4, 5, 6, 7], 0, 16)
        wait_registered(p)
        for layer in range(layers):
            p.offer_blocks("t", layer, [(0, 0), (1, 1), (2, 2), (3, 3)])
        wait_until(lambda: bool(dst.layers[0][4:].any()), "the staged layer 0 did not go")
        time.sleep(0.1)
        assert not dst.layers[1].any() and not dst.layers[2].any()
        assert d.poll_results().finished_recving == set()
        src.ready = True  # the copies ran: the parked layers go out without another offer
        wait_loaded(d, {"rd"}, timeout=10)
        assert all(dst.layers[i][4:].tobytes() == src.layers[i][:4].tobytes() for i in range(layers))
        assert SlowStagingStore.waits == 0  # the TCP path never waited on staging


def test_a_ring_pinned_by_one_stalled_decode_does_not_hold_the_others() -> None:
    """The ring is reused in order: a slot zmq holds because its decode stopped reading would defer every later
    write, to every decode, for as long as that decode stalls. Once the oldest slot is older than PINNED_AFTER_S,
    writes that do not fit go zero-copy instead of waiting."""
    s, ch = host_store(1, 64, 1024), RecordingChannel(_Busy())
    path = tcp_path(s, ch)
    path.ring = GatherRing(capacity=4096)
    header = LayerBlocks(transfer_id="t", layer=0, block_indices=pack_indices([0, 1, 2, 3]), block_bytes=1024)
    path.write(b"stalled", "t", "o", 0, [1, 7, 3, 9], None, header)  # zmq never lets go of this slot
    with pytest.raises(WriteDeferred):
        path.write(b"other", "u", "o", 0, [2, 8, 4, 10], None, header)  # a moment later: waits for the ring
    path.ring._live[0].taken -= tcp_mod.PINNED_AFTER_S + 0.1
    path.write(b"other", "u", "o", 0, [2, 8, 4, 10], None, header)  # pinned: sent one frame per run
    assert b"".join(ch.sent[-1][2:]) == s.layers[0][[2, 8, 4, 10]].tobytes()


def test_one_transfer_queues_at_most_its_window_in_zmq_and_others_go_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode's frames share one FIFO pipe: whatever one transfer has queued, every later transfer to that decode
    waits behind. Past TRANSFER_QUEUE_BYTES queued, a transfer's next write is deferred until zmq sent enough of
    it; another transfer's write is not."""
    monkeypatch.setattr(tcp_mod, "TRANSFER_QUEUE_BYTES", 4096)
    tracker = _Tracker()
    s, ch = host_store(1, 64, 1024), RecordingChannel(tracker)
    path = tcp_path(s, ch)
    header = LayerBlocks(
        transfer_id="big", layer=0, block_indices=pack_indices([0, 1, 2, 3]), block_bytes=1024
    )
    path.write(b"d", "big", "o", 0, [0, 1, 2, 3], None, header)  # 4 KiB queued: the window is full
    with pytest.raises(WriteDeferred):
        path.write(b"d", "big", "o", 0, [4, 5, 6, 7], None, header)
    small = LayerBlocks(transfer_id="small", layer=0, block_indices=pack_indices([0]), block_bytes=1024)
    path.write(b"d", "small", "o", 0, [9], None, small)  # another transfer to the same decode goes now
    assert len(ch.sent) == 2 and path.in_flight("big")
    tracker.done = True  # zmq sent them
    path.write(b"d", "big", "o", 0, [4, 5, 6, 7], None, header)
    assert len(ch.sent) == 3


def test_a_layer_bigger_than_one_write_goes_in_pieces_and_a_deferred_piece_resumes() -> None:
    """A path's max_write_bytes cuts a long layer into several writes (other transfers' writes can go between);
    a piece the path defers leaves the layer's rest pending, and the retry sends each block exactly once."""
    path = DeferringPath(defer=0)
    path.multi_layer_writes = True
    path.max_write_bytes = 4 * 8  # four 8-byte blocks per write
    s = registered_sender(host_store(2, 32, 8), path, list(range(100, 110)))
    step = [(i, 2 * i) for i in range(10)]
    for layer in range(2):
        s.offer("t", layer, step, 0.0, "r")
    s.flush_offered()
    assert [(w[0], w[3]) for w in path.writes] == [
        (0, [0, 1, 2, 3]),
        (0, [4, 5, 6, 7]),
        (0, [8, 9]),
        (1, [0, 1, 2, 3]),
        (1, [4, 5, 6, 7]),
        (1, [8, 9]),
    ]
    assert path.writes[1][1] == [8, 10, 12, 14] and path.writes[1][2] == [104, 105, 106, 107]
    path.writes.clear()
    s2 = registered_sender(host_store(2, 32, 8), path, list(range(100, 110)))
    for layer in range(2):
        s2.offer("t", layer, step, 0.0, "r")
    path.defer = 0
    real_write = path.write
    calls = 0

    def defer_the_second(*a: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise WriteDeferred
        real_write(*a)

    path.write = defer_the_second  # type: ignore[method-assign]
    s2.flush_offered()
    assert [(w[0], w[3]) for w in path.writes] == [(0, [0, 1, 2, 3])] and "t" in s2.parked
    s2.flush_parked()
    sent = [(w[0], i) for w in path.writes for i in w[3]]
    assert sorted(sent) == [(layer, i) for layer in range(2) for i in range(10)]  # each once
    assert s2.stats["bytes_sent"] == 2 * 10 * 8


def test_a_long_transfer_does_not_hold_a_short_one_to_the_same_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both go to one decode, so one zmq pipe: a short transfer begun after a long one's every layer was offered
    lands before the long one has finished (it waits behind one window of the long one, not its whole send)."""
    monkeypatch.setattr(tcp_mod, "TRANSFER_QUEUE_BYTES", 256 << 10)
    monkeypatch.setattr(TcpPath, "max_write_bytes", 64 << 10)
    layers, bb, big = 4, 16 << 10, 1024  # the long transfer: 64 MiB, 256 windows
    src, dst = host_store(layers, big + 8, bb), host_store(layers, big + 8, bb, seed=None)
    with tcp_engines(src, dst) as (p, d):
        d.start_load("long-d", "long", ("127.0.0.1", p.port), list(range(big)), 0, big * 16)
        time.sleep(0.2)  # registered before its layers are offered: they are written as offered
        p.begin_send("long", "long-p", big * 16)
        for layer in range(layers):
            p.offer_blocks("long", layer, [(i, i) for i in range(big)])
        p.mark_forward_end(["long"])
        d.start_load("short-d", "short", ("127.0.0.1", p.port), [big + 1], 0, 16)
        p.begin_send("short", "short-p", 16)
        for layer in range(layers):
            p.offer_blocks("short", layer, [(0, big + 3)])
        p.mark_forward_end(["short"])
        order: list[str] = []
        deadline = time.monotonic() + 30
        while len(order) < 2 and time.monotonic() < deadline:
            r = d.poll_results()
            assert not r.failed_recving
            order += sorted(r.finished_recving)
            time.sleep(0.002)
        assert order == ["short-d", "long-d"]
        for layer in range(layers):
            assert dst.layers[layer][big + 1].tobytes() == src.layers[layer][big + 3].tobytes()
            assert dst.layers[layer][:big].tobytes() == src.layers[layer][:big].tobytes()


def test_a_window_that_drained_takes_the_next_write_and_a_full_one_builds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window is judged on what zmq still holds now (not the count before it sent some), and a parked
    transfer whose window is still full is not rebuilt on every retry: the sender asks the path first."""
    monkeypatch.setattr(tcp_mod, "TRANSFER_QUEUE_BYTES", 4 * 4096)
    trackers: list[_Tracker] = []

    class Chan(RecordingChannel):
        def send_layer(self, identity: bytes, frames: list[Any]) -> Any:
            super().send_layer(identity, frames)
            trackers.append(_Tracker())
            return trackers[-1]

    path = tcp_path(host_store(1, 64, 4096), Chan())
    h = LayerBlocks(transfer_id="big", layer=0, block_indices=pack_indices([0]), block_bytes=4096)
    for b in range(4):  # 4 x 4 KiB: the window is full
        path.write(b"d", "big", "o", 0, [b], None, h)
    assert path.blocked("big")
    for t in trackers[:3]:
        t.done = True  # zmq sent 12 KiB of the 16
    assert not path.blocked("big")
    path.write(b"d", "big", "o", 0, [4], None, h)

    built = 0

    class Blocked(CountingPath):
        def blocked(self, transfer_id: str) -> bool:
            return True

    full = Blocked()
    s = registered_sender(host_store(1, 32, 8), full, list(range(10)))
    real_batch = s._batch

    def counting(*a: Any) -> Any:
        nonlocal built
        built += 1
        return real_batch(*a)

    s._batch = counting  # type: ignore[method-assign]
    s.offer("t", 0, [(i, i) for i in range(10)], 0.0, "r")
    s.flush_offered()
    for _ in range(5):
        s.flush_parked()
    assert built == 0 and "t" in s.parked and full.writes == []


def test_sends_sharing_a_step_each_go_as_one_write_of_their_layers() -> None:
    """A step's sends are offered layer by layer in turn (A0, B0, A1, B1, ...): each list is converted once, and
    each send's layers still leave as one write (its layers share one array)."""
    from vllm_disagg.wire import Register

    layers = 6
    path = CountingPath()
    path.multi_layer_writes = True
    s = registered_sender(host_store(layers, 64, 8), path, list(range(100, 110)))
    s.begin("u", "r2", 10 * 16, "")
    u = s.outgoing["u"]
    u.dest = Register(transfer_id="u", request_id="d2", first_block=0, num_blocks=10,
                      dest_blocks=list(range(200, 210)), prompt_len=160)  # fmt: skip
    u.dest_identity, u.path, u.dest_arr = b"d", path, np.arange(200, 210)  # type: ignore[assignment]
    a = [(i, i) for i in range(10)]
    b = [(i, 20 + i) for i in range(10)]
    for layer in range(layers):
        s.offer("t", layer, a, 0.0, "r")
        s.offer("u", layer, b, 0.0, "r2")
    s.flush_offered()
    assert sorted((w[0], w[4], w[1][0]) for w in path.writes) == [(0, layers, 0), (0, layers, 20)]


def test_a_steps_interleaved_sends_reach_the_sender_as_one_run_each() -> None:
    """Offers that queued up while the I/O thread was busy reach the sender as one call per send's run of layers,
    though a step's sends offer layer by layer in turn (A0 B0 A1 B1 ...); the data still lands whole."""
    import threading

    layers, blocks, bb = 4, 16, 64
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst) as (p, d):
        for tid, dest in (("a", [8, 9]), ("b", [10, 11])):
            p.begin_send(tid, "r" + tid, 32)
            d.start_load("d" + tid, tid, ("127.0.0.1", p.port), dest, 0, 32)
        wait_until(
            lambda: all(o.dest_identity for o in list(p._sender.outgoing.values())), "decode did not register"
        )
        calls: list[tuple[str, int, int]] = []
        offer_layers = p._sender.offer_layers

        def counted(tid: str, first: int, count: int, *rest: Any) -> None:
            calls.append((tid, first, count))
            offer_layers(tid, first, count, *rest)

        p._sender.offer_layers = counted  # type: ignore[method-assign]
        gate = threading.Event()
        p._submit(gate.wait)  # the I/O thread is busy while the step's offers queue
        step = {"a": [(0, 0), (1, 1)], "b": [(0, 2), (1, 3)]}
        for layer in range(layers):
            for tid in ("a", "b"):
                p.offer_blocks(tid, layer, step[tid], "r" + tid)
        gate.set()
        wait_loaded(d, {"da", "db"})
        # each send's layers joined the record it queued first: one call per send
        assert calls == [("a", 0, 4), ("b", 0, 4)], calls
        for layer in range(layers):
            assert dst.layers[layer][[8, 9]].tobytes() == src.layers[layer][[0, 1]].tobytes()
            assert dst.layers[layer][[10, 11]].tobytes() == src.layers[layer][[2, 3]].tobytes()


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
@pytest.mark.parametrize("prepared", [True, False])
def test_nixl_writes_layers_queued_together_as_one_write_with_one_notice(prepared: bool) -> None:
    """Over NIXL, a step's layers that queued up (here: offered before decode registered) go as one WRITE of every
    layer with one notice, and decode counts each layer's blocks from it; with prepared descriptor lists, and with
    descriptors built per write (where lists could not be prepared)."""
    layers, blocks, bb = 4, 32, 256
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    geo = geometry(num_layers=layers, block_bytes=bb)
    opts: dict[str, Any] = dict(bind_host="127.0.0.1", transport="nixl", load_timeout_s=20.0)
    p = TransferEngine(src, geo, "P", EngineSettings(**opts))
    d = TransferEngine(dst, geo, "D", EngineSettings(**opts))
    try:
        assert p.data_path == d.data_path == "nixl"
        writes = _count_writes(p, "nixl")
        if not prepared:
            (path,) = [one for one in p._paths if one.name == "nixl"]
            path._nixl._local = None  # type: ignore[attr-defined]
        s_ids, d_ids = [3, 9, 1, 20, 21, 22], [0, 5, 6, 7, 30, 2]
        p.begin_send("t", "r", 6 * 16)
        step = list(enumerate(s_ids))
        for layer in range(layers):
            p.offer_blocks("t", layer, step)
        time.sleep(0.2)  # held on prefill: nobody registered yet
        d.start_load("rd", "t", ("127.0.0.1", p.port), d_ids, 0, 6 * 16)
        wait_loaded(d, {"rd"})
        assert writes == [layers]
        for layer in range(layers):
            assert dst.layers[layer][d_ids].tobytes() == src.layers[layer][s_ids].tobytes()
    finally:
        p.close()
        d.close()


def test_a_steps_layers_queue_as_one_record_and_no_offer_jumps_a_command() -> None:
    """While the I/O thread is busy, a send's consecutive layers offering one list join the record it queued (one
    queue entry, not one per layer); an offer after another command starts a new record, so it never reaches the
    sender before that command."""
    import threading

    layers, blocks, bb = 4, 16, 64
    src, dst = host_store(layers, blocks, bb), host_store(layers, blocks, bb, seed=None)
    with tcp_engines(src, dst) as (p, d):
        p.begin_send("a", "ra", 32)
        d.start_load("da", "a", ("127.0.0.1", p.port), [8, 9], 0, 32)
        wait_until(lambda: all(o.dest_identity for o in list(p._sender.outgoing.values())), "no registration")
        order: list[str] = []
        offer_layers = p._sender.offer_layers

        def counted(tid: str, first: int, count: int, *rest: Any) -> None:
            order.append(f"offer {first}+{count}")
            offer_layers(tid, first, count, *rest)

        p._sender.offer_layers = counted  # type: ignore[method-assign]
        gate = threading.Event()
        p._submit(gate.wait)
        step = [(0, 0), (1, 1)]
        p.offer_blocks("a", 0, step, "ra")
        p.offer_blocks("a", 1, step, "ra")
        first = p._open_offers["a"]
        assert (first.layer, first.count) == (
            0,
            2,
        )  # one queued record of two layers (it waits behind the gate)
        p._submit(lambda: order.append("command"))
        p.offer_blocks("a", 2, step, "ra")
        p.offer_blocks("a", 3, step, "ra")
        second = p._open_offers["a"]
        assert second is not first and (second.layer, second.count) == (2, 2)
        gate.set()
        wait_loaded(d, {"da"})
        assert order == ["offer 0+2", "command", "offer 2+2"], order
        for layer in range(layers):
            assert dst.layers[layer][[8, 9]].tobytes() == src.layers[layer][[0, 1]].tobytes()
