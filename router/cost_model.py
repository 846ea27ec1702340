"""The default policy, importable from the proxy package too (it lives in :mod:`vllm_disagg.policy.cost_model`)."""

from __future__ import annotations

from vllm_disagg.policy.cost_model import (
    CostModel,
    CostModelConfig,
    Estimate,
    local_plan,
    missing,
    no_pair_reason,
    tier_hit,
    transfer_pairs,
    uncached,
)

__all__ = [
    "CostModel",
    "CostModelConfig",
    "Estimate",
    "local_plan",
    "missing",
    "no_pair_reason",
    "tier_hit",
    "transfer_pairs",
    "uncached",
]
