"""How a transfer ends when the two sides' words cross, arrive late, or never come: each case once failed to free
blocks in time (held for the whole lease or load timeout) or freed them too early (writes landing in blocks vLLM
had handed to another request)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.gated_writes import PATHS, GatedWritesPath
from support.side_channel_peer import RawPeer
from support.transfer_engines import LAYERS, geometry, make, store, wait_results

from vllm_disagg.transport import sender as sender_module
from vllm_disagg.transport.block_store import HostBlockStore
from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.transport.engine import EngineSettings, TransferEngine
from vllm_disagg.transport.records import SendOutcome, SendRecord
from vllm_disagg.wire import Done, Message, Refuse, Register, encode, make_release

BLOCKS = [(0, 1), (1, 2)]  # (logical index, prefill block) of a two-block prompt


class _HoldDone(SideChannel):
    """Decode's side channel with its Done messages held back (as if slow on the wire) until ``release``."""

    def __init__(self, inner: SideChannel) -> None:
        self._inner, self.hold = inner, True
        self.held: list[tuple[Any, Message]] = []

    def release(self) -> None:
        """(On the I/O thread.) Send what was held, and from now on send at once."""
        self.hold = False
        for sock, msg in self.held:
            self._inner.tell(sock, msg)
        self.held = []

    def reply(self, identity: bytes, msg: Message) -> None:
        self._inner.reply(identity, msg)

    def send_layer(self, identity: bytes, frames: list[Any]) -> Any:
        return self._inner.send_layer(identity, frames)

    def tell(self, sock: Any, msg: Message) -> bool:
        if self.hold and isinstance(msg, Done):
            self.held.append((sock, msg))
            return True
        return self._inner.tell(sock, msg)

    def poll(self, now: float) -> None:
        self._inner.poll(now)


@pytest.fixture
def gated_pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """A prefill and a decode over the gated direct-writes path, the decode's Done held back."""
    GatedWritesPath.gate.clear()
    opts = EngineSettings(bind_host="127.0.0.1", load_timeout_s=10.0, lease_s=1.0, connect_timeout_s=3.0)
    p = TransferEngine(store(1), geometry(), "P", opts, data_paths=PATHS)
    d = TransferEngine(store(None), geometry(), "D", opts, data_paths=PATHS, wrap_channel=_HoldDone)
    yield p, d
    GatedWritesPath.gate.set()
    p.close()
    d.close()


def _writes_posted(p: TransferEngine, d: TransferEngine, transfer_id: str = "T") -> None:
    p.begin_send(transfer_id, "p0", prompt_len=8)
    d.start_load("d0", transfer_id, ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
    deadline = time.monotonic() + 5
    while not p._sender.decodes and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the Register
    for layer in range(LAYERS):
        p.offer_blocks(transfer_id, layer, BLOCKS, "p0")
    deadline = time.monotonic() + 5
    while not (
        transfer_id in p._sender.outgoing and p._sender.outgoing[transfer_id].path.in_flight(transfer_id)
    ):
        assert time.monotonic() < deadline, "no write was posted"
        time.sleep(0.01)


def test_a_failed_load_keeps_its_blocks_until_prefill_says_its_writes_stopped(
    gated_pair: tuple[TransferEngine, TransferEngine],
) -> None:
    """Decode gave up (Done, not ok, still on the wire) while prefill aborted the same transfer: prefill's Abort
    leaves at once, its writes still in flight. Decode must not hand the blocks back on that Abort, only on the
    confirmation that no write can land any more."""
    p, d = gated_pair
    _writes_posted(p, d)
    d.cancel_load("T", "d0")  # the client went away on decode
    p.finish_send("T", aborted=True, request_id="p0")  # ... and on prefill: its Abort crosses decode's Done
    time.sleep(0.5)
    assert d._receiver.incoming["T"].state == "stopping"  # still waiting for the writes to stop
    assert not d.poll_results().finished_recving
    channel = d._channel
    assert isinstance(channel, _HoldDone)
    d._submit(channel.release)  # decode's Done reaches prefill now
    time.sleep(0.3)
    assert "T" in d._receiver.incoming  # prefill still has writes in flight: no confirmation yet
    GatedWritesPath.gate.set()
    wait_results(d, lambda r: "d0" in r.finished_recving)
    assert "T" not in d._receiver.incoming


def test_an_expired_lease_is_expired_once_while_its_writes_drain(
    gated_pair: tuple[TransferEngine, TransferEngine],
) -> None:
    p, d = gated_pair
    _writes_posted(p, d)
    p.finish_send("T", aborted=False, request_id="p0")
    d.cancel_load("T", "d0")  # decode falls silent (its Done is held back): the lease (1 s) runs out
    deadline = time.monotonic() + 10
    while p.stats["leases_expired"] < 1:
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.05)
    time.sleep(1.5)  # longer than a lease: no second expiry while its writes drain
    assert p.stats["leases_expired"] == 1


def test_a_load_cancelled_during_the_handshake_frees_prefill_at_once() -> None:
    p, d = make("P", 1, lease_s=10.0), make("D", None)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        for layer in range(LAYERS):
            p.offer_blocks("T", layer, BLOCKS, "p0")
        p.finish_send("T", aborted=False, request_id="p0")
        # one drain of decode's I/O thread runs both: the connection is still greeting when the load is cancelled
        d.start_load("d0", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        d.cancel_load("T", "d0")
        t0 = time.monotonic()
        wait_results(p, lambda r: "p0" in r.finished_sending, timeout=5)
        assert time.monotonic() - t0 < 5  # not the 10 s lease
    finally:
        p.close()
        d.close()


def test_a_register_for_a_send_released_long_ago_is_answered_at_once() -> None:
    """A send released while its request still runs on prefill (a decode registered for another prompt) whose
    tombstone is forgotten: a decode registering now is told the transfer is over instead of waiting out
    load_timeout_s."""
    p, d = make("P", 1, lease_s=0.5), make("D", None, load_timeout_s=10.0)
    try:
        p.begin_send("T", "p0", prompt_len=8, prompt_hash="prompt-a")
        d.start_load("d0", "T", ("127.0.0.1", p.port), [4, 5], 0, 8, "prompt-b")
        assert "d0" in wait_results(d, lambda r: "d0" in r.finished_recving).failed_recving
        time.sleep(1.0)  # past the tombstone
        t0 = time.monotonic()
        d.start_load("d1", "T", ("127.0.0.1", p.port), [4, 5], 0, 8, "prompt-a")
        r = wait_results(d, lambda r: "d1" in r.finished_recving)
        assert "d1" in r.failed_recving and time.monotonic() - t0 < 5
    finally:
        p.close()
        d.close()


def test_a_preemption_waits_for_writes_in_flight_from_the_freed_blocks(
    gated_pair: tuple[TransferEngine, TransferEngine],
) -> None:
    """A preempted send's posted writes still read the freed blocks: the forward pass may not reuse them until the
    writes have landed. Then the transfer goes on (here the writes held every block: the load completes)."""
    p, d = gated_pair
    _writes_posted(p, d)
    with cf.ThreadPoolExecutor(1) as pool:
        suspended = pool.submit(p.suspend_send, "T", "p0", 10.0)  # the forward thread's handle_preemptions
        time.sleep(0.3)
        assert not suspended.done()  # held while the writes read the blocks
        GatedWritesPath.gate.set()
        assert suspended.result(timeout=5)
    res = wait_results(d, lambda r: "d0" in r.finished_recving)
    assert not res.failed_recving


def test_a_preemption_whose_writes_do_not_drain_in_time_aborts_the_transfer(
    gated_pair: tuple[TransferEngine, TransferEngine],
) -> None:
    """Writes that still read the freed blocks when the wait ends may carry the next owner's bytes: the transfer is
    aborted and decode recomputes, once the writes have stopped."""
    p, d = gated_pair
    _writes_posted(p, d)
    assert not p.suspend_send("T", "p0", timeout_s=0.3)
    deadline = time.monotonic() + 5
    while p._sender.outgoing["T"].state == "open":
        assert time.monotonic() < deadline, "the transfer was not aborted"
        time.sleep(0.01)
    assert p._sender.outgoing["T"].outcome is SendOutcome.PREEMPTED
    GatedWritesPath.gate.set()
    channel = d._channel
    assert isinstance(channel, _HoldDone)
    d._submit(channel.release)
    assert "d0" in wait_results(d, lambda r: "d0" in r.finished_recving).failed_recving


class _SlowStaging(HostBlockStore):
    """Device-like staging: each owner's layer 0 is not ready the first time it is looked at (so it is parked)."""

    def __init__(self, layers: Any) -> None:
        super().__init__(layers)
        self.seen: set[str] = set()

    def staged(self, owner: str, layer: int) -> bool:
        if layer == 0 and owner not in self.seen:
            self.seen.add(owner)
            return False
        return True


@pytest.mark.parametrize("first_block, num_blocks", [(-5, 2), (0, -1), (0, 10**12)])
def test_a_malformed_register_is_refused_and_the_io_thread_lives(first_block: int, num_blocks: int) -> None:
    p = TransferEngine(_SlowStaging(store(1).layers), geometry(), "P", EngineSettings(bind_host="127.0.0.1"))
    peer = RawPeer(p.port)
    try:
        peer.handshake(None)
        reg = Register(
            transfer_id="T", request_id="x", first_block=first_block, num_blocks=num_blocks, prompt_len=8
        )
        peer.send(encode(reg))
        reply = peer.recv()
        assert "malformed Register" in getattr(reply, "reason", ""), reply
        p.begin_send("T", "p0", prompt_len=8)
        for layer in range(LAYERS):
            p.offer_blocks("T", layer, BLOCKS, "p0")  # layer 0 is parked, then flushed on the next turns
        deadline = time.monotonic() + 10
        while p._sender.offered or p._sender.parked or not p._cmds.empty():  # the offers were handled
            assert time.monotonic() < deadline and p.alive
            time.sleep(0.02)
        assert p.alive
    finally:
        peer.close()
        p.close()


def test_a_decode_with_a_transfer_in_flight_is_never_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill remembers a bounded number of decode connections; later handshakes push out the quietest ones,
    never one it is sending to."""
    monkeypatch.setattr(sender_module, "_MAX_AUTHED", 4)
    p, d = make("P", 1), make("D", None)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("d0", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        deadline = time.monotonic() + 5
        while not any(o.dest_identity for o in p._sender.outgoing.values()):
            assert time.monotonic() < deadline, "decode did not register"
            time.sleep(0.01)
        for _ in range(6):  # other decodes greet (or reconnections that left entries behind)
            other = RawPeer(p.port)
            other.handshake(None)
            other.close()
        for layer in range(LAYERS):
            p.offer_blocks("T", layer, BLOCKS, "p0")
        r = wait_results(d, lambda r: "d0" in r.finished_recving)
        assert not r.failed_recving
        assert len(p._sender.decodes) <= 4
    finally:
        p.close()
        d.close()


def _released(p: TransferEngine, peer: RawPeer, transfer_id: str, secret: bytes | None = None) -> None:
    peer.send(encode(make_release(secret, "vllm-disagg-proxy", transfer_id, "decode answered HTTP 503")))


def test_a_proxys_release_frees_a_finished_prefill_that_no_decode_registered_for() -> None:
    """The proxy gave up on the hand-off (decode failed before loading, the client left): closing the prefill
    leg's connection frees nothing once prefill's request has finished, so the proxy says so on the side channel
    and the blocks go back at once, not at the lease's end; a decode registering late is told to recompute."""
    secret = b"s3cret"
    p, d = make("P", 1, lease_s=30.0, secret=secret), make("D", None, secret=secret)
    peer = RawPeer(p.port, secret)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        for layer in range(LAYERS):
            p.offer_blocks("T", layer, BLOCKS, "p0")
        p.finish_send("T", aborted=False, request_id="p0")
        _released(p, peer, "T", b"wrong")  # a forged release frees nothing
        assert isinstance(peer.recv(), Refuse)
        time.sleep(0.3)
        assert not p.poll_results().finished_sending
        t0 = time.monotonic()
        _released(p, peer, "T", secret)
        wait_results(p, lambda r: "p0" in r.finished_sending, timeout=5)
        assert time.monotonic() - t0 < 5  # not the 30 s lease
        (rec,) = [r for r in p.drain_records() if r.transfer_id == "T"]
        assert isinstance(rec, SendRecord) and rec.outcome is SendOutcome.ABANDONED
        assert "decode answered HTTP 503" in rec.reason and p.stats["sends_abandoned"] == 1
        d.start_load("d0", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        assert "d0" in wait_results(d, lambda r: "d0" in r.finished_recving, timeout=5).failed_recving
    finally:
        peer.close()
        p.close()
        d.close()


def test_a_release_before_prefill_began_frees_it_as_soon_as_it_finishes() -> None:
    p = make("P", 1, lease_s=30.0)
    peer = RawPeer(p.port)
    try:
        _released(p, peer, "T")
        time.sleep(0.2)  # the I/O thread has it
        p.begin_send("T", "p0", prompt_len=8)
        p.finish_send("T", aborted=False, request_id="p0")
        wait_results(p, lambda r: "p0" in r.finished_sending, timeout=5)
        (rec,) = [r for r in p.drain_records() if r.transfer_id == "T"]
        assert isinstance(rec, SendRecord) and rec.outcome is SendOutcome.ABANDONED
    finally:
        peer.close()
        p.close()


def test_a_release_leaves_a_transfer_a_decode_registered_for_to_that_decode() -> None:
    """The proxy's release crosses a decode that did register (it gave up on a stream that was loading): the
    decode ends the transfer, and its load completes."""
    p, d = make("P", 1, lease_s=30.0), make("D", None)
    peer = RawPeer(p.port)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("d0", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        deadline = time.monotonic() + 5
        while not (p._sender.outgoing.get("T") and p._sender.outgoing["T"].dest is not None):
            assert time.monotonic() < deadline, "decode did not register"
            time.sleep(0.01)
        _released(p, peer, "T")
        time.sleep(0.2)
        for layer in range(LAYERS):
            p.offer_blocks("T", layer, BLOCKS, "p0")
        p.finish_send("T", aborted=False, request_id="p0")
        r = wait_results(d, lambda r: "d0" in r.finished_recving, timeout=5)
        assert "d0" not in r.failed_recving and p.stats["sends_abandoned"] == 0
    finally:
        peer.close()
        p.close()
        d.close()


def test_a_hold_nobody_vouched_for_is_kept_briefly_until_a_decode_claims_it() -> None:
    """With a shared secret, a do_remote_decode without its proof (a client calling prefill directly) holds the
    prompt's KV only unvouched_lease_s; a decode that registers (it proved the secret) gets the whole lease."""
    secret = b"s3cret"
    p = make("P", 1, lease_s=30.0, unvouched_lease_s=0.5, secret=secret)
    d = make("D", None, secret=secret)
    try:
        for tid, req in (("lone", "p-lone"), ("claimed", "p-claimed")):
            p.begin_send(tid, req, prompt_len=8, vouched=False)
            for layer in range(LAYERS):
                p.offer_blocks(tid, layer, BLOCKS, req)
        d.start_load("d0", "claimed", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        deadline = time.monotonic() + 5
        while not (p._sender.outgoing.get("claimed") and p._sender.outgoing["claimed"].claimed):
            assert time.monotonic() < deadline, "decode did not register"
            time.sleep(0.01)
        for tid, req in (("lone", "p-lone"), ("claimed", "p-claimed")):
            p.finish_send(tid, aborted=False, request_id=req)
        wait_results(p, lambda r: "p-lone" in r.finished_sending, timeout=5)  # not the 30 s lease
        assert p.stats["leases_expired"] == 1
        r = wait_results(d, lambda r: "d0" in r.finished_recving, timeout=5)
        assert "d0" not in r.failed_recving  # the claimed one loaded
    finally:
        p.close()
        d.close()
