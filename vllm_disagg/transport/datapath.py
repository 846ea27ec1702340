"""The DataPath interface: how block bytes get from prefill's KV cache into decode's.

The side channel (``engine.py``: ZMQ) always carries the handshake, registrations, heartbeats and the end of each
transfer. A data path only moves the bytes of whole blocks and says when they have landed. Two kinds exist:

* a path whose frames ride the side channel itself (TCP, ``tcp.py``): decode writes each block as its frame
  arrives, so the path has nothing to report on decode's side;
* a path that writes into decode's memory directly (NIXL, ``nixl.py``): decode learns that blocks landed from the
  path's own notices (``landed``), and prefill may still be writing after a load failed (``remote_writes``).

The handshake is generic: decode's Hello lists each path it has with the path's own ``offer()`` bytes, in
preference order; prefill takes the first one it also has whose ``accept`` succeeds and names it in HelloAck. Paths
are registered in ``paths.py``; a new one is a module implementing this protocol plus one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from vllm_disagg.transport.block_store import BlockStore, ReadDone
from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.wire import LayerBlocks

if TYPE_CHECKING:
    from vllm_disagg.transport.engine import EngineSettings


@dataclass(frozen=True)
class PathContext:
    """What a data path may use when it opens."""

    name: str  # unique per worker (engine id and TP rank): e.g. a NIXL agent name
    store: BlockStore
    settings: EngineSettings
    channel: SideChannel  # the side channel's sends (a path whose frames ride it sends through here)
    required: bool  # the operator asked for this path by name: fail loudly instead of returning None


class WriteFailed(Exception):
    """A write could not be started. ``peer_gone``: decode is unreachable, so telling it (Abort) is pointless."""

    def __init__(self, reason: str, peer_gone: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.peer_gone = peer_gone


class WriteDeferred(Exception):
    """A write has no room on the path now (its staging buffers hold bytes not yet sent) and nothing of it was
    sent: the sender keeps the layers pending and tries again on a later turn of the I/O loop. A path defers only
    while other writes hold its buffers, so a retry can always make progress."""


class DataPath(Protocol):
    """One way of moving blocks. All methods run on the engine's I/O thread.

    Peers are named by the decode's side-channel identity on prefill's side (``accept``, ``write``, ``forget``),
    and by the ``source`` string ``connect`` returns on decode's side (``landed``)."""

    name: str  # on the wire: what Hello offers and HelloAck names
    # prefill writes raw pages into decode's cache itself: chosen only between equal page orders, and a failed load
    # waits until prefill stopped
    remote_writes: bool
    polled: bool  # completions are found by polling (progress, landed): the I/O loop must not sleep long
    # ``write`` takes several consecutive layers at once (``header.layer_count``); else always one
    multi_layer_writes: bool
    # the most block bytes a write of several layers may carry (their layers go in as few writes as fit)
    multi_layer_max_bytes: int
    # the most block bytes one write may carry (0: any): a larger layer is written in pieces of at most this, so
    # other transfers' writes can go between them
    max_write_bytes: int

    # ---- decode
    def offer(self) -> bytes:
        """What prefill needs to write to this instance (sent in Hello)."""
        ...

    def connect(self, accepted: bytes) -> str:
        """Prefill accepted this path, with ``accepted`` from its ``accept``: the ``source`` its notices carry."""
        ...

    def landed(self) -> list[tuple[str, bytes]]:
        """(source, encoded LayerBlocks notice) for every write that completed into this cache since the last
        call; a notice is delivered only after its data is in place."""
        ...

    # ---- prefill
    def accept(self, peer: bytes, offer: bytes) -> bytes:
        """Decode ``peer`` offered this path with ``offer``: prepare to write to it; raise to decline it (the
        next offered path is tried). Returns what decode's ``connect`` needs."""
        ...

    def forget(self, peer: bytes) -> None:
        """Decode ``peer``'s connection was forgotten: drop what ``accept`` kept for it."""
        ...

    def write(
        self,
        peer: bytes,
        transfer_id: str,
        owner: str,
        layer: int,
        src_blocks: list[int],
        dst_blocks: list[int] | None,
        header: LayerBlocks,
    ) -> ReadDone | None:
        """Start sending ``src_blocks`` of ``layer`` (and of the ``header.layer_count - 1`` layers after it, where
        the path takes several) (read for ``owner``, see BlockStore) to decode ``peer``, into its ``dst_blocks``
        (None when decode's registration did not list them). ``header`` describes the blocks to decode. Returns
        what says when the path stops reading the blocks' memory (None: it already has, or it tells ``in_flight``
        only). Raises WriteFailed, or WriteDeferred when the path has no room for it yet."""
        ...

    def progress(self) -> set[str]:
        """Advance writes in flight; returns the transfer ids with a write that failed."""
        ...

    def in_flight(self, transfer_id: str) -> bool:
        """Something still reads this transfer's blocks on prefill (its buffers may not be freed yet)."""
        ...

    def blocked(self, transfer_id: str) -> bool:
        """This transfer's next write would be deferred whatever it carries (its share of the path is full): the
        sender parks it without building the write."""
        ...

    def busy(self) -> bool:
        """Writes are in flight (a polled path needs the loop to keep turning)."""
        ...

    def close(self) -> None: ...


PathFactory = Callable[[PathContext], "DataPath | None"]
"""Opens a data path for one engine, or returns None when it is unavailable here (and not ``required``)."""
