"""scripts/gpu_check.py works the first time it meets a GPU: its CPU dry run passes end to end, without the
editable install, and its vLLM-free KV cache views are exactly vLLM 0.32's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


gpu_check = load_script()


def test_dry_run_passes_every_step_without_the_editable_install(tmp_path: Path) -> None:
    """``python -S`` skips site-packages' .pth files, so the editable install's finder is absent, as on the lent
    GPU machine: the script binds connectors/ into vllm_disagg itself."""
    python = REPO / ".venv" / "bin" / "python"
    results = tmp_path / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    proc = subprocess.run(
        [
            str(python if python.exists() else sys.executable),
            "-S",
            str(SCRIPT),
            "--dry-run",
            "--json",
            str(results),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu-check: PASS")
    doc: dict[str, Any] = json.loads(results.read_text())
    assert doc["ok"] and doc["dry_run"]
    assert Path(doc["device_store"]) == REPO / "connectors" / "device_store.py"
    not_passed = [
        s
        for s in doc["steps"]
        if s["status"] != "PASS" and not (s["status"] == "SKIP" and "nixl" in s["name"])
    ]
    assert not not_passed, not_passed
    names = {s["name"] for s in doc["steps"]}
    assert {f"store/cpu/{layout}" for layout in gpu_check.LAYOUTS} <= names
    assert {"engine-tcp/cpu", "engine-tcp-late/cpu", "throughput/64KiB/tcp", "throughput/8KiB/tcp"} <= names
    paths = {(r["path"], r["block_bytes"]) for r in doc["throughput"]}
    assert {("D2D copy_", 65536), ("D2H+H2D pinned", 8192), ("engine tcp", 65536)} <= paths
    assert all(r["gbps"] > 0 for r in doc["throughput"])
    assert {s["run"] for s in doc["stage"]} == {1, 2}


SHAPES = [
    dict(layers=3, blocks=10, heads=2, tokens=16, head_size=32, dtype=torch.bfloat16),
    dict(layers=2, blocks=7, heads=1, tokens=4, head_size=8, dtype=torch.float32),
    dict(layers=4, blocks=5, heads=4, tokens=8, head_size=64, dtype=torch.float16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["bf16", "fp32-1head", "fp16"])
def test_views_equal_vllms_create_kv_cache_views_for_every_layout(shape: dict[str, Any]) -> None:
    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    ours = gpu_check.KVShape(**shape)
    spec = kv.FullAttentionSpec(
        block_size=ours.tokens, num_kv_heads=ours.heads, head_size=ours.head_size, dtype=ours.dtype
    )
    assert spec.page_size_bytes == ours.block_bytes
    assert {lay.name for lay in KVCacheLayout} == set(gpu_check.LAYOUTS)
    for layout in KVCacheLayout:
        assert gpu_check.layout_order(layout.name) == layout.value
        assert gpu_check.block_compact(layout.name) == layout.is_block_compact
        layer_stride, block_stride, *_ = kv.compute_layout_strides(spec, ours.blocks, ours.layers, layout)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(ours.layers)]
        tensor = kv.KVCacheTensor(
            size=ours.nbytes, layers=names, layer_stride=layer_stride, block_stride=block_stride, offset=64
        )
        backing = torch.zeros(ours.nbytes + 192, dtype=torch.int8)
        raw = backing[32:]  # a buffer that starts inside its storage, as vLLM's may
        theirs = kv.create_kv_cache_views(raw, spec, ours.blocks, layout, tensor)
        mine = gpu_check.kv_cache_views(raw, ours, layout.name, offset=64)
        assert len(mine) == len(theirs) == ours.layers
        for m, t in zip(mine, theirs, strict=True):
            got = (m.shape, m.stride(), m.storage_offset(), m.dtype, m.data_ptr())
            assert got == (t.shape, t.stride(), t.storage_offset(), t.dtype, t.data_ptr()), layout.name


def test_views_tile_the_buffer_and_the_store_moves_blocks_for_every_layout() -> None:
    pytest.importorskip("vllm_disagg.connectors.device_store")
    for layout in gpu_check.LAYOUTS:
        gpu_check.check_tiling(gpu_check.SMALL, layout, torch.device("cpu"))
        assert "NIXL" in gpu_check.check_store(torch.device("cpu"), layout)


def test_a_failing_step_is_reported_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = gpu_check.Report(tmp_path / "r.json", {"dry_run": True, "devices": ["cpu"]})

    def boom() -> str:
        raise AssertionError("bytes differ")

    def skipped() -> str:
        raise gpu_check.Skipped("no nixl")

    assert not report.run("a", boom)
    assert not report.run("b", skipped)
    assert report.run("c", lambda: "fine")
    assert report.finish() == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("FAIL") and "AssertionError: bytes differ" in out[0]
    assert out[-1].startswith("gpu-check: FAIL (1 passed, 1 failed, 1 skipped)")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in doc["steps"]] == ["FAIL", "SKIP", "PASS"] and not doc["ok"]


def test_missing_packages_without_wheels_fail_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "REQUIRED", {"no_such_module_for_gpu_check": "no-such-wheel"})
    with pytest.raises(RuntimeError, match="--wheels DIR or VLLM_DISAGG_WHEELS"):
        gpu_check.ensure_deps(tmp_path / "absent", install=True)
    calls: list[list[str]] = []

    def pip_install(wheels: Path, packages: list[str]) -> tuple[bool, str]:
        calls.append(packages)
        return False, "no match"

    monkeypatch.setattr(gpu_check, "pip_install", pip_install)
    with pytest.raises(RuntimeError, match="could not install no-such-wheel"):
        gpu_check.ensure_deps(tmp_path, install=True)
    assert calls == [["no-such-wheel"]]
