"""KV caches in accelerator memory (CUDA), seen by the transfer engine as whole host-side blocks.

The engine moves "the bytes of block b of layer l". For a host cache those are a view into the cache; for a CUDA
cache they must first be copied to pinned host memory, and that copy must neither stall the forward pass nor read
a layer before the kernel that writes it has run. So:

* sender: ``stage(layer, blocks)`` is called from ``save_kv_layer`` on the compute thread. It records an event on the
  compute stream and queues device-to-host copies on a side stream that waits for that event: the copy overlaps the
  next layers. ``read`` (I/O thread) waits only for that block's copy.
* receiver: ``write`` (I/O thread) fills a pinned slot and queues a host-to-device copy on the side stream.
  ``sync()`` waits for every queued copy; the engine calls it before it reports a load as finished, so vLLM never
  schedules a request whose KV is still in flight.

Layouts: block-major (``[num_blocks, ...]``, one segment per block) and K/V-split (``[2, num_blocks, ...]``, as
FlashAttention stores it: two segments per block, K then V). A block's bytes on the wire are its segments
concatenated, so both sides must use the same layout (the handshake's ``kv_layout`` carries it).

The CUDA calls sit behind :class:`DeviceOps`, so this logic is unit-tested on machines without a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class DeviceOps(Protocol):
    """The few device operations the store needs (real: :class:`TorchCudaOps`; tests: a fake)."""

    def pinned(self, nbytes: int) -> np.ndarray: ...

    def compute_event(self) -> Any: ...

    def d2h(self, dst: np.ndarray, segments: list[Any], after: Any) -> Any: ...

    def h2d(self, segments: list[Any], src: np.ndarray) -> Any: ...

    def wait(self, event: Any) -> None: ...


@dataclass
class _Slot:
    buf: np.ndarray
    event: Any = None


@dataclass
class DeviceBlockStore:
    """BlockStore over device tensors, one per layer, through pinned staging slots."""

    layers: list[Any]  # device tensors
    ops: DeviceOps
    kv_split: bool  # [2, num_blocks, ...] (True) or [num_blocks, ...] (False)
    segment_bytes: int  # bytes of one segment (a whole block when not split)
    direct: bool = False  # NIXL reads/writes device memory itself: stage() only orders it after the kernels
    _slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)
    _pending_h2d: list[Any] = field(default_factory=list)
    _ready: dict[tuple[int, int], Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[1 if self.kv_split else 0])

    @property
    def block_bytes(self) -> int:
        return self.segment_bytes * (2 if self.kv_split else 1)

    # NIXL registers device memory directly, but only block-major caches: one descriptor per block per layer.
    @property
    def layer_addrs(self) -> list[int]:
        if not self.direct:
            raise AttributeError("layer_addrs: only block-major caches are registered with NIXL directly")
        return [int(t.data_ptr()) for t in self.layers]

    @property
    def layer_bytes(self) -> int:
        if not self.direct:
            raise AttributeError("layer_bytes")
        return self.num_blocks * self.block_bytes

    nixl_mem_type = "VRAM"

    def segments(self, layer: int, block: int) -> list[Any]:
        t = self.layers[layer]
        return [t[0, block], t[1, block]] if self.kv_split else [t[block]]

    def _slot(self, layer: int, block: int) -> _Slot:
        with self._lock:
            slot = self._slots.get((layer, block))
            if slot is None:
                slot = self._slots[(layer, block)] = _Slot(self.ops.pinned(self.block_bytes))
            return slot

    def stage(self, layer: int, blocks: list[int]) -> None:
        """Sender, compute thread: queue the copies of these blocks once this layer's kernels have run."""
        after = self.ops.compute_event()
        if self.direct:
            with self._lock:
                for b in blocks:
                    self._ready[(layer, b)] = after
            return
        for b in blocks:
            slot = self._slot(layer, b)
            slot.event = self.ops.d2h(slot.buf, self.segments(layer, b), after)

    def wait_staged(self, layer: int, blocks: list[int]) -> None:
        """NIXL on device memory: return once the kernels that wrote these blocks have run."""
        with self._lock:
            events = [self._ready.pop((layer, b), None) for b in blocks]
        for ev in events:
            if ev is not None:
                self.ops.wait(ev)

    def read(self, layer: int, block_id: int) -> memoryview:
        slot = self._slots.get((layer, block_id))
        if slot is None or slot.event is None:
            raise RuntimeError(f"block {block_id} of layer {layer} was offered before it was staged")
        self.ops.wait(slot.event)
        return slot.buf.data

    def write(self, layer: int, block_id: int, data: memoryview | bytes) -> None:
        slot = self._slot(layer, block_id)
        if slot.event is not None:
            self.ops.wait(slot.event)  # the previous copy out of this slot must finish before we overwrite it
        slot.buf[:] = np.frombuffer(data, dtype=np.uint8)
        slot.event = self.ops.h2d(self.segments(layer, block_id), slot.buf)
        with self._lock:
            self._pending_h2d.append(slot.event)

    def sync(self) -> None:
        """Receiver: every block written so far is in device memory when this returns."""
        with self._lock:
            pending, self._pending_h2d = self._pending_h2d, []
        for ev in pending:
            self.ops.wait(ev)

    def release(self, layer: int, blocks: list[int]) -> None:
        """Drop staging slots of blocks that are no longer needed (bounds pinned memory)."""
        with self._lock:
            for b in blocks:
                self._slots.pop((layer, b), None)


class TorchCudaOps:
    """DeviceOps on CUDA: pinned host buffers and one side stream for all staging copies."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pinned(self, nbytes: int) -> np.ndarray:
        t = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)
        return t.numpy()

    def compute_event(self) -> Any:
        ev = self.torch.cuda.Event()
        ev.record(self.torch.cuda.current_stream(self.device))
        return ev

    def d2h(self, dst: np.ndarray, segments: list[Any], after: Any) -> Any:
        torch = self.torch
        host = torch.from_numpy(dst)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            off = 0
            for seg in segments:
                flat = seg.reshape(-1).view(torch.uint8)
                host[off : off + flat.numel()].copy_(flat, non_blocking=True)
                off += flat.numel()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def h2d(self, segments: list[Any], src: np.ndarray) -> Any:
        torch = self.torch
        host = torch.from_numpy(src)
        with torch.cuda.stream(self.stream):
            off = 0
            for seg in segments:
                flat = seg.reshape(-1).view(torch.uint8)
                flat.copy_(host[off : off + flat.numel()], non_blocking=True)
                off += flat.numel()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event: Any) -> None:
        event.synchronize()


def detect_layout(shape: tuple[int, ...], num_blocks: int) -> bool:
    """True for K/V-split ``[2, num_blocks, ...]``, False for block-major ``[num_blocks, ...]``; else ValueError."""
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        return True
    if shape and shape[0] == num_blocks:
        return False
    raise ValueError(f"unsupported KV cache layout {shape} for {num_blocks} blocks")
