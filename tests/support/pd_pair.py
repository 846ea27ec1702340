"""A prefill and a decode vLLM instance running DisaggConnector, and the two request flows through such a pair.

The session's shared pair is the ``pd_pair`` fixture (tests/conftest.py); a test that needs a pair of its own starts
one with ``make_pair``."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from support.vllm_servers import SECRET, complete, disagg_args, tokens
from vllm_disagg.tools.harness import VLLMServer, free_port, kv_events_args, start_many
from vllm_disagg.transfer_params import PROOF_KEY, decode_proof, prefill_proof


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


# One token, around one block, partial last blocks, many blocks, up to ~1900 tokens.
LENGTHS = [
    1,
    2,
    17,
    127,
    128,
    129,
    200,
    255,
    256,
    257,
    384,
    500,
    640,
    777,
    1000,
    1023,
    1024,
    1025,
    1300,
    1600,
    1900,
]


def random_prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 2000, size=n)]


def prefill_params(tid: str) -> dict[str, Any]:
    """A prefill leg's params as the proxy sends them: vouched for with the instances' shared secret."""
    return {"do_remote_decode": True, "transfer_id": tid, PROOF_KEY: decode_proof(SECRET.encode(), tid)}


def decode_params_for(side_port: int, tid: str, host: str = "127.0.0.1") -> dict[str, Any]:
    """A decode leg's params as the proxy sends them: load ``tid`` from the prefill at ``host:side_port``."""
    return {
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_host": host,
        "remote_port": side_port,
        PROOF_KEY: prefill_proof(SECRET.encode(), tid, host, side_port),
    }


def decode_params(pair: PDPair, tid: str) -> dict[str, Any]:
    return decode_params_for(pair.p_side, tid)


def run_sequential(pair: PDPair, model: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """vLLM's example-proxy flow: prefill first (max_tokens=1), then forward its kv_transfer_params to decode."""
    rp = complete(pair.prefill, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = rp["kv_transfer_params"]
    assert params and params["do_remote_prefill"], rp
    return tokens(complete(pair.decode, model, prompt, max_tokens=max_tokens, kv_transfer_params=params))


def run_parallel(
    pair: PDPair, model: str, prompt: list[int], tid: str, max_tokens: int = 12, prefill_after_s: float = 0.0
) -> list[int]:
    """Our proxy's flow: both legs at once with a shared transfer id; decode registers, prefill pushes per layer."""
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(
            complete, pair.decode, model, prompt, max_tokens, kv_transfer_params=decode_params(pair, tid)
        )
        if prefill_after_s:
            time.sleep(prefill_after_s)
        fp = ex.submit(complete, pair.prefill, model, prompt, 1, kv_transfer_params=prefill_params(tid))
        fp.result()
        return tokens(fd.result())
