"""The transfer engine on the paths users take: TP = 2, shared transfer ids, retries, takeovers, preemption, hostile
peer addresses, declines, prompt identity, and a crashed I/O thread. Real engines over loopback TCP (numpy caches);
each test is one of the connector review's repro scripts, asserting the fixed behaviour."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import zmq
from support.transfer_engines import BLOCK_BYTES, LAYERS, geometry, make, wait_results

from vllm_disagg.transport.engine import TransferEngine


def _offer_all(p: TransferEngine, tid: str, blocks: list[int], request_id: str = "") -> None:
    for layer in range(LAYERS):
        p.offer_blocks(tid, layer, list(enumerate(blocks)), request_id)


def _connector_worker(engine: TransferEngine, tp_rank: int) -> Any:
    """The connector's real worker side (its bind() dials prefill's rank), around a real engine."""
    pytest.importorskip("vllm")
    from vllm_disagg.connectors.disagg_connector import _WorkerSide

    w = _WorkerSide.__new__(_WorkerSide)
    w.engine, w.tp_rank, w.meta, w.store = engine, tp_rank, None, engine.store
    return w


def _prefill_ranks(tp_size: int, attempts: int = 20) -> list[TransferEngine]:
    """Prefill engines for ranks 0..tp_size-1 on a free base port + rank, as the connector's workers bind. Rank 0 takes
    an ephemeral port; when the ports above it are taken (by any socket of the host), start again elsewhere."""
    for _ in range(attempts):
        ranks = [make("P0", seed=10, geo=geometry(tp_size=tp_size, tp_rank=0))]
        try:
            for r in range(1, tp_size):
                geo = geometry(tp_size=tp_size, tp_rank=r)
                ranks.append(make(f"P{r}", seed=10 + r, geo=geo, port=ranks[0].port + r))
            return ranks
        except zmq.ZMQError:
            for e in ranks:
                e.close()
    raise RuntimeError(f"no {tp_size} consecutive free ports in {attempts} attempts")


def test_tp2_each_decode_rank_loads_from_the_same_prefill_rank() -> None:
    """Prefill rank r listens on base + r; the connector's decode rank r dials base + r (not base): both ranks load."""
    pytest.importorskip("vllm")
    from vllm_disagg.connectors.disagg_connector import DisaggConnectorMetadata, LoadSpec

    prefills = _prefill_ranks(2)
    decodes: list[TransferEngine] = []
    try:
        for r in range(2):
            decodes.append(make(f"D{r}", seed=None, geo=geometry(tp_size=2, tp_rank=r)))
        base = prefills[0].port
        for r in range(2):
            prefills[r].begin_send("tp", f"p{r}", prompt_len=8)
            meta = DisaggConnectorMetadata(
                loads=[LoadSpec("d", "tp", "127.0.0.1", base, [4, 5], first_block=0, prompt_len=8)]
            )
            _connector_worker(decodes[r], tp_rank=r).bind(meta)
        time.sleep(0.2)
        for r in range(2):
            _offer_all(prefills[r], "tp", [1, 2], f"p{r}")
        for r in range(2):
            res = wait_results(decodes[r], lambda x: "d" in x.finished_recving)
            assert res.failed_recving == set(), f"rank {r} failed"
            for layer in range(LAYERS):
                assert bytes(decodes[r].store.read(layer, 4)) == bytes(prefills[r].store.read(layer, 1))
                assert bytes(decodes[r].store.read(layer, 5)) == bytes(prefills[r].store.read(layer, 2))
        assert bytes(decodes[0].store.read(0, 4)) != bytes(decodes[1].store.read(0, 4))  # each its own shard
    finally:
        for e in prefills + decodes:
            e.close()


def test_two_loads_with_one_transfer_id_never_hang_or_report_unwritten_blocks() -> None:
    """n > 1 children share an id: the second load fails at once (recompute), the first completes; cancelling the
    second never ends the first."""
    p, d = make("P", 1), make("D", None, load_timeout_s=3)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("child0", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        d.start_load("child1", "T", ("127.0.0.1", p.port), [6, 7], first_block=0, prompt_len=8)
        res = wait_results(d, lambda r: "child1" in r.finished_recving, timeout=2)
        assert res.failed_recving == {"child1"}  # refused at once, not after a deadline
        d.cancel_load("T", "child1")  # the scheduler aborts the refused child: must not touch child0's load
        time.sleep(0.2)
        assert "child0" not in d.poll_results().finished_recving
        _offer_all(p, "T", [1, 2], "p0")
        res = wait_results(d, lambda r: "child0" in r.finished_recving)
        assert res.failed_recving == set()
        assert bytes(d.store.read(2, 5)) == bytes(p.store.read(2, 2))
        assert not d.store.layers[0][6].any()  # type: ignore[attr-defined]
    finally:
        p.close()
        d.close()


def test_two_prefill_requests_with_one_transfer_id_are_both_freed() -> None:
    p, d = make("P", 1), make("D", None)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        p.begin_send("T", "p1", prompt_len=8)  # a sibling: never held, never sent from
        d.start_load("d", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        time.sleep(0.2)
        p.offer_blocks("T", 0, [(0, 9), (1, 9)], "p1")  # ignored: not the sending request
        _offer_all(p, "T", [1, 2], "p0")
        assert not wait_results(d, lambda r: "d" in r.finished_recving).failed_recving
        assert bytes(d.store.read(0, 4)) == bytes(p.store.read(0, 1))
        p.finish_send("T", aborted=False, request_id="p0")
        p.finish_send("T", aborted=False, request_id="p1")
        wait_results(p, lambda r: {"p0", "p1"} <= r.finished_sending, timeout=5)
    finally:
        p.close()
        d.close()


def test_a_retry_of_a_completed_transfer_fails_at_once() -> None:
    p, d = make("P", 1), make("D", None, load_timeout_s=4)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("a", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        _offer_all(p, "T", [1, 2], "p0")
        assert not wait_results(d, lambda r: "a" in r.finished_recving).failed_recving
        t0 = time.monotonic()
        d.start_load("b", "T", ("127.0.0.1", p.port), [6, 7], first_block=0, prompt_len=8)
        res = wait_results(d, lambda r: "b" in r.finished_recving, timeout=3)
        assert res.failed_recving == {"b"} and time.monotonic() - t0 < 2.0  # not the 4 s load timeout
    finally:
        p.close()
        d.close()


def test_a_second_registration_cannot_take_a_transfer_over() -> None:
    p, d1, d2 = make("P", 1), make("D1", None), make("D2", None)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d1.start_load("a", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        time.sleep(0.2)
        p.offer_blocks("T", 0, [(0, 1), (1, 2)], "p0")
        time.sleep(0.1)
        d2.start_load("b", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        res2 = wait_results(d2, lambda r: "b" in r.finished_recving, timeout=3)
        assert res2.failed_recving == {"b"}
        for layer in range(1, LAYERS):
            p.offer_blocks("T", layer, [(0, 1), (1, 2)], "p0")
        assert not wait_results(d1, lambda r: "a" in r.finished_recving).failed_recving
        assert not d2.store.layers[1][4].any()  # type: ignore[attr-defined]
    finally:
        for e in (p, d1, d2):
            e.close()


def _reused(p: TransferEngine, blocks: list[int]) -> None:
    """vLLM handed these prefill blocks to another request, which wrote its own KV into them."""
    for layer in range(LAYERS):
        p.store.layers[layer][blocks] = 0xAA  # type: ignore[attr-defined]


def test_a_preempted_prefill_resumes_its_transfer_from_its_new_blocks() -> None:
    """Prefill sends block 0, is preempted (vLLM frees and reuses its blocks), and resumes on new blocks: decode
    keeps block 0 as sent, gets block 1 from the new blocks, never the new owner's bytes, and does not recompute."""
    p, d = make("P", 1), make("D", None)
    try:
        sent_before = [bytes(p.store.read(layer, 5)) for layer in range(LAYERS)]
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("d", "T", ("127.0.0.1", p.port), [1, 2], first_block=0, prompt_len=8)
        time.sleep(0.2)  # registered
        for layer in range(LAYERS):
            p.offer_blocks("T", layer, [(0, 5)], "p0")  # the first chunk: block 0 only
        deadline = time.monotonic() + 5
        while bytes(d.store.read(LAYERS - 1, 1)) != sent_before[-1]:
            assert time.monotonic() < deadline, "block 0 never arrived"
            time.sleep(0.01)
        assert p.suspend_send("T", "p0", timeout_s=5)  # the connector's handle_preemptions
        _reused(p, [5, 6])
        _offer_all(p, "T", [9, 10], "p0")  # resumed: its first step offers every complete block again
        res = wait_results(d, lambda r: "d" in r.finished_recving)
        assert not res.failed_recving
        for layer in range(LAYERS):
            assert bytes(d.store.read(layer, 1)) == sent_before[layer]  # sent once, not again from block 9
            assert bytes(d.store.read(layer, 2)) == bytes(p.store.read(layer, 10))
    finally:
        p.close()
        d.close()


def test_offers_pending_at_a_preemption_are_never_sent() -> None:
    """Offers not yet sent when the request is preempted name blocks vLLM has freed: decode registering later gets
    the resumed request's blocks, never the freed ones' new contents."""
    p, d = make("P", 1), make("D", None)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        _offer_all(p, "T", [5, 6], "p0")  # no decode yet: nothing is sent
        assert p.suspend_send("T", "p0", timeout_s=5)
        _reused(p, [5, 6])
        _offer_all(p, "T", [9, 10], "p0")
        d.start_load("d", "T", ("127.0.0.1", p.port), [1, 2], first_block=0, prompt_len=8)
        res = wait_results(d, lambda r: "d" in r.finished_recving)
        assert not res.failed_recving
        for layer in range(LAYERS):
            assert bytes(d.store.read(layer, 1)) == bytes(p.store.read(layer, 9))
            assert bytes(d.store.read(layer, 2)) == bytes(p.store.read(layer, 10))
        p.finish_send("T", aborted=False, request_id="p0")
        wait_results(p, lambda r: "p0" in r.finished_sending, timeout=5)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize(
    "peer", [("bad host", 5700), ("*", 5700), ("%", 5700), ("127.0.0.1", -1), ("h", 70000)]
)
def test_a_bad_peer_address_fails_only_its_load(peer: tuple[str, int]) -> None:
    p, d = make("P", 1), make("D", None, load_timeout_s=10)
    try:
        d.start_load("evil", "E", peer, [1], first_block=0, prompt_len=4)
        res = wait_results(d, lambda r: "evil" in r.finished_recving, timeout=3)
        assert res.failed_recving == {"evil"} and d.alive
        p.begin_send("ok", "p0", prompt_len=8)
        d.start_load("good", "ok", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        _offer_all(p, "ok", [1, 2], "p0")
        assert not wait_results(d, lambda r: "good" in r.finished_recving).failed_recving
    finally:
        p.close()
        d.close()


def test_a_crashed_io_thread_fails_every_load_and_frees_every_send(monkeypatch: pytest.MonkeyPatch) -> None:
    p, d = make("P", 1), make("D", None, load_timeout_s=30)
    try:
        d.start_load("waiting", "W", ("127.0.0.1", p.port), [1], first_block=0, prompt_len=4)
        p.begin_send("S", "held", prompt_len=4)
        _offer_all(p, "S", [0], "held")
        p.finish_send("S", aborted=False, request_id="held")
        time.sleep(0.3)

        def boom(now: float) -> None:
            raise RuntimeError("injected bug")

        for e in (p, d):
            monkeypatch.setattr(e, "_expire", boom)
        res = wait_results(d, lambda r: "waiting" in r.finished_recving, timeout=3)
        assert res.failed_recving == {"waiting"} and not d.alive
        wait_results(p, lambda r: "held" in r.finished_sending, timeout=3)
        d.start_load("later", "L", ("127.0.0.1", p.port), [2], first_block=0, prompt_len=4)
        assert wait_results(d, lambda r: "later" in r.finished_recving, timeout=2).failed_recving == {"later"}
    finally:
        p.close()
        d.close()


def _freed_without_the_lease(p: TransferEngine) -> None:
    """Prefill computes transfer "T" of request "p0" and finishes: its blocks are freed at once (decode said it will
    not load), not when the lease ends."""
    _offer_all(p, "T", [1, 2], "p0")
    p.finish_send("T", aborted=False, request_id="p0")
    wait_results(p, lambda r: "p0" in r.finished_sending, timeout=3)
    assert p.stats["leases_expired"] == 0


def test_a_declined_transfer_is_freed_without_waiting_for_the_lease() -> None:
    """Decode finished a request without loading (aborted while queued): prefill frees as soon as it has the KV."""
    p, d = make("P", 1, lease_s=30), make("D", None)
    try:
        d.decline_load("T", ("127.0.0.1", p.port))
        time.sleep(0.3)
        p.begin_send("T", "p0", prompt_len=8)
        _freed_without_the_lease(p)
    finally:
        p.close()
        d.close()


def test_equal_length_different_prompts_are_refused() -> None:
    p, d = make("P", 1), make("D", None)
    try:
        p.begin_send("T", "p0", prompt_len=8, prompt_hash="aaaa")
        d.start_load("d", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8, prompt_hash="bbbb")
        _offer_all(p, "T", [1, 2], "p0")
        res = wait_results(d, lambda r: "d" in r.finished_recving)
        assert res.failed_recving == {"d"}
        assert not d.store.layers[0][4].any()  # type: ignore[attr-defined]
    finally:
        p.close()
        d.close()


def test_a_load_extends_its_deadline_while_blocks_arrive() -> None:
    """The load deadline counts from the last progress, not from registration (a long prefill is not a stall)."""
    p, d = make("P", 1), make("D", None, load_timeout_s=1.0)
    try:
        p.begin_send("T", "p0", prompt_len=12)
        d.start_load("d", "T", ("127.0.0.1", p.port), [4, 5, 6], first_block=0, prompt_len=12)
        for layer in range(LAYERS):  # the whole prefill takes ~1.8 s > load_timeout_s, one layer every 0.6 s
            time.sleep(0.6)
            p.offer_blocks("T", layer, [(0, 1), (1, 2), (2, 3)], "p0")
        res = wait_results(d, lambda r: "d" in r.finished_recving)
        assert res.failed_recving == set()
        assert np.array_equal(d.store.layers[2][6], p.store.layers[2][3])  # type: ignore[attr-defined]
        assert d.stats["bytes_received"] == LAYERS * 3 * BLOCK_BYTES
    finally:
        p.close()
        d.close()


def test_a_queued_decode_request_keeps_prefills_lease_alive() -> None:
    """Decode's request waits in its queue longer than prefill's lease: heartbeats from arrival keep the KV held."""
    p, d = make("P", 1, lease_s=1.0), make("D", None, heartbeat_s=0.2)
    try:
        d.watch_load("T", ("127.0.0.1", p.port))  # on_new_request
        p.begin_send("T", "p0", prompt_len=8)
        _offer_all(p, "T", [1, 2], "p0")
        p.finish_send("T", aborted=False, request_id="p0")
        time.sleep(2.5)  # 2.5 leases
        assert p.stats["leases_expired"] == 0
        d.start_load("d", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        assert not wait_results(d, lambda r: "d" in r.finished_recving).failed_recving
        wait_results(p, lambda r: "p0" in r.finished_sending, timeout=3)
        assert not d.snapshot()["watches"]
    finally:
        p.close()
        d.close()


def test_commands_queued_when_the_io_thread_dies_are_still_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while vLLM's worker has just queued a load or a finish: the load is reported failed and the send
    freed, never lost (the request would wait in WAITING_FOR_REMOTE_KVS forever)."""
    d = make("D", None, load_timeout_s=30)
    try:

        def boom() -> None:
            raise RuntimeError("injected bug")

        monkeypatch.setattr(d, "_drain_commands", boom)
        d.start_load("queued", "Q", ("127.0.0.1", 9), [1], first_block=0, prompt_len=4)
        d.finish_send("S", aborted=False, request_id="held")
        res = wait_results(
            d, lambda r: "queued" in r.finished_recving and "held" in r.finished_sending, timeout=3
        )
        assert res.failed_recving == {"queued"} and not d.alive
        d.cancel_load("Q", "queued")  # already reported: nothing more (vLLM has freed the request)
        time.sleep(0.2)
        assert "queued" not in d.poll_results().finished_recving
    finally:
        d.close()


def test_a_prefill_request_that_ends_before_it_starts_lets_decode_recompute_at_once() -> None:
    p, d = make("P", 1), make("D", None, load_timeout_s=30)
    try:
        d.start_load("d", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        time.sleep(0.3)  # decode registered; the prefill leg is aborted while still queued on prefill
        t0 = time.monotonic()
        p.abort_unstarted_send("T")
        res = wait_results(d, lambda r: "d" in r.finished_recving, timeout=5)
        assert res.failed_recving == {"d"} and time.monotonic() - t0 < 3
        assert (
            "d" not in p.poll_results().finished_sending
        )  # nothing reported for a request vLLM already freed
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("peer_host", ["::1", "[::1]"])
def test_a_prefill_on_an_ipv6_address_transfers(peer_host: str) -> None:
    """A prefill advertising an IPv6 literal (with or without brackets, as kv_transfer_params may carry it) is
    dialled and loads: zmq needs the brackets in the endpoint and IPv6 enabled on both sockets."""
    p, d = make("P", 1, bind_host="::1"), make("D", None)
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("d", "T", (peer_host, p.port), [4, 5], first_block=0, prompt_len=8)
        time.sleep(0.2)
        _offer_all(p, "T", [1, 2], "p0")
        res = wait_results(d, lambda x: "d" in x.finished_recving)
        assert res.failed_recving == set()
        assert bytes(d.store.read(0, 4)) == bytes(p.store.read(0, 1))
    finally:
        p.close()
        d.close()


def test_tcp_endpoints_bracket_ipv6_literals() -> None:
    from vllm_disagg.transport.endpoints import tcp_endpoint

    assert tcp_endpoint("10.0.0.5", 5700) == "tcp://10.0.0.5:5700"
    assert tcp_endpoint("prefill-0.svc", 5700) == "tcp://prefill-0.svc:5700"
    assert tcp_endpoint("::1", 5700) == tcp_endpoint("[::1]", 5700) == "tcp://[::1]:5700"
    assert tcp_endpoint("::") == "tcp://[::]"


@pytest.mark.parametrize(
    "host, ipv6", [("::1", True), ("[fd00::5]", True), ("10.0.0.5", False), ("localhost", False)]
)
def test_decode_dials_ipv6_only_for_an_ipv6_literal(host: str, ipv6: bool) -> None:
    """With zmq.IPV6 set, zmq resolves a name to its IPv6 address first: "localhost" became ::1 where /etc/hosts maps
    it so (many containers), where a prefill bound to 0.0.0.0 does not listen."""
    import zmq

    from vllm_disagg.transport.endpoints import for_host

    sock = for_host(zmq.Context.instance().socket(zmq.DEALER), host)
    try:
        assert bool(sock.getsockopt(zmq.IPV6)) is ipv6
    finally:
        sock.close(linger=0)


def test_a_refused_decode_frees_prefills_blocks_without_waiting_for_the_lease() -> None:
    """A decode of another geometry (block size here) is refused and recomputes; it still tells prefill it will not
    load, so prefill frees the prompt's blocks when its request ends instead of holding them for the lease."""
    p = make("P", 1, lease_s=30)
    d = make("D", None, geo=geometry(block_size=8))
    try:
        p.begin_send("T", "p0", prompt_len=8)
        d.start_load("d", "T", ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
        res = wait_results(d, lambda x: "d" in x.finished_recving, timeout=5)
        assert res.failed_recving == {"d"}
        _freed_without_the_lease(p)
    finally:
        p.close()
        d.close()


def test_a_steps_preemptions_are_suspended_together() -> None:
    """Several sends preempted in one step are paused with one wait (the forward pass stalls once, not once each);
    each goes on from its resumed request's blocks."""
    p, d = make("P", 1), make("D", None)
    try:
        for t in ("T1", "T2"):
            p.begin_send(t, f"p-{t}", prompt_len=8)
            _offer_all(p, t, [5, 6] if t == "T1" else [7, 8], f"p-{t}")
        assert p.suspend_sends([("T1", "p-T1"), ("T2", "p-T2")], timeout_s=5)
        _reused(p, [5, 6, 7, 8])
        for t, dest in (("T1", [1, 2]), ("T2", [3, 4])):
            _offer_all(p, t, [9, 10] if t == "T1" else [11, 12], f"p-{t}")
            d.start_load(f"d-{t}", t, ("127.0.0.1", p.port), dest, first_block=0, prompt_len=8)
        res = wait_results(d, lambda r: {"d-T1", "d-T2"} <= r.finished_recving)
        assert not res.failed_recving
        for layer in range(LAYERS):
            assert bytes(d.store.read(layer, 3)) == bytes(p.store.read(layer, 11))
            assert bytes(d.store.read(layer, 4)) == bytes(p.store.read(layer, 12))
    finally:
        p.close()
        d.close()
