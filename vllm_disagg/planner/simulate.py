"""Discrete-event simulation of colocated replicas, disaggregated prefill/decode pools, and adaptive instances.

All designs run the same loop over the same ``Engine``s; they differ in roles and in the routing policy. The
disaggregated and adaptive designs ask a router ``Policy`` (``vllm_disagg.policy``) for each request's plan, built
from the simulator's live state and clock, so a policy can be replayed offline against a workload before it serves
traffic. Adaptive instances all prefill and decode and all run a KV connector: the policy may transfer between any
two of them or serve a request on one alone, as the proxy does with ``--both`` instances that have side channels.

KV transfer model: one serial link (NIC) per prefill instance. With layer-wise push, layer i's KV leaves once
layer i is computed, so the last byte lands at max(prefill end + wire/L, max(prefill start, link free) + wire);
without it the whole transfer starts at prefill end. The link's setup cost and the design's fixed per-transfer cost
(the engine's control round trips, the proxy's extra hop) are added either way. The decode
instance's first iteration with the request produces its first token (TTFT counts the transfer and any wait).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg.planner.costmodel import StepModel
from vllm_disagg.planner.engine import Engine, EngineConfig, IterationRecord, SimRequest
from vllm_disagg.planner.goodput import GoodputResult, search_goodput
from vllm_disagg.planner.hardware import MEASURED_ENGINE_FIXED_S, MEASURED_PROXY_HOP_S, Link
from vllm_disagg.planner.metrics import RequestRecord, Summary, summarize
from vllm_disagg.planner.model import ModelSpec
from vllm_disagg.planner.routing import PoolColocated, PoolTransfer, Routing
from vllm_disagg.planner.stability import Stability, stability
from vllm_disagg.planner.workload import Request, Workload
from vllm_disagg.policy.api import (
    ClusterView,
    InstanceView,
    NoRoute,
    Outcome,
    Plan,
    Policy,
    RequestView,
)
from vllm_disagg.policy.guard import PolicyGuard

logger = logging.getLogger("vllm_disagg.simulate")
_ARRIVAL, _ITER_END, _TRANSFER_DONE = 0, 1, 2


@dataclass(frozen=True)
class Colocated:
    """``replicas`` instances, each prefilling and decoding its own requests, behind a ``routing`` balancer."""

    replicas: int
    routing: Routing = "least-loaded"

    @property
    def name(self) -> str:
        return f"colocated x{self.replicas}"


@dataclass(frozen=True)
class Disaggregated:
    """``prefill`` + ``decode`` instances joined by ``link``; ``policy`` None means always transfer, each pool
    picked by its own balancer (``prefill_routing``, ``decode_routing``). A ``policy`` given as a function that
    builds one is called for each run, so a policy that learns does not carry one rate's state into the next."""

    prefill: int
    decode: int
    link: Link
    layerwise: bool = True
    policy: Policy | Callable[[], Policy] | None = None
    prefill_routing: Routing = "least-loaded"
    decode_routing: Routing = "least-loaded"
    # per transfer, beside the link's setup: the engine's control round trips and the proxy's extra hop
    transfer_fixed_s: float = MEASURED_ENGINE_FIXED_S + MEASURED_PROXY_HOP_S

    @property
    def name(self) -> str:
        return f"disagg {self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Adaptive:
    """``replicas`` instances that each prefill and decode, joined by ``link``; ``policy`` (None: the proxy's default,
    a fresh ``CostModel`` per run; a function: called for each run) chooses per request between a transfer either
    way and serving on one alone."""

    replicas: int
    link: Link
    policy: Policy | Callable[[], Policy] | None = None
    layerwise: bool = True
    transfer_fixed_s: float = MEASURED_ENGINE_FIXED_S + MEASURED_PROXY_HOP_S
    ttft_slo_s: float | None = None  # the default policy's targets (None: CostModelConfig's)
    tpot_slo_s: float | None = None

    @property
    def name(self) -> str:
        return f"adaptive x{self.replicas}"

    def make_policy(self) -> Policy:
        if self.policy is not None:
            return _for_run(self.policy)
        from dataclasses import replace

        from vllm_disagg.policy.cost_model import CostModel, CostModelConfig

        cfg = CostModelConfig()
        return CostModel(
            replace(
                cfg,
                ttft_slo_s=self.ttft_slo_s or cfg.ttft_slo_s,
                tpot_slo_s=self.tpot_slo_s or cfg.tpot_slo_s,
            )
        )


Design = Colocated | Disaggregated | Adaptive


@dataclass
class SimResult:
    design: str
    rate: float
    records: list[RequestRecord]
    iterations: dict[str, list[IterationRecord]] = field(default_factory=dict)
    stability: Stability = Stability(())
    # requests whose policy's plan was replaced by least-loaded's (it raised, or could not be served), as the proxy
    # would, and what the first was
    policy_failures: int = 0
    policy_first_failure: str = ""

    def summary(self, ttft_slo_s: float, tpot_slo_s: float, warmup_s: float = 0.0) -> Summary:
        return summarize(self.records, ttft_slo_s, tpot_slo_s, warmup_s)


class HostCores:
    """The cores a host's engines and the stack around them share: each engine holds one, and the stack's CPU
    (``per_token_s`` for each token the cluster emits, at the emission rate of the last ``window_s``, decayed)
    takes its share from all of them alike, so every engine runs at (cores - stack) / cores of its speed.

    That is what the OS does with engines that each keep a core busy (vLLM's CPU engine spins even when idle)
    and short-lived stack work that is always runnable first: the stack's time is spread over every core, and the
    instance emitting the tokens is slowed no more than the one beside it prefilling."""

    MAX_SHARE = 0.9  # of the cores the stack may take in the model (past it the host is past capacity anyway)

    def __init__(self, cores: int, per_token_s: float, window_s: float = 1.0) -> None:
        self.cores, self.per_token_s, self.window_s = cores, per_token_s, window_s
        self._level = 0.0  # decayed token count
        self._at = 0.0

    def _decayed(self, now: float) -> float:
        return self._level * math.exp(-(now - self._at) / self.window_s) if now > self._at else self._level

    def emitted(self, now: float, tokens: int) -> None:
        self._level = self._decayed(now) + tokens
        self._at = max(now, self._at)

    def slowdown(self, now: float) -> float:
        """The factor on an iteration starting at ``now``."""
        stack = self.per_token_s * self._decayed(now) / self.window_s
        return 1.0 / (1.0 - min(stack / self.cores, self.MAX_SHARE))


class _Loop:
    """The event loop: arrivals, iteration ends and transfer completions, in time order (ties by insertion)."""

    def __init__(
        self,
        engines: list[Engine],
        policy: Policy,
        model: ModelSpec,
        link: Link | None,
        layerwise: bool,
        transfer_fixed_s: float = 0.0,
        kv_connector: bool = False,
    ) -> None:
        self.engines = {e.id: e for e in engines}
        self.kv_connector = kv_connector  # every instance runs a KV connector (the adaptive design)
        self.order = [e.id for e in engines]
        self.policy = policy
        self.model = model
        self.link = link
        self.layerwise = layerwise
        self.transfer_fixed_s = transfer_fixed_s
        self.in_flight = dict.fromkeys(self.order, 0)
        self.link_free = dict.fromkeys(self.order, 0.0)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.done: list[SimRequest] = []
        # the proxy's own guard: a plan it would replace (or a raise) is replaced here too, and counted
        self.guard = PolicyGuard(policy, logger)
        self.observe: Callable[[Outcome], None] | None = (
            self.guard.observe if getattr(policy, "observe", None) is not None else None
        )
        cfg = engines[0].cfg if engines else None
        self.host = (
            HostCores(len(engines), cfg.token_overhead_s)
            if cfg is not None and cfg.token_overhead_s and cfg.stack_cpu == "shared"
            else None
        )

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, payload))
        self.seq += 1

    def cluster(self, now: float, req: Request | None = None) -> ClusterView:
        """What a policy sees at ``now``; with ``req``, each instance's prefix hit for it as the proxy's prefix
        index reports it: what the instance computed or received, and what was sent there to be (pending)."""
        views = tuple(
            InstanceView(
                id=e.id,
                role=e.role,
                in_flight=self.in_flight[e.id],
                waiting=e.prompts,
                running=e.streams,
                kv_usage=e.kv_usage,
                cached_tokens=e.routed_hit(req) if req is not None else 0,
                kv_connector=self.kv_connector,
                known_streams=e.lengths.count,
                shortest_stream=e.lengths.shortest,
                stall_sensitivity=e.lengths.sensitivity,
            )
            for e in (self.engines[i] for i in self.order)
        )
        bw = self.link.bytes_per_s if self.link else 0.0
        return ClusterView(
            views, kv_bytes_per_token=self.model.kv_bytes_per_token, link_bytes_per_s=bw, now_s=now
        )

    def kick(self, now: float, engine: Engine) -> None:
        if engine.busy:
            return
        duration = engine.start_iteration(now, self.host.slowdown(now) if self.host is not None else 1.0)
        if duration is not None:
            self.push(now + duration, _ITER_END, engine.id)

    def engine(self, instance_id: str | None, plan: Plan) -> Engine:
        if instance_id not in self.engines:  # the guard checked the plan: this is the simulator's own fault
            raise AssertionError(f"planned unknown instance {instance_id!r}: {plan.describe()}")
        return self.engines[instance_id]

    def drop(self, r: SimRequest, why: str) -> None:
        r.dropped = why
        self.done.append(r)
        if self.observe is not None and r.plan is not None:
            self.observe(Outcome(str(r.req.id), r.plan, ok=False, prompt_tokens=r.prompt, error=why))

    def arrive(self, now: float, r: SimRequest) -> None:
        view = RequestView(request_id=str(r.req.id), prompt_tokens=r.prompt, max_tokens=r.output, stream=True)
        try:
            plan = self.guard.plan(view, self.cluster(now, r.req))
        except NoRoute as exc:
            self.drop(r, f"no route: {exc}")
            return
        decode = self.engine(plan.decode, plan)
        r.plan = plan
        if plan.mode == "transfer":
            prefill = self.engine(plan.prefill, plan)
            r.prefill_only = True
            if not prefill.fits(r, True) or not decode.fits(r):
                self.drop(r, "request larger than KV capacity")
                return
            prefill.expect(r.req)
            self.in_flight[prefill.id] += 1
            self.in_flight[decode.id] += 1
            prefill.submit(r)
            self.kick(now, prefill)
        else:
            if not decode.fits(r):
                self.drop(r, "request larger than KV capacity")
                return
            decode.expect(r.req)
            self.in_flight[decode.id] += 1
            decode.submit(r)
            self.kick(now, decode)

    def start_transfer(self, now: float, engine: Engine, r: SimRequest) -> None:
        if self.link is None:
            raise ValueError("a transfer plan needs a link (use the disaggregated or adaptive design)")
        # the decode instance loads only what its own prefix cache misses
        assert r.plan is not None
        moved = r.prompt - self.engines[r.plan.decode].cached_for(r.req)
        wire = self.link.wire_s(self.model.kv_bytes(moved))
        start = r.prefill_start if r.prefill_start is not None else now
        free = self.link_free[engine.id]
        if self.layerwise and self.model.num_layers > 1:
            landed = max(now + wire / self.model.num_layers, max(start, free) + wire)
        else:
            landed = max(now, free) + wire
        self.link_free[engine.id] = landed
        done = landed + self.link.setup_s + self.transfer_fixed_s
        r.exposed_transfer_s = done - now
        self.push(done, _TRANSFER_DONE, (engine.id, r))

    def run(self, requests: Sequence[Request]) -> list[SimRequest]:
        for req in requests:
            self.push(req.arrival_s, _ARRIVAL, SimRequest(req))
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == _ARRIVAL:
                self.arrive(now, payload)
            elif kind == _ITER_END:
                engine = self.engines[payload]
                if self.host is not None:
                    self.host.emitted(now, engine.emitting)
                out = engine.finish_iteration(now)
                for r in out.prefilled:
                    self.start_transfer(now, engine, r)
                for r in out.finished:
                    self.finish(r)
                self.kick(now, engine)
            else:
                prefill_id, r = payload
                prefill = self.engines[prefill_id]
                prefill.release(r)
                self.in_flight[prefill_id] -= 1
                r.transfer_end = now
                assert r.plan is not None
                decode = self.engines[r.plan.decode]
                decode.receive(r)
                self.kick(now, decode)
                self.kick(now, prefill)
        stuck = [r for e in self.engines.values() for r in (*e.waiting, *e.ready)]
        for r in stuck:  # only when an engine can never admit them (max_num_seqs 0); kept for safety
            self.drop(r, "never admitted")
        return self.done

    def finish(self, r: SimRequest) -> None:
        assert r.plan is not None
        self.in_flight[r.plan.decode] -= 1
        self.done.append(r)
        if self.observe is not None and r.first_token is not None and r.finish is not None:
            self.observe(
                Outcome(
                    request_id=str(r.req.id),
                    plan=r.plan,
                    ok=True,
                    prompt_tokens=r.prompt,
                    uncached_tokens=r.prompt - r.cached,
                    ttft_s=r.first_token - r.req.arrival_s,
                    prefill_s=(r.prefill_end - r.prefill_start)
                    if r.plan.mode == "transfer" and r.prefill_end is not None and r.prefill_start is not None
                    else None,
                    e2e_s=r.finish - r.req.arrival_s,
                    output_tokens=r.output,
                )
            )


def _record(r: SimRequest) -> RequestRecord:
    req = r.req
    if r.dropped or r.first_token is None or r.finish is None or r.plan is None:
        return RequestRecord(
            id=req.id,
            arrival_s=req.arrival_s,
            prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens,
            mode="dropped",
            prefill_instance=None,
            decode_instance=None,
            ttft_s=None,
            tpot_s=None,
            e2e_s=None,
            dropped=r.dropped or "unfinished",
        )
    # as vllm bench serve: a one-token answer has no TPOT (left out of its percentiles, never over a TPOT target)
    tpot = (r.finish - r.first_token) / (req.output_tokens - 1) if req.output_tokens > 1 else None
    return RequestRecord(
        id=req.id,
        arrival_s=req.arrival_s,
        prompt_tokens=req.prompt_tokens,
        output_tokens=req.output_tokens,
        mode=r.plan.mode,
        prefill_instance=r.plan.prefill if r.plan.mode == "transfer" else r.plan.decode,
        decode_instance=r.plan.decode,
        ttft_s=r.first_token - req.arrival_s,
        tpot_s=tpot,
        e2e_s=r.finish - req.arrival_s,
        exposed_transfer_s=r.exposed_transfer_s,
        cached_tokens=r.cached,
        prefill_done_s=r.prefill_end - req.arrival_s if r.prefill_end is not None else None,
    )


def simulate(
    requests: Sequence[Request],
    design: Design,
    model: ModelSpec,
    cost: StepModel,
    engine: EngineConfig | None = None,
    *,
    prefill_cost: StepModel | None = None,
    record_iterations: bool = False,
    rate: float = 0.0,
    seed: int = 0,
) -> SimResult:
    """Run ``requests`` through ``design``; deterministic for a given request list and ``seed`` (random routing).

    ``cost`` times every instance's iterations (``prefill_cost``, if given, the prefill pool's). Instance ids are
    ``c0..`` (colocated), ``p0..`` and ``d0..`` (disaggregated), which is what a replayed policy sees. With ``rate``
    given, the result carries each pool's utilisation (``stability``).
    """
    cfg = engine or EngineConfig()
    engines: list[Engine]
    policy: Policy
    link: Link | None = None
    layerwise = True
    fixed_s = 0.0
    if isinstance(design, Colocated):
        if design.replicas < 1:
            raise ValueError("need at least one replica")
        engines = [Engine(f"c{i}", "both", cost, cfg, record_iterations) for i in range(design.replicas)]
        policy = PoolColocated(design.routing, seed)
    elif isinstance(design, Adaptive):
        if design.replicas < 1:
            raise ValueError("need at least one instance")
        engines = [Engine(f"a{i}", "both", cost, cfg, record_iterations) for i in range(design.replicas)]
        policy = design.make_policy()
        link, layerwise, fixed_s = design.link, design.layerwise, design.transfer_fixed_s
    else:
        if design.prefill < 1 or design.decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        engines = [
            Engine(f"p{i}", "prefill", prefill_cost or cost, cfg, record_iterations)
            for i in range(design.prefill)
        ]
        engines += [Engine(f"d{i}", "decode", cost, cfg, record_iterations) for i in range(design.decode)]
        policy = (
            _for_run(design.policy)
            if design.policy is not None
            else PoolTransfer(design.prefill_routing, design.decode_routing, seed)
        )
        link, layerwise, fixed_s = design.link, design.layerwise, design.transfer_fixed_s
    loop = _Loop(engines, policy, model, link, layerwise, fixed_s, kv_connector=isinstance(design, Adaptive))
    done = loop.run(requests)
    records = sorted((_record(r) for r in done), key=lambda rec: rec.id)
    iterations = {e.id: e.iterations for e in engines} if record_iterations else {}
    if isinstance(design, Colocated | Adaptive):
        stable = stability(records, rate, cost, cfg, replicas=design.replicas)
    else:
        stable = stability(
            records,
            rate,
            cost,
            cfg,
            prefill=design.prefill,
            decode=design.decode,
            prefill_cost=prefill_cost,
            model=model,
            link=design.link,
        )
    return SimResult(
        design.name, rate, records, iterations, stable, loop.guard.failures, loop.guard.first_failure
    )


def _for_run(policy: Policy | Callable[[], Policy]) -> Policy:
    """The policy one run uses: built afresh where the design holds a function that builds it."""
    return policy if hasattr(policy, "plan") else policy()  # type: ignore[operator]


def simulate_rate(
    workload: Workload,
    rate: float,
    design: Design,
    model: ModelSpec,
    cost: StepModel,
    duration_s: float | None = None,
    **kw: Any,
) -> SimResult:
    """The workload at ``rate`` (only the arrivals within ``duration_s``, if given)."""
    return simulate(workload.at_rate(rate, duration_s), design, model, cost, rate=rate, **kw)


def goodput(
    workload: Workload,
    design: Design,
    model: ModelSpec,
    cost: StepModel,
    ttft_slo_s: float,
    tpot_slo_s: float,
    *,
    target: float = 0.9,
    start_rate: float = 1.0,
    rel_tol: float = 0.02,
    warmup_s: float = 0.0,
    workload_at: Callable[[float], Workload] | None = None,
    **kw: Any,
) -> GoodputResult:
    """Highest request rate at which >= ``target`` of requests meet both SLOs (see ``search_goodput``); a rate
    past a pool's capacity never counts as met, however the finite run's percentiles came out. ``workload_at``
    sizes the sample for each probed rate (a fixed number of requests spans less time at a higher rate: the
    warm-up or a ``duration_s`` would leave a fast probe few or none)."""

    unstable: list[float] = []

    def attainment(rate: float) -> float:
        res = simulate_rate(
            workload if workload_at is None else workload_at(rate), rate, design, model, cost, **kw
        )
        if not res.stability.stable:
            unstable.append(rate)
            return 0.0
        summary = res.summary(ttft_slo_s, tpot_slo_s, warmup_s)
        if summary.requests == 0:
            raise ValueError(
                f"at {rate:g} req/s every request arrives within the {warmup_s:g} s warm-up: use more requests "
                "or a shorter --warmup"
            )
        return summary.attainment

    found = search_goodput(attainment, target=target, start=start_rate, rel_tol=rel_tol)
    return dataclasses.replace(found, unstable=tuple(unstable))
