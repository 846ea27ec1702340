"""A data path that writes straight into decode's cache, as NIXL does, whose writes land only when a test opens
its gate: "writes still in flight" as a state a test can hold."""

from __future__ import annotations

import threading
from collections.abc import Callable

from vllm_disagg.transport.datapath import PathContext, PathFactory, WriteFailed
from vllm_disagg.transport.tcp import TcpPath
from vllm_disagg.wire import LayerBlocks, encode

_BUS: dict[str, GatedWritesPath] = {}  # engine name -> its path: this process is the whole "network"


class GatedWritesPath:
    name = "gated"
    remote_writes = True
    polled = True
    multi_layer_writes = False
    max_write_bytes = 0
    gate = threading.Event()  # set: posted writes land at the writer's next progress()

    def __init__(self, ctx: PathContext) -> None:
        self.me, self.store = ctx.name, ctx.store
        self.inbox: list[tuple[str, bytes]] = []
        self.peers: dict[bytes, str] = {}
        self.posted: list[tuple[str, Callable[[], None]]] = []
        self.lock = threading.Lock()
        _BUS[self.me] = self

    @classmethod
    def open(cls, ctx: PathContext) -> GatedWritesPath:
        return cls(ctx)

    def offer(self) -> bytes:
        return self.me.encode()

    def connect(self, accepted: bytes) -> str:
        return accepted.decode()

    def accept(self, peer: bytes, offer: bytes) -> bytes:
        self.peers[peer] = offer.decode()
        return self.me.encode()

    def forget(self, peer: bytes) -> None:
        self.peers.pop(peer, None)

    def landed(self) -> list[tuple[str, bytes]]:
        with self.lock:
            out, self.inbox = self.inbox, []
        return out

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
        if dst_blocks is None:
            raise WriteFailed("decode did not list its destination blocks")
        remote = _BUS[self.peers[peer]]
        data = [bytes(self.store.read(layer, b, owner)) for b in src_blocks]
        note = encode(header)[1]
        dst = list(dst_blocks)

        def land() -> None:
            remote.store.write_blocks(layer, dst, data)
            with remote.lock:
                remote.inbox.append((self.me, note))

        self.posted.append((transfer_id, land))

    def progress(self) -> set[str]:
        if self.gate.is_set():
            for _, land in self.posted:
                land()
            self.posted = []
        return set()

    def in_flight(self, transfer_id: str) -> bool:
        return any(t == transfer_id for t, _ in self.posted)

    def blocked(self, transfer_id: str) -> bool:
        return False

    def busy(self) -> bool:
        return bool(self.posted)

    def close(self) -> None:
        pass


PATHS: dict[str, PathFactory] = {"gated": GatedWritesPath.open, "tcp": TcpPath.open}
