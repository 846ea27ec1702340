"""Shared fixtures. Real vLLM servers are session-scoped: each costs ~30-70 s and ~3 GiB to start."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_disagg.harness import VLLMServer, free_port, start_many, stop_all, tiny_model_args
from vllm_disagg.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
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


class PDPair:
    """A prefill and a decode instance, both running DisaggConnector over TCP with a shared secret."""

    def __init__(self, prefill: VLLMServer, decode: VLLMServer, p_side: int, d_side: int, trace: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.p_side, self.d_side = p_side, d_side
        self.trace = trace


@contextlib.contextmanager
def make_pair(tiny_model: str, trace: str, transport: str) -> Iterator[PDPair]:
    from helpers import disagg_args

    p_side, d_side = free_port(), free_port()
    prefill = VLLMServer(
        tiny_model,
        args=disagg_args(p_side, trace, transport=transport),
        cpu_cores="0",
        name=f"prefill-{transport}",
    )
    decode = VLLMServer(
        tiny_model,
        args=disagg_args(d_side, trace, transport=transport),
        cpu_cores="1",
        name=f"decode-{transport}",
    )
    start_many([prefill, decode])
    try:
        yield PDPair(prefill, decode, p_side, d_side, trace)
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="session")
def pd_pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    """The shared P/D pair over the TCP data path (proxy tests use it too)."""
    with make_pair(tiny_model, str(tmp_path_factory.mktemp("trace") / "transfers.jsonl"), "tcp") as pair:
        yield pair


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_all()
