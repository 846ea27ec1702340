"""The README's demo: one prefill + one decode + the proxy vs two colocated replicas, on real vLLM CPU processes.

Same mixed workload for both designs (short chat-like streams while long prompts arrive), each vLLM on its own core:
  * P/D: prefill on core 0, decode on core 1, DisaggConnector pushing KV layer by layer, the proxy in front;
  * colocated: two plain replicas (core 0 and core 1), each taking half the traffic (round robin).
Prints TTFT and inter-token latency percentiles of the short streams and the paths taken, and writes a PNG timeline
of inter-token gaps where the colocated prefill stalls show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from vllm_disagg.tools.harness import (
    ProxyServer,
    VLLMServer,
    disagg_connector_args,
    free_port,
    start_many,
    tiny_model_args,
)
from vllm_disagg.tools.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model
from vllm_disagg.tools.workload import RequestResult, Summary, mixed_workload, run_workload, summarize


def _progress(label: str):  # type: ignore[no-untyped-def]
    tty = sys.stdout.isatty()
    step = 0

    def show(done: int, total: int) -> None:
        nonlocal step
        if tty:
            sys.stdout.write(
                f"\r[demo] {label}: {done}/{total} requests done" + ("\n" if done == total else "")
            )
        elif done * 4 // total > step or done == total:  # a line per quarter in logs
            step = done * 4 // total
            sys.stdout.write(f"[demo] {label}: {done}/{total} requests done\n")
        sys.stdout.flush()

    return show


def run_pd(model: str, specs: list, log_dir: Path) -> list[RequestResult]:  # type: ignore[type-arg]
    p_side, d_side = free_port(), free_port()
    prefill = VLLMServer(model, args=[*tiny_model_args(), *disagg_connector_args(p_side)], cpu_cores="0", name="prefill",
                         log_path=log_dir / "prefill.log")  # fmt: skip
    decode = VLLMServer(model, args=[*tiny_model_args(), *disagg_connector_args(d_side)], cpu_cores="1", name="decode",
                        log_path=log_dir / "decode.log")  # fmt: skip
    t = time.monotonic()
    print("[demo] P/D: starting prefill (core 0) and decode (core 1) with DisaggConnector ...", flush=True)
    start_many([prefill, decode])
    proxy = ProxyServer(
        "unused",
        args=[
            "--prefill", f"{prefill.url};side=127.0.0.1:{p_side};id=prefill",
            "--decode", f"{decode.url};side=127.0.0.1:{d_side};id=decode",
            "--tokenizer", model, "--log-level", "warning",
        ],
        log_path=log_dir / "proxy.log",
    )  # fmt: skip
    try:
        proxy.start().wait_healthy(60)
        print(f"[demo] P/D: ready in {time.monotonic() - t:.0f} s; proxy at {proxy.url}", flush=True)
        return asyncio.run(run_workload(specs, [proxy.url], model, _progress("P/D")))
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def run_colocated(model: str, specs: list, log_dir: Path) -> list[RequestResult]:  # type: ignore[type-arg]
    a = VLLMServer(
        model, args=tiny_model_args(), cpu_cores="0", name="replica-a", log_path=log_dir / "replica-a.log"
    )
    b = VLLMServer(
        model, args=tiny_model_args(), cpu_cores="1", name="replica-b", log_path=log_dir / "replica-b.log"
    )
    t = time.monotonic()
    print("[demo] colocated: starting two replicas (core 0, core 1) ...", flush=True)
    start_many([a, b])
    try:
        print(f"[demo] colocated: ready in {time.monotonic() - t:.0f} s", flush=True)
        return asyncio.run(run_workload(specs, [a.url, b.url], model, _progress("colocated")))
    finally:
        a.stop()
        b.stop()


def format_table(rows: dict[str, Summary]) -> str:
    head = f"{'design':<12} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8} {'ITL p99':>8} " \
           f"{'TPOT p95':>9} {'errors':>6}  paths"  # fmt: skip
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        paths = ", ".join(f"{k}={v}" for k, v in sorted(s.paths.items()))
        lines.append(
            f"{name:<12} {1000 * s.ttft_p50:>7.1f}ms {1000 * s.ttft_p95:>7.1f}ms {1000 * s.itl_p50:>6.1f}ms "
            f"{1000 * s.itl_p95:>6.1f}ms {1000 * s.itl_p99:>6.1f}ms {1000 * s.tpot_p95:>7.1f}ms {s.errors:>6}  {paths}"
        )
    return "\n".join(lines)


def plot_timeline(results: dict[str, list[RequestResult]], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), sharex=True, sharey=True)
    for ax, (name, rs) in zip(axes, results.items(), strict=True):
        t0 = min(r.start for r in rs)
        xs, ys = [], []
        for r in rs:
            if r.spec.kind != "short":
                continue
            for tprev, tnext in zip(r.chunk_times, r.chunk_times[1:], strict=False):
                xs.append(tnext - t0)
                ys.append(1000 * (tnext - tprev))
        ax.scatter(xs, ys, s=4, alpha=0.6, label="inter-token gap of a short stream")
        for r in rs:
            if r.spec.kind == "long":
                ax.axvline(r.start - t0, color="red", alpha=0.25, linewidth=0.8)
        ax.set_title(f"{name}: inter-token gaps (red lines: long prompts arriving)")
        ax.set_ylabel("gap (ms)")
        ax.set_yscale("log")
    axes[-1].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_demo(ns: argparse.Namespace) -> int:
    model = str(Path(ns.model_dir).resolve())
    if not is_tiny_model(model, TinyLlamaSpec()):
        write_tiny_model(model, TinyLlamaSpec())
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = mixed_workload(
        duration_s=ns.duration,
        short_rate=ns.short_rate,
        long_rate=ns.long_rate,
        long_prompt=ns.long_prompt,
        seed=0,
    )
    n_long = sum(1 for s in specs if s.kind == "long")
    print(
        f"[demo] workload: {len(specs) - n_long} short streams (32 -> 64 tokens) and {n_long} long prompts "
        f"({ns.long_prompt} tokens) over {ns.duration:.0f} s, same for both designs",
        flush=True,
    )
    results = {"P/D": run_pd(model, specs, out), "colocated": run_colocated(model, specs, out)}
    rows = {name: summarize(rs) for name, rs in results.items()}
    print("\n[demo] short streams, through each design:")
    print(format_table(rows))
    png = plot_timeline(results, out / "itl_timeline.png")
    pd_, co = rows["P/D"], rows["colocated"]
    print(
        f"\n[demo] ITL p99: P/D {1000 * pd_.itl_p99:.1f} ms vs colocated {1000 * co.itl_p99:.1f} ms "
        f"({co.itl_p99 / pd_.itl_p99:.2f}x); TTFT p50: P/D {1000 * pd_.ttft_p50:.1f} ms vs colocated "
        f"{1000 * co.ttft_p50:.1f} ms"
    )
    summary = {name: s.__dict__ for name, s in rows.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[demo] wrote {out / 'summary.json'}" + (f" and the timeline {png}" if png else ""))
    print("[demo] all vLLM processes stopped.")
    return 0 if all(s.errors == 0 for s in rows.values()) else 1
