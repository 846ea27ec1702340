"""Built-in routing policies, and ``load_policy``: how ``--policy`` turns a name or a path into a policy object.

The simple built-ins are baselines to compare the cost model against: they always transfer when a prefill/decode
pair is usable. When none is, they fall back to serving on a decode-capable instance and say so in
``Plan.reason`` ("no_prefill" or "no_pair"), never silently; with no decode-capable instance they raise ``NoRoute``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from vllm_disagg.router.cost_model import CostModel, local_plan, no_pair_reason, transfer_pairs
from vllm_disagg.router.policy import ClusterView, InstanceView, NoRoute, Plan, Policy, RequestView

ENTRY_POINT_GROUP = "vllm_disagg.policies"


class PolicyLoadError(ValueError):
    """A ``--policy`` spec that names nothing loadable (a ValueError, so CLIs report it as bad input)."""


def load(inst: InstanceView) -> int:
    """Requests on an instance, whichever queue they are in."""
    return inst.in_flight + inst.waiting + inst.running


def _least_loaded(insts: Sequence[InstanceView]) -> list[InstanceView]:
    """Least loaded first; ties by id so the choice never depends on list order."""
    return sorted(insts, key=lambda i: (load(i), i.id))


def _fallback(cluster: ClusterView) -> Plan:
    """No usable pair: serve on the least-loaded decode-capable instance, saying why, or raise ``NoRoute``."""
    live = _least_loaded(cluster.decode)
    if not live:
        raise NoRoute("no healthy instance can decode")
    return local_plan(live[0], no_pair_reason(cluster))


def _transfer(prefills: Sequence[InstanceView], decode: InstanceView, reason: str) -> Plan:
    """Transfer from the least-loaded of ``prefills`` to ``decode``; the runner-up is the backup prefill."""
    ranked = _least_loaded(prefills)
    backup = ranked[1].id if len(ranked) > 1 else None
    return Plan.transfer(ranked[0].id, decode.id, reason=reason, backup_prefill=backup)


def _prefills_for(cluster: ClusterView, decode: InstanceView) -> list[InstanceView]:
    return [p for p, d in transfer_pairs(cluster) if d.id == decode.id]


class RoundRobinPairs:
    """Cycle over the usable (prefill, decode) pairs in id order; always transfer (the vLLM toy proxy's behaviour)."""

    def __init__(self) -> None:
        self._next = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        pairs = transfer_pairs(cluster)
        if not pairs:
            return _fallback(cluster)
        p, d = pairs[self._next % len(pairs)]
        self._next += 1
        others = [q for q in _prefills_for(cluster, d) if q.id != p.id]
        backup = _least_loaded(others)[0].id if others else None
        return Plan.transfer(p.id, d.id, reason="round_robin", backup_prefill=backup)


class LeastLoaded:
    """Transfer from the least-loaded prefill to the least-loaded decode instance (in_flight + waiting + running)."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        pairs = transfer_pairs(cluster)
        if not pairs:
            return _fallback(cluster)
        decodes = _least_loaded(list({d.id: d for _, d in pairs}.values()))
        d = decodes[0]
        return _transfer(_prefills_for(cluster, d), d, "least_loaded")


class AlwaysTransfer:
    """Transfer to the decode instance holding the longest cached prefix (then least loaded), from the least-loaded
    prefill: prefix affinity on the decode side, no cost model."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        pairs = transfer_pairs(cluster)
        if not pairs:
            return _fallback(cluster)
        decodes = {d.id: d for _, d in pairs}.values()
        d = min(decodes, key=lambda i: (-i.cached_tokens, load(i), i.id))
        return _transfer(_prefills_for(cluster, d), d, "always_transfer")


BUILTIN_POLICIES: dict[str, type] = {
    "cost": CostModel,
    "round-robin": RoundRobinPairs,
    "least-loaded": LeastLoaded,
    "always-transfer": AlwaysTransfer,
}


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
