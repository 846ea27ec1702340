"""LMCache tier benchmark: time to first token of a long prompt computed fresh, served from vLLM's own prefix cache,
and loaded from the LMCache tier beneath it (CPU memory; ``--disk`` adds LMCache's local-disk tier and clears the
memory one first), side by side in one run, with ratios against the fresh computation.

    .venv-lmcache/bin/python benchmarks/tier.py [-n 20] [--tokens 1500] [--disk] [--json out.json]

Needs lmcache in the running environment (scripts/setup-lmcache.sh). Per prompt, in this order: fresh (a new
prompt), local (the same prompt again), tier (after ``/reset_prefix_cache``, the same prompt again). Each answer is
checked against the fresh one, and each tier run against vLLM's own count of tokens loaded from outside.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_info, percentile, render_table  # noqa: E402

from vllm_disagg.tools.harness import LMCacheServer, VLLMServer, tiny_model_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = str(ROOT / ".artifacts" / "tiny-model")
ENV = {"VLLM_SERVER_DEV_MODE": "1", "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}


def _external_tokens(server: VLLMServer) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external_kv_transfer"' in line
    )


def _ttft(client: httpx.Client, server: VLLMServer, prompt: list[int]) -> tuple[float, list[int]]:
    """One greedy token: the whole request is the time to first token."""
    body = {"model": MODEL_DIR, "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    t = time.perf_counter()
    r = client.post(server.url + "/v1/completions", json=body)
    dt = time.perf_counter() - t
    r.raise_for_status()
    return dt, list(r.json()["choices"][0]["token_ids"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20, help="prompts (each is run fresh, local and from the tier)")
    ap.add_argument("--tokens", type=int, default=1500, help="prompt length")
    ap.add_argument("--disk", action="store_true", help="add a local-disk tier; clear LMCache's memory first")
    ap.add_argument("--json")
    ns = ap.parse_args(argv)
    disk = Path(tempfile.mkdtemp(prefix="lmcache-disk-")) if ns.disk else None
    l2 = ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)})] if disk else []
    times: dict[str, list[float]] = {"fresh": [], "local prefix cache": [], "tier": []}
    loaded: list[float] = []
    rng = random.Random(7)
    with LMCacheServer("", env=ENV, l2=l2, name="bench-lmcache") as lmc:
        ktc = json.dumps(lmc.mp_config())
        args = [*tiny_model_args(), "--kv-transfer-config", ktc]
        server = VLLMServer(MODEL_DIR, args=args, env=ENV, cpu_cores="0", name="bench-tier")
        with server, httpx.Client(timeout=120) as client:
            _ttft(client, server, [rng.randrange(5, 2000) for _ in range(ns.tokens)])  # warm-up
            for _ in range(ns.n):
                prompt = [rng.randrange(5, 2000) for _ in range(ns.tokens)]
                dt, fresh = _ttft(client, server, prompt)
                times["fresh"].append(dt)
                dt, again = _ttft(client, server, prompt)
                times["local prefix cache"].append(dt)
                assert again == fresh, "local prefix-cache answer differs from the fresh one"
                if disk is not None:
                    time.sleep(0.5)  # L2 stores are written behind L1's
                    client.post(lmc.url + "/cache/clear", json={"tier": "l1"}).raise_for_status()
                client.post(server.url + "/reset_prefix_cache").raise_for_status()
                before = _external_tokens(server)
                dt, tiered = _ttft(client, server, prompt)
                times["tier"].append(dt)
                assert tiered == fresh, "tier answer differs from the fresh one"
                time.sleep(0.2)  # the counters land just after the response
                loaded.append(_external_tokens(server) - before)
    base = percentile(times["fresh"], 50)
    rows = [
        {
            "path": k,
            "ttft_p50_ms": f"{percentile(v, 50) * 1000:.1f}",
            "ttft_p90_ms": f"{percentile(v, 90) * 1000:.1f}",
            "vs fresh (p50)": f"{percentile(v, 50) / base:.2f}x",
        }
        for k, v in times.items()
    ]
    tier_name = "LMCache CPU memory + local disk (memory cleared)" if disk else "LMCache CPU memory"
    print(f"\nLMCache tier, {ns.n} prompts of {ns.tokens} tokens, tiny model, tier: {tier_name}")
    print(f"tokens loaded from the tier per request: min {min(loaded):.0f}, max {max(loaded):.0f}")
    print(render_table(rows, ["path", "ttft_p50_ms", "ttft_p90_ms", "vs fresh (p50)"]))
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {"machine": machine_info(), "tier": tier_name, "ttft_s": times, "loaded": loaded}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
