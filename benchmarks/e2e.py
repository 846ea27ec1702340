"""End-to-end benchmark: `vllm bench serve` (the real tool, unchanged) against P/D (proxy) and colocated replicas.

    python benchmarks/e2e.py [--rates 1,2,4] [--num-prompts 40] [--out .artifacts/e2e]

For each design (1 prefill + 1 decode behind the proxy; 2 colocated replicas behind the proxy with --both, so
both designs pay the same proxy hop), each dataset (random with long prompts; prefix repetition) and each request
rate, runs `vllm bench serve` and collects its JSON. Prints a summary table with ratios P/D vs colocated, computes
goodput for the stated SLOs, writes results.json and plots p95 TPOT and p95 TTFT against rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
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

DATASETS: dict[str, list[str]] = {
    "random-long": ["--dataset-name", "random", "--random-input-len", "1500", "--random-output-len", "64"],
    "prefix-repetition": [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "64",
    ],
}  # fmt: skip


def bench_serve(url: str, dataset: list[str], rate: float, n: int, out: Path, slo: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--base-url", url, "--model", MODEL,
        *dataset, "--num-prompts", str(n), "--request-rate", str(rate), "--ignore-eos", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
        "--goodput", *slo.split(), "--save-result", "--result-filename", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return dict(json.loads(out.read_text()))


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
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in ns.rates.split(",")]
    results: list[dict[str, Any]] = []
    for design in ("pd", "colocated"):
        if design == "pd":
            ps, ds = free_port(), free_port()
            servers = [
                VLLMServer(
                    MODEL,
                    args=[*tiny_model_args(), *disagg_connector_args(ps)],
                    cpu_cores="0",
                    name="prefill",
                ),
                VLLMServer(
                    MODEL, args=[*tiny_model_args(), *disagg_connector_args(ds)], cpu_cores="1", name="decode"
                ),
            ]
            specs = ["--prefill", f"{servers[0].url};side=127.0.0.1:{ps};id=prefill",
                     "--decode", f"{servers[1].url};side=127.0.0.1:{ds};id=decode"]  # fmt: skip
        else:
            servers = [
                VLLMServer(MODEL, args=tiny_model_args(), cpu_cores="0", name="replica-a"),
                VLLMServer(MODEL, args=tiny_model_args(), cpu_cores="1", name="replica-b"),
            ]
            specs = ["--both", f"{servers[0].url};id=replica-a", "--both", f"{servers[1].url};id=replica-b",
                     "--policy", "least-loaded"]  # fmt: skip
        start_many(servers)
        proxy = ProxyServer("unused", args=[*specs, "--tokenizer", MODEL, "--log-level", "warning"])
        try:
            proxy.start().wait_healthy(60)
            for dataset in ns.datasets.split(","):
                for rate in rates:
                    print(f"[e2e] {design} {dataset} rate={rate:g} ...", flush=True)
                    bench = bench_serve(proxy.url, DATASETS[dataset], rate, ns.num_prompts,
                                        out / f"{design}-{dataset}-{rate:g}.json", ns.slo)  # fmt: skip
                    results.append({"design": design, "dataset": dataset, "rate": rate, "bench": bench})
        finally:
            proxy.stop()
            for s in servers:
                s.stop()
    rows = summarize(results)
    cols = list(rows[0]) if rows else []
    print(render_table(rows, cols))
    (out / "results.json").write_text(
        json.dumps({"machine": machine_info(), "slo": ns.slo, "results": results}, indent=2)
    )
    with contextlib.suppress(ImportError):  # plots need the plot extra (matplotlib)
        plot(results, out / "latency_vs_rate.png")
    print(f"[e2e] wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
