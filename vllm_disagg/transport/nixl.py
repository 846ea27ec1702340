"""NIXL (UCX) data path: prefill WRITEs whole blocks straight into decode's registered KV cache.

The side channel (ZMQ) still carries the handshake and registrations; NIXL only moves bytes. Each WRITE carries a
NIXL notification holding the layer header, and NIXL delivers a notification only after its data landed, so decode
counts a block as arrived when the notification arrives, never earlier (a receiver that trusts an allocation or a
partial write returns wrong tokens; see LMCache's PD pitfall in the reference notes).

Works on host memory (CPU DRAM; UCX picks shared memory / CMA on one host, TCP or RDMA across hosts) and on CUDA
memory ("VRAM") with the same code; only the memory type differs. NIXL's progress thread is disabled: it spins a
core, and the transfer engine's I/O loop progresses transfers itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_disagg.wire import NixlPeerInfo

logger = logging.getLogger("vllm_disagg.nixl")


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


class NixlDataPath:
    """One NIXL agent per worker, with the whole KV cache registered once at start-up."""

    def __init__(
        self,
        name: str,
        regions: list[tuple[int, int]],
        layer_addrs: list[int],
        block_stride: int,
        block_bytes: int,
        mem_type: str = "DRAM",
        device_id: int = 0,
    ):
        """``regions``: disjoint (address, length) spans holding every page; block ``b`` of layer ``l`` is the
        ``block_bytes`` at ``layer_addrs[l] + b * block_stride`` (block-outermost layouts interleave layers).
        ``device_id``: the CUDA ordinal of that memory (NIXL checks it on VRAM registration)."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.mem_type = mem_type
        self.layer_addrs = list(layer_addrs)
        self.block_stride = block_stride
        self.block_bytes = block_bytes
        self.device_id = device_id
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._reg = self.agent.register_memory([(a, n, device_id, "") for a, n in regions], mem_type)
        self._remotes: dict[str, NixlPeerInfo] = {}
        self.pending: list[_Xfer] = []

    def info(self) -> NixlPeerInfo:
        return NixlPeerInfo(
            agent_name=self.name,
            metadata=self.agent.get_agent_metadata(),
            layer_addrs=self.layer_addrs,
            block_bytes=self.block_bytes,
            block_stride=self.block_stride,
            mem_type=self.mem_type,
            device_id=self.device_id,
        )

    def add_peer(self, info: NixlPeerInfo) -> str:
        if info.agent_name not in self._remotes:
            name = self.agent.add_remote_agent(info.metadata)
            self._remotes[info.agent_name] = info
            return str(name.decode() if isinstance(name, bytes) else name)
        return info.agent_name

    def remove_peer(self, agent_name: str) -> None:
        """Forget a decode's agent (its connection was forgotten): bounded state on a long-running prefill."""
        if self._remotes.pop(agent_name, None) is not None:
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
    ) -> None:
        """Start one WRITE of whole blocks of one layer; the notification ``notif`` follows the data."""
        remote = self._remotes[peer]
        bb, stride = self.block_bytes, self.block_stride
        rstride = remote.block_stride or remote.block_bytes
        src = [(self.layer_addrs[layer] + b * stride, bb, self.device_id) for b in src_blocks]
        dst = [(remote.layer_addrs[layer] + b * rstride, bb, remote.device_id) for b in dst_blocks]
        local_descs = self.agent.get_xfer_descs(src, self.mem_type)
        remote_descs = self.agent.get_xfer_descs(dst, remote.mem_type)
        handle = self.agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, notif)
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL WRITE to {peer} failed to start")
        self.pending.append(_Xfer(handle, transfer_id))

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
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:  # pragma: no cover
            logger.debug("could not deregister NIXL memory at shutdown", exc_info=True)
