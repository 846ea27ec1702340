"""The prefix-aware P/D proxy and its routing-policy API (``vllm_disagg.router``). Runs without vLLM or torch.

Public API for custom policies::

    from vllm_disagg.router import Policy, Plan, RequestView, ClusterView
"""

from __future__ import annotations

from vllm_disagg.policy.api import (
    ClusterView,
    InstanceView,
    NoRoute,
    Outcome,
    Plan,
    Policy,
    RequestView,
)

__all__ = ["ClusterView", "InstanceView", "NoRoute", "Outcome", "Plan", "Policy", "RequestView"]
