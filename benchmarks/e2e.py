"""End-to-end benchmark: `vllm bench serve` (the real tool, unchanged) against three designs on the same two cores.

    python benchmarks/e2e.py [--designs pd,colocated,adaptive] [--rates 1,2,4] [--repeats 3] [--num-prompts 40]
                             [--datasets random-long,prefix-repetition,chat-mix] [--out .artifacts/e2e] [--profile]

Designs, each on two vLLM instances (one core each) behind the proxy, so all pay the same proxy hop:
  * ``pd``: a fixed 1 prefill + 1 decode pair; every request transfers (``--policy always-transfer``).
  * ``colocated``: 2 replicas without a KV connector, least-loaded; vLLM's chunked prefill with the
    ``--max-num-batched-tokens`` given by ``--colocated-batched-tokens`` (``--tune-colocated`` picks it first: a
    sweep at the highest rate of the chat mix, best goodput then best p95 TPOT).
  * ``adaptive``: the same two instances as ``--both`` with DisaggConnector and the proxy's default policy, free to
    transfer either way or serve colocated per request; same engine settings as ``colocated``.
Datasets: long random prompts, prefix repetition, and a chat-like mix (short streams with long prompts among them).
Every (dataset, rate, repeat) point draws its own prompts, the same in every design. Prints a table of goodput and
p95 TTFT/TPOT per design (median [range] over repeats) with adaptive's verdict, writes results.json (one entry per
run: ``{"design", "dataset", "rate", "repeat", "bench"}``; a rerun of some designs replaces only theirs) and plots
goodput, p95 TTFT and p95 TPOT against rate.

With --profile, each design's instances are profiled (``vllm_disagg.planner.profile``) once they are up and before
any benchmark, into profile-<design>-<instance>.json next to results.json, and results.json gains a "replay" section
(engine settings, dataset lengths, seed, instance counts, profile files) so the simulator can replay every measured
point: ``vllm_disagg.planner.validate``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_summary import kind_rows, spreads, summary_rows, verdicts  # noqa: E402
from report import (  # noqa: E402
    Histogram,
    cpu_description,
    cpu_ticks,
    histogram,
    histogram_delta,
    histogram_quantile,
    machine_info,
    metric_samples,
    percentile,
    render_table,
    steal_share,
)
from stack_cpu import StackCpu, foreign_cpu_s  # noqa: E402

from vllm_disagg.planner.validate import run_arrivals  # noqa: E402
from vllm_disagg.tools.harness import (  # noqa: E402
    ProxyServer,
    VLLMServer,
    disagg_connector_args,
    free_port,
    start_many,
    tiny_model_args,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / ".artifacts" / "tiny-model")

# Engine limits passed explicitly (the values vLLM's CPU platform defaults to for an API server), so a replay
# knows them rather than guessing vLLM's per-platform defaults.
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
# The colocated designs' chunked-prefill budget: --tune-colocated's pick on this machine (docs in the README).
COLOCATED_BATCHED_TOKENS = 2048
TUNE_CANDIDATES = (256, 512, 1024, 2048)
TUNE_PROMPTS = 30
DESIGNS = ("pd", "colocated", "adaptive")
# Ablations that take adaptive's two changes from colocated one at a time, to say which one costs what:
# colocated-cost is colocated's instances behind adaptive's policy (tokenizer, prefix index, cost model; no
# connector), adaptive-ll is adaptive's instances (DisaggConnector loaded) behind colocated's least-loaded policy,
# their side channels not given to the proxy, so every request is served where it lands, as in colocated;
# adaptive-ungated is adaptive with the split's TTFT gate off (--no-split-ttft-gate), adaptive-count adaptive with a
# stall priced by the number of streams it hits, not their lengths (--no-length-weighted-stall).
ABLATIONS = ("colocated-cost", "adaptive-ll", "adaptive-ungated", "adaptive-count")
# Each (dataset, rate) point draws its own prompts (seed SEED + its index, the same in both designs): with one seed
# for all, every point after the first would find its prompts in the prefix cache and prefill for free.
SEED = 0
WARM_UP_SEED = 1000
ZERO_LOAD_SEED = 2000
TUNE_SEED = 3000
ZERO_LOAD_PROMPTS = 24
SETTLE_S = 10.0  # idle time between the profile and the first benchmark point
ZERO_LOAD_RATE = 2.0  # one request every 0.5 s; one alone takes ~0.2 s
DETAIL_KEYS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
)  # --save-detailed's per-request lists: kept in each point's own file


# vllm bench serve's "custom" dataset: a file written per point by prompt_file(), lengths per request.
FILE_BACKED = ["--dataset-name", "custom", "--custom-output-len", "-1", "--skip-chat-template"]
DATASETS: dict[str, list[str]] = {
    "random-long": FILE_BACKED,  # 1500 random tokens -> 64 (prompt_file: no two prompts share a prefix)
    "prefix-repetition": [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "64",
    ],
    "chat-mix": FILE_BACKED,
}  # fmt: skip
# The chat mix: short streams (most requests) with long prompts arriving among them, as in `vllm-disagg demo`.
CHAT_SHORT = (64, 128)  # prompt, output tokens
CHAT_LONG = (1500, 16)
CHAT_LONG_SHARE = 0.25
# The zero-load calibration's batched run: short prompts and long streams, several at once per decoding instance,
# so its TPOT is the decode step at a batch (with what each streamed token costs the stack) and not prefill stalls.
DECODE_BATCH_SHAPE = (128, 128)
DECODE_BATCH_STREAMS = 4  # streams per decoding instance
DECODE_BATCH_WAVES = 3  # requests sent: this many times the concurrency

# Each dataset's token lengths as a replay sees them (prefix repetition: shared prefix + unique suffix).
DATASET_LENGTHS: dict[str, dict[str, int]] = {
    "random-long": {"input_len": 1500, "output_len": 64},
    "prefix-repetition": {
        "input_len": 1024 + 128,
        "output_len": 64,
        "shared_prefix_len": 1024,
        "num_prefixes": 4,
    },
    "chat-mix": {
        "input_len": round(CHAT_LONG_SHARE * CHAT_LONG[0] + (1 - CHAT_LONG_SHARE) * CHAT_SHORT[0]),
        "output_len": round(CHAT_LONG_SHARE * CHAT_LONG[1] + (1 - CHAT_LONG_SHARE) * CHAT_SHORT[1]),
    },
}


def prompt_file(dataset: str, n: int, seed: int, out: Path) -> Path:
    """Write ``n`` requests of a file-backed dataset (vllm bench's custom JSONL: prompt text and output_tokens).

    Prompts are random token ids of the tiny model's vocabulary decoded to text (``random_text``: re-tokenized
    they come out at the drawn length or one more), and no two prompts share a prefix, in a point or across
    points. vllm bench's own random dataset does not guarantee that: its prompts are runs of consecutive ids from
    a random start, so on this 2,048-token vocabulary 9-36% of a point's prompts were prompts of earlier points,
    prefilled from the prefix cache.
    """
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    rng = random.Random(f"{dataset}-{seed}")
    path = out / f"{dataset}-{seed}.jsonl"
    with path.open("w") as f:
        for _ in range(n):
            plen, olen = request_shape(dataset, rng)
            text = random_text(tok, rng, plen)
            f.write(json.dumps({"prompt": text, "output_tokens": olen}) + "\n")
    return path


def random_text(tok: Any, rng: Any, tokens: int) -> str:
    """Text of random token ids that re-tokenizes to ``tokens`` tokens (or within one): decoded ids re-tokenize to
    ~18% more on this vocabulary, so the text is cut back to its first ``tokens`` tokens until it holds."""
    text = str(tok.decode([rng.randint(4, tok.vocab_size - 1) for _ in range(tokens)]))
    for _ in range(5):
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) <= tokens + 1:
            break
        text = str(tok.decode(ids[:tokens]))
    return text


def request_shape(dataset: str, rng: Any) -> tuple[int, int]:
    """(prompt, output) tokens of one request of a file-backed dataset."""
    if dataset == "chat-mix":
        return CHAT_LONG if rng.random() < CHAT_LONG_SHARE else CHAT_SHORT
    if dataset == "decode-batch":
        return DECODE_BATCH_SHAPE
    lengths = DATASET_LENGTHS[dataset]
    return lengths["input_len"], lengths["output_len"]


def dataset_args(dataset: str, n: int, seed: int, out: Path) -> list[str]:
    """vllm bench serve's dataset flags for one point (file-backed datasets write their file for the seed)."""
    if dataset == "decode-batch" or DATASETS[dataset] is FILE_BACKED:
        return [*FILE_BACKED, "--dataset-path", str(prompt_file(dataset, n, seed, out))]
    return DATASETS[dataset]


def engine_args(batched_tokens: int = MAX_NUM_BATCHED_TOKENS) -> list[str]:
    return ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(batched_tokens)]


def logged_flag(log: Path | None, name: str) -> bool | None:
    """A boolean engine setting as vLLM's EngineCore logged it at start-up (``name=True``), None if absent."""
    text = log.read_text(errors="replace") if log is not None and log.exists() else ""
    for value in ("True", "False"):
        if f"{name}={value}" in text:
            return value == "True"
    return None


def profile_instances(servers: list[VLLMServer], design: str, out: Path) -> dict[str, str]:
    """Profile each instance of a design in turn; returns {instance name: profile file}.

    One at a time: on 2 cores a second profile client and engine would starve the first's API server, whose
    streams then coalesce tokens into one chunk and read as zero-length decode steps. Prompt lengths bracket the
    datasets' (1152-1500 tokens). Decode streams use short prompts so that every batch's prefills fit one
    iteration and the batch decodes together (a 1500-token prompt would stagger them by an iteration each); on
    this model a decode step's cost barely depends on its context. Decode steps come from latencies, not chunk
    gaps: here an API server short of CPU at times delivers a whole stream in one burst.
    """
    from vllm_disagg.planner.profile import ProfileConfig, profile

    cfg = ProfileConfig(
        prompt_lens=(256, 768, 1152, 1500, 2000),
        repeats=5,
        batches=(1, 2, 4, 8, 16),
        decode_tokens=96,
        decode_prompt_tokens=128,
        context_lens=(1536,),
        decode_method="latency",
    )
    files = {s.name: f"profile-{design}-{s.name}.json" for s in servers}
    for s in servers:
        profile(s.url, model=MODEL, cfg=cfg, out=out / files[s.name])
    return files


def zero_load(url: str, dataset: str, design: str, out: Path, slo: str, cpu: StackCpu) -> dict[str, Any]:
    """Requests one at a time through the proxy, each meeting an idle cluster: latency with no queueing or batching.

    Arrivals are evenly spaced (gamma gaps of shape 100 at ZERO_LOAD_RATE), so no request starts while another
    runs or finishes: back to back (``--max-concurrency 1`` at rate inf) here delivered most P/D streams in one
    burst at their end. What this adds to the engines' own prefill and decode time (client, proxy hop,
    tokenization, the API server, for P/D the hand-off to decode) is what a replay adds per request. The stack's
    CPU over it (``cpu``) is one stream's cost per token, one token per engine step, beside ``zero_load_batch``'s
    several tokens a step: the two apart say how much of the stack's work is per step and how much per token.
    """
    name = f"zero-load-{design}-{dataset}.json"
    extra = ["--max-concurrency", "1", "--burstiness", "100", "--save-detailed"]
    args = dataset_args(dataset, ZERO_LOAD_PROMPTS, ZERO_LOAD_SEED, out)
    bench, stack = with_stack_cpu(cpu, lambda: bench_serve(url, args, ZERO_LOAD_RATE, ZERO_LOAD_PROMPTS, out / name,
                                  slo, seed=ZERO_LOAD_SEED, extra=extra))  # fmt: skip
    keys = ("median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "total_input_tokens", "total_output_tokens",
            "completed", "foreign_cpu_cores")  # fmt: skip
    return {"file": name, **{k: bench.get(k) for k in keys}, "late_first_chunk_share": late_share(bench),
            **stack, **per_request_ms(bench)}  # fmt: skip


def with_stack_cpu(
    cpu: StackCpu, serve: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, object]]:
    """``serve``'s vllm bench result, with the stack's CPU sampled over its requests' window (``StackCpu.stop``)."""
    cpu.start()
    try:
        bench = serve()
    except BaseException:
        cpu.stop()
        raise
    return bench, cpu.stop(request_window(bench))


def zero_load_batch(
    url: str,
    design: str,
    decoders: int,
    out: Path,
    slo: str,
    cpu: StackCpu,
    per_instance: int = DECODE_BATCH_STREAMS,
) -> dict[str, Any]:
    """Streams several at a time per decoding instance (``per_instance``), short prompts and long outputs.

    Beside ``zero_load`` (one stream alone) this gives the TPOT at a batch, measured through the same stack: the
    two together say how much of a token's time is the engine's step and how much each running stream adds, which
    a profile taken without streaming cannot show (``validate.ZeroLoad``). Its arrivals are recorded so that a
    replay can run it as it ran, and the stack's CPU over it (``cpu``: the API servers, proxy and client, per
    emitted token) is what the replay charges each token the cluster emits.
    """
    streams = per_instance * decoders
    n = streams * DECODE_BATCH_WAVES
    name = f"zero-load-batch-{design}.json"
    args = dataset_args("decode-batch", n, ZERO_LOAD_SEED + 1, out)
    bench, stack = with_stack_cpu(cpu, lambda: bench_serve(url, args, math.inf, n, out / name, slo,
                                  seed=ZERO_LOAD_SEED + 1,
                                  extra=["--max-concurrency", str(streams), "--save-detailed"]))  # fmt: skip
    return {"file": name, "concurrency": streams, "median_tpot_ms": bench.get("median_tpot_ms"),
            "late_first_chunk_share": late_share(bench), "arrivals": run_arrivals(bench),
            "total_output_tokens": bench.get("total_output_tokens"), **stack,
            **per_request_ms(bench)}  # fmt: skip


def instance_metrics(servers: Sequence[VLLMServer]) -> dict[str, str]:
    """Each instance's /metrics text now, by instance name (none for an instance that did not answer): one read
    that the prefix-cache counters and the engine phases are both taken from."""
    import httpx

    texts = {}
    for s in servers:
        with contextlib.suppress(httpx.HTTPError):
            texts[s.name] = httpx.get(f"{s.url}/metrics", timeout=10).text
    return texts


def prefix_cache_tokens(metrics: dict[str, str]) -> tuple[float, float]:
    """(hit, queried) prompt tokens of vLLM's prefix caches so far, summed over the instances' /metrics texts."""
    counts = [prefix_cache_counts(text) for text in metrics.values()]
    return sum(h for h, _ in counts), sum(q for _, q in counts)


def prefix_cache_counts(metrics: str) -> tuple[float, float]:
    """(hit, queried) prompt tokens from one vLLM /metrics text (its prefix-cache counters, every engine)."""
    hit = sum(v for _, v in metric_samples(metrics, "vllm:prefix_cache_hits_total"))
    queried = sum(v for _, v in metric_samples(metrics, "vllm:prefix_cache_queries_total"))
    return hit, queried


# vLLM's own per-request histograms, by the name a results entry gives them: where a request's TTFT went inside the
# instance (queued in the engine, computing its prompt) against the API server's TTFT and the client's.
ENGINE_PHASES = {
    "ttft_ms": "vllm:time_to_first_token_seconds",  # the API server's: request in, first token out
    "queue_ms": "vllm:request_queue_time_seconds",  # waiting in the engine's scheduler
    "prefill_ms": "vllm:request_prefill_time_seconds",  # scheduled to first token
    "itl_ms": "vllm:inter_token_latency_seconds",
}


def phase_histograms(metrics: str) -> dict[str, Histogram]:
    """ENGINE_PHASES' histograms from one instance's /metrics text."""
    return {name: histogram(metrics, family) for name, family in ENGINE_PHASES.items()}


def phase_summary(
    before: dict[str, Histogram], after: dict[str, Histogram]
) -> dict[str, dict[str, float | None]]:
    """Mean, p50 and p95 (ms) of each phase over the requests an instance served between two reads."""
    out: dict[str, dict[str, float | None]] = {}
    for name in ENGINE_PHASES:
        h = histogram_delta(before[name], after[name])
        if h[2] <= 0:
            continue
        p50, p95 = histogram_quantile(h, 0.5), histogram_quantile(h, 0.95)
        out[name] = {"count": h[2], "mean": h[1] / h[2] * 1000,
                     "p50": None if p50 is None else p50 * 1000, "p95": None if p95 is None else p95 * 1000}  # fmt: skip
    return out


def phases_between(
    before: dict[str, str], after: dict[str, str]
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each instance's ENGINE_PHASES over the requests it served between two reads of its /metrics
    (``instance_metrics``); instances missing from either read are left out."""
    return {
        name: phase_summary(phase_histograms(before[name]), phase_histograms(text))
        for name, text in after.items()
        if name in before
    }


def with_engine_phases(servers: Sequence[VLLMServer], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run``'s record with the instances' ENGINE_PHASES over it (``engine_phases``, by instance)."""
    before = instance_metrics(servers)
    record = run()
    record["engine_phases"] = phases_between(before, instance_metrics(servers))
    return record


def per_request_ms(bench: dict[str, Any]) -> dict[str, list[float]]:
    """Each request's TTFT and TPOT (ms) from a --save-detailed result, as vllm bench serve computes them, with its
    prompt and output tokens (a mixed dataset's replay compares each request with its own lengths alone)."""
    ttfts, tpots, prompts, outputs = [], [], [], []
    inputs = bench.get("input_lens") or [0] * len(bench.get("ttfts", []))
    for ttft, lat, out, inp in zip(bench.get("ttfts", []), bench.get("latencies", []), bench.get("output_lens", []),
                                   inputs, strict=False):  # fmt: skip
        if out and out > 1:
            ttfts.append(ttft * 1000)
            tpots.append((lat - ttft) / (out - 1) * 1000)
            prompts.append(inp)
            outputs.append(out)
    return {"ttfts_ms": ttfts, "tpots_ms": tpots, "input_lens": prompts, "output_lens": outputs}


MAX_LENGTH_CLASSES = 8  # a dataset with more distinct output lengths than this gets no per-length breakdown


def by_output_len(bench: dict[str, Any]) -> dict[str, dict[str, float]]:
    """TTFT and TPOT percentiles (ms) of each output length's requests, for a mix of a few request kinds (the chat
    mix's 16-token answers to long prompts beside its 128-token streams): a p95 over all requests is the worst
    kind's, and this says which kind it is. Empty for a dataset with more than MAX_LENGTH_CLASSES lengths."""
    rows = per_request_ms(bench)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(rows["output_lens"]):
        groups.setdefault(int(n), []).append(i)
    if len(groups) > MAX_LENGTH_CLASSES:
        return {}
    out: dict[str, dict[str, float]] = {}
    for n, idx in sorted(groups.items()):
        ttfts = [rows["ttfts_ms"][i] for i in idx]
        tpots = [rows["tpots_ms"][i] for i in idx]
        out[str(n)] = {"requests": len(idx), "p50_ttft_ms": percentile(ttfts, 50), "p95_ttft_ms": percentile(ttfts, 95),
                       "p50_tpot_ms": percentile(tpots, 50), "p95_tpot_ms": percentile(tpots, 95)}  # fmt: skip
    return out


def late_share(bench: dict[str, Any]) -> float | None:
    """Share of requests whose first chunk arrived with their last (TTFT >= 90% of latency): streams the API
    server delivered in one burst, which read as a TTFT of the whole request and a TPOT near 0."""
    pairs = list(zip(bench.get("ttfts", []), bench.get("latencies", []), strict=False))
    return sum(t >= 0.9 * lat for t, lat in pairs) / len(pairs) if pairs else None


def warm_up(url: str, dataset: str, slo: str, out: Path) -> None:
    """A few requests before any measurement: a P/D pair's first hand-offs (connections, first transfers) take
    hundreds of ms, which would otherwise land in the first point's p95."""
    bench_serve(url, dataset_args(dataset, 4, WARM_UP_SEED, out), math.inf, 4, out / "warm-up.json", slo,
                seed=WARM_UP_SEED, extra=["--max-concurrency", "1"])  # fmt: skip
    (out / "warm-up.json").unlink(missing_ok=True)


def save_metrics(servers: Sequence[VLLMServer], design: str, out: Path, suffix: str = "") -> None:
    """Each process's /metrics after the run: vLLM's own TTFT histogram (first token out of the engine) against
    the client's says how much of a TTFT was delivery rather than compute. ``suffix`` tells the starts of an
    interleaved run apart."""
    import httpx

    for s in servers:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{s.url}/metrics", timeout=10).text
            (out / f"metrics-{design}-{s.name}{suffix}.txt").write_text(text)


def bench_serve(
    url: str,
    dataset: list[str],
    rate: float,
    n: int,
    out: Path,
    slo: str,
    seed: int = SEED,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--base-url", url, "--model", MODEL,
        *dataset, "--num-prompts", str(n), "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed), *extra,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
        "--goodput", *slo.split(), "--save-result", "--result-filename", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    foreign, t0, ticks = foreign_cpu_s(os.getpid()), time.monotonic(), cpu_ticks()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    bench = dict(json.loads(out.read_text()))
    # cores other jobs used meanwhile (0 on a quiet machine)
    bench["foreign_cpu_cores"] = (foreign_cpu_s(os.getpid()) - foreign) / max(time.monotonic() - t0, 1e-9)
    # the hypervisor's share of this VM's CPUs meanwhile
    bench["steal_share"] = steal_share(ticks, cpu_ticks())
    return bench


def plot(results: list[dict[str, Any]], designs: Sequence[str], slo: str, out: Path) -> None:
    """Goodput, p95 TTFT and p95 TPOT against rate, one row per dataset; bars span the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = spreads(results)
    datasets = sorted({d for d, _, _ in sp})
    keys = (
        ("request_goodput", "goodput (req/s)"),
        ("p95_ttft_ms", "p95 TTFT (ms)"),
        ("p95_tpot_ms", "p95 TPOT (ms)"),
    )
    fig, axes = plt.subplots(len(datasets), 3, figsize=(14, 3.6 * len(datasets)), squeeze=False)
    for row, ds in zip(axes, datasets, strict=True):
        for ax, (key, title) in zip(row, keys, strict=True):
            for design in designs:
                pts = sorted((rate, m[key]) for (d, rate, de), m in sp.items() if d == ds and de == design)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ys = [p[1].median for p in pts]
                err = [[p[1].median - p[1].lo for p in pts], [p[1].hi - p[1].median for p in pts]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=design)
            ax.set_title(f"{ds}: {title}")
            ax.set_xlabel("request rate (req/s)")
            ax.legend()
    fig.suptitle(f"SLOs (ms): {slo}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def slo_flags(slo_text: str) -> list[str]:
    """The default policy aimed at the benchmark's SLOs, as a user would configure it."""
    slo = dict(part.split(":") for part in slo_text.split())
    flags = []
    if "ttft" in slo:
        flags += ["--ttft-slo-s", f"{float(slo['ttft']) / 1e3:g}"]
    if "tpot" in slo:
        flags += ["--tpot-slo-s", f"{float(slo['tpot']) / 1e3:g}"]
    return flags


def design_servers(design: str, batched_tokens: int, slo_text: str) -> tuple[list[VLLMServer], list[str]]:
    """The design's two instances (not started) and the proxy flags that front them (the adaptive design's policy
    aims at the benchmark's SLOs, as a user would configure it)."""
    if design == "pd":
        ps, ds = free_port(), free_port()
        servers = [
            VLLMServer(MODEL, args=[*tiny_model_args(), *engine_args(), *disagg_connector_args(ps)],
                       cpu_cores="0", name="prefill"),
            VLLMServer(MODEL, args=[*tiny_model_args(), *engine_args(), *disagg_connector_args(ds)],
                       cpu_cores="1", name="decode"),
        ]  # fmt: skip
        specs = ["--prefill", f"{servers[0].url};side=127.0.0.1:{ps};id=prefill",
                 "--decode", f"{servers[1].url};side=127.0.0.1:{ds};id=decode", "--policy", "always-transfer"]  # fmt: skip
        return servers, specs
    if design in ("colocated", "colocated-cost"):
        servers = [
            VLLMServer(MODEL, args=[*tiny_model_args(), *engine_args(batched_tokens)], cpu_cores=str(i),
                       name=f"replica-{c}")
            for i, c in enumerate("ab")
        ]  # fmt: skip
        specs = ["--both", f"{servers[0].url};id=replica-a", "--both", f"{servers[1].url};id=replica-b"]
        specs += ["--policy", "least-loaded"] if design == "colocated" else slo_flags(slo_text)
        return servers, specs
    if design in ("adaptive", "adaptive-ll", "adaptive-ungated", "adaptive-count"):
        ports = [free_port(), free_port()]
        servers = [
            VLLMServer(MODEL, args=[*tiny_model_args(), *engine_args(batched_tokens), *disagg_connector_args(p)],
                       cpu_cores=str(i), name=f"both-{c}")
            for i, (c, p) in enumerate(zip("ab", ports, strict=True))
        ]  # fmt: skip
        if design == "adaptive-ll":
            return servers, [*(a for s in servers for a in ("--both", f"{s.url};id={s.name}")),
                             "--policy", "least-loaded"]  # fmt: skip
        specs = [a for s, p in zip(servers, ports, strict=True)
                 for a in ("--both", f"{s.url};side=127.0.0.1:{p};id={s.name}")]  # fmt: skip
        specs += slo_flags(slo_text)
        if design == "adaptive-ungated":
            specs.append("--no-split-ttft-gate")
        if design == "adaptive-count":
            specs.append("--no-length-weighted-stall")
        return servers, specs
    raise ValueError(f"unknown design {design!r}; known: {', '.join(DESIGNS + ABLATIONS)}")


class Running:
    """One design's instances and proxy, up; stopped on exit."""

    def __init__(self, design: str, batched_tokens: int, slo: str, proxy_args: Sequence[str] = ()) -> None:
        self.design = design
        self.servers, specs = design_servers(design, batched_tokens, slo)
        # every decision of a point is kept for its decisions-*.json (the proxy's default keeps the last 200)
        self.proxy = ProxyServer(
            "unused",
            args=[
                *specs,
                "--tokenizer",
                MODEL,
                "--log-level",
                "warning",
                "--recent-decisions",
                "4096",
                "--admin-key",
                ADMIN_KEY,
                *proxy_args,
            ],
        )

    def __enter__(self) -> Running:
        try:
            start_many(self.servers)
            self.proxy.start().wait_healthy(60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.proxy.stop()
        for s in self.servers:
            s.stop()

    def stack_cpu(self) -> StackCpu:
        """CPU accounting over this design's processes: each instance split into API server and engine."""
        roots = {s.name: s.proc.pid for s in self.servers if s.proc is not None}
        if self.proxy.proc is not None:
            roots["proxy"] = self.proxy.proc.pid
        return StackCpu(roots, frozenset(s.name for s in self.servers))


def decisions(proxy_url: str) -> dict[str, float]:
    """The proxy's routing decisions so far, by mode (its vllm_disagg_decisions_total counter)."""
    import httpx

    counts: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{proxy_url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm_disagg_decisions_total{"):
                labels, value = line.rsplit(" ", 1)
                mode = labels.split('mode="', 1)[1].split('"', 1)[0] if 'mode="' in labels else "?"
                counts[mode] = counts.get(mode, 0.0) + float(value)
    return counts


ADMIN_KEY = "e2e"  # the proxy listens on localhost for this benchmark alone


def save_decisions(proxy_url: str, since: float, path: Path) -> list[dict[str, Any]]:
    """The point's routing decisions, each with its plan, reason and the alternatives not taken (the proxy's
    /admin/decisions from ``since``, a wall-clock time): what to read when a design loses somewhere."""
    import httpx

    kept: list[dict[str, Any]] = []
    with contextlib.suppress(httpx.HTTPError, ValueError):
        answer = httpx.get(f"{proxy_url}/admin/decisions", headers={"x-admin-key": ADMIN_KEY}, timeout=10)
        kept = [d for d in answer.json()["decisions"] if d["time"] >= since]
        path.write_text(json.dumps(kept))
    return kept


def placements(decisions: list[dict[str, Any]]) -> dict[str, int]:
    """Where a point's requests went, counted by prompt size (to the nearest 100 tokens), plan, serving instance and
    the reason's first word (``pooled``, ``split``, ...): whether a policy balanced each kind of request."""
    counts: dict[str, int] = {}
    for d in decisions:
        parts = dict(p.split("=", 1) for p in d["path"].split("; ")[1:] if "=" in p)
        mode = d["path"].split(";", 1)[0]
        where = parts.get("decode") or parts.get("instance", "?")
        reason = parts.get("reason", "").split(",", 1)[0]
        key = f"~{round(d['prompt_tokens'], -2)} tok {mode}->{where} {reason}".rstrip()
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def request_window(bench: dict[str, Any]) -> tuple[float, float] | None:
    """From the first request sent to the last answer's end, on this host's monotonic clock (``vllm bench``'s
    ``start_times`` are its ``time.perf_counter``, CLOCK_MONOTONIC on Linux); None without the detailed results."""
    starts, latencies = bench.get("start_times"), bench.get("latencies")
    if not starts or not latencies or len(starts) != len(latencies):
        return None
    return min(starts), max(s + lat for s, lat in zip(starts, latencies, strict=True))


def run_point(run: Running, dataset: str, rate: float, repeat: int, seed: int, ns: argparse.Namespace,
              out: Path) -> dict[str, Any]:  # fmt: skip
    """One `vllm bench serve` run; the results entry it makes."""
    print(f"[e2e] {run.design} {dataset} rate={rate:g} repeat={repeat} ...", flush=True)
    before = decisions(run.proxy.url)
    metrics_before = instance_metrics(run.servers)
    started = time.time()
    name = f"{run.design}-{dataset}-{rate:g}-r{repeat}.json"
    bench, stack = with_stack_cpu(run.stack_cpu(), lambda: bench_serve(
        run.proxy.url, dataset_args(dataset, ns.num_prompts, seed, out), rate, ns.num_prompts, out / name, ns.slo,
        seed=seed, extra=["--save-detailed"]))  # fmt: skip
    after = decisions(run.proxy.url)
    metrics_after = instance_metrics(run.servers)
    routed = save_decisions(run.proxy.url, started, out / f"decisions-{name}")
    hit, queried = (
        b - a
        for a, b in zip(prefix_cache_tokens(metrics_before), prefix_cache_tokens(metrics_after), strict=True)
    )
    return {
        "design": run.design,
        "dataset": dataset,
        "rate": rate,
        "repeat": repeat,
        "seed": seed,
        "decisions": {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)},
        "placements": placements(routed),
        "late_first_chunk_share": late_share(bench),
        "by_output_len": by_output_len(bench),
        # prompt tokens the instances found in their prefix caches: ~0 where no two prompts share a prefix
        "prefix_cache": {"hit_tokens": hit, "queried_tokens": queried},
        # vLLM's own view of each instance's requests in this run: where their TTFT went (ENGINE_PHASES)
        "engine_phases": phases_between(metrics_before, metrics_after),
        "arrivals": run_arrivals(bench),  # what `vllm-disagg simulate --validate` replays
        # CPU seconds by role (each instance's API server and engine, the proxy, the client) and each core's busy
        # share over the point: how much of the cores the stack took (stack_cpu.py)
        **stack,
        "bench": {k: v for k, v in bench.items() if k not in DETAIL_KEYS},
    }


def tune_colocated(rate: float, ns: argparse.Namespace, out: Path) -> tuple[int, list[dict[str, Any]]]:
    """The colocated design's --max-num-batched-tokens: each candidate serves the chat mix at ``rate`` (the
    highest benchmarked), best goodput wins, then best p95 TPOT. Returns the pick and each candidate's numbers."""
    tried = []
    for tokens in TUNE_CANDIDATES:
        with Running("colocated", tokens, ns.slo) as run:
            warm_up(run.proxy.url, "chat-mix", ns.slo, out)
            bench = bench_serve(run.proxy.url, dataset_args("chat-mix", TUNE_PROMPTS, TUNE_SEED, out), rate,
                                TUNE_PROMPTS, out / f"tune-{tokens}.json", ns.slo, seed=TUNE_SEED)  # fmt: skip
        tried.append({"max_num_batched_tokens": tokens, "goodput": bench.get("request_goodput") or 0.0,
                      "p95_tpot_ms": bench["p95_tpot_ms"], "p95_ttft_ms": bench["p95_ttft_ms"]})  # fmt: skip
        print(f"[e2e] tune colocated max_num_batched_tokens={tokens}: {tried[-1]}", flush=True)
    best = max(tried, key=lambda t: (round(t["goodput"], 2), -t["p95_tpot_ms"]))
    return int(best["max_num_batched_tokens"]), tried


def load_previous(path: Path, designs: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Entries of an earlier results.json for designs not rerun now, and those designs' replay settings (profiles,
    zero-load calibration), so designs can be measured in turn."""
    if not path.exists():
        return [], {}
    old = json.loads(path.read_text())
    kept = {d: spec for d, spec in old.get("replay", {}).get("designs", {}).items() if d not in designs}
    return [r for r in old.get("results", []) if r.get("design") not in designs], kept


def run_order(designs: Sequence[str], points: Sequence[tuple[str, float, int]],
              interleave: bool) -> list[tuple[str, list[tuple[str, float, int]]]]:  # fmt: skip
    """Which design serves which points, in order. By default each design serves every point in turn. Interleaved,
    each repeat is served by every design before the next repeat starts, in ABBA order (reversed on odd repeats), so
    that a host whose speed drifts over the run's hour weighs on every design alike rather than on the last one."""
    if not interleave:
        return [(d, list(points)) for d in designs]
    order: list[tuple[str, list[tuple[str, float, int]]]] = []
    for k in sorted({p[2] for p in points}):
        todo = [p for p in points if p[2] == k]
        order += [(d, todo) for d in (designs if k % 2 == 0 else list(reversed(designs)))]
    return order


def serve_design(design: str, todo: Sequence[tuple[str, float, int]], seeds: dict[tuple[str, float, int], int],
                 ns: argparse.Namespace, replay: dict[str, Any], out: Path) -> list[dict[str, Any]]:  # fmt: skip
    """Starts the design's instances and proxy, serves ``todo`` and stops them. Profiling (--profile) happens on the
    design's first start only."""
    results: list[dict[str, Any]] = []
    first = design not in replay["designs"]
    with Running(design, ns.colocated_batched_tokens, ns.slo, shlex.split(ns.proxy_args)) as run:
        counts: dict[str, Any]
        if design == "pd":
            counts = {"prefill": 1, "decode": 1}
        elif design in ("colocated", "colocated-cost"):
            counts = {"replicas": 2, "max_num_batched_tokens": ns.colocated_batched_tokens}
        else:
            counts = {"adaptive": 2, "max_num_batched_tokens": ns.colocated_batched_tokens}
        counts = replay["designs"].setdefault(design, counts)
        chunked = {logged_flag(s.log_path, "enable_chunked_prefill") for s in run.servers}
        replay["engine"]["chunked_prefill"] = chunked.pop() if len(chunked) == 1 else None
        datasets = list(dict.fromkeys(p[0] for p in todo))
        for dataset in datasets:
            warm_up(run.proxy.url, dataset, ns.slo, out)
        if ns.profile and first:
            # zero load first: right after the profile's batches, many more streams came in one burst for a
            # while (up to half of them, against ~5% later), which no benchmark point sees
            counts["zero_load"] = {
                d: with_engine_phases(
                    run.servers, partial(zero_load, run.proxy.url, d, design, out, ns.slo, run.stack_cpu())
                )
                for d in datasets
            }
            decoders = int(counts.get("decode", 0) or counts.get("replicas", 0) or counts.get("adaptive", 0))
            counts["zero_load_batch"] = with_engine_phases(
                run.servers,
                lambda: zero_load_batch(run.proxy.url, design, decoders, out, ns.slo, run.stack_cpu()),
            )
            print(f"[e2e] profiling {design} instances ...", flush=True)
            counts["profiles"] = profile_instances(run.servers, design, out)
            time.sleep(SETTLE_S)
            for dataset in datasets:
                warm_up(run.proxy.url, dataset, ns.slo, out)
        for dataset, rate, repeat in todo:
            results.append(run_point(run, dataset, rate, repeat, seeds[(dataset, rate, repeat)], ns, out))
        if ns.profile:
            suffix = f"-r{todo[0][2]}" if ns.interleave and todo else ""
            save_metrics([run.proxy, *run.servers], design, out, suffix)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", default=",".join(DESIGNS))
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--slo", default="ttft:1000 tpot:25", help="vllm bench --goodput SLOs (ms)")
    ap.add_argument("--proxy-args", default="",
                    help="more `vllm-disagg proxy` flags for every design's proxy (one string, shell-quoted)")  # fmt: skip
    ap.add_argument("--colocated-batched-tokens", type=int, default=COLOCATED_BATCHED_TOKENS,
                    help="--max-num-batched-tokens of the colocated and adaptive designs' instances")  # fmt: skip
    ap.add_argument(
        "--tune-colocated", action="store_true", help="pick --colocated-batched-tokens by a sweep first"
    )
    ap.add_argument("--out", default=".artifacts/e2e")
    ap.add_argument("--interleave", action="store_true",
                    help="serve each repeat with every design in turn (ABBA order), restarting the instances, so "
                         "host drift over the run weighs on every design alike")  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true", help="profile the instances first and record what a replay needs"
    )
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in ns.rates.split(",")]
    designs = ns.designs.split(",")
    datasets = ns.datasets.split(",")
    for name in designs:
        if name not in DESIGNS + ABLATIONS:
            ap.error(f"unknown design {name!r}; known: {', '.join(DESIGNS + ABLATIONS)}")
    for name in datasets:
        if name not in DATASETS:
            ap.error(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    results, kept_designs = load_previous(out / "results.json", designs)
    tuning: dict[str, Any] = {
        "max_num_batched_tokens": ns.colocated_batched_tokens,
        "how": "--colocated-batched-tokens",
    }
    if ns.tune_colocated:
        picked, tried = tune_colocated(max(rates), ns, out)
        ns.colocated_batched_tokens = picked
        tuning = {
            "max_num_batched_tokens": picked,
            "how": f"sweep on chat-mix at rate {max(rates):g}",
            "tried": tried,
        }
    replay: dict[str, Any] = {
        "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS},
        "datasets": {d: DATASET_LENGTHS[d] for d in datasets},
        "num_prompts": ns.num_prompts,
        "seed": SEED,  # each entry says its own seed: one per (dataset, rate, repeat), the same in every design
        "model_config": json.loads((Path(MODEL) / "config.json").read_text()),
        "arrivals": "poisson",  # vllm bench serve's default (burstiness 1)
        # each instance, API server included, is pinned to its engine's core, and the proxy and client use the same
        # two cores: work per streamed token lengthens the engines' iterations (see validate.ZeroLoad)
        "stack_shares_engine_cores": True,
        "designs": kept_designs,
    }
    points = [(d, r, k) for k in range(ns.repeats) for d in datasets for r in rates]
    seeds = {pt: SEED + i for i, pt in enumerate(points)}  # one per point, the same in every design and order
    for design, todo in run_order(designs, points, ns.interleave):
        results.extend(serve_design(design, todo, seeds, ns, replay, out))
    shown = [d for d in DESIGNS + ABLATIONS if any(r["design"] == d for r in results)]
    rows = summary_rows(results, shown)
    cols = list(dict.fromkeys(c for r in rows for c in r))
    cpu = cpu_description(Path("/proc/cpuinfo").read_text())
    print(f"SLOs (ms): {ns.slo}; colocated/adaptive max_num_batched_tokens {ns.colocated_batched_tokens} "
          f"({tuning['how']}); CPU {cpu['cpu_model']} ({cpu['cpu_isa']})")  # fmt: skip
    print(render_table(rows, cols))
    vs = verdicts(results)
    if vs:
        held = sum(v.holds_its_own for v in vs)
        beat = sum(v.beats_both for v in vs)
        print(f"adaptive holds its own (goodput >= 0.95x the better fixed design, p95 TPOT within spread of "
              f"colocated) at {held}/{len(vs)} points; beats both fixed designs by >= 1.1x at {beat}")  # fmt: skip
    kinds = kind_rows(results, shown)
    if kinds:  # a mix of request kinds: which kind each design's p95 belongs to
        print("by output length (ms, median [range] over repeats):")
        print(render_table(kinds, list(kinds[0])))
    placed = [r for r in results if r.get("placements")]
    if placed:  # whether each design balanced each kind of request (decisions-*.json has every decision)
        print("placements (requests by prompt size, plan -> serving instance, regime or reason):")
        for r in placed:
            where = ", ".join(f"{k} {v}" for k, v in r["placements"].items())
            print(f"  {r['design']} {r['dataset']} {r['rate']:g} r{r['repeat']}: {where}")
    (out / "results.json").write_text(
        json.dumps(
            {"machine": machine_info(), "slo": ns.slo, "proxy_args": ns.proxy_args, "colocated_tuning": tuning,
             "results": results, "replay": replay},
            indent=2,
        )
    )  # fmt: skip
    with contextlib.suppress(ImportError):  # plots need the plot extra (matplotlib)
        plot(results, shown, ns.slo, out / "latency_vs_rate.png")
    print(f"[e2e] wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
