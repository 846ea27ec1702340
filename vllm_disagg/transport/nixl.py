"""NIXL (UCX) data path: prefill WRITEs whole blocks straight into decode's registered KV cache.

The side channel (ZMQ) still carries the handshake and registrations; NIXL only moves bytes. Descriptor lists
of every block of every layer are prepared once (the local cache at start-up, a decode's cache when it is
accepted), each as one strided row per layer, so a WRITE of a layer (or of consecutive layers that queued up
together) is one ``make_prepped_xfer`` with two numpy index arrays: O(1) Python per write, and NIXL merges runs of
adjacent blocks into single descriptors. Each WRITE carries a NIXL notification holding the layer header, and NIXL
delivers a notification only after its data landed, so decode counts a block as arrived when the notification
arrives, never earlier (a receiver that trusts an allocation or a partial write would return wrong tokens).

Works on host memory (CPU DRAM; UCX picks shared memory / CMA on one host, TCP or RDMA across hosts) and on CUDA
memory ("VRAM") with the same code; only the memory type differs. NIXL's progress thread is disabled: it spins a
core, and the transfer engine's I/O loop progresses transfers itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from vllm_disagg.transport.block_store import BlockStore, Region
from vllm_disagg.transport.datapath import PathContext, WriteFailed
from vllm_disagg.wire import LayerBlocks, encode

logger = logging.getLogger("vllm_disagg.nixl")


class NixlPeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a decode offers in its Hello (msgpack, as the NIXL offer's bytes) so prefill can WRITE into it."""

    agent_name: str
    metadata: bytes
    layer_addrs: list[int]  # address of each layer's block 0
    block_bytes: int
    mem_type: str = "DRAM"
    device_id: int = 0
    block_stride: int = 0  # bytes between a layer's consecutive blocks; 0: block_bytes (layer-contiguous)
    # Blocks per layer, for a prepared descriptor list; 0: descriptors are built per write.
    num_blocks: int = 0


_offer_decoder = msgspec.msgpack.Decoder(NixlPeerInfo)


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:
        return False
    return True


@dataclass
class _Xfer:
    handle: Any
    transfer_id: str


@dataclass(frozen=True)
class _Remote:
    info: NixlPeerInfo
    prepped: Any  # NIXL's prepared descriptor list of every block of every layer, or None


def _strided_rows(
    layer_addrs: list[int], block_bytes: int, device_id: int, stride: int, num_blocks: int
) -> np.ndarray:
    """One NIXL strided descriptor row per layer: ``num_blocks`` blocks of ``block_bytes``, ``stride`` apart; block
    ``b`` of layer ``l`` is then entry ``l * num_blocks + b`` of the prepared list."""
    rows = np.empty((len(layer_addrs), 5), dtype=np.uint64)
    rows[:, 0] = layer_addrs
    rows[:, 1:] = (block_bytes, device_id, stride, num_blocks)
    return rows


class NixlAgent:
    """One NIXL agent per worker, with the whole KV cache registered once at start-up."""

    def __init__(self, name: str, region: Region, block_bytes: int, num_blocks: int = 0):
        """``region``: the cache's pages and how blocks are addressed in them (``Region.device_id``: NIXL checks
        it on VRAM registration). ``num_blocks`` per layer: with it, descriptors are prepared once (else built per
        write)."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.mem_type = region.mem_type
        self.layer_addrs = list(region.layer_addrs)
        self.block_stride = region.block_stride
        self.block_bytes = block_bytes
        self.device_id = region.device_id
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._reg = self.agent.register_memory(
            [(a, n, self.device_id, "") for a, n in region.spans], self.mem_type
        )
        self.num_blocks = num_blocks
        self._remotes: dict[str, _Remote] = {}
        self.pending: list[_Xfer] = []
        self._local = self._prep(
            "", self.mem_type, self.layer_addrs, block_bytes, self.device_id, self.stride, num_blocks
        )

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes

    def _prep(
        self,
        agent: str,
        mem_type: str,
        layer_addrs: list[int],
        block_bytes: int,
        device_id: int,
        stride: int,
        num_blocks: int,
    ) -> Any:
        """The prepared descriptor list of every block of every layer of one cache (``agent`` "": this one), or
        None when it cannot be prepared (no ``num_blocks``, or a NIXL without strided lists): writes then build
        their descriptors per layer."""
        if num_blocks <= 0:
            return None
        rows = _strided_rows(layer_addrs, block_bytes, device_id, stride, num_blocks)
        try:
            return self.agent.prep_xfer_dlist(agent, rows, mem_type)
        except Exception as exc:
            logger.info("NIXL: cannot prepare a descriptor list (%s); building descriptors per write", exc)
            return None

    def info(self) -> NixlPeerInfo:
        return NixlPeerInfo(
            agent_name=self.name,
            metadata=self.agent.get_agent_metadata(),
            layer_addrs=self.layer_addrs,
            block_bytes=self.block_bytes,
            block_stride=self.block_stride,
            mem_type=self.mem_type,
            device_id=self.device_id,
            num_blocks=self.num_blocks,
        )

    def add_peer(self, info: NixlPeerInfo) -> str:
        if info.agent_name not in self._remotes:
            raw = self.agent.add_remote_agent(info.metadata)
            name = str(raw.decode() if isinstance(raw, bytes) else raw)
            stride = info.block_stride or info.block_bytes
            prepped = None
            if self._local is not None:
                prepped = self._prep(
                    name,
                    info.mem_type,
                    info.layer_addrs,
                    info.block_bytes,
                    info.device_id,
                    stride,
                    info.num_blocks,
                )
            self._remotes[info.agent_name] = _Remote(info, prepped)
            return name
        return info.agent_name

    def remove_peer(self, agent_name: str) -> None:
        """Forget a decode's agent (its connection was forgotten): bounded state on a long-running prefill."""
        remote = self._remotes.pop(agent_name, None)
        if remote is not None:
            _release_dlist(remote.prepped)
            try:
                self.agent.remove_remote_agent(agent_name)
            except Exception:  # pragma: no cover - best effort
                logger.debug("could not remove NIXL agent %s", agent_name, exc_info=True)

    def write_blocks(
        self,
        transfer_id: str,
        peer: str,
        layer: int,
        src_blocks: list[int],
        dst_blocks: list[int],
        notif: bytes,
        layer_count: int = 1,
    ) -> None:
        """Start one WRITE of whole blocks of ``layer_count`` consecutive layers from ``layer`` on (the same blocks
        of each); the notification ``notif`` follows all of the data."""
        remote = self._remotes[peer]
        if self._local is not None and remote.prepped is not None:
            layers = np.arange(layer, layer + layer_count, dtype=np.int64)[:, None]
            src = (np.asarray(src_blocks, dtype=np.int64) + layers * self.num_blocks).reshape(-1)
            dst = (np.asarray(dst_blocks, dtype=np.int64) + layers * remote.info.num_blocks).reshape(-1)
            handle = self.agent.make_prepped_xfer(
                "WRITE", self._local, src.astype(np.int32), remote.prepped, dst.astype(np.int32), notif
            )
        else:
            local_descs, remote_descs = self._descs(remote.info, layer, layer_count, src_blocks, dst_blocks)
            handle = self.agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, notif)
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL WRITE to {peer} failed to start")
        self.pending.append(_Xfer(handle, transfer_id))

    def _descs(
        self, remote: NixlPeerInfo, layer: int, layer_count: int, src_blocks: list[int], dst_blocks: list[int]
    ) -> tuple[Any, Any]:
        """Descriptor lists for a WRITE of these layers (no prepared lists): built in numpy, with runs of blocks
        that are adjacent on both sides (layer-contiguous caches) merged into one descriptor each."""
        src = np.asarray(src_blocks, dtype=np.int64)
        dst = np.asarray(dst_blocks, dtype=np.int64)
        bb, stride, rstride = self.block_bytes, self.stride, remote.block_stride or remote.block_bytes
        if stride == bb and rstride == remote.block_bytes:
            src, dst, lengths = merged_runs(src, dst)
        else:  # blocks of a layer are not adjacent in memory (layers interleaved): one descriptor each
            lengths = np.ones(len(src), dtype=np.int64)
        rows = slice(layer, layer + layer_count)
        local = _desc_rows(self.layer_addrs[rows], src * stride, lengths * bb, self.device_id)
        far = _desc_rows(remote.layer_addrs[rows], dst * rstride, lengths * bb, remote.device_id)
        return (
            self.agent.get_xfer_descs(local.astype(np.uint64), self.mem_type),
            self.agent.get_xfer_descs(far.astype(np.uint64), remote.mem_type),
        )

    def progress(self) -> tuple[set[str], set[str]]:
        """Check in-flight WRITEs: returns (transfer ids with a finished WRITE, transfer ids with a failed one)."""
        done: set[str] = set()
        failed: set[str] = set()
        still: list[_Xfer] = []
        for x in self.pending:
            state = self.agent.check_xfer_state(x.handle)
            if state == "DONE":
                self.agent.release_xfer_handle(x.handle)
                done.add(x.transfer_id)
            elif state == "ERR":
                self.agent.release_xfer_handle(x.handle)
                failed.add(x.transfer_id)
            else:
                still.append(x)
        self.pending = still
        return done, failed

    def in_flight(self, transfer_id: str) -> bool:
        return any(x.transfer_id == transfer_id for x in self.pending)

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sender agent, message) pairs received since the last call."""
        out: list[tuple[str, bytes]] = []
        for agent, msgs in self.agent.get_new_notifs().items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        for x in self.pending:
            try:
                self.agent.release_xfer_handle(x.handle)
            except Exception:  # pragma: no cover - best effort at shutdown
                logger.debug("could not release a NIXL handle at shutdown", exc_info=True)
        self.pending = []
        for remote in self._remotes.values():
            _release_dlist(remote.prepped)
        _release_dlist(self._local)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:  # pragma: no cover
            logger.debug("could not deregister NIXL memory at shutdown", exc_info=True)


def merged_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source block, first destination block, length) of each run of blocks adjacent on both sides."""
    if len(src) < 2:
        return src, dst, np.ones(len(src), dtype=np.int64)
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], cut))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], lengths


def _release_dlist(handle: Any) -> None:
    """Free a prepared descriptor list (best effort: at shutdown or when a decode is forgotten)."""
    if handle is None:
        return
    try:
        handle.release()
    except Exception:  # pragma: no cover - best effort
        logger.debug("could not release a NIXL descriptor list", exc_info=True)


def _desc_rows(layer_addrs: list[int], offsets: np.ndarray, nbytes: np.ndarray, device_id: int) -> np.ndarray:
    """(address, length, device) rows of the same block runs (``offsets`` into a layer, ``nbytes`` each) in each of
    these layers, layer after layer."""
    addrs = (np.asarray(layer_addrs, dtype=np.int64)[:, None] + offsets).reshape(-1)
    return np.stack([addrs, np.tile(nbytes, len(layer_addrs)), np.full_like(addrs, device_id)], 1)


class NixlPath:
    """The DataPath over one NixlAgent: decode offers its agent and layout, prefill WRITEs with notices."""

    name = "nixl"
    remote_writes = True  # a failed load waits until prefill confirms it stopped writing into decode's blocks
    polled = True  # NIXL's completions and notices do not wake the I/O loop's poller
    # Consecutive layers that queued up together go as one WRITE with one notice: each WRITE is a post, a
    # completion to poll and a notice for decode, so a chunked prefill's layers cost a few of each, not one per layer.
    multi_layer_writes = True
    multi_layer_max_bytes = 64 << 20
    max_write_bytes = 0  # one-sided writes share no queue with other transfers' writes

    def __init__(self, nixl: NixlAgent, store: BlockStore) -> None:
        self._nixl = nixl
        self._store = store
        self._agents: dict[bytes, str] = {}  # decode's side-channel identity -> its NIXL agent

    @classmethod
    def open(cls, ctx: PathContext) -> NixlPath | None:
        region = ctx.store.region()
        if not nixl_available() or region is None:
            if ctx.required:
                raise RuntimeError(
                    "transport: nixl was requested but NIXL is not importable (pip install 'vllm-disagg[nixl]') "
                    "or this KV cache cannot be registered; use transport: tcp or auto"
                )
            return None
        try:
            return cls(NixlAgent(ctx.name, region, ctx.store.block_bytes, ctx.store.num_blocks), ctx.store)
        except Exception as exc:
            if ctx.required:
                raise
            logger.warning("NIXL unavailable (%s); using the TCP data path", exc)
            return None

    def offer(self) -> bytes:
        return msgspec.msgpack.encode(self._nixl.info())

    def connect(self, accepted: bytes) -> str:
        return accepted.decode("utf-8", "replace")

    def landed(self) -> list[tuple[str, bytes]]:
        return self._nixl.notifications()

    def accept(self, peer: bytes, offer: bytes) -> bytes:
        info = _offer_decoder.decode(offer)
        self._agents[peer] = self._nixl.add_peer(info)
        return self._nixl.name.encode()

    def forget(self, peer: bytes) -> None:
        agent = self._agents.pop(peer, None)
        if agent is not None and agent not in self._agents.values():
            self._nixl.remove_peer(agent)

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
            raise WriteFailed("registration lacks destination blocks for a NIXL write")
        try:
            for one in range(layer, layer + header.layer_count):
                self._store.wait_staged(owner, one)  # device memory: the kernels must have run
            self._nixl.write_blocks(
                transfer_id,
                self._agents[peer],
                layer,
                src_blocks,
                dst_blocks,
                encode(header)[1],
                header.layer_count,
            )
        except Exception as exc:
            raise WriteFailed(f"NIXL write failed: {exc}") from None

    def progress(self) -> set[str]:
        _, failed = self._nixl.progress()
        return failed

    def in_flight(self, transfer_id: str) -> bool:
        return self._nixl.in_flight(transfer_id)

    def blocked(self, transfer_id: str) -> bool:
        return False

    def busy(self) -> bool:
        return bool(self._nixl.pending)

    def close(self) -> None:
        self._nixl.close()
