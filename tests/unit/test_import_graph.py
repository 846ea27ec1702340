"""The allowed dependencies between the parts, checked on the source with ``ast`` (function-level imports too).

* The core (``vllm_disagg/`` but its ``tools/`` and the CLI) imports neither the proxy (``vllm_disagg.router``)
  nor the connector (``vllm_disagg.connectors``), nor vLLM or torch.
* The proxy (``router/``) runs without vLLM or torch and does not import the connector.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import ROOT


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _offending(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for f in files:
        for mod in sorted(imported_modules(f)):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    return bad


def core_files() -> list[Path]:
    pkg = ROOT / "vllm_disagg"
    return [
        p for p in pkg.rglob("*.py") if "tools" not in p.relative_to(pkg).parts[:1] and p.name != "cli.py"
    ]


def test_the_core_imports_neither_proxy_nor_connector_nor_vllm() -> None:
    files = core_files()
    assert len(files) > 20
    assert _offending(files, ("vllm_disagg.router", "vllm_disagg.connectors", "vllm", "torch")) == []


def test_the_proxy_runs_without_vllm_torch_or_the_connector() -> None:
    files = list((ROOT / "router").rglob("*.py"))
    assert _offending(files, ("vllm", "torch", "vllm_disagg.connectors")) == []


@pytest.mark.parametrize("source", ["import vllm_disagg.router.app", "from vllm_disagg.connectors import x"])
def test_the_check_sees_function_level_imports(tmp_path: Path, source: str) -> None:
    f = tmp_path / "m.py"
    f.write_text(f"def f():\n    {source}\n")
    assert imported_modules(f) & {"vllm_disagg.router.app", "vllm_disagg.connectors"}
