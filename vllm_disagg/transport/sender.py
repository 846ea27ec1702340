"""Prefill (P) side of the transfer engine: the handshake with decodes, and one state machine per transfer.

Decodes dial P's ROUTER, say Hello (versioned, optionally authenticated, KV geometry compared field by field, data
paths offered) and Register a transfer with the blocks they still need. As the forward pass produces each layer,
the connector offers that layer's completed blocks; they go to the registered decode at once over the data path
chosen in the handshake. Blocks are held until decode says Done, the transfer is aborted, or the lease runs out;
they are freed only once no data path reads them any more.

A transfer has two explicit states (``_Outgoing``): ``local``, the life of the prefill request here, and
``state``, the life of the transfer. Everything runs on the engine's I/O thread.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import zmq

from vllm_disagg import __version__
from vllm_disagg.transport.block_store import staging_owner
from vllm_disagg.transport.datapath import DataPath, WriteDeferred, WriteFailed
from vllm_disagg.transport.parts import EngineParts, EngineSide
from vllm_disagg.transport.records import SendOutcome, SendRecord
from vllm_disagg.wire import (
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
    Posted,
    Refuse,
    Register,
    Release,
    check_hello_auth,
    hello_ack_auth,
    pack_indices,
)

logger = logging.getLogger("vllm_disagg.transfer")

_AUTH_SKEW_S = 300.0
# Refusals one connection without a handshake is sent; it is silently ignored after (a real decode that is refused
# closes its connection at the first).
REFUSALS_PER_PEER = 16
_MAX_AUTHED = 4096  # remembered decode connections; the oldest are forgotten (they say Hello again)
_MAX_QUEUED_HEARTBEAT = 65536  # transfer ids read from one heartbeat (each list)
_MAX_HEARTBEAT_ABORTS = 1024  # Aborts one heartbeat may draw (ids prefill cannot serve)
# The most block bytes one multi-layer write carries: coalescing pays where a message's fixed cost (Python on both
# sides, zmq) is large against its bytes; bigger messages would only delay decode's first write (it writes a message
# once all of it arrived) and hold more of the gather ring at once.
COALESCE_MAX_BYTES = 1 << 20
_OFFER_ARRAYS_KEPT = 256  # offered lists remembered (``Sender._offer_array``): more than one step's sends

# The local prefill request: not begun here yet (decode registered first) | computing | finished (blocks held).
LocalState = Literal["unseen", "running", "finished"]
# The transfer: blocks are sent as offered | nothing more is sent (see release_reason) | blocks freed and reported.
SendState = Literal["open", "released", "reported"]


@dataclass
class _Outgoing:
    transfer_id: str
    request_id: str = ""
    local: LocalState = "unseen"
    state: SendState = "open"
    outcome: SendOutcome = SendOutcome.LOADED  # meaningful once released
    release_reason: str = ""
    prompt_len: int = 0
    prompt_hash: str = ""
    # layer -> offers not yet sent, each an int64 array of (logical index, local block id) rows: a flush touches
    # only these (numpy, so a layer costs a few calls however many blocks it has)
    pending: dict[int, list[np.ndarray]] = field(default_factory=dict)
    # [layer, logical index below dest's end] -> sent; allocated on the first flush to a registered decode, so a
    # write of several layers marks them with one numpy call
    sent: np.ndarray | None = None
    # per layer, one past the highest logical index sent: offers wholly at or above it need no look at the mask (a
    # prompt's chunks offer rising indices)
    sent_end: np.ndarray | None = None
    dest: Register | None = None
    dest_arr: np.ndarray | None = None  # dest.dest_blocks as an array (index - first_block -> decode's block)
    dest_identity: bytes | None = None
    path: DataPath | None = None  # the data path of the decode that registered
    lease_deadline: float = 0.0
    # asked for by someone holding the shared secret (or there is none); a decode's Register or Heartbeat claims it
    vouched: bool = True
    claimed: bool = False
    bytes_sent: int = 0
    writes_deferred: int = 0  # writes the data path had no room for yet (retried)
    unannounced: int = 0  # writes of a polled data path not yet announced to decode (``Posted``)
    announced: bool = False  # this flush's first such write was announced at once
    t_begin: float = 0.0
    t_first_send: float = 0.0
    t_last_send: float = 0.0
    t_forward_end: float = 0.0
    layer_offer_times: list[float] = field(default_factory=list)
    ack_identity: bytes | None = None  # remote writes: tell this decode once no more writes can land
    extra_requests: set[str] = field(default_factory=set)  # other local requests that named this transfer id
    quiet: list[threading.Event] = field(default_factory=list)  # set once nothing reads the blocks any more
    preemptions: int = 0  # times the prefill request was preempted mid-send (and resumed)

    @property
    def owner(self) -> str:
        return staging_owner(self.transfer_id, self.request_id)


@dataclass
class _Decode:
    """A decode connection that completed the handshake."""

    engine_id: str
    path: DataPath


def _trim_oldest(remembered: dict[bytes, Any]) -> None:
    """Keep the ``_MAX_AUTHED`` most recently inserted peers."""
    while len(remembered) > _MAX_AUTHED:
        del remembered[next(iter(remembered))]


def _malformed_register(reg: Register, cache_blocks: int) -> str:
    """What makes a Register unusable, or "": a prompt's blocks fit in the cache that holds them."""
    if reg.first_block < 0 or reg.num_blocks < 0:
        return f"negative block range (first_block {reg.first_block}, num_blocks {reg.num_blocks})"
    if reg.first_block + reg.num_blocks > cache_blocks:
        return f"blocks up to {reg.first_block + reg.num_blocks}, more than this cache's {cache_blocks}"
    if reg.dest_blocks and len(reg.dest_blocks) != reg.num_blocks:
        return f"{len(reg.dest_blocks)} destination blocks for {reg.num_blocks} blocks"
    return ""


def _prompt_mismatch(reg: Register, prompt_len: int, prompt_hash: str) -> str:
    """Why decode's registration is not for this prompt (empty when it is): a wrong pairing must never load."""
    if reg.prompt_len != prompt_len:
        return f"prompt length differs: decode {reg.prompt_len}, prefill {prompt_len}"
    if reg.prompt_hash and prompt_hash and reg.prompt_hash != prompt_hash:
        return "prompt tokens differ between decode and prefill (same length, different hash)"
    return ""


def _unsent(
    parts: list[np.ndarray], lo: int, hi: int, sent: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(logical indices, local block ids) among the offers ``parts`` inside decode's ``[lo, hi)`` and not
    ``sent`` yet, by ascending index; an index offered twice keeps its latest block id."""
    rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
    idx, src = rows[:, 0], rows[:, 1]
    inside = (idx >= lo) & (idx < hi)
    if not inside.all():
        idx, src = idx[inside], src[inside]
    if len(idx) > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        # unordered or repeated: the last offer of an index wins (np.unique keeps the first of the reversed rows)
        idx, first = np.unique(idx[::-1], return_index=True)
        src = src[::-1][first]
    if sent is not None:
        new = ~sent[idx]
        if not new.all():
            idx, src = idx[new], src[new]
    return idx, src


class _Batch(NamedTuple):
    """One layer's blocks to send: logical indices (ascending), the same as a slice when they are one run (the
    sent mask is then read and set through a view), packed for the header, local and decode's block ids."""

    idx: np.ndarray
    sel: np.ndarray | slice
    packed: bytes
    src: list[int]
    dst: list[int] | None
    first: int  # the lowest and one past the highest index
    end: int


def _same_offers(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Two layers' pending offers are the same arrays (a step's layers offer one)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _extend(segments: list[list[Any]], layer: int, count: int, batch: _Batch) -> None:
    """Append ``count`` layers from ``layer`` on sending ``batch`` to ``segments`` ([first, count, batch]),
    joining the last one where it sends the same batch and ends at ``layer``."""
    if segments:
        last = segments[-1]
        if last[2] is batch and last[0] + last[1] == layer:
            last[1] += count
            return
    segments.append([layer, count, batch])


def _pieces(batch: _Batch, most: int) -> Iterator[_Batch]:
    """``batch`` as consecutive batches of at most ``most`` blocks each."""
    for a in range(0, len(batch.src), most):
        idx = batch.idx[a : a + most]
        first, end = int(idx[0]), int(idx[-1]) + 1
        yield _Batch(
            idx,
            slice(first, end) if end - first == len(idx) else idx,
            pack_indices(idx),
            batch.src[a : a + most],
            batch.dst[a : a + most] if batch.dst is not None else None,
            first,
            end,
        )


class Sender(EngineSide):
    """Prefill's side: messages from decodes arrive through ``on_message``, commands from the connector through
    the public methods; sends go through the side channel (control) and the decode's data path (blocks)."""

    def __init__(self, parts: EngineParts) -> None:
        super().__init__(parts)
        self.outgoing: dict[str, _Outgoing] = {}
        # transfer id -> (expiry, reason, the outcome a send begun under it ends with)
        self.tombstones: dict[str, tuple[float, str, SendOutcome]] = {}
        # a frame of the message being handled: its peer's address is looked up only when a log names it
        self.peer_frame: zmq.Frame | None = None
        # released transfers waiting for data paths to let go of blocks
        self.draining: dict[str, _Outgoing] = {}
        # open transfers whose request was preempted, until no data path reads its freed blocks (``suspend``)
        self.suspended: dict[str, _Outgoing] = {}
        # ROUTER identity -> handshake, the most recently heard last (bounded: see _forget_quietest)
        self.decodes: dict[bytes, _Decode] = {}
        # Decodes that proved the secret but were refused (another geometry, no common data path): they may still
        # say they will not load (Done, not ok), so their transfers are freed now rather than at the lease's end.
        self.refused: dict[bytes, str] = {}
        # Refusals sent to each peer without a handshake (see ``turn_away``).
        self.unwelcome: dict[bytes, int] = {}
        self._nonces: dict[str, float] = {}  # Hello/Describe nonces seen within the skew window -> expiry
        # Transfers with a layer whose device copies had not run when it was to be sent: flushed again each turn
        # of the I/O loop (``flush_parked``) instead of blocking the loop on the device.
        self.parked: dict[str, _Outgoing] = {}
        self.offered: dict[str, _Outgoing] = {}  # transfers with offers not yet flushed (``flush_offered``)
        # Block bytes offered since the last flush: the engine sends early once they make a message's worth.
        self.offered_bytes = 0
        # Offered lists and their arrays, by the list's id (the list is held, so its id is not reused): the connector
        # offers one list object to every layer of a step for each send, the sends of a step layer by layer in turn,
        # so each list is converted once per step, and a send's layers share one array (one batch, written together).
        self._offer_arrays: dict[int, tuple[list[tuple[int, int]], np.ndarray]] = {}
        # The last (offer arrays, transfer, batch) computed by _base: reused by the step's other layers.
        self._last_batch: tuple[tuple[np.ndarray, ...], _Outgoing, _Batch] | None = None
        # A store that stages a copy per offer (device memory) is told when the sender is done with each layer's
        # offers, so it frees their copies once the writes that carried them stop reading (``_consume``).
        self._stages_copies = self.store.staging == "device"

    # ----------------------------------------------------------------- commands from the worker thread

    def _out(self, transfer_id: str) -> _Outgoing:
        """The transfer's state, created on first mention (decode may register before prefill begins)."""
        out = self.outgoing.get(transfer_id)
        if out is None:
            out = self.outgoing[transfer_id] = _Outgoing(transfer_id=transfer_id, t_begin=time.monotonic())
        return out

    def begin(
        self, transfer_id: str, request_id: str, prompt_len: int, prompt_hash: str, vouched: bool = True
    ) -> None:
        out = self._out(transfer_id)
        if out.local != "unseen" and out.request_id != request_id:
            # n > 1 children or a resend share the id: only the first request's blocks are sent; the others are
            # never held (finish reports them at once).
            logger.warning(
                "transfer %s: request %s reuses the id of request %s; only the first is sent",
                transfer_id,
                request_id,
                out.request_id,
            )
            out.extra_requests.add(request_id)
            return
        out.request_id, out.prompt_len, out.prompt_hash = request_id, prompt_len, prompt_hash
        out.vouched = vouched
        if out.local == "unseen":
            out.local = "running"
        out.lease_deadline = time.monotonic() + self._lease_s(out)
        if transfer_id in self.tombstones:
            # Decode (or the proxy) already gave up on this transfer: free right after the prefill.
            _, reason, outcome = self.tombstones[transfer_id]
            if outcome is SendOutcome.ABANDONED:
                self.stats["sends_abandoned"] += 1
                self._release(out, outcome, "before prefill started, " + reason)
            else:
                self._release(out, outcome, "decode gave up before prefill started: " + reason)
            return
        if out.dest is not None:
            mismatch = _prompt_mismatch(out.dest, prompt_len, prompt_hash)
            if mismatch:
                self._abort_out(out, SendOutcome.MISMATCH, mismatch)

    def offer(
        self, transfer_id: str, layer: int, blocks: list[tuple[int, int]], now: float, request_id: str
    ) -> None:
        self.offer_layers(transfer_id, layer, 1, blocks, [now], request_id)

    def offer_layers(
        self,
        transfer_id: str,
        first: int,
        count: int,
        blocks: list[tuple[int, int]],
        times: list[float],
        request_id: str,
    ) -> None:
        """``offer`` of ``count`` consecutive layers from ``first`` on, all offering ``blocks`` (offered at
        ``times``): the offers of a step's layers that queued up together, handed over at once."""
        out = self.outgoing.get(transfer_id)
        if out is None or out.state != "open" or (request_id and request_id != out.request_id):
            return
        arr = self._offer_array(blocks)
        pending = out.pending
        for layer in range(first, first + count):
            offers = pending.get(layer)
            if offers is None:
                pending[layer] = [arr]
            else:
                offers.append(arr)
        out.layer_offer_times.extend(times)
        self.offered[transfer_id] = out
        self.offered_bytes += count * len(blocks) * self.store.block_bytes

    def flush_offered(self) -> None:
        """Send what was offered since the last call. The engine calls this once offers have gathered for its offer
        window, a forward pass ended, or a message's worth of bytes is waiting, so layers offered together leave
        as one message where the data path takes several layers at once."""
        self.offered_bytes = 0
        while self.offered:
            self._flush_guarded(self.offered.pop(next(iter(self.offered))))

    def _flush_guarded(self, out: _Outgoing) -> None:
        """``_flush``; a transfer whose flush raises is aborted (decode recomputes) and the others go on."""
        try:
            self._flush(out)
        except Exception:
            logger.exception(
                "transfer %s (request %s): sending failed; aborting it (decode recomputes)",
                out.transfer_id,
                out.request_id,
            )
            self.parked.pop(out.transfer_id, None)
            self._abort_out(out, SendOutcome.WRITE_FAILED, "prefill failed to send (see its log)")

    def _offer_array(self, blocks: list[tuple[int, int]]) -> np.ndarray:
        """``blocks`` as an int64 array of rows (logical index, block id), converted once per list object."""
        known = self._offer_arrays.get(id(blocks))
        if known is not None and known[0] is blocks:
            return known[1]
        arr = np.array(blocks, dtype=np.int64).reshape(-1, 2)
        if len(self._offer_arrays) >= _OFFER_ARRAYS_KEPT:
            del self._offer_arrays[next(iter(self._offer_arrays))]  # the oldest: a step long gone
        self._offer_arrays[id(blocks)] = (blocks, arr)
        return arr

    def forward_end(self, transfer_ids: list[str], now: float) -> None:
        for tid in transfer_ids:
            out = self.outgoing.get(tid)
            if out is not None:
                out.t_forward_end = now

    def finish(self, transfer_id: str, aborted: bool, request_id: str) -> None:
        out = self.outgoing.get(transfer_id) or self.draining.get(transfer_id)
        if out is not None and request_id and request_id in out.extra_requests:
            out.extra_requests.discard(request_id)
            self.store.release(staging_owner(transfer_id, request_id))
            self.reports.sent(request_id)
            return
        if out is None or (request_id and out.request_id != request_id):
            self.store.release(staging_owner(transfer_id, request_id))
            self.reports.sent(request_id)  # nothing of this request is held here
            return
        if out.local == "running":
            out.local = "finished"
        if aborted:
            self._abort_out(out, SendOutcome.ABORTED, "request aborted on prefill")
            return
        out.lease_deadline = time.monotonic() + self._lease_s(out)
        self._maybe_report(out)

    def _lease_s(self, out: _Outgoing) -> float:
        """How long the blocks are held without word from decode: a hold nobody with the secret asked for (a client
        calling this instance directly can ask) only briefly, until a decode that proved the secret claims it."""
        if out.vouched or out.claimed:
            return self.settings.lease_s
        return min(self.settings.lease_s, self.settings.unvouched_lease_s)

    def suspend(self, transfer_id: str, request_id: str, quiet: threading.Event) -> None:
        """vLLM preempted the request and freed its blocks: drop its offers not yet sent (they name those blocks)
        and set ``quiet`` once no data path reads them. The transfer stays open: what reached decode is still that
        prompt's KV, and the resumed request offers the rest from its new blocks (the sent masks skip what went)."""
        out = self.outgoing.get(transfer_id)
        if out is None or out.request_id != request_id:
            quiet.set()  # this request never sent from its blocks
            return
        out.quiet.append(quiet)  # set once nothing reads the blocks any more
        if out.state != "open":
            self.draining.setdefault(transfer_id, out)
            self._maybe_report(out)
            return
        out.pending.clear()
        self.offered.pop(transfer_id, None)
        self.parked.pop(transfer_id, None)
        self._last_batch = None
        out.preemptions += 1
        self.suspended[transfer_id] = out
        self._settle_suspended(out)

    def _settle_suspended(self, out: _Outgoing) -> None:
        """Once no data path reads a suspended send's freed blocks: drop its staged copies and wake the forward
        pass waiting to reuse them."""
        if out.state == "open" and not self._quiet(out):
            return
        self.suspended.pop(out.transfer_id, None)
        if out.state != "open":  # released meanwhile: its own ending sets the events
            self.draining.setdefault(out.transfer_id, out)
            self._maybe_report(out)
            return
        self.store.release(out.owner)
        for ev in out.quiet:
            ev.set()
        out.quiet = []

    def abort_suspended(self, transfer_id: str, request_id: str) -> None:
        """A suspended send whose data path did not let go in time: decode recomputes (what it holds may have been
        read from overwritten blocks)."""
        out = self.outgoing.get(transfer_id)
        if out is not None and out.request_id == request_id:
            self.suspended.pop(transfer_id, None)
            self._abort_out(
                out, SendOutcome.PREEMPTED, "prefill request was preempted and its blocks reused mid-send"
            )

    def abort_unstarted(self, transfer_id: str) -> None:
        out = self.outgoing.get(transfer_id)
        if out is None:
            self._tombstone(transfer_id, "prefill request ended before it started")
        elif out.local == "unseen":
            self._abort_out(out, SendOutcome.ABORTED, "prefill request ended before it started")

    # ----------------------------------------------------------------- sending

    def _flush(self, out: _Outgoing) -> None:
        """``_flush_layers``, telling decode of the writes of a polled data path it starts: their notices wake
        nothing there, so decode polls for them quickly only while it knows some are on their way. The first write
        of a flush is announced at once (decode's polling also progresses the transfer on its side, and a flush of
        many layers can take a while to post), the rest together at the end."""
        out.announced = False
        self._flush_layers(out)
        self._announce(out)

    def _announce(self, out: _Outgoing) -> None:
        if out.unannounced and out.dest_identity is not None:
            self.channel.reply(out.dest_identity, Posted(transfer_id=out.transfer_id, writes=out.unannounced))
        out.unannounced = 0

    def _flush_layers(self, out: _Outgoing) -> None:
        """Send the offered, not yet sent blocks that the registered decode needs, layer by layer in order. Work is
        proportional to the runs of layers offered since the last flush, not to the prompt or its layers: the
        blocks are handled in numpy, and consecutive layers offering the same arrays (a step's layers) are looked at
        together, their batch computed once and their sent masks read and set with one numpy call each. Such layers
        go as one write where the data path takes several. A write the path defers (no room yet) parks the
        transfer with that write's layers and the later ones still pending."""
        reg, identity, path = out.dest, out.dest_identity, out.path
        if reg is None or identity is None or path is None or out.state != "open" or not out.pending:
            return
        if path.blocked(out.transfer_id):  # retried while parked: nothing to build until the path has room
            self.stats["writes_deferred"] += 1
            self.parked[out.transfer_id] = out
            return
        lo, hi = reg.first_block, reg.first_block + reg.num_blocks
        pending = out.pending
        layers = sorted(pending)
        sent, sent_end = out.sent, out.sent_end
        if sent is None or sent_end is None or layers[-1] >= len(sent):
            rows = max(self.store.num_layers, layers[-1] + 1)
            grown = np.zeros((rows, hi), dtype=bool)
            grown_end = np.zeros(rows, dtype=np.int64)
            if sent is not None and sent_end is not None:
                grown[: len(sent)], grown_end[: len(sent_end)] = sent, sent_end
            sent, sent_end = out.sent, out.sent_end = grown, grown_end
        owner, staged, block_bytes = out.owner, self.store.staged, self.store.block_bytes
        multi = path.multi_layer_writes
        # (first layer, layer count, batch): consecutive layers that send the same blocks, in layer order
        segments: list[list[Any]] = []
        i, n = 0, len(layers)
        while i < n:
            layer = layers[i]
            parts = pending[layer]
            if not staged(owner, layer):  # device copies still running: try again next turn
                self.parked[out.transfer_id] = out
                i += 1
                continue
            j = i + 1
            if multi:
                only = parts[0] if len(parts) == 1 else None  # a step's layers each hold one offer, the same
                while j < n and layers[j] == layer + j - i:
                    other = pending[layers[j]]
                    if only is not None:
                        if len(other) != 1 or other[0] is not only:
                            break
                    elif not _same_offers(other, parts):
                        break
                    if not staged(owner, layers[j]):
                        break
                    j += 1
            end = layer + j - i
            base = self._base(out, parts, lo, hi)
            if base is None:  # outside what decode registered
                for gone in range(layer, end):
                    self._consume(out, gone, [])
            elif int(sent_end[layer:end].max()) <= base.first:  # none of these layers sent any of it yet
                _extend(segments, layer, end - layer, base)
            else:
                for one in range(layer, end):
                    batch = self._batch(out, parts, lo, hi, sent[one], int(sent_end[one]))
                    if batch is None:
                        self._consume(out, one, [])
                    else:
                        _extend(segments, one, 1, batch)
            i = j
        cap = path.max_write_bytes // block_bytes if path.max_write_bytes else 0
        for first, count, batch in segments:
            if cap and len(batch.src) > cap:
                # A layer bigger than one write goes in pieces, each a message of its own, so the path can let
                # other transfers' writes in between (a long prompt's chunk does not hold the socket for its
                # whole send); a piece the path defers leaves the layer pending with the rest unsent.
                for layer in range(first, first + count):
                    probes: list[Any] = []
                    for piece in _pieces(batch, cap):
                        if self._write(out, identity, path, layer, 1, piece, probes) != "sent":
                            return
                    self._consume(out, layer, probes)
                continue
            most = max(1, path.multi_layer_max_bytes // max(1, len(batch.src) * block_bytes)) if multi else 1
            for a in range(first, first + count, most):
                k = min(most, first + count - a)
                written: list[Any] = []
                if self._write(out, identity, path, a, k, batch, written) != "sent":
                    return
                for layer in range(a, a + k):
                    self._consume(out, layer, written)

    def _consume(self, out: _Outgoing, layer: int, probes: list[Any]) -> None:
        """The layer's pending offers are dealt with (sent by the writes ``probes`` track, or not needed): a store
        that staged a copy per offer may free them once those writes stop reading."""
        parts = out.pending.pop(layer)
        if self._stages_copies:
            self.store.consumed(out.owner, layer, len(parts), probes)

    def _write(
        self,
        out: _Outgoing,
        identity: bytes,
        path: DataPath,
        first: int,
        count: int,
        batch: _Batch,
        probes: list[Any],
    ) -> Literal["sent", "deferred", "ended"]:
        """One write of ``batch``'s blocks of the ``count`` layers from ``first`` on: sent (what says when the path
        stops reading the blocks is appended to ``probes``); deferred by the path (the transfer is parked, its
        layers still pending); or the transfer ended on a failure."""
        header = LayerBlocks(
            transfer_id=out.transfer_id,
            layer=first,
            layer_count=count,
            block_indices=batch.packed,
            block_bytes=self.store.block_bytes,
        )
        try:
            read_done = path.write(identity, out.transfer_id, out.owner, first, batch.src, batch.dst, header)
        except WriteDeferred:
            self.stats["writes_deferred"] += 1
            out.writes_deferred += 1
            self.parked[out.transfer_id] = out
            return "deferred"
        except WriteFailed as exc:
            if exc.peer_gone:
                self._release(out, SendOutcome.UNREACHABLE, exc.reason)
            else:
                self._abort_out(out, SendOutcome.WRITE_FAILED, exc.reason)
            return "ended"
        probes.append(read_done)
        if path.polled:
            out.unannounced += 1
            if not out.announced:
                out.announced = True
                self._announce(out)
        now = time.monotonic()
        out.t_first_send = out.t_first_send or now
        out.t_last_send = now
        nbytes = len(batch.src) * count * self.store.block_bytes
        out.bytes_sent += nbytes
        self.stats["bytes_sent"] += nbytes
        assert out.sent is not None and out.sent_end is not None
        out.sent[first : first + count, batch.sel] = True
        ends = out.sent_end[first : first + count]
        np.maximum(ends, batch.end, out=ends)
        return "sent"

    def _base(self, out: _Outgoing, parts: list[np.ndarray], lo: int, hi: int) -> _Batch | None:
        """What to send of these offers before any layer's sent mask is looked at (None: nothing inside decode's
        range). Every layer of a step offers the same array, so it is computed once and reused."""
        last = self._last_batch
        if (
            last is None
            or last[1] is not out
            or len(last[0]) != len(parts)
            or any(map(operator.is_not, last[0], parts))
        ):
            base = self._batch_of(out, parts, lo, hi, None)
            if base is None:
                return None
            last = self._last_batch = (tuple(parts), out, base)  # holds the arrays: their ids are not reused
        return last[2]

    def _batch(
        self, out: _Outgoing, parts: list[np.ndarray], lo: int, hi: int, sent: np.ndarray, sent_end: int
    ) -> _Batch | None:
        """What to send of one layer's offers, or None when nothing is left. Every layer of a step offers the same
        array (and layers whose offers queued up hold the same arrays), so what does not depend on the layer
        (range filter, order, the lists) is computed once (``_base``); per layer only the sent mask is checked,
        and only where this layer sent an index at or above the batch's first (``sent_end``)."""
        base = self._base(out, parts, lo, hi)
        if base is None:
            return None
        if sent_end <= base.first:
            return base
        seen = sent[base.sel]
        if not seen.any():
            return base
        if seen.all():
            return None
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return self._batch_of(out, [rows[np.isin(rows[:, 0], base.idx[~seen])]], lo, hi, sent)

    def _batch_of(
        self, out: _Outgoing, parts: list[np.ndarray], lo: int, hi: int, sent: np.ndarray | None
    ) -> _Batch | None:
        """``_batch`` computed from scratch (``sent`` None: nothing is excluded as sent)."""
        idx, src = _unsent(parts, lo, hi, sent)
        if not len(idx):
            return None
        dst = out.dest_arr[idx - lo].tolist() if out.dest_arr is not None else None
        first, end = int(idx[0]), int(idx[-1]) + 1
        sel: np.ndarray | slice = slice(first, end) if end - first == len(idx) else idx
        return _Batch(idx, sel, pack_indices(idx), src.tolist(), dst, first, end)

    def flush_parked(self) -> None:
        """Send the parked layers whose device copies have run since (the rest stay parked)."""
        parked, self.parked = self.parked, {}
        for out in parked.values():
            self._flush_guarded(out)

    def writes_failed(self, path: DataPath, transfer_ids: set[str]) -> None:
        """``path`` reports writes that failed after they started: decode recomputes."""
        for tid in transfer_ids:
            out = self.outgoing.get(tid)
            if out is not None:
                self._abort_out(out, SendOutcome.WRITE_FAILED, f"{path.name} write failed")

    # ----------------------------------------------------------------- releasing

    def _abort_out(self, out: _Outgoing, outcome: SendOutcome, reason: str) -> None:
        if out.dest_identity is not None:
            self.channel.reply(out.dest_identity, Abort(transfer_id=out.transfer_id, reason=reason))
        self._tombstone(out.transfer_id, reason)
        self._release(out, outcome, reason)

    def _tombstone(
        self, transfer_id: str, reason: str, outcome: SendOutcome = SendOutcome.DECODE_GAVE_UP
    ) -> None:
        """For ``lease_s``, a Register or Heartbeat for this transfer is answered with an Abort naming ``reason``, and
        a send begun under it is released at once with ``outcome``."""
        self.tombstones[transfer_id] = (time.monotonic() + self.settings.lease_s, reason, outcome)

    def _release(self, out: _Outgoing, outcome: SendOutcome, reason: str) -> None:
        if out.state == "open":
            out.state, out.outcome, out.release_reason = "released", outcome, reason
            logger.debug("transfer %s (request %s) released: %s", out.transfer_id, out.request_id, reason)
            if self._stages_copies and out.local == "running":  # its later steps' copies would go unread
                self.store.stop_staging(out.owner)
        self._maybe_report(out)

    def _quiet(self, out: _Outgoing) -> bool:
        """True once no data path reads this transfer's blocks any more."""
        return out.path is None or not out.path.in_flight(out.transfer_id)

    def _maybe_report(self, out: _Outgoing) -> None:
        if (out.quiet or out.ack_identity is not None) and out.state != "open" and self._quiet(out):
            for ev in out.quiet:
                ev.set()
            out.quiet = []
            if out.ack_identity is not None:
                # Remote writes: decode waits for this before it frees (or recomputes into) the blocks we wrote.
                self.channel.reply(out.ack_identity, _writes_stopped(out.transfer_id))
                out.ack_identity = None
        if out.state != "released" or out.local == "running":
            return
        if not self._quiet(out):
            # A data path still reads these blocks (zero-copy): freeing them now could ship another request's bytes.
            self.draining[out.transfer_id] = out
            return
        self.draining.pop(out.transfer_id, None)
        self.store.release(out.owner)
        out.state = "reported"
        self.outgoing.pop(out.transfer_id, None)
        if out.local == "finished":
            self.reports.sent(out.request_id)
            self._record(out)

    def recheck_draining(self) -> None:
        for out in list(self.draining.values()):
            self._maybe_report(out)
        for out in list(self.suspended.values()):
            self._settle_suspended(out)

    def _record(self, out: _Outgoing) -> None:
        if out.bytes_sent:
            self.stats["transfers_sent"] += 1
        logger.debug(
            "sent transfer %s (request %s): %d bytes, %s",
            out.transfer_id,
            out.request_id,
            out.bytes_sent,
            out.release_reason,
        )
        self.reports.record(
            SendRecord(
                transfer_id=out.transfer_id,
                request_id=out.request_id,
                outcome=out.outcome,
                reason=out.release_reason,
                bytes=out.bytes_sent,
                writes_deferred=out.writes_deferred,
                preemptions=out.preemptions,
                t_begin=out.t_begin,
                t_first_send=out.t_first_send,
                t_last_send=out.t_last_send,
                t_forward_end=out.t_forward_end,
                layer_offer_times=out.layer_offer_times,
            )
        )

    def expire(self, now: float) -> None:
        """Leases that ran out free their blocks; tombstones are forgotten after ``lease_s``."""
        for out in list(self.outgoing.values()):
            if out.state == "open" and now > out.lease_deadline and out.local != "running":
                self.stats["leases_expired"] += 1
                logger.warning(
                    "transfer %s (request %s): lease of %g s expired without word from decode; freeing its blocks%s",
                    out.transfer_id,
                    out.request_id or "<not seen on prefill>",
                    self._lease_s(out),
                    ""
                    if out.vouched or out.claimed
                    else " (its do_remote_decode carried no proof from the shared secret: unvouched_lease_s applies "
                    "until a decode claims it; give the router in front the secret)",
                )
                self._abort_out(out, SendOutcome.LEASE_EXPIRED, "lease expired on prefill")
        self.recheck_draining()
        if self._stages_copies:
            self.store.reclaim()
        for tid, (expiry, *_) in list(self.tombstones.items()):
            if now > expiry:
                del self.tombstones[tid]

    def fail_all(self) -> None:
        """After an I/O-thread crash: report every held send finished, so vLLM frees its blocks."""
        for out in [*self.outgoing.values(), *self.draining.values()]:
            if out.local == "finished" and out.state != "reported":
                self.reports.sent(out.request_id)

    # ----------------------------------------------------------------- messages from decodes

    def on_message(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        if isinstance(msg, Describe):
            self._on_describe(identity, msg)
            return
        if isinstance(msg, Release):
            self._on_release(identity, msg)
            return
        decode = self.decodes.pop(identity, None)
        if decode is None:
            if identity in self.refused and isinstance(msg, Done) and not msg.ok:
                self._on_done(identity, msg)
                return
            self.stats["messages_rejected"] += 1
            what = type(msg).__name__
            if self.turn_away(identity, Refuse(reason="handshake required before " + what)):
                logger.warning(
                    "side channel: %s from %s, a peer that has not completed the handshake", what, self.peer
                )
            return
        self.decodes[identity] = decode  # the most recently heard last: eviction takes the quietest
        if isinstance(msg, Register):
            self._on_register(identity, msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(identity, msg)
        elif isinstance(msg, Done):
            self._on_done(identity, msg)
        else:
            self.stats["messages_rejected"] += 1
            self.channel.reply(
                identity, Refuse(reason=f"unexpected {type(msg).__name__} on the prefill side")
            )

    def _proxy_proved(self, identity: bytes, msg: Describe | Release, what: str) -> bool:
        """Whether a proxy's message carries a valid proof of the secret; refused (and logged) when not."""
        reason = self._check_auth(msg)
        if not reason:
            return True
        self.stats["handshakes_refused"] += 1
        if self.turn_away(identity, Refuse(reason=reason, field="shared_secret")):
            logger.warning(
                "side channel: refused %s from %s at %s: %s", what, msg.engine_id, self.peer, reason
            )
        return False

    def _on_describe(self, identity: bytes, msg: Describe) -> None:
        if not self._proxy_proved(identity, msg, "a describe request"):
            return
        self.channel.reply(
            identity,
            Description(
                engine_id=self.engine_id,
                geometry=self.geometry,
                connector_version=__version__,
                data_paths=list(self.paths),
            ),
        )

    def _on_release(self, identity: bytes, msg: Release) -> None:
        """A proxy gave up on this hand-off: free the blocks now unless a decode registered (which ends it itself);
        a transfer not begun yet is freed as soon as its prefill finishes, and a late Register is aborted."""
        if not self._proxy_proved(identity, msg, f"a release of transfer {msg.transfer_id}"):
            return
        out = self.outgoing.get(msg.transfer_id)
        if out is not None and out.dest is not None:
            return
        why = f"the proxy gave up on the hand-off: {msg.reason}"
        if msg.transfer_id not in self.tombstones:
            self._tombstone(msg.transfer_id, why, SendOutcome.ABANDONED)
        if out is None:
            return
        logger.info(
            "transfer %s (request %s): freed before any decode registered: %s",
            out.transfer_id,
            out.request_id,
            why,
        )
        self.stats["sends_abandoned"] += 1
        self._release(out, SendOutcome.ABANDONED, why)

    def _on_register(self, identity: bytes, msg: Register) -> None:
        malformed = _malformed_register(msg, self.store.num_blocks)
        if malformed:
            self.stats["messages_rejected"] += 1
            logger.warning(
                "side channel: malformed Register for transfer %s from %s: %s",
                msg.transfer_id,
                self.peer,
                malformed,
            )
            self.channel.reply(
                identity, Abort(transfer_id=msg.transfer_id, reason=f"malformed Register: {malformed}")
            )
            return
        if msg.transfer_id in self.tombstones:
            self.channel.reply(
                identity, Abort(transfer_id=msg.transfer_id, reason=self.tombstones[msg.transfer_id][1])
            )
            return
        out = self._out(msg.transfer_id)
        if out.state != "open":  # released (preempted, say) after its tombstone was forgotten
            self.channel.reply(identity, Abort(transfer_id=msg.transfer_id, reason=out.release_reason))
            return
        if out.dest is not None:
            if out.dest_identity != identity or out.dest.request_id != msg.request_id:
                reason = "transfer already registered by another load"
                self.channel.reply(identity, Abort(transfer_id=msg.transfer_id, reason=reason))
            return  # the same registration again: already being served
        mismatch = _prompt_mismatch(msg, out.prompt_len, out.prompt_hash) if out.local != "unseen" else ""
        if mismatch:
            self.channel.reply(identity, Abort(transfer_id=msg.transfer_id, reason=mismatch))
            return
        out.dest, out.dest_identity, out.path = msg, identity, self.decodes[identity].path
        if len(msg.dest_blocks) == msg.num_blocks:
            out.dest_arr = np.asarray(msg.dest_blocks, dtype=np.int64)
        out.claimed = True
        out.lease_deadline = time.monotonic() + self.settings.lease_s
        self._flush(out)

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        """Extend the leases of this decode's transfers (and of transfers still queued there, not yet registered by
        anyone); answer each it waits for in vain with an Abort, at most ``_MAX_HEARTBEAT_ABORTS`` a heartbeat (the
        rest are answered by the next ones): one message must not make prefill queue unbounded replies."""
        deadline = time.monotonic() + self.settings.lease_s
        for tid in msg.queued[:_MAX_QUEUED_HEARTBEAT]:
            queued = self.outgoing.get(tid)
            if queued is not None and queued.state == "open" and queued.dest_identity in (None, identity):
                queued.lease_deadline, queued.claimed = deadline, True
        aborts = 0
        for tid in msg.transfer_ids[:_MAX_QUEUED_HEARTBEAT]:
            out = self.outgoing.get(tid)
            if out is not None and out.dest_identity not in (None, identity):
                continue  # another decode's: only it keeps the lease
            if out is not None and out.state == "open":
                out.lease_deadline, out.claimed = deadline, True
                continue
            if aborts >= _MAX_HEARTBEAT_ABORTS:
                continue
            aborts += 1
            if out is not None:  # released: the load will never complete
                self.channel.reply(identity, Abort(transfer_id=tid, reason=out.release_reason))
            elif tid in self.tombstones:
                self.channel.reply(identity, Abort(transfer_id=tid, reason=self.tombstones[tid][1]))
            else:
                self.channel.reply(identity, Abort(transfer_id=tid, reason="unknown transfer on prefill"))

    def _on_done(self, identity: bytes, msg: Done) -> None:
        out = self.outgoing.get(msg.transfer_id)
        known = self.decodes.get(identity)  # None: a refused decode, which never had a data path
        remote_writes = known is not None and known.path.remote_writes
        registered_elsewhere = out is not None and out.dest_identity not in (None, identity)
        if (out is None or registered_elsewhere) and not msg.ok and remote_writes:
            # Nothing was ever written to this decode for this transfer: it may reuse its blocks now.
            self.channel.reply(identity, _writes_stopped(msg.transfer_id))
        if registered_elsewhere:
            return  # only the decode that registered may end a transfer
        if out is None:
            if not msg.ok and msg.transfer_id not in self.tombstones:
                # Decode will not load (aborted while queued, say): free the blocks as soon as prefill has them.
                self._tombstone(msg.transfer_id, f"decode gave up: {msg.reason}")
            return
        if not msg.ok and remote_writes:
            out.ack_identity = identity
            self.draining.setdefault(out.transfer_id, out)  # the ack goes out once writes drained
        if msg.ok:
            self._release(out, SendOutcome.LOADED, "decode loaded all blocks")
        else:
            self._release(out, SendOutcome.DECODE_GAVE_UP, f"decode gave up: {msg.reason}")
        # A retry of a finished transfer id is answered at once instead of waiting for a deadline.
        self._tombstone(
            msg.transfer_id, "transfer already completed" if msg.ok else f"decode gave up: {msg.reason}"
        )

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        logger.debug("side channel: hello from decode engine %s", hello.engine_id)
        refusal = self._refusal(hello)
        path, accepted = (None, b"") if refusal else self._choose_path(identity, hello)
        if path is not None and path.remote_writes and not accepted:
            # decode keeps the offer of a path that writes into its cache back until this side proves the secret:
            # name the path and prove it; decode greets again with the offer (nothing is kept for it until then)
            self._ack(identity, hello, path, b"")
            return
        if path is None:
            if refusal is None:
                offered = ", ".join(o.name for o in hello.data_paths) or "none"
                ours = ", ".join(self.paths)
                reason = f"no data path in common: decode offers {offered}, prefill has {ours}"
                if not self.geometry.same_pages(hello.geometry):
                    reason += (
                        f" (raw-page paths need the same page order: {self.geometry.kv_layout} here, "
                        f"{hello.geometry.kv_layout} on decode; offer tcp on both)"
                    )
                refusal = reason, "data_paths", ours, offered
            reason, fld, ours, theirs = refusal
            self.stats["handshakes_refused"] += 1
            if fld not in ("wire_version", "shared_secret"):
                self.refused[identity] = hello.engine_id
                _trim_oldest(self.refused)
            # Refuse's ours/theirs are the receiver's (decode's) view.
            if self.turn_away(identity, Refuse(reason=reason, field=fld, ours=theirs, theirs=ours)):
                logger.error(
                    "side channel: refused decode engine %s at %s: %s. Fix: run both instances with the same %s.",
                    hello.engine_id,
                    self.peer,
                    reason,
                    fld or "settings",
                )
            return
        previous = self.decodes.pop(identity, None)
        if previous is not None and previous.path is not path:
            previous.path.forget(identity)
        self.unwelcome.pop(identity, None)
        self.decodes[identity] = _Decode(hello.engine_id, path)
        if len(self.decodes) > _MAX_AUTHED:
            self._forget_quietest()
        self._ack(identity, hello, path, accepted)

    def _forget_quietest(self) -> None:
        """Forget the connections heard from longest ago (they greet again if they come back), never one a transfer
        is being sent to."""
        busy = {out.dest_identity for out in self.outgoing.values()}
        for identity in list(self.decodes):
            if len(self.decodes) <= _MAX_AUTHED:
                return
            if identity not in busy:
                self.decodes.pop(identity).path.forget(identity)

    @property
    def peer(self) -> str:
        """The IP address of the peer whose message is being handled, as zmq saw the connection (for logs that must
        name a misbehaving host)."""
        if self.peer_frame is None:
            return "an unknown address"
        try:
            address = str(self.peer_frame.get("Peer-Address"))
        except (zmq.ZMQError, ValueError):
            return "an unknown address"
        return address.removeprefix("::ffff:")  # an IPv4 peer on the dual-stack socket

    def turn_away(self, identity: bytes, refuse: Refuse) -> bool:
        """Send ``refuse``; False when it was not sent. A connection without a handshake hears at most
        ``REFUSALS_PER_PEER`` refusals: one that goes on sending without reading cannot make this side queue replies
        (or log lines) without bound, as the socket's send queue is unbounded for the layers."""
        if identity not in self.decodes:
            told = self.unwelcome.pop(identity, 0)
            self.unwelcome[identity] = told + 1
            _trim_oldest(self.unwelcome)
            if told >= REFUSALS_PER_PEER:
                return False
        self.channel.reply(identity, refuse)
        return True

    def _ack(self, identity: bytes, hello: Hello, path: DataPath, accepted: bytes) -> None:
        """HelloAck: the chosen data path, what decode's ``connect`` needs of it, and this side's proof of the
        secret over decode's nonce."""
        self.channel.reply(
            identity,
            HelloAck(
                engine_id=self.engine_id,
                geometry=self.geometry,
                data_path=path.name,
                data_path_info=accepted,
                auth=hello_ack_auth(self.settings.secret, self.engine_id, hello.nonce),
            ),
        )

    def _refusal(self, hello: Hello) -> tuple[str, str, str, str] | None:
        """(reason, field, prefill's value, decode's value) when this decode may not load from here."""
        if hello.wire_version != WIRE_VERSION:
            return (
                f"wire version differs (prefill speaks {WIRE_VERSION}, decode {hello.wire_version}): "
                "run the same vllm-disagg version on both",
                "wire_version",
                str(WIRE_VERSION),
                str(hello.wire_version),
            )
        reason = self._check_auth(hello)
        if reason:
            return reason, "shared_secret", "", ""
        diff = self.geometry.incompatibility(hello.geometry)
        if diff is not None:
            fld, ours, theirs = diff
            reason = f"incompatible KV layout: {fld} is {ours} here (prefill) but {theirs} on decode"
            return reason, fld, str(ours), str(theirs)
        return None

    def _choose_path(self, identity: bytes, hello: Hello) -> tuple[DataPath | None, bytes]:
        """The first data path decode offers that prefill has and can use, with what decode needs of it. A path that
        writes raw pages into decode's cache (NIXL) is used only where both sides' pages have the same physical
        order."""
        same_pages = self.geometry.same_pages(hello.geometry)
        for offer in hello.data_paths:
            path = self.paths.get(offer.name)
            if path is None or (path.remote_writes and not same_pages):
                continue
            if path.remote_writes and not offer.info:
                return path, b""  # offered by name only, until this side proves the shared secret
            try:
                return path, path.accept(identity, offer.info)
            except Exception as exc:
                logger.warning(
                    "decode %s offered data path %s but accepting it failed (%s); trying the next",
                    hello.engine_id,
                    offer.name,
                    exc,
                )
        return None, b""

    def _check_auth(self, hello: Hello | Describe | Release) -> str:
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


def _writes_stopped(transfer_id: str) -> Abort:
    """The answer to a Done(not ok) on a path that writes into decode's cache: none of this transfer's writes can
    land there any more, so decode may hand the blocks back."""
    return Abort(transfer_id=transfer_id, reason="stopped: no more writes", writes_stopped=True)
