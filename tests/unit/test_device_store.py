"""DeviceBlockStore against vLLM 0.32's own KV cache views, for every KVCacheLayout, with the real torch copy code.

What must hold on a GPU, checked here on CPU tensors (TorchDeviceOps runs the same indexing synchronously):
a received block lands in the cache itself (never in a temporary, whatever the strides), the bytes on the wire are
the block in logical order, NIXL addresses point at each block's real page, the layout tag tells physical layouts
apart, pinned staging is reused and bounded, and copies are ordered (a block is read only after its copy, a load
counts only after ``sync``).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from vllm_disagg.connectors.device_store import (  # noqa: E402
    DeviceBlockStore,
    TorchDeviceOps,
    check_block_major,
)
from vllm_disagg.kv_layout import KVGeometry  # noqa: E402
from vllm_disagg.transport.block_store import staging_owner  # noqa: E402
from vllm_disagg.transport.engine import EngineSettings, TransferEngine  # noqa: E402

LAYERS, BLOCKS = 3, 10
LAYOUTS = list(KVCacheLayout)
DENSE = [lay for lay in LAYOUTS if lay.is_block_compact]


def vllm_views(layout: KVCacheLayout, seed: int | None) -> list[Any]:
    """What vLLM's allocate_kv_cache hands a connector: one [B, H, N, C] view per layer into one int8 buffer."""
    spec = kv_iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layer_stride, block_stride, *_ = kv_iface.compute_layout_strides(
        spec, BLOCKS, LAYERS, layout
    )  # as vLLM does
    kt = kv_iface.KVCacheTensor(
        size=LAYERS * BLOCKS * page, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(LAYERS * BLOCKS * page, dtype=torch.int8)
    views = kv_iface.create_kv_cache_views(raw, spec, BLOCKS, layout, kt)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in views:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return views


def logical_bytes(t: Any) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).flatten().numpy())


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_blocks_land_in_the_real_cache_for_every_layout(layout: KVCacheLayout) -> None:
    src_views, dst_views = vllm_views(layout, seed=1), vllm_views(layout, seed=None)
    src = DeviceBlockStore(src_views, TorchDeviceOps("cpu"))
    dst = DeviceBlockStore(dst_views, TorchDeviceOps("cpu"))
    assert src.block_bytes == logical_bytes(src_views[0][0]).__len__()
    for layer in range(LAYERS):
        src.stage("t", layer, [3, 8])
        wire = [bytes(src.read(layer, b, "t")) for b in (3, 8)]
        assert wire == [logical_bytes(src_views[layer][b]) for b in (3, 8)]  # logical order on the wire
        dst.write_blocks(layer, [7, 0], wire)
    dst.sync()
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][7], src_views[layer][3])
        assert torch.equal(dst_views[layer][0], src_views[layer][8])
        untouched = [b for b in range(BLOCKS) if b not in (0, 7)]
        assert not dst_views[layer][untouched].float().abs().sum()  # no other block (or layer) was written
    src.release("t")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_nixl_addresses_are_each_blocks_real_page(layout: KVCacheLayout) -> None:
    views = vllm_views(layout, seed=2)
    store = DeviceBlockStore(views, TorchDeviceOps("cpu"), direct=True)
    if not layout.is_block_compact:  # heads outermost: a block is not one run of bytes; TCP serves it
        assert not store.direct and store.region() is None
        return
    assert store.direct
    nl = store.region()
    assert nl is not None
    regions, bases, stride = nl.spans, nl.layer_addrs, nl.block_stride
    page = store.block_bytes
    for layer in range(LAYERS):
        for b in range(BLOCKS):
            addr = bases[layer] + b * stride
            assert addr == views[layer][b].data_ptr()
            assert any(start <= addr and addr + page <= start + n for start, n in regions)
            # the page at that address holds exactly this block's elements (in the layout's physical order)
            assert sorted(ctypes.string_at(addr, page)) == sorted(logical_bytes(views[layer][b]))


def test_layout_tag_tells_physical_orders_apart() -> None:
    tags = {
        lay.name: DeviceBlockStore(vllm_views(lay, None), TorchDeviceOps("cpu")).layout_tag()
        for lay in LAYOUTS
    }
    assert tags["LBNHC"] != tags["LBHNC"]  # equal logical shapes, different page bytes
    assert tags["LBHNC"] == tags["BLHNC"]  # same page order, only the block stride differs
    assert tags["LBNHC"] == tags["BLNHC"]


def test_pinned_staging_is_reused_and_bounded() -> None:
    store = DeviceBlockStore(vllm_views(KVCacheLayout.LBNHC, 3), TorchDeviceOps("cpu"))
    assert store.pool is not None
    for i in range(200):  # many transfers, each staged and released as the engine does
        for layer in range(LAYERS):
            store.stage(f"t{i}", layer, [i % BLOCKS, (i + 1) % BLOCKS])
        store.release(f"t{i}")
    assert store.pool.allocated <= LAYERS * store.pool.size_class(2 * store.block_bytes)
    assert not store._staged


def test_reading_an_unstaged_block_is_an_error() -> None:
    store = DeviceBlockStore(vllm_views(KVCacheLayout.LBNHC, 1), TorchDeviceOps("cpu"))
    with pytest.raises(RuntimeError, match="before it was staged"):
        store.read(0, 2, "t")


class _Deferred:
    def __init__(self, action: Any) -> None:
        self.action = action

    def run(self) -> None:
        if self.action is not None:
            self.action()
            self.action = None


class DeferredOps(TorchDeviceOps):
    """Copies run only when their event is waited on, as if the side stream were slow: ordering bugs show up."""

    def compute_event(self) -> Any:
        return _Deferred(None)

    def gather(self, dst: Any, cache: Any, blocks: list[int], after: Any) -> Any:
        return _Deferred(lambda: super(DeferredOps, self).gather(dst, cache, blocks, after))

    def scatter(self, cache: Any, blocks: list[int], src: Any) -> Any:
        return _Deferred(lambda: super(DeferredOps, self).scatter(cache, blocks, src))

    def wait(self, event: Any) -> None:
        if event is not None:
            event.run()

    def done(self, event: Any) -> bool:
        return event is None or event.action is None


def test_copies_are_ordered_reads_wait_for_staging_and_loads_for_sync() -> None:
    src_views, dst_views = vllm_views(KVCacheLayout.LBNHC, 4), vllm_views(KVCacheLayout.LBNHC, None)
    src, dst = (
        DeviceBlockStore(src_views, DeferredOps("cpu")),
        DeviceBlockStore(dst_views, DeferredOps("cpu")),
    )
    src.stage("t", 1, [4])  # queued, not run: the forward pass is not blocked
    assert bytes(src._staged[("t", 1)][0].buf.numpy()[: src.block_bytes]) != logical_bytes(src_views[1][4])
    data = bytes(src.read(1, 4, "t"))  # waits for its copy
    assert data == logical_bytes(src_views[1][4])
    dst.write_blocks(1, [0], [data])
    assert not dst_views[1][0].float().abs().sum()  # the host-to-device copy has not run yet
    dst.sync()
    assert torch.equal(dst_views[1][0], src_views[1][4])


def test_direct_mode_orders_nixl_after_the_kernels() -> None:
    waited: list[Any] = []

    class Recording(TorchDeviceOps):
        def compute_event(self) -> Any:
            return object()

        def wait(self, event: Any) -> None:
            waited.append(event)

    store = DeviceBlockStore(vllm_views(KVCacheLayout.LBNHC, 3), Recording("cpu"), direct=True)
    store.stage("t", 0, [1, 2])
    assert not store._staged  # no host copy in direct mode
    store.wait_staged("t", 0)
    assert len(waited) == 1
    store.wait_staged("t", 0)
    assert len(waited) == 1  # each event is waited once


def test_kernel_block_splitting_is_refused_with_the_fix() -> None:
    check_block_major((100, 8, 16, 256), 100)
    with pytest.raises(ValueError, match="--block-size"):
        check_block_major((400, 8, 16, 256), 100)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLHNC], ids=["LBNHC", "BLHNC"])
def test_engines_move_device_blocks_end_to_end_over_tcp(layout: KVCacheLayout) -> None:
    """Two transfer engines over loopback on vLLM-shaped views: staging, zero-copy frames, indexed writes, sync."""
    src_views, dst_views = vllm_views(layout, 5), vllm_views(layout, None)
    src, dst = (
        DeviceBlockStore(src_views, TorchDeviceOps("cpu")),
        DeviceBlockStore(dst_views, TorchDeviceOps("cpu")),
    )
    geo = KVGeometry(model="m", num_layers=LAYERS, num_kv_heads=2, head_size=32, block_size=16, dtype="bfloat16",
                     kv_layout=src.layout_tag(), block_bytes=src.block_bytes)  # fmt: skip
    opts = dict(bind_host="127.0.0.1", transport="tcp", load_timeout_s=10)
    p = TransferEngine(src, geo, "P", EngineSettings(**opts))  # type: ignore[arg-type]
    d = TransferEngine(dst, geo, "D", EngineSettings(**opts))  # type: ignore[arg-type]
    try:
        p.begin_send("t", "rp", prompt_len=32)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [2, 5], first_block=0, prompt_len=32)
        time.sleep(0.2)
        for layer in range(LAYERS):
            src.stage(
                staging_owner("t", "rp"), layer, [0, 1]
            )  # what save_kv_layer does on CUDA before offering
            p.offer_blocks("t", layer, [(0, 0), (1, 1)], "rp")
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while "rd" not in done and time.monotonic() < deadline:
            done |= d.poll_results().finished_recving
            time.sleep(0.01)
        assert "rd" in done
        for layer in range(LAYERS):
            assert torch.equal(dst_views[layer][2], src_views[layer][0])
            assert torch.equal(dst_views[layer][5], src_views[layer][1])
        p.finish_send("t", aborted=False, request_id="rp")
        deadline = time.monotonic() + 10
        sent: set[str] = set()
        while "rp" not in sent and time.monotonic() < deadline:
            sent |= p.poll_results().finished_sending
            time.sleep(0.01)
        assert "rp" in sent
        assert not src._staged  # the transfer's staging buffers went back to the pool
    finally:
        p.close()
        d.close()


def test_receiver_buffers_return_to_the_pool_as_their_copies_land() -> None:
    """A long load does not hold a pinned buffer per layer message until it completes."""
    store = DeviceBlockStore(vllm_views(KVCacheLayout.LBNHC, None), TorchDeviceOps("cpu"))
    assert store.pool is not None
    block = bytes(store.block_bytes)
    for i in range(50):
        store.write_blocks(i % LAYERS, [i % BLOCKS], [block])
    assert len(store._pending) <= 1
    assert store.pool.allocated <= 2 * store.pool.size_class(store.block_bytes)
    assert store.mem_type == "DRAM" and store.device_id == 0  # from the tensors, not a parameter


def test_a_nixl_registered_prefill_still_serves_a_tcp_decode() -> None:
    """direct (NIXL) stores stage nothing; a decode that ended up on TCP gets each block copied out on demand."""
    views = vllm_views(KVCacheLayout.LBNHC, 6)
    store = DeviceBlockStore(views, TorchDeviceOps("cpu"), direct=True)
    assert store.direct
    store.stage("t", 1, [2, 3])  # records the kernels' event only
    assert bytes(store.read(1, 3, "t")) == logical_bytes(views[1][3])
    store.release("t")
    assert not store._staged and store.staged_bytes == 0


def test_a_tcp_decode_of_a_nixl_registered_prefill_gets_one_gather_per_layer_write() -> None:
    """The on-demand copy of a write's blocks is one gather (not one gather and one device sync per block), and
    it goes back to the pool once the sender consumed the layer and zmq stopped reading, not at release."""
    views = vllm_views(KVCacheLayout.LBNHC, 7)
    ops = CountingOps()
    store = DeviceBlockStore(views, ops, direct=True)
    blocks = [9, 2, 5, 4]
    for layer in range(LAYERS):
        store.stage("t", layer, blocks)
    assert ops.gathers == 0
    got = store.read_blocks(1, blocks, "t")
    assert ops.gathers == 1 and len(got) == 1
    assert bytes(got[0]) == b"".join(logical_bytes(views[1][b]) for b in blocks)
    assert bytes(store.read_blocks(1, blocks[1:3], "t")[0]) == b"".join(
        logical_bytes(views[1][b]) for b in (2, 5)
    )
    assert ops.gathers == 1  # a stretch of the copy just made
    assert store.staged_bytes > 0

    class Probe:
        done = False

    probe = Probe()
    store.consumed("t", 1, 1, [probe])  # type: ignore[list-item]
    assert store.staged_bytes > 0  # zmq may still read the frames
    probe.done = True
    store.reclaim()
    assert store.staged_bytes == 0 and not store._staged
    store.read_blocks(2, blocks, "t")
    store.release("t")
    assert store.staged_bytes == 0 and not store._staged


class CountingOps(TorchDeviceOps):
    """TorchDeviceOps that counts its device copies (one gather / scatter per layer is the point)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.gathers = self.scatters = 0

    def gather(self, dst: Any, cache: Any, blocks: list[int], after: Any) -> Any:
        self.gathers += 1
        return super().gather(dst, cache, blocks, after)

    def scatter(self, cache: Any, blocks: list[int], src: Any) -> Any:
        self.scatters += 1
        return super().scatter(cache, blocks, src)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_one_gather_and_one_scatter_per_layer_with_multi_block_frames(layout: KVCacheLayout) -> None:
    """The staged copy of a step's blocks is served as one frame (no per-block views), and a frame holding several
    blocks lands with one scatter, on vLLM's own views of every layout."""
    src_views, dst_views = vllm_views(layout, seed=3), vllm_views(layout, seed=None)
    src_ops, dst_ops = CountingOps(), CountingOps()
    src = DeviceBlockStore(src_views, src_ops)
    dst = DeviceBlockStore(dst_views, dst_ops)
    blocks, dest = [6, 2, 9, 4], [1, 8, 3, 5]
    for layer in range(LAYERS):
        src.stage("t", layer, blocks)
        frames = src.read_blocks(layer, blocks, "t")
        assert len(frames) == 1 and len(frames[0]) == 4 * src.block_bytes
        assert bytes(frames[0]) == b"".join(logical_bytes(src_views[layer][b]) for b in blocks)
        half = 2 * src.block_bytes
        dst.write_blocks(layer, dest, [frames[0][:half], frames[0][half:]])
    dst.sync()
    assert src_ops.gathers == LAYERS and dst_ops.scatters == LAYERS
    for layer in range(LAYERS):
        for s, d in zip(blocks, dest, strict=True):
            assert torch.equal(dst_views[layer][d], src_views[layer][s])
    # a subset of what was staged: per-block views of the staged copy, adjacent ones joined
    sub = src.read_blocks(0, [2, 9, 6], "t")
    assert b"".join(bytes(v) for v in sub) == b"".join(logical_bytes(src_views[0][b]) for b in (2, 9, 6))
    assert len(sub) == 2  # 2 and 9 are adjacent in the staged buffer; 6 is before them
    src.release("t")


def test_staged_queries_the_copies_without_waiting() -> None:
    """``staged`` answers from the events' state (the I/O thread parks an unready layer instead of blocking)."""

    class PendingOps(TorchDeviceOps):
        finished = False
        waited = 0

        def gather(self, dst: Any, cache: Any, blocks: list[int], after: Any) -> Any:
            super().gather(dst, cache, blocks, after)
            return "copy-event"

        def done(self, event: Any) -> bool:
            return event is None or self.finished

        def wait(self, event: Any) -> None:
            self.waited += 1

    ops = PendingOps("cpu")
    store = DeviceBlockStore(vllm_views(LAYOUTS[0], seed=1), ops)
    assert store.staged("t", 0)  # nothing staged: nothing to wait for
    store.stage("t", 0, [1, 2])
    assert not store.staged("t", 0) and store.staged("t", 1)
    ops.finished = True
    assert store.staged("t", 0) and ops.waited == 0
    store.release("t")


def test_a_stretch_of_a_staged_copy_is_one_frame() -> None:
    """Decode holding a prefix already: the rest of the step's staged copy is still served as one view."""
    views = vllm_views(LAYOUTS[0], seed=4)
    store = DeviceBlockStore(views, TorchDeviceOps("cpu"))
    store.stage("t", 1, [5, 0, 7, 3])
    frames = store.read_blocks(1, [7, 3], "t")
    assert len(frames) == 1 and bytes(frames[0]) == logical_bytes(views[1][7]) + logical_bytes(views[1][3])
    store.release("t")


def wide_views(layers: int, blocks: int, seed: int | None) -> list[Any]:
    """vLLM views of 64 KiB blocks (LBNHC): a frame of two blocks is over zmq's copy threshold, so it goes
    zero-copy and its pinned buffer is read by zmq after the send returns."""
    spec = kv_iface.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_stride, block_stride, *_ = kv_iface.compute_layout_strides(
        spec, blocks, layers, KVCacheLayout.LBNHC
    )
    kt = kv_iface.KVCacheTensor(
        size=layers * blocks * page, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(layers * blocks * page, dtype=torch.int8)
    views = kv_iface.create_kv_cache_views(raw, spec, blocks, KVCacheLayout.LBNHC, kt)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in views:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return views


class _Probe:
    def __init__(self, done: bool) -> None:
        self.done = done


def test_a_sent_layers_copies_go_back_once_nothing_reads_them() -> None:
    """Copies are freed per layer as the sender finishes with them (and zmq with their frames), not at the end of
    the transfer: a long prompt does not pin its whole KV."""
    store = DeviceBlockStore(vllm_views(KVCacheLayout.LBNHC, 2), TorchDeviceOps("cpu"))
    cls = store.pool.size_class(2 * store.block_bytes)
    for step in range(3):
        store.stage("t", 0, [2 * step, 2 * step + 1])
    assert store.staged_bytes == 3 * cls
    reading = _Probe(False)
    store.consumed("t", 0, 2, [reading])  # the first two steps' offers went in a write zmq still reads
    assert store.staged_bytes == 3 * cls  # not freed while zmq may read them
    assert bytes(store.read_blocks(0, [4, 5], "t")[0]) == logical_bytes(store.layers[0][4]) + logical_bytes(
        store.layers[0][5]
    )  # the third step's copy is still served
    reading.done = True
    store.consumed("t", 0, 1, [None])  # type: ignore[list-item]  # a write that zmq copied at once
    assert store.staged_bytes == 0 and not store._staged and not store._retired
    assert store.pool.allocated <= 3 * cls
    store.release("t")
    assert store.staged_bytes == 0 and not store._owner_bytes


def test_copies_past_the_staging_budget_wait_for_their_send() -> None:
    """Past the budget a gather is only noted; the I/O thread queues it when the layer is about to be sent, in
    order, with the bytes as they were when it was staged: for the transfer's lowest layer whatever the budget (it
    must move), for a later one only as sent copies come back. A transfer under its floor is never held back."""
    views = vllm_views(KVCacheLayout.LBNHC, 7)
    store = DeviceBlockStore(views, DeferredOps("cpu"))
    cls = store.pool.size_class(2 * store.block_bytes)
    store.staging_budget_bytes, store.staging_floor_bytes = 2 * cls, cls
    for layer in range(LAYERS):
        store.stage("late", layer, [1, 2])  # a decode that has not registered yet
    store.stage("late", 0, [3, 4])  # the next step: after a deferred copy of its layer, deferred as well
    assert [c.buf is not None for c in store._staged[("late", 0)]] == [True, False]
    assert store._staged[("late", 2)][0].buf is None
    assert store.deferred_gathers == 2 and store.staged_bytes == 2 * cls
    store.stage("ready", 1, [5, 6])  # another transfer holding nothing: staged at once, over the budget
    assert store._staged[("ready", 1)][0].buf is not None
    assert not store.staged("late", 2)  # not the transfer's lowest layer, and no room: still waiting
    assert store._staged[("late", 2)][0].buf is None
    assert not store.staged("late", 0)  # the lowest: queued whatever the budget (DeferredOps runs it on wait)
    assert bytes(store.read_blocks(0, [3, 4], "late")[0]) == logical_bytes(views[0][3]) + logical_bytes(
        views[0][4]
    )
    store.consumed("late", 0, 2, [_Probe(True)])  # layer 0 sent, and zmq let go of it
    store.consumed("late", 1, 1, [_Probe(True)])
    assert store.staged_bytes == cls  # only the other transfer's copy
    assert not store.staged("late", 2)  # room again: queued now
    frames = store.read_blocks(2, [1, 2], "late")
    assert bytes(frames[0]) == logical_bytes(views[2][1]) + logical_bytes(views[2][2])
    store.release("late")
    store.release("ready")
    assert store.staged_bytes == 0 and not store._owner_bytes and not store._staged


def test_a_failed_gather_takes_its_charge_back() -> None:
    """Pinned memory exhausted: the gather fails (the transfer is aborted by its caller) and the budget keeps no
    charge for it."""

    class NoPinned(TorchDeviceOps):
        def pinned(self, nbytes: int) -> Any:
            raise RuntimeError("cudaHostAlloc failed")

    store = DeviceBlockStore(vllm_views(KVCacheLayout.LBNHC, 1), NoPinned("cpu"))
    with pytest.raises(RuntimeError, match="cudaHostAlloc"):
        store.stage("t", 0, [1])
    assert store.staged_bytes == 0 and not store._owner_bytes


def _engines(src: DeviceBlockStore, dst: DeviceBlockStore) -> tuple[TransferEngine, TransferEngine]:
    geo = KVGeometry(model="m", num_layers=src.num_layers, num_kv_heads=8, head_size=128, block_size=16,
                     dtype="bfloat16", kv_layout=src.layout_tag(), block_bytes=src.block_bytes)  # fmt: skip
    opts = dict(bind_host="127.0.0.1", transport="tcp", load_timeout_s=10)
    return (
        TransferEngine(src, geo, "P", EngineSettings(**opts)),  # type: ignore[arg-type]
        TransferEngine(dst, geo, "D", EngineSettings(**opts)),  # type: ignore[arg-type]
    )


def _wait_until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _wait_for(poll: Any, key: str, what: str) -> None:
    deadline = time.monotonic() + 10
    got: set[str] = set()
    while key not in got and time.monotonic() < deadline:
        got |= getattr(poll(), what)
        time.sleep(0.01)
    assert key in got, what


@pytest.mark.parametrize("late", [False, True], ids=["decode-registered", "decode-late-past-the-budget"])
def test_a_chunked_prefills_copies_go_back_while_the_transfer_is_still_open(late: bool) -> None:
    """Six prefill chunks of three layers through two engines over TCP, with frames zmq sends zero-copy: once
    decode holds every block, the prefill worker holds no step's copy any more although the transfer is still
    open (the request has not finished). Decode holding a prefix: the first chunk's offers are never sent, and their
    copies go back too. ``late``: every chunk is staged before decode registers, past a budget of two copies; the
    copies left waiting are made when their layers are sent, and every byte still lands."""
    layers, blocks, steps = 3, 24, 6
    src_views, dst_views = wide_views(layers, blocks, 8), wide_views(layers, blocks, None)
    src = DeviceBlockStore(src_views, TorchDeviceOps("cpu"))
    dst = DeviceBlockStore(dst_views, TorchDeviceOps("cpu"))
    cls = src.pool.size_class(2 * src.block_bytes)
    if late:
        src.staging_budget_bytes, src.staging_floor_bytes = 2 * cls, cls
    peak = [0]
    charge = src._charge

    def charged(owner: str, nbytes: int) -> None:
        charge(owner, nbytes)
        peak[0] = max(peak[0], src.staged_bytes)

    src._charge = charged  # type: ignore[method-assign]
    owner = staging_owner("t", "rp")
    dest = list(range(12, 22))  # decode holds logical blocks 0-1 already and registers 2-11
    p, d = _engines(src, dst)
    try:
        p.begin_send("t", "rp", prompt_len=16 * 2 * steps)

        def register() -> None:
            d.start_load("rd", "t", ("127.0.0.1", p.port), dest, first_block=2, prompt_len=16 * 2 * steps)

        if not late:
            register()
            time.sleep(0.2)
        for step in range(steps):
            pairs = [(2 * step, 2 * step), (2 * step + 1, 2 * step + 1)]
            for layer in range(layers):
                src.stage(owner, layer, [b for _, b in pairs])  # as save_kv_layer does on CUDA
                p.offer_blocks("t", layer, pairs, "rp")
            p.mark_forward_end([])
        if late:
            assert src.deferred_gathers > 0 and src.staged_bytes <= 2 * cls
            register()
        _wait_for(d.poll_results, "rd", "finished_recving")
        if late:
            # the budget, the lowest layer's waiting copies (a layer leaves whole), and the layer sent before it
            # while zmq may still read it: not the whole transfer's 18 copies at once
            assert peak[0] <= (2 + 2 * steps) * cls, peak[0] // cls
        for layer in range(layers):
            for logical, block in zip(range(2, 12), dest, strict=True):
                assert torch.equal(dst_views[layer][block], src_views[layer][logical])
        # the transfer is open (its request runs on): its copies come back as zmq lets go of their frames
        assert not src._staged
        _wait_until(lambda: not src.staged_bytes, "the sent copies never came back", 5)
        assert src.staged_bytes == 0 and not src._retired
        p.finish_send("t", aborted=False, request_id="rp")
        _wait_for(p.poll_results, "rp", "finished_sending")
        assert src.staged_bytes == 0 and not src._retired and not src._owner_bytes
    finally:
        p.close()
        d.close()


def test_a_transfer_ended_while_its_prefill_runs_stages_nothing_more() -> None:
    """Decode gave up while prefill's long prompt is still computing: its later steps' copies would never be read,
    so they are not made (they would hold pinned memory and the budget until the request ends)."""
    src, dst = wide_views(3, 24, 8), wide_views(3, 24, None)
    store = DeviceBlockStore(src, TorchDeviceOps("cpu"))
    p, d = _engines(store, DeviceBlockStore(dst, TorchDeviceOps("cpu")))
    owner = staging_owner("t", "rp")
    try:
        p.begin_send("t", "rp", prompt_len=16 * 4)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [10, 11, 12, 13], first_block=0, prompt_len=16 * 4)
        store.stage(owner, 0, [0, 1])
        p.offer_blocks("t", 0, [(0, 0), (1, 1)], "rp")
        d.cancel_load("t", "rd")  # decode gives up; prefill's request runs on
        _wait_until(lambda: owner in store._stopped, "the sender never stopped the transfer's staging")
        held = store.staged_bytes
        for layer in range(3):
            store.stage(owner, layer, [2, 3])  # the next step
        assert store.staged_bytes == held and not store.deferred_gathers
        p.finish_send("t", aborted=False, request_id="rp")
        _wait_for(p.poll_results, "rp", "finished_sending")
        assert store.staged_bytes == 0 and not store._stopped and not store._staged
    finally:
        p.close()
        d.close()
