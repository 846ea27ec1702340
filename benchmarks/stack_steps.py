"""The stack's CPU per streamed token against how many streams decode together, on one P/D pair.

The stack (the decode instance's API server, the proxy, the client) handles one engine output message per step and
one SSE chunk per stream per token, so its CPU per token falls as more streams share a step, as far as per-step work
is a real share of it. `simulate --validate` charges the stack's CPU per token as the batched zero-load run read it
(4 streams per decoding instance) at every load; this says how far that figure holds at other batch sizes.

For each concurrency C (streams decoding together on the decode instance), `vllm bench serve` sends 3 x C requests of
128 prompt and 128 output tokens through the proxy, and the stack's CPU is read from /proc over their window
(`stack_cpu.StackCpu`).

    python benchmarks/stack_steps.py [--concurrency 1,2,4,8,16] [--out .artifacts/stack-steps]

Prints each concurrency's CPU per token by role and its ratio to C=4's; writes ``stack-steps.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402  (the benchmark harness beside this file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--out", default=".artifacts/stack-steps")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = "ttft:1500 tpot:25"
    rows: list[dict[str, Any]] = []
    with e2e.Running("pd", e2e.COLOCATED_BATCHED_TOKENS, slo) as run:
        e2e.warm_up(run.proxy.url, "chat-mix", slo, out)
        for c in (int(x) for x in ns.concurrency.split(",")):
            n = 3 * c
            args = e2e.dataset_args("decode-batch", n, 7 + c, out)
            serve = partial(e2e.bench_serve, run.proxy.url, args, math.inf, n, out / f"c{c}.json", slo,
                            seed=7 + c, extra=["--max-concurrency", str(c), "--save-detailed"])  # fmt: skip
            bench, stack = e2e.with_stack_cpu(run.stack_cpu(), serve)
            tokens = float(bench["total_output_tokens"])
            cpu_s: dict[str, float] = stack["cpu_s"]  # type: ignore[assignment]
            roles = {k: v * 1000 / tokens for k, v in cpu_s.items() if "/engine" not in k}
            rows.append({"concurrency": c, "ms_per_token": roles, "stack_ms_per_token": sum(roles.values()),
                         "median_tpot_ms": bench.get("median_tpot_ms")})  # fmt: skip
            print(f"C={c:3d}: stack {sum(roles.values()):.3f} ms CPU per token "
                  f"({', '.join(f'{k} {v:.3f}' for k, v in sorted(roles.items()))}); "
                  f"TPOT median {bench.get('median_tpot_ms', 0):.2f} ms", flush=True)  # fmt: skip
    per_token = {int(r["concurrency"]): float(r["stack_ms_per_token"]) for r in rows}
    if per_token.get(4):
        print("against C=4 (the batched zero-load run's streams per instance): " + ", ".join(
            f"C={c} {v / per_token[4]:.2f}x" for c, v in per_token.items()))  # fmt: skip
    (out / "stack-steps.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
