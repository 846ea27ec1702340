#!/usr/bin/env python3
"""One-shot check of the device KV path on a lent GPU machine (``make gpu-check``; docs/gpu-check.md).

The machine has torch with CUDA but no vLLM and no network, so this script needs nothing else up front: it installs
numpy, msgspec, pyzmq and (optionally) nixl from a local wheels folder when they are missing, imports this checkout
without an install, and builds vLLM-shaped KV cache views itself. Without CUDA (or with ``--dry-run``) it runs the
same code on CPU tensors at small sizes, which is how CI keeps it working for the first time it meets a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import importlib.util
import itertools
import json
import logging
import os
import platform
import random
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import torch
except ImportError:  # pragma: no cover - the one thing the machine must bring
    sys.exit(
        f"gpu_check: torch is not importable by {sys.executable}; run this with the Python that has torch"
    )

if TYPE_CHECKING:
    from vllm_disagg.connectors.device_store import DeviceBlockStore
    from vllm_disagg.transport.engine import TransferEngine

REPO = Path(__file__).resolve().parent.parent
REQUIRED = {"numpy": "numpy", "msgspec": "msgspec", "zmq": "pyzmq"}  # import name -> wheel name
DIMS = "LBHNC"  # vLLM's logical KV axes: layer, block, head, token, content (bytes)
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DEFAULT_LAYOUT = "LBNHC"
KIB = 1024
INSTALLED_ENV = "VLLM_DISAGG_GPU_CHECK_INSTALLED"  # set across the restart that follows an install
_engine_ids = itertools.count()


class Skipped(Exception):
    """A step that cannot run here (e.g. no nixl); it is reported, not failed."""


def expect(ok: bool, message: str) -> None:
    """An assertion that survives ``python -O``."""
    if not ok:
        raise AssertionError(message)


# --------------------------------------------------------------------------------------------- vLLM-shaped caches


@dataclass(frozen=True)
class KVShape:
    """One attention KV cache group: ``layers`` x ``blocks`` pages of [heads, tokens, K and V content]."""

    layers: int
    blocks: int
    heads: int
    tokens: int = 16
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def content_bytes(self) -> int:
        return 2 * self.head_size * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.heads * self.tokens * self.content_bytes

    @property
    def nbytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    def byte_shape(self) -> tuple[int, int, int, int, int]:
        """Logical [L, B, H, N, C] with C in bytes, as vLLM lays out its int8 allocation."""
        return (self.layers, self.blocks, self.heads, self.tokens, self.content_bytes)


def layout_order(layout: str) -> tuple[int, ...]:
    """The logical axes in physical order, outermost first: a layout's name spells it (LBNHC: N before H)."""
    if sorted(layout) != sorted(DIMS):
        raise ValueError(f"unknown KV cache layout {layout!r}")
    return tuple(DIMS.index(ch) for ch in layout)


def block_compact(layout: str) -> bool:
    """Each page is one run of bytes when layers and blocks are the two outermost axes (NIXL can address it)."""
    return set(layout[:2]) == {"L", "B"}


def dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides of a tensor of logical ``shape`` whose axes are stored densely in physical ``order``."""
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


def kv_cache_views(raw: torch.Tensor, shape: KVShape, layout: str, offset: int = 0) -> list[torch.Tensor]:
    """What vLLM 0.32 hands a connector, without vLLM: one strided [B, H, N, C] view per layer into one int8
    buffer (``offset`` bytes in), then viewed as the cache dtype. tests/unit/test_gpu_check.py proves it equal to
    vLLM's ``create_kv_cache_views`` for every layout."""
    dims = shape.byte_shape()
    strides = dense_strides(dims, layout_order(layout))
    base = raw.storage_offset() + offset
    return [
        torch.as_strided(raw, dims[1:], strides[1:], base + layer * strides[0]).view(shape.dtype)
        for layer in range(shape.layers)
    ]


@dataclass
class Cache:
    raw: torch.Tensor  # the int8 allocation
    views: list[torch.Tensor]


def make_cache(shape: KVShape, layout: str, device: torch.device, seed: int | None) -> Cache:
    """A cache on ``device``: random bytes (bit patterns, NaNs included: compare bytes, not values) or zeros."""
    raw = torch.zeros(shape.nbytes, dtype=torch.int8, device=device)
    if seed is not None:
        raw.random_(-128, 128, generator=torch.Generator(device=device).manual_seed(seed))
    sync(device)  # the receiver's copies run on the store's own stream, unordered with this one
    return Cache(raw, kv_cache_views(raw, shape, layout))


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def logical_bytes(t: torch.Tensor) -> bytes:
    """A block's bytes in logical [H, N, C] order: what the TCP path puts on the wire."""
    return bytes(u8(t.contiguous()).cpu().numpy().tobytes())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_store(views: list[torch.Tensor], direct: bool) -> DeviceBlockStore:
    """The store as DisaggConnector builds it on a worker (device id and NIXL memory type come from the views)."""
    from vllm_disagg.connectors.device_store import DeviceBlockStore, TorchDeviceOps

    return DeviceBlockStore(views, TorchDeviceOps(views[0].device), direct=direct)


# --------------------------------------------------------------------------------------------- set-up


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def nixl_importable() -> bool:
    try:
        return hasattr(importlib.import_module("nixl._api"), "nixl_agent")
    except Exception:
        return False


def pip_install(wheels: Path, packages: list[str], *flags: str) -> tuple[bool, str]:
    """Offline install from the wheels folder into this interpreter (a system Python may need the PEP 668
    override; the lent machine is thrown away after the run)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(wheels),
        *flags,
        *packages,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode and "externally-managed-environment" in proc.stdout + proc.stderr:
        proc = subprocess.run([*cmd, "--break-system-packages"], capture_output=True, text=True, timeout=600)
    importlib.invalidate_caches()
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, " | ".join(lines[-3:])


def ensure_deps(wheels: Path, install: bool) -> str:
    """numpy, msgspec and pyzmq are what the store and the engine import; install the missing ones offline."""
    missing = [m for m in REQUIRED if not importable(m)]
    installed = os.environ.get(INSTALLED_ENV, "")
    if not missing:
        return f"{installed}; restarted to import them" if installed else "numpy, msgspec, pyzmq importable"
    packages = [REQUIRED[m] for m in missing]
    if installed:
        raise RuntimeError(f"{', '.join(packages)} still not importable after '{installed}' and a restart")
    if not install:
        raise RuntimeError(f"{', '.join(packages)} not importable (--no-install)")
    if not wheels.is_dir():
        raise RuntimeError(
            f"{', '.join(packages)} not importable and no wheels folder at {wheels} "
            "(--wheels DIR or VLLM_DISAGG_WHEELS)"
        )
    _, output = pip_install(wheels, packages)
    still = [REQUIRED[m] for m in missing if not importable(m)]
    if still:
        raise RuntimeError(f"could not install {', '.join(still)} from {wheels}: {output}")
    return f"installed {', '.join(packages)} from {wheels}"


def restart_after_install(installed: str) -> None:
    """torch looks for numpy once, when it is imported: a fresh interpreter sees what pip just installed."""
    os.environ[INSTALLED_ENV] = installed
    print(f"{installed}: restarting the check", flush=True)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def ensure_nixl(wheels: Path, install: bool) -> str:
    """NIXL is optional: without it the NIXL checks are skipped, never failed."""
    if nixl_importable():
        return "nixl importable"
    if not install or not wheels.is_dir() or not any(wheels.glob("nixl*")):
        raise Skipped(f"nixl not importable and no nixl wheel in {wheels}: NIXL checks skipped")
    _, output = pip_install(wheels, ["nixl"])
    if nixl_importable():
        return f"installed nixl from {wheels}"
    # nixl-cuXX requires torch, and pip then wants every requirement of the torch already here (setuptools, ...)
    # in the folder too; torch and numpy are here, so the nixl wheels alone will do.
    names = sorted({whl.name.split("-")[0] for whl in wheels.glob("nixl*.whl")})
    _, retry = pip_install(wheels, names, "--no-deps")
    if nixl_importable():
        return f"installed {', '.join(names)} from {wheels} with --no-deps (with deps, pip said: {output})"
    raise Skipped(f"nixl could not be installed from {wheels} ({output} / {retry}): NIXL checks skipped")


def bind_repo_packages(root: Path) -> str:
    """Import this checkout without ``pip install -e .``: setuptools maps connectors/ into vllm_disagg
    (package-dir in pyproject.toml), which a bare sys.path entry does not, so the subpackage is bound here.
    Only connectors/ is bound: router/ imports the proxy's dependencies, which this check does not need."""
    sys.path.insert(0, str(root))
    pkg = importlib.import_module("vllm_disagg")
    where = Path(pkg.__file__ or "").resolve().parent
    if where != (root / "vllm_disagg").resolve():
        raise RuntimeError(f"vllm_disagg was imported from {where}, not from this checkout {root}")
    name = "vllm_disagg.connectors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, root / "connectors" / "__init__.py", submodule_search_locations=[str(root / "connectors")]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        pkg.connectors = module  # type: ignore[attr-defined]
    store = importlib.import_module("vllm_disagg.connectors.device_store")
    importlib.import_module("vllm_disagg.transport.engine")
    heavy = [m for m in ("vllm", "pydantic") if m in sys.modules]
    expect(not heavy, f"importing the store and the engine pulled in {heavy}")
    return str(store.__file__)


# --------------------------------------------------------------------------------------------- store checks

SMALL = KVShape(layers=3, blocks=12, heads=2, tokens=16, head_size=32)
ENGINE_SHAPE = KVShape(layers=4, blocks=64, heads=2, tokens=16, head_size=64)


def check_tiling(shape: KVShape, layout: str, device: torch.device) -> None:
    """The views tile the allocation exactly once (no gap, no overlap), on this device."""
    cache = make_cache(shape, layout, device, None)
    for layer, view in enumerate(cache.views):
        u8(view).fill_(layer + 1)
    counts = torch.bincount(u8(cache.raw).long(), minlength=shape.layers + 1).tolist()
    per_layer = shape.blocks * shape.block_bytes
    expect(counts == [0] + [per_layer] * shape.layers, f"views do not tile the buffer: byte counts {counts}")


def check_moved(src: Cache, dst: Cache, moves: dict[int, int]) -> None:
    """Destination blocks equal their sources byte for byte; every other destination block is still zero."""
    for layer, (s, d) in enumerate(zip(src.views, dst.views, strict=True)):
        for sb, db in moves.items():
            expect(
                torch.equal(u8(d[db]).cpu(), u8(s[sb]).cpu()), f"layer {layer}: block {sb} -> {db} differs"
            )
        rest = [b for b in range(d.shape[0]) if b not in moves.values()]
        touched = bool(u8(d)[torch.tensor(rest, device=d.device)].any()) if rest else False
        expect(not touched, f"layer {layer}: a block outside the destination list was written")


def check_nixl_addresses(views: list[torch.Tensor], layout: str) -> str:
    """NIXL moves raw pages: each block's registered address must be the view's own block address."""
    store = make_store(views, direct=True)
    if not block_compact(layout):
        expect(not store.direct and store.region() is None, "a sparse layout was offered to NIXL")
        return "not registrable (TCP serves it)"
    expect(store.direct, "a dense layout was refused direct access")
    region = store.region()
    expect(region is not None, "region() is None for a dense layout")
    assert region is not None
    regions, bases, stride = region.spans, region.layer_addrs, region.block_stride
    for layer, view in enumerate(views):
        for b in range(view.shape[0]):
            addr = bases[layer] + b * stride
            expect(addr == view[b].data_ptr(), f"layer {layer} block {b}: address {addr} != data_ptr")
            inside = any(s <= addr and addr + store.block_bytes <= s + n for s, n in regions)
            expect(inside, f"layer {layer} block {b}: page outside the registered regions")
    device = max(views[0].get_device(), 0)
    expect(store.device_id == device, f"store.device_id {store.device_id} != tensor device {device}")
    return f"{len(regions)} region(s), addresses match"


def check_store(device: torch.device, layout: str) -> str:
    """Stage and read on a source cache, write and sync on a destination: TCP's device path for one layout."""
    check_tiling(SMALL, layout, device)
    src, dst = make_cache(SMALL, layout, device, 1), make_cache(SMALL, layout, device, None)
    sender, receiver = make_store(src.views, False), make_store(dst.views, False)
    moves = {3: 7, 8: 0, 11: 5}
    for layer in range(SMALL.layers):
        sender.stage("t", layer, list(moves))
        wire = [bytes(sender.read(layer, b, "t")) for b in moves]
        want = [logical_bytes(src.views[layer][b]) for b in moves]
        expect(wire == want, f"layer {layer}: staged bytes are not the blocks in logical order")
        receiver.write_blocks(layer, list(moves.values()), wire)
    receiver.sync()
    sender.release("t")
    check_moved(src, dst, moves)
    return f"{sender.layout_tag()}; NIXL: {check_nixl_addresses(src.views, layout)}"


# --------------------------------------------------------------------------------------------- engines


@dataclass
class Moved:
    seconds: float  # first stage() to the load reported (after the receiver's sync)
    cpu_s: float  # process CPU over that window, every thread
    reason: str
    pinned_peak: int = 0  # the most pinned bytes of staged copies the prefill store held (sampled each ms)


class EnginePair:
    """A prefill and a decode TransferEngine in this process, over loopback, driven as the connector drives them."""

    def __init__(
        self, p: TransferEngine, d: TransferEngine, source: DeviceBlockStore, timeout_s: float
    ) -> None:
        self.p, self.d, self.source, self.timeout_s = p, d, source, timeout_s
        self._sent: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._peak = 0

    def move(self, src_ids: list[int], dst_ids: list[int], late: bool = False) -> Moved:
        """Blocks ``src_ids`` of every layer to ``dst_ids``: stage and offer layer by layer, as save_kv_layer does.
        ``late``: decode registers only after every layer was staged and offered (past the staging budget, the
        copies left waiting are then made by the I/O thread when it sends their layers)."""
        from vllm_disagg.transport.block_store import staging_owner

        tid = uuid.uuid4().hex
        rp, rd = f"p-{tid}", f"d-{tid}"
        prompt_len = 16 * len(src_ids)
        self.p.begin_send(tid, rp, prompt_len)

        def register() -> None:
            self.d.start_load(
                rd, tid, ("127.0.0.1", self.p.port), dst_ids, first_block=0, prompt_len=prompt_len
            )

        if not late:
            register()
            time.sleep(0.3)  # decode registers first, as in the parallel flow; not timed
        offer = list(enumerate(src_ids))
        t0, c0 = time.perf_counter(), time.process_time()
        self._peak = 0
        for layer in range(self.source.num_layers):
            self.source.stage(staging_owner(tid, rp), layer, src_ids)  # the key the connector stages under
            self.p.offer_blocks(tid, layer, offer, rp)
        if late:
            register()
        self._wait(lambda: rd in self._loaded, self.timeout_s, "the load")
        moved = Moved(time.perf_counter() - t0, time.process_time() - c0, self._reason(tid), self._peak)
        expect(rd not in self._failed, f"the load failed: {moved.reason}")
        self.p.finish_send(tid, aborted=False, request_id=rp)
        self._wait(lambda: rp in self._sent, 30.0, "the sender's release")
        return moved

    def _reason(self, tid: str) -> str:
        self.p.drain_records()
        records = [r for r in self.d.drain_records() if r.transfer_id == tid]
        return records[-1].reason if records else ""

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.d.poll_results()
            self._loaded |= got.finished_recving
            self._failed |= got.failed_recving
            self._sent |= self.p.poll_results().finished_sending
            self._peak = max(self._peak, self.source.staged_bytes)
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
            time.sleep(0.001)


def geometry_of(store: DeviceBlockStore, shape: KVShape) -> Any:
    from vllm_disagg.kv_layout import KVGeometry

    return KVGeometry(
        model="gpu-check",
        num_layers=shape.layers,
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        block_size=shape.tokens,
        dtype=str(shape.dtype).removeprefix("torch."),
        kv_layout=store.layout_tag(),
        block_bytes=store.block_bytes,
    )


@contextlib.contextmanager
def engine_pair(
    source: DeviceBlockStore, dest: DeviceBlockStore, shape: KVShape, transport: str, timeout_s: float
) -> Iterator[EnginePair]:
    """``timeout_s`` bounds each load, so a transport that never delivers fails its step instead of the run."""
    from vllm_disagg.transport.engine import EngineSettings, TransferEngine

    def settings() -> EngineSettings:
        return EngineSettings(
            bind_host="127.0.0.1", transport=transport, load_timeout_s=timeout_s, lease_s=max(timeout_s, 30.0)
        )

    n = next(_engine_ids)
    p = TransferEngine(source, geometry_of(source, shape), f"gpu-check-p{n}", settings())
    try:
        d = TransferEngine(dest, geometry_of(dest, shape), f"gpu-check-d{n}", settings())
        try:
            expect(p.data_path == d.data_path == transport, f"data path {p.data_path}/{d.data_path}")
            yield EnginePair(p, d, source, timeout_s)
        finally:
            d.close()
    finally:
        p.close()


def check_late_decode(device: torch.device) -> str:
    """TCP with a staging budget of one layer's copy and a decode that registers after every layer was staged:
    the copies past the budget wait, the I/O thread makes them (on the side stream, after the kernels' event) when
    it sends their layers, and the destination still holds exactly the sources."""
    shape = ENGINE_SHAPE
    src = make_cache(shape, DEFAULT_LAYOUT, device, 9)
    dst = make_cache(shape, DEFAULT_LAYOUT, device, None)
    rng = random.Random(11)
    src_ids, dst_ids = rng.sample(range(shape.blocks), 40), rng.sample(range(shape.blocks), 40)
    source, dest = make_store(src.views, False), make_store(dst.views, False)
    source.staging_budget_bytes = source.pool.size_class(len(src_ids) * source.block_bytes)
    source.staging_floor_bytes = 0
    with engine_pair(source, dest, shape, "tcp", timeout_s=30.0) as pair:
        moved = pair.move(src_ids, dst_ids, late=True)
    check_moved(src, dst, dict(zip(src_ids, dst_ids, strict=True)))
    expect(source.deferred_gathers >= shape.layers - 1, f"only {source.deferred_gathers} gathers waited")
    expect(source.staged_bytes == 0, f"{source.staged_bytes} staged bytes left after the release")
    return (
        f"{source.deferred_gathers} of {shape.layers} layers' copies made when sent, "
        f"{len(src_ids)} blocks each, in {moved.seconds * 1e3:.0f} ms, bytes equal"
    )


def check_engines(src_dev: torch.device, dst_dev: torch.device, transport: str) -> str:
    """Two engines move scattered blocks of vLLM-shaped caches; the destination holds exactly the sources."""
    shape, direct = ENGINE_SHAPE, transport == "nixl"
    src = make_cache(shape, DEFAULT_LAYOUT, src_dev, 5)
    dst = make_cache(shape, DEFAULT_LAYOUT, dst_dev, None)
    rng = random.Random(7)
    src_ids, dst_ids = rng.sample(range(shape.blocks), 40), rng.sample(range(shape.blocks), 40)
    stores = make_store(src.views, direct), make_store(dst.views, direct)
    with engine_pair(*stores, shape, transport, timeout_s=30.0) as pair:
        moved = pair.move(src_ids, dst_ids)
    check_moved(src, dst, dict(zip(src_ids, dst_ids, strict=True)))
    if direct:
        expect("NIXL" in moved.reason, f"the load did not go over NIXL: {moved.reason!r}")
    memory = "DRAM" if src_dev.type == "cpu" else "VRAM"
    return f"{len(src_ids)} blocks x {shape.layers} layers ({memory}) in {moved.seconds * 1e3:.0f} ms: {moved.reason}"


# --------------------------------------------------------------------------------------------- throughput


@dataclass
class Row:
    path: str
    block_bytes: int
    layers: int
    blocks: int
    seconds: float
    cpu_s: float | None = None  # process CPU (every thread) over the timed window
    runs: list[float] = field(default_factory=list)
    pinned_peak: int | None = None  # engine TCP rows: the most pinned staging bytes prefill held at once

    @property
    def nbytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_block(self) -> float | None:
        return None if self.cpu_s is None else 1e6 * self.cpu_s / (self.layers * self.blocks)


@dataclass
class StageBench:
    run: int
    wall_ms_mean: float
    wall_ms_max: float
    cpu_us_per_layer_block: float  # main thread's stage() calls only, no engine running
    gather_gbps: float  # first stage() to every gather landed in pinned memory
    seconds: float
    cpu_s: float


def shape_for(block_kib: int, layers: int, blocks: int) -> KVShape:
    """64 KiB: a Llama-70B-class layer block (8 KV heads x 128 x bf16 x 16 tokens); 8 KiB: one KV head (TP 8)."""
    heads = block_kib * KIB // (16 * 2 * 128 * 2)
    return KVShape(layers=layers, blocks=blocks, heads=heads)


def host_available_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    return 0


def fit_blocks(shape: KVShape, device: torch.device) -> KVShape:
    """Fewer blocks when the two caches (device) or pinned staging on both sides (host) would not fit."""
    per_block = shape.layers * shape.block_bytes
    caps = [shape.blocks]
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        caps.append(int(free * 0.6) // (2 * per_block))
    host = host_available_bytes()
    if host:
        copies = 3 if device.type == "cuda" else 5  # staging twice + bounce, plus the caches on CPU
        caps.append(int(host * 0.5) // (copies * per_block))
    return replace(shape, blocks=max(1, min(caps)))


def time_d2d(src: Cache, dst: Cache, device: torch.device) -> float:
    """cudaMemcpy device-to-device of the same bytes (best of 3)."""
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.raw.copy_(src.raw)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def time_bounce(src: Cache, dst: Cache, device: torch.device, chunk: int = 1 << 30) -> tuple[float, float]:
    """Device to pinned host, then back, in chunks through one pinned buffer: (D2H seconds, H2D seconds)."""
    total = src.raw.numel()
    chunk = min(chunk, total)
    pinned = device.type == "cuda"
    host = torch.zeros(chunk, dtype=torch.int8, pin_memory=pinned)  # zeros: no first-touch page faults timed
    d2h = h2d = 0.0
    for off in range(0, total, chunk):
        n = min(chunk, total - off)
        sync(device)
        t0 = time.perf_counter()
        host[:n].copy_(src.raw[off : off + n], non_blocking=True)
        sync(device)
        t1 = time.perf_counter()
        dst.raw[off : off + n].copy_(host[:n], non_blocking=True)
        sync(device)
        d2h, h2d = d2h + t1 - t0, h2d + time.perf_counter() - t1
    return d2h, h2d


def bench_stage(store: DeviceBlockStore, shape: KVShape, device: torch.device, run: int) -> StageBench:
    """stage() of every block of every layer, as one long prompt's send; release() waits for every gather."""
    ids = list(range(shape.blocks))
    walls: list[float] = []
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for layer in range(shape.layers):
        t = time.perf_counter()
        store.stage("bench", layer, ids)
        walls.append(time.perf_counter() - t)
    cpu = time.process_time() - c0
    store.release("bench")
    total = time.perf_counter() - t0
    return StageBench(
        run=run,
        wall_ms_mean=1e3 * sum(walls) / len(walls),
        wall_ms_max=1e3 * max(walls),
        cpu_us_per_layer_block=1e6 * cpu / (shape.layers * shape.blocks),
        gather_gbps=shape.nbytes / total / 1e9,
        seconds=total,
        cpu_s=cpu,
    )


def time_engine(src: Cache, dst: Cache, shape: KVShape, transport: str, reps: int) -> Row:
    """Every block of every layer through two engines (after a one-block warm-up that opens the connection)."""
    direct = transport == "nixl"
    ids = list(range(shape.blocks))
    runs: list[Moved] = []
    stores = make_store(src.views, direct), make_store(dst.views, direct)
    with engine_pair(*stores, shape, transport, timeout_s=90.0) as pair:
        pair.move([0], [0])
        for _ in range(reps):
            dst.raw.zero_()
            sync(
                dst.raw.device
            )  # the receiver's copies run on the store's own stream, unordered with this one
            runs.append(pair.move(ids, ids))
            expect(torch.equal(src.raw, dst.raw), f"{transport}: destination cache differs from the source")
    best = min(runs, key=lambda m: m.seconds)
    return Row(
        f"engine {transport}",
        shape.block_bytes,
        shape.layers,
        shape.blocks,
        best.seconds,
        best.cpu_s,
        [m.seconds for m in runs],
        None if direct else max(m.pinned_peak for m in runs),
    )


def free_memory() -> None:
    """Return cached device and pinned host memory between block sizes (torch keeps both otherwise)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


# --------------------------------------------------------------------------------------------- report


@dataclass
class Step:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str = ""


class Report:
    """Steps as they finish (one line each), throughput rows, the summary line and the JSON file."""

    def __init__(self, json_path: Path, meta: dict[str, Any], budget_s: float = float("inf")) -> None:
        self.json_path = json_path
        self.meta = meta
        self.budget_s = budget_s
        self.steps: list[Step] = []
        self.rows: list[Row] = []
        self.stage: list[dict[str, Any]] = []
        self.current = ""
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._finished = False

    def run(self, name: str, fn: Callable[..., str | None], *args: Any) -> bool:
        """Run one step; a failure is printed with its exception and the check goes on."""
        self.current = name
        t0 = time.perf_counter()
        try:
            detail, status = fn(*args) or "", "PASS"
        except Skipped as exc:
            detail, status = str(exc), "SKIP"
        except Exception as exc:
            detail, status = f"{type(exc).__name__}: {exc}", "FAIL"
            traceback.print_exc(file=sys.stderr)
        self.add(Step(name, status, time.perf_counter() - t0, detail))
        return status == "PASS"

    def skip(self, name: str, why: str) -> None:
        self.add(Step(name, "SKIP", 0.0, why))

    def within_budget(self, name: str) -> bool:
        """Throughput steps start only within ``--budget-s``, so the whole check fits a short device lease."""
        if time.monotonic() - self.t0 < self.budget_s:
            return True
        self.skip(name, f"time budget spent (--budget-s {self.budget_s:.0f})")
        return False

    def add(self, step: Step) -> None:
        with self._lock:
            self.steps.append(step)
        print(f"{step.status:<4}  {step.name:<34} {step.seconds:7.2f} s  {step.detail}", flush=True)

    def status(self, name: str) -> str | None:
        return next((s.status for s in self.steps if s.name == name), None)

    def count(self, status: str) -> int:
        return sum(s.status == status for s in self.steps)

    def summary(self) -> str:
        ok = self.count("FAIL") == 0
        mode = "CPU dry run" if self.meta["dry_run"] else str(self.meta["devices"][0])
        rates = "; ".join(
            f"{r.path.removeprefix('engine ')} {r.block_bytes // KIB} KiB {r.gbps:.2f} GB/s"
            for r in self.rows
            if r.path.startswith("engine ")
        )
        return (
            f"gpu-check: {'PASS' if ok else 'FAIL'} ({self.count('PASS')} passed, {self.count('FAIL')} failed, "
            f"{self.count('SKIP')} skipped) on {mode} in {time.monotonic() - self.t0:.0f} s"
            + (f"; {rates}" if rates else "")
            + f"; results: {self.json_path}"
        )

    def finish(self) -> int:
        """Write the JSON and print the summary as the last line; the exit code says whether anything failed."""
        with self._lock:
            if self._finished:
                return 1
            self._finished = True
        line = self.summary()
        try:
            self.write_json(line)
        except OSError as exc:
            print(f"could not write {self.json_path}: {exc}", flush=True)
        print(line, flush=True)
        return 1 if self.count("FAIL") else 0

    def write_json(self, summary: str) -> None:
        doc = {
            **self.meta,
            "ok": self.count("FAIL") == 0,
            "summary": summary,
            "elapsed_s": time.monotonic() - self.t0,
            "steps": [asdict(s) for s in self.steps],
            "throughput": [
                {**asdict(r), "nbytes": r.nbytes, "gbps": r.gbps, "cpu_us_per_block": r.cpu_us_per_block}
                for r in self.rows
            ],
            "stage": self.stage,
        }
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")

    def arm_watchdog(self, timeout_s: float) -> None:
        """A hung step (a transport that never completes) still leaves the JSON and the summary behind."""
        timer = threading.Timer(timeout_s, self._hung, args=(timeout_s,))
        timer.daemon = True
        timer.start()

    def _hung(self, timeout_s: float) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.add(
            Step(self.current or "?", "FAIL", timeout_s, f"still running after {timeout_s:.0f} s (hung)")
        )
        code = self.finish()
        sys.stdout.flush()
        os._exit(code or 1)


def render_table(rows: list[Row]) -> list[str]:
    """GB/s per path and block size, with ratios to the baselines measured on the same bytes."""
    head = f"{'path':<16} {'block':>7} {'layers x blocks':>16} {'GiB':>7} {'s':>8} {'GB/s':>8} {'vs D2D':>7} {'vs D2H+H2D':>10} {'CPU us/blk':>10}"
    lines = [head, "-" * len(head)]
    for row in rows:
        same = [r for r in rows if r.block_bytes == row.block_bytes]
        d2d = next((r.gbps for r in same if r.path == "D2D copy_"), 0.0)
        bounce = next((r.gbps for r in same if r.path == "D2H+H2D pinned"), 0.0)
        cpu = row.cpu_us_per_block
        lines.append(
            f"{row.path:<16} {row.block_bytes // KIB:>4} KiB {f'{row.layers} x {row.blocks}':>16} "
            f"{row.nbytes / 2**30:>7.2f} {row.seconds:>8.4f} {row.gbps:>8.2f} "
            f"{(f'{row.gbps / d2d:.3f}' if d2d else '-'):>7} {(f'{row.gbps / bounce:.3f}' if bounce else '-'):>10} "
            f"{(f'{cpu:.2f}' if cpu is not None else '-'):>10}"
        )
    return lines


# --------------------------------------------------------------------------------------------- main


@dataclass
class Options:
    dry_run: bool
    json: Path
    wheels: Path
    install: bool
    layers: int | None
    blocks: int | None
    reps: int
    budget_s: float
    timeout_s: float
    throughput: bool
    require_cuda: bool


def parse_args(argv: Sequence[str] | None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU tensors, small sizes (automatic without CUDA)"
    )
    ap.add_argument("--json", type=Path, default=Path("gpu-check.json"), help="results file")
    default_wheels = os.environ.get("VLLM_DISAGG_WHEELS") or str(REPO / "shared" / "wheels")
    ap.add_argument("--wheels", type=Path, default=Path(default_wheels), help="offline wheels folder")
    ap.add_argument("--no-install", action="store_true", help="never run pip")
    ap.add_argument("--layers", type=int, help="throughput: layers (80 on GPU, 4 in a dry run)")
    ap.add_argument(
        "--blocks", type=int, help="throughput: blocks per transfer (2048 on GPU, 32 in a dry run)"
    )
    ap.add_argument("--reps", type=int, help="throughput: timed transfers per path (best is reported)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="no new throughput step after this many s")
    ap.add_argument("--timeout-s", type=float, default=540.0, help="give up (FAIL, JSON written) after this")
    ap.add_argument("--no-throughput", action="store_true", help="correctness steps only")
    ap.add_argument(
        "--require-cuda", action="store_true", help="exit 2 instead of a CPU dry run without CUDA"
    )
    a = ap.parse_args(argv)
    dry_run = a.dry_run or not torch.cuda.is_available()
    return Options(
        dry_run=dry_run,
        json=a.json,
        wheels=a.wheels,
        install=not a.no_install,
        layers=a.layers,
        blocks=a.blocks,
        reps=a.reps or (1 if dry_run else 2),
        budget_s=a.budget_s,
        timeout_s=a.timeout_s,
        throughput=not a.no_throughput,
        require_cuda=a.require_cuda,
    )


def devices_for(opts: Options) -> list[torch.device]:
    if opts.dry_run:
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]


def describe(opts: Options, devices: list[torch.device]) -> dict[str, Any]:
    names = [torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"]
    return {
        "dry_run": opts.dry_run,
        "devices": [str(d) for d in devices],
        "device_names": names,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "wheels": str(opts.wheels),
    }


def run_correctness(report: Report, devices: list[torch.device], nixl: bool) -> None:
    for device in devices:
        for layout in LAYOUTS:
            report.run(f"store/{device}/{layout}", check_store, device, layout)
    pairs = [(devices[0], devices[0]), *((devices[0], d) for d in devices[1:])]
    for transport in ("tcp", "nixl"):
        for src, dst in pairs:
            name = f"engine-{transport}/{src}" + (f"->{dst}" if dst != src else "")
            if transport == "nixl" and not nixl:
                report.skip(name, "nixl not available")
            else:
                report.run(name, check_engines, src, dst, transport)
    report.run(f"engine-tcp-late/{devices[0]}", check_late_decode, devices[0])


def run_throughput(report: Report, opts: Options, device: torch.device) -> None:
    """Per block size: allocate both caches once, then the baselines, stage() and each engine path on them."""
    layers = opts.layers or (4 if opts.dry_run else 80)
    blocks = opts.blocks or (32 if opts.dry_run else 2048)
    for kib in (64, 8):
        shape = fit_blocks(shape_for(kib, layers, blocks), device)
        tag = f"throughput/{kib}KiB"
        caches: list[Cache] = []
        if not report.within_budget(f"{tag}/setup") or not report.run(
            f"{tag}/setup", allocate, shape, device, blocks, caches
        ):
            continue
        src, dst = caches
        report.run(f"{tag}/baselines", baselines, report, shape, src, dst, device)
        if report.within_budget(f"{tag}/stage"):
            report.run(f"{tag}/stage", stage_benches, report, shape, src, device)
        for transport in ("tcp", "nixl"):
            name, checked = f"{tag}/{transport}", f"engine-{transport}/{device}"
            if report.status(checked) != "PASS":
                report.skip(name, f"{checked} did not pass")
            elif report.within_budget(name):
                report.run(name, engine_row, report, shape, src, dst, transport, opts.reps)
        caches.clear()
        del src, dst
        free_memory()


def allocate(shape: KVShape, device: torch.device, asked: int, out: list[Cache]) -> str:
    out[:] = [make_cache(shape, DEFAULT_LAYOUT, device, 11), make_cache(shape, DEFAULT_LAYOUT, device, None)]
    scaled = f" (scaled down from {asked} to fit memory)" if shape.blocks != asked else ""
    return (
        f"{DEFAULT_LAYOUT} bf16, {shape.layers} layers x {shape.blocks} blocks{scaled}, "
        f"{shape.nbytes / 2**30:.2f} GiB per cache"
    )


def baselines(report: Report, shape: KVShape, src: Cache, dst: Cache, device: torch.device) -> str:
    d2d = time_d2d(src, dst, device)
    d2h, h2d = time_bounce(src, dst, device)
    expect(torch.equal(src.raw, dst.raw), "the D2H+H2D round trip changed the bytes")
    dst.raw.zero_()
    sync(device)
    args = (shape.block_bytes, shape.layers, shape.blocks)
    rows = [
        Row("D2D copy_", *args, d2d),
        Row("D2H pinned", *args, d2h),
        Row("H2D pinned", *args, h2d),
        Row("D2H+H2D pinned", *args, d2h + h2d),
    ]
    report.rows.extend(rows)
    return ", ".join(f"{r.path} {r.gbps:.1f} GB/s" for r in rows)


def stage_benches(report: Report, shape: KVShape, src: Cache, device: torch.device) -> str:
    store = make_store(src.views, direct=False)
    runs = [bench_stage(store, shape, device, run) for run in (1, 2)]
    report.stage.extend({"block_bytes": shape.block_bytes, **asdict(r)} for r in runs)
    report.rows.extend(
        Row(f"stage() run {r.run}", shape.block_bytes, shape.layers, shape.blocks, r.seconds, r.cpu_s)
        for r in runs
    )
    return "; ".join(
        f"run {r.run}: {r.wall_ms_mean:.2f} ms/layer (max {r.wall_ms_max:.1f}), "
        f"{r.cpu_us_per_layer_block:.2f} us CPU/layer-block, gathers {r.gather_gbps:.1f} GB/s"
        for r in runs
    )


def engine_row(report: Report, shape: KVShape, src: Cache, dst: Cache, transport: str, reps: int) -> str:
    row = time_engine(src, dst, shape, transport, reps)
    report.rows.append(row)
    runs = ", ".join(f"{s:.3f}" for s in row.runs)
    pinned = (
        f", pinned staging peak {row.pinned_peak / 2**20:.0f} of {row.nbytes / 2**20:.0f} MiB"
        if row.pinned_peak is not None
        else ""
    )
    return f"{row.gbps:.2f} GB/s (runs {runs} s), {row.cpu_us_per_block:.2f} us CPU/layer-block{pinned}, bytes equal"


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if opts.require_cuda and opts.dry_run:
        print("gpu-check: FAIL: CUDA is not available to torch and --require-cuda was given", flush=True)
        return 2
    devices = devices_for(opts)
    report = Report(opts.json, describe(opts, devices), opts.budget_s)
    report.arm_watchdog(opts.timeout_s)
    if opts.dry_run:
        print("NOTE: no CUDA (or --dry-run): the same steps run on CPU tensors at small sizes", flush=True)
    print(
        f"gpu-check on {', '.join(map(str, devices))} {report.meta['device_names']}, torch {torch.__version__}"
    )
    deps_ok = report.run("deps", ensure_deps, opts.wheels, opts.install)
    if deps_ok and INSTALLED_ENV not in os.environ and report.steps[-1].detail.startswith("installed"):
        restart_after_install(report.steps[-1].detail)
    nixl = report.run("deps/nixl", ensure_nixl, opts.wheels, opts.install)
    report.meta["nixl"] = nixl
    if deps_ok and report.run("imports", bind_repo_packages, REPO):
        report.meta["device_store"] = sys.modules["vllm_disagg.connectors.device_store"].__file__
        run_correctness(report, devices, nixl)
        if opts.throughput:
            run_throughput(report, opts, devices[0])
        if report.rows:
            print("\n".join(["", *render_table(report.rows), ""]), flush=True)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
