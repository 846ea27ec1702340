"""Routing by model on real vLLM: a LoRA adapter made offline for the tiny model is served by one instance only;
the proxy lists it in /v1/models, routes its requests only there (and the answer is the adapter's, not the base
model's), and answers 404 for a model nobody serves."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from support.pd_pair import PDPair

from vllm_disagg.tools.harness import ProxyServer, VLLMServer, tiny_model_args
from vllm_disagg.tools.tiny_model import write_tiny_lora

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def lora_vllm(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, str]]:
    adapter = write_tiny_lora(tmp_path_factory.mktemp("lora") / "tiny-lora", tiny_model)
    args = [
        *tiny_model_args(),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"tiny-lora={adapter}",
    ]
    with VLLMServer(tiny_model, args=args, cpu_cores="0", name="lora") as server:
        yield server, str(adapter)


def _complete(url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_lora_requests_go_only_to_the_instance_that_has_the_adapter(
    lora_vllm: tuple[VLLMServer, str], pd_pair: PDPair, tiny_model: str
) -> None:
    lora, _ = lora_vllm
    plain = pd_pair.decode  # serves the base model only
    args = ["--both", f"{lora.url};id=lora", "--both", f"{plain.url};id=plain", "--tokenizer", tiny_model]
    with ProxyServer("unused", args=args, name="lora-proxy") as proxy:
        models = httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"]
        assert {m["id"] for m in models} == {tiny_model, "tiny-lora"}
        prompt = "def parse(self, text):"
        direct = _complete(lora.url, "tiny-lora", prompt).json()["choices"][0]["text"]
        base = _complete(lora.url, tiny_model, prompt).json()["choices"][0]["text"]
        assert direct != base  # the adapter changes the answer, so the routing below is visible in the text
        for _ in range(4):
            r = _complete(proxy.url, "tiny-lora", prompt)
            assert r.status_code == 200, r.text
            assert "instance=lora" in r.headers["x-disagg-path"]
            assert r.json()["choices"][0]["text"] == direct
        b = _complete(proxy.url, tiny_model, prompt)
        assert b.status_code == 200 and b.json()["choices"][0]["text"] == base
        r = _complete(proxy.url, "no-such-model", prompt)
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
