"""Offered load against capacity, per pool: whether a simulated point is a steady state at all.

Past capacity a queue grows without bound, so a finite run reports whatever percentile its length happens to
produce (the longer the run, the worse) — a number that means nothing. Each pool's utilisation is the work the
requests routed to it bring per second over what its instances can do per second:

* a prompt of P tokens occupies a prefill-capable instance for ``step(P x c) / c`` seconds, c prompts batched whole
  up to ``max_batched_tokens`` (so short prompts share an iteration's fixed cost, as vLLM batches them);
* an output token occupies a decode-capable instance for ``step(B) / B`` seconds at its largest batch B (memory
  and ``max_num_seqs`` cap it), at the mean context — the best the instance can do, so utilisation >= 1 means the
  pool cannot keep up under any batching;
* a transfer occupies its prefill instance's link for KV bytes / link bytes/s;
* where the stack around the engines shares their cores (``EngineConfig.token_overhead_s``), its CPU for every
  emitted token comes out of each instance's capacity: spread over every engine's core (``stack_cpu`` "shared",
  as the simulator's ``HostCores`` charges it) each keeps 1 - the stack's share of the cores; charged to the
  emitting instance ("serial"), each output token costs that much more there.

Work is attributed from each request's actual plan, so a policy that serves some requests locally loads the decode
pool with their prefill too. Pure arithmetic over a ``StepModel``; no simulation state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_disagg.planner.costmodel import BatchShape, StepModel
from vllm_disagg.planner.engine import EngineConfig
from vllm_disagg.planner.hardware import Link
from vllm_disagg.planner.metrics import RequestRecord
from vllm_disagg.planner.model import ModelSpec


@dataclass(frozen=True)
class PoolLoad:
    pool: str  # "replicas", "prefill", "decode" or "link"
    instances: int
    offered: float  # busy seconds per second the pool is asked for, in total
    utilization: float  # offered / instances

    def describe(self) -> str:
        return f"{self.pool} {self.utilization:.2f}"


@dataclass(frozen=True)
class Stability:
    loads: tuple[PoolLoad, ...]
    # every request was dropped (none fits the KV cache): nothing was served, which is no steady state either
    all_dropped: bool = False

    @property
    def stable(self) -> bool:
        return not self.all_dropped and all(load.utilization < 1.0 for load in self.loads)

    @property
    def bottleneck(self) -> PoolLoad | None:
        return max(self.loads, key=lambda load: load.utilization, default=None)

    def describe(self) -> str:
        """``"0.83 prefill"`` for the busiest pool, ``"1.20 prefill UNSTABLE"`` past capacity."""
        top = self.bottleneck
        if self.all_dropped:
            return "all dropped UNSTABLE"
        if top is None:
            return "-"
        return f"{top.utilization:.2f} {top.pool}" + ("" if self.stable else " UNSTABLE")

    def to_dict(self) -> dict[str, Any]:
        return {
            "stable": self.stable,
            "all_dropped": self.all_dropped,
            "utilization": {load.pool: load.utilization for load in self.loads},
            "bottleneck": self.bottleneck.pool if self.bottleneck else None,
        }


class WorkModel:
    """Seconds of instance time per prompt and per output token, from a ``StepModel`` (memoised per length)."""

    def __init__(self, cost: StepModel, engine: EngineConfig, mean_prompt: float, mean_output: float) -> None:
        self.cost = cost
        self.engine = engine
        self._prefill: dict[int, float] = {}
        cap = engine.kv_capacity_tokens if engine.kv_capacity_tokens is not None else cost.kv_capacity_tokens
        per_seq = max(1, round(mean_prompt + mean_output))
        batch = engine.max_num_seqs if cap is None else max(1, min(engine.max_num_seqs, cap // per_seq))
        context = max(1, round(mean_prompt + mean_output / 2))
        self.decode_batch = batch
        self.token_s = cost.step_s(BatchShape.decode(batch, context)) / batch
        if engine.token_overhead_s and engine.stack_cpu == "serial":
            self.token_s += engine.token_overhead_s

    def prefill_s(self, prompt: int) -> float:
        if prompt not in self._prefill:
            count = max(1, self.engine.max_batched_tokens // max(prompt, 1))
            self._prefill[prompt] = self.cost.step_s(BatchShape.prefill(prompt, count=count)) / count
        return self._prefill[prompt]


def stability(
    records: Sequence[RequestRecord],
    rate: float,
    cost: StepModel,
    engine: EngineConfig,
    *,
    replicas: int = 0,
    prefill: int = 0,
    decode: int = 0,
    prefill_cost: StepModel | None = None,
    model: ModelSpec | None = None,
    link: Link | None = None,
) -> Stability:
    """Each pool's utilisation at ``rate`` requests/s for the requests in ``records`` (dropped ones excluded).

    ``replicas`` > 0 describes a colocated design; else ``prefill`` + ``decode`` instances (and their links).
    """
    served = [r for r in records if r.mode != "dropped"]
    if not served or rate <= 0:
        return Stability((), all_dropped=bool(records) and not served)
    mean_p = sum(r.prompt_tokens for r in served) / len(served)
    mean_o = sum(r.output_tokens for r in served) / len(served)
    work = WorkModel(cost, engine, mean_p, mean_o)
    per_request = rate / len(served)  # each served request's share of the arrival rate
    # what each instance keeps of its core beside the stack's work, spread over all of them
    kept = 1.0
    if engine.token_overhead_s and engine.stack_cpu == "shared":
        cores = replicas or (prefill + decode)
        share = engine.token_overhead_s * rate * mean_o / max(cores, 1)
        kept = max(1.0 - share, 1e-9)
    per_request /= kept
    if replicas:
        busy = sum(
            work.prefill_s(r.prompt_tokens - r.cached_tokens) + (r.output_tokens - 1) * work.token_s
            for r in served
        )
        return Stability((PoolLoad("replicas", replicas, busy * per_request, busy * per_request / replicas),))
    pwork = WorkModel(prefill_cost, engine, mean_p, mean_o) if prefill_cost is not None else work
    p_busy = d_busy = wire = 0.0
    for r in served:
        if r.mode == "transfer":
            p_busy += pwork.prefill_s(r.prompt_tokens - r.cached_tokens)
            d_busy += r.output_tokens * work.token_s  # decode samples every token, the first included
            if model is not None and link is not None:
                wire += link.wire_s(model.kv_bytes(r.prompt_tokens))
        else:
            d_busy += work.prefill_s(r.prompt_tokens - r.cached_tokens) + (r.output_tokens - 1) * work.token_s
    loads = [
        PoolLoad("prefill", prefill, p_busy * per_request, p_busy * per_request / max(prefill, 1)),
        PoolLoad("decode", decode, d_busy * per_request, d_busy * per_request / max(decode, 1)),
    ]
    if wire:
        loads.append(PoolLoad("link", prefill, wire * per_request, wire * per_request / max(prefill, 1)))
    return Stability(tuple(loads))
