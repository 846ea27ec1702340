"""The TCP data path: each layer's blocks go to decode as zero-copy frames on the side channel's own connection.

Decode writes a layer's blocks as its message arrives (``receiver.py``), so on decode's side this path has nothing
to do. On prefill's side zmq reads the block buffers after ``send`` returns: a transfer stays in flight until zmq's
trackers say it let go, and only then may the blocks be freed (or overwritten by the next forward pass).
"""

from __future__ import annotations

import zlib
from typing import Any

import zmq

from vllm_disagg.transport.block_store import BlockStore
from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.transport.datapath import PathContext, WriteFailed
from vllm_disagg.wire import LayerBlocks, encode


def checksums(blocks: list[Any]) -> list[int]:
    """CRC32 per block (``verify_checksums``): decode counts a block as arrived only if it matches."""
    return [zlib.crc32(b) for b in blocks]


class TcpPath:
    name = "tcp"
    remote_writes = False
    polled = False  # its frames arrive on a socket, which wakes the I/O loop

    def __init__(self, store: BlockStore, channel: SideChannel, verify_checksums: bool) -> None:
        self._store = store
        self._channel = channel
        self._verify = verify_checksums
        self._trackers: dict[str, list[zmq.MessageTracker]] = {}  # transfer id -> frames zmq may still read

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
    ) -> None:
        views = [self._store.read(layer, b, owner) for b in src_blocks]
        if self._verify:
            header.crc32 = checksums(views)
        try:
            tracker = self._channel.send_layer(peer, [*encode(header), *views])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: decode disconnected
            raise WriteFailed(f"decode unreachable while sending ({exc})", peer_gone=True) from None
        if tracker is not None:
            self._trackers.setdefault(transfer_id, []).append(tracker)

    def progress(self) -> set[str]:
        return set()

    def in_flight(self, transfer_id: str) -> bool:
        trackers = self._trackers.get(transfer_id)
        if trackers is None:
            return False
        trackers[:] = [t for t in trackers if not t.done]
        if not trackers:
            del self._trackers[transfer_id]
        return bool(trackers)

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        self._trackers.clear()
