"""Transfer engines in the test process: a small KV geometry, numpy-backed block stores, engines on loopback,
and waiting for their results."""

from __future__ import annotations

import time

import numpy as np

from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.transport.block_store import HostBlockStore
from vllm_disagg.transport.engine import EngineSettings, TransferEngine, TransferResults

LAYERS, BLOCKS, BLOCK_BYTES = 3, 16, 256


def geometry(**kw: object) -> KVGeometry:
    base: dict[str, object] = dict(
        model="tiny",
        num_layers=LAYERS,
        num_kv_heads=2,
        head_size=32,
        block_size=4,
        dtype="float32",
        kv_layout="cpu",
        block_bytes=BLOCK_BYTES,
    )
    base.update(kw)
    return KVGeometry(**base)  # type: ignore[arg-type]


def store(seed: int | None) -> HostBlockStore:
    rng = np.random.default_rng(seed)
    layers = [
        (
            rng.integers(0, 255, size=(BLOCKS, BLOCK_BYTES), dtype=np.uint8)
            if seed is not None
            else np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        )
        for _ in range(LAYERS)
    ]
    return HostBlockStore(layers)


def make(name: str, seed: int | None, geo: KVGeometry | None = None, **settings: object) -> TransferEngine:
    opts: dict[str, object] = dict(
        bind_host="127.0.0.1", load_timeout_s=10.0, lease_s=10.0, connect_timeout_s=3.0
    )
    opts.update(settings)
    return TransferEngine(store(seed), geo or geometry(), name, EngineSettings(**opts))  # type: ignore[arg-type]


def wait_results(engine: TransferEngine, pred, timeout: float = 10.0) -> TransferResults:  # type: ignore[no-untyped-def]
    acc = TransferResults()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = engine.poll_results()
        acc.finished_sending |= r.finished_sending
        acc.finished_recving |= r.finished_recving
        acc.failed_recving |= r.failed_recving
        if pred(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"timed out; got {acc}")
