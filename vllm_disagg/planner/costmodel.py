"""How long one engine iteration takes, from a roofline or from a measured profile.

The simulator and the planner both ask a ``StepModel`` for the duration of a batch shape, so roofline estimates
and measurements are interchangeable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vllm_disagg.planner.hardware import InstanceSpec
from vllm_disagg.planner.model import ModelSpec
from vllm_disagg.planner.profiledata import Profile


@dataclass(frozen=True)
class BatchShape:
    """The work in one iteration.

    ``prefill_attn_pairs`` is the causal attention's query-key pairs of the prefill chunks: a chunk of ``n`` new
    tokens after ``s`` already-computed ones attends n*(s + n/2) pairs. ``prefill_ctx_tokens`` are the earlier prompt
    tokens whose KV the chunks read (sum of ``s``); ``decode_ctx_tokens`` the KV tokens the decoding sequences read;
    ``prefill_seqs`` the number of prefill chunks (each computes logits at its last position, as vLLM does).
    """

    prefill_tokens: int = 0
    prefill_attn_pairs: float = 0.0
    prefill_ctx_tokens: int = 0
    decode_seqs: int = 0
    decode_ctx_tokens: int = 0
    prefill_seqs: int = 0

    @classmethod
    def prefill(cls, prompt: int, start: int = 0, count: int = 1) -> BatchShape:
        """``count`` chunks of ``prompt - start`` tokens each, after ``start`` computed tokens."""
        n = prompt - start
        return cls(count * n, count * n * (start + n / 2), count * start, 0, 0, count)

    @classmethod
    def decode(cls, seqs: int, context: int) -> BatchShape:
        """``seqs`` sequences of ``context`` tokens each, one new token each."""
        return cls(0, 0.0, 0, seqs, seqs * context)


class StepModel(Protocol):
    @property
    def kv_capacity_tokens(self) -> int | None: ...

    def step_s(self, batch: BatchShape) -> float: ...


@dataclass(frozen=True)
class RooflineCost:
    """Iteration time = max(compute, memory) + overhead, for one instance of ``tp`` GPUs.

    compute = ``ModelSpec.forward_flops`` (layers per token, LM head per sequence, attention per query-key pair) /
              (peak FLOP/s x eff_compute x tp)
    memory  = [weight bytes read + KV bytes per token x (decode context + prefill context + new tokens)] /
              (HBM bytes/s x eff_mem x tp)

    A pure prefill of P tokens is compute-bound (~2 x layer params x P FLOPs); a decode step of B sequences is
    memory-bound (weights + B x context x KV bytes). A mixed batch pays the larger of the two, which is why
    piggy-backed prefill lengthens the decode steps it shares.
    """

    model: ModelSpec
    instance: InstanceSpec
    kv_capacity_override: int | None = (
        None  # a measured or configured KV capacity (tokens) instead of the estimate
    )

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV memory on "
                f"{self.instance.tp} x {self.instance.gpu.name}; raise --tp"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit in the memory the weights leave free (or the override)."""
        if self.kv_capacity_override is not None:
            return self.kv_capacity_override
        free = self.instance.usable_mem_bytes - self.model.weight_bytes
        return int(free // self.model.kv_bytes_per_token)

    def compute_s(self, batch: BatchShape) -> float:
        tokens = batch.prefill_tokens + batch.decode_seqs
        seqs = batch.prefill_seqs + batch.decode_seqs
        attn_pairs = batch.prefill_attn_pairs + batch.decode_ctx_tokens
        return self.model.forward_flops(tokens, seqs, attn_pairs) / self.instance.flops

    def memory_s(self, batch: BatchShape) -> float:
        m = self.model
        tokens = batch.prefill_tokens + batch.decode_seqs
        kv_tokens = batch.decode_ctx_tokens + batch.prefill_ctx_tokens + tokens
        return (m.weight_bytes_read(tokens) + m.kv_bytes_per_token * kv_tokens) / self.instance.bandwidth

    def step_s(self, batch: BatchShape) -> float:
        if batch.prefill_tokens + batch.decode_seqs == 0:
            return 0.0
        return max(self.compute_s(batch), self.memory_s(batch)) + self.instance.step_overhead_s


@dataclass(frozen=True)
class ProfileCost:
    """Iteration time from measurements: the decode step at this batch plus the prefill tokens at the measured rate
    plus, where the profile measured them, attention's cost per query-key pair of the prefill chunks and per
    context token the decoding streams read beyond the batch curve's context.

    A prefill-only iteration costs one batch-1 step (the weight pass) plus its tokens. Adding the two parts of a
    mixed batch is conservative: on hardware, prefill tokens partly hide under the decode step's memory time.
    """

    profile: Profile
    kv_capacity_override: int | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self.kv_capacity_override or self.profile.kv_capacity_tokens

    def step_s(self, batch: BatchShape) -> float:
        if batch.prefill_tokens + batch.decode_seqs == 0:
            return 0.0
        prof = self.profile
        base = prof.decode_step_s(max(batch.decode_seqs, 1))
        attention = batch.prefill_attn_pairs * prof.prefill_s_per_pair
        # the streams' context beyond what the batch curve was measured at (where the profile measured its cost)
        longer = batch.decode_ctx_tokens - batch.decode_seqs * prof.decode_context_tokens
        if longer > 0 and batch.decode_seqs:
            attention += longer * prof.decode_s_per_kv_token
        return base + batch.prefill_tokens / prof.prefill_tokens_per_s + attention
