"""Shared fixtures. Real vLLM servers are session-scoped: each costs ~30-70 s and ~3 GiB to start."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_disagg.tools.harness import (
    VLLMServer,
    free_port,
    kv_events_args,
    start_many,
    stop_all,
    tiny_model_args,
)
from vllm_disagg.tools.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model

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
    """A prefill and a decode instance, both running DisaggConnector with a shared secret and KV events."""

    def __init__(
        self,
        prefill: VLLMServer,
        decode: VLLMServer,
        p_side: int,
        d_side: int,
        trace: str,
        events: dict[str, int],
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.p_side, self.d_side = p_side, d_side
        self.trace = trace
        self.events = events  # "prefill"/"decode" -> event port; "+replay" suffix -> replay port

    def spec(self, which: str) -> str:
        """The proxy's instance spec for the prefill or decode instance."""
        server = self.prefill if which == "prefill" else self.decode
        side = self.p_side if which == "prefill" else self.d_side
        ev, rp = self.events[which], self.events[which + "+replay"]
        return f"{server.url};side=127.0.0.1:{side};events=tcp://127.0.0.1:{ev};replay=tcp://127.0.0.1:{rp};id={which}"


@contextlib.contextmanager
def make_pair(tiny_model: str, trace: str, transport: str) -> Iterator[PDPair]:
    from helpers import disagg_args

    p_side, d_side = free_port(), free_port()
    ev = {k: free_port() for k in ("prefill", "prefill+replay", "decode", "decode+replay")}
    p_args = [
        *disagg_args(p_side, trace, transport=transport),
        *kv_events_args(ev["prefill"], ev["prefill+replay"]),
    ]
    d_args = [
        *disagg_args(d_side, trace, transport=transport),
        *kv_events_args(ev["decode"], ev["decode+replay"]),
    ]
    prefill = VLLMServer(tiny_model, args=p_args, cpu_cores="0", name=f"prefill-{transport}")
    decode = VLLMServer(tiny_model, args=d_args, cpu_cores="1", name=f"decode-{transport}")
    start_many([prefill, decode])
    try:
        yield PDPair(prefill, decode, p_side, d_side, trace, ev)
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
