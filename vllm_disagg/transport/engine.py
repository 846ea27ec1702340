"""The transfer engine: one I/O thread per worker that owns every socket of the side channel and every data path.

Roles, per transfer (one instance can be both at once, for different requests):
  * sender (prefill, P, ``sender.py``): binds a ZMQ ROUTER that decodes dial; pushes each layer's blocks to the
    registered decode as soon as the forward pass produced them, and holds them until decode is done.
  * receiver (decode, D, ``receiver.py``): dials P, registers, and reports a request loaded only when every
    needed block of every layer has arrived; any failure reports it failed (the connector recomputes).

Bytes move over a data path (``datapath.py``: TCP frames on the side channel, or NIXL writes), chosen per decode
in the handshake. The vLLM worker thread talks to the engine only through thread-safe methods that enqueue
commands; results come back through ``poll_results`` and ``drain_records``. ZMQ sockets never cross threads.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.transport import defaults
from vllm_disagg.transport.block_store import BlockStore
from vllm_disagg.transport.channel import MESSAGES_PER_TURN, SideChannel
from vllm_disagg.transport.datapath import DataPath, PathContext, PathFactory
from vllm_disagg.transport.endpoints import dual_stack, tcp_endpoint
from vllm_disagg.transport.parts import EngineParts
from vllm_disagg.transport.paths import DATA_PATHS, FALLBACK
from vllm_disagg.transport.receiver import Receiver
from vllm_disagg.transport.records import Reports, TransferRecord, TransferResults
from vllm_disagg.transport.sender import COALESCE_MAX_BYTES, Sender
from vllm_disagg.transport.zmq_auth import Gatekeeper
from vllm_disagg.transport.zmq_monitor import unwatch
from vllm_disagg.wire import MAX_CONTROL_BYTES, WIRE_VERSION, Refuse, WireError, decode

__all__ = ["EngineSettings", "TransferEngine", "TransferResults"]

if TYPE_CHECKING:
    from vllm_disagg.config import ConnectorConfig

logger = logging.getLogger("vllm_disagg.transfer")
_OFFERS_PER_FLUSH = 256  # commands run before queued offers are sent even if more are waiting
# Offers under ``offer_hold_bytes`` are still sent this long (or their window, if longer) after they began gathering
# (the first of them, or the last send where a wake-up was armed for them) when no step's last layer or forward end
# comes first: a caller that never marks a forward end does not hold them long.
_SMALL_OFFERS_HOLD_S = 0.02
# That hold once the caller has marked a forward end (``mark_forward_end``): its steps' last layers and ends send
# small offers, so the hold is only a bound for a step that runs long. Holding does not lengthen the tail (what is
# left at a step's end stays under ``offer_hold_bytes``); a shorter hold splits a step's small offers into more
# messages, each a wake-up of both sides' I/O threads.
_SMALL_OFFERS_HOLD_MARKED_S = 0.1
# While loads wait on a polled data path with no announced write outstanding (``Receiver.awaiting_writes``), the
# I/O loop still looks for its notices this often: a safety net, since prefill announces every write it starts.
_LOAD_SAFETY_POLL_MS = 20

_instance_ids = itertools.count()


class _Offer:
    """Offers of one send's consecutive layers, all of one list, queued as one command. The worker thread extends
    the record it queued last for the send while the I/O thread has not taken it (under ``_offer_lock``), so a
    step's layers cost the worker an append each and the I/O thread one record per wake-up, not one per layer."""

    __slots__ = ("transfer_id", "layer", "count", "blocks", "request_id", "last", "times", "taken")

    def __init__(
        self,
        transfer_id: str,
        layer: int,
        blocks: list[tuple[int, int]],
        request_id: str,
        last: bool,
        at: float,
    ) -> None:
        self.transfer_id = transfer_id
        self.layer = layer  # the first layer
        self.count = 1
        self.blocks = blocks
        self.request_id = request_id
        self.last = last  # its latest layer is the model's last: what gathered goes now
        self.times = [at]  # when each layer was offered (monotonic)
        self.taken = False  # the I/O thread took it: the worker queues a new record for the next layer


class _Run:
    """Offers of one send's consecutive layers, all of one list, taken one record after another
    (``_drain_commands``)."""

    __slots__ = ("transfer_id", "first", "count", "blocks", "request_id", "times")

    def __init__(self, first: _Offer, count: int, times: list[float]) -> None:
        self.transfer_id, self.first, self.count = first.transfer_id, first.layer, count
        self.blocks, self.request_id, self.times = first.blocks, first.request_id, times


@dataclass
class EngineSettings:
    """What the engine needs of the connector's config (``from_config``); defaults from ``defaults.py``, as the
    config's."""

    bind_host: str = "0.0.0.0"
    port: int = 0  # 0: pick a free port (tests)
    secret: bytes | None = None
    lease_s: float = defaults.LEASE_S
    unvouched_lease_s: float = defaults.UNVOUCHED_LEASE_S  # a hold no secret-holder asked for, until claimed
    load_timeout_s: float = defaults.LOAD_TIMEOUT_S
    heartbeat_s: float = defaults.HEARTBEAT_S
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S
    trace_path: str | None = None  # JSON lines, one per finished transfer (tests, benchmarks)
    # auto: every data path that comes up here; a path's name: that one is required (TCP stays as the fallback).
    transport: str = defaults.TRANSPORT
    verify_checksums: bool = defaults.VERIFY_CHECKSUMS  # TCP: CRC32 per block
    cancel_ack_s: float = (
        5.0  # remote writes: how long decode waits for prefill to confirm it stopped writing
    )
    offer_batch_ms: float = defaults.OFFER_BATCH_MS  # prefill: how long offers gather before they are sent
    offer_hold_bytes: int = defaults.OFFER_HOLD_BYTES  # prefill: smaller offers wait for the step's end

    @classmethod
    def from_config(cls, cfg: ConnectorConfig, port: int) -> EngineSettings:
        """The engine's settings for a connector configured by ``cfg``, its side channel on ``port``."""
        return cls(
            bind_host=cfg.side_channel_host,
            port=port,
            secret=cfg.secret(),
            lease_s=cfg.lease_s,
            unvouched_lease_s=cfg.unvouched_lease_s,
            load_timeout_s=cfg.load_timeout_s,
            heartbeat_s=cfg.heartbeat_s,
            connect_timeout_s=cfg.connect_timeout_s,
            trace_path=cfg.trace_path,
            transport=cfg.transport,
            verify_checksums=cfg.verify_checksums,
            offer_batch_ms=cfg.offer_batch_ms,
            offer_hold_bytes=cfg.offer_hold_bytes,
        )


class TransferEngine:
    """Sender and receiver of layer-wise KV blocks. See the module docstring.

    ``data_paths`` replaces the registered data paths (``paths.py``), in preference order; ``wrap_channel`` wraps
    the side channel's sends (tests inject faults with it, ``faults.py``)."""

    def __init__(
        self,
        store: BlockStore,
        geometry: KVGeometry,
        engine_id: str,
        settings: EngineSettings,
        *,
        data_paths: Mapping[str, PathFactory] | None = None,
        wrap_channel: Callable[[SideChannel], SideChannel] | None = None,
    ) -> None:
        self.store = store
        self.geometry = geometry
        self.engine_id = engine_id
        self.settings = settings
        # The engine's own context: a ZAP handler (``Gatekeeper``) serves every socket of its context, and another
        # engine in this process may have another secret.
        self._ctx: zmq.Context[Any] = zmq.Context()
        # commands for the I/O thread, in order: callables, and offers as records (``_Offer``)
        self._cmds: queue.SimpleQueue[tuple[Callable[[], None] | _Offer, Callable[[], None] | None]] = (
            queue.SimpleQueue()
        )
        self._wake_addr = f"inproc://vllm-disagg-wake-{id(self)}-{next(_instance_ids)}"
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _wake_socks
        self._wake_socks: list[zmq.Socket[Any]] = []
        self._crashed = False
        self._closed = False  # close() ran: nothing is woken any more
        # A wake-up is on its way to the I/O thread: later commands ride on it (one zmq message per burst of
        # commands, e.g. one per step instead of one per layer offer). Cleared by the I/O thread before it drains.
        self._wake_pending = False
        # Prefill's offers are gathering until this monotonic time, or a wake-up is armed for the next step's offers
        # (``_arm_offers``); set and cleared by the I/O thread, which then wakes by itself: offers submitted
        # meanwhile send no wake-up, and layers computed within the window leave together. A forward pass's end
        # (``mark_forward_end``) sends them at once.
        self._offers_due: float | None = None
        self._offer_batch_s = settings.offer_batch_ms / 1000
        self._offers_sent_at = 0.0  # when offers were last sent (I/O thread): the window runs from there
        # Bytes offered by the worker thread since it last woke the I/O thread for them (worker thread only): offers
        # under ``offer_hold_bytes`` send no wake-up, so it wakes the I/O thread itself once they pass it.
        self._offer_hold_bytes = settings.offer_hold_bytes if self._offer_batch_s > 0 else 0
        self._gathering_bytes = 0
        self._last_layer = geometry.num_layers - 1
        self._block_bytes = store.block_bytes
        self._gathering_since: float | None = None  # when the offers now gathering began (I/O thread)
        self._rearm = False  # offers were sent: wake when the next ones would be due (``_arm_offers``)
        # The caller marks forward ends: small offers may wait longer for them (``_small_offers_hold_s``).
        self._marks_forward_ends = False
        # Worker thread: the latest offer was a step's last layer (it sent what gathered and woke the I/O thread).
        self._last_offer_was_last = False
        # Worker thread: per send, the offer record it queued last (``_Offer``), extended while not yet taken.
        self._open_offers: dict[str, _Offer] = {}
        # guards the open records' growth against the I/O thread taking them
        self._offer_lock = threading.Lock()
        self._stop = threading.Event()
        self._reports = Reports(settings.trace_path)
        self.stats = self._reports.stats
        # with a secret, zmq's handshake itself must prove it: nobody else gets a message read (``zmq_auth``)
        self._gate = (
            Gatekeeper(self._ctx, settings.secret, self._refused_handshake) if settings.secret else None
        )
        self._router = self._ctx.socket(zmq.ROUTER)
        if self._gate is not None:
            self._gate.guard(self._router)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, 0)
        # Prefill only receives control messages: bound what an unauthenticated peer can make it buffer.
        self._router.setsockopt(zmq.RCVHWM, 1000)
        self._router.setsockopt(zmq.LINGER, 0)
        dual_stack(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES + 4096)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        channel = SideChannel(self._router)
        self._channel = wrap_channel(channel) if wrap_channel is not None else channel
        self._paths: list[DataPath] = []
        try:
            self._paths = self._open_paths(DATA_PATHS if data_paths is None else data_paths)
            if settings.port:
                self._router.bind(tcp_endpoint(settings.bind_host, settings.port))
                self.port = settings.port
            else:
                self.port = self._router.bind_to_random_port(tcp_endpoint(settings.bind_host))
        except Exception:
            # a port in use: what was opened is released (a NIXL agent's registrations, the path's sockets), so the
            # caller can retry on another port
            for path in self._paths:
                path.close()
            self._router.close(linger=0)
            if self._gate is not None:
                self._gate.close()
            self._ctx.term()
            raise
        self._polled = [p for p in self._paths if p.polled]
        parts = EngineParts(
            store, geometry, engine_id, settings, self._channel, tuple(self._paths), self._reports
        )
        self._sender = Sender(parts)
        self._receiver = Receiver(self._ctx, parts)
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
            "+".join(p.name for p in self._paths),
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

    def _open_paths(self, factories: Mapping[str, PathFactory]) -> list[DataPath]:
        """The data paths this engine offers, in preference order: all that come up (``transport: auto``), or the
        one named plus the fallback."""
        wanted = self.settings.transport
        paths: list[DataPath] = []
        for name, factory in factories.items():
            if wanted not in ("auto", name) and name != FALLBACK:
                continue
            ctx = PathContext(
                name=f"{self.engine_id}-{self.geometry.tp_rank}",
                store=self.store,
                settings=self.settings,
                channel=self._channel,
                required=wanted == name,
            )
            path = factory(ctx)
            if path is not None:
                paths.append(path)
        if not paths or (wanted != "auto" and all(p.name != wanted for p in paths)):
            for p in paths:
                p.close()
            raise ValueError(f"transport: {wanted!r} is not a data path here (known: {', '.join(factories)})")
        return paths

    @property
    def data_path(self) -> str:
        """The preferred data path (what a decode that offers everything would get)."""
        return self._paths[0].name

    # ----------------------------------------------------------------- API for the worker thread (thread-safe)

    def _submit(
        self, fn: Callable[[], None] | _Offer, on_crash: Callable[[], None] | None = None, offer: bool = False
    ) -> None:
        """Queue ``fn`` for the I/O thread. ``on_crash`` is what must still be reported if the thread is dead or
        dies before running it (a load reported failed, a send reported freed), so no request waits forever.
        ``offer``: no wake-up while offers are gathering (the I/O thread wakes when they are due)."""
        if not isinstance(fn, _Offer) and self._open_offers:
            with self._offer_lock:  # later offers must not join a record queued before this command
                self._open_offers.clear()
        self._cmds.put((fn, on_crash))
        if self._crashed:
            self._drain_after_crash()
            return
        self._wake(offer)

    def _wake(self, offer: bool = False) -> None:
        """Wake the I/O thread for what was just queued (or added to a queued offer record), unless a wake-up is
        on its way or, for an ``offer``, offers are gathering."""
        # Both flags are read after the put: the I/O thread clears them before it last checks the queue.
        if self._wake_pending:  # the I/O thread has not drained since the last wake-up: it will see this one
            return
        if offer and self._offers_due is not None:  # offers are gathering: it wakes when they are due
            return
        if self._closed:  # the I/O thread is gone, and so are the context's sockets
            return
        self._wake_pending = True
        sock = getattr(self._local, "wake", None)  # one PUSH socket per calling thread
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

    def begin_send(
        self, transfer_id: str, request_id: str, prompt_len: int, prompt_hash: str = "", vouched: bool = True
    ) -> None:
        """P: a local request's prompt KV is to be sent under ``transfer_id`` (decode may register before or after).

        ``prompt_hash`` (of the prompt's token ids) is compared with decode's, when both are given. Not ``vouched``
        (nobody holding the shared secret asked for it): held ``unvouched_lease_s`` at most until a decode claims
        it."""
        self._submit(lambda: self._sender.begin(transfer_id, request_id, prompt_len, prompt_hash, vouched))

    def offer_blocks(
        self, transfer_id: str, layer: int, blocks: list[tuple[int, int]], request_id: str = ""
    ) -> None:
        """P: (logical index, local block id) pairs of ``layer`` whose KV is now complete; sent as soon as possible.
        Pass one list to every layer of a step, and do not change it afterwards: it is converted once per step.

        Offers from a request other than the one that began the send under this id are ignored."""
        last = layer == self._last_layer  # the step's last layer: what gathered goes now
        wake = last
        if self._offer_hold_bytes:
            self._gathering_bytes += len(blocks) * self._block_bytes
            wake = wake or self._gathering_bytes >= self._offer_hold_bytes
            if wake:
                self._gathering_bytes = 0

        # A record, not a closure, and a step's layers extend the one queued for the send while the I/O thread has
        # not taken it: it hands each run of consecutive layers offering one list to the sender in one call.
        self._last_offer_was_last = last
        now = time.monotonic()
        with self._offer_lock:
            rec = self._open_offers.get(transfer_id)
            joined = False
            if (
                rec is not None
                and not rec.taken
                and rec.blocks is blocks
                and rec.layer + rec.count == layer
                and rec.request_id == request_id
            ):
                rec.count += 1
                rec.times.append(now)
                rec.last = last
                joined = True
            else:
                rec = self._open_offers[transfer_id] = _Offer(
                    transfer_id, layer, blocks, request_id, last, now
                )
        if not joined:
            self._submit(rec, offer=not wake)
        elif wake:
            self._wake()

    def mark_forward_end(self, transfer_ids: list[str]) -> None:
        """P: a forward pass that offered layers ended (every step, so its last layers leave without waiting for
        the offer window); ``transfer_ids``: the sends whose prefill it completed."""
        now = time.monotonic()
        self._gathering_bytes = 0
        self._marks_forward_ends = True

        def run() -> None:
            self._sender.forward_end(transfer_ids, now)
            if self._sender.offered:  # else the timer armed for the next step's offers stays
                self._flush_offers()

        # After the step's last layer (which sends what gathered and woke the I/O thread itself), the end has
        # nothing to send: it rides on the next wake-up (a timer armed for the next step's offers, or any command)
        # instead of waking the I/O thread once more per step. A step that offered nothing wakes it as before.
        ride = self._last_offer_was_last
        self._last_offer_was_last = False
        self._submit(run, offer=ride)

    def finish_send(self, transfer_id: str, aborted: bool, request_id: str = "") -> None:
        """P: the local request finished. Hold its blocks until decode is done (or the lease ends); abort frees now."""
        self._submit(
            lambda: self._sender.finish(transfer_id, aborted, request_id),
            lambda: self._reports.sent(request_id),
        )

    def abort_unstarted_send(self, transfer_id: str) -> None:
        """P: a request that was to send ``transfer_id`` ended before computing anything (aborted while queued).
        Tell a decode that already registered to recompute now; nothing is held here (vLLM freed the request)."""
        self._submit(lambda: self._sender.abort_unstarted(transfer_id))

    def suspend_send(self, transfer_id: str, request_id: str, timeout_s: float = 5.0) -> bool:
        """P: the request was preempted and vLLM freed its blocks. Return once nothing more is read from those
        blocks, so the next forward pass may overwrite them. The transfer stays open: the resumed request's offers
        (on its new blocks) send what decode still lacks. False on timeout (the transfer is then aborted)."""
        return self.suspend_sends([(transfer_id, request_id)], timeout_s)

    def suspend_sends(self, sends: list[tuple[str, str]], timeout_s: float = 5.0) -> bool:
        """``suspend_send`` for several (transfer id, request id) at once: one wait of at most ``timeout_s`` for all
        of them (one step's preemptions stall its forward pass once, not once each). False when any timed out."""
        waits = []
        for transfer_id, request_id in sends:
            quiet = threading.Event()
            self._submit(functools.partial(self._sender.suspend, transfer_id, request_id, quiet), quiet.set)
            waits.append((transfer_id, request_id, quiet))
        deadline = time.monotonic() + timeout_s
        ok = True
        for transfer_id, request_id, quiet in waits:
            if quiet.wait(max(0.0, deadline - time.monotonic())) or not self.alive:
                continue
            ok = False
            # decode hears of the abort before the forward pass overwrites the blocks (a write still in flight
            # could land overwritten bytes, and must not complete its load unnoticed)
            told = threading.Event()
            self._submit(functools.partial(self._abort_suspended, transfer_id, request_id, told), told.set)
            told.wait(1.0)
            logger.error(
                "transfer %s (request %s): frames still in flight %.0f s after preemption; the freed blocks may be "
                "overwritten while a data path reads them, so decode was told to recompute. A stalled decode "
                "or link holds them (see the decode's log).",
                transfer_id,
                request_id,
                timeout_s,
            )
        return ok

    def _abort_suspended(self, transfer_id: str, request_id: str, told: threading.Event) -> None:
        try:
            self._sender.abort_suspended(transfer_id, request_id)
        finally:
            told.set()

    def decline_load(self, transfer_id: str, peer: tuple[str, int]) -> None:
        """D: a request that named this transfer finished without loading it; tell prefill to free its blocks now."""
        self._submit(lambda: self._receiver.decline(transfer_id, peer))

    def watch_load(self, transfer_id: str, peer: tuple[str, int]) -> None:
        """D: a request that will load ``transfer_id`` arrived but is still queued here: keep prefill's lease alive
        (heartbeats) until it starts loading or is declined, so a long decode queue does not expire the KV."""
        self._submit(lambda: self._receiver.watch(transfer_id, peer))

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
        self._submit(
            lambda: self._receiver.start(
                request_id, transfer_id, peer, dest_blocks, first_block, prompt_len, prompt_hash
            ),
            lambda: self._reports.loaded(request_id, failed=True),
        )

    def cancel_load(self, transfer_id: str, request_id: str = "") -> None:
        """D: the local request was aborted while waiting; stop writing, tell P, report it finished.

        After a crash nothing is reported here: the load itself was already reported failed (reporting it again
        would name a request vLLM has freed)."""
        self._submit(lambda: self._receiver.cancel(transfer_id, request_id))

    def poll_results(self) -> TransferResults:
        return self._reports.take_results()

    def drain_records(self) -> list[TransferRecord]:
        """Finished-transfer records since the last call (the connector turns them into vLLM connector stats)."""
        return self._reports.take_records()

    def snapshot(self) -> dict[str, int]:
        """How much per-transfer and per-peer state the engine holds (tests check that it stays bounded)."""
        s, r = self._sender, self._receiver
        return {
            "outgoing": len(s.outgoing),
            "tombstones": len(s.tombstones),
            "draining": len(s.draining),
            "decodes": len(s.decodes),
            "incoming": len(r.incoming),
            "peers": len(r.peers),
            "watches": len(r.watches),
            "declines": len(r.declines),
        }

    def close(self) -> None:
        self._stop.set()
        self._submit(lambda: None)
        self._thread.join(timeout=5)
        self._closed = True
        with self._lock:
            socks, self._wake_socks = self._wake_socks, []
        for sock in socks:
            sock.close(linger=0)
        if not self._thread.is_alive():  # every socket of the context is closed: its threads can end
            self._ctx.term()

    def _refused_handshake(self) -> None:
        self.stats["handshakes_refused"] += 1

    # ----------------------------------------------------------------- I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        gate = self._gate
        if gate is not None:
            for s in gate.sockets:
                poller.register(s, zmq.POLLIN)
        registered: set[int] = set()
        receiver = self._receiver
        stats = self.stats
        try:
            while not self._stop.is_set():
                for peer in list(receiver.peers.values()):
                    for s in (peer.sock, peer.monitor):
                        if id(s) not in registered:
                            poller.register(s, zmq.POLLIN)
                            registered.add(id(s))
                # A polled data path's completions wake nothing: keep turning while it has writes of its own in
                # flight, or decode was told of writes whose notices have not landed; a load waiting for writes
                # not yet announced is looked at every _LOAD_SAFETY_POLL_MS.
                polled = bool(self._polled)
                busy = polled and (any(p.busy() for p in self._polled) or receiver.awaiting_writes())
                busy = busy or bool(self._sender.parked)  # device copies to check again soon
                # a forward pass waits on a preempted send's frames: look again in 1 ms, not at the next wake-up
                busy = busy or bool(self._sender.suspended)
                timeout = 1 if busy else _LOAD_SAFETY_POLL_MS if polled and receiver.loading() else 100
                due = self._offers_due
                if due is not None:
                    timeout = min(timeout, max(0, math.ceil((due - time.monotonic()) * 1000)))
                events = dict(poller.poll(timeout=timeout))
                stats["io_turns"] += 1
                now = time.monotonic()
                self._expire(now)
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                # After reading wake-ups, before running commands: a command queued from here on either is run
                # below or sends a new wake-up (its submitter sees the flag clear).
                self._wake_pending = False
                self._drain_commands()
                if self._sender.parked:
                    self._sender.flush_parked()
                if gate is not None and any(s in events for s in gate.sockets):
                    gate.answer(now, MESSAGES_PER_TURN)
                if self._router in events:
                    self._drain_router()
                for peer in list(receiver.peers.values()):
                    if peer.monitor in events:
                        receiver.drain_monitor(peer)
                    if peer.sock in events and peer.state != "dead":
                        receiver.drain_peer(peer)
                if self._polled:
                    for path in self._polled:
                        self._sender.writes_failed(path, path.progress())
                        receiver.landed(path, path.landed())
                    self._sender.recheck_draining()
                self._channel.poll(now)
                receiver.heartbeats(now)
                while receiver.graveyard:
                    peer = receiver.graveyard.pop()
                    with contextlib.suppress(zmq.ZMQError):
                        peer.sock.disable_monitor()
                    for s in (peer.sock, peer.monitor):
                        if id(s) in registered:
                            poller.unregister(s)
                            registered.discard(id(s))
                        s.close(linger=peer.farewell_ms if s is peer.sock else 0)
        except Exception:  # a bug here must not leave vLLM waiting forever
            logger.exception(
                "transfer engine %s I/O thread crashed: failing every pending load (they recompute) and freeing "
                "every held send; new transfers on this worker recompute. Please report this with the log above.",
                self.engine_id,
            )
            self._crashed = True
            self._fail_everything()
        finally:
            for peer in [*receiver.peers.values(), *receiver.graveyard]:
                unwatch(peer.sock, peer.monitor)
                peer.sock.close(linger=0)
            self._router.close(linger=0)
            self._wake_pull.close(linger=0)
            if gate is not None:
                gate.close()
            for path in self._paths:
                path.close()

    def _expire(self, now: float) -> None:
        self._receiver.expire(now)
        self._sender.expire(now)

    def _drain_commands(self) -> None:
        """Run the queued commands, then send what they offered once the offer window is over (every
        ``_OFFERS_PER_FLUSH`` commands too, so a producer that keeps the queue full cannot hold offers back).
        Offers are handed to the sender as runs: per send, its consecutive layers offering one list (a step's
        sends offer layer by layer in turn, A0 B0 A1 B1 ...), each run one call; any other command hands the open
        runs over first, so commands still reach the sender in the order they were queued, per send."""
        ran = 0
        runs: dict[str, _Run] = {}  # per send, its run of offers not yet handed over
        get = self._cmds.get_nowait
        while True:
            try:
                fn, _ = get()
            except queue.Empty:
                if runs:
                    self._offer_runs(runs)
                if not self._sender.offered:
                    due = self._offers_due
                    if (
                        due is not None and time.monotonic() >= due
                    ):  # an armed wake-up nothing rode on: lapsed
                        self._offers_due = self._gathering_since = None
                        if not self._cmds.empty():  # an offer came while it looked armed: it sent no wake-up
                            continue
                    # else the timer armed for the next offers stays: an unrelated command does not cancel it
                    if self._rearm:
                        self._arm_offers()
                    return
                if not self._offers_are_due():
                    return
                self._flush_offers()
                if self._cmds.empty():  # else an offer came while the window looked open: it sent no wake-up
                    if self._rearm:
                        self._arm_offers()
                    return
                continue
            ran += 1
            if isinstance(fn, _Offer):
                with self._offer_lock:  # from here on the worker queues a new record for the send
                    fn.taken = True
                    count, times, last = fn.count, fn.times, fn.last
                    if self._open_offers.get(fn.transfer_id) is fn:
                        del self._open_offers[fn.transfer_id]
                r = runs.get(fn.transfer_id)
                if (
                    r is not None
                    and fn.blocks is r.blocks
                    and fn.layer == r.first + r.count
                    and fn.request_id == r.request_id
                ):
                    r.count += count
                    r.times.extend(times)
                else:
                    if r is not None:
                        self._offer_run(r)
                    runs[fn.transfer_id] = _Run(fn, count, times)
                if last or ran % _OFFERS_PER_FLUSH == 0:  # the step's last layer: what gathered goes now
                    self._offer_runs(runs)
                    self._flush_offers()
                continue
            if runs:
                self._offer_runs(runs)
            if ran % _OFFERS_PER_FLUSH == 0:
                self._flush_offers()
            self._run_command(fn)

    def _offer_runs(self, runs: dict[str, _Run]) -> None:
        for r in runs.values():
            self._offer_run(r)
        runs.clear()

    def _offer_run(self, run: _Run) -> None:
        """Hand a run of offers (consecutive layers, all of one list) to the sender."""
        try:
            self._sender.offer_layers(
                run.transfer_id, run.first, run.count, run.blocks, run.times, run.request_id
            )
        except Exception:  # as ``_run_command``: a bad offer fails only its own transfer
            logger.exception("transfer engine %s: an offer failed; the engine keeps serving", self.engine_id)

    def _arm_offers(self) -> None:
        """After a flush that sent offers, while small offers are held (``offer_hold_bytes``), wake by the timer
        when the next ones would be due, as if they had begun gathering then: a forward pass's next layers then ride
        on that wake-up (or on the worker's own wake-up at the hold bytes or the last layer) instead of waking this
        thread with the first of them. Never later than the first offer's own hold would send them; nothing offered
        by then costs one idle turn, and nothing is armed again. Without a hold, offers go a window at a time and
        the first of each window still wakes this thread (a timer per window would split them finer)."""
        self._rearm = False
        if self._offer_batch_s <= 0 or not self._offer_hold_bytes:
            return
        sent = self._offers_sent_at
        self._gathering_since = sent
        self._offers_due = sent + max(self._offer_batch_s, self._small_offers_hold_s())

    def _offers_are_due(self) -> bool:
        """Whether offered layers go now: no window (``offer_batch_ms`` 0), a message's worth of bytes, or a
        window since the last send is over; else they gather until then. Offers that come slower than the window
        each go at once; faster ones go a window's worth at a time. Offers under ``offer_hold_bytes`` in all wait
        (up to the small-offer hold from when they began gathering), after a quiet spell too: the step's last layer or
        the forward pass's end sends them, or the worker thread wakes this one once they pass the floor."""
        gathered = self._sender.offered_bytes
        if self._offer_batch_s <= 0 or gathered >= COALESCE_MAX_BYTES:
            return True
        now = time.monotonic()
        if self._gathering_since is None:
            self._gathering_since = now
        if gathered < self._offer_hold_bytes:
            due = self._gathering_since + max(self._offer_batch_s, self._small_offers_hold_s())
        else:
            due = self._offers_sent_at + self._offer_batch_s
        if now >= due:
            return True
        self._offers_due = due
        return False

    def _small_offers_hold_s(self) -> float:
        hold = _SMALL_OFFERS_HOLD_S
        return max(hold, _SMALL_OFFERS_HOLD_MARKED_S) if self._marks_forward_ends else hold

    def _flush_offers(self) -> None:
        self._offers_due = None
        self._gathering_since = None
        if self._sender.offered:
            self._offers_sent_at = time.monotonic()
            self._rearm = True
            self._run_command(self._sender.flush_offered)

    def _run_command(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # one bad command (e.g. an unusable peer address) fails only its own transfer
            logger.exception("transfer engine %s: a command failed; the engine keeps serving", self.engine_id)

    def _drain_router(self) -> None:
        """Handle at most ``MESSAGES_PER_TURN`` messages from decodes and proxies: what is left waits for the next
        turn, so a flood delays the side channel but not the loop's deadlines, commands and data paths."""
        for _ in range(MESSAGES_PER_TURN):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0].bytes, [f.buffer for f in frames[1:]]
            self._sender.peer_frame = frames[-1]
            try:
                msg, _ = decode(body)
            except WireError as exc:
                self.stats["messages_rejected"] += 1
                if self._sender.turn_away(identity, Refuse(reason=f"malformed message: {exc}")):
                    logger.warning(
                        "side channel: rejected a malformed message from %s: %s", self._sender.peer, exc
                    )
                continue
            try:
                self._sender.on_message(identity, msg)
            except Exception:  # one bad message must never take the side channel down
                self.stats["messages_rejected"] += 1
                logger.exception(
                    "side channel: error handling %s from %s; dropped it",
                    type(msg).__name__,
                    self._sender.peer,
                )

    def _fail_everything(self) -> None:
        """After an I/O-thread crash: report every load failed and every held send finished, so vLLM frees."""
        with contextlib.suppress(Exception):
            self.store.sync()
        self._receiver.fail_all()
        self._sender.fail_all()
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
