"""Built-in policies and the loader, importable from the proxy package too (they live in :mod:`vllm_disagg.policy`)."""

from __future__ import annotations

from vllm_disagg.policy.builtin import BUILTIN_POLICIES, AlwaysTransfer, LeastLoaded, RoundRobinPairs, load
from vllm_disagg.policy.loader import ENTRY_POINT_GROUP, PolicyLoadError, load_policy

__all__ = [
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "AlwaysTransfer",
    "LeastLoaded",
    "PolicyLoadError",
    "RoundRobinPairs",
    "load",
    "load_policy",
]
