"""A data path defined in this file alone moves blocks through two real engines: the DataPath interface is enough.

The toy path copies blocks between two stores in this process and reports each layer as landed afterwards, the
way a path that writes decode's memory directly (NIXL, say) reports its writes."""

from __future__ import annotations

import time

from support.transfer_engines import LAYERS, geometry, store, wait_results

from vllm_disagg.transport.datapath import PathContext, WriteFailed
from vllm_disagg.transport.engine import EngineSettings, TransferEngine
from vllm_disagg.transport.records import RecvRecord, SendOutcome, SendRecord
from vllm_disagg.transport.tcp import TcpPath
from vllm_disagg.wire import LayerBlocks, encode

_BUS: dict[str, MemPath] = {}  # path name -> the path: this process is the whole "network"


class MemPath:
    name = "mem"
    remote_writes = False  # write() copies synchronously: nothing lands after it returns
    polled = True  # landed notices wake no socket
    multi_layer_writes = False
    multi_layer_max_bytes = 1 << 20
    max_write_bytes = 0

    def __init__(self, ctx: PathContext) -> None:
        self.me, self.store = ctx.name, ctx.store
        self.inbox: list[tuple[str, bytes]] = []
        self.peers: dict[bytes, str] = {}  # decode's side-channel identity -> its path's name
        self.blocks_written = 0
        _BUS[self.me] = self

    @classmethod
    def open(cls, ctx: PathContext) -> MemPath:
        return cls(ctx)

    def offer(self) -> bytes:
        return self.me.encode()

    def connect(self, accepted: bytes) -> str:
        return accepted.decode()

    def landed(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def accept(self, peer: bytes, offer: bytes) -> bytes:
        self.peers[peer] = offer.decode()
        return self.me.encode()

    def forget(self, peer: bytes) -> None:
        self.peers.pop(peer, None)

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
        remote.store.write_blocks(layer, dst_blocks, data)
        remote.inbox.append((self.me, encode(header)[1]))
        self.blocks_written += len(src_blocks)

    def progress(self) -> set[str]:
        return set()

    def in_flight(self, transfer_id: str) -> bool:
        return False

    def blocked(self, transfer_id: str) -> bool:
        return False

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        _BUS.pop(self.me, None)


def _engine(name: str, seed: int | None, paths: dict) -> TransferEngine:  # type: ignore[type-arg]
    settings = EngineSettings(bind_host="127.0.0.1", load_timeout_s=10.0, lease_s=10.0, transport="auto")
    return TransferEngine(store(seed), geometry(), name, settings, data_paths=paths)


def test_a_toy_data_path_moves_blocks_from_sender_to_receiver() -> None:
    p = _engine("toy-P", 1, {"mem": MemPath.open, "tcp": TcpPath.open})
    d = _engine("toy-D", None, {"mem": MemPath.open, "tcp": TcpPath.open})
    try:
        assert p.data_path == d.data_path == "mem"
        p_blocks, d_blocks = [3, 7, 1, 9], [5, 6, 2, 11]
        p.begin_send("t", "req-p", prompt_len=15)
        d.start_load("req-d", "t", ("127.0.0.1", p.port), d_blocks, first_block=0, prompt_len=15)
        time.sleep(0.2)  # decode registered before prefill computes: blocks go out as each layer is offered
        for layer in range(LAYERS):
            p.offer_blocks("t", layer, list(enumerate(p_blocks)), "req-p")
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == set()
        for layer in range(LAYERS):
            for pb, db in zip(p_blocks, d_blocks, strict=True):
                assert bytes(p.store.read(layer, pb)) == bytes(d.store.read(layer, db))
        assert _BUS["toy-P-0"].blocks_written == LAYERS * len(p_blocks)  # none went as TCP frames
        p.finish_send("t", aborted=False, request_id="req-p")
        wait_results(p, lambda r: "req-p" in r.finished_sending)
        (recv,) = [r for r in d.drain_records() if isinstance(r, RecvRecord)]
        assert recv.state == "done" and recv.reason == "all blocks arrived (MEM)"
        (send,) = [r for r in p.drain_records() if isinstance(r, SendRecord)]
        assert send.outcome is SendOutcome.LOADED and send.bytes == recv.bytes > 0
    finally:
        p.close()
        d.close()


def test_peers_without_a_common_data_path_are_refused_and_the_load_fails() -> None:
    p = _engine("toy-P2", 1, {"mem": MemPath.open})
    d = _engine("toy-D2", None, {"tcp": TcpPath.open})
    try:
        p.begin_send("t", "req-p", prompt_len=4)
        d.start_load("req-d", "t", ("127.0.0.1", p.port), [1], first_block=0, prompt_len=4)
        res = wait_results(d, lambda r: "req-d" in r.finished_recving)
        assert res.failed_recving == {"req-d"}  # vLLM recomputes
        (recv,) = d.drain_records()
        assert isinstance(recv, RecvRecord) and "no data path in common" in recv.reason
        assert p.stats["handshakes_refused"] == 1
    finally:
        p.close()
        d.close()


def test_an_engine_whose_port_is_taken_releases_the_paths_it_opened() -> None:
    """A port in use fails the engine's construction; the data paths it had opened are closed (a NIXL agent's
    registrations, a path's sockets), so the caller can retry on another port without leaking them."""
    first = _engine("toy-first", 1, {"mem": MemPath.open, "tcp": TcpPath.open})
    try:
        settings = EngineSettings(bind_host="127.0.0.1", port=first.port, transport="auto")
        try:
            TransferEngine(store(2), geometry(), "toy-second", settings, data_paths={"mem": MemPath.open})
        except Exception:
            pass
        else:
            raise AssertionError("a second engine bound the port the first holds")
        assert "toy-second-0" not in _BUS  # its path was opened, then closed
        assert "toy-first-0" in _BUS  # the first engine's is untouched
    finally:
        first.close()
