"""Model geometry the planner needs: KV bytes per token, weight bytes, and FLOPs per token.

Built from an HF ``config.json`` dict (dense GQA, MLA and MoE configs) or from explicit numbers. The KV formula for
GQA is shared with the connector (``vllm_disagg.kv_layout.kv_bytes_per_token``) so the planner and the wire agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_disagg.kv_layout import DTYPE_BYTES, kv_bytes_per_token


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``bfloat16``, ``bf16``, ``fp8``, ...)."""
    key = dtype.lower().removeprefix("torch.")
    key = _FP8_FORMATS.get(key, key)
    if key not in DTYPE_BYTES:
        known = sorted([*DTYPE_BYTES, *_FP8_FORMATS])
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(known)}")
    return DTYPE_BYTES[key]


# vLLM's --kv-cache-dtype (and torch's) names of the 8-bit float formats: one byte each, as "fp8"
_FP8_FORMATS = {
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


@dataclass(frozen=True)
class ModelSpec:
    """What a model costs to hold, read and run, per token.

    ``params`` counts all weights (they must fit in memory); ``active_params`` is what one token multiplies through
    (equal for dense models, much smaller for MoE). ``expert_params`` is the routed-expert part of ``params``: a
    decode step reads only the experts its batch touches. ``embed_params`` is a separate input embedding table (a
    lookup: no FLOPs, and only the looked-up rows are read; 0 when tied to the LM head) and ``lm_head_params`` the
    output projection, which vLLM applies once per sequence per step (the last position), not to every prompt token. ``mla_latent_dim`` set means the cache holds one latent
    vector per layer and token (DeepSeek MLA: ``kv_lora_rank + qk_rope_head_dim``) instead of K and V per KV head.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    params: float
    dtype: str = "bfloat16"
    kv_dtype: str | None = None  # KV-cache dtype when it differs from the weights (e.g. fp8 cache)
    active_params: float | None = None
    attn_dim: int = 0  # query heads x head dim, for the attention FLOPs (0: num_kv_heads * head_dim)
    num_heads: int = 0  # query (attention) heads, which tensor parallelism must divide (0: not known)
    max_model_len: int = 0  # the context window in tokens, prompt and output together (0: not known)
    mla_latent_dim: int | None = None
    expert_params: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    embed_params: float = 0.0
    lm_head_params: float = 0.0
    # instance-wide copies of each token's KV under tensor parallelism: vLLM shards KV heads over the ranks, and a
    # rank keeps one whole head when there are more ranks than heads; an MLA latent is held whole by every rank
    kv_copies: int = 1

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_copies) <= 0 or self.params <= 0:
            raise ValueError(f"model {self.name!r}: layers, KV heads, head dim and params must be positive")
        dtype_bytes(self.dtype)
        dtype_bytes(self.kv_dtype or self.dtype)
        if self.body_params <= 0:
            raise ValueError(f"model {self.name!r}: embedding and LM head leave no parameters for the layers")

    @property
    def weight_dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def kv_dtype_bytes(self) -> int:
        """The cache's element size. Without an explicit KV dtype vLLM (``--kv-cache-dtype auto``) keeps the cache in
        the activations' type, which for 8-bit quantized weights is BF16, not the weights' 8 bits."""
        if self.kv_dtype:
            return dtype_bytes(self.kv_dtype)
        return max(self.weight_dtype_bytes, 2)

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV over the whole instance. GQA: 2 x layers x KV heads x head dim x bytes. MLA: layers x
        latent x bytes (no separate K and V). Times ``kv_copies`` (see ``at_tp``)."""
        if self.mla_latent_dim:
            return self.num_layers * self.mla_latent_dim * self.kv_dtype_bytes * self.kv_copies
        per_copy = kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes)
        return per_copy * self.kv_copies

    def at_tp(self, tp: int) -> ModelSpec:
        """The model as an instance of ``tp`` ranks stores it: MLA's latent cache on every rank (``tp`` copies);
        GQA's KV heads split over the ranks, each rank keeping at least one, so ``tp`` ranks over fewer heads
        replicate them ``tp / heads`` times. That is memory, bandwidth per decode step and bytes on the wire."""
        if tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, not {tp}")
        problem = self._tp_problem(tp)
        if problem:
            valid = ", ".join(str(t) for t in self.valid_tps())
            raise ValueError(f"model {self.name!r}: {problem}; pick another --tp (valid: {valid})")
        if self.mla_latent_dim:
            copies = tp
        elif tp > self.num_kv_heads:
            copies = tp // self.num_kv_heads
        else:
            copies = 1
        return replace(self, kv_copies=copies)

    def _tp_problem(self, tp: int) -> str:
        """Why vLLM refuses ``tp`` ranks for this model ("" if it does not): the query heads must split evenly over
        the ranks, and the KV heads too, or the ranks evenly over the KV heads (each keeping a whole one)."""
        if self.num_heads and self.num_heads % tp:
            return f"{self.num_heads} attention heads do not split over {tp} ranks"
        if self.mla_latent_dim:
            return ""
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            return f"{tp} ranks over {self.num_kv_heads} KV heads: vLLM needs one to divide the other"
        if tp <= self.num_kv_heads and self.num_kv_heads % tp:
            return f"{self.num_kv_heads} KV heads do not split over {tp} ranks"
        return ""

    def valid_tps(self) -> list[int]:
        """The tensor-parallel sizes vLLM accepts for this model, up to its query heads (or 64 if not known)."""
        top = self.num_heads or max(64, self.num_kv_heads)
        return [t for t in range(1, top + 1) if not self._tp_problem(t)]

    def kv_bytes(self, tokens: int) -> int:
        """KV cache of one sequence of ``tokens`` tokens (what a prefill instance ships for that prompt)."""
        return self.kv_bytes_per_token * tokens

    @property
    def active(self) -> float:
        return self.active_params if self.active_params is not None else self.params

    @property
    def body_params(self) -> float:
        """Parameters every token multiplies through: the active ones less the embedding table and the LM head."""
        return self.active - self.embed_params - self.lm_head_params

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_dtype_bytes

    def forward_flops(self, tokens: int, seqs: int, attn_pairs: float) -> float:
        """FLOPs of one forward pass over ``tokens`` new tokens of ``seqs`` sequences.

        2 x body params per token (the layers' matmuls), 2 x LM head per sequence (logits at its last position
        only), and attention's QK^T and AV: 2 x 2 x layers x attention dim per query-key pair (``attn_pairs``: a
        chunk of n tokens after s computed ones has n x (s + n/2); a decode token has its context). The embedding
        lookup costs none.
        """
        return (
            2.0 * self.body_params * tokens
            + 2.0 * self.lm_head_params * seqs
            + 4.0 * self.num_layers * self.attention_dim * attn_pairs
        )

    @property
    def attention_dim(self) -> int:
        return self.attn_dim or self.num_kv_heads * self.head_dim

    def weight_bytes_read(self, batch_tokens: int) -> float:
        """Weight bytes one forward pass over ``batch_tokens`` tokens reads from memory.

        Dense: all of them. MoE: the dense part plus the experts the batch touches; with top-k of E experts picked
        independently per token, a given expert is missed by all n tokens with probability (1 - k/E)^n.
        """
        read = self.params - self.embed_params  # the embedding table: only the looked-up rows
        if not self.expert_params or not self.num_experts or not self.experts_per_token:
            return read * self.weight_dtype_bytes
        touched = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(batch_tokens, 1)
        return (read - self.expert_params * (1.0 - touched)) * self.weight_dtype_bytes

    def with_overrides(self, **changes: Any) -> ModelSpec:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def with_params(self, params: float | None = None, active: float | None = None) -> ModelSpec:
        """The model with another total and/or active parameter count.

        A new total alone changes what must be held, not what a token multiplies through: a dense model's active
        count follows it (they are one number), an MoE keeps its active count and the difference goes to the routed
        experts (the part of the total a token does not use), so its dense share and FLOPs per token stay.
        """
        if params is None and active is None:
            return self
        total = self.params if params is None else params
        if self.active_params is None and active is None:  # dense: active is the total
            return replace(self, params=total)
        new_active = self.active if active is None else active
        if new_active > total:
            raise ValueError(
                f"model {self.name!r}: {new_active / 1e9:.2f}B active parameters exceed the {total / 1e9:.2f}B total; "
                "raise --params or lower --active-params"
            )
        experts = self.expert_params + (total - self.params) if self.expert_params else 0.0
        return replace(self, params=total, active_params=new_active, expert_params=max(experts, 0.0))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "", dtype: str | None = None) -> ModelSpec:
        """Read the geometry from an HF ``config.json`` dict; parameter counts are estimated from the shapes.

        The estimate counts embeddings, attention and MLP matrices and ignores norms and biases (<0.1%): Llama-3-8B
        comes out at 8.03e9. Multimodal configs are read from their ``text_config``.
        """
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k == "torch_dtype"}}
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}: not an HF config.json?")
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        vocab = int(cfg.get("vocab_size", 0))
        context = context_window(cfg)
        dt = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")

        mla_latent: int | None = None
        if cfg.get("kv_lora_rank"):
            rank, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 0))
            nope, v_dim = int(cfg.get("qk_nope_head_dim", head_dim)), int(cfg.get("v_head_dim", head_dim))
            q_rank = cfg.get("q_lora_rank")
            q = (
                hidden * heads * (nope + rope)
                if not q_rank
                else hidden * q_rank + q_rank * heads * (nope + rope)
            )
            attn = q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden
            mla_latent = rank + rope
            attn_dim = heads * (nope + rope)
        else:
            attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
            attn_dim = heads * head_dim

        inter = int(cfg.get("intermediate_size", 4 * hidden))
        n_experts = int(
            cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        )
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        dense_layers = layers
        expert_total = expert_active = 0.0
        if n_experts and top_k:
            moe_inter = int(cfg.get("moe_intermediate_size") or inter)
            shared = int(cfg.get("n_shared_experts") or 0) * 3 * hidden * moe_inter
            shared += 3 * hidden * int(cfg.get("shared_expert_intermediate_size") or 0)
            dense_layers = int(cfg.get("first_k_dense_replace") or 0)
            moe_layers = layers - dense_layers
            per_expert = 3 * hidden * moe_inter
            expert_total = moe_layers * n_experts * per_expert
            expert_active = moe_layers * top_k * per_expert
            router = moe_layers * (hidden * n_experts + shared)
        else:
            router = 0
        tied = bool(cfg.get("tie_word_embeddings"))
        head = vocab * hidden
        embed = 0 if tied else vocab * hidden
        common = embed + head + layers * attn + dense_layers * 3 * hidden * inter + router
        return cls(
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            params=float(common + expert_total),
            active_params=float(common + expert_active) if expert_total else None,
            dtype=dt,
            attn_dim=attn_dim,
            num_heads=heads,
            max_model_len=context,
            mla_latent_dim=mla_latent,
            expert_params=float(expert_total),
            num_experts=n_experts if expert_total else 0,
            experts_per_token=top_k if expert_total else 0,
            embed_params=float(embed),
            lm_head_params=float(head),
        )

    @classmethod
    def from_hf_config_file(cls, path: str | Path, name: str = "", dtype: str | None = None) -> ModelSpec:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: not a JSON config ({exc}); give --hf-config an HF config.json") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{p}: not a JSON object; give --hf-config an HF config.json")
        return cls.from_hf_config(cfg, name=name or p.parent.name, dtype=dtype)


# The config keys vLLM reads a context window from; it takes the smallest present.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def context_window(cfg: dict[str, Any]) -> int:
    """The context window vLLM derives from a config (its default ``--max-model-len``); 0 if the config has none.

    The smallest of the length keys present, times a rope-scaling factor (YaRN from its original length), except
    for the rope types whose configs already state the extended length (su, longrope, llama3).
    """
    lengths = [int(cfg[k]) for k in _CONTEXT_KEYS if isinstance(cfg.get(k), (int, float)) and cfg[k] > 0]
    if not lengths:
        return 0
    length = min(lengths)
    rope = cfg.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("factor"), (int, float)):
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in ("su", "longrope", "llama3"):
            if kind == "yarn" and "original_max_position_embeddings" in rope:
                length = int(rope["original_max_position_embeddings"])
            length = int(length * rope["factor"])
    return length


def _llama(
    layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, context: int
) -> dict[str, Any]:
    return {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "torch_dtype": "bfloat16",
    }


# Public configs (shapes and context windows, as their config.json files publish them), so the planner works
# offline without a model download.
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "qwen3-8b": {**_llama(36, 4096, 32, 8, 12288, 151936, 40960), "head_dim": 128},
    "deepseek-v3": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
    },
}


def preset_model(name: str, dtype: str | None = None) -> ModelSpec:
    key = name.lower()
    if key not in PRESET_CONFIGS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESET_CONFIGS)}")
    return ModelSpec.from_hf_config(PRESET_CONFIGS[key], name=key, dtype=dtype)
