"""The transfer engine: one I/O thread per worker that owns every socket of the side channel and the TCP data path.

Roles, per transfer (one instance can be both at once, for different requests):
  * sender (prefill, P): binds a ZMQ ROUTER. Decode instances dial it, say Hello (typed, versioned, optionally
    authenticated, KV geometry compared field by field) and Register a transfer with the blocks they still need.
    As the forward pass produces each layer, the connector *offers* that layer's completed blocks; the engine pushes
    them to the registered decode at once (layer-wise, overlapping the rest of the prefill) as zero-copy frames.
    Blocks are held until decode says Done, the transfer is aborted, or the lease runs out.
  * receiver (decode, D): dials P with a DEALER, registers, writes arriving blocks straight into its own KV cache,
    and reports the request loaded only when every needed block of every layer has arrived. A dead peer, a refused
    handshake, an Abort or the deadline fails the load (the connector then recomputes): a partial block is never
    used because an incomplete load is never reported as loaded.

The vLLM worker thread talks to the engine only through thread-safe methods that enqueue commands; results come
back through ``poll_results``. ZMQ sockets never cross threads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.monitor

from vllm_disagg import __version__
from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.transport.block_store import BlockStore, staging_owner
from vllm_disagg.transport.faults import FaultInjector, FaultRule
from vllm_disagg.transport.nixl import NixlDataPath, nixl_available
from vllm_disagg.wire import (
    MAX_CONTROL_BYTES,
    WIRE_VERSION,
    Abort,
    Describe,
    Description,
    Done,
    Heartbeat,
    Hello,
    HelloAck,
    LayerBlocks,
    Message,
    Refuse,
    Register,
    WireError,
    check_hello_ack_auth,
    check_hello_auth,
    decode,
    decode_layer_notice,
    encode,
    hello_ack_auth,
    make_hello,
    peek_transfer_id,
)

logger = logging.getLogger("vllm_disagg.transfer")

_instance_ids = itertools.count()


@dataclass
class EngineSettings:
    bind_host: str = "0.0.0.0"
    port: int = 0  # 0: pick a free port (tests)
    secret: bytes | None = None
    lease_s: float = 30.0
    load_timeout_s: float = 30.0
    heartbeat_s: float = 1.0
    connect_timeout_s: float = 5.0
    trace_path: str | None = None  # JSON lines, one per finished transfer (tests, benchmarks)
    transport: str = "auto"  # auto | tcp | nixl: the data paths this engine offers (control is always ZMQ)
    verify_checksums: bool = False  # TCP: CRC32 per block, checked before a block counts as arrived
    cancel_ack_s: float = 5.0  # NIXL: how long decode waits for prefill to confirm it stopped writing


@dataclass
class TransferResults:
    """What the worker reports to vLLM's scheduler after a step."""

    finished_sending: set[str] = field(default_factory=set)  # P: request ids whose held blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # D: loads finished (ok, failed or cancelled)
    failed_recving: set[str] = field(default_factory=set)  # D: subset of finished_recving that must recompute


@dataclass
class _Outgoing:
    transfer_id: str
    request_id: str = ""
    known: bool = False  # the local request exists (begin_send was called)
    finished: bool = False  # the local request finished; blocks now held for this transfer
    prompt_len: int = 0
    block_ids: dict[int, int] = field(default_factory=dict)  # logical index -> local block id
    # layer -> logical indices offered (KV complete) and not yet sent: a flush touches only these
    pending: dict[int, list[int]] = field(default_factory=dict)
    sent: dict[int, set[int]] = field(default_factory=dict)
    dest: Register | None = None
    dest_identity: bytes | None = None
    lease_deadline: float = 0.0
    released: bool = False
    reported: bool = False
    release_reason: str = ""
    bytes_sent: int = 0
    t_begin: float = 0.0
    t_first_send: float = 0.0
    t_last_send: float = 0.0
    t_forward_end: float = 0.0
    layer_send_times: list[float] = field(default_factory=list)
    trackers: list[zmq.MessageTracker] = field(default_factory=list)  # zero-copy frames zmq still reads
    ack_identity: bytes | None = None  # NIXL: tell this decode once no more writes can land
    prompt_hash: str = ""
    extra_requests: set[str] = field(default_factory=set)  # other local requests that named this transfer id
    quiet: list[threading.Event] = field(default_factory=list)  # set once nothing reads the blocks any more


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
    received: set[tuple[int, int]] = field(default_factory=set)
    state: str = "pending"  # pending (awaiting handshake) | waiting | stopping | done | failed | cancelled
    stop_deadline: float = (
        0.0  # NIXL: while stopping, report the outcome once prefill confirms or at this time
    )
    outcome: tuple[bool, str, bool] = (False, "", False)  # (ok, reason, cancelled) held while stopping
    prompt_hash: str = ""
    bytes: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    stop_overdue_since: float = 0.0  # NIXL: when prefill's "stopped writing" first became overdue


@dataclass
class _Peer:
    addr: tuple[str, int]
    sock: zmq.Socket[Any]
    monitor: zmq.Socket[Any]
    state: str = "connecting"  # connecting | ready | dead
    since: float = 0.0
    engine_id: str = ""
    last_heartbeat: float = 0.0
    transport: str = "tcp"
    hello_nonce: str = ""
    nixl_agent: str = ""  # the prefill agent whose write notifications count


def _owner(out: _Outgoing) -> str:
    return staging_owner(out.transfer_id, out.request_id)


def _prompt_mismatch(reg: Register, prompt_len: int, prompt_hash: str) -> str:
    """Why decode's registration is not for this prompt (empty when it is): a wrong pairing must never load."""
    if reg.prompt_len != prompt_len:
        return f"prompt length differs: decode {reg.prompt_len}, prefill {prompt_len}"
    if reg.prompt_hash and prompt_hash and reg.prompt_hash != prompt_hash:
        return "prompt tokens differ between decode and prefill (same length, different hash)"
    return ""


_AUTH_SKEW_S = 300.0
_MAX_AUTHED = 4096  # remembered decode connections; the oldest are forgotten (they say Hello again)
_STOP_HARD_LIMIT = 12  # x cancel_ack_s: the longest decode waits for a live prefill's "stopped writing"
_MAX_QUEUED_HEARTBEAT = 65536  # queued transfer ids read from one heartbeat


class TransferEngine:
    """Sender and receiver of layer-wise KV blocks over ZMQ/TCP. See the module docstring."""

    def __init__(
        self, store: BlockStore, geometry: KVGeometry, engine_id: str, settings: EngineSettings
    ) -> None:
        self.store = store
        self.geometry = geometry
        self.engine_id = engine_id
        self.settings = settings
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._cmds: queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None] | None]] = (
            queue.SimpleQueue()
        )
        self._wake_addr = f"inproc://vllm-disagg-wake-{id(self)}-{next(_instance_ids)}"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._results = TransferResults()
        self._records: list[dict[str, Any]] = []
        self._outgoing: dict[str, _Outgoing] = {}
        self._tombstones: dict[str, tuple[float, str]] = {}  # transfer id -> (expiry, reason)
        self._incoming: dict[str, _Incoming] = {}  # by transfer id
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._graveyard: list[_Peer] = []  # dead peers whose sockets the I/O loop closes
        self._draining: dict[
            str, _Outgoing
        ] = {}  # released transfers waiting for ZMQ to let go of their blocks
        self._faults = FaultInjector.from_env()  # tests only: drop/delay/truncate/corrupt by rule
        self._delayed: list[tuple[float, Callable[[], object]]] = []
        self._authed: dict[bytes, str] = {}  # ROUTER identity -> peer engine id (bounded: oldest dropped)
        self._nonces: dict[str, float] = {}  # Hello/Describe nonces seen within the skew window -> expiry
        # D: "won't load" notices waiting for a handshake; queued requests' transfers whose lease we renew
        self._declines: dict[tuple[str, int], list[str]] = {}
        self._watches: dict[tuple[str, int], set[str]] = {}
        self._wake_socks: list[zmq.Socket[Any]] = []
        self._crashed = False
        self._stop = threading.Event()
        self.stats: dict[str, float] = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "transfers_sent": 0,
            "loads_ok": 0,
            "loads_failed": 0,
            "leases_expired": 0,
            "handshakes_refused": 0,
            "messages_rejected": 0,
        }
        self._nixl: NixlDataPath | None = None
        self._nixl_peers: dict[bytes, str] = {}  # ROUTER identity -> NIXL agent of that decode
        if settings.transport in ("auto", "nixl"):
            self._nixl = self._make_nixl(settings.transport == "nixl")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, 0)
        # Prefill only receives control messages: bound what an unauthenticated peer can make it buffer.
        self._router.setsockopt(zmq.RCVHWM, 1000)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES + 4096)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if settings.port:
            self._router.bind(f"tcp://{settings.bind_host}:{settings.port}")
            self.port = settings.port
        else:
            self.port = self._router.bind_to_random_port(f"tcp://{settings.bind_host}")
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name="vllm-disagg-transfer", daemon=True)
        self._thread.start()
        logger.info(
            "transfer engine %s listening on %s:%d (wire v%d, secret %s, data paths: %s)",
            engine_id,
            settings.bind_host,
            self.port,
            WIRE_VERSION,
            "required" if settings.secret else "off",
            "nixl+tcp" if self._nixl else "tcp",
        )
        if not settings.secret:
            logger.warning(
                "transfer engine %s: the side channel on %s:%d has no shared secret: any host that reaches it can "
                "register transfers and read prompt KV. Set shared_secret (or VLLM_DISAGG_SECRET) on every instance "
                "and the proxy.",
                engine_id,
                settings.bind_host,
                self.port,
            )

    def _make_nixl(self, required: bool) -> NixlDataPath | None:
        layout = self.store.nixl_layout()
        if not nixl_available() or layout is None:
            if required:
                raise RuntimeError(
                    "transport: nixl was requested but NIXL is not importable (pip install 'vllm-disagg[nixl]') "
                    "or this KV cache cannot be registered; use transport: tcp or auto"
                )
            return None
        try:
            regions, bases, stride = layout
            return NixlDataPath(
                f"{self.engine_id}-{self.geometry.tp_rank}",
                regions,
                bases,
                stride,
                self.store.block_bytes,
                mem_type=self.store.nixl_mem_type,
                device_id=self.store.device_id,
            )
        except Exception as exc:
            if required:
                raise
            logger.warning("NIXL unavailable (%s); using the TCP data path", exc)
            return None

    @property
    def data_path(self) -> str:
        return "nixl" if self._nixl else "tcp"

    # ----------------------------------------------------------------- API for the worker thread (thread-safe)

    def _submit(self, fn: Callable[[], None], on_crash: Callable[[], None] | None = None) -> None:
        """Queue ``fn`` for the I/O thread. ``on_crash`` is what must still be reported if the thread is dead or
        dies before running it (a load reported failed, a send reported freed), so no request waits forever."""
        self._cmds.put((fn, on_crash))
        if self._crashed:
            self._drain_after_crash()
            return
        sock = getattr(self._local, "wake", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._wake_addr)
            self._local.wake = sock
            with self._lock:
                self._wake_socks.append(sock)
        with contextlib.suppress(zmq.Again):
            sock.send(b"", zmq.NOBLOCK)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._crashed

    def begin_send(self, transfer_id: str, request_id: str, prompt_len: int, prompt_hash: str = "") -> None:
        """P: a local request's prompt KV is to be sent under ``transfer_id`` (decode may register before or after).

        ``prompt_hash`` (of the prompt's token ids) is compared with decode's, when both are given."""
        self._submit(lambda: self._begin_send(transfer_id, request_id, prompt_len, prompt_hash))

    def offer_blocks(
        self, transfer_id: str, layer: int, blocks: list[tuple[int, int]], request_id: str = ""
    ) -> None:
        """P: (logical index, local block id) pairs of ``layer`` whose KV is now complete; sent as soon as possible.

        Offers from a request other than the one that began the send under this id are ignored."""
        self._submit(lambda: self._offer(transfer_id, layer, blocks, time.monotonic(), request_id))

    def mark_forward_end(self, transfer_ids: list[str]) -> None:
        now = time.monotonic()
        self._submit(lambda: self._forward_end(transfer_ids, now))

    def finish_send(self, transfer_id: str, aborted: bool, request_id: str = "") -> None:
        """P: the local request finished. Hold its blocks until decode is done (or the lease ends); abort frees now."""
        self._submit(
            lambda: self._finish_send(transfer_id, aborted, request_id),
            lambda: self._report_sent_now(request_id),
        )

    def abort_unstarted_send(self, transfer_id: str) -> None:
        """P: a request that was to send ``transfer_id`` ended before computing anything (aborted while queued).
        Tell a decode that already registered to recompute now; nothing is held here (vLLM freed the request)."""
        self._submit(lambda: self._abort_unstarted(transfer_id))

    def invalidate_send(self, transfer_id: str, request_id: str, timeout_s: float = 5.0) -> bool:
        """P: the request was preempted and vLLM freed its blocks. Abort the transfer (decode recomputes) and return
        once nothing more is read from those blocks, so the next forward pass may overwrite them. False on timeout."""
        quiet = threading.Event()
        self._submit(lambda: self._invalidate(transfer_id, request_id, quiet), quiet.set)
        ok = quiet.wait(timeout_s) or not self.alive
        if not ok:
            logger.error(
                "transfer %s (request %s): frames still in flight %.0f s after preemption; the freed blocks may be "
                "overwritten while zmq/NIXL reads them. Decode was told to recompute.",
                transfer_id,
                request_id,
                timeout_s,
            )
        return ok

    def decline_load(self, transfer_id: str, peer: tuple[str, int]) -> None:
        """D: a request that named this transfer finished without loading it; tell prefill to free its blocks now."""
        self._submit(lambda: self._decline(transfer_id, peer))

    def watch_load(self, transfer_id: str, peer: tuple[str, int]) -> None:
        """D: a request that will load ``transfer_id`` arrived but is still queued here: keep prefill's lease alive
        (heartbeats) until it starts loading or is declined, so a long decode queue does not expire the KV."""
        self._submit(lambda: self._watch(transfer_id, peer))

    def start_load(
        self,
        request_id: str,
        transfer_id: str,
        peer: tuple[str, int],
        dest_blocks: list[int],
        first_block: int,
        prompt_len: int,
        prompt_hash: str = "",
    ) -> None:
        """D: fetch blocks [first_block, first_block+len(dest_blocks)) of ``transfer_id`` from ``peer``."""

        def failed() -> None:
            with self._lock:
                self._results.finished_recving.add(request_id)
                self._results.failed_recving.add(request_id)

        self._submit(
            lambda: self._start_load(
                request_id, transfer_id, peer, dest_blocks, first_block, prompt_len, prompt_hash
            ),
            failed,
        )

    def cancel_load(self, transfer_id: str, request_id: str = "") -> None:
        """D: the local request was aborted while waiting; stop writing, tell P, report it finished.

        After a crash nothing is reported here: the load itself was already reported failed (reporting it again
        would name a request vLLM has freed)."""
        self._submit(lambda: self._cancel_load(transfer_id, request_id))

    def poll_results(self) -> TransferResults:
        with self._lock:
            out, self._results = self._results, TransferResults()
        return out

    def close(self) -> None:
        self._stop.set()
        self._submit(lambda: None)
        self._thread.join(timeout=5)
        with self._lock:
            socks, self._wake_socks = self._wake_socks, []
        for sock in socks:
            sock.close(linger=0)

    def _report_sent_now(self, request_id: str) -> None:
        if request_id:
            with self._lock:
                self._results.finished_sending.add(request_id)

    # ----------------------------------------------------------------- I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        registered: set[int] = set()
        try:
            while not self._stop.is_set():
                for peer in list(self._peers.values()):
                    for s in (peer.sock, peer.monitor):
                        if id(s) not in registered:
                            poller.register(s, zmq.POLLIN)
                            registered.add(id(s))
                busy = self._nixl is not None and (
                    self._nixl.pending
                    or any(i.state in ("waiting", "stopping") for i in self._incoming.values())
                )
                events = dict(poller.poll(timeout=1 if busy else 100))
                now = time.monotonic()
                self._expire(now)
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._drain_commands()
                if self._router in events:
                    self._drain_router()
                for peer in list(self._peers.values()):
                    if peer.monitor in events:
                        self._drain_monitor(peer)
                    if peer.sock in events and peer.state != "dead":
                        self._drain_peer(peer)
                if self._nixl is not None:
                    self._progress_nixl()
                if self._delayed:
                    due = [fn for t, fn in self._delayed if t <= now]
                    self._delayed = [(t, fn) for t, fn in self._delayed if t > now]
                    for fn in due:
                        fn()
                self._heartbeats(now)
                while self._graveyard:
                    peer = self._graveyard.pop()
                    with contextlib.suppress(zmq.ZMQError):
                        peer.sock.disable_monitor()
                    for s in (peer.sock, peer.monitor):
                        if id(s) in registered:
                            poller.unregister(s)
                            registered.discard(id(s))
                        s.close(linger=0)
        except Exception:  # a bug here must not leave vLLM waiting forever
            logger.exception(
                "transfer engine %s I/O thread crashed: failing every pending load (they recompute) and freeing "
                "every held send; new transfers on this worker recompute. Please report this with the log above.",
                self.engine_id,
            )
            self._crashed = True
            self._fail_everything()
        finally:
            for peer in [*self._peers.values(), *self._graveyard]:
                with contextlib.suppress(zmq.ZMQError):
                    peer.sock.disable_monitor()
                peer.sock.close(linger=0)
                peer.monitor.close(linger=0)
            self._router.close(linger=0)
            self._wake_pull.close(linger=0)
            if self._nixl is not None:
                self._nixl.close()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, _ = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:  # one bad command (e.g. an unusable peer address) fails only its own transfer
                logger.exception(
                    "transfer engine %s: a command failed; the engine keeps serving", self.engine_id
                )

    def _fail_everything(self) -> None:
        """After an I/O-thread crash: report every load failed and every held send finished, so vLLM frees."""
        with contextlib.suppress(Exception):
            self.store.sync()
        with self._lock:
            for inc in self._incoming.values():
                self._results.finished_recving.add(inc.request_id)
                self._results.failed_recving.add(inc.request_id)
            for out in [*self._outgoing.values(), *self._draining.values()]:
                if out.known and out.finished and not out.reported:
                    self._results.finished_sending.add(out.request_id)
        self._incoming.clear()
        self._drain_after_crash()

    def _drain_after_crash(self) -> None:
        """Commands that will never run: report what their requests wait for."""
        while True:
            try:
                _, on_crash = self._cmds.get_nowait()
            except queue.Empty:
                return
            if on_crash is not None:
                on_crash()

    # ----------------------------------------------------------------- sender side

    def _out(self, transfer_id: str) -> _Outgoing:
        out = self._outgoing.get(transfer_id)
        if out is None:
            out = self._outgoing[transfer_id] = _Outgoing(transfer_id=transfer_id, t_begin=time.monotonic())
        return out

    def _begin_send(self, transfer_id: str, request_id: str, prompt_len: int, prompt_hash: str = "") -> None:
        out = self._out(transfer_id)
        if out.known and out.request_id != request_id:
            # n > 1 children or a resend share the id: only the first request's blocks are sent; the others are
            # never held (finish_send reports them at once).
            logger.warning(
                "transfer %s: request %s reuses the id of request %s; only the first is sent",
                transfer_id,
                request_id,
                out.request_id,
            )
            out.extra_requests.add(request_id)
            return
        out.request_id, out.prompt_len, out.known = request_id, prompt_len, True
        out.prompt_hash = prompt_hash
        out.lease_deadline = time.monotonic() + self.settings.lease_s
        if transfer_id in self._tombstones:
            # Decode already gave up on this transfer (aborted, timed out): free right after the prefill.
            self._release(out, "decode gave up before prefill started: " + self._tombstones[transfer_id][1])
            return
        if out.dest is not None:
            mismatch = _prompt_mismatch(out.dest, prompt_len, prompt_hash)
            if mismatch:
                self._abort_out(out, mismatch)

    def _offer(
        self, transfer_id: str, layer: int, blocks: list[tuple[int, int]], now: float, request_id: str = ""
    ) -> None:
        out = self._outgoing.get(transfer_id)
        if out is None or out.released or (request_id and request_id != out.request_id):
            return
        pending = out.pending.setdefault(layer, [])
        for idx, block_id in blocks:
            out.block_ids[idx] = block_id
            pending.append(idx)
        out.layer_send_times.append(now)
        self._flush(out, (layer,))

    def _forward_end(self, transfer_ids: list[str], now: float) -> None:
        for tid in transfer_ids:
            out = self._outgoing.get(tid)
            if out is not None:
                out.t_forward_end = now

    def _flush(self, out: _Outgoing, layers: tuple[int, ...] | None = None) -> None:
        """Send the offered, not yet sent blocks of ``layers`` (all layers: on registration) that the registered
        decode needs. Work is proportional to what was offered since the last flush, not to the prompt."""
        reg = out.dest
        if reg is None or out.dest_identity is None or out.released:
            return
        lo, hi = reg.first_block, reg.first_block + reg.num_blocks
        for layer in layers if layers is not None else tuple(out.pending):
            pending = out.pending.get(layer)
            if not pending:
                continue
            out.pending[layer] = []  # each is sent now, or outside what decode registered (never needed)
            sent = out.sent.setdefault(layer, set())
            todo = sorted({i for i in pending if lo <= i < hi and i not in sent})
            if not todo:
                continue
            header = LayerBlocks(
                transfer_id=out.transfer_id,
                layer=layer,
                block_indices=todo,
                block_bytes=self.store.block_bytes,
            )
            agent = self._nixl_peers.get(out.dest_identity)
            if agent is not None and self._nixl is not None:
                if len(reg.dest_blocks) != reg.num_blocks:
                    self._abort_out(out, "registration lacks destination blocks for a NIXL write")
                    return
                try:
                    self.store.wait_staged(_owner(out), layer)  # device memory: the kernels must have run
                    self._nixl.write_blocks(
                        out.transfer_id,
                        agent,
                        layer,
                        [out.block_ids[i] for i in todo],
                        [reg.dest_blocks[i - lo] for i in todo],
                        encode(header)[1],
                    )
                except Exception as exc:
                    self._abort_out(out, f"NIXL write failed: {exc}")
                    return
                self._sent(out, sent, todo)
                continue
            owner = _owner(out)
            views = [self.store.read(layer, out.block_ids[i], owner) for i in todo]
            if self.settings.verify_checksums:
                header.crc32 = [zlib.crc32(v) for v in views]
            frames: list[Any] = [out.dest_identity, *encode(header), *views]
            if self._faults is not None and self._inject_layer_fault(out, sent, todo, frames):
                continue
            try:
                tracker = self._router.send_multipart(frames, copy=False, track=True)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: decode disconnected
                self._release(out, f"decode unreachable while sending ({exc})")
                return
            self._sent(out, sent, todo)
            if tracker is not None:
                out.trackers.append(tracker)

    def _inject_layer_fault(self, out: _Outgoing, sent: set[int], todo: list[int], frames: list[Any]) -> bool:
        """Tests only. True when the message was handled here (dropped or delayed)."""
        assert self._faults is not None
        rule = self._faults.decide("layer")
        if rule is None:
            return False
        logger.warning("FAULT: %s layer message of transfer %s", rule.action, out.transfer_id)
        if rule.action == "drop":
            self._sent(out, sent, todo)
            return True
        if rule.action == "delay":
            copied = [bytes(f) for f in frames]
            self._delayed.append(
                (time.monotonic() + rule.delay_s, lambda: self._router.send_multipart(copied))
            )
            self._sent(out, sent, todo)
            return True
        if rule.action == "truncate":
            frames[-1] = bytes(frames[-1])[:-8]
        elif rule.action == "corrupt":
            damaged = bytearray(bytes(frames[-1]))
            damaged[len(damaged) // 2] ^= 0xFF
            frames[-1] = bytes(damaged)
        return False

    def _control_fault(self, on: str) -> FaultRule | None:
        if self._faults is None:
            return None
        rule = self._faults.decide(on)
        if rule is not None:
            logger.warning("FAULT: %s %s message", rule.action, on)
        return rule

    def _sent(self, out: _Outgoing, sent: set[int], todo: list[int]) -> None:
        now = time.monotonic()
        out.t_first_send = out.t_first_send or now
        out.t_last_send = now
        nbytes = len(todo) * self.store.block_bytes
        out.bytes_sent += nbytes
        self.stats["bytes_sent"] += nbytes
        sent.update(todo)

    def _progress_nixl(self) -> None:
        assert self._nixl is not None
        _, failed = self._nixl.progress()
        for tid in failed:
            out = self._outgoing.get(tid)
            if out is not None:
                self._abort_out(out, "NIXL write failed")
        for agent, body in self._nixl.notifications():
            try:
                notice = decode_layer_notice(body)
            except WireError as exc:
                self.stats["messages_rejected"] += 1
                logger.warning("rejected a malformed NIXL notification: %s", exc)
                continue
            self._on_layer_written(agent, notice)
        for out in list(self._draining.values()):
            self._maybe_report(out)

    def _finish_send(self, transfer_id: str, aborted: bool, request_id: str = "") -> None:
        out = self._outgoing.get(transfer_id) or self._draining.get(transfer_id)
        if out is not None and request_id and request_id in out.extra_requests:
            out.extra_requests.discard(request_id)
            self.store.release(staging_owner(transfer_id, request_id))
            self._report_sent_now(request_id)
            return
        if out is None or (request_id and out.request_id != request_id):
            self.store.release(staging_owner(transfer_id, request_id))
            self._report_sent_now(request_id)  # nothing of this request is held here
            return
        out.finished = True
        if aborted:
            self._abort_out(out, "request aborted on prefill")
            return
        out.lease_deadline = time.monotonic() + self.settings.lease_s
        self._maybe_report(out)

    def _invalidate(self, transfer_id: str, request_id: str, quiet: threading.Event) -> None:
        out = self._outgoing.get(transfer_id)
        if out is None or out.request_id != request_id:
            quiet.set()  # this request never sent from its blocks
            return
        out.quiet.append(quiet)  # set by _maybe_report once nothing reads the blocks
        self._draining.setdefault(transfer_id, out)
        if out.released:
            self._maybe_report(out)
        else:
            self._abort_out(out, "prefill request was preempted: its blocks were freed")

    def _abort_unstarted(self, transfer_id: str) -> None:
        out = self._outgoing.get(transfer_id)
        if out is None:
            self._tombstone(transfer_id, "prefill request ended before it started")
        elif not out.known:
            self._abort_out(out, "prefill request ended before it started")

    def _abort_out(self, out: _Outgoing, reason: str) -> None:
        if out.dest_identity is not None:
            self._send_to(out.dest_identity, Abort(transfer_id=out.transfer_id, reason=reason))
        self._tombstone(out.transfer_id, reason)
        self._release(out, reason)

    def _tombstone(self, transfer_id: str, reason: str) -> None:
        """For ``lease_s``, a Register or Heartbeat for this transfer is answered with an Abort naming ``reason``."""
        self._tombstones[transfer_id] = (time.monotonic() + self.settings.lease_s, reason)

    def _release(self, out: _Outgoing, reason: str) -> None:
        if not out.released:
            out.released, out.release_reason = True, reason
            logger.debug("transfer %s (request %s) released: %s", out.transfer_id, out.request_id, reason)
        self._maybe_report(out)

    def _quiet(self, out: _Outgoing) -> bool:
        """True once neither zmq (zero-copy frames) nor NIXL reads this transfer's blocks any more."""
        out.trackers = [t for t in out.trackers if not t.done]
        return not out.trackers and not (self._nixl is not None and self._nixl.in_flight(out.transfer_id))

    def _maybe_report(self, out: _Outgoing) -> None:
        if (out.quiet or out.ack_identity is not None) and out.released and self._quiet(out):
            for ev in out.quiet:
                ev.set()
            out.quiet = []
            if out.ack_identity is not None:
                # NIXL: decode waits for this before it frees (or recomputes into) the blocks we were writing.
                self._send_to(
                    out.ack_identity, Abort(transfer_id=out.transfer_id, reason="stopped: no more writes")
                )
                out.ack_identity = None
        if not (out.released and (out.finished or not out.known) and not out.reported):
            return
        if not self._quiet(out):
            # ZMQ still reads these blocks (zero-copy): freeing them now could ship another request's bytes.
            self._draining[out.transfer_id] = out
            return
        self._draining.pop(out.transfer_id, None)
        self.store.release(_owner(out))
        out.reported = True
        self._outgoing.pop(out.transfer_id, None)
        if out.known:
            with self._lock:
                self._results.finished_sending.add(out.request_id)
            self._trace_send(out)

    def _trace_send(self, out: _Outgoing) -> None:
        if out.bytes_sent:
            self.stats["transfers_sent"] += 1
        record = {
            "side": "send",
            "transfer_id": out.transfer_id,
            "request_id": out.request_id,
            "bytes": out.bytes_sent,
            "reason": out.release_reason,
            "t_begin": out.t_begin,
            "t_first_send": out.t_first_send,
            "t_last_send": out.t_last_send,
            "t_forward_end": out.t_forward_end,
            "layer_offer_times": out.layer_send_times,
        }
        logger.info(
            "sent transfer %s (request %s): %d bytes, %s",
            out.transfer_id,
            out.request_id,
            out.bytes_sent,
            out.release_reason,
        )
        self._trace(record)

    def drain_records(self) -> list[dict[str, Any]]:
        """Finished-transfer records since the last call (the connector turns them into vLLM connector stats)."""
        with self._lock:
            out, self._records = self._records, []
        return out

    def _trace(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records.append(record)
        if self.settings.trace_path:
            with contextlib.suppress(OSError), Path(self.settings.trace_path).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def _send_to(self, identity: bytes, msg: Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([identity, *encode(msg)])

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                msg, _ = decode(body)
            except WireError as exc:
                self.stats["messages_rejected"] += 1
                logger.warning(
                    "side channel: rejected a malformed message from peer %r: %s", identity[:8], exc
                )
                self._send_to(identity, Refuse(reason=f"malformed message: {exc}"))
                continue
            try:
                self._on_router_message(identity, msg)
            except Exception:  # one bad message must never take the side channel down
                self.stats["messages_rejected"] += 1
                logger.exception(
                    "side channel: error handling %s from %r; dropped it", type(msg).__name__, identity[:8]
                )

    def _on_router_message(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        if isinstance(msg, Describe):
            reason = self._check_auth(msg)
            if reason:
                self.stats["handshakes_refused"] += 1
                logger.warning("side channel: refused a describe request from %s: %s", msg.engine_id, reason)
                self._send_to(identity, Refuse(reason=reason, field="shared_secret"))
            else:
                self._send_to(
                    identity,
                    Description(
                        engine_id=self.engine_id,
                        geometry=self.geometry,
                        connector_version=__version__,
                        data_paths=["nixl", "tcp"] if self._nixl else ["tcp"],
                    ),
                )
            return
        if identity not in self._authed:
            self.stats["messages_rejected"] += 1
            logger.warning(
                "side channel: %s from a peer that has not completed the handshake", type(msg).__name__
            )
            self._send_to(identity, Refuse(reason="handshake required before " + type(msg).__name__))
            return
        now = time.monotonic()
        if isinstance(msg, Register):
            if msg.transfer_id in self._tombstones:
                self._send_to(
                    identity, Abort(transfer_id=msg.transfer_id, reason=self._tombstones[msg.transfer_id][1])
                )
                return
            out = self._out(msg.transfer_id)
            if out.dest_identity is not None:
                if out.dest_identity != identity or out.dest.request_id != msg.request_id:  # type: ignore[union-attr]
                    self._send_to(
                        identity,
                        Abort(
                            transfer_id=msg.transfer_id, reason="transfer already registered by another load"
                        ),
                    )
                return  # the same registration again: already being served
            mismatch = _prompt_mismatch(msg, out.prompt_len, out.prompt_hash) if out.known else ""
            if mismatch:
                self._send_to(identity, Abort(transfer_id=msg.transfer_id, reason=mismatch))
                return
            out.dest, out.dest_identity = msg, identity
            out.lease_deadline = now + self.settings.lease_s
            self._flush(out)
        elif isinstance(msg, Heartbeat):
            for tid in msg.queued[:_MAX_QUEUED_HEARTBEAT]:
                queued = self._outgoing.get(tid)
                if queued is not None:
                    queued.lease_deadline = now + self.settings.lease_s
            for tid in msg.transfer_ids:
                hb = self._outgoing.get(tid)
                if hb is not None:
                    hb.lease_deadline = now + self.settings.lease_s
                elif tid in self._tombstones:
                    self._send_to(identity, Abort(transfer_id=tid, reason=self._tombstones[tid][1]))
                else:
                    self._send_to(identity, Abort(transfer_id=tid, reason="unknown transfer on prefill"))
        elif isinstance(msg, Done):
            done = self._outgoing.get(msg.transfer_id)
            registered_elsewhere = done is not None and done.dest_identity not in (None, identity)
            if (done is None or registered_elsewhere) and not msg.ok and identity in self._nixl_peers:
                # Nothing was ever written to this decode for this transfer: it may reuse its blocks now.
                self._send_to(identity, Abort(transfer_id=msg.transfer_id, reason="stopped: no more writes"))
            if registered_elsewhere:
                return  # only the decode that registered may end a transfer
            if done is None and not msg.ok and msg.transfer_id not in self._tombstones:
                # Decode will not load (aborted while queued, say): free the blocks as soon as prefill has them.
                self._tombstone(msg.transfer_id, f"decode gave up: {msg.reason}")
            if done is not None:
                if not msg.ok and identity in self._nixl_peers:
                    done.ack_identity = identity
                    self._draining.setdefault(done.transfer_id, done)  # the ack goes out once writes drained
                self._release(done, "decode loaded all blocks" if msg.ok else f"decode gave up: {msg.reason}")
                # A retry of a finished transfer id is answered at once instead of waiting for a deadline.
                self._tombstone(
                    msg.transfer_id,
                    "transfer already completed" if msg.ok else f"decode gave up: {msg.reason}",
                )
        else:
            self.stats["messages_rejected"] += 1
            self._send_to(identity, Refuse(reason=f"unexpected {type(msg).__name__} on the prefill side"))

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        logger.debug("side channel: hello from decode engine %s", hello.engine_id)
        reason = ""
        fld, ours, theirs = "", "", ""
        if hello.wire_version != WIRE_VERSION:
            reason, fld, ours, theirs = (
                "wire version differs",
                "wire_version",
                str(WIRE_VERSION),
                str(hello.wire_version),
            )
        else:
            reason = self._check_auth(hello)
            if reason:
                fld = "shared_secret"
            else:
                diff = self.geometry.incompatibility(hello.geometry)
                if diff is not None:
                    fld, o, t = diff
                    ours, theirs = str(o), str(t)
                    reason = f"incompatible KV layout: {fld} is {ours} here (prefill) but {theirs} on decode"
        if reason:
            self.stats["handshakes_refused"] += 1
            logger.error(
                "side channel: refused decode engine %s: %s. Fix: run both instances with the same %s.",
                hello.engine_id,
                reason,
                fld or "settings",
            )
            self._send_to(identity, Refuse(reason=reason, field=fld, ours=theirs, theirs=ours))
            return
        self._authed[identity] = hello.engine_id
        while len(self._authed) > _MAX_AUTHED:
            forgotten = next(iter(self._authed))
            del self._authed[forgotten]
            agent = self._nixl_peers.pop(forgotten, None)
            if agent is not None and self._nixl is not None and agent not in self._nixl_peers.values():
                self._nixl.remove_peer(agent)
        transport = "tcp"
        if self._nixl is not None and hello.nixl is not None and "nixl" in hello.transports:
            try:
                self._nixl_peers[identity] = self._nixl.add_peer(hello.nixl)
                transport = "nixl"
            except Exception as exc:
                logger.warning(
                    "decode %s offered NIXL but adding it failed (%s); using TCP", hello.engine_id, exc
                )
        self._send_to(
            identity,
            HelloAck(
                engine_id=self.engine_id,
                geometry=self.geometry,
                transport=transport,
                nixl_agent=self._nixl.name if transport == "nixl" and self._nixl is not None else "",
                auth=hello_ack_auth(self.settings.secret, self.engine_id, hello.nonce),
            ),
        )

    def _check_auth(self, hello: Hello | Describe) -> str:
        """check_hello_auth plus replay refusal: a proof is accepted once (nonces remembered for the skew window)."""
        reason = check_hello_auth(self.settings.secret, hello, max_skew_s=_AUTH_SKEW_S)
        if reason or not self.settings.secret:
            return reason
        now = time.monotonic()
        if len(self._nonces) > 100_000 or (self._nonces and next(iter(self._nonces.values())) < now):
            self._nonces = {n: t for n, t in self._nonces.items() if t >= now}
        if hello.nonce in self._nonces:
            return "hello replayed (this proof was already used)"
        self._nonces[hello.nonce] = now + 2 * _AUTH_SKEW_S
        return ""

    # ----------------------------------------------------------------- receiver side

    def _start_load(
        self,
        request_id: str,
        transfer_id: str,
        peer: tuple[str, int],
        dest_blocks: list[int],
        first_block: int,
        prompt_len: int,
        prompt_hash: str = "",
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
        )
        self._unwatch(transfer_id, peer)
        if transfer_id in self._incoming:
            other = self._incoming[transfer_id].request_id
            self._finalize_load(inc, ok=False, reason=f"transfer id already loading for request {other}")
            return
        bad = [b for b in dest_blocks if not 0 <= b < self.store.num_blocks]
        if bad:
            self._finalize_load(inc, ok=False, reason=f"destination blocks {bad[:4]} out of range")
            return
        self._incoming[transfer_id] = inc
        if inc.expected == 0:
            self._finish_load(inc, ok=True, reason="nothing to load")
            return
        try:
            p = self._peer(peer)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            self._finish_load(inc, ok=False, reason=f"cannot dial prefill {peer!r}: {exc}")
            return
        if p.state == "ready":
            self._register(p, inc)

    def _peer(self, addr: tuple[str, int]) -> _Peer:
        p = self._peers.get(addr)
        if p is not None:
            return p
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_CONTROL_BYTES, self.store.block_bytes) + 4096)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        # A unique monitor endpoint: pyzmq's default name reuses the socket's fd, which collides after fd reuse.
        mon_addr = f"inproc://vllm-disagg-monitor-{id(self)}-{next(_instance_ids)}"
        sock.monitor(mon_addr, zmq.EVENT_DISCONNECTED)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(mon_addr)
        host, port = addr
        try:
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"port {port!r} is not in 1..65535")
            sock.connect(f"tcp://{host}:{port}")
        except Exception:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            sock.close(linger=0)
            monitor.close(linger=0)
            raise
        p = _Peer(addr=addr, sock=sock, monitor=monitor, since=time.monotonic())
        self._peers[addr] = p
        info = self._nixl.info() if self._nixl is not None else None
        hello = make_hello(self.settings.secret, self.engine_id, self.geometry, __version__, nixl=info)
        p.hello_nonce = hello.nonce
        sock.send_multipart(encode(hello))
        return p

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
        rule = self._control_fault("register")
        if rule is not None and rule.action == "drop":
            return
        if rule is not None and rule.action == "delay":
            self._delayed.append(
                (time.monotonic() + rule.delay_s, lambda: p.sock.send_multipart(encode(reg)))
            )
            return
        p.sock.send_multipart(encode(reg))

    def _peer_loads(self, p: _Peer) -> list[_Incoming]:
        return [
            i
            for i in self._incoming.values()
            if i.peer == p.addr and i.state in ("pending", "waiting", "stopping")
        ]

    def _drain_peer(self, p: _Peer) -> None:
        while p.state != "dead":
            try:
                frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg, payload = decode([f.buffer for f in frames])
            except WireError as exc:
                self.stats["messages_rejected"] += 1
                logger.warning("rejected a malformed message from prefill %s:%d: %s", *p.addr, exc)
                tid = peek_transfer_id([f.buffer for f in frames])
                bad = self._incoming.get(tid) if tid else None
                if bad is not None and bad.peer == p.addr and bad.state == "waiting":
                    self._finish_load(bad, ok=False, reason=f"malformed data: {exc}")
                continue
            try:
                self._on_peer_message(p, msg, payload)
            except Exception:
                self.stats["messages_rejected"] += 1
                logger.exception(
                    "error handling %s from prefill %s:%d; dropped it", type(msg).__name__, *p.addr
                )

    def _on_peer_message(self, p: _Peer, msg: Message, payload: list[Any]) -> None:
        if isinstance(msg, LayerBlocks):
            self._on_layer(p, msg, payload)
        elif isinstance(msg, HelloAck):
            if p.state != "connecting":
                return
            reason = check_hello_ack_auth(self.settings.secret, msg, p.hello_nonce)
            if reason:
                self.stats["handshakes_refused"] += 1
                logger.error("prefill %s:%d: %s; not loading from it", *p.addr, reason)
                self._kill_peer(p, reason)
                return
            logger.debug("prefill %s:%d accepted the handshake", *p.addr)
            p.state, p.engine_id, p.transport = "ready", msg.engine_id, msg.transport
            p.nixl_agent = msg.nixl_agent
            for inc in self._peer_loads(p):
                if inc.state == "pending":
                    self._register(p, inc)
            self._send_declines(p)
        elif isinstance(msg, Refuse):
            self.stats["handshakes_refused"] += 1
            detail = f" ({msg.field}: decode has {msg.ours}, prefill has {msg.theirs})" if msg.field else ""
            logger.error(
                "prefill %s:%d refused this decode: %s%s; affected requests recompute locally",
                *p.addr,
                msg.reason,
                detail,
            )
            self._kill_peer(p, f"refused by prefill: {msg.reason}{detail}")
        elif isinstance(msg, Abort):
            aborted = self._incoming.get(msg.transfer_id)
            if aborted is not None and aborted.peer == p.addr and aborted.state == "stopping":
                self._finalize_load(aborted, *aborted.outcome)
            elif aborted is not None and aborted.peer == p.addr and aborted.state in ("pending", "waiting"):
                self._finish_load(aborted, ok=False, reason=f"prefill aborted: {msg.reason}")

    def _on_layer(self, p: _Peer, msg: LayerBlocks, payload: list[Any]) -> None:
        inc = self._incoming.get(msg.transfer_id)
        if inc is None or inc.peer != p.addr or inc.state != "waiting":
            return  # late data for a finished, failed or cancelled load: never written
        if not 0 <= msg.layer < self.store.num_layers or msg.block_bytes != self.store.block_bytes:
            self._finish_load(inc, ok=False, reason=f"bad layer header {msg.layer}/{msg.block_bytes}")
            return
        lo, hi = inc.first_block, inc.first_block + len(inc.dest_blocks)
        if msg.crc32 and (
            len(msg.crc32) != len(payload)
            or any(zlib.crc32(buf) != crc for buf, crc in zip(payload, msg.crc32, strict=True))
        ):
            self._finish_load(inc, ok=False, reason=f"checksum mismatch in layer {msg.layer}: data corrupted")
            return
        outside = [idx for idx in msg.block_indices if not lo <= idx < hi]
        if outside:
            self._finish_load(inc, ok=False, reason=f"block index {outside[0]} outside [{lo}, {hi})")
            return
        self.store.write_blocks(msg.layer, [inc.dest_blocks[idx - lo] for idx in msg.block_indices], payload)
        self._arrived(inc, msg, "all blocks arrived")

    def _on_layer_written(self, agent: str, msg: LayerBlocks) -> None:
        """NIXL: prefill's WRITE of these blocks completed (the notification follows the data)."""
        inc = self._incoming.get(msg.transfer_id)
        if inc is None or inc.state != "waiting":
            return
        p = self._peers.get(inc.peer)
        if p is None or not p.nixl_agent or agent != p.nixl_agent:
            self.stats["messages_rejected"] += 1
            logger.warning(
                "ignored a NIXL notification for transfer %s from agent %s (expected %s)",
                msg.transfer_id,
                agent,
                p.nixl_agent if p else "none",
            )
            return
        lo, hi = inc.first_block, inc.first_block + len(inc.dest_blocks)
        if not 0 <= msg.layer < self.store.num_layers or any(not lo <= i < hi for i in msg.block_indices):
            self._finish_load(inc, ok=False, reason=f"bad NIXL notification for layer {msg.layer}")
            return
        self._arrived(inc, msg, "all blocks arrived (NIXL)")

    def _arrived(self, inc: _Incoming, msg: LayerBlocks, done_reason: str) -> None:
        """These blocks of a layer are in place (TCP: written; NIXL: notified after the WRITE landed)."""
        inc.received.update((msg.layer, i) for i in msg.block_indices)
        now = time.monotonic()
        inc.t_first = inc.t_first or now
        inc.deadline = max(
            inc.deadline, now + self.settings.load_timeout_s
        )  # a stall deadline once data flows
        nbytes = len(msg.block_indices) * self.store.block_bytes
        inc.bytes += nbytes
        self.stats["bytes_received"] += nbytes
        if len(inc.received) == inc.expected:
            self._finish_load(inc, ok=True, reason=done_reason)

    def _finish_load(self, inc: _Incoming, ok: bool, reason: str, cancelled: bool = False) -> None:
        p = self._peers.get(inc.peer)
        if p is not None and p.state == "ready":
            if self._control_fault("done") is None:
                with contextlib.suppress(zmq.ZMQError):
                    p.sock.send_multipart(encode(Done(transfer_id=inc.transfer_id, ok=ok, reason=reason)))
            if not ok and p.transport == "nixl" and inc.state == "waiting":
                # Prefill may still be WRITING into these blocks: hand them back only once it confirms it stopped.
                inc.state, inc.outcome = "stopping", (ok, reason, cancelled)
                inc.stop_deadline = time.monotonic() + self.settings.cancel_ack_s
                return
        self._finalize_load(inc, ok, reason, cancelled)

    def _finalize_load(self, inc: _Incoming, ok: bool, reason: str, cancelled: bool = False) -> None:
        # Device memory: queued host-to-device copies must land before vLLM uses (or recomputes into) the blocks.
        self.store.sync()
        inc.state = "done" if ok else ("cancelled" if cancelled else "failed")
        inc.t_done = time.monotonic()
        if self._incoming.get(inc.transfer_id) is inc:
            del self._incoming[inc.transfer_id]
        with self._lock:
            self._results.finished_recving.add(inc.request_id)
            if not ok and not cancelled:
                self._results.failed_recving.add(inc.request_id)
        self.stats["loads_ok" if ok else "loads_failed"] += 1
        log = logger.info if ok or cancelled else logger.warning
        log(
            "load %s for request %s from prefill %s:%d: %s (%d/%d layer-blocks, %d bytes, %.1f ms)%s",
            inc.state,
            inc.request_id,
            *inc.peer,
            reason,
            len(inc.received),
            inc.expected,
            inc.bytes,
            1000 * (inc.t_done - inc.t_start),
            "" if ok or cancelled else "; recomputing locally",
        )
        self._trace(
            {
                "side": "recv",
                "transfer_id": inc.transfer_id,
                "request_id": inc.request_id,
                "state": inc.state,
                "reason": reason,
                "bytes": inc.bytes,
                "blocks": len(inc.dest_blocks),
                "first_block": inc.first_block,
                "t_start": inc.t_start,
                "t_first": inc.t_first,
                "t_done": inc.t_done,
            }
        )

    def _cancel_load(self, transfer_id: str, request_id: str = "") -> None:
        inc = self._incoming.get(transfer_id)
        if inc is not None and request_id and inc.request_id != request_id:
            # Not this request's load (its own was refused as a duplicate and already reported).
            return
        if inc is not None and inc.state in ("pending", "waiting"):
            self._finish_load(inc, ok=False, reason="request aborted on decode", cancelled=True)

    def _watch(self, transfer_id: str, addr: tuple[str, int]) -> None:
        try:
            self._peer(addr)
        except (zmq.ZMQError, ValueError, TypeError):
            return
        self._watches.setdefault(addr, set()).add(transfer_id)

    def _unwatch(self, transfer_id: str, addr: tuple[str, int]) -> None:
        watched = self._watches.get(addr)
        if watched is not None:
            watched.discard(transfer_id)
            if not watched:
                del self._watches[addr]

    def _decline(self, transfer_id: str, addr: tuple[str, int]) -> None:
        self._unwatch(transfer_id, addr)
        try:
            p = self._peer(addr)
        except (zmq.ZMQError, ValueError, TypeError):
            return
        self._declines.setdefault(addr, []).append(transfer_id)
        if p.state == "ready":
            self._send_declines(p)

    def _send_declines(self, p: _Peer) -> None:
        for tid in self._declines.pop(p.addr, []):
            with contextlib.suppress(zmq.ZMQError):
                p.sock.send_multipart(encode(Done(transfer_id=tid, ok=False, reason="decode will not load")))

    def _kill_peer(self, p: _Peer, reason: str) -> None:
        p.state = "dead"
        self._declines.pop(p.addr, None)
        self._watches.pop(p.addr, None)
        if self._peers.get(p.addr) is p:
            del self._peers[p.addr]
        self._graveyard.append(p)
        for inc in self._peer_loads(p):
            if inc.state == "stopping":
                self._finalize_load(inc, *inc.outcome)  # a dead prefill writes no more
            else:
                self._finish_load(inc, ok=False, reason=reason)

    def _drain_monitor(self, p: _Peer) -> None:
        while True:
            try:
                ev = zmq.utils.monitor.recv_monitor_message(p.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_DISCONNECTED and p.state != "dead":
                logger.warning("prefill %s:%d disconnected", *p.addr)
                self._kill_peer(p, "prefill disconnected (died or network failure)")
                return

    def _heartbeats(self, now: float) -> None:
        for p in self._peers.values():
            if p.state != "ready" or now - p.last_heartbeat < self.settings.heartbeat_s:
                continue
            tids = [i.transfer_id for i in self._peer_loads(p) if i.state == "waiting"]
            queued = sorted(self._watches.get(p.addr, ()))
            p.last_heartbeat = now
            if (tids or queued) and self._control_fault("heartbeat") is None:
                with contextlib.suppress(zmq.ZMQError):
                    p.sock.send_multipart(encode(Heartbeat(transfer_ids=tids, queued=queued)))

    def _expire(self, now: float) -> None:
        for inc in list(self._incoming.values()):
            if inc.state == "stopping" and now > inc.stop_deadline:
                # A live prefill may still post RDMA writes into these blocks: hand them back only when it confirms,
                # dies, or a much longer hard limit passes (then loudly: the operator should look at that prefill).
                peer = self._peers.get(inc.peer)
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
                    continue
                (logger.error if hard else logger.warning)(
                    "prefill %s:%d never confirmed it stopped writing transfer %s; releasing its blocks (%s)",
                    *inc.peer,
                    inc.transfer_id,
                    "hard limit: check that prefill instance" if hard else "prefill is gone",
                )
                self._finalize_load(inc, *inc.outcome)
            elif inc.state in ("pending", "waiting") and now > inc.deadline:
                self._finish_load(
                    inc,
                    ok=False,
                    reason=f"no complete KV within load_timeout_s={self.settings.load_timeout_s:g}",
                )
        for p in list(self._peers.values()):
            if p.state == "connecting" and now - p.since > self.settings.connect_timeout_s:
                logger.error(
                    "prefill %s:%d did not answer the handshake within %.0f s: is its side channel reachable?",
                    *p.addr,
                    self.settings.connect_timeout_s,
                )
                self._kill_peer(p, "prefill side channel unreachable")
        for out in list(self._outgoing.values()):
            if now > out.lease_deadline and (out.finished or not out.known):
                self.stats["leases_expired"] += 1
                logger.warning(
                    "transfer %s (request %s): lease of %.0f s expired without word from decode; freeing its blocks",
                    out.transfer_id,
                    out.request_id or "<not seen on prefill>",
                    self.settings.lease_s,
                )
                self._abort_out(out, "lease expired on prefill")
        for out in list(self._draining.values()):
            self._maybe_report(out)
        for tid, (expiry, _) in list(self._tombstones.items()):
            if now > expiry:
                del self._tombstones[tid]
