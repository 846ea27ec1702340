"""The prefix-aware P/D proxy and its routing-policy API (``vllm_disagg.router``). Runs without vLLM or torch."""

from __future__ import annotations
