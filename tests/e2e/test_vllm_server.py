"""A real vLLM CPU server on the tiny model: deterministic greedy output that equals transformers' reference."""

from __future__ import annotations

import httpx
import pytest

from vllm_disagg.tools.harness import VLLMServer

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Hello, how are you",
    "def main():\n    return",
    "The quick brown fox jumps over the lazy dog. " * 8,
]


def _complete(
    server: VLLMServer, model: str, prompt: str, max_tokens: int = 16
) -> tuple[list[int], list[int]]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def _hf_greedy(model: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    m.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_is_deterministic_and_matches_transformers(
    single_vllm: VLLMServer, tiny_model: str, prompt: str
) -> None:
    prompt_ids, first = _complete(single_vllm, tiny_model, prompt)
    _, second = _complete(single_vllm, tiny_model, prompt)
    assert len(first) == 16
    assert first == second
    assert first == _hf_greedy(tiny_model, prompt_ids, 16)


def test_server_reports_prompt_tokens_in_metrics(single_vllm: VLLMServer) -> None:
    text = httpx.get(single_vllm.url + "/metrics", timeout=10).text
    assert "vllm:prompt_tokens" in text


def test_profile_real_vllm_feeds_simulate(single_vllm: VLLMServer, tiny_model: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys

    from vllm_disagg.planner.profile import ProfileConfig, profile

    out = tmp_path / "profile.json"
    cfg = ProfileConfig(
        prompt_lens=(64, 256, 1024), repeats=2, batches=(1, 4), decode_tokens=16, timeout_s=120
    )
    prof = profile(single_vllm.url, model=tiny_model, cfg=cfg, out=out)
    assert prof.prefill_tokens_per_s > 0
    assert all(p.step_s > 0 for p in prof.decode_points)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_disagg.cli",
            "simulate",
            "--profile",
            str(out),
            "--requests",
            "30",
            "--rates",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["results"]
