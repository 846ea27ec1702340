"""Transport benchmark: GB/s of whole-block, layer-wise KV transfers, side by side, as ratios to memcpy.

Runs, in one invocation on one machine (sender in this process, receiver in a child process, loopback), for each
block size at equal bytes per transfer:
  * memcpy      -- numpy gather/scatter of the same scattered blocks inside one process (the ceiling)
  * nixl-raw    -- NIXL WRITE of the same scattered blocks between two agents, no engine (if nixl is installed)
  * engine-tcp  -- vllm-disagg's transfer engine, TCP (pyzmq) data path
  * engine-nixl -- vllm-disagg's transfer engine, NIXL data path (if nixl is installed)

Each engine row also reports the Python CPU per layer-block on each side (process CPU time of prefill's and of
decode's process over the transfer, I/O threads included, divided by layers x blocks), unchunked (every layer
offered once) and chunked (the prompt offered in ``--chunks`` prefill chunks, layer by layer per chunk, as vLLM's
chunked prefill does). ``--cpu-only`` runs just the CPU-cost check: 80 layers x 2,048 tiny blocks per side, where
bytes cost nothing and what is left is per-block bookkeeping.

    python benchmarks/transport.py [--layers 32] [--mbytes 268] [--block-kib 512,64,8] [--chunks 16] [--json out.json]
    python benchmarks/transport.py --cpu-only [--cpu-layers 80] [--cpu-blocks 2048]

512 KiB per layer-block ~ one 128-token block of Llama-3-8B (8 KV heads x 128 dim x bf16 x K+V); 64 KiB is vLLM's
default 16-token block of the same model, 8 KiB that block of Llama-3-70B at TP 8 (one KV head per rank).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import dataclass
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


def bench_nixl_raw(layers: int, n: int, block_bytes: int, num_blocks: int) -> tuple[float, float]:
    """NIXL's own API, no engine: two agents, one WRITE per layer from descriptor arrays built in numpy (what a
    careful direct user does). Returns (seconds, process CPU seconds)."""
    from nixl._api import nixl_agent, nixl_agent_config

    src, dst = _store(layers, num_blocks, block_bytes, True), _store(layers, num_blocks, block_bytes, False)
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("raw-a", cfg), nixl_agent("raw-b", cfg)
    regs = [
        (ag, ag.register_memory([(s, ln, 0, "") for s, ln in st.region().spans], "DRAM"))
        for ag, st in ((a, src), (b, dst))
    ]
    a.add_remote_agent(b.get_agent_metadata())
    s_ids = np.array(_scatter(n, num_blocks, 1), dtype=np.uint64)
    d_ids = np.array(_scatter(n, num_blocks, 2), dtype=np.uint64)
    ones = np.full(n, block_bytes, dtype=np.uint64)
    zeros = np.zeros(n, dtype=np.uint64)
    cpu, t = time.process_time(), time.perf_counter()
    handles = []
    for layer in range(layers):
        s_base, d_base = src.layers[layer].ctypes.data, dst.layers[layer].ctypes.data
        local = a.get_xfer_descs(np.stack([s_base + s_ids * block_bytes, ones, zeros], 1), "DRAM")
        far = a.get_xfer_descs(np.stack([d_base + d_ids * block_bytes, ones, zeros], 1), "DRAM")
        h = a.initialize_xfer("WRITE", local, far, "raw-b", b"n")
        assert a.transfer(h) != "ERR"
        handles.append(h)
    while handles:
        handles = [h for h in handles if a.check_xfer_state(h) != "DONE"]
        b.get_new_notifs()  # the target must progress UCX too (as the engine's I/O loop does)
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    assert bytes(dst.read(layers - 1, int(d_ids[-1]))) == bytes(src.read(layers - 1, int(s_ids[-1])))
    for ag, reg in regs:
        ag.deregister_memory(reg)
    return dt, dcpu


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
        tid, port, dest, poll_s = cmd
        cpu = time.process_time()
        eng.start_load("r-" + tid, tid, ("127.0.0.1", port), dest, 0, len(dest) * 128)
        while True:
            res = eng.poll_results()
            if res.finished_recving:
                conn.send((time.perf_counter(), not res.failed_recving, time.process_time() - cpu))
                break
            time.sleep(poll_s)
    eng.close()


@dataclass
class Run:
    """One timed transfer: wall seconds, and process CPU seconds on prefill's and decode's side."""

    seconds: float
    p_cpu: float
    d_cpu: float


def _offer_all(
    p: TransferEngine, tid: str, layers: int, s_ids: list[int], chunks: int, pace_s: float = 0.0
) -> float:
    """Offer the prompt's blocks as a (chunked) prefill would: per chunk, every layer in order, the chunk's blocks
    as one list shared by all layers, then the forward pass's end (as the connector does). ``pace_s``: the time one
    layer's forward takes (0: offered back to back, so offers queue up while the engine works and go out several
    layers at a time). Returns the CPU this thread spent in its pacing sleeps (a timer wake-up costs tens of µs on
    a VM): not the engine's, so the caller leaves it out of prefill's CPU."""
    n = len(s_ids)
    bounds = [n * c // chunks for c in range(chunks + 1)]
    next_t = time.perf_counter()
    sleeping = 0.0
    for c in range(chunks):
        blocks = [(i, s_ids[i]) for i in range(bounds[c], bounds[c + 1])]
        for layer in range(layers):
            p.offer_blocks(tid, layer, blocks)
            if pace_s:
                next_t += pace_s
                t = time.thread_time()
                time.sleep(max(0.0, next_t - time.perf_counter()))
                sleeping += time.thread_time() - t
        p.mark_forward_end([tid] if c == chunks - 1 else [])  # as the connector's wait_for_save, every step
    return sleeping


def bench_engine(
    transport: str,
    layers: int,
    n: int,
    block_bytes: int,
    num_blocks: int,
    repeat: int,
    fixed: bool = False,
    chunks: int = 1,
    pace_s: float = 0.0,
    offer_batch_ms: float | None = None,
    offer_hold_bytes: int | None = None,
) -> list[Run]:
    """Per transfer: wall time and both sides' CPU. Default: the push of the whole KV to an already registered
    decode (bandwidth), offered in ``chunks`` prefill chunks. ``fixed``: a prefill that already finished, and the
    time from the decode's load request to its completion (registration round trip, layer messages, completion
    notice): the per-transfer cost that does not shrink with size, which the planner's break-even uses."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver, args=(child, layers, num_blocks, block_bytes, transport), daemon=True
    )
    proc.start()
    got = parent.recv()
    window: dict[str, Any] = {} if offer_batch_ms is None else {"offer_batch_ms": offer_batch_ms}
    if offer_hold_bytes is not None:
        window["offer_hold_bytes"] = offer_hold_bytes
    p = TransferEngine(
        _store(layers, num_blocks, block_bytes, True),
        _geometry(layers, block_bytes),
        "bench-p",
        EngineSettings(bind_host="127.0.0.1", transport=transport, **window),
    )
    assert got == p.data_path == transport, (got, p.data_path, transport)
    runs = []
    poll_s = 0.005 if pace_s else 0.0005  # decode's completion check; paced runs are long, so poll less there
    try:
        for r in range(repeat + 1):  # the first round warms up the connection and handshake
            tid = f"t{r}"
            s_ids, d_ids = _scatter(n, num_blocks, 10 + r), _scatter(n, num_blocks, 20 + r)
            p.begin_send(tid, "req", n * 128)
            if fixed:
                _offer_all(p, tid, layers, s_ids, 1)
                time.sleep(0.05)
                cpu, t = time.process_time(), time.perf_counter()
                pacing = 0.0
                parent.send((tid, p.port, d_ids, poll_s))
            else:
                parent.send((tid, p.port, d_ids, poll_s))
                time.sleep(0.2)  # decode registered: measure the push, not the handshake
                cpu, t = time.process_time(), time.perf_counter()
                pacing = _offer_all(p, tid, layers, s_ids, chunks, pace_s)
            t_done, ok, d_cpu = parent.recv()
            p_cpu = time.process_time() - cpu - pacing
            assert ok, f"{transport} transfer failed"
            p.finish_send(tid, aborted=False)
            if r:
                runs.append(Run(t_done - t, p_cpu, d_cpu))
    finally:
        parent.send(None)
        proc.join(timeout=10)
        p.close()
    return runs


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _us_per_block(runs: list[Run], side: str, layer_blocks: int) -> float:
    """Median CPU microseconds per layer-block on one side."""
    return _median([getattr(r, side) for r in runs]) / layer_blocks * 1e6


def measure_size(ns: argparse.Namespace, block_kib: int) -> dict[str, Any]:
    """All rows for one block size, at ``--mbytes`` per transfer."""
    bb = block_kib * 1024
    n = max(1, ns.mbytes * 1_000_000 // (ns.layers * bb))
    num_blocks = n * 4
    total = ns.layers * n * bb
    lb = ns.layers * n
    gbps: dict[str, float] = {}
    cpu: dict[str, dict[str, float]] = {}
    gbps["memcpy"] = total / min(bench_memcpy(ns.layers, n, bb, num_blocks) for _ in range(ns.repeat))
    if nixl_available():
        gbps["nixl-raw"] = total / min(
            bench_nixl_raw(ns.layers, n, bb, num_blocks)[0] for _ in range(ns.repeat)
        )
    for transport in ("tcp", "nixl") if nixl_available() else ("tcp",):
        name = f"engine-{transport}"
        runs = bench_engine(transport, ns.layers, n, bb, num_blocks, ns.repeat)
        gbps[name] = total / min(r.seconds for r in runs)
        chunked = bench_engine(transport, ns.layers, n, bb, num_blocks, ns.repeat, chunks=ns.chunks)
        gbps[f"{name} ({ns.chunks} chunks)"] = total / min(r.seconds for r in chunked)
        cpu[name] = {"p": _us_per_block(runs, "p_cpu", lb), "d": _us_per_block(runs, "d_cpu", lb)}
        cpu[f"{name} ({ns.chunks} chunks)"] = {
            "p": _us_per_block(chunked, "p_cpu", lb),
            "d": _us_per_block(chunked, "d_cpu", lb),
        }
    return {"block_kib": block_kib, "blocks": n, "bytes": total, "gbps": gbps, "cpu_us_per_layer_block": cpu}


def cpu_check(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Python CPU of 80 layers x 2,048 blocks per side (tiny blocks: only bookkeeping costs), chunked or not."""
    layers, n, bb = ns.cpu_layers, ns.cpu_blocks, 64
    out: dict[str, dict[str, float]] = {}
    if nixl_available():
        # one process holds both agents, so its CPU is both sides' (UCX's own per-descriptor work included)
        raw = min((bench_nixl_raw(layers, n, bb, n * 2) for _ in range(2)), key=lambda r: r[1])
        out["nixl-raw (P+D in one process)"] = {"p_ms": raw[1] * 1e3, "d_ms": 0.0, "wall_ms": raw[0] * 1e3}
    pace = ns.pace_ms / 1e3
    for transport in ("tcp", "nixl") if nixl_available() else ("tcp",):
        # the last rows: the paced one without holding small offers for the step's end (each window sends), and
        # without the offer window at all (every layer its own message), in the same run
        for chunks, pace_s, window, hold in (
            (1, 0.0, None, None),
            (ns.chunks, 0.0, None, None),
            (ns.chunks, pace, None, None),
            (ns.chunks, pace, None, 0),
            (ns.chunks, pace, 0.0, None),
        ):
            runs = bench_engine(
                transport,
                layers,
                n,
                bb,
                n * 2,
                ns.cpu_repeat,
                chunks=chunks,
                pace_s=pace_s,
                offer_batch_ms=window,
                offer_hold_bytes=hold,
            )
            name = f"engine-{transport} {chunks} chunk(s)" + (
                f", a layer per {ns.pace_ms:g} ms" if pace_s else ""
            )
            if window is not None:
                name += f", offer_batch_ms {window:g}"
            if hold is not None:
                name += f", offer_hold_bytes {hold}"
            out[name] = {  # medians: one transfer's CPU swings by half on this kind of VM
                "p_ms": _median([r.p_cpu for r in runs]) * 1e3,
                "d_ms": _median([r.d_cpu for r in runs]) * 1e3,
                "wall_ms": _median([r.seconds for r in runs]) * 1e3,
            }
    return out


def host_pace_penalty(pace_s: float, gathers: int, units: int = 1000) -> dict[str, float]:
    """What this host charges for running the same work at a forward pass's pace rather than back to back: one
    thread's CPU per work unit (``gathers`` gathers of 128 scattered 64 B blocks with numpy, as the engine does per
    layer, each with a few dict and list operations), run ``units`` times back to back, then once per ``pace_s``
    with sleeps between (the sleeps' own CPU left out, as the paced rows leave it out). On a VM whose core idles
    between units, caches and the vCPU's state go cold in each sleep: the paced rows pay that on every layer and
    every I/O turn, whatever the engine does."""
    rows = np.frombuffer(np.random.default_rng(0).bytes(2048 * 64), dtype=np.dtype((np.void, 64)))
    ids = np.random.default_rng(1).permutation(2048)[:128].astype(np.intp)
    out = np.empty(128, dtype=rows.dtype)

    def unit() -> None:
        for _ in range(gathers):
            rows.take(ids, out=out, mode="clip")
            pending: dict[int, list[np.ndarray]] = {}
            pending.setdefault(0, []).append(ids)
            del pending[0]

    res = {"gathers": float(gathers)}
    for name, pace in (("back_to_back_us", 0.0), ("paced_us", pace_s)):
        cpu0, slept, next_t = time.thread_time(), 0.0, time.perf_counter()
        for _ in range(units):
            unit()
            if pace:
                next_t += pace
                t = time.thread_time()
                time.sleep(max(0.0, next_t - time.perf_counter()))
                slept += time.thread_time() - t
        res[name] = (time.thread_time() - cpu0 - slept) / units * 1e6
    res["ratio"] = res["paced_us"] / max(res["back_to_back_us"], 1e-9)
    return res


def _print_size(res: dict[str, Any], layers: int) -> None:
    print(
        f"\n{res['block_kib']} KiB blocks: {layers} layers x {res['blocks']} scattered blocks = "
        f"{res['bytes'] / 1e6:.0f} MB per transfer"
    )
    rows = ratio_rows({k: v / 1e9 for k, v in res["gbps"].items()}, baseline="memcpy", unit="GB/s")
    base_nixl = res["gbps"].get("nixl-raw")
    for row in rows:
        c = res["cpu_us_per_layer_block"].get(row["path"])
        row["P CPU us/layer-block"] = f"{c['p']:.2f}" if c else ""
        row["D CPU us/layer-block"] = f"{c['d']:.2f}" if c else ""
        if base_nixl and row["path"].startswith("engine-nixl"):
            row["vs nixl-raw"] = f"{res['gbps'][row['path']] / base_nixl:.2f}x"
    cols = ["path", "GB/s", "vs memcpy", "vs nixl-raw", "P CPU us/layer-block", "D CPU us/layer-block"]
    print(render_table(rows, cols))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument(
        "--mbytes", type=int, default=268, help="bytes per transfer (MB), equal at every block size"
    )
    ap.add_argument("--block-kib", default="512,64,8", help="comma-separated layer-block sizes")
    ap.add_argument("--chunks", type=int, default=16, help="prefill chunks of the chunked rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fixed-repeat", type=int, default=30, help="tiny transfers timed for the fixed cost")
    ap.add_argument("--cpu-only", action="store_true", help="only the 80 x 2,048 CPU-cost check")
    ap.add_argument(
        "--pace-ms",
        type=float,
        default=1.0,
        help="the CPU check's paced row: one layer offered per this many ms (a forward pass's layer time), so "
        "every layer is its own message",
    )
    ap.add_argument("--cpu-layers", type=int, default=80)
    ap.add_argument("--cpu-blocks", type=int, default=2048)
    ap.add_argument("--cpu-repeat", type=int, default=5, help="transfers per CPU-check row (median reported)")
    ap.add_argument("--json", help="write results here")
    ns = ap.parse_args(argv)
    os.environ.setdefault("UCX_MODULES", "^ib")
    result: dict[str, Any] = {"machine": machine_info()}
    if not ns.cpu_only:
        result["sizes"] = []
        for kib in (int(x) for x in ns.block_kib.split(",")):
            res = measure_size(ns, kib)
            result["sizes"].append(res)
            _print_size(res, ns.layers)
        tcp = {r["block_kib"]: r["gbps"]["engine-tcp"] for r in result["sizes"]}
        if 512 in tcp:
            print(
                "\nengine-tcp vs its own 512 KiB: "
                + ", ".join(f"{k} KiB {v / tcp[512]:.2f}x" for k, v in tcp.items())
            )
        # fixed cost: one 4 KiB block per layer, so the bytes take microseconds and what is left is per-transfer work
        fixed_ms: dict[str, float] = {}
        for transport in ("tcp", "nixl") if nixl_available() else ("tcp",):
            runs = bench_engine(transport, ns.layers, 1, 4096, 4, ns.fixed_repeat, fixed=True)
            times = sorted(r.seconds for r in runs)
            fixed_ms[f"engine-{transport}"] = times[len(times) // 2] * 1e3
        result["fixed_ms"] = fixed_ms
        print(
            f"fixed cost per transfer (median of {ns.fixed_repeat}; {ns.layers} layers x one 4 KiB block, from the "
            "decode's load request to its completion, prefill already done): "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in fixed_ms.items())
        )
    cpu = cpu_check(ns)
    result["cpu_check"] = cpu
    print(
        f"\nCPU check: {ns.cpu_layers} layers x {ns.cpu_blocks} blocks of 64 B (process CPU per side, ms; median of {ns.cpu_repeat} transfers)"
    )
    print(
        render_table(
            [{"run": k, **{c: f"{v:.0f}" for c, v in d.items()}} for k, d in cpu.items()],
            ["run", "p_ms", "d_ms", "wall_ms"],
        )
    )
    host = [host_pace_penalty(ns.pace_ms / 1e3, g) for g in (1, 16)]
    result["host_pace_penalty"] = host
    units = "; ".join(
        f"{int(h['gathers'])} gather(s) {h['back_to_back_us']:.1f} -> {h['paced_us']:.1f} us ({h['ratio']:.1f}x)"
        for h in host
    )
    print(
        f"host: one thread's CPU for the same work back to back -> run once per {ns.pace_ms:g} ms (gathers of 128 "
        f"blocks of 64 B): {units}. The paced rows pay this on every layer and I/O turn, whatever the engine does."
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
