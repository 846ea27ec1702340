"""``load_policy``: how ``--policy`` (proxy and simulator alike) turns a name or a path into a policy object."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from vllm_disagg.policy.api import Policy
from vllm_disagg.policy.builtin import BUILTIN_POLICIES

ENTRY_POINT_GROUP = "vllm_disagg.policies"


class PolicyLoadError(ValueError):
    """A ``--policy`` spec that names nothing loadable (a ValueError, so CLIs report it as bad input)."""


def load_policy(spec: str, **kwargs: Any) -> Policy:
    """Build the policy ``spec`` names; ``kwargs`` go to its constructor.

    ``spec`` is, in the order tried: a built-in name (``BUILTIN_POLICIES``); ``path/to/file.py:Class``;
    ``package.module:Class``; or the name of an entry point in the group ``vllm_disagg.policies``, which lets an
    installed package offer policies by name. Anything else raises ``PolicyLoadError`` saying what would work.
    """
    spec = spec.strip()
    if not spec:
        raise PolicyLoadError("empty policy spec")
    if spec in BUILTIN_POLICIES:
        return _instantiate(BUILTIN_POLICIES[spec], spec, kwargs)
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
        if not target or not attr:
            raise PolicyLoadError(f"policy {spec!r}: expected module:Class or path/to/file.py:Class")
        module = _load_file(target) if _looks_like_path(target) else _import(target)
        factory = getattr(module, attr, None)
        if factory is None:
            public = sorted(
                n for n in vars(module) if not n.startswith("_") and isinstance(vars(module)[n], type)
            )
            raise PolicyLoadError(
                f"{target} has no {attr!r}; classes it defines: {', '.join(public) or 'none'}"
            )
        return _instantiate(factory, spec, kwargs)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            try:
                factory = ep.load()
            except Exception as exc:
                raise PolicyLoadError(f"entry point {spec!r} ({ep.value}) failed to load: {exc}") from exc
            return _instantiate(factory, spec, kwargs)
    installed = sorted(ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))
    raise PolicyLoadError(
        f"unknown policy {spec!r}; built-ins: {', '.join(BUILTIN_POLICIES)}"
        + (f"; installed ({ENTRY_POINT_GROUP}): {', '.join(installed)}" if installed else "")
        + "; or give module:Class or path/to/file.py:Class"
    )


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise PolicyLoadError(f"cannot import policy module {name!r}: {exc}") from exc


def _load_file(target: str) -> Any:
    """Execute a policy file as a module of its own (registered, so dataclasses and pickling work in it)."""
    path = Path(target)
    if not path.is_file():
        raise PolicyLoadError(f"policy file not found: {target}")
    name = f"vllm_disagg_user_policy_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PolicyLoadError(f"cannot load policy file {target}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise PolicyLoadError(f"policy file {target} failed to load: {exc}") from exc
    return module


def _instantiate(factory: Any, spec: str, kwargs: dict[str, Any]) -> Policy:
    if not callable(factory):
        raise PolicyLoadError(f"{spec}: {factory!r} is not a class or factory")
    try:
        policy = cast(Callable[..., Any], factory)(**kwargs)
    except TypeError as exc:
        raise PolicyLoadError(f"{spec}: cannot construct with {sorted(kwargs)}: {exc}") from exc
    if not callable(getattr(policy, "plan", None)):  # checked after construction: a factory may build it
        raise PolicyLoadError(f"{spec}: {type(policy).__name__} has no plan(request, cluster) method")
    return cast(Policy, policy)
