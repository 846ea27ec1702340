"""The README's demo: real vLLM CPU processes on the tiny model.

Stage 1 (foundation): start one instance on the tiny model and complete a few prompts through its OpenAI API.
Later stages grow this into the P/D-vs-colocated comparison.
"""

from __future__ import annotations

import argparse
import time

import httpx

from vllm_disagg.harness import VLLMServer, tiny_model_args
from vllm_disagg.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model

DEMO_PROMPTS = (
    "Hello, how are you",
    "Tell me a story about a cache that moved between two machines.",
    "def fibonacci(n):",
)


def run_demo(ns: argparse.Namespace) -> int:
    if not is_tiny_model(ns.model_dir, TinyLlamaSpec()):
        write_tiny_model(ns.model_dir, TinyLlamaSpec())
    t0 = time.monotonic()
    print(f"[demo] starting vLLM (CPU) on the tiny model in {ns.model_dir} ...", flush=True)
    with VLLMServer(ns.model_dir, args=tiny_model_args(), cpu_cores="0", name="demo") as server:
        print(f"[demo] vLLM healthy at {server.url} after {time.monotonic() - t0:.1f} s", flush=True)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for prompt in DEMO_PROMPTS:
                t = time.monotonic()
                r = client.post(
                    "/v1/completions",
                    json={"model": ns.model_dir, "prompt": prompt, "max_tokens": 24, "temperature": 0},
                )
                r.raise_for_status()
                body = r.json()
                print(
                    f"[demo] {body['usage']['prompt_tokens']:>3} prompt tokens -> "
                    f"{body['usage']['completion_tokens']} tokens in {1000 * (time.monotonic() - t):.0f} ms: "
                    f"{prompt!r} => {body['choices'][0]['text']!r}"
                )
    print("[demo] vLLM stopped; no processes left behind.")
    return 0
