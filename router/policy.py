"""The routing-policy API, importable from the proxy package too (it lives in :mod:`vllm_disagg.policy.api`)."""

from __future__ import annotations

from vllm_disagg.policy.api import (
    ClusterView,
    InstanceView,
    Mode,
    NoRoute,
    Outcome,
    Plan,
    Policy,
    RequestView,
    Role,
)

__all__ = [
    "ClusterView",
    "InstanceView",
    "Mode",
    "NoRoute",
    "Outcome",
    "Plan",
    "Policy",
    "RequestView",
    "Role",
]
