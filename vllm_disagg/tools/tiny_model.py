"""Write a tiny random-weight Llama plus an offline-trained tokenizer.

There is no model hub on CI machines, so the project makes its own model: small enough to start in seconds on one
CPU core, yet a real ``LlamaForCausalLM`` with GQA (more query heads than KV heads), several layers and a BPE
tokenizer, so vLLM, transformers and the KV connector exercise the same code paths as with a production model.

No torch here: weights are drawn with numpy and written with safetensors, so the generator is byte-for-byte
deterministic for a seed and runs on the proxy's CPU-only nodes too.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

#: Files from the Python standard library used as the tokenizer's training text. A fixed list so the vocabulary
#: does not depend on which other files happen to be installed.
_CORPUS_MODULES = (
    "this.py",
    "textwrap.py",
    "argparse.py",
    "difflib.py",
    "json/__init__.py",
    "json/decoder.py",
    "http/client.py",
    "http/server.py",
    "email/message.py",
    "string.py",
    "calendar.py",
    "configparser.py",
    "logging/__init__.py",
    "pathlib.py",
    "shutil.py",
    "statistics.py",
    "tarfile.py",
    "unittest/case.py",
    "urllib/parse.py",
    "zipfile.py",
)

_EXTRA_TEXT = """\
The quick brown fox jumps over the lazy dog. Prefill is compute-bound and decode is bandwidth-bound.
Hello, how are you today? Tell me a story about a cache that moved between two machines.
user: What is the capital of France? assistant: Paris is the capital of France.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Geometry of the tiny model. Defaults: ~1.1 M parameters, KV = 2*4*2*32*4 B = 2 KiB/token in fp32."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    initializer_range: float = 0.5
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [_EXTRA_TEXT]
    for rel in _CORPUS_MODULES:
        path = stdlib / rel
        if path.exists():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def _train_tokenizer(spec: TinyLlamaSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": spec.max_position_embeddings,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    )


def _weights(spec: TinyLlamaSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * spec.initializer_range).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_out, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_out, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_out, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, q_out)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, inter)
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = normal(spec.vocab_size, h)
    return tensors


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_model(out_dir: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write config, safetensors weights and tokenizer into ``out_dir``; returns the directory.

    Idempotent: the files depend only on ``spec`` (seed included) and the Python standard library's text.
    """
    from safetensors.numpy import save_file

    spec = spec or TinyLlamaSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(spec, out)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": spec.initializer_range,
        "torch_dtype": "float32",
        "bos_token_id": SPECIAL_TOKENS.index("<s>"),
        "eos_token_id": SPECIAL_TOKENS.index("</s>"),
        "pad_token_id": SPECIAL_TOKENS.index("<pad>"),
    }
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False},
    )
    save_file(_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "vllm_disagg_tiny_model.json", asdict(spec))
    return out


def is_tiny_model(path: str | Path, spec: TinyLlamaSpec | None = None) -> bool:
    """True when ``path`` already holds a tiny model written with ``spec`` (so set-up can skip regenerating it)."""
    marker = Path(path) / "vllm_disagg_tiny_model.json"
    if not marker.exists() or not (Path(path) / "model.safetensors").exists():
        return False
    return bool(json.loads(marker.read_text()) == asdict(spec or TinyLlamaSpec()))


def write_tiny_lora(
    out_dir: str | Path, base: str | Path, spec: TinyLlamaSpec | None = None, rank: int = 4
) -> Path:
    """A LoRA adapter for the tiny model in PEFT's format (q_proj and v_proj of every layer, seeded random
    weights, so its answers differ from the base model's), for tests of LoRA serving and routing."""
    from safetensors.numpy import save_file

    spec = spec or TinyLlamaSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed + 1)
    outs = {
        "q_proj": spec.num_attention_heads * spec.head_dim,
        "v_proj": spec.num_key_value_heads * spec.head_dim,
    }
    tensors: dict[str, np.ndarray] = {}
    for layer in range(spec.num_hidden_layers):
        for proj, width in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.5, (rank, spec.hidden_size)).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.5, (width, rank)).astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(
        out / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base),
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "target_modules": sorted(outs),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
        },
    )
    return out
