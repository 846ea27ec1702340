"""What running DisaggConnector costs an instance that serves colocated requests, side by side in one run.

    python benchmarks/connector_overhead.py                 # 4 rounds, 16 streams, 20 s windows
    python benchmarks/connector_overhead.py --rounds 2 --streams 8 --window 10
    python benchmarks/connector_overhead.py --streams 2 --prompt-tokens 1500 --fresh-prompts   # light load, long prompts
    python benchmarks/connector_overhead.py --rate 6 --prompt-tokens 1200 --output-tokens 128   # open loop, Poisson
    python benchmarks/connector_overhead.py --rate 12 --prompt-tokens 1152 --shared-prefix 1024 --output-tokens 64
                                                # as e2e.py's prefix-repetition dataset, per instance at 24 req/s

The adaptive design runs every instance with ``DisaggConnector`` (``kv_both``) so that any request can be handed
off; the colocated design runs plain vLLM. When the two designs are compared, a cost the connector adds to every
step would read as a worse policy. This measures that cost alone: two instances of the tiny model, one plain and
one with the connector, each pinned to its own core, both under the same closed-loop load **at the same time**
(so host drift, which moves this VM's step time by 10-20% from one minute to the next, hits both alike), every
request colocated (no ``kv_transfer_params``). Each round then swaps the cores, so a faster core favours each side
once. Per round and instance, over the requests that finished within the window: their output tokens per second
of window, their median TTFT and TPOT, and their p95 TPOT; the ratio connector / plain is taken within each round,
and the run prints the geometric mean of the ratios and their range.

The load: ``--streams`` concurrent streamed completions per instance, ``--prompt-tokens`` fixed token ids
(distinct per stream) and ``--output-tokens`` tokens each (``ignore_eos``), as `vllm bench serve` would stream
them, from ``benchmarks/loadgen.py`` (one thread: uvloop, httptools, keep-alive connections). The load generator is
this process, not pinned: it shares the two cores with the instances, and which core an instance sits on moved its
TTFT by up to ~1.5x on the development VM, which is what swapping the cores every round evens out. Needs
``.artifacts/tiny-model`` (``make setup`` builds it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import loadgen  # noqa: E402

from vllm_disagg.tools.harness import (  # noqa: E402
    VLLMServer,
    disagg_connector_args,
    free_port,
    start_many,
    tiny_model_args,
)

MODEL = str(ROOT / ".artifacts" / "tiny-model")
PREFIXES = 4  # benchmarks/e2e.py's prefix-repetition dataset: 4 shared prefixes
ENGINE = ["--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]  # benchmarks/e2e.py's limits


@dataclass
class Load:
    """Closed-loop streamed requests against one instance (``loadgen``'s keep-alive connections): the output tokens,
    TTFTs and TPOTs of the requests that finish inside the window."""

    url: str
    streams: int
    prompt_tokens: int
    output_tokens: int
    fresh_prompts: bool = False  # a new prompt for every request (no prefix-cache hits), not one per stream
    # > 0: open loop instead, requests arriving at this rate (Poisson, the same arrivals for both instances), each
    # with a fresh prompt, as a benchmark client sends them (``streams`` is then unused)
    rate: float = 0.0
    # > 0: each prompt starts with one of ``PREFIXES`` shared prefixes of this many tokens (prefix-cache hits, as in
    # benchmarks/e2e.py's prefix-repetition dataset); the rest of the prompt is the request's own
    shared_prefix: int = 0
    results: list[loadgen.Result] = field(default_factory=list)
    errors: int = 0

    def request(self, i: int, k: int = 0) -> bytes:
        """Stream ``i``'s request; ``k`` (the stream's request count) changes the prompt when ``fresh_prompts``."""
        shift = 7 * i + (1009 * k if self.fresh_prompts else 0)
        prefix = [1000 + (101 * ((i + k) % PREFIXES) + j) % 900 for j in range(self.shared_prefix)]
        # the rest is distinct per stream (and per request with fresh prompts)
        own = [100 + (shift + j) % 900 for j in range(self.prompt_tokens - len(prefix))]
        body = {
            "model": MODEL,
            "prompt": prefix + own,
            "max_tokens": self.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        return loadgen.build_request(self.url, "/v1/completions", json.dumps(body).encode())

    async def run(self, window: tuple[float, float]) -> None:
        """Keep ``streams`` requests in flight until the window closes (or send them at ``rate``); keep those that
        finish inside it."""
        start, end = window
        if self.rate > 0:
            await self._open_loop(start, end)
            return

        async def stream(i: int) -> None:
            conn, k = loadgen.Connection(self.url), 0
            raw = self.request(i, k)
            try:
                while time.perf_counter() < end:
                    try:
                        res = await conn.request(raw)
                    except (ConnectionError, OSError):
                        self.errors += 1
                        await asyncio.sleep(0.5)
                        continue
                    self._keep(res, start, end)
                    if self.fresh_prompts:
                        k += 1
                        raw = self.request(i, k)
            finally:
                conn.close()

        await asyncio.gather(*(stream(i) for i in range(self.streams)))

    def _keep(self, res: loadgen.Result, start: float, end: float) -> None:
        """Count a failed answer; keep a good one that finished inside the window."""
        if res.status != 200:
            self.errors += 1
        elif start <= res.start + res.total <= end:
            self.results.append(res)

    async def _open_loop(self, start: float, end: float) -> None:
        arrivals = random.Random(1)  # the same seed for both instances: the same arrival times

        async def one(k: int) -> None:
            conn = loadgen.Connection(self.url)
            try:
                res = await conn.request(self.request(0, k))
            except (ConnectionError, OSError):
                self.errors += 1
                return
            finally:
                conn.close()
            self._keep(res, start, end)

        tasks, k = [], 0
        at = time.perf_counter()
        while at < end:
            at += arrivals.expovariate(self.rate)
            await asyncio.sleep(max(at - time.perf_counter(), 0.0))
            tasks.append(asyncio.ensure_future(one(k)))
            k += 1
        await asyncio.gather(*tasks)

    def summary(self, window_s: float) -> dict[str, Any]:
        done = self.results
        tpots = [(r.total - r.ttft) / max(self.output_tokens - 1, 1) for r in done]
        return {
            "tokens_per_s": sum(r.events - 1 for r in done)
            / window_s,  # one SSE event per token, [DONE] aside
            "ttft_p50_ms": 1e3 * statistics.median(r.ttft for r in done) if done else None,
            "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else None,
            # the tail: streams that waited out other requests' prefills (where the e2e designs differ)
            "tpot_p95_ms": 1e3 * statistics.quantiles(tpots, n=20)[-1] if len(tpots) >= 2 else None,
            "requests": len(done),
            "errors": self.errors,
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _ms(v: float | None) -> str:
    return f"{v:.2f} ms" if v is not None else "-"


def _x(v: float | None) -> str:
    return f"{v:.3f}x" if v is not None else "-"


def one_round(cores: dict[str, str], ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both instances up at once, loaded at once: {name: {core, tokens_per_s, ttft_p50_ms, tpot_p50_ms, ...}}."""
    servers = {
        name: VLLMServer(
            MODEL,
            args=[
                *tiny_model_args(),
                *ENGINE,
                *(disagg_connector_args(free_port()) if name == "connector" else []),
            ],
            cpu_cores=core,
            name=f"{name}-core{core}",
        )
        for name, core in cores.items()
    }
    start_many(list(servers.values()))
    try:
        loads = {
            name: Load(
                s.url,
                ns.streams,
                ns.prompt_tokens,
                ns.output_tokens,
                ns.fresh_prompts or ns.rate > 0,
                ns.rate,
                ns.shared_prefix,
            )
            for name, s in servers.items()
        }
        now = time.perf_counter()
        window = (now + ns.warmup, now + ns.warmup + ns.window)

        async def both() -> None:
            await asyncio.gather(*(load.run(window) for load in loads.values()))

        loadgen.run(both)
        return {name: {"core": cores[name], **load.summary(ns.window)} for name, load in loads.items()}
    finally:
        for s in servers.values():
            s.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds; odd ones swap the two instances' cores")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams per instance")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="open loop: requests per second per instance (Poisson, fresh prompts) instead of --streams",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="a new prompt for every request (each one prefilled whole) instead of one prompt per stream",
    )
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help=f"tokens of each prompt taken from one of {PREFIXES} shared prefixes (prefix-cache hits)",
    )
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window opens")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured per round")
    ap.add_argument("--json", default=None, help="write the rounds and the summary here")
    ns = ap.parse_args(argv)
    if not Path(MODEL).exists():
        raise SystemExit(f"{MODEL} is missing: run `make setup` first")
    rounds = []
    for r in range(ns.rounds):
        cores = {"plain": "0", "connector": "1"} if r % 2 == 0 else {"plain": "1", "connector": "0"}
        res = one_round(cores, ns)
        conn, plain = res["connector"], res["plain"]
        ratio = conn["tokens_per_s"] / plain["tokens_per_s"]
        tpot_ratio = _ratio(conn["tpot_p50_ms"], plain["tpot_p50_ms"])
        ttft_ratio = _ratio(conn["ttft_p50_ms"], plain["ttft_p50_ms"])
        tpot_p95_ratio = _ratio(conn["tpot_p95_ms"], plain["tpot_p95_ms"])
        rounds.append(
            {
                "round": r,
                "results": res,
                "throughput_ratio": ratio,
                "tpot_ratio": tpot_ratio,
                "ttft_ratio": ttft_ratio,
                "tpot_p95_ratio": tpot_p95_ratio,
            }
        )
        print(
            f"round {r}: "
            + " | ".join(
                f"{name} (core {cores[name]}) {x['tokens_per_s']:.0f} tok/s, TTFT p50 {_ms(x['ttft_p50_ms'])}, "
                f"TPOT p50 {_ms(x['tpot_p50_ms'])}, p95 {_ms(x['tpot_p95_ms'])}"
                for name, x in (("plain", plain), ("connector", conn))
            )
            + f" | connector/plain: throughput {ratio:.3f}x, TTFT {_x(ttft_ratio)}, TPOT {_x(tpot_ratio)}, "
            f"TPOT p95 {_x(tpot_p95_ratio)}",
            flush=True,
        )
    summary: dict[str, Any] = {
        "streams": ns.streams,
        "prompt_tokens": ns.prompt_tokens,
        "output_tokens": ns.output_tokens,
        "window_s": ns.window,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    parts = []
    for key in ("throughput", "ttft", "tpot", "tpot_p95"):
        values = [r[f"{key}_ratio"] for r in rounds if r[f"{key}_ratio"]]
        if not values:
            continue
        gmean = math.exp(statistics.fmean(math.log(x) for x in values))
        summary[f"{key}_ratio_gmean"] = gmean
        summary[f"{key}_ratio_range"] = [min(values), max(values)]
        parts.append(f"{key} {gmean:.3f}x [{min(values):.3f}-{max(values):.3f}]")
    print(f"connector / plain, geometric mean of {ns.rounds} rounds [range]: " + ", ".join(parts))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"rounds": rounds, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
