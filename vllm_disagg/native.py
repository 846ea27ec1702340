"""Which modules run compiled (mypyc, ``scripts/build_native.py``), and the guard that keeps a stale build unused.

A compiled module sits beside its source and an import prefers it, so an edit to the source would be silently
ignored. ``activate`` (run by ``vllm_disagg/__init__``) compares each listed source's hash with the build's manifest
and, if any differs, the manifest is missing, the interpreter's ABI differs, or ``VLLM_DISAGG_PURE_PYTHON=1`` is
set, routes every listed module to its ``.py``: all or none, because the compiled modules of one build call each
other directly. Standard library only: this runs before anything else of the package is imported.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

# The proxy's request path and the default policy: what runs once or more per request.
NATIVE_MODULES: tuple[str, ...] = (
    "vllm_disagg.policy.decayed",
    "vllm_disagg.policy.regime",
    "vllm_disagg.policy.cost_model",
    "vllm_disagg.router.http_server",
    "vllm_disagg.router.upstream",
    "vllm_disagg.router.exchange",
    "vllm_disagg.router.legs",
    "vllm_disagg.router.intake",
    "vllm_disagg.router.instances",
    "vllm_disagg.router.metrics",
    "vllm_disagg.router.app",
    "vllm_disagg.router.token_cache",
    "vllm_disagg.router.prefix_index",
    "vllm_disagg.router.kv_events",
    "vllm_disagg.router.ledger",
    "vllm_disagg.router.admission",
    "vllm_disagg.router.interrupts",
    "vllm_disagg.router.shared_load",
)
GROUP = (
    "vllm_disagg.native_lib"  # the extension holding the compiled code; each module's own is a shim into it
)
PACKAGE = Path(__file__).resolve().parent
MANIFEST = PACKAGE / "_native_manifest.json"
PURE_ENV = "VLLM_DISAGG_PURE_PYTHON"


def ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def extension_path(module: str) -> Path:
    """Where a build puts a listed module's compiled extension: beside its source."""
    return source_path(module).with_name(module.rsplit(".", 1)[-1] + ext_suffix())


def source_path(module: str) -> Path:
    """The ``.py`` of a listed module, in the installed layout or the repo's (router/ and connectors/ at the top)."""
    parts = module.split(".")[1:]
    installed = PACKAGE.joinpath(*parts)
    if parts and parts[0] in ("router", "connectors") and not (PACKAGE / parts[0]).is_dir():
        installed = PACKAGE.parent.joinpath(*parts)
    return installed.with_suffix(".py")


def source_digest(module: str) -> str:
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


def stale_reason() -> str | None:
    """Why the compiled modules must not be used (None: they are current)."""
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return "no build manifest"
    if manifest.get("python") != sysconfig.get_config_var("SOABI"):
        return "built for another Python"
    built = manifest.get("modules", {})
    for module in NATIVE_MODULES:
        try:
            if built.get(module) != source_digest(module):
                return f"{source_path(module).name} changed since the build"
        except OSError:
            return f"{module} has no source"
    return None


def stale() -> bool:
    return stale_reason() is not None


class _FromSource(importlib.abc.MetaPathFinder):
    """Loads the listed modules from their ``.py`` even where a compiled one sits beside it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in NATIVE_MODULES:
            return None
        src = source_path(fullname)
        return importlib.util.spec_from_file_location(
            fullname, src, loader=importlib.machinery.SourceFileLoader(fullname, str(src))
        )


_state: dict[str, str | None] = {}


def activate() -> None:
    """Decide once per process whether the compiled modules are used; see the module docstring."""
    if "why_source" in _state:
        return
    why: str | None
    if forced_source():
        why = f"{PURE_ENV} is set"
    else:
        built = extension_path(NATIVE_MODULES[0]).exists()
        why = stale_reason() if built else "not built (make native)"
    _state["why_source"] = why
    if why is not None and not any(isinstance(f, _FromSource) for f in sys.meta_path):
        sys.meta_path.insert(0, _FromSource())


def describe() -> str:
    """One phrase for logs: how the request path runs in this process."""
    activate()
    why = _state["why_source"]
    return "compiled (mypyc)" if why is None else f"Python source ({why})"


def forced_source() -> bool:
    """Whether the user asked for the Python source (``VLLM_DISAGG_PURE_PYTHON``)."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def compiled() -> bool:
    activate()
    return _state["why_source"] is None
