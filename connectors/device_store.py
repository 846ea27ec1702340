"""KV caches in accelerator memory (CUDA), seen by the transfer engine as whole blocks of bytes.

vLLM hands each layer's cache as a 4-D logical view ``[num_blocks, H, N, C]`` whose *physical* order follows the
resolved ``KVCacheLayout`` (LBNHC by default on CUDA: N before H, so neither the view nor a block of it is
contiguous). The store therefore never reshapes a cache view (a reshape of a non-viewable tensor is a silent copy);
it moves bytes with indexed copies that address the real strides:

* TCP path, sender: ``stage(owner, layer, blocks)`` runs from ``save_kv_layer`` on the compute thread. It records an
  event on the compute stream and queues, on a side stream that waits for it, one gather of the step's blocks of
  that layer (``index_select`` on a uint8 view of the cache) and one device-to-host copy into a pinned buffer from
  a reusable pool. The bytes on the wire are each block in *logical* order ``[H, N, C]``, whatever the physical
  layout. ``read`` (I/O thread) waits only for that gather. Once the sender has written a layer's offers
  (``consumed``), their buffers go back to the pool as soon as zmq stops reading them, not at the end of the
  transfer, so a long prompt does not hold its whole KV in pinned memory. Copies staged ahead of their send (a
  decode that has not registered yet) are bounded by ``staging_budget_bytes``: past it, a gather is only noted,
  and the I/O thread queues it (non-blocking, on the same side stream) when the sender is about to send that
  layer, as far as the budget allows, and always for the transfer's lowest layer still to be sent (a layer's
  offers leave together), so a late decode pins the budget plus about one layer's copies, not the whole prompt. A
  transfer may always hold ``staging_floor_bytes``, so one that streams to a ready decode is not slowed by others
  waiting for theirs. ``release(owner)`` returns whatever is left once nothing reads it.
* TCP path, receiver: ``write_blocks`` (I/O thread) copies a layer's frames into one pinned buffer and queues one
  host-to-device copy plus one ``index_copy_`` into the cache view (in place, through the real strides).
  ``sync()`` waits for every queued copy; the engine calls it before it reports a load, so vLLM never schedules a
  request whose KV is still in flight.
* NIXL (direct): NIXL reads and writes device memory itself, so a block must be one dense run of bytes (its page):
  ``page_layout`` finds its address and the physical order of its dims, which goes into the layout tag. Layouts
  whose pages are not dense (heads outermost) are served by the TCP path. A registered prefill whose decode reads
  over TCP (no NIXL there, or its NIXL failed) stages nothing ahead: ``read_blocks`` gathers each write's blocks of
  a layer at once, and ``consumed`` returns those copies as it does staged ones.

The device calls sit behind :class:`DeviceOps`; :class:`TorchDeviceOps` implements them on CUDA and, synchronously,
on CPU tensors, so this logic runs in CI against vLLM's own cache views for every layout.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any, Protocol

import numpy as np

from vllm_disagg.kv_layout import PageLayout, merge_spans, page_layout
from vllm_disagg.transport.block_store import BlockIds, ReadDone, Region, Staging

logger = logging.getLogger("vllm_disagg.connector")

# Pinned bytes of staged copies a prefill worker holds at once (not yet sent, or still read by zmq) before further
# gathers wait until the sender is about to send their layer.
STAGING_BUDGET_BYTES = 1 << 30
# What one transfer may always hold whatever the budget: a window of its own, so it keeps streaming to a ready
# decode while other transfers' copies (whose decodes have not registered yet) fill the budget.
STAGING_FLOOR_BYTES = 16 << 20


class DeviceOps(Protocol):
    """The device operations the store needs (real: :class:`TorchDeviceOps`; tests may wrap it)."""

    def pinned(self, nbytes: int) -> Any: ...

    def compute_event(self) -> Any: ...

    def gather(self, dst: Any, cache: Any, blocks: list[int], after: Any) -> Any: ...

    def scatter(self, cache: Any, blocks: BlockIds, src: Any) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def done(self, event: Any) -> bool: ...


@dataclass
class _Chunk:
    """One staged gather: the listed blocks of one layer, back to back in ``buf``; ``buf`` None while the gather
    waits for the staging budget (``after`` is the event of the kernels it must follow)."""

    buf: Any  # pinned uint8 tensor
    event: Any
    offset: dict[int, int]  # block id -> index in buf
    blocks: list[int] = field(default_factory=list)  # the gathered block ids, in buf's order
    after: Any = None
    charged: int = 0  # pinned bytes this chunk counts against the budget (its buffer's size class)


class PinnedPool:
    """Pinned host buffers reused by size class, so staging stops allocating once warm and memory stays bounded
    by what is in flight (plus ``keep_bytes`` of idle buffers)."""

    def __init__(self, ops: DeviceOps, keep_bytes: int = 256 << 20) -> None:
        self.ops = ops
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[Any]] = defaultdict(list)
        self._idle = 0
        self.allocated = 0  # bytes ever allocated and not dropped (tests, metrics)
        self._lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int) -> Any:
        cls = self.size_class(nbytes)
        with self._lock:
            free = self._free[cls]
            if free:
                self._idle -= cls
                return free.pop()
            self.allocated += cls
        return self.ops.pinned(cls)

    def give(self, buf: Any) -> None:
        cls = int(buf.numel())
        with self._lock:
            if self._idle + cls <= self.keep_bytes:
                self._free[cls].append(buf)
                self._idle += cls
            else:
                self.allocated -= cls


@dataclass
class DeviceBlockStore:
    """BlockStore over vLLM's per-layer device cache views (see the module docstring)."""

    layers: list[Any]  # vLLM's [num_blocks, H, N, C] views, one per layer
    ops: DeviceOps
    direct: bool = False  # NIXL reads/writes device memory itself: stage() only orders it after the kernels
    staging_budget_bytes: int = STAGING_BUDGET_BYTES
    staging_floor_bytes: int = STAGING_FLOOR_BYTES
    staging: Staging = field(init=False, default="device")
    pool: PinnedPool = field(init=False)
    device_id: int = field(
        init=False, default=0
    )  # the tensors' CUDA ordinal (NIXL checks it on registration)
    mem_type: str = field(init=False, default="VRAM")
    _bytes: list[Any] = field(init=False, default_factory=list)  # uint8 views [num_blocks, H, N, C * elsize]
    _pages: list[PageLayout | None] = field(init=False, default_factory=list)
    _staged: dict[tuple[str, int], list[_Chunk]] = field(init=False, default_factory=dict)
    _ready: dict[tuple[str, int], list[Any]] = field(init=False, default_factory=dict)
    _pending: list[tuple[Any, Any]] = field(init=False, default_factory=list)  # (event, buffer) of queued h2d
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    # pinned bytes of staged copies not yet back in the pool, in all and per owner
    staged_bytes: int = field(init=False, default=0)
    _owner_bytes: dict[str, int] = field(init=False, default_factory=dict)
    # per owner, in write order: (what says zmq stopped reading them, chunks) of copies sent but possibly still read
    _retired: dict[str, deque[tuple[list[Any], list[_Chunk]]]] = field(init=False, default_factory=dict)
    # gathers that waited for the budget (metrics, tests)
    deferred_gathers: int = field(init=False, default=0)
    # owners whose transfer the sender ended while their request runs: stage() copies nothing for them
    _stopped: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        first = self.layers[0]
        for t in self.layers:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise ValueError(
                    f"KV cache layers differ: {tuple(t.shape)}/{t.dtype} vs {tuple(first.shape)}/{first.dtype}; "
                    "DisaggConnector needs one shape and dtype for every attention layer (hybrid models: "
                    "--disable-hybrid-kv-cache-manager is not enough, they are not supported)"
                )
            if t.stride(-1) != 1:
                raise ValueError(f"KV cache view with strides {t.stride()}: the innermost dim must be dense")
        import torch

        self._bytes = [t.view(torch.uint8) for t in self.layers]
        self._pages = [
            page_layout(tuple(t.shape), tuple(t.stride()), t.element_size(), t.storage_offset())
            for t in self.layers
        ]
        self.device_id = max(first.get_device(), 0)
        self.mem_type = "VRAM" if first.device.type == "cuda" else "DRAM"
        if self.direct and not self.pages_dense:
            logger.info(
                "KV cache layout %s: a block is not one dense page, so NIXL cannot address it; using TCP staging",
                self.layout_tag(),
            )
            self.direct = False
        self.pool = PinnedPool(self.ops)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[0])

    @property
    def block_bytes(self) -> int:
        t = self.layers[0]
        return int(prod(t.shape[1:])) * int(t.element_size())

    @property
    def pages_dense(self) -> bool:
        return all(p is not None for p in self._pages)

    def layout_tag(self) -> str:
        """What must match on both sides: logical block shape and dtype, and the physical order of a page's dims
        (NIXL moves raw pages, so LBNHC and LBHNC pages are different bytes even with equal logical shapes)."""
        t = self.layers[0]
        page = self._pages[0]
        order = "".join(str(i) for i in page.order) if page is not None else "sparse"
        return f"{t.device.type}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape[1:])}:order={order}"

    # ---------------------------------------------------------------- NIXL registration (direct only)

    def region(self) -> Region | None:
        """The pages NIXL registers, or None when not registrable (not direct, or pages not dense)."""
        if not self.direct:
            return None
        pages = [p for p in self._pages if p is not None]
        strides = {p.block_stride for p in pages}
        if len(pages) != len(self._pages) or len(strides) != 1:
            return None
        stride = strides.pop()
        bases = [
            int(t.untyped_storage().data_ptr()) + p.base for t, p in zip(self.layers, pages, strict=True)
        ]
        span = (self.num_blocks - 1) * stride + pages[0].page_bytes
        return Region(merge_spans([(b, span) for b in bases]), bases, stride, self.mem_type, self.device_id)

    # ---------------------------------------------------------------- sender

    def stage(self, owner: str, layer: int, blocks: list[int]) -> None:
        """Compute thread: queue the copy of these blocks once this layer's kernels have run (past the staging
        budget, only note it: the I/O thread queues it when the layer is to be sent, in the same order)."""
        if owner in self._stopped:  # the transfer ended on the sender's side: nothing will read this copy
            return
        after = self.ops.compute_event()
        if self.direct:
            with self._lock:
                self._ready.setdefault((owner, layer), []).append(after)
            return
        key = (owner, layer)
        cls = self.pool.size_class(len(blocks) * self.block_bytes)
        now = self._reserve(owner, key, cls)
        if not now and self._retired:  # copies whose frames have left since may make room
            self.reclaim()
            now = self._reserve(owner, key, cls)
        offset = {b: i for i, b in enumerate(blocks)}
        if now:
            buf, event = self._gather(owner, cls, layer, blocks, after)
            chunk = _Chunk(buf=buf, event=event, offset=offset, blocks=list(blocks), charged=cls)
        else:
            chunk = _Chunk(buf=None, event=None, offset=offset, blocks=list(blocks), after=after)
        with self._lock:
            self._staged.setdefault(key, []).append(chunk)
            if not now:
                self.deferred_gathers += 1
        if not now and self.deferred_gathers == 1:
            logger.info(
                "prefill staging holds %d MiB of pinned copies (staging_budget_mb %d): further gathers wait until "
                "their layer is sent (decodes slow to register or to read), which adds a copy to those layers' "
                "transfer time; raise staging_budget_mb if host memory allows",
                self.staged_bytes >> 20,
                self.staging_budget_bytes >> 20,
            )

    def _reserve(self, owner: str, key: tuple[str, int], cls: int) -> bool:
        """Charge a copy to be gathered now, if the budget allows it and no earlier copy of the layer waits (a
        layer's copies are read in the order they were offered)."""
        with self._lock:
            chunks = self._staged.get(key)
            if (chunks and chunks[-1].buf is None) or not self._fits(owner, cls):
                return False
            self._charge(owner, cls)
            return True

    def _gather(self, owner: str, cls: int, layer: int, blocks: list[int], after: Any) -> tuple[Any, Any]:
        """Queue one charged gather into a pool buffer; a failure (pinned memory exhausted) takes its charge back."""
        buf = None
        try:
            buf = self.pool.take(len(blocks) * self.block_bytes)
            return buf, self.ops.gather(buf, self._bytes[layer], blocks, after)
        except BaseException:
            if buf is not None:
                self.pool.give(buf)
            with self._lock:
                self._uncharge(owner, cls)
            raise

    def _fits(self, owner: str, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` may be staged now (caller holds the lock)."""
        held = self._owner_bytes.get(owner, 0)
        if self.staged_bytes + nbytes <= self.staging_budget_bytes:
            return True
        return held + nbytes <= self.staging_floor_bytes or not held

    def _charge(self, owner: str, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + nbytes

    def _uncharge(self, owner: str, nbytes: int) -> None:
        self.staged_bytes -= nbytes
        left = self._owner_bytes.get(owner, 0) - nbytes
        if left > 0:
            self._owner_bytes[owner] = left
        else:
            self._owner_bytes.pop(owner, None)

    def _give_back(self, owner: str, chunks: Sequence[_Chunk]) -> None:
        """Return gathered chunks' buffers to the pool (their copies ran and nothing reads them any more)."""
        freed = 0
        for c in chunks:
            if c.buf is None:
                continue
            self.ops.wait(c.event)
            self.pool.give(c.buf)
            freed += c.charged
            c.buf = None
        if freed:
            with self._lock:
                self._uncharge(owner, freed)

    def reclaim(self) -> None:
        """Give back the sent copies zmq no longer reads (the I/O thread calls it every turn). A transfer's writes
        leave its decode's pipe in order, so each transfer's are looked at oldest first, up to the first still
        read."""
        if not self._retired:
            return
        done: list[tuple[str, list[_Chunk]]] = []
        with self._lock:
            for owner, queue in list(self._retired.items()):
                while queue and all(p.done for p in queue[0][0]):
                    done.append((owner, queue.popleft()[1]))
                if not queue:
                    del self._retired[owner]
        for owner, chunks in done:
            self._give_back(owner, chunks)

    def consumed(self, owner: str, layer: int, count: int, probes: list[ReadDone]) -> None:
        """I/O thread: the sender is done with the oldest ``count`` offers of this layer (sent, or not needed by
        decode); their buffers go back once ``probes`` (the writes that sent them) say nothing reads them."""
        with self._lock:
            chunks = self._staged.get((owner, layer))
            if not chunks:
                return
            # NIXL registered: nothing was staged per offer, and every copy made on demand was made for these writes
            n = len(chunks) if self.direct else count
            gone = chunks[:n]
            del chunks[:n]
            if not chunks:
                del self._staged[(owner, layer)]
            self._retired.setdefault(owner, deque()).append(([p for p in probes if p is not None], gone))
        self.reclaim()

    def wait_staged(self, owner: str, layer: int) -> None:
        """NIXL on device memory: return once the kernels that wrote this layer's offered blocks have run."""
        with self._lock:
            events = self._ready.pop((owner, layer), [])
        for ev in events:
            self.ops.wait(ev)

    def staged(self, owner: str, layer: int) -> bool:
        """Every copy staged for this layer (and, for NIXL, every kernel it waits for) has run: a query, no wait.
        The sender asks when it is about to send the layer: copies that waited for the staging budget are queued
        now, as far as the budget (or the transfer's floor) allows, and always for the transfer's lowest layer
        still to be sent, so it keeps moving whatever the others hold."""
        key = (owner, layer)
        with self._lock:
            chunks = list(self._staged.get(key, ()))
            ready = list(self._ready.get(key, ()))
        waiting = [c for c in chunks if c.buf is None]
        if waiting and not self._gather_deferred(owner, layer, waiting):
            return False
        return all(self.ops.done(c.event) for c in chunks) and all(self.ops.done(ev) for ev in ready)

    def _gather_deferred(self, owner: str, layer: int, waiting: list[_Chunk]) -> bool:
        """I/O thread: queue these deferred gathers in order (non-blocking: on the side stream, after the kernels'
        event recorded when they were staged) while the budget allows, or all of them when this is the transfer's
        lowest layer with copies left; True when none is left waiting."""
        self.reclaim()
        with self._lock:
            lowest = layer <= min(k[1] for k in self._staged if k[0] == owner)
        for c in waiting:
            cls = self.pool.size_class(len(c.blocks) * self.block_bytes)
            with self._lock:
                if not lowest and not self._fits(owner, cls):
                    return False
                self._charge(owner, cls)
            buf, c.event = self._gather(owner, cls, layer, c.blocks, c.after)
            c.charged, c.after = cls, None
            c.buf = buf  # last: a chunk with a buffer has its event
        return True

    def read(self, layer: int, block_id: int, owner: str = "") -> memoryview:
        with self._lock:
            chunks = list(self._staged.get((owner, layer), ()))
        for chunk in reversed(chunks):  # a re-staged block: the newest copy
            i = chunk.offset.get(block_id) if chunk.buf is not None else None
            if i is not None:
                self.ops.wait(chunk.event)
                bb = self.block_bytes
                return memoryview(chunk.buf.numpy()[i * bb : (i + 1) * bb])
        if self.direct:
            # NIXL is registered, but this decode is on TCP (no NIXL, or its NIXL peer failed): copy out now.
            return self._gather_now(owner, layer, [block_id])
        raise RuntimeError(
            f"block {block_id} of layer {layer} was offered for {owner!r} before it was staged"
        )

    def read_blocks(
        self, layer: int, block_ids: list[int], owner: str = "", out: memoryview | None = None
    ) -> list[memoryview]:
        """The staged copies of these blocks: when they are a stretch of what one ``stage`` gathered (the connector
        offers what it staged), one view of that pinned buffer, after one event wait; otherwise adjacent copies
        joined.
        ``out`` is not needed: the gather already ran on the device."""
        with self._lock:
            chunks = list(self._staged.get((owner, layer), ()))
        n, bb = len(block_ids), self.block_bytes
        for chunk in reversed(chunks):
            start = chunk.offset.get(block_ids[0]) if n and chunk.buf is not None else None
            # a stretch of one staged copy (all of it, or what is left after decode's own prefix): one view
            if start is not None and chunk.blocks[start : start + n] == block_ids:
                self.ops.wait(chunk.event)
                return [memoryview(chunk.buf.numpy()[start * bb : (start + n) * bb])]
        if self.direct and n:
            return [self._gather_now(owner, layer, block_ids)]
        return _join_adjacent([self.read(layer, b, owner) for b in block_ids])

    def _gather_now(self, owner: str, layer: int, blocks: list[int]) -> memoryview:
        """NIXL is registered (nothing was staged) but this decode reads over TCP: one gather of the blocks once the
        layer's kernels have run, waited for here; the copy goes back when the sender has consumed the layer."""
        self.wait_staged(owner, layer)
        n, bb = len(blocks), self.block_bytes
        cls = self.pool.size_class(n * bb)
        with self._lock:
            self._charge(owner, cls)
        buf, event = self._gather(owner, cls, layer, blocks, None)
        self.ops.wait(event)
        offset = {b: i for i, b in enumerate(blocks)}
        chunk = _Chunk(buf=buf, event=event, offset=offset, blocks=list(blocks), charged=cls)
        with self._lock:
            self._staged.setdefault((owner, layer), []).append(chunk)
        return memoryview(buf.numpy()[: n * bb])

    def stop_staging(self, owner: str) -> None:
        """I/O thread: ``owner``'s transfer ended while its request runs on; its later steps stage nothing (what
        is staged already goes back at ``release``)."""
        with self._lock:
            self._stopped.add(owner)

    def release(self, owner: str) -> None:
        """The engine no longer reads ``owner``'s staged blocks: their buffers go back to the pool."""
        with self._lock:
            self._stopped.discard(owner)
            keys = [k for k in self._staged if k[0] == owner]
            chunks = [c for k in keys for c in self._staged.pop(k)]
            for k in [k for k in self._ready if k[0] == owner]:
                del self._ready[k]
            chunks += [c for _, sent in self._retired.pop(owner, ()) for c in sent]
        self._give_back(owner, chunks)

    # ---------------------------------------------------------------- receiver

    def write_blocks(self, layer: int, block_ids: BlockIds, data: list[Any]) -> None:
        """I/O thread: queue the copy of whole blocks (``block_bytes`` each, logical order) into this layer."""
        bb = self.block_bytes
        buf = self.pool.take(len(block_ids) * bb)
        host = buf.numpy()
        pos = 0
        for d in data:  # one copy per frame (a frame holds one or more blocks)
            src = np.frombuffer(d, dtype=np.uint8)
            host[pos : pos + len(src)] = src
            pos += len(src)
        if pos != len(block_ids) * bb:
            self.pool.give(buf)
            raise ValueError(f"{pos} bytes of data for {len(block_ids)} blocks of {bb} bytes")
        event = self.ops.scatter(self._bytes[layer], block_ids, buf)
        with self._lock:
            self._pending.append((event, buf))
            # Buffers of copies that already landed go back to the pool now, not at the end of the whole load.
            landed: list[tuple[Any, Any]] = []
            still: list[tuple[Any, Any]] = []
            for item in self._pending:
                (landed if self.ops.done(item[0]) else still).append(item)
            self._pending = still
        for _, b in landed:
            self.pool.give(b)

    def sync(self) -> None:
        """Receiver: every block written so far is in device memory when this returns."""
        with self._lock:
            pending, self._pending = self._pending, []
        for event, buf in pending:
            self.ops.wait(event)
            self.pool.give(buf)


def _join_adjacent(views: list[memoryview]) -> list[memoryview]:
    """Merge views that are adjacent in memory (consecutive blocks of one staged buffer) into one view each."""
    out: list[memoryview] = []
    start = end = 0
    base: np.ndarray | None = None
    for v in views:
        arr = np.frombuffer(v, dtype=np.uint8)
        addr = arr.__array_interface__["data"][0]
        if base is not None and addr == end:
            end += len(arr)
            continue
        if base is not None:
            out.append(_span(base, start, end))
        base, start, end = arr, addr, addr + len(arr)
    if base is not None:
        out.append(_span(base, start, end))
    return out


def _span(first: np.ndarray, start: int, end: int) -> memoryview:
    """A view of ``end - start`` bytes from ``first``'s address (``first`` lies at its start, inside one buffer)."""
    return np.lib.stride_tricks.as_strided(first, shape=(end - start,), strides=(1,)).data


class TorchDeviceOps:
    """DeviceOps with torch: on CUDA, pinned buffers and one side stream for all staging copies; on CPU the same
    copies run synchronously (CI exercises the exact indexing code that runs on a GPU)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.cuda)

    def compute_event(self) -> Any:
        if not self.cuda:
            return None
        ev = self.torch.cuda.Event()
        ev.record(self.torch.cuda.current_stream(self.device))
        return ev

    def _index(self, blocks: BlockIds) -> Any:
        return self.torch.tensor(blocks, dtype=self.torch.long).to(self.device, non_blocking=True)

    def gather(self, dst: Any, cache: Any, blocks: list[int], after: Any) -> Any:
        torch = self.torch
        n = len(blocks)
        out = dst[: n * int(prod(cache.shape[1:]))].view(n, *cache.shape[1:])
        if not self.cuda:
            torch.index_select(cache, 0, self._index(blocks), out=out)
            return None
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            out.copy_(cache.index_select(0, self._index(blocks)), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def scatter(self, cache: Any, blocks: BlockIds, src: Any) -> Any:
        torch = self.torch
        n = len(blocks)
        rows = src[: n * int(prod(cache.shape[1:]))].view(n, *cache.shape[1:])
        if not self.cuda:
            cache.index_copy_(0, self._index(blocks), rows)
            return None
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            cache.index_copy_(0, self._index(blocks), rows.to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def done(self, event: Any) -> bool:
        return event is None or bool(event.query())


def check_block_major(shape: tuple[int, ...], num_blocks: int) -> None:
    """vLLM 0.32 hands ``[num_blocks, H, N, C]`` views; kernel-block splitting (FlashInfer/MLA with a large
    ``--block-size``) gives ``num_blocks * ratio`` rows instead, which this connector does not address."""
    if len(shape) != 4 or (num_blocks and shape[0] != num_blocks):
        raise ValueError(
            f"unsupported KV cache view {shape} for {num_blocks} blocks: DisaggConnector moves whole "
            "[num_blocks, heads, tokens, content] blocks. With kernel-block splitting, set --block-size to the "
            "attention backend's kernel block size (e.g. 16)."
        )
