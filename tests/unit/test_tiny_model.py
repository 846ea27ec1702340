from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vllm_disagg.tools.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", TinyLlamaSpec(seed=3))
    b = write_tiny_model(tmp_path / "b", TinyLlamaSpec(seed=3))
    c = write_tiny_model(tmp_path / "c", TinyLlamaSpec(seed=4))
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert is_tiny_model(a, TinyLlamaSpec(seed=3))
    assert not is_tiny_model(a, TinyLlamaSpec(seed=4))


def test_geometry_is_gqa_llama(tiny_model: str) -> None:
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"] >= 1
    assert cfg["num_hidden_layers"] >= 2
    assert 1024 <= cfg["vocab_size"] <= 4096


def test_autotokenizer_loads_offline_and_roundtrips(tiny_model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "def main():\n    return 'Hello, world'"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok) <= json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("assistant:")
