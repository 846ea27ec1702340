"""Calling a routing policy the way the proxy and the simulator both do.

A user's policy is code the proxy does not control. What it returns is checked against the cluster it was shown
before any instance sees the request: a plan that is no plan, names an instance it was not offered (unknown,
excluded for this request, unhealthy) or one that cannot take the role (a decode-only instance asked to prefill),
or transfers without a prefill, is served instead as least-loaded would serve it, with reason ``policy_error`` and
the failure among the plan's alternatives (``x-disagg-path``, ``/admin/decisions``). A policy that raises is
treated the same. The first of each distinct failure is logged with what the policy returned or its traceback;
repeats are counted and summarised at most every ``REPEAT_LOG_S``, so a broken policy under load cannot flood the log.

``plan()`` runs on the proxy's event loop, inline: a call slower than ``SLOW_PLAN_S`` delays every request and
health check the proxy serves, and is warned about, naming the policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from vllm_disagg.policy.api import ClusterView, InstanceView, NoRoute, Outcome, Plan, Policy, RequestView
from vllm_disagg.policy.builtin import LeastLoaded
from vllm_disagg.policy.cost_model import can_pair

MODES = ("transfer", "recompute", "colocated")
REPEAT_LOG_S = 10.0
SLOW_PLAN_S = 0.05
# Distinct failures logged in full; past this many (a policy whose failure names the request, say) every failure is
# summarised with the repeats
MAX_LOGGED_KINDS = 64


def _view(cluster: ClusterView, instance_id: object) -> InstanceView | None:
    for inst in cluster.instances:
        if inst.id == instance_id:
            return inst
    return None


def _cannot(inst: InstanceView, role: str) -> str:
    why = "it is unhealthy" if not inst.healthy else f"its role is {inst.role}"
    return f"instance {inst.id!r} cannot {role} ({why})"


def plan_problem(plan: object, cluster: ClusterView) -> str:
    """Why ``plan`` cannot be served on ``cluster``, the view its policy was given ("" when it can)."""
    if not isinstance(plan, Plan):
        return f"returned {type(plan).__name__}, not a Plan"
    if plan.mode not in MODES:
        return f"returned mode {plan.mode!r}; a plan's mode is one of {', '.join(MODES)}"
    decode = _view(cluster, plan.decode)
    if decode is None:
        return f"chose instance {plan.decode!r}, which it was not offered (unknown, or excluded for this request)"
    if not decode.can_decode:
        return "chose " + _cannot(decode, "serve a request")
    if plan.mode != "transfer":
        return ""
    if plan.prefill is None:
        return "returned a transfer plan without a prefill instance"
    if plan.prefill == plan.decode:
        return (
            f"returned a transfer from {plan.prefill!r} to itself (that is Plan.colocated or Plan.recompute)"
        )
    if plan.backup_prefill is not None and plan.backup_prefill in (plan.prefill, plan.decode):
        return f"named {plan.backup_prefill!r} as its own backup prefill (the backup is another instance)"
    for what, iid in (("prefill", plan.prefill), ("backup prefill", plan.backup_prefill)):
        if iid is None:
            continue
        inst = _view(cluster, iid)
        if inst is None:
            return f"chose {what} instance {iid!r}, which it was not offered (unknown, or excluded for this request)"
        if not inst.can_prefill:
            return f"chose as {what} " + _cannot(inst, "prefill")
        if not can_pair(inst, decode):
            return (
                f"chose a transfer from {iid!r} to {decode.id!r}: two instances of role both pair only when both run "
                "a KV connector the proxy could describe (InstanceView.kv_connector)"
            )
    return ""


class PolicyGuard:
    """One policy's calls, guarded as the module docstring says. ``failures`` counts the requests whose plan was
    replaced; ``first_failure`` says what the first one was."""

    def __init__(
        self,
        policy: Policy,
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.name = type(policy).__name__
        self.log = log
        self.clock = clock
        self.failures = 0
        self.first_failure = ""
        self.slow_calls = 0
        self._seen: set[str] = set()
        self._unlogged = 0
        self._next_summary = 0.0
        self._next_slow_warning = 0.0
        self._fallback = LeastLoaded()
        self._observe: Callable[[Outcome], None] | None = getattr(policy, "observe", None)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        """The policy's plan when it can be served, else least-loaded's (``NoRoute`` from either passes through)."""
        t0 = self.clock()
        raised = False
        try:
            plan = self.policy.plan(request, cluster)
            problem = key = plan_problem(plan, cluster)
        except NoRoute:
            raise
        except Exception as exc:
            # one log per exception type: its message may name the request, which would make each one new
            plan, problem, key, raised = None, f"raised {exc!r}", f"raised {type(exc).__name__}", True
        took = self.clock() - t0
        if took > SLOW_PLAN_S:
            self._slow(request, took)
        if not problem:
            assert isinstance(plan, Plan)
            return plan
        self._failed(request, problem, key, raised)
        fallback = self._fallback.plan(request, cluster)
        return Plan(
            fallback.mode,
            fallback.decode,
            fallback.prefill,
            fallback.backup_prefill,
            reason="policy_error",
            alternatives=(f"{self.name} {problem}",),
        )

    def observe(self, outcome: Outcome) -> None:
        """Feed the policy an outcome; a policy whose ``observe`` raises is logged as for ``plan``, never fatal."""
        if self._observe is None:
            return
        try:
            self._observe(outcome)
        except Exception as exc:
            self._failed_quietly(
                f"observe() raised {exc!r}", f"observe {type(exc).__name__}", outcome.request_id
            )

    def _failed(self, request: RequestView, problem: str, key: str, raised: bool) -> None:
        self.failures += 1
        self.first_failure = self.first_failure or problem
        if key not in self._seen and len(self._seen) < MAX_LOGGED_KINDS:
            self._seen.add(key)
            self.log.error(
                "request %s: policy %s %s; serving it with least-loaded instead (reason=policy_error). Fix the "
                "policy; further requests failing the same way are counted, not logged one by one",
                request.request_id,
                self.name,
                problem,
                exc_info=raised,
            )
            return
        self._summarise(request.request_id)

    def _failed_quietly(self, problem: str, key: str, request_id: str) -> None:
        if key not in self._seen and len(self._seen) < MAX_LOGGED_KINDS:
            self._seen.add(key)
            self.log.error(
                "request %s: policy %s %s; the outcome was dropped",
                request_id,
                self.name,
                problem,
                exc_info=True,
            )
            return
        self._summarise(request_id)

    def _summarise(self, request_id: str) -> None:
        self._unlogged += 1
        now = self.clock()
        if now >= self._next_summary:
            self._next_summary = now + REPEAT_LOG_S
            self.log.error(
                "policy %s: %d more request(s) failed as logged before (the latest: %s); %d in all since start",
                self.name,
                self._unlogged,
                request_id,
                self.failures,
            )
            self._unlogged = 0

    def _slow(self, request: RequestView, took: float) -> None:
        self.slow_calls += 1
        now = self.clock()
        if now >= self._next_slow_warning:
            self._next_slow_warning = now + REPEAT_LOG_S
            self.log.warning(
                "request %s: policy %s took %.0f ms to plan (%d call(s) over %.0f ms so far); plan() runs on the "
                "proxy's event loop, so every request and health check waited. Keep it under a millisecond: "
                "precompute in observe() or a thread of its own",
                request.request_id,
                self.name,
                took * 1e3,
                self.slow_calls,
                SLOW_PLAN_S * 1e3,
            )
