"""Transport benchmark: GB/s of whole-block, layer-wise KV transfers, side by side, as ratios to memcpy.

Runs, in one invocation on one machine (sender in this process, receiver in a child process, loopback):
  * memcpy      -- numpy gather/scatter of the same scattered blocks inside one process (the ceiling)
  * nixl-raw    -- NIXL WRITE of the same scattered blocks between two agents, no engine (if nixl is installed)
  * engine-tcp  -- vllm-disagg's transfer engine, TCP (pyzmq) data path
  * engine-nixl -- vllm-disagg's transfer engine, NIXL data path (if nixl is installed)

    python benchmarks/transport.py [--layers 32] [--blocks 64] [--block-kib 512] [--repeat 3] [--json out.json]

Block size 512 KiB per layer ~ one 128-token block of Llama-3-8B (8 KV heads x 128 dim x bf16 x K+V).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_info, ratio_rows, render_table  # noqa: E402

from vllm_disagg.kv_layout import KVGeometry  # noqa: E402
from vllm_disagg.transport.block_store import HostBlockStore  # noqa: E402
from vllm_disagg.transport.engine import EngineSettings, TransferEngine  # noqa: E402
from vllm_disagg.transport.nixl import nixl_available  # noqa: E402


def _store(layers: int, num_blocks: int, block_bytes: int, fill: bool) -> HostBlockStore:
    rng = np.random.default_rng(0)
    arrays = []
    for _ in range(layers):
        a = np.empty((num_blocks, block_bytes), dtype=np.uint8)
        a[:] = rng.integers(0, 255, size=(1, block_bytes), dtype=np.uint8) if fill else 0
        arrays.append(a)
    return HostBlockStore(arrays)


def _geometry(layers: int, block_bytes: int) -> KVGeometry:
    return KVGeometry(
        model="bench",
        num_layers=layers,
        num_kv_heads=8,
        head_size=128,
        block_size=128,
        dtype="bfloat16",
        kv_layout="bench",
        block_bytes=block_bytes,
    )


def _scatter(n: int, num_blocks: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).permutation(num_blocks)[:n]]


def bench_memcpy(layers: int, n: int, block_bytes: int, num_blocks: int) -> float:
    src, dst = _store(layers, num_blocks, block_bytes, True), _store(layers, num_blocks, block_bytes, False)
    s_ids, d_ids = _scatter(n, num_blocks, 1), _scatter(n, num_blocks, 2)
    t = time.perf_counter()
    for layer in range(layers):
        dst.layers[layer][d_ids] = src.layers[layer][s_ids]
    return time.perf_counter() - t


def bench_nixl_raw(layers: int, n: int, block_bytes: int, num_blocks: int) -> float:
    from vllm_disagg.transport.nixl import NixlAgent

    src, dst = _store(layers, num_blocks, block_bytes, True), _store(layers, num_blocks, block_bytes, False)
    a = NixlAgent("bench-a", src.region(), block_bytes)
    b = NixlAgent("bench-b", dst.region(), block_bytes)
    peer = a.add_peer(b.info())
    s_ids, d_ids = _scatter(n, num_blocks, 1), _scatter(n, num_blocks, 2)
    t = time.perf_counter()
    for layer in range(layers):
        a.write_blocks("x", peer, layer, s_ids, d_ids, b"n")
    while a.pending:
        a.progress()
        b.notifications()  # the target must progress UCX too (as the engine's I/O loop does)
    dt = time.perf_counter() - t
    assert bytes(dst.read(layers - 1, d_ids[-1])) == bytes(src.read(layers - 1, s_ids[-1]))
    a.close()
    b.close()
    return dt


def _receiver(conn: Any, layers: int, num_blocks: int, block_bytes: int, transport: str) -> None:
    eng = TransferEngine(
        _store(layers, num_blocks, block_bytes, False),
        _geometry(layers, block_bytes),
        "bench-d",
        EngineSettings(bind_host="127.0.0.1", transport=transport, load_timeout_s=120),
    )
    conn.send(eng.data_path)
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        tid, port, dest = cmd
        eng.start_load("r-" + tid, tid, ("127.0.0.1", port), dest, 0, len(dest) * 128)
        while True:
            res = eng.poll_results()
            if res.finished_recving:
                conn.send((time.perf_counter(), not res.failed_recving))
                break
            time.sleep(0.0005)
    eng.close()


def bench_engine(
    transport: str, layers: int, n: int, block_bytes: int, num_blocks: int, repeat: int, fixed: bool = False
) -> list[float]:
    """Seconds per transfer. Default: the push of the whole KV to an already registered decode (bandwidth).
    ``fixed``: a prefill that already finished, and the time from the decode's load request to its completion
    (registration round trip, layer messages, completion notice): the per-transfer cost that does not shrink with
    size, which the planner's break-even uses."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver, args=(child, layers, num_blocks, block_bytes, transport), daemon=True
    )
    proc.start()
    got = parent.recv()
    p = TransferEngine(
        _store(layers, num_blocks, block_bytes, True),
        _geometry(layers, block_bytes),
        "bench-p",
        EngineSettings(bind_host="127.0.0.1", transport=transport),
    )
    assert got == p.data_path == transport, (got, p.data_path, transport)
    times = []
    try:
        for r in range(repeat + 1):  # the first round warms up the connection and handshake
            tid = f"t{r}"
            s_ids, d_ids = _scatter(n, num_blocks, 10 + r), _scatter(n, num_blocks, 20 + r)
            p.begin_send(tid, "req", n * 128)
            if fixed:
                for layer in range(layers):
                    p.offer_blocks(tid, layer, list(enumerate(s_ids)))
                t = time.perf_counter()
                parent.send((tid, p.port, d_ids))
            else:
                parent.send((tid, p.port, d_ids))
                time.sleep(0.2)  # decode registered: measure the push, not the handshake
                t = time.perf_counter()
                for layer in range(layers):
                    p.offer_blocks(tid, layer, list(enumerate(s_ids)))
            t_done, ok = parent.recv()
            assert ok, f"{transport} transfer failed"
            p.finish_send(tid, aborted=False)
            if r:
                times.append(t_done - t)
    finally:
        parent.send(None)
        proc.join(timeout=10)
        p.close()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16, help="blocks per layer in one transfer")
    ap.add_argument("--block-kib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fixed-repeat", type=int, default=30, help="tiny transfers timed for the fixed cost")
    ap.add_argument("--json", help="write results here")
    ns = ap.parse_args(argv)
    os.environ.setdefault("UCX_MODULES", "^ib")
    bb = ns.block_kib * 1024
    num_blocks = ns.blocks * 4
    total = ns.layers * ns.blocks * bb
    results: dict[str, float] = {}
    results["memcpy"] = total / min(
        bench_memcpy(ns.layers, ns.blocks, bb, num_blocks) for _ in range(ns.repeat)
    )
    if nixl_available():
        results["nixl-raw"] = total / min(
            bench_nixl_raw(ns.layers, ns.blocks, bb, num_blocks) for _ in range(ns.repeat)
        )
    results["engine-tcp"] = total / min(bench_engine("tcp", ns.layers, ns.blocks, bb, num_blocks, ns.repeat))
    if nixl_available():
        results["engine-nixl"] = total / min(
            bench_engine("nixl", ns.layers, ns.blocks, bb, num_blocks, ns.repeat)
        )
    # fixed cost: one 4 KiB block per layer, so the bytes take microseconds and what is left is per-transfer work
    fixed_ms: dict[str, float] = {}
    for transport in ("tcp", "nixl") if nixl_available() else ("tcp",):
        times = sorted(bench_engine(transport, ns.layers, 1, 4096, 4, ns.fixed_repeat, fixed=True))
        fixed_ms[f"engine-{transport}"] = times[len(times) // 2] * 1e3
    rows = ratio_rows({k: v / 1e9 for k, v in results.items()}, baseline="memcpy", unit="GB/s")
    print(
        f"transfer of {ns.layers} layers x {ns.blocks} scattered blocks x {ns.block_kib} KiB = {total / 1e6:.0f} MB"
    )
    print(render_table(rows, ["path", "GB/s", "vs memcpy"]))
    print(
        f"fixed cost per transfer (median of {ns.fixed_repeat}; {ns.layers} layers x one 4 KiB block, from the "
        "decode's load request to its completion, prefill already done): "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in fixed_ms.items())
    )
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {
                    "machine": machine_info(),
                    "bytes": total,
                    "gbps": {k: v / 1e9 for k, v in results.items()},
                    "fixed_ms": fixed_ms,
                },
                indent=2,
            )
        )
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
