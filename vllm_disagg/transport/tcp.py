"""The TCP data path: each layer's blocks go to decode as a few frames on the side channel's own connection.

A layer message is one header plus frames that hold its blocks back to back. Runs of adjacent blocks go as one
zero-copy frame each; when the runs are short (small, scattered blocks: vLLM's 16-token blocks), the layer's blocks
are gathered with one copy into a slot of a bounded, reusable ring and sent as one frame per ``MAX_FRAME_BYTES``, so
zmq, decode and the Python on both sides see a few frames per layer instead of one per block. When the ring is full
of bytes zmq has not sent yet, the write is deferred (``WriteDeferred``: the sender retries it on a later turn) rather
than sent one frame per block, which would cost far more CPU per byte just when the socket is the bottleneck; only a
write too big for an empty ring goes zero-copy, one frame per run. The ring is reused in order, so one slot that zmq
holds for long (a decode that stopped reading: its frames wait in its queue) would hold every later write, to every
decode; once the oldest slot is ``PINNED_AFTER_S`` old, writes that do not fit go zero-copy instead of waiting.

A decode's frames share one zmq pipe, first in first out, so whatever a transfer queues there, every later transfer
to that decode waits behind. One transfer therefore keeps at most ``TRANSFER_QUEUE_BYTES`` queued in zmq: its next
write is deferred until zmq has sent enough of the earlier ones. A long prompt's layers then interleave with other
transfers' instead of holding them for its whole send, and a decode that stopped reading holds one window of its
own transfer, not the ring.

Decode writes a layer's blocks as its message arrives (``receiver.py``), so on decode's side this path has nothing
to do. On prefill's side zmq reads the frames after ``send`` returns: a transfer stays in flight until zmq's
trackers say it let go, and only then may the blocks be freed (or overwritten by the next forward pass); a ring
slot is reused only after its tracker is done.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from vllm_disagg.transport.block_store import BlockStore, block_runs, layers_reader
from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.transport.datapath import PathContext, WriteDeferred, WriteFailed
from vllm_disagg.wire import MAX_FRAME_BYTES, LayerBlocks, block_views, encode

# Runs shorter than this on average are gathered: below it, per-frame costs (zmq, Python on both sides) cost more
# than one copy (measured: 64 KiB blocks 2.4-2.7 GB/s gathered against 1.8 one frame per block).
_GATHER_BELOW = 256 << 10
# The gather ring's size per prefill worker: the most gathered bytes zmq may hold at once.
RING_BYTES = 64 << 20
# The oldest ring slot held longer than this pins the ring (its decode is not reading): writes stop waiting for it.
PINNED_AFTER_S = 1.0
# The most bytes one transfer may have queued in zmq before its next write waits: what another transfer to the same
# decode queues behind (16 MiB is ~5-15 ms on a host link at 1-3 GB/s), and above what a 1 ms retry needs to keep
# the socket busy.
TRANSFER_QUEUE_BYTES = 16 << 20
# One message's block bytes at most: a longer layer goes as several, so other transfers' messages fit in between.
WRITE_MAX_BYTES = 4 << 20


def checksums(frames: list[Any], block_bytes: int) -> list[int]:
    """CRC32 per block (``verify_checksums``): decode counts a block as arrived only if it matches."""
    return [zlib.crc32(b) for b in block_views(frames, block_bytes)]


@dataclass
class _Slot:
    start: int
    end: int
    tracker: zmq.MessageTracker | None = None
    # The send was attempted: from then on the tracker (None: nothing of zmq's holds the slot) says when it is free.
    sent: bool = False
    taken: float = field(default_factory=time.monotonic)

    def free(self) -> bool:
        return self.sent and (self.tracker is None or self.tracker.done)


class GatherRing:
    """A bounded host buffer for gathered frames, reused in order: a slot is taken at the head and comes back once
    zmq has sent it, so gathered bytes in flight never exceed ``capacity`` however long the prompt. Allocated on
    first use (a decode-only worker never pays for it)."""

    def __init__(self, capacity: int = RING_BYTES) -> None:
        self.capacity = capacity
        self._buf: np.ndarray | None = None
        self._head = 0  # where the next slot starts
        self._live: deque[_Slot] = deque()  # slots in the order taken

    def take(self, nbytes: int) -> tuple[_Slot, memoryview] | None:
        """A slot of ``nbytes`` and its writable view, or None while the ring is too full (or ``nbytes`` too big)."""
        self._reclaim()
        if nbytes > self.capacity:
            return None
        if not self._live:
            self._head = 0
        tail = self._live[0].start if self._live else self.capacity
        # Slots are never empty, so live slots lie in [tail, head) when head > tail, else they wrapped round.
        if self._live and self._head > tail:  # free space: [head, capacity) and then [0, tail)
            if self.capacity - self._head < nbytes:
                if tail < nbytes:
                    return None
                self._head = 0
        elif self._live and tail - self._head < nbytes:  # wrapped: free space is [head, tail)
            return None
        if self._buf is None:
            self._buf = np.empty(self.capacity, dtype=np.uint8)
        slot = _Slot(self._head, self._head + nbytes)
        self._live.append(slot)
        self._head = slot.end
        return slot, self._buf[slot.start : slot.end].data

    def idle(self) -> bool:
        """No slot is held (slots zmq has let go of are reclaimed first)."""
        self._reclaim()
        return not self._live

    def pinned(self, after_s: float = PINNED_AFTER_S) -> bool:
        """The oldest slot has been held longer than ``after_s``: waiting for the ring means waiting on one
        decode's socket."""
        self._reclaim()
        return bool(self._live) and time.monotonic() - self._live[0].taken > after_s

    def _reclaim(self) -> None:
        """Forget the oldest slots zmq has let go of (slots are freed in the order they were taken)."""
        while self._live and self._live[0].free():
            self._live.popleft()

    def in_use(self) -> int:
        """Bytes held by slots not yet reclaimed (tests)."""
        return sum(s.end - s.start for s in self._live if not s.free())


def _split(views: list[memoryview], most: int) -> list[memoryview]:
    """``views`` cut into frames of at most ``most`` bytes (a multiple of the block size)."""
    if all(len(v) <= most for v in views):
        return views
    return [v[a : a + most] for v in views for a in range(0, len(v), most)]


class TcpPath:
    name = "tcp"
    remote_writes = False
    polled = False  # its frames arrive on a socket, which wakes the I/O loop
    multi_layer_writes = True  # a step's layers that queued up together go as one message
    # a message of several layers is gathered into the ring and sent as one frame: small enough not to hold the pipe
    multi_layer_max_bytes = 1 << 20
    max_write_bytes = WRITE_MAX_BYTES

    def __init__(self, store: BlockStore, channel: SideChannel, verify_checksums: bool) -> None:
        self._store = store
        self._channel = channel
        self._verify = verify_checksums
        # transfer id -> (tracker, bytes) of its writes zmq may still read, in the order sent
        self._queued: dict[str, deque[tuple[zmq.MessageTracker, int]]] = {}
        self._queued_bytes: dict[str, int] = {}
        self.ring = GatherRing()
        # the store's one-pass gather of a multi-layer frame, where it has one (a host store)
        self._read_layers = layers_reader(store)
        # (block ids, their number of runs) of the last write: a step's layers share one list, counted once
        self._last_runs: tuple[list[int], int] | None = None

    @classmethod
    def open(cls, ctx: PathContext) -> TcpPath:
        return cls(ctx.store, ctx.channel, ctx.settings.verify_checksums)

    def offer(self) -> bytes:
        return b""

    def connect(self, accepted: bytes) -> str:
        return ""

    def landed(self) -> list[tuple[str, bytes]]:
        return []

    def accept(self, peer: bytes, offer: bytes) -> bytes:
        return b""

    def forget(self, peer: bytes) -> None:
        return None

    def write(
        self,
        peer: bytes,
        transfer_id: str,
        owner: str,
        layer: int,
        src_blocks: list[int],
        dst_blocks: list[int] | None,
        header: LayerBlocks,
    ) -> zmq.MessageTracker | None:
        if self.blocked(transfer_id):
            raise WriteDeferred  # this transfer's window is full: later transfers to its decode go first
        slots: list[_Slot] = []
        # Other writes hold the ring: a full ring defers this one (they drain as zmq sends them). An idle ring
        # that cannot hold a write never will, nor soon a pinned one: its remaining blocks go zero-copy instead.
        defer = not self.ring.idle() and not self.ring.pinned()
        try:
            frames = self._layers_frames(
                range(layer, layer + header.layer_count), src_blocks, owner, slots, defer
            )
        except WriteDeferred:
            for slot in slots:  # nothing was sent: the slots taken so far are free again
                slot.sent = True
            raise
        if self._verify:
            header.crc32 = checksums(frames, self._store.block_bytes)
        try:
            tracker = self._channel.send_layer(peer, [*encode(header), *frames])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: decode disconnected
            raise WriteFailed(f"decode unreachable while sending ({exc})", peer_gone=True) from None
        finally:
            for slot in slots:
                slot.sent = True
        for slot in slots:
            slot.tracker = tracker
        if tracker is not None:
            nbytes = sum(memoryview(f).nbytes for f in frames)
            self._queued.setdefault(transfer_id, deque()).append((tracker, nbytes))
            self._queued_bytes[transfer_id] = self._queued_bytes.get(transfer_id, 0) + nbytes
        return tracker

    def _runs(self, src_blocks: list[int]) -> int:
        """How many runs of adjacent blocks ``src_blocks`` has (cached for the list the last write had)."""
        last = self._last_runs
        if last is None or last[0] is not src_blocks:
            last = self._last_runs = (src_blocks, len(block_runs(src_blocks)))
        return last[1]

    def _layers_frames(
        self, layers: range, src_blocks: list[int], owner: str, slots: list[_Slot], defer: bool
    ) -> list[memoryview]:
        """The same blocks of consecutive ``layers`` as frames, layer by layer: gathered into one ring slot when
        the blocks are gathered at all and the layers fit one frame, else each layer's own frames. Ring slots
        taken are appended to ``slots``."""
        if len(layers) == 1:
            return self._frames(layers[0], src_blocks, owner, slots, defer)
        store, bb, n = self._store, self._store.block_bytes, len(src_blocks)
        layer_bytes = n * bb
        if self._gathers(src_blocks) and layer_bytes * len(layers) <= MAX_FRAME_BYTES:
            got = self.ring.take(layer_bytes * len(layers))
            if got is None and defer:
                raise WriteDeferred
            if got is not None:
                slot, view = got
                slots.append(slot)
                if self._read_layers is not None:  # a host store gathers them all with a gather per layer
                    self._read_layers(layers[0], len(layers), src_blocks, owner, view)
                    return [view]
                for i, layer in enumerate(layers):
                    store.read_blocks(
                        layer, src_blocks, owner, out=view[i * layer_bytes : (i + 1) * layer_bytes]
                    )
                return [view]
        frames: list[memoryview] = []
        for layer in layers:
            frames.extend(self._frames(layer, src_blocks, owner, slots, defer))
        return frames

    def _gathers(self, src_blocks: list[int]) -> bool:
        """The blocks are gathered (a copy into the ring) rather than sent as zero-copy runs: host memory, and runs
        too short for a frame each to pay."""
        n, bb = len(src_blocks), self._store.block_bytes
        return self._store.staging == "host" and n >= 2 and n * bb < _GATHER_BELOW * self._runs(src_blocks)

    def _frames(
        self, layer: int, src_blocks: list[int], owner: str, slots: list[_Slot], defer: bool
    ) -> list[memoryview]:
        """The layer's blocks as frames: zero-copy runs, or gathered into ring slots (appended to ``slots``) when
        runs are short. A full ring raises WriteDeferred when ``defer``, else sends the rest zero-copy."""
        store, bb = self._store, self._store.block_bytes
        n = len(src_blocks)
        per = max(
            1, MAX_FRAME_BYTES // bb
        )  # blocks per frame at most (decode's socket limits a frame's size)
        if not self._gathers(src_blocks):
            return _split(store.read_blocks(layer, src_blocks, owner), per * bb)
        frames: list[memoryview] = []
        for a in range(0, n, per):
            # the whole list when it fits one frame: a store converts a list it saw on the step's last layer once
            ids = src_blocks if n <= per else src_blocks[a : a + per]
            got = self.ring.take(len(ids) * bb)
            if got is None:
                if defer:
                    raise WriteDeferred
                frames.extend(_split(store.read_blocks(layer, ids, owner), per * bb))  # one frame per run
                continue
            slots.append(got[0])
            frames.extend(store.read_blocks(layer, ids, owner, out=got[1]))
        return frames

    def progress(self) -> set[str]:
        return set()

    def in_flight(self, transfer_id: str) -> bool:
        """Whether zmq may still read frames of this transfer. Its writes share one pipe and leave in order, so
        the sent ones are dropped from the front, keeping the queued byte count current."""
        queued = self._queued.get(transfer_id)
        if queued is None:
            return False
        left = self._queued_bytes[transfer_id]
        while queued and queued[0][0].done:
            left -= queued.popleft()[1]
        if not queued:
            del self._queued[transfer_id], self._queued_bytes[transfer_id]
            return False
        self._queued_bytes[transfer_id] = left
        return True

    def blocked(self, transfer_id: str) -> bool:
        """This transfer's window is full: zmq still holds ``TRANSFER_QUEUE_BYTES`` of its frames (the count is
        brought up to date first)."""
        if self._queued_bytes.get(transfer_id, 0) < TRANSFER_QUEUE_BYTES:
            return False
        self.in_flight(transfer_id)
        return self._queued_bytes.get(transfer_id, 0) >= TRANSFER_QUEUE_BYTES

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        self._queued.clear()
        self._queued_bytes.clear()
