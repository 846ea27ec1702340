"""Restarts: a restarted proxy rebuilds its prefix index from the instances' KV events; a restarted instance is
described again by the proxy.

The proxy's prefix index lives in its memory only. A new proxy process subscribes to each instance's KV events and
first replays what the publisher still buffers (vLLM's replay socket, the ``;replay=`` part of an instance spec),
so it knows what the instances cache before any of them publishes again: an idle instance may not for a long time.
Instances killed and restarted under traffic are rows of the fault matrix (test_fault_matrix.py).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import httpx
import pytest
import zmq
from support.fake_instance import FakeInstance
from support.pd_pair import PDPair, random_prompt
from support.transfer_engines import geometry, make
from support.vllm_servers import SECRET, complete

from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.router.instances import InstanceRegistry
from vllm_disagg.router.upstream import UpstreamPool
from vllm_disagg.tools.harness import ProxyServer, free_port
from vllm_disagg.transport.engine import TransferEngine

ADMIN = {"x-admin-key": "k"}
BLOCK = 128  # vLLM's block size on CPU, and the proxy's default --block-size


def _side_channel(port: int, **geo: object) -> TransferEngine:
    """A transfer engine (what answers an instance's side channel) on ``port``, which a closed one just released."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return make("p", 1, geometry(**geo), port=port, transport="tcp")
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"port {port} stays in use"
            time.sleep(0.05)


def test_an_instance_back_from_unhealthy_is_described_again() -> None:
    """A prefill registered while still starting (side channel silent) is refused for transfers; once healthy it is
    described and paired. Restarted with another KV layout, it is refused again instead of paired by a stale
    description."""

    async def scenario() -> None:
        d_side, p_side = free_port(), free_port()
        d_engine, p_engine = _side_channel(d_side), None
        d_http = await FakeInstance(free_port()).start()
        p_http = FakeInstance(free_port())  # still starting: nothing listens yet
        reg = InstanceRegistry(UpstreamPool(1.0, 1.0, 5.0), describe_timeout_s=3.0)
        try:
            await reg.add(
                InstanceConfig(url=d_http.url, role="decode", id="d", side_channel=f"127.0.0.1:{d_side}")
            )
            p = await reg.add(
                InstanceConfig(url=p_http.url, role="prefill", id="p", side_channel=f"127.0.0.1:{p_side}")
            )
            assert not p.healthy and "did not answer" in p.incompatible
            assert "cannot connect" in p.last_error, p.last_error
            p_engine = _side_channel(p_side)
            await p_http.start()
            await reg.probe(p)
            assert p.healthy and p.incompatible == "" and p.geometry == geometry()
            assert p.models == ["m"] and p.max_model_len == 2048
            assert reg.views({})[1].healthy  # a usable prefill now
            p_engine.close()  # restarts with another block size
            await p_http.stop()
            await reg.probe_all()
            await reg.probe_all()
            assert not p.healthy
            p_engine = _side_channel(p_side, block_size=8)
            await p_http.start()
            await reg.probe(p)
            assert p.healthy and p.incompatible == "KV layout differs from d: block_size 4 vs 8", (
                p.incompatible
            )
        finally:
            for engine in (d_engine, p_engine):
                if engine is not None:
                    engine.close()
            for http in (d_http, p_http):
                await http.stop()
            reg.probes.close()

    asyncio.run(scenario())


def test_a_healthy_instance_whose_side_channel_did_not_answer_is_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A side channel that missed its deadline at registration (a proxy restarted under load, an engine still
    binding) turned P/D off for that prefill until the instance itself restarted. It is asked again while healthy,
    and the registration's refusal is a WARNING naming the reason. A side channel with another secret is told at
    once (zmq's handshake fails), not after the deadline, and its instance prefills by the sequential flow (which
    needs no secret in the proxy) until the proxy has the secret."""

    async def scenario() -> None:
        p_side = free_port()
        p_http = await FakeInstance(free_port()).start()
        reg = InstanceRegistry(UpstreamPool(1.0, 1.0, 5.0), describe_timeout_s=1.0)
        p_engine = None
        try:
            with caplog.at_level("WARNING", logger="vllm_disagg.proxy"):
                p = await reg.add(
                    InstanceConfig(url=p_http.url, role="prefill", id="p", side_channel=f"127.0.0.1:{p_side}")
                )
            assert p.healthy and "did not answer" in p.incompatible
            assert any("will not prefill for KV transfers" in r.getMessage() for r in caplog.records)
            p_engine = make("p", 1, geometry(), port=p_side, transport="tcp", secret=b"other")
            p.describe_again_at = time.monotonic() - 1  # as if REDESCRIBE_EVERY_S had passed
            t0 = time.monotonic()
            await reg.probe(p)
            # refused for want of the secret: transfers from it take the sequential flow meanwhile
            assert "refused the proxy's connection" in p.side_refused and p.incompatible == "", p.side_refused
            assert "shared_secret" in p.side_refused and time.monotonic() - t0 < 1.0
            assert p.transfer_flow().startswith("sequential") and reg.views({})[0].kv_connector
            reg.secret = b"other"  # the operator gives the proxy the instances' secret
            p.describe_again_at = time.monotonic() - 1
            await reg.probe(p)
            assert p.incompatible == p.side_refused == "" and p.geometry == geometry()
            assert p.transfer_flow().startswith("parallel")
            assert p.describe_again_at == 0.0  # described: not asked again
        finally:
            if p_engine is not None:
                p_engine.close()
            await p_http.stop()
            reg.probes.close()

    asyncio.run(scenario())


def test_an_instance_that_restarted_between_probes_has_its_cached_prefixes_forgotten() -> None:
    """A restart faster than two probes never looked unhealthy, and the prefix index kept the old process's blocks
    until the new one published an event: long prompts went to an instance that had to prefill them whole. The
    start time its /metrics reports changes; the index forgets it then (and on any recovery from unhealthy). A NaN
    gauge is ignored rather than failing the probe."""
    from vllm_disagg.router.prefix_index import PrefixIndex

    async def scenario() -> None:
        metrics = (
            "vllm:num_requests_running 1\nvllm:num_requests_waiting NaN\nprocess_start_time_seconds {}\n"
        )
        http = await FakeInstance(free_port(), metrics=metrics.format("1700000000.5")).start()
        index = PrefixIndex(16)
        reg = InstanceRegistry(UpstreamPool(1.0, 1.0, 5.0))
        reg.on_fresh_cache = index.clear
        try:
            inst = await reg.add(InstanceConfig(url=http.url, role="both", id="d"))
            assert inst.healthy and inst.running == 1 and inst.waiting == 0
            prompt = list(range(64))
            index.record_routed("d", prompt)
            await reg.probe(inst)  # same process: what it holds stays
            assert index.cached_tokens("d", prompt) == 64
            http.routes["/metrics"] = (200, metrics.format("1700000099.5").encode())  # a new process
            await reg.probe(inst)
            assert inst.healthy and index.cached_tokens("d", prompt) == 0
            assert index.stats()["instances"]["d"]["resets"] == 1
            # Unhealthy for a spell (paused, overloaded) and back with the same start time: the cache outlived it,
            # and vLLM will not announce again the blocks it still holds, so the index keeps them.
            index.record_routed("d", prompt)
            http.routes["/health"] = (503, b"")
            await reg.probe(inst)
            await reg.probe(inst)
            assert not inst.healthy
            http.routes["/health"] = (200, b"")
            await reg.probe(inst)
            assert inst.healthy and index.cached_tokens("d", prompt) == 64
            # The same without a start time to compare (several API servers do not export it): forgotten.
            http.routes["/metrics"] = (200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
            await reg.probe(inst)  # the start time disappearing reads as a restart
            index.record_routed("d", prompt)
            http.routes["/health"] = (503, b"")
            await reg.probe(inst)
            await reg.probe(inst)
            http.routes["/health"] = (200, b"")
            await reg.probe(inst)
            assert inst.healthy and index.cached_tokens("d", prompt) == 0
            assert index.stats()["instances"]["d"]["resets"] == 3
        finally:
            await http.stop()
            reg.probes.close()

    asyncio.run(scenario())


def _proxy(pair: PDPair, model: str, port: int = 0) -> ProxyServer:
    return ProxyServer(
        "unused",
        port=port,
        args=[
            "--prefill", pair.spec("prefill"), "--decode", pair.spec("decode"),
            "--tokenizer", model, "--shared-secret", SECRET, "--admin-key", "k", "--log-level", "info",
        ],
    )  # fmt: skip


def _cached_on_decode(proxy: ProxyServer, model: str, prompt: list[int]) -> int:
    """Tokens of ``prompt`` the proxy's index said decode holds when it routed it. The decision log records the
    lookup made before the request ran, so the request's own KV events cannot count."""
    rid = f"restart-{uuid.uuid4().hex[:8]}"
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(proxy.url + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=120)
    assert r.status_code == 200, r.text
    decisions = httpx.get(proxy.url + "/admin/decisions", headers=ADMIN, timeout=5).json()["decisions"]
    return int(next(d for d in decisions if d["request_id"] == rid)["cached"].get("decode", 0))


def _wait_log(proxy: ProxyServer, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    assert proxy.log_path is not None
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, proxy.log_path.read_text(errors="replace"))
        if m is not None:
            return m
        assert time.monotonic() < deadline, f"no {pattern!r} in the proxy's log {proxy.log_path}"
        time.sleep(0.1)


@pytest.mark.vllm
def test_a_restarted_proxy_rebuilds_its_prefix_index_from_the_replay_buffer(
    pd_pair: PDPair, tiny_model: str
) -> None:
    prefix = random_prompt(6 * BLOCK, 4242)
    first = _proxy(pd_pair, tiny_model)
    with first:
        complete(pd_pair.decode, tiny_model, prefix, max_tokens=1)  # directly: only decode's KV events tell
        deadline = time.monotonic() + 30
        while (cached := _cached_on_decode(first, tiny_model, prefix + random_prompt(20, 4300))) < len(
            prefix
        ):
            assert time.monotonic() < deadline, f"the running proxy never learnt the prefix ({cached} tokens)"
            time.sleep(0.2)
    # A new proxy process on the same address. Nothing runs on the instances meanwhile: no live KV event can teach
    # it the prefix, only the replay of what the instances published before it existed.
    t0 = time.monotonic()
    second = _proxy(pd_pair, tiny_model, port=first.port)
    with second:
        caught_up = _wait_log(second, r"kv-events decode: caught up from \S+ \((\d+) batches replayed")
        took = time.monotonic() - t0
        assert second.log_path is not None
        log_before = second.log_path.read_text(errors="replace")
        cached = _cached_on_decode(second, tiny_model, prefix + random_prompt(20, 4301))
    print(
        f"\nrestarted proxy: healthy and caught up {took:.1f} s after start, {caught_up[1]} batches replayed"
    )
    assert "kv-events decode: gap" not in log_before, "a live batch, not the catch-up, filled the index"
    assert cached >= len(prefix), f"the restarted proxy's index knows {cached} of {len(prefix)} tokens"
