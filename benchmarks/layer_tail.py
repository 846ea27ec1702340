"""Layer-wise tail on two real vLLM CPU processes: from prefill's last layer computed to decode holding every block.

    python benchmarks/layer_tail.py [--requests 20] [--tokens 1900,1000] [--chunk-tokens 512] [--json out.json]

Starts a prefill and a decode vLLM instance of the tiny model (4 layers, 2 KV heads x 32 dim x fp32 x 128-token
blocks: 64 KiB per layer-block, the size of vLLM's default 16-token block of Llama-3-8B), DisaggConnector over TCP,
each pinned to its own core. Per request, decode's leg is sent first and prefill's ``--register-s`` later, so
decode has registered before prefill computes its first layer and every layer can leave as soon as it is computed
(the proxy's parallel flow). Both instances write transfer traces with ``time.monotonic`` times, one clock on one
host, so prefill's and decode's times compare directly:

  tail   decode's load done (every block in place)  -  prefill's last layer offered (its KV computed), reported
         in three parts: prefill handing that layer to zmq, the wire until decode held it, decode's bookkeeping
  layer  median over the other layers of (that layer complete on decode - that layer offered on prefill):
         one layer's transfer as this run measured it

Target (#17): tail <= layer + 2 ms. Runs unchunked prefill (the prompt in one step) and chunked prefill (the
prefill instance's ``--max-num-batched-tokens`` set to ``--chunk-tokens``, so a layer is offered once per chunk
and only the last chunk's offers end the transfer). A request whose decode registered after prefill's first offer
is reported but not judged (its early layers waited for the registration, not for the wire).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_info, percentile, render_table  # noqa: E402

from vllm_disagg.router.legs import decode_leg_params, prefill_leg_params  # noqa: E402
from vllm_disagg.tools.harness import (  # noqa: E402
    VLLMServer,
    disagg_connector_args,
    free_port,
    start_many,
    tiny_model_args,
)
from vllm_disagg.tools.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".artifacts" / "tiny-model"
TARGET_SLACK_S = 0.002


def tail_figures(send: dict[str, Any], recv: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """One transfer's tail and per-layer transfer times from its prefill (send) and decode (recv) trace records.

    The last ``num_layers`` offers are the last prefill chunk's, one per layer in layer order; a layer is complete
    on decode once its last chunk's blocks are in place, so each layer's transfer is timed from that offer."""
    offers = send["layer_offer_times"]
    done = recv["layer_done_times"]
    if recv["state"] != "done" or len(offers) < num_layers or len(done) != num_layers or not all(done):
        raise ValueError(f"transfer {send['transfer_id']}: not a complete layer-wise load ({recv['state']})")
    last = offers[-num_layers:]
    per_layer = [d - o for d, o in zip(done, last, strict=True)]
    layer = statistics.median(per_layer[:-1]) if num_layers > 1 else per_layer[0]
    tail = recv["t_done"] - offers[-1]
    # The tail in three parts: prefill's I/O thread taking the last layer and handing it to zmq; the bytes on the
    # way until decode held the last of them; decode's bookkeeping until it reported the load done.
    # Prefill stamps its last write after zmq took the layer, and that stamp can wait for the GIL while the bytes are
    # already on their way: the hand-off is capped at what the tail leaves before decode's bookkeeping.
    d_finish = max(0.0, recv["t_done"] - max(done))
    p_send = min(max(0.0, send["t_last_send"] - offers[-1]), max(0.0, tail - d_finish))
    return {
        "transfer_id": send["transfer_id"],
        "bytes": recv["bytes"],
        "offers": len(offers),
        "registered_first": recv["t_start"] < offers[0],
        "tail_s": tail,
        "layer_s": layer,
        "per_layer_s": per_layer,
        "tail_parts_s": {
            "prefill_send": p_send,
            "wire": max(0.0, tail - p_send - d_finish),
            "decode_finish": d_finish,
        },
        "meets_target": tail <= layer + TARGET_SLACK_S,
    }


def read_trace(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(transfer id, side) -> the record; a missing file is no records."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[(rec["transfer_id"], rec["side"])] = rec
    return out


def complete(url: str, prompt: list[int], max_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    body = {
        "model": str(MODEL),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def one_transfer(
    prefill: VLLMServer,
    decode: VLLMServer,
    p_side: int,
    prompt: list[int],
    register_s: float,
    secret: bytes | None = None,
) -> str:
    """Decode's leg first, prefill's ``register_s`` later; returns the transfer id. ``secret``: the instances'
    shared secret, to vouch for both legs' params as the proxy does."""
    tid = uuid.uuid4().hex
    d_params = decode_leg_params(tid, "127.0.0.1", p_side, secret)
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(complete, decode.url, prompt, 2, d_params)
        time.sleep(register_s)
        fp = ex.submit(complete, prefill.url, prompt, 1, prefill_leg_params(tid, secret))
        fp.result()
        fd.result()
    return tid


def wait_records(
    trace: Path, tids: list[str], timeout: float = 30.0
) -> dict[tuple[str, str], dict[str, Any]]:
    """The send and recv records of every transfer in ``tids`` (prefill records a send once decode let go)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = read_trace(trace)
        if all((t, s) in recs for t in tids for s in ("send", "recv")) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def run_mode(
    mode: str, batched_tokens: int, lengths: list[int], requests: int, register_s: float, out_dir: Path
) -> list[dict[str, Any]]:
    trace = out_dir / f"transfers-{mode}.jsonl"
    p_side, d_side = free_port(), free_port()
    engine = ["--max-num-batched-tokens", str(batched_tokens)]
    prefill = VLLMServer(
        str(MODEL),
        args=[*tiny_model_args(), *engine, *disagg_connector_args(p_side, trace_path=str(trace))],
        cpu_cores="0",
        name=f"tail-prefill-{mode}",
    )
    decode = VLLMServer(
        str(MODEL),
        args=[*tiny_model_args(), *disagg_connector_args(d_side, trace_path=str(trace))],
        cpu_cores="1",
        name=f"tail-decode-{mode}",
    )
    start_many([prefill, decode])
    try:
        return measure(mode, prefill, decode, p_side, trace, lengths, requests, register_s)
    finally:
        prefill.stop()
        decode.stop()


def measure(
    mode: str,
    prefill: VLLMServer,
    decode: VLLMServer,
    p_side: int,
    trace: Path,
    lengths: list[int],
    requests: int,
    register_s: float,
    secret: bytes | None = None,
) -> list[dict[str, Any]]:
    """``requests`` transfers per prompt length through a running pair whose instances both trace into ``trace``;
    one row per transfer (its ``tail_figures``, or an ``error``)."""
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(17)
    tids: dict[str, int] = {}
    one_transfer(
        prefill, decode, p_side, [5] * 300, register_s, secret
    )  # warm-up: first connection, first step
    for n in lengths:
        for _ in range(requests):
            prompt = [int(t) for t in rng.integers(4, 2000, size=n)]  # fresh tokens: no prefix cache hit
            tids[one_transfer(prefill, decode, p_side, prompt, register_s, secret)] = n
    recs = wait_records(trace, list(tids))
    for tid, n in tids.items():
        send, recv = recs.get((tid, "send")), recs.get((tid, "recv"))
        if send is None or recv is None:
            rows.append({"mode": mode, "tokens": n, "transfer_id": tid, "error": "no trace record"})
            continue
        try:
            rows.append(
                {"mode": mode, "tokens": n, **tail_figures(send, recv, TinyLlamaSpec().num_hidden_layers)}
            )
        except ValueError as exc:
            rows.append({"mode": mode, "tokens": n, "transfer_id": tid, "error": str(exc)})
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for key in sorted({(r["mode"], r["tokens"]) for r in rows}):
        group = [r for r in rows if (r["mode"], r["tokens"]) == key]
        judged = [r for r in group if "error" not in r and r["registered_first"]]
        if not judged:
            out.append({"mode": key[0], "tokens": str(key[1]), "judged": f"0/{len(group)}"})
            continue
        tails = [1e3 * r["tail_s"] for r in judged]
        layers = [1e3 * r["layer_s"] for r in judged]
        excess = [1e3 * (r["tail_s"] - r["layer_s"]) for r in judged]
        out.append(
            {
                "mode": key[0],
                "tokens": str(key[1]),
                "KiB/layer": f"{judged[0]['bytes'] / TinyLlamaSpec().num_hidden_layers / 1024:.0f}",
                "judged": f"{len(judged)}/{len(group)}",
                "tail p50 ms": f"{statistics.median(tails):.2f}",
                "tail p95 ms": f"{percentile(tails, 95):.2f}",
                "layer p50 ms": f"{statistics.median(layers):.2f}",
                "tail-layer max ms": f"{max(excess):.2f}",
                "p95 P send / wire / D finish ms": " / ".join(
                    f"{percentile([1e3 * r['tail_parts_s'][k] for r in judged], 95):.2f}"
                    for k in ("prefill_send", "wire", "decode_finish")
                ),
                "meets (<= layer + 2 ms)": f"{sum(r['meets_target'] for r in judged)}/{len(judged)}",
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="transfers per prompt length and mode")
    ap.add_argument("--tokens", default="1900,1000", help="comma-separated prompt lengths")
    ap.add_argument(
        "--chunk-tokens", type=int, default=512, help="prefill's token budget in the chunked mode"
    )
    ap.add_argument("--register-s", type=float, default=0.5, help="decode's head start over prefill")
    ap.add_argument("--modes", default="unchunked,chunked")
    ap.add_argument("--json", help="write the rows and summary here")
    ns = ap.parse_args(argv)
    if not is_tiny_model(MODEL, TinyLlamaSpec()):
        write_tiny_model(MODEL, TinyLlamaSpec())
    lengths = [int(x) for x in ns.tokens.split(",")]
    budgets = {"unchunked": 2048, "chunked": ns.chunk_tokens}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="layer-tail-") as tmp:
        for mode in ns.modes.split(","):
            rows += run_mode(mode, budgets[mode], lengths, ns.requests, ns.register_s, Path(tmp))
    table = summary(rows)
    cols = ["mode", "tokens", "KiB/layer", "judged", "tail p50 ms", "tail p95 ms", "layer p50 ms"]
    more = ["p95 P send / wire / D finish ms", "tail-layer max ms", "meets (<= layer + 2 ms)"]
    print(render_table(table, [*cols, *more]))
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"transfer {r['transfer_id']} ({r['mode']}, {r['tokens']} tokens): {r['error']}")
    if ns.json:
        Path(ns.json).write_text(
            json.dumps({"machine": machine_info(), "rows": rows, "summary": table}, indent=1)
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
