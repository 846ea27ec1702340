"""DisaggConnector over a KV tier (LMCache): vLLM's MultiConnector, with the two things it gets wrong for P/D fixed.

Use it exactly like MultiConnector::

    --kv-transfer-config '{"kv_connector":"DisaggTierConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"connectors":[
        {"kv_connector":"DisaggConnector", ...},
        {"kv_connector":"LMCacheMPConnector", ...}]}}'

1. **Order is checked, not documented.** MultiConnector loads a request from the *first* sub-connector that reports
   matched tokens. With the tier first, a decode request whose prefix is in the tier loads from the tier, so
   DisaggConnector never pulls the KV the prefill instance is holding for it: P keeps those blocks until their lease
   runs out. So DisaggConnector must come first; plain requests (DisaggConnector reports 0) still fall through to
   the tier. A config with DisaggConnector elsewhere is refused at start with a message saying so.
2. **Tier KV events reach the router.** MultiConnector has no ``get_kv_connector_kv_cache_events`` (vLLM's TODO
   in multi_connector.py), so a tier's ``BlockStored(medium="CPU")`` events die on the worker and the router never
   learns what the tier holds. Here the sub-connectors' event containers are merged and passed on; on the scheduler
   side MultiConnector already hands the step's output to every sub-connector, and the one that made the events
   (LMCache checks its own container type) publishes them.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from vllm_disagg.connectors.plugin import CONNECTOR_NAME, TIERED_CONNECTOR_NAME


def check_order(connectors: Any) -> None:
    """Refuse a composition where DisaggConnector is missing or not first (see the module docstring, point 1)."""
    if not isinstance(connectors, list) or not connectors:
        raise ValueError(
            f"{TIERED_CONNECTOR_NAME}: kv_connector_extra_config.connectors must be a non-empty list of "
            "kv-transfer configs, DisaggConnector first"
        )
    names = [c.get("kv_connector") if isinstance(c, dict) else None for c in connectors]
    if CONNECTOR_NAME not in names:
        raise ValueError(
            f"{TIERED_CONNECTOR_NAME}: no {CONNECTOR_NAME} among connectors {names}; add it first, or use "
            "MultiConnector if this instance does not take part in P/D transfers"
        )
    if names[0] != CONNECTOR_NAME:
        raise ValueError(
            f"{TIERED_CONNECTOR_NAME}: {CONNECTOR_NAME} must be the first of connectors {names}: MultiConnector "
            "loads from the first connector reporting a hit, so a tier listed first would take P/D loads and leave "
            "the prefill instance holding their blocks until the lease expires. Move it to the front."
        )


class DisaggTierConnector(MultiConnector):  # type: ignore[misc]
    """MultiConnector that checks DisaggConnector comes first and passes the tier's KV-cache events through."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        ktc = vllm_config.kv_transfer_config
        check_order(ktc.kv_connector_extra_config.get("connectors") if ktc is not None else None)
        sc = vllm_config.scheduler_config
        if not sc.disable_hybrid_kv_cache_manager and not MultiConnector.all_children_support_hma(ktc):
            # vLLM turns the hybrid allocator off for a MultiConnector whose children lack HMA support by *name*
            # ("MultiConnector"), so under our name it stays on and MultiConnector's assertion fires. With one KV
            # cache group (every full-attention model) the allocator has nothing to do: tell MultiConnector so.
            groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
            if groups > 1:
                raise ValueError(
                    f"{TIERED_CONNECTOR_NAME}: this model has {groups} KV-cache groups (a hybrid model) and not "
                    "every sub-connector supports the hybrid allocator; start vLLM with "
                    "--disable-hybrid-kv-cache-manager"
                )
            vllm_config = copy.copy(vllm_config)
            vllm_config.scheduler_config = copy.copy(sc)
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
        super().__init__(vllm_config, role, kv_cache_config)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Every sub-connector's events of this step, in one container of the first producer's type."""
        merged: KVConnectorKVEvents | None = None
        for c in self._connectors:
            events = c.get_kv_connector_kv_cache_events()
            if events is None:
                continue
            merged = events if merged is None else merged.merge(events)
        return merged
