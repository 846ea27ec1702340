"""The compiled request path (mypyc, ``scripts/build_native.py``): the suite runs what users run, a stale build never
shadows its sources, the sources keep to what mypyc compiles correctly, and the Python fallback still works."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_disagg import native

ROOT = Path(__file__).resolve().parents[2]


def test_the_suite_runs_the_compiled_request_path_when_make_test_asks_for_it() -> None:
    """``make test`` sets VLLM_DISAGG_REQUIRE_NATIVE: a build that failed (setup.sh only warns) or went stale must
    fail the suite, or the tests would pass on the Python source while users run the compiled modules."""
    if os.environ.get("VLLM_DISAGG_REQUIRE_NATIVE", "") in ("", "0"):
        pytest.skip("VLLM_DISAGG_REQUIRE_NATIVE not set (make test sets it)")
    assert native.compiled(), f"request path: {native.describe()}; run `make native` and read its output"
    import vllm_disagg.router.exchange as exchange

    assert not exchange.__file__.endswith(".py"), exchange.__file__


def _manifest(tmp_path: Path, modules: dict[str, str]) -> Path:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"python": native.sysconfig.get_config_var("SOABI"), "modules": modules}))
    return path


def test_a_build_is_stale_when_any_listed_source_differs_from_what_was_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = {m: native.source_digest(m) for m in native.NATIVE_MODULES}
    monkeypatch.setattr(native, "MANIFEST", _manifest(tmp_path, current))
    assert native.stale_reason() is None
    edited = dict(current, **{native.NATIVE_MODULES[-1]: "0" * 64})
    monkeypatch.setattr(native, "MANIFEST", _manifest(tmp_path, edited))
    assert (
        native.stale_reason()
        == f"{native.source_path(native.NATIVE_MODULES[-1]).name} changed since the build"
    )
    monkeypatch.setattr(native, "MANIFEST", tmp_path / "absent.json")
    assert native.stale_reason() == "no build manifest"


def test_the_source_finder_loads_every_listed_module_from_its_py() -> None:
    finder = native._FromSource()
    for module in native.NATIVE_MODULES:
        spec = finder.find_spec(module, None)
        assert spec is not None and spec.origin == str(native.source_path(module)), module
        assert Path(spec.origin).is_file()
    assert finder.find_spec("vllm_disagg.router.config", None) is None  # not compiled: the usual finders


def test_forcing_the_source_loads_the_request_path_from_py_files() -> None:
    code = (
        "import vllm_disagg.router.exchange as e, vllm_disagg.policy.cost_model as c, vllm_disagg.native as n;"
        "print(e.__file__, c.__file__, n.describe())"
    )
    env = dict(os.environ, VLLM_DISAGG_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    exchange_file, cost_file, *how = out.stdout.split()
    assert exchange_file.endswith("exchange.py") and cost_file.endswith("cost_model.py")
    assert " ".join(how).startswith("Python source (VLLM_DISAGG_PURE_PYTHON is set)")


def _functions(module: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(native.source_path(module).read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_compiled_function_binds_one_exception_name_to_two_types() -> None:
    """mypyc gives a local one type: ``except A as exc`` then ``except B as exc`` in one function compiles, and
    raises TypeError when B is caught (found by the exchange's fallback tests). Each handler gets its own name."""
    clashes = []
    for module in native.NATIVE_MODULES:
        for fn in _functions(module):
            bound: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    bound.setdefault(node.name, set()).add(ast.unparse(node.type))
            clashes += [
                f"{module}.{fn.name}: {name} as {sorted(t)}" for name, t in bound.items() if len(t) > 1
            ]
    assert not clashes, clashes


def test_no_compiled_module_has_an_async_generator() -> None:
    """mypyc has none: one would fail the build, and the proxy would fall back to source."""
    found = []
    for module in native.NATIVE_MODULES:
        for fn in _functions(module):
            if isinstance(fn, ast.AsyncFunctionDef) and any(
                isinstance(n, ast.Yield | ast.YieldFrom) for n in ast.walk(fn)
            ):
                found.append(f"{module}.{fn.name}")
    assert not found, found


@pytest.mark.skipif(not native.compiled(), reason="the request path is not compiled here")
def test_the_exchange_and_policy_tests_pass_from_source_too() -> None:
    """The suite runs compiled; the fallback (no C compiler, a stale build) runs the same code from source."""
    env = dict(os.environ, VLLM_DISAGG_PURE_PYTHON="1")
    env.pop("VLLM_DISAGG_REQUIRE_NATIVE", None)
    tests = [
        "tests/unit/test_exchange.py",
        "tests/unit/test_adaptive_policy.py",
        "tests/unit/test_policies.py",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:]


def test_a_wheel_holds_every_package_of_the_installed_layout() -> None:
    """pyproject's package list is explicit (package-dir maps router/ and connectors/ under vllm_disagg): a package
    left out installs fine in editable mode and is missing from a wheel, as the policy package once was from the
    Docker image."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    found = set()
    for name, root in dirs.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join([name, *rel.parts]))
    assert found <= set(setuptools["packages"]), sorted(found - set(setuptools["packages"]))
    data = setuptools["package-data"]
    for module in native.NATIVE_MODULES:  # the compiled modules' packages carry their extensions into a wheel
        assert "*.so" in data[module.rsplit(".", 1)[0]], module
