"""Measure a running vLLM OpenAI server: prefill tokens/s and decode step time vs batch size.

Only the HTTP I/O lives here; the arithmetic (line fit, steady-state gaps, /metrics parsing) is in
``profiledata.py``. Prompts are lists of random token ids, so no tokenizer is needed and no two prefill measurements
share a prefix (the prefix cache would otherwise make prefill look free); the latency method's decode measurements
reuse theirs, so that their prefills are cached. Works against any OpenAI-compatible
``/v1/completions`` that accepts token-id prompts and streams one chunk per token (vLLM's default).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from vllm_disagg.planner.profiledata import (
    DecodePoint,
    PrefillPoint,
    Profile,
    decode_step_from_latencies,
    decode_step_from_streams,
    fit_prefill_attention,
    parse_kv_capacity,
)


@dataclass(frozen=True)
class ProfileConfig:
    prompt_lens: tuple[int, ...] = (128, 512, 1024, 2048)
    repeats: int = 3
    batches: tuple[int, ...] = (1, 4, 16, 32)
    decode_tokens: int = 32  # tokens each stream generates while measuring
    decode_prompt_tokens: int = 128
    # longer prompts than ``decode_prompt_tokens`` the decode step is also measured at (at ``context_batch``
    # streams; shorter ones are skipped): what each context token a stream reads adds to a step
    # (``Profile.decode_s_per_kv_token``); none: the step does not depend on context
    context_lens: tuple[int, ...] = ()
    context_batch: int = 8
    token_id_range: tuple[int, int] = (
        100,
        1000,
    )  # ids drawn uniformly from here (inside any real vocabulary)
    timeout_s: float = 600.0
    seed: int = 0
    tp: int = 1
    api_key: str | None = None  # sent as a bearer token (vLLM's --api-key)
    # "gaps": median inter-chunk gap of streams; "latency": latency difference of non-streamed batches generating
    # decode_tokens vs decode_tokens / 4 tokens (robust when an API server short of CPU delivers chunks in bursts).
    decode_method: Literal["gaps", "latency"] = "gaps"


class _Client:
    def __init__(self, url: str, cfg: ProfileConfig, model: str | None) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.model = model or ""
        self.rng = random.Random(cfg.seed)
        limit = max((*cfg.batches, 1)) + 4
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(
            timeout=cfg.timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        )

    def prompt(self, n: int) -> list[int]:
        lo, hi = self.cfg.token_id_range
        return [self.rng.randint(lo, hi) for _ in range(n)]

    def body(
        self, n_prompt: int, max_tokens: int, stream: bool, prompt: list[int] | None = None
    ) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": self.prompt(n_prompt) if prompt is None else prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def resolve_model(self) -> str:
        if not self.model:
            r = await self.http.get(f"{self.url}/v1/models")
            r.raise_for_status()
            self.model = str(r.json()["data"][0]["id"])
        return self.model

    async def kv_capacity(self) -> int | None:
        try:
            r = await self.http.get(f"{self.url}/metrics")
            return parse_kv_capacity(r.text) if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    async def prefill_once(
        self, n_prompt: int, max_tokens: int = 1, prompt: list[int] | None = None
    ) -> float:
        body = self.body(n_prompt, max_tokens, False, prompt)
        t0 = time.perf_counter()
        r = await self.http.post(f"{self.url}/v1/completions", json=body)
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        return elapsed

    async def stream_once(self, n_prompt: int, max_tokens: int) -> list[float]:
        """Arrival times of the stream's token chunks."""
        times: list[float] = []
        body = self.body(n_prompt, max_tokens, True)
        async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if json.loads(data).get("choices"):
                    times.append(time.perf_counter())
        return times


async def _profile(url: str, cfg: ProfileConfig, model: str | None) -> Profile:
    c = _Client(url, cfg, model)
    try:
        name = await c.resolve_model()
        await c.prefill_once(min(cfg.prompt_lens))  # warm-up: first-request costs are not throughput
        prefill = []
        for n in cfg.prompt_lens:
            samples = [await c.prefill_once(n) for _ in range(cfg.repeats)]
            prefill.append(PrefillPoint(prompt_tokens=n, seconds=statistics.median(samples)))
        rate, per_pair, overhead = fit_prefill_attention(prefill)
        decode = []
        points = [(b, cfg.decode_prompt_tokens) for b in cfg.batches]
        points += [(cfg.context_batch, n) for n in cfg.context_lens if n > cfg.decode_prompt_tokens]
        for batch, context in points:
            if cfg.decode_method == "latency":
                step = await _decode_step_by_latency(c, cfg, batch, context)
            else:
                streams = await asyncio.gather(
                    *(c.stream_once(context, cfg.decode_tokens) for _ in range(batch))
                )
                step = decode_step_from_streams(streams)
            decode.append(DecodePoint(batch=batch, step_s=step, context_tokens=context))
        return Profile(
            source=url,
            model=name,
            tp=cfg.tp,
            prefill_tokens_per_s=rate,
            prefill_overhead_s=overhead,
            prefill_s_per_pair=per_pair,
            prefill_points=prefill,
            decode_points=decode,
            kv_capacity_tokens=await c.kv_capacity(),
            created_unix=time.time(),
        )
    finally:
        await c.http.aclose()


async def _decode_step_by_latency(c: _Client, cfg: ProfileConfig, batch: int, context: int) -> float:
    """``batch`` requests of ``context`` prompt tokens at once, non-streamed, at two output lengths (``repeats``
    rounds each), the step from the difference. The same ``batch`` prompts every round, computed once first: with
    the prefix cache on, the timed requests compute only their last block, so no prefill (whose batching varies
    from round to round: 8 fresh 1,536-token prompts are several chunked iterations) is left in the difference."""
    long_n = cfg.decode_tokens
    short_n = max(2, long_n // 4)
    prompts = [c.prompt(context) for _ in range(batch)]
    await asyncio.gather(*(c.prefill_once(context, 1, p) for p in prompts))
    lat: dict[int, list[float]] = {short_n: [], long_n: []}
    for _ in range(cfg.repeats):
        for n in (short_n, long_n):
            lat[n] += await asyncio.gather(*(c.prefill_once(context, n, p) for p in prompts))
    return decode_step_from_latencies(lat[short_n], lat[long_n], long_n - short_n)


def profile(
    url: str, *, model: str | None = None, cfg: ProfileConfig | None = None, out: str | Path | None = None
) -> Profile:
    """Measure the server at ``url`` (e.g. ``http://127.0.0.1:8000``); write the JSON profile to ``out`` if given."""
    result = asyncio.run(_profile(url, cfg or ProfileConfig(), model))
    if out is not None:
        result.save(out)
    return result
