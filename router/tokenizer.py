"""Tokenize prompts the way the serving instances do, so prefix lookups and length checks see vLLM's token ids.

With a local tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``), tokenization runs in-process with
the ``tokenizers`` library and the chat template is rendered with jinja2: no transformers, no torch. Without one,
the proxy asks an instance's ``/tokenize`` endpoint (exact, one extra round trip).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec

from vllm_disagg.router.upstream import UpstreamPool, UpstreamTimeout


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        d = Path(path)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self._template = None
        template = self.config.get("chat_template")
        if isinstance(template, str):
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(template)

    def _special(self, name: str) -> str:
        v = self.config.get(name)
        if isinstance(v, dict):
            return str(v.get("content", ""))
        return str(v or "")

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=True).ids)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special("bos_token"),
            eos_token=self._special("eos_token"),
        )
        return list(self._tok.encode(text, add_special_tokens=False).ids)


async def remote_tokenize(pool: UpstreamPool, url: str, model: str, body: dict[str, Any]) -> list[int]:
    """Token ids from an instance's /tokenize (completions: ``prompt``; chat: ``messages``); ``HTTPStatusError``
    for an answer that is not 2xx, ``UpstreamError`` when the instance cannot be reached (or takes over 10 s)."""
    req: dict[str, Any] = {"model": model}
    if "messages" in body:
        req["messages"] = body["messages"]
        req["add_generation_prompt"] = body.get("add_generation_prompt", True)
    else:
        req["prompt"] = body.get("prompt", "")
    try:
        raw = await asyncio.wait_for(pool.post_json(url, "/tokenize", msgspec.json.encode(req), {}), 10.0)
    except TimeoutError:
        raise UpstreamTimeout(f"{url}/tokenize: no answer within 10 s") from None
    return list(msgspec.json.decode(raw)["tokens"])
