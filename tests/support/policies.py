"""Policies used by tests (loaded by the proxy with --policy tests/support/policies.py:Class)."""

from __future__ import annotations

from vllm_disagg.router import ClusterView, Plan, RequestView
from vllm_disagg.router.policy import NoRoute


class PreferVictim:
    """Recompute on an instance whose id starts with "victim" while it is healthy, else on any decode instance."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        decodes = sorted(cluster.decode, key=lambda i: (not i.id.startswith("victim"), i.id))
        if not decodes:
            raise NoRoute("no decode instance")
        return Plan.recompute(decodes[0].id, reason="prefer_victim")


class Broken:
    """A user policy with a bug: the proxy must serve the request anyway (least-loaded) and log the error."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        raise ZeroDivisionError("bug in a user policy")


class NoPrefill:
    """A user policy that returns a transfer plan with no prefill instance (``Plan.transfer(p and p.id, d.id)`` when
    the prefill pool is empty): the proxy must serve the request anyway, not answer 500."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        return Plan("transfer", decode=cluster.decode[0].id)
