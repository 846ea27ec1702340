"""Routing policies: the API a policy implements, the cost model, the built-ins, and the one loader.

Pure logic, shared by the proxy (``vllm_disagg.router``, which re-exports the API) and the planner's simulator::

    from vllm_disagg.policy import Policy, Plan, RequestView, ClusterView, load_policy
"""

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
from vllm_disagg.policy.builtin import BUILTIN_POLICIES, AlwaysTransfer, LeastLoaded, RoundRobinPairs, load
from vllm_disagg.policy.cost_model import CostModel, CostModelConfig
from vllm_disagg.policy.loader import ENTRY_POINT_GROUP, PolicyLoadError, load_policy

__all__ = [
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "AlwaysTransfer",
    "ClusterView",
    "CostModel",
    "CostModelConfig",
    "InstanceView",
    "LeastLoaded",
    "Mode",
    "NoRoute",
    "Outcome",
    "Plan",
    "Policy",
    "PolicyLoadError",
    "RequestView",
    "Role",
    "RoundRobinPairs",
    "load",
    "load_policy",
]
