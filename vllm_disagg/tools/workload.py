"""A mixed streaming workload (short chat-like streams while long prompts arrive) and its latency statistics.

Used by the demo and the end-to-end benchmark. Each request records when every streamed chunk arrived, so the
statistics are the ones `vllm bench serve` reports: TTFT = first chunk, ITL = every gap between chunks, pooled;
TPOT = (E2E - TTFT) / (chunks - 1) per request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from vllm_disagg.planner.metrics import percentile


@dataclass(frozen=True)
class RequestSpec:
    at_s: float  # send time, relative to the start
    kind: str  # "short" | "long"
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    spec: RequestSpec
    target: str
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    path: str = ""
    error: str = ""
    tokens: int = 0  # streamed events (tokens) received

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    def gaps(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = max(self.tokens, len(self.chunk_times))
        if n < 2 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)


def mixed_workload(
    duration_s: float,
    short_rate: float,
    long_rate: float,
    short_prompt: int = 32,
    short_output: int = 64,
    long_prompt: int = 1800,
    long_output: int = 4,
    vocab: tuple[int, int] = (4, 2000),
    seed: int = 0,
) -> list[RequestSpec]:
    """Poisson arrivals of short streaming requests and long-prompt requests, deterministic for a seed."""
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    for kind, rate, plen, out in (
        ("short", short_rate, short_prompt, short_output),
        ("long", long_rate, long_prompt, long_output),
    ):
        t = rng.expovariate(rate) if rate > 0 else duration_s
        while t < duration_s:
            prompt = [rng.randint(*vocab) for _ in range(plen)]
            specs.append(RequestSpec(at_s=t, kind=kind, prompt=prompt, max_tokens=out))
            t += rng.expovariate(rate)
    specs.sort(key=lambda s: s.at_s)
    return specs


async def _one(
    client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, res: RequestResult
) -> None:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.path = r.headers.get("x-disagg-path", "direct")
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                return
            # One timestamp per network read that carries tokens: events that arrive together reach the user
            # together, so they are one gap, not several zero-length ones.
            async for raw in r.aiter_raw():
                n = raw.count(b"data: ") - raw.count(b"data: [DONE]")
                if n > 0:
                    res.chunk_times.append(time.perf_counter())
                    res.tokens += n
    except httpx.HTTPError as exc:
        res.error = repr(exc)


async def run_workload(
    specs: Sequence[RequestSpec],
    targets: Sequence[str],
    model: str,
    progress: Callable[[int, int], None] | None = None,
) -> list[RequestResult]:
    """Send each request at its time; round-robin over ``targets`` (one proxy, or colocated replicas)."""
    results = [RequestResult(spec=s, target=targets[i % len(targets)]) for i, s in enumerate(specs)]
    done = 0
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=None)
    ) as client:
        t0 = time.perf_counter()

        async def launch(res: RequestResult) -> None:
            nonlocal done
            delay = res.spec.at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await _one(client, res.target, model, res.spec, res)
            done += 1
            if progress is not None:
                progress(done, len(results))

        await asyncio.gather(*(launch(r) for r in results))
    return results


@dataclass(frozen=True)
class Summary:
    requests: int
    errors: int
    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    itl_p99: float
    tpot_p50: float
    tpot_p95: float
    paths: dict[str, int]


def summarize(results: Sequence[RequestResult], kind: str | None = "short") -> Summary:
    """Latency statistics over one kind of request (default: the short streams whose ITL suffers)."""
    rs = [r for r in results if kind is None or r.spec.kind == kind]
    ok = [r for r in rs if not r.error and r.chunk_times]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps()]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    paths: dict[str, int] = {}
    for r in results:
        mode = r.path.split(";", 1)[0] or "none"
        paths[mode] = paths.get(mode, 0) + 1
    return Summary(
        requests=len(rs),
        errors=len(rs) - len(ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        itl_p50=percentile(gaps, 50),
        itl_p95=percentile(gaps, 95),
        itl_p99=percentile(gaps, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p95=percentile(tpots, 95),
        paths=paths,
    )
