"""Proxy overhead benchmark: added time-to-first-token and max req/s of the proxy vs direct calls, side by side.

    python benchmarks/proxy.py mock      # a fast fake backend (isolates the proxy's own cost)
    python benchmarks/proxy.py vllm      # a real vLLM CPU instance on the tiny model

Each mode measures, in one run: sequential streaming requests (TTFT = first byte) direct and through the proxy,
interleaved so both see the same machine state; then closed-loop throughput at a fixed concurrency for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_info, percentile, render_table  # noqa: E402

from vllm_disagg.tools.harness import ProxyServer, VLLMServer, free_port, tiny_model_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = str(ROOT / ".artifacts" / "tiny-model")


async def _ttft(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> float:
    t = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            return time.perf_counter() - t
    return time.perf_counter() - t


async def _throughput(url: str, body: dict[str, object], concurrency: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                r = await client.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                done += 1

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t)


async def measure(
    direct: str, proxies: dict[str, str], model: str, n: int, concurrency: int, seconds: float
) -> dict[str, dict[str, float]]:
    """Per proxy: added TTFT (p50/p99, paired with a direct request each time) and req/s relative to direct."""
    body = {
        "model": model,
        "prompt": "Hello, how are you today?",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    d_t: list[float] = []
    p_t: dict[str, list[float]] = {name: [] for name in proxies}
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(5):  # warm every path
            await _ttft(client, direct, body)
            for url in proxies.values():
                await _ttft(client, url, body)
        for _ in range(n):  # interleaved, so every path sees the same machine state
            d_t.append(await _ttft(client, direct, body))
            for name, url in proxies.items():
                p_t[name].append(await _ttft(client, url, body))
    nb = dict(body, stream=False)
    rps_direct = await _throughput(direct, nb, concurrency, seconds)
    out: dict[str, dict[str, float]] = {
        "direct": {"ttft_p50_ms": 1000 * percentile(d_t, 50), "rps": rps_direct, "rps_ratio": 1.0}
    }
    for name, url in proxies.items():
        added = [p - d for p, d in zip(p_t[name], d_t, strict=True)]
        rps = await _throughput(url, nb, concurrency, seconds)
        out[name] = {
            "ttft_p50_ms": 1000 * percentile(p_t[name], 50),
            "added_p50_ms": 1000 * percentile(added, 50),
            "added_p99_ms": 1000 * percentile(added, 99),
            "rps": rps,
            "rps_ratio": rps / rps_direct,
        }
    return out


def _wait_http(url: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["mock", "vllm"])
    ap.add_argument("-n", type=int, default=200, help="sequential requests per path for TTFT")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json")
    ap.add_argument(
        "--vllm-router",
        default=shutil.which("vllm-router"),
        help="path to the Rust vllm-router binary (pip install vllm-router) to measure side by side",
    )
    ns = ap.parse_args(argv)
    backend_port = free_port()
    backend: subprocess.Popen[bytes] | VLLMServer
    if ns.mode == "mock":
        model = "mock"
        backend = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "mock_backend.py"), str(backend_port), model]
        )
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{backend_port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{backend_port}"
    else:
        model = MODEL_DIR
        backend = VLLMServer(
            MODEL_DIR, args=tiny_model_args(), cpu_cores="0", port=backend_port, name="bench-vllm"
        )
        backend.start().wait_healthy()
        url = backend.url
    proxy = ProxyServer(
        "unused",
        args=["--both", url, "--tokenizer", MODEL_DIR, "--policy", "least-loaded", "--log-level", "warning"],
    )
    router: subprocess.Popen[bytes] | None = None
    try:
        proxy.start().wait_healthy(60)
        targets = {"vllm-disagg": proxy.url}
        if ns.vllm_router:
            rport = free_port()
            router = subprocess.Popen(
                [ns.vllm_router, "--host", "127.0.0.1", "--port", str(rport), "--worker-urls", url,
                 "--policy", "round_robin"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if _wait_http(f"http://127.0.0.1:{rport}/v1/models", 30):
                targets["vllm-router"] = f"http://127.0.0.1:{rport}"
            else:
                print("vllm-router did not come up; measuring vllm-disagg only", file=sys.stderr)
        res = asyncio.run(measure(url, targets, model, ns.n, ns.concurrency, ns.seconds))
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        proxy.stop()
        if isinstance(backend, VLLMServer):
            backend.stop()
        else:
            backend.terminate()
            backend.wait(10)
    rows = [{"path": name, **{k: f"{v:.3f}" for k, v in vals.items()}} for name, vals in res.items()]
    print(
        f"proxy overhead, backend = {ns.mode}, {ns.n} sequential streaming requests, concurrency {ns.concurrency}"
    )
    print(render_table(rows, ["path", "ttft_p50_ms", "added_p50_ms", "added_p99_ms", "rps", "rps_ratio"]))
    if ns.json:
        Path(ns.json).write_text(
            json.dumps({"machine": machine_info(), "mode": ns.mode, "results": res}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
