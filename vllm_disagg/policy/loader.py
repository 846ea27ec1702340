"""``load_policy``: how ``--policy`` (proxy and simulator alike) turns a name or a path into a policy object."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
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
    """Build the policy ``spec`` names; ``kwargs`` go to its constructor (``load_factory`` then ``build_policy``)."""
    return build_policy(load_factory(spec), spec, kwargs)


def load_factory(spec: str) -> Any:
    """The class (or function) ``spec`` names, imported once: a caller that builds a fresh policy per run (the
    simulator) does not execute the user's module again for each.

    ``spec`` is, in the order tried: a built-in name (``BUILTIN_POLICIES``); ``path/to/file.py:Class``;
    ``package.module:Class`` (a module in the working directory is found even where the console script's
    ``sys.path`` lacks it); or the name of an entry point in the group ``vllm_disagg.policies``, which lets an
    installed package offer policies by name. Anything else raises ``PolicyLoadError`` saying what would work.
    """
    spec = spec.strip()
    if not spec:
        raise PolicyLoadError("empty policy spec")
    if spec in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[spec]
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
        if not target or not attr:
            raise PolicyLoadError(f"policy {spec!r}: expected module:Class or path/to/file.py:Class")
        module = _load_file(target) if _looks_like_path(target) else _import(target)
        factory = getattr(module, attr, None)
        if factory is None:
            policies = sorted(
                n
                for n, v in vars(module).items()
                if not n.startswith("_")
                and isinstance(v, type)
                and callable(getattr(v, "plan", None))
                and not getattr(v, "_is_protocol", False)
            )
            raise PolicyLoadError(
                f"{target} has no {attr!r}; policy classes in it: {', '.join(policies) or 'none'}"
            )
        return factory
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            try:
                return ep.load()
            except Exception as exc:
                raise PolicyLoadError(f"entry point {spec!r} ({ep.value}) failed to load: {exc}") from exc
    installed = sorted(ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))
    raise PolicyLoadError(
        f"unknown policy {spec!r}; built-ins: {', '.join(BUILTIN_POLICIES)}"
        + (f"; installed ({ENTRY_POINT_GROUP}): {', '.join(installed)}" if installed else "")
        + "; or give module:Class or path/to/file.py:Class"
    )


def parse_policy_args(text: str) -> dict[str, Any]:
    """``--policy-args``: the policy constructor's keyword arguments as one JSON object ("" for none)."""
    if not text.strip():
        return {}
    try:
        args = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyLoadError(f"--policy-args is not JSON ({exc}): {text!r}") from None
    if not isinstance(args, dict):
        raise PolicyLoadError(
            f'--policy-args must be a JSON object such as {{"threshold_tokens": 512}}: {text!r}'
        )
    return args


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import(name: str) -> Any:
    top = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing: ImportError = exc
        here = os.getcwd()
        if exc.name == top and here not in sys.path and "" not in sys.path:
            # A console script's sys.path starts at its own bin directory, not the working directory that
            # ``python -m`` would add: a module next to the user is looked for there too.
            sys.path.append(here)
            try:
                return importlib.import_module(name)
            except ImportError as again:
                sys.path.remove(here)
                missing = again
        if getattr(missing, "name", None) == top:
            raise PolicyLoadError(
                f"cannot import policy module {name!r}: no {top!r} on sys.path or in {here}; put its directory on "
                "PYTHONPATH, or give the file: path/to/module.py:Class"
            ) from missing
        raise PolicyLoadError(f"cannot import policy module {name!r}: {missing}") from missing
    except ImportError as exc:
        raise PolicyLoadError(f"cannot import policy module {name!r}: {exc}") from exc


# Policy files executed in this process, by resolved path: the proxy checks its policy before it builds it, and a
# file's module-level setup must run once, as an import's does.
_LOADED_FILES: dict[Path, Any] = {}


def _load_file(target: str) -> Any:
    """Execute a policy file as a module of its own (registered, so dataclasses and pickling work in it), once per
    process."""
    path = Path(target)
    if not path.is_file():
        raise PolicyLoadError(f"policy file not found: {target}")
    loaded = _LOADED_FILES.get(path.resolve())
    if loaded is not None:
        return loaded
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
    _LOADED_FILES[path.resolve()] = module
    return module


def build_policy(factory: Any, spec: str, kwargs: dict[str, Any]) -> Policy:
    """A policy object from what ``load_factory`` returned. Everything a user's constructor does wrong fails here,
    as a ``PolicyLoadError`` naming the spec, before any request is routed."""
    if not callable(factory):
        raise PolicyLoadError(f"{spec}: {factory!r} is not a class or factory")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise PolicyLoadError(f"{spec}: does not take the arguments {sorted(kwargs)}: {exc}") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        policy = cast(Callable[..., Any], factory)(**kwargs)
    except Exception as exc:
        raise PolicyLoadError(f"{spec}: constructing it raised {exc!r}") from exc
    plan = getattr(policy, "plan", None)
    if not callable(plan):  # checked after construction: a factory may build it
        raise PolicyLoadError(f"{spec}: {type(policy).__name__} has no plan(request, cluster) method")
    for name in ("plan", "observe"):
        if inspect.iscoroutinefunction(getattr(policy, name, None)):
            raise PolicyLoadError(
                f"{spec}: {type(policy).__name__}.{name} is async; it must be a plain method (the proxy calls it on "
                "its event loop for every request and cannot wait for it)"
            )
    return cast(Policy, policy)


def policy_builder(spec: str, args: dict[str, Any], cost_config: Any = None) -> Callable[[], Policy]:
    """What builds the policy ``spec`` names with constructor arguments ``args``, checked by building one now (a
    spec that does not load fails before anything runs); the module is imported once however often it builds.

    A ``CostModel``, or a user's subclass of it that takes ``config``, is given ``cost_config`` (the tool's SLOs and
    link) with ``args`` as overrides of its fields, so subclassing the default policy keeps the command line's
    targets."""
    from vllm_disagg.policy.cost_model import CostModel

    factory = load_factory(spec)
    kwargs = dict(args)
    if (
        cost_config is not None
        and isinstance(factory, type)
        and issubclass(factory, CostModel)
        and "config" in inspect.signature(factory).parameters
        and "config" not in kwargs
    ):
        kwargs["config"] = cost_config
    build_policy(factory, spec, kwargs)
    return lambda: build_policy(factory, spec, kwargs)
