"""Pool sizing arithmetic: KV bytes, transfer time, per-GPU rates, the balanced prefill share, instance counts.

All functions are pure. Rates come from a ``StepModel`` (roofline or measured profile), so the same plan can be
made from spec sheets before hardware exists and from a profile after it does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from vllm_disagg.planner.costmodel import BatchShape, StepModel
from vllm_disagg.planner.hardware import MEASURED_ENGINE_FIXED_S, MEASURED_PROXY_HOP_S, Link
from vllm_disagg.planner.model import ModelSpec


def kv_bytes_per_request(model: ModelSpec, prompt_tokens: int) -> int:
    """The prompt's KV cache: what a prefill instance ships to a decode instance."""
    return model.kv_bytes(prompt_tokens)


def transfer_s(model: ModelSpec, link: Link, prompt_tokens: int) -> float:
    """Setup plus wire time to move a prompt's whole KV cache, with no overlap."""
    return link.transfer_s(kv_bytes_per_request(model, prompt_tokens))


def exposed_transfer_s(
    wire_s: float, prefill_s: float, layers: int, setup_s: float = 0.0, layerwise: bool = True
) -> float:
    """Transfer time left on the critical path after prefill ends.

    Without overlap the whole transfer is exposed. With layer-wise push, layer i's KV (1/L of it) leaves as soon as
    layer i is computed, on one serial link: the last byte lands at prefill end + wire/L when the link keeps up, or
    at prefill start + prefill/L + wire when it is the bottleneck, i.e. exposed = max(wire/L, wire - prefill*(L-1)/L).
    The per-transfer setup is never hidden.
    """
    if not layerwise or layers <= 1:
        return setup_s + wire_s
    return setup_s + max(wire_s / layers, wire_s - prefill_s * (layers - 1) / layers)


def prefill_share(r: float, rp_over_rd: float) -> float:
    """Throughput-balanced share of GPUs for prefill: r / (r + R_p/R_d), with r = P/O.

    A request costs a = P/R_p prefill GPU-seconds and b = O/R_d decode GPU-seconds; pools sized a : b finish their
    halves at the same rate, and a / (a + b) = r / (r + R_p/R_d).
    """
    if r < 0 or rp_over_rd <= 0:
        raise ValueError("r must be >= 0 and R_p/R_d > 0")
    return r / (r + rp_over_rd)


def break_even_prompt_tokens(
    setup_s: float, prefill_s_per_token: float, wire_s_per_token: float, layers: int = 1
) -> float:
    """Prompt length below which moving the KV costs more time than prefilling locally on the decode instance.

    Definition: transferring a P-token prompt puts setup + exposed_transfer(P) on the request's critical path;
    prefilling it on the decode instance instead costs P x prefill_s_per_token of decode-instance compute, a stall
    every co-running decode stream sees. Break-even is the P where the two are equal. Both sides are linear in P
    (``exposed_transfer_s`` is), so P* = setup / (prefill_per_token - exposed_per_token); ``inf`` when the transfer
    per token is not cheaper than the prefill per token (transfer never pays), 0 with no setup cost.
    """
    return BreakEven.of(setup_s, 0.0, 0.0, prefill_s_per_token, wire_s_per_token, layers).tokens


@dataclass(frozen=True)
class BreakEven:
    """The terms of the transfer-or-recompute break-even, each one a number a deployment can measure.

    Fixed per transfer (paid whatever the prompt length): the link's setup, the transfer engine's control round
    trips and the proxy's extra hop. Per prompt token: the prefill the transfer avoids on the decode instance, and the
    transfer tail left exposed after prefill ends (with layer-wise push, max(wire/L, wire - prefill x (L-1)/L)).
    """

    link_setup_s: float
    engine_fixed_s: float
    proxy_hop_s: float
    prefill_s_per_token: float
    exposed_s_per_token: float
    at_tokens: int = 0  # the prompt length the per-token terms are priced at (0: not one length)

    @classmethod
    def of(
        cls,
        link_setup_s: float,
        engine_fixed_s: float,
        proxy_hop_s: float,
        prefill_s_per_token: float,
        wire_s_per_token: float,
        layers: int = 1,
    ) -> BreakEven:
        exposed = exposed_transfer_s(wire_s_per_token, prefill_s_per_token, layers, 0.0, layers > 1)
        return cls(link_setup_s, engine_fixed_s, proxy_hop_s, prefill_s_per_token, exposed)

    @property
    def fixed_s(self) -> float:
        return self.link_setup_s + self.engine_fixed_s + self.proxy_hop_s

    @property
    def tokens(self) -> float:
        """fixed / (prefill avoided - tail exposed) per token; ``inf`` when a token's transfer is not cheaper."""
        margin = self.prefill_s_per_token - self.exposed_s_per_token
        if margin <= 0:
            return math.inf
        return self.fixed_s / margin


# How far the break-even search looks for a model whose context window is not known.
BREAK_EVEN_SEARCH_TOKENS = 1 << 20


def break_even_search(priced_at: Callable[[int], BreakEven], limit: int) -> tuple[BreakEven, bool]:
    """(terms, found): the terms at the shortest prompt length P where a transfer wins (P x margin(P) >= fixed),
    found by doubling then bisection up to ``limit`` tokens; the terms at ``limit`` and False when it wins nowhere
    below. The prefill avoided per token grows with P (attention), and with layer-wise push so does the
    hidden share of the wire, so a margin negative at short prompts can turn positive at long ones: a fixed point of
    P = fixed / margin(P) from one starting length misses that crossing (it read "never" on slow links)."""

    def wins(terms: BreakEven) -> bool:
        margin = terms.prefill_s_per_token - terms.exposed_s_per_token
        return margin > 0 and terms.at_tokens * margin >= terms.fixed_s

    first = priced_at(1)
    if wins(first):
        return first, True
    lo, hi = 1, 2
    while hi < limit and not wins(priced_at(hi)):
        lo, hi = hi, hi * 2
    hi = min(hi, limit)
    found = priced_at(hi)
    if not wins(found):
        return found, False
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if wins(priced_at(mid)):
            hi = mid
        else:
            lo = mid
    return priced_at(hi), True


def prefill_rate(cost: StepModel, prompt_tokens: int, max_batched_tokens: int = 8192) -> float:
    """Prompt tokens/s of one instance that batches whole prompts up to ``max_batched_tokens`` per iteration."""
    count = max(1, max_batched_tokens // max(prompt_tokens, 1))
    return count * prompt_tokens / cost.step_s(BatchShape.prefill(prompt_tokens, count=count))


@dataclass(frozen=True)
class DecodePoint:
    """The decode operating point: the largest batch whose step meets the TPOT SLO and whose KV fits."""

    batch: int
    step_s: float
    tokens_per_s: float
    meets_slo: bool
    # what capped the batch: "the TPOT SLO", "KV memory" (the batch's KV fills the cache) or "max_num_seqs"
    bound: str = "the TPOT SLO"


def decode_rate(
    cost: StepModel, prompt_tokens: int, output_tokens: int, tpot_slo_s: float, max_num_seqs: int = 256
) -> DecodePoint:
    """Output tokens/s of one decode instance at its best batch under the TPOT SLO.

    Sequences are taken at their mean context (P + O/2). Larger batches amortise the weight read (more tokens/s)
    but lengthen the step (TPOT), so the SLO, memory, or ``max_num_seqs`` caps the batch.
    """
    context = prompt_tokens + output_tokens // 2
    cap = cost.kv_capacity_tokens
    fits = None if cap is None else cap // max(prompt_tokens + output_tokens, 1)
    limit = max_num_seqs if fits is None else max(1, min(max_num_seqs, fits))
    bound = "max_num_seqs" if fits is None or fits >= max_num_seqs else "KV memory"
    best: DecodePoint | None = None
    for batch in range(1, limit + 1):
        step = cost.step_s(BatchShape.decode(batch, context))
        if step > tpot_slo_s and best is not None:
            break
        best = DecodePoint(batch, step, batch / step, step <= tpot_slo_s, bound)
        if not best.meets_slo:
            break
    assert best is not None
    if best.batch < limit:
        best = dataclasses.replace(best, bound="the TPOT SLO")
    return best


def instances_for(rate: float, work_per_request: float, instance_rate: float, max_util: float) -> int:
    """Instances that keep utilisation under ``max_util`` (headroom against queueing) at ``rate`` requests/s."""
    if rate <= 0:
        return 0
    return max(1, math.ceil(rate * work_per_request / (instance_rate * max_util) - 1e-9))


def best_split(
    instances: int, rp: float, rd: float, prompt: int, output: int, wire_s: float = 0.0
) -> tuple[int, int, float]:
    """The prefill:decode split of ``instances`` (>= 1 each) that sustains the highest request rate; a prefill
    instance's link carries one request's KV per ``wire_s``."""
    if instances < 2:
        raise ValueError("a disaggregated deployment needs at least 2 instances")
    best = (1, instances - 1, 0.0)
    for n_p in range(1, instances):
        n_d = instances - n_p
        rate = min(n_p * rp / max(prompt, 1), n_d * rd / max(output, 1))
        if wire_s > 0:
            rate = min(rate, n_p / wire_s)
        if rate > best[2]:
            best = (n_p, n_d, rate)
    return best


# What plan --json's rates and sizes are counted per: the key names alone do not say.
PLAN_UNITS = {
    "prefill_tokens_per_s": "prompt tokens/s per GPU (one instance's rate / tp)",
    "decode_tokens_per_s": "output tokens/s per GPU (one instance's rate / tp)",
    "kv_capacity_tokens": "KV tokens per instance (all its tp GPUs)",
    "kv_bytes_per_token": "bytes per token per instance (kv_copies copies over its ranks)",
    "kv_bytes_per_request": "bytes per request (the prompt's KV shipped)",
    "decode_batch": "sequences per decode instance",
    "budget_max_rate": "requests/s of the whole budget split",
    "n_prefill": "instances of tp GPUs",
    "n_decode": "instances of tp GPUs",
    "n_colocated": "instances of tp GPUs",
}


@dataclass(frozen=True)
class PoolPlan:
    """A plan's numbers; rates are per GPU unless named ``*_instance``."""

    model: str
    params: float
    weight_bytes: float
    source: str  # "roofline" or the profile's origin
    gpu: str
    tp: int
    link: str
    prompt_tokens: int
    output_tokens: int
    r: float
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    transfer_s: float
    exposed_transfer_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_batch: int
    decode_step_s: float
    decode_meets_slo: bool
    decode_bound: str  # what capped the decode batch (see DecodePoint.bound)
    rp_over_rd: float
    prefill_share: float
    break_even_prompt_tokens: float
    target_rate: float
    n_prefill: int
    n_decode: int
    n_colocated: int
    tpot_slo_s: float
    max_util: float
    budget_instances: int = 0
    budget_split: tuple[int, int] = (0, 0)
    budget_max_rate: float = 0.0
    break_even_terms: BreakEven | None = None
    break_even_search_tokens: int = 0  # the longest prompt the break-even search tried (inf: no win up to it)
    kv_capacity_tokens: int | None = None  # one instance's KV cache (None: not known)
    kv_copies: int = 1  # the instance's ranks hold each token's KV this many times (ModelSpec.at_tp)
    prefill_bound: str = "compute"  # what sizes the prefill pool at the target rate: "compute" or "link"
    # what makes the numbers above not a deployment that works as planned (empty: nothing)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields, plus ``units``: what each rate and capacity is counted per (GPU, instance or request)."""
        d = asdict(self)
        d["units"] = PLAN_UNITS
        if math.isinf(self.break_even_prompt_tokens):
            d["break_even_prompt_tokens"] = None
        if self.break_even_terms is not None:
            d["break_even_terms"]["fixed_s"] = self.break_even_terms.fixed_s
        return d


def make_plan(
    model: ModelSpec,
    cost: StepModel,
    link: Link,
    prompt_tokens: int,
    output_tokens: int,
    *,
    tp: int = 1,
    gpu_name: str = "",
    source: str = "roofline",
    tpot_slo_s: float = 0.05,
    target_rate: float = 0.0,
    max_util: float = 0.8,
    max_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    budget_gpus: int = 0,
    layerwise: bool = True,
    engine_fixed_s: float = MEASURED_ENGINE_FIXED_S,
    proxy_hop_s: float = MEASURED_PROXY_HOP_S,
) -> PoolPlan:
    """Everything the pool-sizing question needs, for one workload shape (P input, O output tokens)."""
    if prompt_tokens <= 0 or output_tokens <= 0:
        raise ValueError("prompt and output tokens must be positive")
    context = model.max_model_len
    if context and prompt_tokens > context:
        raise ValueError(
            f"a {prompt_tokens:,}-token prompt is longer than {model.name}'s context window of {context:,} tokens "
            "(its max_position_embeddings): vLLM refuses it; use a shorter --prompt, or --max-model-len where the "
            "deployment runs a longer context"
        )
    rp_inst = prefill_rate(cost, prompt_tokens, max_batched_tokens)
    dp = decode_rate(cost, prompt_tokens, output_tokens, tpot_slo_s, max_num_seqs)
    rd_inst = dp.tokens_per_s
    nbytes = kv_bytes_per_request(model, prompt_tokens)
    wire = link.wire_s(nbytes)
    fixed = link.setup_s + engine_fixed_s
    exposed = exposed_transfer_s(wire, prompt_tokens / rp_inst, model.num_layers, fixed, layerwise)
    r = prompt_tokens / output_tokens
    ratio = rp_inst / rd_inst

    def terms_at(prefill_s_per_token: float) -> BreakEven:
        return BreakEven.of(
            link.setup_s,
            engine_fixed_s,
            proxy_hop_s,
            prefill_s_per_token,
            link.wire_s(model.kv_bytes_per_token),
            model.num_layers if layerwise else 1,
        )

    def priced_at(tokens: int) -> BreakEven:
        per_token = 1.0 / prefill_rate(cost, tokens, max_batched_tokens)
        return dataclasses.replace(terms_at(per_token), at_tokens=tokens)

    search_limit = model.max_model_len or max(prompt_tokens, BREAK_EVEN_SEARCH_TOKENS)
    terms, found = break_even_search(priced_at, search_limit)
    n_p = instances_for(target_rate, prompt_tokens, rp_inst, max_util)
    # each prefill instance's link carries its requests' KV: on a slow link that, not compute, sizes the pool
    n_link = instances_for(target_rate, wire, 1.0, max_util)
    bound = "link" if n_link > n_p else "compute"
    n_p = max(n_p, n_link)
    n_d = instances_for(target_rate, output_tokens, rd_inst, max_util)
    n_c = instances_for(target_rate, 1.0, 1.0 / (prompt_tokens / rp_inst + output_tokens / rd_inst), max_util)
    budget = budget_gpus // tp if budget_gpus else 0
    split, max_rate = (0, 0), 0.0
    if budget >= 2:
        n_bp, n_bd, max_rate = best_split(budget, rp_inst, rd_inst, prompt_tokens, output_tokens, wire)
        split = (n_bp, n_bd)
    warnings: list[str] = []
    cap = cost.kv_capacity_tokens
    if cap is not None and cap < prompt_tokens + output_tokens:
        warnings.append(
            f"one request ({prompt_tokens + output_tokens:,} tokens) does not fit an instance's KV cache "
            f"({cap:,} tokens): vLLM would refuse it; use more GPUs per instance (--tp) or shorter requests"
        )
    if context and prompt_tokens + output_tokens > context:
        warnings.append(
            f"a request ({prompt_tokens:,} + {output_tokens:,} tokens) runs past {model.name}'s context window of "
            f"{context:,} tokens: vLLM refuses a request whose max_tokens would, or stops its output there"
        )
    if not dp.meets_slo:
        warnings.append(
            f"no decode batch meets the TPOT SLO ({tpot_slo_s * 1e3:g} ms; batch 1 steps "
            f"{dp.step_s * 1e3:.1f} ms): the decode counts size for batch 1 and still miss it"
        )
    if budget_gpus and budget < 2:
        warnings.append(
            f"a budget of {budget_gpus} GPUs is {budget} instance(s) of {tp} GPUs: a prefill/decode split needs 2"
        )
    return PoolPlan(
        model=model.name,
        params=model.params,
        weight_bytes=model.weight_bytes,
        source=source,
        gpu=gpu_name,
        tp=tp,
        link=link.name,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        r=r,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_copies=model.kv_copies,
        kv_bytes_per_request=nbytes,
        transfer_s=link.transfer_s(nbytes) + engine_fixed_s,
        exposed_transfer_s=exposed,
        prefill_tokens_per_s=rp_inst / tp,
        decode_tokens_per_s=rd_inst / tp,
        decode_batch=dp.batch,
        decode_step_s=dp.step_s,
        decode_meets_slo=dp.meets_slo,
        decode_bound=dp.bound,
        rp_over_rd=ratio,
        prefill_share=prefill_share(r, ratio),
        break_even_prompt_tokens=terms.tokens if found else math.inf,
        break_even_search_tokens=search_limit,
        target_rate=target_rate,
        n_prefill=n_p,
        n_decode=n_d,
        n_colocated=n_c,
        tpot_slo_s=tpot_slo_s,
        max_util=max_util,
        budget_instances=budget,
        budget_split=split,
        budget_max_rate=max_rate,
        break_even_terms=terms,
        kv_capacity_tokens=cap,
        prefill_bound=bound,
        warnings=tuple(warnings),
    )
