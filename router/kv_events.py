"""vLLM KV-cache events -> PrefixIndex: a tolerant decoder and one ZMQ subscriber thread per instance.

Wire format (vllm/distributed/kv_events.py, ``--kv-events-config``): PUB multipart ``[topic, seq, payload]`` with
``seq`` an 8-byte big-endian counter starting at 0 per publisher process and ``payload`` a msgpack
``KVEventBatch`` = ``[ts, events, dp_rank]``. Events are tagged maps (``{"type": "BlockStored", ...}``) in current
vLLM and positional arrays (``["BlockStored", hashes, parent, ...]``) up to ~0.20; block hashes are ints (low 64
bits) or digest bytes. The decoder accepts all of these and never unpickles anything.

Gaps (pain point: a stale index) are found from ``seq``: a jump means lost batches, a drop back (or a TCP
disconnect followed by an unexpected seq) means the publisher restarted with an empty cache. Lost batches are
replayed from the publisher's ROUTER replay socket when one is configured; otherwise, or if the replay cannot
cover the hole, the instance is cleared, which keeps the index a subset of the engine's cache.

Catch-up: a subscriber that starts against a publisher already running (a restarted proxy, an instance added at
run time) first replays the publisher's buffer from seq 0, so the index knows the instance's cache at once instead
of at the instance's next KV event (an idle instance may publish none for a long time).

Not handled here: data-parallel ranks publish on ``port + rank``, each with its own seq: run one subscriber per
rank endpoint (with its own instance name).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from vllm_disagg.router.prefix_index import BlockHash, PrefixIndex

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end-of-stream marker


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch in any encoding we know."""


# -- decoded events ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class UnknownEvent:
    """An event type newer than this decoder: skipped, not an error (it cannot change token prefixes we index)."""

    tag: str


KVEvent: TypeAlias = "BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent"


@dataclass(frozen=True)
class DecodedBatch:
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


# Positional field order of vLLM's structs (array_like encoding puts the tag first, then these, trailing
# defaults omitted). Also the keys read from the map encoding.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_STORED_REQUIRED = 4
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED = 1


def _fields(
    raw: dict[str, Any] | list[Any], names: tuple[str, ...], required: int, tag: str
) -> dict[str, Any]:
    if isinstance(raw, dict):
        missing = [n for n in names[:required] if n not in raw]
        if missing:
            raise KVEventDecodeError(f"{tag} lacks {', '.join(missing)}")
        return {n: raw.get(n) for n in names}
    values = raw[1:]
    if len(values) < required:
        raise KVEventDecodeError(f"{tag} has {len(values)} positional fields, needs >= {required}")
    return {n: (values[i] if i < len(values) else None) for i, n in enumerate(names)}


def _hashes(v: Any, what: str) -> list[BlockHash]:
    if not isinstance(v, list):
        raise KVEventDecodeError(f"{what}: expected a list of block hashes, got {type(v).__name__}")
    for h in v:
        if not (type(h) is int or type(h) is bytes):
            raise KVEventDecodeError(f"{what}: block hash of type {type(h).__name__}")
    return v


def _opt(v: Any, typ: type, what: str) -> Any:
    if v is not None and (type(v) is not typ):
        raise KVEventDecodeError(f"{what}: expected {typ.__name__} or nil, got {type(v).__name__}")
    return v


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise KVEventDecodeError(f"event is a {type(raw).__name__}, not a tagged map or array")
    if not isinstance(tag, str):
        raise KVEventDecodeError(f"event tag is {tag!r}, not a string")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, _STORED_REQUIRED, tag)
        parent = f["parent_block_hash"]
        if parent is not None and not (type(parent) is int or type(parent) is bytes):
            raise KVEventDecodeError(f"BlockStored.parent_block_hash of type {type(parent).__name__}")
        tokens = f["token_ids"]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise KVEventDecodeError("BlockStored.token_ids: expected a list of ints")
        block_size = f["block_size"]
        if type(block_size) is not int or block_size < 0:
            raise KVEventDecodeError(f"BlockStored.block_size: {block_size!r}")
        if block_size == 0 or not tokens:
            # A placeholder: vLLM's CPU offloading announces its stores by hash alone, in the same batch as the
            # device's events. Nothing to index, and no reason to doubt the rest of the batch.
            return UnknownEvent("BlockStored without tokens")
        extra = f["extra_keys"]
        if extra is not None and not isinstance(extra, list):
            raise KVEventDecodeError("BlockStored.extra_keys: expected a list or nil")
        return BlockStored(
            block_hashes=_hashes(f["block_hashes"], "BlockStored.block_hashes"),
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=block_size,
            lora_id=_opt(f["lora_id"], int, "BlockStored.lora_id"),
            medium=_opt(f["medium"], str, "BlockStored.medium"),
            lora_name=_opt(f["lora_name"], str, "BlockStored.lora_name"),
            extra_keys=extra,
            group_idx=_opt(f["group_idx"], int, "BlockStored.group_idx"),
        )
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, _REMOVED_REQUIRED, tag)
        return BlockRemoved(
            block_hashes=_hashes(f["block_hashes"], "BlockRemoved.block_hashes"),
            medium=_opt(f["medium"], str, "BlockRemoved.medium"),
            group_idx=_opt(f["group_idx"], int, "BlockRemoved.group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag)


def decode_event_batch(payload: bytes) -> DecodedBatch:
    """Decode one ``KVEventBatch`` payload (map or positional encoding); raises ``KVEventDecodeError``."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise KVEventDecodeError(f"not msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, dp = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events = raw[0], raw[1]
        dp = raw[2] if len(raw) == 3 else None
    else:
        raise KVEventDecodeError(f"batch is a {type(raw).__name__}, not [ts, events, dp_rank]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventDecodeError(f"batch ts is {type(ts).__name__}, not a number")
    if not isinstance(events, list):
        raise KVEventDecodeError(f"batch events is {type(events).__name__}, not a list")
    if dp is not None and type(dp) is not int:
        raise KVEventDecodeError(f"batch dp_rank is {type(dp).__name__}, not an int")
    return DecodedBatch(ts=float(ts), events=[_decode_event(e) for e in events], dp_rank=dp)


def apply_batch(index: PrefixIndex, instance: str, batch: DecodedBatch) -> tuple[int, int]:
    """Apply a decoded batch to the index; returns (events applied, unknown events skipped)."""
    applied = skipped = 0
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            index.apply_stored(
                instance,
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
                ev.block_size,
                medium=ev.medium,
                group=ev.group_idx,
                lora=ev.lora_name if ev.lora_name is not None else ev.lora_id,
                extra_keys=ev.extra_keys,
            )
        elif isinstance(ev, BlockRemoved):
            index.apply_removed(instance, ev.block_hashes, medium=ev.medium, group=ev.group_idx)
        elif isinstance(ev, AllBlocksCleared):
            # vLLM's prefix-cache reset: the tiers beneath the engine keep their blocks
            index.clear(instance, device_only=True)
        else:
            skipped += 1
            continue
        applied += 1
    return applied, skipped


# -- sequence tracking (pure) --------------------------------------------------------------------------------

Verdict = Literal["next", "gap", "restart", "duplicate"]


class SeqTracker:
    """Classifies each batch's seq against what came before. Pure: the subscriber does the I/O."""

    def __init__(self) -> None:
        self.last: int | None = None
        # After a replay, live batches the replay already applied arrive again: [lo, hi] are duplicates.
        self._dups: tuple[int, int] | None = None

    @property
    def expected(self) -> int:
        return 0 if self.last is None else self.last + 1

    def classify(self, seq: int) -> Verdict:
        exp = self.expected
        if seq == exp:
            return "next"
        if seq > exp:
            return "gap"
        if self._dups is not None and self._dups[0] <= seq <= self._dups[1]:
            return "duplicate"
        return "restart"

    def advance(self, seq: int) -> None:
        """``seq`` is now applied (or deliberately skipped after a clear)."""
        self.last = seq
        if self._dups is not None and seq > self._dups[1]:
            self._dups = None

    def expect_duplicates(self, lo: int, hi: int) -> None:
        if lo <= hi:
            self._dups = (lo, hi)

    def reset(self) -> None:
        self.last = None
        self._dups = None


# -- subscriber ----------------------------------------------------------------------------------------------


@dataclass
class SubscriberStats:
    batches: int = 0  # batches applied (live and replayed)
    events_applied: int = 0
    events_skipped: int = 0  # unknown event types
    gaps: int = 0
    restarts: int = 0  # publisher restarts detected
    disconnects: int = 0
    replays: int = 0  # replay requests answered with an end marker
    replay_failures: int = 0  # no answer within the timeout (the catch-up's included)
    replayed_batches: int = 0
    clears: int = 0  # index.clear() done to resync (not AllBlocksCleared events)
    duplicates: int = 0
    decode_errors: int = 0
    apply_errors: int = 0
    last_seq: int | None = None


def subscriber_endpoint(vllm_endpoint: str, host: str) -> tuple[str, bool]:
    """Where the subscriber goes for a ``--kv-events-config`` endpoint: ``(address, bind)``.

    vLLM's PUB binds wildcard and ipc/inproc endpoints (``tcp://*:5557``: we connect to ``host``) and *connects*
    to any other (``tcp://10.0.0.5:5557``: we must bind that address). Its replay socket always binds.
    """
    for wildcard in ("*", "[::]", "::"):
        prefix = f"tcp://{wildcard}:"
        if vllm_endpoint.startswith(prefix):
            return f"tcp://{host}:{vllm_endpoint[len(prefix) :]}", False
    if vllm_endpoint.startswith(("ipc://", "inproc://")):
        return vllm_endpoint, False
    return vllm_endpoint, True


class KVEventSubscriber:
    """Feeds one instance's KV events into a PrefixIndex from a background thread.

    ``endpoint``/``bind`` come from ``subscriber_endpoint()`` (vLLM's PUB binds wildcard endpoints and connects to
    concrete ones). Sockets are made in ``start()`` (so a bad endpoint raises there) and then used only by the
    thread (ZMQ sockets are not thread-safe). ``stop()`` returns within about ``poll_interval_s``, having joined
    the thread and closed its sockets.
    """

    def __init__(
        self,
        index: PrefixIndex,
        instance: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        poll_interval_s: float = 0.05,
        bind: bool = False,
        mark_precise: bool = True,
        catch_up: bool = True,
        context: zmq.Context[Any] | None = None,
        blip_s: float = 10.0,
    ) -> None:
        self.index = index
        self.blip_s = blip_s  # see _on_live: a shorter outage with the numbering moved on is the same engine
        self.instance = instance
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.poll_ms = max(1, int(poll_interval_s * 1000))
        self.bind = bind  # True when vLLM's PUB connects to us (see subscriber_endpoint)
        self.mark_precise = mark_precise
        self.catch_up = catch_up  # replay the publisher's buffer from 0 on start (needs replay_endpoint)
        self._ctx = context or zmq.Context.instance()
        self._tracker = SeqTracker()
        self._stats = SubscriberStats()
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._peer_lost = False
        self._lost_at = 0.0  # when the connection to the publisher dropped (monotonic)
        self._caught_up = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("subscriber already started")
        # Sockets are made here so a bad endpoint (port in use) raises to the caller; then only the thread uses them.
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # A publisher whose host died without closing its connection is noticed (and reconnected to) within
        # seconds, not never: zmq pings it (vLLM's PUB answers) and drops a connection that stops answering.
        sub.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        mon = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError:
            self._close(sub, mon)
            raise
        if self.mark_precise:
            self.index.set_precise(self.instance, True)
        self._stop.clear()
        self._caught_up.clear()
        self._reader = threading.Thread(
            target=self._run, args=(sub, mon), name=f"kv-events-{self.instance}", daemon=True
        )
        self._reader.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout_s)
            if self._reader.is_alive():
                log.warning("kv-events subscriber %s did not stop within %.1fs", self.instance, timeout_s)
            self._reader = None

    @property
    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def wait_caught_up(self, timeout_s: float | None = None) -> bool:
        """Block until the start-up catch-up replay is done (answered, timed out, or not configured)."""
        return self._caught_up.wait(timeout_s)

    @property
    def stats(self) -> SubscriberStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def __enter__(self) -> KVEventSubscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- thread --------------------------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)
            self._stats.last_seq = self._tracker.last

    @staticmethod
    def _close(sub: zmq.Socket[Any], mon: zmq.Socket[Any]) -> None:
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        mon.close(linger=0)
        sub.close(linger=0)

    def _run(self, sub: zmq.Socket[Any], mon: zmq.Socket[Any]) -> None:
        try:
            if self.catch_up and self.replay_endpoint is not None:
                self._catch_up()
            self._caught_up.set()
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(self.poll_ms))
                if mon in ready:
                    self._drain_monitor(mon)
                if sub in ready:
                    for _ in range(1000):  # bounded, so stop() stays prompt under load
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(frames)
                        if self._stop.is_set():
                            break
        except Exception:
            log.exception("kv-events subscriber %s crashed", self.instance)
        finally:
            self._caught_up.set()
            self._close(sub, mon)

    def _catch_up(self) -> None:
        """Replay everything the publisher still buffers. The SUB socket is connected first: a batch published
        meanwhile arrives live (skipped as a duplicate if the replay already applied it) or, if ZMQ's subscription
        was not in place yet, shows up as a gap at the next live batch and is replayed then."""
        before = self.stats.replayed_batches
        self._replay(0)
        last = self._tracker.last
        if last is not None:
            self._tracker.expect_duplicates(0, last)
        log.info(
            "kv-events %s: caught up from %s (%d batches replayed, last seq %s)",
            self.instance,
            self.replay_endpoint,
            self.stats.replayed_batches - before,
            last,
        )

    def _drain_monitor(self, mon: zmq.Socket[Any]) -> None:
        while True:
            try:
                msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                # The publisher may have restarted: the next batch decides (see _on_live).
                self._peer_lost = True
                self._lost_at = time.monotonic()
                self._count(disconnects=1)

    def _parse(self, frames: Sequence[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count(decode_errors=1)
            log.warning("kv-events %s: malformed message (%d frames)", self.instance, len(frames))
            return None
        topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big", signed=True)
        if seq != END_SEQ and self.topic and topic != self.topic:
            return None  # SUB filters by prefix; "kv" must not take "kv2"'s batches
        return seq, payload

    def _on_live(self, frames: Sequence[bytes]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, payload = parsed
        if self._peer_lost:
            self._peer_lost = False
            expected, last = self._tracker.expected, self._tracker.last
            # A restarted engine counts from 0 again, after a model load of tens of seconds. Numbering that moved
            # on after a short drop is the same engine's, with batches lost meanwhile: the gap's replay fills them
            # (a clear would lose every block the engine keeps cached, which it never announces again).
            blip = time.monotonic() - self._lost_at < self.blip_s
            if last is not None and seq != expected and (seq < expected or not blip):
                self._restart(seq)
        verdict = self._tracker.classify(seq)
        if verdict == "duplicate":
            self._count(duplicates=1)
            return
        if verdict == "restart":
            self._restart(seq)
            verdict = self._tracker.classify(seq)
        if verdict == "gap":
            self._count(gaps=1)
            log.info("kv-events %s: gap, expected seq %d got %d", self.instance, self._tracker.expected, seq)
            self._resync(seq)
            if self._tracker.expected > seq:
                return  # the replay already applied this batch
        self._apply(seq, payload)

    def _restart(self, seq: int) -> None:
        """A restarted vLLM has an empty cache and a seq counter back at 0."""
        log.info("kv-events %s: publisher restart (seq %d after %s)", self.instance, seq, self._tracker.last)
        self._tracker.reset()
        self.index.clear(self.instance)
        self._count(restarts=1, clears=1)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply batch ``seq`` (the expected one). Lost content (undecodable) clears: we can't know what changed."""
        try:
            batch = decode_event_batch(payload)
        except KVEventDecodeError as e:
            self._tracker.advance(seq)
            self.index.clear(self.instance)
            self._count(decode_errors=1, clears=1)
            log.warning("kv-events %s: seq %d undecodable (%s); cleared the instance", self.instance, seq, e)
            return
        try:
            applied, skipped = apply_batch(self.index, self.instance, batch)
        except Exception:
            self._tracker.advance(seq)
            self.index.clear(self.instance)
            self._count(apply_errors=1, clears=1)
            log.exception("kv-events %s: applying seq %d failed; cleared the instance", self.instance, seq)
            return
        self._tracker.advance(seq)
        self._count(batches=1, events_applied=applied, events_skipped=skipped)

    def _resync(self, trigger: int) -> None:
        """Fill the hole before live batch ``trigger`` by replay; clear the instance where that can't be done."""
        if self.replay_endpoint is not None:
            self._replay(self._tracker.expected)
            if self._tracker.expected > trigger:
                # Live batches (trigger, last] are already applied: skip them when the SUB socket delivers them.
                self._tracker.expect_duplicates(trigger, self._tracker.last or 0)
                return
        if (lost_from := self._tracker.expected) < trigger:
            if (
                self._tracker.last is None
            ):  # joining an instance that published before: nothing known to forget
                self._tracker.advance(trigger - 1)
                log.info(
                    "kv-events %s: following from batch %d; blocks the instance stored before are unknown%s",
                    self.instance,
                    trigger,
                    "" if self.replay_endpoint is not None else " (give the instance replay= to learn them)",
                )
                return
            self.index.clear(self.instance)
            self._tracker.advance(trigger - 1)
            self._count(clears=1)
            log.warning(
                "kv-events %s: batches %d-%d were lost and could not be replayed%s: the proxy forgot this "
                "instance's cache and knows only what is stored from now on",
                self.instance,
                lost_from,
                trigger - 1,
                ""
                if self.replay_endpoint is not None
                else " (no replay endpoint: give the instance replay=)",
            )

    def _replay(self, start: int) -> None:
        """Ask the ROUTER replay socket for batches >= start and apply the contiguous ones."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + self.replay_timeout_s
        got_end = False
        try:
            dealer.connect(self.replay_endpoint)
            try:
                dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)], zmq.NOBLOCK)
            except zmq.Again:
                self._count(replay_failures=1)
                return
            while not self._stop.is_set():
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                if not dealer.poll(min(left_ms, self.poll_ms)):
                    continue
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the DEALER side keeps the ROUTER's empty delimiter
                parsed = self._parse(frames)
                if parsed is None:
                    continue
                seq, payload = parsed
                if seq == END_SEQ:
                    got_end = True
                    break
                verdict = self._tracker.classify(seq)
                if verdict == "gap":
                    # The replay buffer no longer holds the start of the hole: clear what was known (a proxy that
                    # is joining knew nothing), then apply the rest.
                    joining = self._tracker.last is None
                    if not joining:
                        self.index.clear(self.instance)
                        self._count(clears=1)
                    self._tracker.advance(seq - 1)
                    log.warning(
                        "kv-events %s: the publisher's replay buffer starts at batch %d, but %d was needed: the "
                        "proxy knows only the blocks stored from there on, and prefixes the instance still caches "
                        "from before count as misses until they are stored again (a larger buffer_steps in vLLM's "
                        "--kv-events-config keeps more)",
                        self.instance,
                        seq,
                        start,
                    )
                elif verdict != "next":
                    continue
                self._apply(seq, payload)
                self._count(replayed_batches=1)
        finally:
            dealer.close(linger=0)
        if got_end:
            self._count(replays=1)
        else:
            self._count(replay_failures=1)
            log.warning("kv-events %s: replay from %s timed out", self.instance, self.replay_endpoint)
