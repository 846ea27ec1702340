"""KV-event decoding (both vLLM encodings, garbage) and the subscriber against real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import ast
import importlib.util
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from vllm_disagg.router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    KVEventSubscriber,
    SeqTracker,
    UnknownEvent,
    apply_batch,
    decode_event_batch,
    subscriber_endpoint,
)
from vllm_disagg.router.prefix_index import PrefixIndex

BS = 4
TOPIC = "kv"


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def wait_for(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- vLLM's own event structs, without importing vllm (whose import pulls in torch: ~10 s) --------------------


def _vllm_structs() -> dict[str, Any]:
    """Exec the struct definitions of the installed vllm/distributed/kv_events.py, so payloads are byte-for-byte
    what vLLM's publisher sends, and follow the installed version's format."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_events.py"
    wanted = {"EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"}
    tree = ast.parse(path.read_text())
    body: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    ns: dict[str, Any] = {
        "msgspec": msgspec,
        "Any": Any,
        "ExternalBlockHash": bytes | int,
        "__name__": "vllm_ev",
    }
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    except Exception as e:  # a future vLLM restructured the module: the real-import test still covers it
        pytest.skip(f"cannot load vLLM's event structs from {path}: {e}")
    assert wanted <= ns.keys()
    return ns


@pytest.fixture(scope="module")
def vllm_ev() -> dict[str, Any]:
    return _vllm_structs()


def vllm_payload(ev: dict[str, Any], events: list[Any], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode(ev["KVEventBatch"](ts=ts, events=events))


def stored(ev: dict[str, Any], hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
    return ev["BlockStored"](
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **kw,
    )


def removed(ev: dict[str, Any], hashes: list[Any]) -> Any:
    return ev["BlockRemoved"](block_hashes=hashes, medium="GPU")


# -- decoding ------------------------------------------------------------------------------------------------


def test_decode_current_tagged_map_encoding(vllm_ev: dict[str, Any]) -> None:
    payload = vllm_payload(
        vllm_ev,
        [
            stored(vllm_ev, [11, 12], None, toks(8), group_idx=1),
            removed(vllm_ev, [b"\x01" * 32]),
            vllm_ev["AllBlocksCleared"](),
        ],
        ts=123.5,
    )
    batch = decode_event_batch(payload)
    assert batch.ts == 123.5 and batch.dp_rank is None
    s, r, c = batch.events
    assert isinstance(s, BlockStored)
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size) == ([11, 12], None, toks(8), BS)
    assert (s.medium, s.group_idx, s.lora_id) == ("GPU", 1, None)
    assert r == BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU")
    assert c == AllBlocksCleared()


def test_decode_old_positional_encoding() -> None:
    """vLLM <= ~0.20: array_like structs, tag first, trailing defaults omitted, no dp_rank."""
    payload = msgspec.msgpack.encode(
        [
            7.0,
            [
                ["BlockStored", [1, 2], None, toks(8), BS, None],  # before `medium` existed
                ["BlockStored", [3], 2, toks(4, 8), BS, None, "GPU"],
                ["BlockRemoved", [1]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_event_batch(payload)
    assert batch.ts == 7.0 and batch.dp_rank is None
    assert batch.events == [
        BlockStored([1, 2], None, toks(8), BS),
        BlockStored([3], 2, toks(4, 8), BS, medium="GPU"),
        BlockRemoved([1]),
        AllBlocksCleared(),
    ]
    # With a dp rank, and a newer event type we don't know: skipped, not an error.
    batch = decode_event_batch(msgspec.msgpack.encode([1, [["BlockTouched", 5]], 3]))
    assert batch.dp_rank == 3 and batch.events == [UnknownEvent("BlockTouched")]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x80\x04\x95\x10\x00\x00\x00",  # a pickle: must be refused, never unpickled
        msgspec.msgpack.encode(42),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, {}]),
        msgspec.msgpack.encode([1.0, [42]]),
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # no tag
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]]]),  # too few fields
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}]]
        ),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1], 1]]]),  # float hash
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["a"], 1]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], -1]]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", "x"]]]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
    ],
)
def test_decode_rejects_garbage(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_event_batch(payload)


def test_a_placeholder_store_is_skipped_not_the_batch() -> None:
    """vLLM's CPU offloading announces its stores by hash alone (no tokens, block size 0), in the batch that carries
    the device's own events: those are applied, and nothing is cleared."""
    index = PrefixIndex(BS)
    prompt = list(range(2 * BS))
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [11, 12], None, prompt, BS, None, None],
               ["BlockStored", [21, 22], None, [], 0, None, "CPU"]]]
    )  # fmt: skip
    batch = decode_event_batch(payload)
    assert apply_batch(index, "a", batch) == (1, 1)
    assert index.cached_tokens("a", prompt) == 2 * BS


def test_seq_tracker() -> None:
    t = SeqTracker()
    assert t.classify(0) == "next" and t.classify(3) == "gap"
    for s in range(3):
        t.advance(s)
    assert t.classify(3) == "next" and t.classify(5) == "gap" and t.classify(0) == "restart"
    t.advance(9)  # a replay filled 3..9 while live batch 5 waited
    t.expect_duplicates(5, 9)
    assert t.classify(6) == "duplicate" and t.classify(0) == "restart" and t.classify(10) == "next"
    t.advance(10)
    assert t.classify(6) == "restart"  # past the window, a lower seq is a new publisher


def test_subscriber_endpoint_follows_vllms_bind_or_connect_rule() -> None:
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.2") == ("tcp://10.0.0.2:5557", False)
    assert subscriber_endpoint("tcp://[::]:5557", "h") == ("tcp://h:5557", False)
    assert subscriber_endpoint("ipc:///tmp/kv", "h") == ("ipc:///tmp/kv", False)
    # A concrete address: vLLM's PUB connects there, so the proxy must bind it.
    assert subscriber_endpoint("tcp://127.0.0.1:5557", "h") == ("tcp://127.0.0.1:5557", True)


# -- subscriber against real sockets ---------------------------------------------------------------------------


def _rebind(sock: zmq.Socket[Any], port: int) -> None:
    """Bind a port a closed socket just released: ZMQ closes sockets asynchronously, so retry briefly."""
    deadline = time.monotonic() + 5
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class FakePublisher:
    """vLLM's publisher protocol: PUB [topic, seq, payload] + ROUTER replay. XPUB (same wire as PUB) lets the
    test wait for the subscription instead of sleeping through ZMQ's slow-joiner window."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        port: int | None = None,
        replay: bool = True,
        topic: str = TOPIC,
        replay_port: int | None = None,
    ):
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            _rebind(self.pub, port)
        self.port = port
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=1000)
        self.lock = threading.Lock()
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self.router: zmq.Socket[Any] | None = None
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if replay_port is None:
                rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                rport = replay_port
                _rebind(self.router, rport)
            self.replay_port = rport
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        assert self.pub.poll(int(timeout * 1000)), "no subscriber connected"
        msg = self.pub.recv()
        assert msg[:1] == b"\x01"

    def emit(self, seq: int, payload: bytes, send: bool = True, topic: bytes | None = None) -> None:
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([topic or self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        assert self.router is not None
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start_b = self.router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                self.router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.router is not None:
            self.router.close(linger=0)
        self.pub.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def started(
    ctx: zmq.Context[Any],
) -> Iterator[Callable[..., tuple[FakePublisher, KVEventSubscriber, PrefixIndex]]]:
    made: list[tuple[FakePublisher, KVEventSubscriber]] = []

    def make(replay: bool = True, **kw: Any) -> tuple[FakePublisher, KVEventSubscriber, PrefixIndex]:
        pub = FakePublisher(ctx, replay=replay)
        index = PrefixIndex(BS)
        kw.setdefault("replay_endpoint", pub.replay_endpoint)
        kw.setdefault("catch_up", False)  # these tests are about a live stream; the catch-up has its own
        sub = KVEventSubscriber(index, "a", pub.endpoint, topic=TOPIC, context=ctx, **kw)
        made.append((pub, sub))
        sub.start()
        pub.wait_subscribed()
        return pub, sub, index

    yield make
    for pub, sub in made:
        sub.stop()
        pub.close()


def seq_is(sub: KVEventSubscriber, seq: int) -> Callable[[], bool]:
    return lambda: sub.stats.last_seq == seq


PROMPT = toks(16)


def chain_payloads(ev: dict[str, Any]) -> list[bytes]:
    """Four batches, one block each, chained by parent hash: seq i stores block i of PROMPT."""
    return [
        vllm_payload(ev, [stored(ev, [100 + i], None if i == 0 else 99 + i, PROMPT[i * BS : (i + 1) * BS])])
        for i in range(4)
    ]


def test_subscriber_applies_stored_removed_and_cleared(started: Any, vllm_ev: dict[str, Any]) -> None:
    pub, sub, index = started(replay=False, replay_endpoint=None)
    assert index.stats()["instances"]["a"]["precise"] is True
    for seq, p in enumerate(chain_payloads(vllm_ev)):
        pub.emit(seq, p)
    wait_for(seq_is(sub, 3), what="seq 3")
    assert index.match(PROMPT) == {"a": 16}
    pub.emit(4, vllm_payload(vllm_ev, [removed(vllm_ev, [102])]))
    wait_for(seq_is(sub, 4))
    assert index.cached_tokens("a", PROMPT) == 8
    pub.emit(5, vllm_payload(vllm_ev, [vllm_ev["AllBlocksCleared"]()]))
    wait_for(seq_is(sub, 5))
    assert index.cached_tokens("a", PROMPT) == 0
    st = sub.stats
    assert (st.batches, st.events_applied, st.gaps, st.clears, st.decode_errors) == (6, 6, 0, 0, 0)


def test_gap_is_filled_by_replay(started: Any, vllm_ev: dict[str, Any]) -> None:
    pub, sub, index = started()
    payloads = chain_payloads(vllm_ev)
    pub.emit(0, payloads[0])
    pub.emit(1, payloads[1])
    pub.emit(2, payloads[2], send=False)  # lost on the PUB socket, but in the replay buffer
    pub.emit(3, payloads[3])
    wait_for(seq_is(sub, 3), what="replay to fill seq 2")
    assert index.match(PROMPT) == {"a": 16}
    assert pub.replay_requests == [2]
    st = sub.stats
    assert (st.gaps, st.replays, st.replayed_batches, st.clears, st.replay_failures) == (1, 1, 2, 0, 0)
    # Live batches after the replayed range continue normally.
    pub.emit(4, vllm_payload(vllm_ev, [removed(vllm_ev, [103])]))
    wait_for(seq_is(sub, 4))
    assert index.cached_tokens("a", PROMPT) == 12 and sub.stats.gaps == 1


def test_gap_without_replay_clears_the_instance(
    started: Any, vllm_ev: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_disagg")
    pub, sub, index = started(replay=False, replay_endpoint=None)
    payloads = chain_payloads(vllm_ev)
    pub.emit(0, payloads[0])
    wait_for(seq_is(sub, 0))
    other = toks(4, 500)
    pub.emit(2, vllm_payload(vllm_ev, [stored(vllm_ev, [777], None, other)]))  # seq 1 lost for good
    wait_for(seq_is(sub, 2))
    assert index.cached_tokens("a", PROMPT) == 0  # whatever seq 1 did (maybe removals) is unknown
    assert index.cached_tokens("a", other) == 4  # applied after the clear
    st = sub.stats
    assert (st.gaps, st.clears, st.replays) == (1, 1, 0)
    assert index.stats()["instances"]["a"]["resets"] == 1  # exported as vllm_disagg_prefix_index_resets_total
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("batches 1-1 were lost" in m and "give the instance replay=" in m for m in warned), warned


def test_unanswered_replay_times_out_and_clears(ctx: zmq.Context[Any], vllm_ev: dict[str, Any]) -> None:
    pub = FakePublisher(ctx, replay=False)
    mute = ctx.socket(zmq.ROUTER)  # accepts the request, never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        index,
        "a",
        pub.endpoint,
        replay_endpoint=f"tcp://127.0.0.1:{port}",
        topic=TOPIC,
        replay_timeout_s=0.3,
        catch_up=False,
        context=ctx,
    )
    try:
        sub.start()
        pub.wait_subscribed()
        payloads = chain_payloads(vllm_ev)
        pub.emit(0, payloads[0])
        pub.emit(2, payloads[2])  # a gap; seq 2's parent (seq 1) is then unknown: an orphan, not a guess
        wait_for(seq_is(sub, 2))
        st = sub.stats
        assert (st.gaps, st.replay_failures, st.replays, st.clears) == (1, 1, 0, 1)
        assert index.match(PROMPT) == {"a": 0}
    finally:
        sub.stop()
        mute.close(linger=0)
        pub.close()


def test_replay_buffer_that_lost_the_start_of_the_gap_clears(
    started: Any, vllm_ev: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_disagg")
    pub, sub, index = started()
    payloads = chain_payloads(vllm_ev)
    pub.emit(0, payloads[0])
    wait_for(seq_is(sub, 0))
    with pub.lock:
        pub.buffer.clear()  # seq 1 fell out of the publisher's buffer
    pub.emit(2, vllm_payload(vllm_ev, [stored(vllm_ev, [900], None, toks(4, 900))]), send=False)
    pub.emit(3, vllm_payload(vllm_ev, [stored(vllm_ev, [901], 900, toks(4, 904))]))
    wait_for(seq_is(sub, 3))
    assert index.cached_tokens("a", PROMPT) == 0
    assert index.cached_tokens("a", toks(8, 900)) == 8
    st = sub.stats
    assert (st.gaps, st.replays, st.clears) == (1, 1, 1)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("replay buffer starts at batch 2, but 1 was needed" in m for m in warned), warned


def test_publisher_restart_clears_the_instance(ctx: zmq.Context[Any], vllm_ev: dict[str, Any]) -> None:
    pub = FakePublisher(ctx, replay=False)
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(index, "a", pub.endpoint, topic=TOPIC, context=ctx)
    try:
        sub.start()
        pub.wait_subscribed()
        for seq, p in enumerate(chain_payloads(vllm_ev)):
            pub.emit(seq, p)
        wait_for(seq_is(sub, 3))
        assert index.cached_tokens("a", PROMPT) == 16
        # vLLM restarts on the same port: empty cache, seq back at 0.
        port = pub.port
        pub.close()
        pub = FakePublisher(ctx, port=port, replay=False)
        pub.wait_subscribed(timeout=10)
        other = toks(4, 300)
        pub.emit(0, vllm_payload(vllm_ev, [stored(vllm_ev, [1], None, other)]))
        wait_for(seq_is(sub, 0), what="first batch of the restarted publisher")
        assert index.match(PROMPT) == {"a": 0}
        assert index.cached_tokens("a", other) == 4
        st = sub.stats
        assert st.restarts == 1 and st.clears == 1 and st.gaps == 0
    finally:
        sub.stop()
        pub.close()


def _dropped_after_seq_3(
    ctx: zmq.Context[Any], vllm_ev: dict[str, Any], **settings: Any
) -> tuple[FakePublisher, KVEventSubscriber, PrefixIndex, list[tuple[int, bytes]]]:
    """A subscriber (with replay) that applied seq 0..3 before its publisher's connection dropped: a new publisher
    on the same ports (not yet reached by the subscriber) and the old one's replay buffer."""
    pub = FakePublisher(ctx)
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        index,
        "a",
        pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
        topic=TOPIC,
        catch_up=False,
        context=ctx,
        **settings,
    )
    try:
        sub.start()
        pub.wait_subscribed()
        for seq, p in enumerate(chain_payloads(vllm_ev)):
            pub.emit(seq, p)
        wait_for(seq_is(sub, 3))
        port, rport, buffered = pub.port, pub.replay_port, list(pub.buffer)
        pub.close()
        wait_for(lambda: sub.stats.disconnects == 1, what="the disconnect")
    except BaseException:
        sub.stop()
        pub.close()
        raise
    return FakePublisher(ctx, port=port, replay_port=rport), sub, index, buffered


def test_restart_that_looks_like_a_gap_is_caught_by_the_disconnect(
    ctx: zmq.Context[Any], vllm_ev: dict[str, Any]
) -> None:
    """The restarted vLLM published seq 0..5 before we reconnected, so its seq 6 looks like a plain gap after our
    seq 3. Replaying 4..6 on top of the old state would keep the dead process's blocks; a disconnect longer than
    ``blip_s`` (a restart loads a model: tens of seconds; 0 here) tells us it is a new publisher: clear, then replay
    it from 0."""
    pub, sub, index, _ = _dropped_after_seq_3(ctx, vllm_ev, blip_s=0.0)
    try:
        new = toks(24, 1000)
        for seq in range(6):
            blk = new[seq * BS : (seq + 1) * BS]
            p = vllm_payload(vllm_ev, [stored(vllm_ev, [50 + seq], None if seq == 0 else 49 + seq, blk)])
            pub.emit(seq, p, send=False)  # published before the SUB reconnected
        pub.wait_subscribed(timeout=10)
        pub.emit(6, vllm_payload(vllm_ev, [removed(vllm_ev, [55])]))
        wait_for(seq_is(sub, 6), what="seq 6 of the new publisher")
        assert index.match(PROMPT) == {"a": 0}
        assert index.cached_tokens("a", new) == 20
        assert pub.replay_requests == [0]
        st = sub.stats
        assert (st.restarts, st.gaps, st.replays, st.clears) == (1, 1, 1, 1)
    finally:
        sub.stop()
        pub.close()


def test_a_short_drop_of_a_running_engine_is_a_gap_the_replay_fills(
    ctx: zmq.Context[Any], vllm_ev: dict[str, Any]
) -> None:
    """The same engine, its connection back within ``blip_s`` and a batch published meanwhile: the replay fills
    the hole from the expected seq. Taken for a restart, the instance was cleared, and a long-running engine
    (its replay buffer no longer reaching seq 0) never announces the blocks it keeps cached again."""
    pub, sub, index, buffered = _dropped_after_seq_3(ctx, vllm_ev)
    try:
        pub.buffer.extend(buffered)
        extra = toks(4, 500)
        pub.emit(4, vllm_payload(vllm_ev, [stored(vllm_ev, [70], None, extra)]), send=False)  # lost meanwhile
        pub.wait_subscribed(timeout=10)
        pub.emit(5, vllm_payload(vllm_ev, [stored(vllm_ev, [71], None, toks(4, 600))]))
        wait_for(seq_is(sub, 5), what="seq 5")
        assert index.cached_tokens("a", PROMPT) == len(PROMPT) // BS * BS  # kept: no clear
        assert index.cached_tokens("a", extra) == 4  # the lost batch, replayed
        assert pub.replay_requests == [4]
        st = sub.stats
        assert (st.restarts, st.clears) == (0, 0)
    finally:
        sub.stop()
        pub.close()


def test_seq_going_back_on_a_live_connection_is_a_restart(started: Any, vllm_ev: dict[str, Any]) -> None:
    pub, sub, index = started(replay=False, replay_endpoint=None)
    payloads = chain_payloads(vllm_ev)
    for seq, p in enumerate(payloads):
        pub.emit(seq, p)
    wait_for(seq_is(sub, 3))
    pub.emit(0, payloads[0])
    wait_for(lambda: sub.stats.restarts == 1)
    wait_for(seq_is(sub, 0))
    assert index.cached_tokens("a", PROMPT) == 4


def test_undecodable_batch_and_foreign_topic(started: Any, vllm_ev: dict[str, Any]) -> None:
    pub, sub, index = started(replay=False, replay_endpoint=None)
    payloads = chain_payloads(vllm_ev)
    pub.emit(0, payloads[0])
    pub.emit(1, b"\xc1garbage")
    pub.emit(2, vllm_payload(vllm_ev, [stored(vllm_ev, [5], None, toks(4, 40))]), topic=b"kv2")  # not ours
    pub.emit(2, vllm_payload(vllm_ev, [stored(vllm_ev, [6], None, toks(4, 60))]))
    wait_for(seq_is(sub, 2))
    st = sub.stats
    assert (st.decode_errors, st.clears, st.gaps, st.batches) == (1, 1, 0, 2)
    assert index.match(PROMPT) == {"a": 0}  # cleared: the lost batch may have removed blocks
    assert index.cached_tokens("a", toks(4, 40)) == 0
    assert index.cached_tokens("a", toks(4, 60)) == 4


def test_block_size_mismatch_is_reported_not_applied(started: Any, vllm_ev: dict[str, Any]) -> None:
    pub, sub, index = started(replay=False, replay_endpoint=None)
    bad = vllm_ev["BlockStored"](
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=toks(18),
        block_size=6,  # not a whole number of the index's blocks
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    pub.emit(0, vllm_payload(vllm_ev, [bad]))
    pub.emit(1, chain_payloads(vllm_ev)[0])
    wait_for(seq_is(sub, 1))
    reason = index.ignored_reason("a")
    assert reason is not None and "block_size 6" in reason
    assert index.match(PROMPT) == {"a": 0}


def test_bind_mode_when_vllm_connects(ctx: zmq.Context[Any], vllm_ev: dict[str, Any]) -> None:
    from vllm_disagg.tools.harness import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(index, "a", endpoint, topic=TOPIC, bind=True, context=ctx)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        sub.start()
        with pytest.raises(zmq.ZMQError):  # a port already taken fails start(), not silently in the thread
            KVEventSubscriber(PrefixIndex(BS), "b", endpoint, topic=TOPIC, bind=True, context=ctx).start()
        pub.connect(endpoint)
        assert pub.poll(5000) and pub.recv()[:1] == b"\x01"
        pub.send_multipart([TOPIC.encode(), (0).to_bytes(8, "big"), chain_payloads(vllm_ev)[0]])
        wait_for(seq_is(sub, 0))
        assert index.cached_tokens("a", PROMPT) == 4
    finally:
        sub.stop()
        pub.close(linger=0)


def test_stop_is_prompt_and_idempotent(ctx: zmq.Context[Any]) -> None:
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(index, "a", "tcp://127.0.0.1:1", topic=TOPIC, context=ctx, poll_interval_s=0.05)
    sub.start()
    assert sub.running
    t0 = time.monotonic()
    sub.stop()
    assert time.monotonic() - t0 < 2.0 and not sub.running
    sub.stop()


def test_late_join_against_vllms_real_publisher() -> None:
    """vLLM's own ZmqEventPublisher, configured as vllm_disagg.tools.harness.kv_events_args does (a concrete address:
    vLLM's PUB connects, we bind): batches sent before it connected come back through replay from 0 (here at the
    first live batch's gap: the start-up catch-up is off; test_catch_up_against_vllms_real_publisher has it on)."""
    pytest.importorskip("vllm")
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from vllm_disagg.tools.harness import free_port

    port, rport = free_port(), free_port()
    endpoint, bind = subscriber_endpoint(f"tcp://127.0.0.1:{port}", "127.0.0.1")
    assert bind
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=f"tcp://127.0.0.1:{rport}", topic=TOPIC
    )
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        index,
        "vllm",
        endpoint,
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        topic=TOPIC,
        bind=bind,
        catch_up=False,
    )

    def batch(events: list[Any]) -> Any:
        return kv_events.KVEventBatch(ts=time.time(), events=events)

    def blk(i: int) -> Any:
        return kv_events.BlockStored(
            block_hashes=[100 + i],
            parent_block_hash=None if i == 0 else 99 + i,
            token_ids=PROMPT[i * BS : (i + 1) * BS],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    try:
        for i in range(2):  # published before anyone listens: only the replay buffer has them
            publisher.publish(batch([blk(i)]))
        wait_for(lambda: len(publisher._buffer) == 2, what="the publisher thread to send seq 0 and 1")
        sub.start()
        # Keep publishing no-op batches until the SUB socket hears one (ZMQ's slow joiner drops the first ones).
        seq = 2
        deadline = time.monotonic() + 10
        while sub.stats.last_seq is None:
            assert time.monotonic() < deadline, "subscriber never received a batch"
            publisher.publish(batch([kv_events.BlockRemoved(block_hashes=[12345], medium="GPU")]))
            seq += 1
            time.sleep(0.05)
        for i in (2, 3):
            publisher.publish(batch([blk(i)]))
        wait_for(seq_is(sub, seq + 1), timeout=10, what="the last batch")
        assert index.match(PROMPT) == {"vllm": 16}
        st = sub.stats
        assert st.gaps == 1 and st.replays == 1 and st.clears == 0
    finally:
        sub.stop()
        publisher.shutdown()


def test_catch_up_on_start_knows_the_cache_before_any_live_batch(
    ctx: zmq.Context[Any], vllm_ev: dict[str, Any]
) -> None:
    """A (re)started proxy subscribing to an idle instance: the replay buffer alone rebuilds the index, and live
    batches the replay already applied are skipped as duplicates, not taken for a publisher restart."""
    pub = FakePublisher(ctx)
    payloads = chain_payloads(vllm_ev)
    for seq, p in enumerate(payloads):
        pub.emit(seq, p, send=False)  # published before this subscriber existed
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        index, "a", pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=TOPIC, context=ctx
    )
    try:
        sub.start()
        assert sub.wait_caught_up(5)
        assert index.cached_tokens("a", PROMPT) == 16
        assert pub.replay_requests == [0]
        pub.wait_subscribed()
        pub.emit(3, payloads[3])  # already replayed: a duplicate
        pub.emit(4, vllm_payload(vllm_ev, [removed(vllm_ev, [103])]))
        wait_for(seq_is(sub, 4))
        assert index.cached_tokens("a", PROMPT) == 12
        st = sub.stats
        assert (st.replays, st.replayed_batches, st.duplicates, st.restarts, st.clears) == (1, 4, 1, 0, 0)
    finally:
        sub.stop()
        pub.close()


def test_joining_after_the_replay_buffer_rolled_over_warns_but_forgets_nothing(
    ctx: zmq.Context[Any], vllm_ev: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy that starts after the instance's buffer dropped its first batches cannot learn the blocks stored in
    them (a WARNING says so) but had nothing to forget: no clear, no reset counted."""
    caplog.set_level(logging.INFO, logger="vllm_disagg")
    pub = FakePublisher(ctx)
    payloads = chain_payloads(vllm_ev)
    for seq, p in enumerate(payloads):
        pub.emit(seq, p, send=False)
    with pub.lock:
        pub.buffer.popleft()  # batch 0 rolled out of the buffer
    index = PrefixIndex(BS)
    index.set_precise("a", True)  # as adding the instance does
    sub = KVEventSubscriber(
        index, "a", pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=TOPIC, context=ctx
    )
    try:
        sub.start()
        assert sub.wait_caught_up(5)
        assert sub.stats.clears == 0 and index.stats()["instances"]["a"]["resets"] == 0
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("replay buffer starts at batch 1, but 0 was needed" in m for m in warned), warned
        assert not any("forgot" in m for m in warned), warned
    finally:
        sub.stop()
        pub.close()


def test_catch_up_that_gets_no_answer_still_follows_the_live_stream(
    ctx: zmq.Context[Any], vllm_ev: dict[str, Any]
) -> None:
    """An instance whose replay socket is not up (yet): the catch-up gives up after its timeout and live batches
    are applied as usual."""
    pub = FakePublisher(ctx, replay=False)
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        index, "a", pub.endpoint, replay_endpoint=f"tcp://127.0.0.1:{port}", topic=TOPIC, replay_timeout_s=0.3,
        context=ctx,
    )  # fmt: skip
    try:
        sub.start()
        assert sub.wait_caught_up(5)
        assert sub.stats.replay_failures == 1
        pub.wait_subscribed()
        pub.emit(0, chain_payloads(vllm_ev)[0])
        wait_for(seq_is(sub, 0))
        assert index.cached_tokens("a", PROMPT) == BS
    finally:
        sub.stop()
        mute.close(linger=0)
        pub.close()


def test_catch_up_against_vllms_real_publisher() -> None:
    """vLLM's own publisher, two batches sent before the subscriber starts and none after: the catch-up alone
    puts them in the index."""
    pytest.importorskip("vllm")
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from vllm_disagg.tools.harness import free_port

    port, rport = free_port(), free_port()
    endpoint, bind = subscriber_endpoint(f"tcp://127.0.0.1:{port}", "127.0.0.1")
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=f"tcp://127.0.0.1:{rport}", topic=TOPIC
    )
    index = PrefixIndex(BS)
    sub = KVEventSubscriber(
        index, "vllm", endpoint, replay_endpoint=f"tcp://127.0.0.1:{rport}", topic=TOPIC, bind=bind
    )
    try:
        for i in range(2):
            blk = kv_events.BlockStored(
                block_hashes=[100 + i], parent_block_hash=None if i == 0 else 99 + i,
                token_ids=PROMPT[i * BS : (i + 1) * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None,
            )  # fmt: skip
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[blk]))
        wait_for(lambda: len(publisher._buffer) == 2, what="the publisher thread to send seq 0 and 1")
        sub.start()
        assert sub.wait_caught_up(10)
        assert index.match(PROMPT) == {"vllm": 2 * BS}
        st = sub.stats
        assert (st.replays, st.replayed_batches, st.gaps, st.clears) == (1, 2, 0, 0)
    finally:
        sub.stop()
        publisher.shutdown()
