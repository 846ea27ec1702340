"""The CUDA staging logic of DeviceBlockStore, with a fake device (numpy "tensors", events that complete on wait).

What must hold on a GPU: a block is read only after its device-to-host copy, which itself runs only after the
compute kernels that wrote the layer; a received block counts only after its host-to-device copy; K/V-split layouts
move both halves; NIXL on device memory waits for the kernels before the write is posted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from vllm_disagg.connectors.device_store import DeviceBlockStore, detect_layout
from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.transport.engine import EngineSettings, TransferEngine


class FakeEvent:
    def __init__(self, action: Any = None) -> None:
        self.action, self.done = action, action is None

    def complete(self) -> None:
        if not self.done:
            self.done = True
            if self.action is not None:
                self.action()


class FakeOps:
    """Copies run only when their event is waited on (as if the side stream were slow): ordering bugs show up."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def compute_event(self) -> FakeEvent:
        self.log.append("compute_event")
        return FakeEvent()

    def d2h(self, dst: np.ndarray, segments: list[Any], after: FakeEvent) -> FakeEvent:
        def run() -> None:
            assert after.done or after.action is None
            off = 0
            for seg in segments:
                raw = np.ascontiguousarray(seg).view(np.uint8).reshape(-1)
                dst[off : off + raw.size] = raw
                off += raw.size
            self.log.append("d2h")

        return FakeEvent(run)

    def h2d(self, segments: list[Any], src: np.ndarray) -> FakeEvent:
        def run() -> None:
            off = 0
            for seg in segments:
                view = seg.reshape(-1).view(np.uint8)
                view[:] = src[off : off + view.size]
                off += view.size
            self.log.append("h2d")

        return FakeEvent(run)

    def wait(self, event: FakeEvent) -> None:
        event.complete()


def _layers(split: bool, seed: int | None, n_layers: int = 2, blocks: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (2, blocks, 4, 8) if split else (blocks, 2, 4, 8)
    return [
        rng.standard_normal(shape).astype(np.float32) if seed is not None else np.zeros(shape, np.float32)
        for _ in range(n_layers)
    ]


def _store(split: bool, seed: int | None) -> DeviceBlockStore:
    layers = _layers(split, seed)
    seg = layers[0][0, 0].nbytes if split else layers[0][0].nbytes
    return DeviceBlockStore(layers, FakeOps(), kv_split=split, segment_bytes=seg)


@pytest.mark.parametrize("split", [False, True], ids=["block-major", "kv-split"])
def test_staged_read_is_the_block_bytes_after_the_copy(split: bool) -> None:
    st = _store(split, seed=1)
    st.stage(0, [3])
    ops = st.ops
    assert (
        isinstance(ops, FakeOps) and "d2h" not in ops.log
    )  # queued, not run: the forward pass is not blocked
    got = bytes(st.read(0, 3))
    assert "d2h" in ops.log
    t = st.layers[0]
    want = (t[0, 3].tobytes() + t[1, 3].tobytes()) if split else t[3].tobytes()
    assert got == want and len(got) == st.block_bytes


def test_reading_an_unstaged_block_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="before it was staged"):
        _store(False, 1).read(0, 2)


@pytest.mark.parametrize("split", [False, True], ids=["block-major", "kv-split"])
def test_received_blocks_land_only_after_sync(split: bool) -> None:
    src, dst = _store(split, seed=2), _store(split, seed=None)
    src.stage(1, [4])
    dst.write(1, 0, src.read(1, 4))
    assert not dst.layers[1].any()  # the host-to-device copy has not run yet
    dst.sync()
    if split:
        assert np.array_equal(dst.layers[1][:, 0], src.layers[1][:, 4])
    else:
        assert np.array_equal(dst.layers[1][0], src.layers[1][4])


def test_direct_mode_orders_nixl_after_the_kernels() -> None:
    st = _store(False, seed=3)
    st.direct = True
    waited: list[Any] = []
    ops = st.ops
    assert isinstance(ops, FakeOps)
    ops.wait = lambda ev: waited.append(ev)  # type: ignore[method-assign]
    st.stage(0, [1, 2])
    assert not st._slots  # no host copy in direct mode
    st.wait_staged(0, [1, 2])
    assert len(waited) == 2
    assert st.nixl_mem_type == "VRAM" and st.layer_bytes == st.num_blocks * st.block_bytes


def test_layout_detection() -> None:
    assert detect_layout((2, 100, 16, 8, 64), 100) is True
    assert detect_layout((100, 2, 8, 16, 64), 100) is False
    with pytest.raises(ValueError, match="unsupported"):
        detect_layout((7, 9), 100)


def test_engines_move_device_blocks_end_to_end_over_tcp() -> None:
    """Two transfer engines over loopback, each over a fake-device store: the staging hooks are on the real path."""
    import time

    src, dst = _store(True, seed=5), _store(True, seed=None)
    geo = KVGeometry(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="float32",
                     kv_layout="cuda:kvsplit", block_bytes=src.block_bytes)  # fmt: skip
    opts = dict(bind_host="127.0.0.1", transport="tcp", load_timeout_s=10)
    p = TransferEngine(src, geo, "P", EngineSettings(**opts))  # type: ignore[arg-type]
    d = TransferEngine(dst, geo, "D", EngineSettings(**opts))  # type: ignore[arg-type]
    try:
        p.begin_send("t", "rp", prompt_len=8)
        d.start_load("rd", "t", ("127.0.0.1", p.port), [2, 5], first_block=0, prompt_len=8)
        time.sleep(0.2)
        for layer in range(2):
            src.stage(layer, [0, 1])  # what save_kv_layer does on CUDA before offering
            p.offer_blocks("t", layer, [(0, 0), (1, 1)])
        deadline = time.monotonic() + 10
        done = set()
        while "rd" not in done and time.monotonic() < deadline:
            done |= d.poll_results().finished_recving
            time.sleep(0.01)
        assert "rd" in done
        for layer in range(2):
            assert np.array_equal(dst.layers[layer][:, 2], src.layers[layer][:, 0])
            assert np.array_equal(dst.layers[layer][:, 5], src.layers[layer][:, 1])
    finally:
        p.close()
        d.close()
