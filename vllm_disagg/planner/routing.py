"""The simulator's built-in routing policies (plain ``Policy`` classes, like any user policy)."""

from __future__ import annotations

from vllm_disagg.policy.api import ClusterView, InstanceView, NoRoute, Plan, RequestView


def _load(inst: InstanceView) -> tuple[int, int]:
    return (inst.in_flight, inst.waiting)


class LeastLoadedTransfer:
    """Always transfer: the prefill and the decode instance with the fewest requests in flight (first on ties)."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        prefill = [i for i in cluster.instances if i.healthy and i.role == "prefill"] or cluster.prefill
        decode = [i for i in cluster.instances if i.healthy and i.role == "decode"] or cluster.decode
        if not prefill or not decode:
            raise NoRoute("no prefill/decode pair")
        p = min(prefill, key=_load)
        d = min(decode, key=_load)
        return Plan.transfer(p.id, d.id, reason="least-loaded pair")


class LeastLoadedColocated:
    """Colocated serving: the replica with the fewest requests in flight (first on ties)."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        live = [i for i in cluster.instances if i.healthy]
        if not live:
            raise NoRoute("no healthy instance")
        return Plan.colocated(min(live, key=_load).id, reason="least-loaded replica")
