"""The simulator's built-in routing policies (plain ``Policy`` classes, like any user policy).

A deployment's load balancer is one of three kinds, and which one changes the latency tail a design shows:
``least-loaded`` (fewest requests in flight: what this project's proxy and most routers do), ``round-robin`` (a
plain L4/L7 balancer or a Kubernetes Service with session-less round robin) and ``random`` (kube-proxy's iptables
mode). Each pool of a design gets its own picker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal, Protocol

from vllm_disagg.policy.api import ClusterView, InstanceView, NoRoute, Plan, RequestView
from vllm_disagg.policy.builtin import load

Routing = Literal["least-loaded", "round-robin", "random"]
ROUTINGS: tuple[Routing, ...] = ("least-loaded", "round-robin", "random")


class Picker(Protocol):
    def pick(self, candidates: Sequence[InstanceView]) -> InstanceView: ...


class LeastLoadedPick:
    """Least loaded by the proxy's own definition of load (``vllm_disagg.policy.builtin.load``); the first on ties."""

    def pick(self, candidates: Sequence[InstanceView]) -> InstanceView:
        return min(candidates, key=load)


class RoundRobinPick:
    """The next instance in turn, blind to load."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[InstanceView]) -> InstanceView:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class RandomPick:
    """A uniformly random instance, blind to load; seeded, so runs are reproducible."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: Sequence[InstanceView]) -> InstanceView:
        return candidates[self._rng.randrange(len(candidates))]


def picker(kind: Routing, seed: int = 0) -> Picker:
    if kind == "least-loaded":
        return LeastLoadedPick()
    if kind == "round-robin":
        return RoundRobinPick()
    if kind == "random":
        return RandomPick(seed)
    raise ValueError(f"unknown routing {kind!r}; use one of {', '.join(ROUTINGS)}")


def _live(cluster: ClusterView, role: str) -> list[InstanceView]:
    return [i for i in cluster.instances if i.healthy and i.role == role]


class PoolTransfer:
    """Always transfer: a prefill instance and a decode instance, each picked by its pool's balancer."""

    def __init__(
        self, prefill: Routing = "least-loaded", decode: Routing = "least-loaded", seed: int = 0
    ) -> None:
        self.prefill = picker(prefill, seed)
        self.decode = picker(decode, seed + 1)
        self.kinds = (prefill, decode)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        prefill = _live(cluster, "prefill") or list(cluster.prefill)
        decode = _live(cluster, "decode") or list(cluster.decode)
        if not prefill or not decode:
            raise NoRoute("no prefill/decode pair")
        p, d = self.prefill.pick(prefill), self.decode.pick(decode)
        return Plan.transfer(p.id, d.id, reason=f"{self.kinds[0]} prefill, {self.kinds[1]} decode")


class PoolColocated:
    """Colocated serving: one replica, picked by the balancer."""

    def __init__(self, routing: Routing = "least-loaded", seed: int = 0) -> None:
        self.picker = picker(routing, seed)
        self.kind = routing

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        live = [i for i in cluster.instances if i.healthy]
        if not live:
            raise NoRoute("no healthy instance")
        return Plan.colocated(self.picker.pick(live).id, reason=f"{self.kind} replica")


class LeastLoadedTransfer(PoolTransfer):
    """Always transfer: the least-loaded prefill and decode instances (first on ties)."""

    def __init__(self) -> None:
        super().__init__("least-loaded", "least-loaded")


class LeastLoadedColocated(PoolColocated):
    """Colocated serving: the least-loaded replica (first on ties)."""

    def __init__(self) -> None:
        super().__init__("least-loaded")
