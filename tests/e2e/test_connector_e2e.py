"""DisaggConnector between two real vLLM CPU processes (tiny model, fp32, temperature 0)."""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

import httpx
import numpy as np
import pytest
import zmq
from support.pd_pair import (
    LENGTHS,
    PDPair,
    decode_params,
    prefill_params,
    random_prompt,
    run_parallel,
    run_sequential,
)
from support.vllm_servers import complete, find_trace, log_contains, metric, tokens, wait_kv_idle

from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.transport.zmq_auth import HANDSHAKE_FAILED
from vllm_disagg.wire import WIRE_VERSION, Hello, encode

pytestmark = pytest.mark.vllm

BLOCK = 128  # vLLM's default CPU block size


@pytest.mark.parametrize("flow", ["sequential", "parallel"])
def test_disaggregated_output_equals_colocated(pd_pair: PDPair, tiny_model: str, flow: str) -> None:
    ext_before = metric(pd_pair.decode, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    local_before = metric(pd_pair.decode, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
    expected_external = 0
    seed_base = 1000 if flow == "sequential" else 2000
    for i, n in enumerate(LENGTHS):
        prompt = random_prompt(n, seed_base + i)
        # Reference: the prefill instance serving the request alone (colocated), before it has any of it cached.
        ref = tokens(complete(pd_pair.prefill, tiny_model, prompt))
        if flow == "sequential":
            out = run_sequential(pd_pair, tiny_model, prompt)
        else:
            out = run_parallel(pd_pair, tiny_model, prompt, uuid.uuid4().hex)
        assert out == ref, f"{flow} flow, prompt of {n} tokens: {out} != {ref}"
        expected_external += n
    ext = (
        metric(pd_pair.decode, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
        - ext_before
    )
    local = (
        metric(pd_pair.decode, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') - local_before
    )
    # Decode computed (at most) the last prompt token of each request itself; everything else came over the wire.
    assert ext >= expected_external - len(LENGTHS), (ext, expected_external)
    assert local <= len(LENGTHS)
    wait_kv_idle(pd_pair.prefill)
    wait_kv_idle(pd_pair.decode)


def test_layerwise_sends_overlap_the_prefill_forward(pd_pair: PDPair, tiny_model: str) -> None:
    prompt = random_prompt(1900, 77)
    tid = uuid.uuid4().hex
    # Decode registers first, so every layer can leave as soon as it is computed. Under load, the tiny model's
    # prefill can finish before decode registers; prefill then serves decode from held blocks (tested elsewhere),
    # and there is nothing left to overlap.
    run_parallel(pd_pair, tiny_model, prompt, tid, prefill_after_s=2.0)
    send = find_trace(pd_pair.trace, tid, "send")
    recv = find_trace(pd_pair.trace, tid, "recv")
    assert recv["state"] == "done"
    assert send["bytes"] == recv["bytes"] > 0
    offers = send["layer_offer_times"]
    assert len(offers) >= 4  # one offer per layer (per prefill chunk)
    # The first layer left before the forward pass finished computing the last one...
    assert send["t_first_send"] < send["t_forward_end"]
    assert offers[0] < offers[-1] <= send["t_forward_end"]
    # ...and what remained after the forward pass is at most about one layer's send plus a small constant.
    layer_gap = (offers[-1] - offers[0]) / max(1, len(offers) - 1)
    tail = send["t_last_send"] - send["t_forward_end"]
    assert tail <= layer_gap + 0.1, (tail, layer_gap)
    # Decode timed each layer's completion (one monotonic clock on this host): never before prefill offered that
    # layer's last chunk, and the load ended with the last of them.
    done = recv["layer_done_times"]
    assert len(done) == 4 and all(done), done
    assert all(d >= o for d, o in zip(done, offers[-4:], strict=True)), (done, offers)
    assert max(done) <= recv["t_done"]
    # The same numbers reach vLLM's own /metrics through the connector stats hooks.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sent = metric(pd_pair.prefill, "vllm:disagg_send_bytes_count")
        got = metric(pd_pair.decode, "vllm:disagg_recv_bytes_count")
        if sent > 0 and got > 0:
            break
        time.sleep(0.2)
    assert sent > 0 and got > 0
    assert metric(pd_pair.prefill, "vllm:disagg_send_overlap_ratio_count") > 0


def test_only_blocks_decode_lacks_are_transferred(pd_pair: PDPair, tiny_model: str) -> None:
    prefix = random_prompt(4 * BLOCK, 31)
    # Warm the decode instance's own prefix cache with the first half of the prompt (4 blocks).
    complete(pd_pair.decode, tiny_model, prefix, max_tokens=1)
    prompt = prefix + random_prompt(4 * BLOCK, 32)
    ref = tokens(complete(pd_pair.prefill, tiny_model, prompt))
    tid = uuid.uuid4().hex
    assert run_parallel(pd_pair, tiny_model, prompt, tid) == ref
    recv = find_trace(pd_pair.trace, tid, "recv")
    assert recv["first_block"] == 4 and recv["blocks"] == 4
    send = find_trace(pd_pair.trace, tid, "send")
    layer_block_bytes = 2 * BLOCK * 2 * 32 * 4  # KV heads x block x (K+V) x head dim x fp32
    assert (
        recv["bytes"] == send["bytes"] == 4 * 4 * layer_block_bytes
    )  # 4 blocks x 4 layers: not all 8 blocks


def test_decode_abort_while_waiting_frees_blocks_on_both(pd_pair: PDPair, tiny_model: str) -> None:
    prompt = random_prompt(900, 41)
    tid = uuid.uuid4().hex
    # Decode registers and waits; the client gives up before prefill ever sees the request.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            pd_pair.decode.url + "/v1/completions",
            json={
                "model": tiny_model,
                "prompt": prompt,
                "max_tokens": 8,
                "kv_transfer_params": decode_params(pd_pair, tid),
            },
            timeout=1.5,
        )
    assert wait_kv_idle(pd_pair.decode, timeout=10) < 10  # freed at once, not after load_timeout_s (15 s)
    # The prefill leg arrives late (the proxy's abort raced it): prefill must free right after computing.
    complete(pd_pair.prefill, tiny_model, prompt, max_tokens=1, kv_transfer_params=prefill_params(tid))
    assert wait_kv_idle(pd_pair.prefill, timeout=10) < 10  # not after the 15 s lease
    # And both still serve correctly.
    p2 = random_prompt(300, 42)
    assert run_parallel(pd_pair, tiny_model, p2, uuid.uuid4().hex) == tokens(
        complete(pd_pair.prefill, tiny_model, p2)
    )


def test_prefill_that_never_hears_from_decode_frees_blocks_after_the_lease(
    pd_pair: PDPair, tiny_model: str
) -> None:
    prompt = random_prompt(700, 43)
    complete(pd_pair.prefill, tiny_model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert metric(pd_pair.prefill, "vllm:kv_cache_usage_perc") > 0  # held for the decode that never comes
    took = wait_kv_idle(pd_pair.prefill, timeout=40)
    assert took < 30


def test_side_channel_refuses_a_peer_without_the_secret(pd_pair: PDPair, tiny_model: str) -> None:
    """A real instance with a shared secret: a peer without it fails zmq's handshake, so not even a Hello is read
    (nothing answers), and the refusal shows in the instance's metrics."""
    before = metric(pd_pair.prefill, "vllm:disagg_handshakes_refused_total")
    geo = KVGeometry(
        model="x",
        num_layers=4,
        num_kv_heads=2,
        head_size=32,
        block_size=128,
        dtype="float32",
        kv_layout="cpu",
    )
    hello = Hello(
        wire_version=WIRE_VERSION,
        connector_version="0",
        engine_id="intruder",
        geometry=geo,
        nonce="n",
        ts=time.time(),
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
    try:
        sock.connect(f"tcp://127.0.0.1:{pd_pair.p_side}")
        sock.send_multipart(encode(hello))
        assert monitor.poll(10_000), "zmq's handshake with a secret-protected prefill did not fail"
        assert not sock.poll(1000), "a peer without the secret got an answer"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
    # vLLM collects a connector's stats with a step's outputs: a request makes one
    deadline = time.monotonic() + 30
    while metric(pd_pair.prefill, "vllm:disagg_handshakes_refused_total") <= before:
        assert time.monotonic() < deadline, "the refused handshake was not counted"
        complete(pd_pair.prefill, tiny_model, "count it", max_tokens=1)
        time.sleep(0.5)
    assert log_contains(pd_pair.prefill, r"side channel: refused a connection from a peer \(no credentials")


def test_connector_logs_like_vllm(pd_pair: PDPair) -> None:
    """The connector's INFO lines reach vLLM's log with vLLM's prefix (level, time, file): vLLM configures only its
    own logger, so they were dropped (INFO) or printed bare (warnings)."""
    assert log_contains(
        pd_pair.prefill, r"INFO \d\d-\d\d [\d:]+ \[engine\.py:\d+\] transfer engine \S+ listening on"
    )


def test_concurrent_load_through_prefill_and_decode(pd_pair: PDPair, tiny_model: str) -> None:
    rng = np.random.default_rng(5)
    prompts = [random_prompt(int(rng.integers(1, 1200)), 5000 + i) for i in range(200)]
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            if i % 2:
                run_parallel(pd_pair, tiny_model, prompts[i], uuid.uuid4().hex, max_tokens=4)
            else:
                run_sequential(pd_pair, tiny_model, prompts[i], max_tokens=4)
        except Exception as exc:  # collected, asserted below
            errors.append(f"{i}: {exc!r}")

    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(one, range(len(prompts))))
    assert errors == []
    wait_kv_idle(pd_pair.prefill)
    wait_kv_idle(pd_pair.decode)
