"""The stack's CPU per streamed token against how many streams decode together, on one P/D pair.

The stack (the decode instance's API server, the proxy, the client) handles one engine output message per step and
one SSE chunk per stream per token, so its CPU per token falls as more streams share a step, as far as per-step work
is a real share of it. `simulate --validate` charges the stack's CPU per token as the batched zero-load run read it
(4 streams per decoding instance) at every load; this says how far that figure holds at other batch sizes.

For each concurrency C (streams decoding together on the decode instance), the batched zero-load run of `e2e.py`
(`zero_load_batch`: 3 x C requests of 128 prompt and 128 output tokens through the proxy) at C streams, with the
stack's CPU read from /proc over its window (`stack_cpu.StackCpu`).

    python benchmarks/stack_steps.py [--concurrency 1,2,4,8,16] [--out .artifacts/stack-steps]

Prints each concurrency's CPU per token by role and its ratio to the batched run's (4 streams); writes ``stack-steps.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402  (the benchmark harness beside this file)

from vllm_disagg.planner.validate import cpu_use  # noqa: E402


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
            rec = e2e.zero_load_batch(run.proxy.url, "pd", 1, out, slo, run.stack_cpu(), per_instance=c)
            use = cpu_use([{**rec, "bench": {"total_output_tokens": rec["total_output_tokens"]}}])
            if use is None:
                raise RuntimeError(f"no stack CPU was read at {c} streams")
            rows.append({"concurrency": c, "ms_per_token": use.ms_per_token,
                         "stack_ms_per_token": use.stack_ms_per_token,
                         "median_tpot_ms": rec["median_tpot_ms"]})  # fmt: skip
            print(f"C={c:3d}: {use.describe()}; TPOT median {rec['median_tpot_ms'] or 0:.2f} ms", flush=True)
    per_token = {int(r["concurrency"]): float(r["stack_ms_per_token"]) for r in rows}
    base = e2e.DECODE_BATCH_STREAMS
    if per_token.get(base):
        print(f"against C={base} (the batched zero-load run's streams per instance): " + ", ".join(
            f"C={c} {v / per_token[base]:.2f}x" for c, v in per_token.items()))  # fmt: skip
    (out / "stack-steps.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
