"""Built-in routing policies (one definition of an instance's load, ``load``).

The simple built-ins are baselines to compare the cost model against: they always transfer when a prefill/decode
pair is usable. When none is, they fall back to serving on a decode-capable instance and say so in
``Plan.reason`` ("no_prefill" or "no_pair"), never silently; with no decode-capable instance they raise ``NoRoute``.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_disagg.policy.api import ClusterView, InstanceView, NoRoute, Plan, RequestView
from vllm_disagg.policy.cost_model import CostModel, local_plan, no_pair_reason, transfer_pairs


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

    needs_tokens = False  # reads no prompt length and no cached prefix: the proxy need not tokenize

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

    needs_tokens = False  # reads no prompt length and no cached prefix: the proxy need not tokenize

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
