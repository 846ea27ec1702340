"""Shared fixtures. Real vLLM servers are session-scoped: each costs ~30-70 s and ~3 GiB to start."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.paths import ROOT
from support.pd_pair import PDPair, make_pair

from vllm_disagg.tools.harness import VLLMServer, stop_all, tiny_model_args
from vllm_disagg.tools.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny Llama (written once per checkout under .artifacts/, as the README's set-up does)."""
    path = ROOT / ".artifacts" / "tiny-model"
    if not is_tiny_model(path, TinyLlamaSpec()):
        write_tiny_model(path, TinyLlamaSpec())
    return str(path)


@pytest.fixture(scope="module")
def single_vllm(tiny_model: str) -> Iterator[VLLMServer]:
    """One plain vLLM instance (no connector): the colocated reference that P/D output must equal."""
    server = VLLMServer(tiny_model, args=tiny_model_args(), cpu_cores="0", name="single")
    with server:
        yield server


@pytest.fixture(scope="session")
def pd_pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    """The shared P/D pair over the TCP data path (proxy tests use it too)."""
    with make_pair(tiny_model, str(tmp_path_factory.mktemp("trace") / "transfers.jsonl"), "tcp") as pair:
        yield pair


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_all()
