"""End-to-end benchmark: `vllm bench serve` (the real tool, unchanged) against P/D (proxy) and colocated replicas.

    python benchmarks/e2e.py [--rates 1,2,4] [--num-prompts 40] [--out .artifacts/e2e] [--profile]

For each design (1 prefill + 1 decode behind the proxy; 2 colocated replicas behind the proxy with --both, so
both designs pay the same proxy hop), each dataset (random with long prompts; prefix repetition) and each request
rate, runs `vllm bench serve` and collects its JSON. Prints a summary table with ratios P/D vs colocated, computes
goodput for the stated SLOs, writes results.json and plots p95 TPOT and p95 TTFT against rate.

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
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_info, render_table  # noqa: E402

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
# Each (dataset, rate) point draws its own prompts (seed SEED + its index, the same in both designs): with one seed
# for all, every point after the first would find its prompts in the prefix cache and prefill for free.
SEED = 0
WARM_UP_SEED = 1000
ZERO_LOAD_SEED = 2000
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


DATASETS: dict[str, list[str]] = {
    "random-long": ["--dataset-name", "random", "--random-input-len", "1500", "--random-output-len", "64"],
    "prefix-repetition": [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "64",
    ],
}  # fmt: skip

# Each dataset's token lengths as a replay sees them (prefix repetition: shared prefix + unique suffix).
DATASET_LENGTHS: dict[str, dict[str, int]] = {
    "random-long": {"input_len": 1500, "output_len": 64},
    "prefix-repetition": {
        "input_len": 1024 + 128,
        "output_len": 64,
        "shared_prefix_len": 1024,
        "num_prefixes": 4,
    },
}


def engine_args() -> list[str]:
    return ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]


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
        decode_method="latency",
    )
    files = {s.name: f"profile-{design}-{s.name}.json" for s in servers}
    for s in servers:
        profile(s.url, model=MODEL, cfg=cfg, out=out / files[s.name])
    return files


def zero_load(url: str, dataset: str, design: str, out: Path, slo: str) -> dict[str, Any]:
    """Requests one at a time through the proxy, each meeting an idle cluster: latency with no queueing or batching.

    Arrivals are evenly spaced (gamma gaps of shape 100 at ZERO_LOAD_RATE), so no request starts while another
    runs or finishes: back to back (``--max-concurrency 1`` at rate inf) here delivered most P/D streams in one
    burst at their end. What this adds to the engines' own prefill and decode time (client, proxy hop,
    tokenization, the API server, for P/D the hand-off to decode) is what a replay adds per request.
    """
    name = f"zero-load-{design}-{dataset}.json"
    extra = ["--max-concurrency", "1", "--burstiness", "100", "--save-detailed"]
    bench = bench_serve(url, DATASETS[dataset], ZERO_LOAD_RATE, ZERO_LOAD_PROMPTS, out / name, slo,
                        seed=ZERO_LOAD_SEED, extra=extra)  # fmt: skip
    keys = ("median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "total_input_tokens", "completed",
            "foreign_cpu_cores")  # fmt: skip
    return {"file": name, **{k: bench.get(k) for k in keys}, "late_first_chunk_share": late_share(bench),
            **per_request_ms(bench)}  # fmt: skip


def per_request_ms(bench: dict[str, Any]) -> dict[str, list[float]]:
    """Each request's TTFT and TPOT (ms) from a --save-detailed result, as vllm bench serve computes them."""
    ttfts, tpots = [], []
    for ttft, lat, out in zip(bench.get("ttfts", []), bench.get("latencies", []), bench.get("output_lens", []),
                              strict=False):  # fmt: skip
        if out and out > 1:
            ttfts.append(ttft * 1000)
            tpots.append((lat - ttft) / (out - 1) * 1000)
    return {"ttfts_ms": ttfts, "tpots_ms": tpots}


def late_share(bench: dict[str, Any]) -> float | None:
    """Share of requests whose first chunk arrived with their last (TTFT >= 90% of latency): streams the API
    server delivered in one burst, which read as a TTFT of the whole request and a TPOT near 0."""
    pairs = list(zip(bench.get("ttfts", []), bench.get("latencies", []), strict=False))
    return sum(t >= 0.9 * lat for t, lat in pairs) / len(pairs) if pairs else None


def warm_up(url: str, dataset: str, slo: str, out: Path) -> None:
    """A few requests before any measurement: a P/D pair's first hand-offs (connections, first transfers) take
    hundreds of ms, which would otherwise land in the first point's p95."""
    bench_serve(url, DATASETS[dataset], math.inf, 4, out / "warm-up.json", slo, seed=WARM_UP_SEED,
                extra=["--max-concurrency", "1"])  # fmt: skip
    (out / "warm-up.json").unlink(missing_ok=True)


def foreign_cpu_s() -> float:
    """CPU seconds used so far by every process outside this benchmark's own tree (other jobs on the machine).

    On a 2-core machine another job's vLLM instances skew every latency here; the difference over a point says
    how much of the machine was not ours while it ran.
    """
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            parent[int(entry)] = int(fields[1])
            used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(t for pid, t in used.items() if not ours(pid))


def save_metrics(servers: Sequence[VLLMServer], design: str, out: Path) -> None:
    """Each process's /metrics after the run: vLLM's own TTFT histogram (first token out of the engine) against
    the client's says how much of a TTFT was delivery rather than compute."""
    import httpx

    for s in servers:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{s.url}/metrics", timeout=10).text
            (out / f"metrics-{design}-{s.name}.txt").write_text(text)


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
    foreign, t0 = foreign_cpu_s(), time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    bench = dict(json.loads(out.read_text()))
    # cores other jobs used meanwhile (0 on a quiet machine)
    bench["foreign_cpu_cores"] = (foreign_cpu_s() - foreign) / max(time.monotonic() - t0, 1e-9)
    return bench


def summarize(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per (dataset, rate): P/D and colocated side by side, with ratios colocated / P/D (>1: P/D wins)."""
    rows = []
    by = {(r["design"], r["dataset"], r["rate"]): r["bench"] for r in results}
    for (design, dataset, rate), pd_ in sorted(by.items()):
        if design != "pd":
            continue
        co = by.get(("colocated", dataset, rate))
        if co is None:
            continue
        row = {"dataset": dataset, "rate": f"{rate:g}"}
        for key in ("p95_ttft_ms", "p95_tpot_ms", "p99_itl_ms"):
            row[f"{key} P/D"] = f"{pd_[key]:.1f}"
            row[f"{key} colo"] = f"{co[key]:.1f}"
            row[f"{key} colo/PD"] = f"{co[key] / pd_[key]:.2f}x" if pd_[key] else "-"
        row["goodput P/D"] = f"{pd_.get('request_goodput') or 0:.2f}"
        row["goodput colo"] = f"{co.get('request_goodput') or 0:.2f}"
        rows.append(row)
    return rows


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in results})
    fig, axes = plt.subplots(len(datasets), 2, figsize=(10, 3.5 * len(datasets)), squeeze=False)
    for row, ds in zip(axes, datasets, strict=True):
        for ax, key in zip(row, ("p95_tpot_ms", "p95_ttft_ms"), strict=True):
            for design in ("pd", "colocated"):
                pts = sorted(
                    (r["rate"], r["bench"][key])
                    for r in results
                    if r["dataset"] == ds and r["design"] == design
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=design)
            ax.set_title(f"{ds}: {key}")
            ax.set_xlabel("request rate (req/s)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--slo", default="ttft:2000 tpot:50", help="vllm bench --goodput SLOs (ms)")
    ap.add_argument("--out", default=".artifacts/e2e")
    ap.add_argument(
        "--profile", action="store_true", help="profile the instances first and record what a replay needs"
    )
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in ns.rates.split(",")]
    results: list[dict[str, Any]] = []
    datasets = ns.datasets.split(",")
    replay: dict[str, Any] = {
        "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS},
        "datasets": {d: DATASET_LENGTHS[d] for d in datasets},
        "num_prompts": ns.num_prompts,
        "seed": SEED,  # point i of a design ran with seed SEED + i (its results entry says which)
        "model_config": json.loads((Path(MODEL) / "config.json").read_text()),
        "arrivals": "poisson",  # vllm bench serve's default (burstiness 1)
        "designs": {},
    }
    for design in ("pd", "colocated"):
        if design == "pd":
            ps, ds = free_port(), free_port()
            servers = [
                VLLMServer(
                    MODEL,
                    args=[*tiny_model_args(), *engine_args(), *disagg_connector_args(ps)],
                    cpu_cores="0",
                    name="prefill",
                ),
                VLLMServer(
                    MODEL,
                    args=[*tiny_model_args(), *engine_args(), *disagg_connector_args(ds)],
                    cpu_cores="1",
                    name="decode",
                ),
            ]
            specs = ["--prefill", f"{servers[0].url};side=127.0.0.1:{ps};id=prefill",
                     "--decode", f"{servers[1].url};side=127.0.0.1:{ds};id=decode"]  # fmt: skip
        else:
            servers = [
                VLLMServer(MODEL, args=[*tiny_model_args(), *engine_args()], cpu_cores="0", name="replica-a"),
                VLLMServer(MODEL, args=[*tiny_model_args(), *engine_args()], cpu_cores="1", name="replica-b"),
            ]
            specs = ["--both", f"{servers[0].url};id=replica-a", "--both", f"{servers[1].url};id=replica-b",
                     "--policy", "least-loaded"]  # fmt: skip
        start_many(servers)
        proxy = ProxyServer("unused", args=[*specs, "--tokenizer", MODEL, "--log-level", "warning"])
        try:
            proxy.start().wait_healthy(60)
            counts = {"prefill": 1, "decode": 1} if design == "pd" else {"replicas": len(servers)}
            replay["designs"][design] = counts
            chunked = {logged_flag(s.log_path, "enable_chunked_prefill") for s in servers}
            replay["engine"]["chunked_prefill"] = chunked.pop() if len(chunked) == 1 else None
            for dataset in datasets:
                warm_up(proxy.url, dataset, ns.slo, out)
            if ns.profile:
                # zero load first: right after the profile's batches, many more streams came in one burst for a
                # while (up to half of them, against ~5% later), which no benchmark point sees
                replay["designs"][design]["zero_load"] = {
                    d: zero_load(proxy.url, d, design, out, ns.slo) for d in datasets
                }
                print(f"[e2e] profiling {design} instances ...", flush=True)
                replay["designs"][design]["profiles"] = profile_instances(servers, design, out)
                time.sleep(SETTLE_S)
                for dataset in datasets:
                    warm_up(proxy.url, dataset, ns.slo, out)
            points = [(d, r) for d in datasets for r in rates]
            for i, (dataset, rate) in enumerate(points):
                print(f"[e2e] {design} {dataset} rate={rate:g} ...", flush=True)
                bench = bench_serve(proxy.url, DATASETS[dataset], rate, ns.num_prompts,
                                    out / f"{design}-{dataset}-{rate:g}.json", ns.slo, seed=SEED + i,
                                    extra=["--save-detailed"])  # fmt: skip
                row = {"design": design, "dataset": dataset, "rate": rate, "seed": SEED + i}
                row["late_first_chunk_share"] = late_share(bench)
                row["bench"] = {k: v for k, v in bench.items() if k not in DETAIL_KEYS}
                results.append(row)
            if ns.profile:
                save_metrics([proxy, *servers], design, out)
        finally:
            proxy.stop()
            for s in servers:
                s.stop()
    rows = summarize(results)
    cols = list(rows[0]) if rows else []
    print(render_table(rows, cols))
    (out / "results.json").write_text(
        json.dumps({"machine": machine_info(), "slo": ns.slo, "results": results, "replay": replay}, indent=2)
    )
    with contextlib.suppress(ImportError):  # plots need the plot extra (matplotlib)
        plot(results, out / "latency_vs_rate.png")
    print(f"[e2e] wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
