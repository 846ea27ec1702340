"""Decode (D) side of the transfer engine: one connection per prefill, one state machine per load.

D dials each prefill with a DEALER, says Hello (offering its data paths), registers loads, and writes arriving
blocks straight into its own KV cache (TCP frames here; a direct data path reports blocks already written). A load
is reported loaded only when every needed block of every layer has arrived. A dead peer, a refused handshake, an
Abort or the deadline fails the load (the connector then recomputes): a partial block is never used because an
incomplete load is never reported as loaded. Everything runs on the engine's I/O thread.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import zmq
import zmq.utils.monitor

from vllm_disagg import __version__
from vllm_disagg.transport.block_store import layers_writer
from vllm_disagg.transport.channel import MESSAGES_PER_TURN
from vllm_disagg.transport.datapath import DataPath
from vllm_disagg.transport.endpoints import for_host, tcp_endpoint
from vllm_disagg.transport.parts import EngineParts, EngineSide
from vllm_disagg.transport.records import RecvRecord
from vllm_disagg.transport.zmq_auth import HANDSHAKE_FAILED, as_client, handshake_failure
from vllm_disagg.transport.zmq_monitor import unwatch, watch
from vllm_disagg.wire import (
    MAX_CONTROL_BYTES,
    MAX_FRAME_BYTES,
    Abort,
    Done,
    Heartbeat,
    HelloAck,
    LayerBlocks,
    Message,
    PathOffer,
    Posted,
    Refuse,
    Register,
    WireError,
    block_views,
    check_hello_ack_auth,
    decode,
    decode_layer_notice,
    make_hello,
    peek_transfer_id,
)

logger = logging.getLogger("vllm_disagg.transfer")

_SEND_QUEUE_LIMIT = 100_000  # control messages queued to one prefill
_STOP_HARD_LIMIT = 12  # x cancel_ack_s: the longest decode waits for a live prefill's "stopped writing"
_NOBLOCK = int(zmq.NOBLOCK)

# pending: awaiting the handshake | waiting: registered, blocks arriving | stopping: failed, but prefill may still
# write into the blocks (remote writes), so they are handed back once it confirms | then one of the final three.
LoadState = Literal["pending", "waiting", "stopping", "done", "failed", "cancelled"]
PeerState = Literal["connecting", "ready", "dead"]


@dataclass
class _Incoming:
    request_id: str
    transfer_id: str
    peer: tuple[str, int]
    dest_blocks: list[int]
    first_block: int
    prompt_len: int
    deadline: float
    expected: int
    received: int = 0  # distinct (layer, block) pairs in place
    posted: int = 0  # direct writes prefill announced (``Posted``)
    noticed: int = 0  # direct writes whose notice arrived
    # [layer, index - first_block] -> in place; numpy, so a layer message costs a few calls however many blocks
    got: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    got_per_layer: list[int] = field(default_factory=list)  # in place per layer (the count of ``got``'s row)
    dest_arr: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    state: LoadState = "pending"
    stop_deadline: float = (
        0.0  # while stopping: report the outcome once prefill confirms, or check again then
    )
    outcome: tuple[bool, str, bool] = (False, "", False)  # (ok, reason, cancelled) held while stopping
    prompt_hash: str = ""
    bytes: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    # per layer: when its last block arrived (0: not yet)
    layer_done: np.ndarray = field(default_factory=lambda: np.zeros(0))
    stop_overdue_since: float = 0.0  # when prefill's "stopped writing" first became overdue


@dataclass
class _Peer:
    addr: tuple[str, int]
    sock: zmq.Socket[Any]
    monitor: zmq.Socket[Any]
    state: PeerState = "connecting"
    since: float = 0.0
    engine_id: str = ""
    last_heartbeat: float = 0.0
    hello_nonce: str = ""
    # offers of paths that let prefill write into this cache, kept back until prefill proves the shared secret
    withheld: bool = False
    # how long zmq may still deliver what was queued to this prefill after its socket is closed (a refused decode's
    # last word that it will not load); 0 drops it
    farewell_ms: int = 0
    path: DataPath | None = None  # the data path prefill chose
    source: str = ""  # the path's name for prefill's writes: only its notices count
    unsendable: bool = False  # a send was refused: the next expire() retires this peer


def _relative(idx: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray | None, int]:
    """``idx - lo`` (int64) when every index lies in ``[lo, hi)``; else (None, the first one outside)."""
    if len(idx) and (int(idx.min()) < lo or int(idx.max()) >= hi):
        return None, int(idx[(idx < lo) | (idx >= hi)][0])
    return idx.astype(np.int64) - lo, 0


def _recv_frames(sock: zmq.Socket[Any]) -> list[memoryview]:
    """The next message's frames, zero-copy (zmq.Again when none is waiting). The parts of a message arrive
    together, so only the first receive can find nothing. A loop over ``recv`` reading ``Frame.more`` costs about
    half of pyzmq's ``recv_multipart``, which asks the socket for RCVMORE after every part; decode pays it once
    per layer message."""
    recv = sock.recv
    frame = recv(_NOBLOCK, copy=False)
    frames = [frame.buffer]
    while frame.more:
        frame = recv(_NOBLOCK, copy=False)
        frames.append(frame.buffer)
    return frames


def _layer_slices(payload: list[Any], layer_bytes: int, layers: int) -> list[list[Any]]:
    """A multi-layer message's payload cut into each layer's buffers (``layer_bytes`` each; decode has checked the
    total). A frame never needs cutting when prefill gathered each layer apart, but one that spans layers is cut
    at the boundary rather than trusted."""
    if layers == 1:
        return [payload]
    out: list[list[Any]] = [[] for _ in range(layers)]
    layer, room = 0, layer_bytes
    for frame in payload:
        mv = memoryview(frame).cast("B")
        while len(mv):
            take = min(room, len(mv))
            out[layer].append(mv[:take])
            mv, room = mv[take:], room - take
            if room == 0 and layer + 1 < layers:
                layer, room = layer + 1, layer_bytes
    return out


def _checksums_match(msg: LayerBlocks, payload: list[Any]) -> bool:
    """Every block's CRC32 matches the header's (a frame may hold several blocks)."""
    if not msg.crc32:
        return True
    if len(msg.crc32) != msg.num_blocks * msg.layer_count or msg.block_bytes <= 0:
        return False
    blocks = block_views(payload, msg.block_bytes)
    return all(zlib.crc32(buf) == crc for buf, crc in zip(blocks, msg.crc32, strict=True))


class Receiver(EngineSide):
    """Decode's side: commands from the connector arrive through the public methods; the I/O loop hands it each
    prefill connection's messages (``drain_peer``) and each polled data path's notices (``landed``)."""

    def __init__(self, ctx: zmq.Context[Any], parts: EngineParts) -> None:
        self.ctx = ctx
        super().__init__(parts)
        self.incoming: dict[str, _Incoming] = {}  # by transfer id
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.graveyard: list[_Peer] = []  # dead peers whose sockets the I/O loop closes
        # "won't load" notices waiting for a handshake; queued requests' transfers whose lease we renew
        self.declines: dict[tuple[str, int], list[str]] = {}
        self.watches: dict[tuple[str, int], set[str]] = {}
        # (load, packed indices, relative indices, destination block ids) of the last layer message: every layer
        # of a prefill step names the same blocks, so the step's other layers reuse the mapping
        self._last_map: tuple[_Incoming, bytes, np.ndarray, np.ndarray] | None = None
        # the store's one-pass scatter of a multi-layer frame, where it has one (a host store)
        self._write_layers = layers_writer(self.store)

    # ----------------------------------------------------------------- commands from the worker thread

    def start(
        self,
        request_id: str,
        transfer_id: str,
        peer: tuple[str, int],
        dest_blocks: list[int],
        first_block: int,
        prompt_len: int,
        prompt_hash: str,
    ) -> None:
        now = time.monotonic()
        inc = _Incoming(
            request_id=request_id,
            transfer_id=transfer_id,
            peer=peer,
            dest_blocks=list(dest_blocks),
            first_block=first_block,
            prompt_len=prompt_len,
            deadline=now + self.settings.load_timeout_s,
            expected=len(dest_blocks) * self.store.num_layers,
            t_start=now,
            prompt_hash=prompt_hash,
            got=np.zeros((self.store.num_layers, len(dest_blocks)), dtype=bool),
            got_per_layer=[0] * self.store.num_layers,
            dest_arr=np.asarray(dest_blocks, dtype=np.int64),
            layer_done=np.zeros(self.store.num_layers),
        )
        self._unwatch(transfer_id, peer)
        if transfer_id in self.incoming:
            other = self.incoming[transfer_id].request_id
            self._finalize(inc, ok=False, reason=f"transfer id already loading for request {other}")
            return
        bad = [b for b in dest_blocks if not 0 <= b < self.store.num_blocks]
        if bad:
            self._finalize(inc, ok=False, reason=f"destination blocks {bad[:4]} out of range")
            return
        self.incoming[transfer_id] = inc
        if inc.expected == 0:
            self._finish(inc, ok=True, reason="nothing to load")
            return
        try:
            p = self._peer(peer)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            self._finish(inc, ok=False, reason=f"cannot dial prefill {peer!r}: {exc}")
            return
        if p.state == "ready":
            self._register(p, inc)

    def cancel(self, transfer_id: str, request_id: str) -> None:
        inc = self.incoming.get(transfer_id)
        if inc is not None and request_id and inc.request_id != request_id:
            # Not this request's load (its own was refused as a duplicate and already reported).
            return
        if inc is not None and inc.state in ("pending", "waiting"):
            self._finish(inc, ok=False, reason="request aborted on decode", cancelled=True)

    def watch(self, transfer_id: str, addr: tuple[str, int]) -> None:
        try:
            self._peer(addr)
        except (zmq.ZMQError, ValueError, TypeError):
            return
        self.watches.setdefault(addr, set()).add(transfer_id)

    def decline(self, transfer_id: str, addr: tuple[str, int]) -> None:
        self._unwatch(transfer_id, addr)
        try:
            p = self._peer(addr)
        except (zmq.ZMQError, ValueError, TypeError):
            return
        self.declines.setdefault(addr, []).append(transfer_id)
        if p.state == "ready":
            self._send_declines(p)

    def _unwatch(self, transfer_id: str, addr: tuple[str, int]) -> None:
        watched = self.watches.get(addr)
        if watched is not None:
            watched.discard(transfer_id)
            if not watched:
                del self.watches[addr]

    # ----------------------------------------------------------------- connections

    def _peer(self, addr: tuple[str, int]) -> _Peer:
        """The connection to the prefill at ``addr``, dialled (and greeted) on first use."""
        p = self.peers.get(addr)
        if p is not None:
            return p
        sock = as_client(for_host(self.ctx.socket(zmq.DEALER), str(addr[0])), self.settings.secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # Far above what live loads queue; a send refused here (no connection, or a prefill that stopped reading)
        # retires the peer.
        sock.setsockopt(zmq.SNDHWM, _SEND_QUEUE_LIMIT)
        sock.setsockopt(
            zmq.MAXMSGSIZE, max(MAX_CONTROL_BYTES, MAX_FRAME_BYTES, self.store.block_bytes) + 4096
        )
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        monitor = watch(self.ctx, sock, zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED, "decode")
        host, port = addr
        try:
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"port {port!r} is not in 1..65535")
            sock.connect(tcp_endpoint(host, port))
        except Exception:
            unwatch(sock, monitor)
            sock.close(linger=0)
            raise
        p = _Peer(addr=addr, sock=sock, monitor=monitor, since=time.monotonic())
        self.peers[addr] = p
        # A path prefill writes through (NIXL) is offered with what it needs (this cache's addresses and keys) only
        # once prefill has proved it knows the shared secret: first by name alone, and if prefill takes it, again
        # in full after its HelloAck checked out. Without a secret nobody is authenticated, so it goes at once.
        p.withheld = bool(self.settings.secret) and any(path.remote_writes for path in self.paths.values())
        self._greet(p)
        return p

    def _greet(self, p: _Peer) -> None:
        offers = [
            PathOffer(name=path.name, info=b"" if p.withheld and path.remote_writes else path.offer())
            for path in self.paths.values()
        ]
        hello = make_hello(
            self.settings.secret, self.engine_id, self.geometry, __version__, data_paths=offers
        )
        p.hello_nonce = hello.nonce
        self._tell(p, hello)

    def _tell(self, p: _Peer, msg: Message) -> None:
        """Send on ``p``'s connection. One that zmq tore down (a protocol error) or whose queue is full takes no
        more messages; the peer is retired by the next ``expire()`` rather than here, because callers are midway
        through a load's update."""
        if not self.channel.tell(p.sock, msg):
            p.unsendable = True

    def _register(self, p: _Peer, inc: _Incoming) -> None:
        inc.state = "waiting"
        reg = Register(
            transfer_id=inc.transfer_id,
            request_id=inc.request_id,
            first_block=inc.first_block,
            num_blocks=len(inc.dest_blocks),
            prompt_len=inc.prompt_len,
            dest_blocks=inc.dest_blocks,
            prompt_hash=inc.prompt_hash,
        )
        self._tell(p, reg)

    def _peer_loads(self, p: _Peer) -> list[_Incoming]:
        return [
            i
            for i in self.incoming.values()
            if i.peer == p.addr and i.state in ("pending", "waiting", "stopping")
        ]

    def loading(self) -> bool:
        """Some load waits for blocks (a polled data path needs the I/O loop to keep turning)."""
        return any(i.state in ("waiting", "stopping") for i in self.incoming.values())

    def awaiting_writes(self) -> bool:
        """Prefill announced direct writes (``Posted``) whose notices have not all arrived: a polled data path's
        notices wake nothing, so the I/O loop polls for them quickly until they have."""
        return any(i.posted > i.noticed and i.state == "waiting" for i in self.incoming.values())

    def _send_declines(self, p: _Peer) -> None:
        for tid in self.declines.pop(p.addr, []):
            self._tell(p, Done(transfer_id=tid, ok=False, reason="decode will not load"))

    def _kill_peer(self, p: _Peer, reason: str) -> None:
        p.state = "dead"
        self.declines.pop(p.addr, None)
        self.watches.pop(p.addr, None)
        if self.peers.get(p.addr) is p:
            del self.peers[p.addr]
        self.graveyard.append(p)
        for inc in self._peer_loads(p):
            if inc.state == "stopping":
                self._finalize(inc, *inc.outcome)  # a dead prefill writes no more
            else:
                self._finish(inc, ok=False, reason=reason)

    def drain_monitor(self, p: _Peer) -> None:
        while True:
            try:
                ev = zmq.utils.monitor.recv_monitor_message(p.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if p.state == "dead":
                return
            if ev["event"] & HANDSHAKE_FAILED:
                self.stats["handshakes_refused"] += 1
                why = handshake_failure(ev["event"], ev["value"])
                logger.error("prefill %s:%d: %s; affected requests recompute locally", *p.addr, why)
                self._kill_peer(p, f"refused by prefill: {why}")
                return
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                logger.warning("prefill %s:%d disconnected", *p.addr)
                self._kill_peer(p, "prefill disconnected (died or network failure)")
                return

    def heartbeats(self, now: float) -> None:
        for p in self.peers.values():
            if p.state != "ready" or now - p.last_heartbeat < self.settings.heartbeat_s:
                continue
            tids = [i.transfer_id for i in self._peer_loads(p) if i.state == "waiting"]
            queued = sorted(self.watches.get(p.addr, ()))
            p.last_heartbeat = now
            if tids or queued:
                self._tell(p, Heartbeat(transfer_ids=tids, queued=queued))

    # ----------------------------------------------------------------- messages from prefills

    def drain_peer(self, p: _Peer) -> None:
        """Handle what this prefill sent, at most ``MESSAGES_PER_TURN`` messages: the I/O loop turns in between
        (deadlines, commands, other peers), so a peer that floods cannot hold it."""
        for _ in range(MESSAGES_PER_TURN):
            if p.state == "dead":
                return
            try:
                frames = _recv_frames(p.sock)
            except zmq.Again:
                return
            try:
                msg, payload = decode(frames)
            except WireError as exc:
                self.stats["messages_rejected"] += 1
                logger.warning("rejected a malformed message from prefill %s:%d: %s", *p.addr, exc)
                tid = peek_transfer_id(frames)
                bad = self.incoming.get(tid) if tid else None
                if bad is not None and bad.peer == p.addr and bad.state == "waiting":
                    self._finish(bad, ok=False, reason=f"malformed data: {exc}")
                continue
            try:
                self._on_message(p, msg, payload)
            except Exception:
                self.stats["messages_rejected"] += 1
                logger.exception(
                    "error handling %s from prefill %s:%d; dropped it", type(msg).__name__, *p.addr
                )

    def _on_message(self, p: _Peer, msg: Message, payload: list[Any]) -> None:
        if isinstance(msg, LayerBlocks):
            self._on_layer(p, msg, payload)
        elif isinstance(msg, Posted):
            inc = self.incoming.get(msg.transfer_id)
            if inc is not None and inc.peer == p.addr and inc.state == "waiting" and msg.writes > 0:
                inc.posted += msg.writes
        elif isinstance(msg, HelloAck):
            self._on_hello_ack(p, msg)
        elif isinstance(msg, Refuse):
            self.stats["handshakes_refused"] += 1
            detail = f" ({msg.field}: decode has {msg.ours}, prefill has {msg.theirs})" if msg.field else ""
            logger.error(
                "prefill %s:%d refused this decode: %s%s; affected requests recompute locally",
                *p.addr,
                msg.reason,
                detail,
            )
            # prefill holds these transfers' blocks until told: it takes word of a refused decode that it will
            # not load (else they stay held until the lease ends)
            for inc in self._peer_loads(p):
                if inc.state == "pending":
                    self._tell(
                        p, Done(transfer_id=inc.transfer_id, ok=False, reason="this decode was refused")
                    )
            self._send_declines(p)
            p.farewell_ms = 1000
            self._kill_peer(p, f"refused by prefill: {msg.reason}{detail}")
        elif isinstance(msg, Abort):
            aborted = self.incoming.get(msg.transfer_id)
            if aborted is None or aborted.peer != p.addr:
                return
            if aborted.state == "stopping":
                if msg.writes_stopped:  # any other Abort may have left while writes were still in flight
                    self._finalize(aborted, *aborted.outcome)
            elif aborted.state in ("pending", "waiting"):
                self._finish(aborted, ok=False, reason=f"prefill aborted: {msg.reason}")

    def _on_hello_ack(self, p: _Peer, msg: HelloAck) -> None:
        if p.state != "connecting":
            return
        reason = check_hello_ack_auth(self.settings.secret, msg, p.hello_nonce)
        path = self.paths.get(msg.data_path)
        if not reason and path is None:
            reason = f"prefill chose data path {msg.data_path!r}, which this decode did not offer"
        diff = None if reason else self.geometry.incompatibility(msg.geometry)
        if diff is not None:  # prefill checks this too; an older or broken one may not
            fld, ours, theirs = diff
            reason = (
                f"incompatible KV layout: {fld} is {theirs} on prefill but {ours} here (decode). Fix: run both "
                f"instances with the same {fld}"
            )
        if reason or path is None:
            self.stats["handshakes_refused"] += 1
            logger.error("prefill %s:%d: %s; not loading from it", *p.addr, reason)
            self._kill_peer(p, reason)
            return
        if p.withheld and path.remote_writes and not msg.data_path_info:
            # prefill proved the secret and takes a path whose offer was kept back: greet again, in full
            p.withheld = False
            self._greet(p)
            return
        logger.debug("prefill %s:%d accepted the handshake (data path %s)", *p.addr, path.name)
        p.state, p.engine_id, p.path = "ready", msg.engine_id, path
        p.source = path.connect(msg.data_path_info)
        for inc in self._peer_loads(p):
            if inc.state == "pending":
                self._register(p, inc)
        self._send_declines(p)

    def _on_layer(self, p: _Peer, msg: LayerBlocks, payload: list[Any]) -> None:
        """Blocks that came as frames on the side channel (the TCP data path): written here."""
        inc = self.incoming.get(msg.transfer_id)
        if inc is None or inc.peer != p.addr or inc.state != "waiting":
            return  # late data for a finished, failed or cancelled load: never written
        first, count = msg.layer, msg.layer_count
        if not self._names_layers(msg) or msg.block_bytes != self.store.block_bytes:
            self._finish(inc, ok=False, reason=f"bad layer header {first}+{count}/{msg.block_bytes}")
            return
        if not _checksums_match(msg, payload):
            self._finish(inc, ok=False, reason=f"checksum mismatch in layers {first}+{count}: data corrupted")
            return
        mapped = self._map(inc, msg)
        if mapped is None:
            return
        rel, dest = mapped
        layer_bytes = msg.num_blocks * msg.block_bytes
        if count > 1 and len(payload) == 1 and msg.block_bytes and self._write_layers is not None:
            # a step's layers in one message: written by the store at once, counted with a few numpy calls
            self._write_layers(first, count, dest, payload)
        else:
            for i, data in enumerate(_layer_slices(payload, layer_bytes, count)):
                self.store.write_blocks(first + i, dest, data)
        self._arrived_layers(inc, first, count, rel, "all blocks arrived")

    def _names_layers(self, msg: LayerBlocks) -> bool:
        """The message's layers (``layer`` .. ``layer + layer_count - 1``) are all layers of this cache."""
        return msg.layer >= 0 and msg.layer + msg.layer_count <= self.store.num_layers

    def _map(self, inc: _Incoming, msg: LayerBlocks) -> tuple[np.ndarray, np.ndarray] | None:
        """(indices relative to the load's first block, destination block ids) of a layer message's blocks, or
        None after failing the load when one lies outside it. Cached for the load's next message: every layer of
        a prefill step names the same blocks."""
        last = self._last_map
        if last is not None and last[0] is inc and last[1] == msg.block_indices:
            return last[2], last[3]
        lo, hi = inc.first_block, inc.first_block + len(inc.dest_blocks)
        rel, outside = _relative(msg.indices(), lo, hi)
        if rel is None:
            self._finish(inc, ok=False, reason=f"block index {outside} outside [{lo}, {hi})")
            return None
        dest = inc.dest_arr[rel]
        self._last_map = (inc, msg.block_indices, rel, dest)
        return rel, dest

    def landed(self, path: DataPath, notices: list[tuple[str, bytes]]) -> None:
        """A direct data path's notices: these blocks were written into this cache by prefill."""
        for source, body in notices:
            try:
                notice = decode_layer_notice(body)
            except WireError as exc:
                self.stats["messages_rejected"] += 1
                logger.warning("rejected a malformed %s notice: %s", path.name, exc)
                continue
            self._on_written(path, source, notice)

    def _on_written(self, path: DataPath, source: str, msg: LayerBlocks) -> None:
        inc = self.incoming.get(msg.transfer_id)
        if inc is None or inc.state != "waiting":
            return
        p = self.peers.get(inc.peer)
        if p is None or p.path is not path or not p.source or source != p.source:
            self.stats["messages_rejected"] += 1
            logger.warning(
                "ignored a %s notice for transfer %s from %s (expected %s)",
                path.name,
                msg.transfer_id,
                source,
                p.source if p else "none",
            )
            return
        inc.noticed += 1
        lo, hi = inc.first_block, inc.first_block + len(inc.dest_blocks)
        rel, _ = _relative(msg.indices(), lo, hi)
        first, count = msg.layer, msg.layer_count
        if not self._names_layers(msg) or rel is None:
            self._finish(inc, ok=False, reason=f"bad {path.name} notice for layers {first}+{count}")
            return
        self._arrived_layers(inc, first, count, rel, f"all blocks arrived ({path.name.upper()})")

    # ----------------------------------------------------------------- the end of a load

    def _arrived(self, inc: _Incoming, layer: int, rel: np.ndarray, done_reason: str) -> None:
        """These blocks of a layer (``rel``: indices relative to the load's first block) are in place (written
        here, or reported written by the data path). A block that arrives twice counts once."""
        row = inc.got[layer]
        row[rel] = True
        count = int(np.count_nonzero(row))
        new = count - inc.got_per_layer[layer]
        inc.received += new
        inc.got_per_layer[layer] = count
        now = time.monotonic()
        if count == len(row) and not inc.layer_done[layer]:
            inc.layer_done[layer] = now
        self._progressed(inc, now, new, done_reason)

    def _arrived_layers(
        self, inc: _Incoming, first: int, count: int, rel: np.ndarray, done_reason: str
    ) -> None:
        """``_arrived`` for the same blocks of ``count`` consecutive layers from ``first`` on (one layer message):
        the masks set and counted with one numpy call each, whatever the number of layers."""
        if count == 1:
            self._arrived(inc, first, rel, done_reason)
            return
        end = first + count
        got = inc.got[first:end]
        got[:, rel] = True
        counts = np.count_nonzero(got, axis=1).tolist()
        new = sum(counts) - sum(inc.got_per_layer[first:end])
        inc.received += new
        inc.got_per_layer[first:end] = counts
        now = time.monotonic()
        width = got.shape[1]
        if max(counts) == width:
            done = inc.layer_done
            for layer, c in enumerate(counts, first):
                if c == width and not done[layer]:
                    done[layer] = now
        self._progressed(inc, now, new, done_reason)

    def _progressed(self, inc: _Incoming, now: float, layer_blocks: int, done_reason: str) -> None:
        """``layer_blocks`` blocks of the load arrived for the first time (counted in its masks already): its clocks,
        a stall deadline once data flows, the byte counts, and its end once every block is in place. A block sent
        again is no progress: it neither moves the deadline nor counts its bytes twice."""
        if layer_blocks <= 0:
            return
        inc.t_first = inc.t_first or now
        inc.deadline = max(inc.deadline, now + self.settings.load_timeout_s)
        nbytes = layer_blocks * self.store.block_bytes
        inc.bytes += nbytes
        self.stats["bytes_received"] += nbytes
        if inc.received == inc.expected:
            self._finish(inc, ok=True, reason=done_reason)

    def _finish(self, inc: _Incoming, ok: bool, reason: str, cancelled: bool = False) -> None:
        """Tell prefill (Done), then report; with remote writes, a failed load first waits until prefill stopped."""
        p = self.peers.get(inc.peer)
        if p is not None and p.state == "connecting":
            # Never registered, so nothing was sent or written for it: prefill hears once the handshake completes.
            self.declines.setdefault(p.addr, []).append(inc.transfer_id)
        if p is not None and p.state == "ready":
            self._tell(p, Done(transfer_id=inc.transfer_id, ok=ok, reason=reason))
            if not ok and p.path is not None and p.path.remote_writes and inc.state == "waiting":
                # Prefill may still be WRITING into these blocks: hand them back only once it confirms it stopped.
                inc.state, inc.outcome = "stopping", (ok, reason, cancelled)
                inc.stop_deadline = time.monotonic() + self.settings.cancel_ack_s
                return
        self._finalize(inc, ok, reason, cancelled)

    def _finalize(self, inc: _Incoming, ok: bool, reason: str, cancelled: bool = False) -> None:
        # Device memory: queued host-to-device copies must land before vLLM uses (or recomputes into) the blocks.
        self.store.sync()
        inc.state = "done" if ok else ("cancelled" if cancelled else "failed")
        inc.t_done = time.monotonic()
        if self.incoming.get(inc.transfer_id) is inc:
            del self.incoming[inc.transfer_id]
        if self._last_map is not None and self._last_map[0] is inc:
            self._last_map = None
        self.reports.loaded(inc.request_id, failed=not ok and not cancelled)
        self.stats["loads_ok" if ok else "loads_failed"] += 1
        log = (
            logger.debug if ok or cancelled else logger.warning
        )  # one line per request: DEBUG when it went well
        log(
            "load %s for request %s from prefill %s:%d: %s (%d/%d layer-blocks, %d bytes, %.1f ms)%s",
            inc.state,
            inc.request_id,
            *inc.peer,
            reason,
            inc.received,
            inc.expected,
            inc.bytes,
            1000 * (inc.t_done - inc.t_start),
            "" if ok or cancelled else "; recomputing locally",
        )
        self.reports.record(
            RecvRecord(
                transfer_id=inc.transfer_id,
                request_id=inc.request_id,
                state=inc.state,
                reason=reason,
                bytes=inc.bytes,
                blocks=len(inc.dest_blocks),
                first_block=inc.first_block,
                t_start=inc.t_start,
                t_first=inc.t_first,
                t_done=inc.t_done,
                layer_done_times=inc.layer_done.tolist(),
            )
        )

    def expire(self, now: float) -> None:
        """Loads past their deadline fail; stopped loads are handed back; silent prefills are given up on."""
        for inc in list(self.incoming.values()):
            if inc.state == "stopping" and now > inc.stop_deadline:
                self._stop_overdue(inc, now)
            elif inc.state in ("pending", "waiting") and now > inc.deadline:
                self._finish(
                    inc,
                    ok=False,
                    reason=f"no complete KV within load_timeout_s={self.settings.load_timeout_s:g}",
                )
        for p in list(self.peers.values()):
            if p.unsendable:
                logger.error(
                    "prefill %s:%d: the side channel connection refuses messages (zmq dropped it, e.g. after a "
                    "failed handshake: is that port a vllm-disagg side channel?); not loading from it",
                    *p.addr,
                )
                self._kill_peer(p, "prefill side channel connection failed")
            elif p.state == "connecting" and now - p.since > self.settings.connect_timeout_s:
                logger.error(
                    "prefill %s:%d did not answer the handshake within %.0f s: is its side channel reachable?",
                    *p.addr,
                    self.settings.connect_timeout_s,
                )
                self._kill_peer(p, "prefill side channel unreachable")

    def _stop_overdue(self, inc: _Incoming, now: float) -> None:
        # A live prefill may still post writes into these blocks: hand them back only when it confirms, dies, or a
        # much longer hard limit passes (then loudly: the operator should look at that prefill).
        peer = self.peers.get(inc.peer)
        overdue = inc.stop_overdue_since
        hard = bool(overdue) and now - overdue > _STOP_HARD_LIMIT * self.settings.cancel_ack_s
        if peer is not None and peer.state == "ready" and not hard:
            if not overdue:
                inc.stop_overdue_since = now
                logger.warning(
                    "prefill %s:%d has not confirmed it stopped writing transfer %s after %.0f s; keeping "
                    "the blocks until it does (or dies)",
                    *inc.peer,
                    inc.transfer_id,
                    self.settings.cancel_ack_s,
                )
            inc.stop_deadline = now + self.settings.cancel_ack_s
            return
        (logger.error if hard else logger.warning)(
            "prefill %s:%d never confirmed it stopped writing transfer %s; releasing its blocks (%s)",
            *inc.peer,
            inc.transfer_id,
            "hard limit: check that prefill instance" if hard else "prefill is gone",
        )
        self._finalize(inc, *inc.outcome)

    def fail_all(self) -> None:
        """After an I/O-thread crash: report every pending load failed (they recompute)."""
        for inc in self.incoming.values():
            self.reports.loaded(inc.request_id, failed=True)
        self.incoming.clear()
