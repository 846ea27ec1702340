"""A prefill instance short of KV cache preempts requests mid-send: their transfers pause and go on from the
resumed requests' blocks, and decode's answers still equal the colocated ones (real vLLM CPU processes)."""

from __future__ import annotations

import concurrent.futures as cf
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from support.pd_pair import PDPair, decode_params_for, prefill_params, random_prompt
from support.vllm_servers import complete, disagg_args, read_trace, tokens, wait_kv_idle

from vllm_disagg.tools.harness import VLLMServer, free_port, start_many

pytestmark = pytest.mark.vllm

# 20 blocks of 128 tokens: room for one 1,500-token prompt and part of another, so concurrent prompts preempt
# each other (vLLM needs 16 for the tiny model's 2,048-token context).
_BLOCKS = 20


@pytest.fixture(scope="module")
def tight_prefill(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VLLMServer, int, str]]:
    """A prefill instance with a KV cache of ``_BLOCKS`` blocks, its side-channel port and its transfer trace."""
    side = free_port()
    trace = str(tmp_path_factory.mktemp("preemption") / "transfers.jsonl")
    # Each step gives every prompt at most one block's worth of tokens, so five prompts grow together until the
    # cache is full and vLLM preempts the newest (without the threshold, one prompt takes the step's whole budget).
    args = [
        *disagg_args(side, trace),
        "--num-gpu-blocks-override",
        str(_BLOCKS),
        "--max-num-batched-tokens",
        "1024",
        "--long-prefill-token-threshold",
        "128",
    ]
    server = VLLMServer(tiny_model, args=args, cpu_cores="0", name="prefill-tight")
    start_many([server])
    try:
        yield server, side, trace
    finally:
        server.stop()


def _disaggregated(
    prefill: VLLMServer, side: int, decode: VLLMServer, model: str, prompt: list[int], tid: str
) -> list[int]:
    """Both legs at once (the proxy's flow): decode registers for ``tid`` and loads what prefill pushes."""
    params = decode_params_for(side, tid)
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(complete, decode, model, prompt, 8, kv_transfer_params=params)
        fp = ex.submit(complete, prefill, model, prompt, 1, kv_transfer_params=prefill_params(tid))
        fp.result()
        return tokens(fd.result())


def test_a_prefill_preempted_mid_send_still_hands_its_kv_over(
    tight_prefill: tuple[VLLMServer, int, str], pd_pair: PDPair, tiny_model: str
) -> None:
    prefill, side, trace = tight_prefill
    decode = pd_pair.decode
    preempted: list[dict[str, Any]] = []
    for attempt in range(
        3
    ):  # preemption depends on how the prompts' steps interleave: a batch may not preempt
        prompts = [
            random_prompt(n, 9100 + 10 * attempt + i) for i, n in enumerate([1500, 1400, 1300, 1600, 1200])
        ]
        # the reference: the shared pair's prefill serving each prompt alone (decode must not cache them first)
        refs = [tokens(complete(pd_pair.prefill, tiny_model, p, max_tokens=8)) for p in prompts]
        tids = [uuid.uuid4().hex for _ in prompts]
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(
                ex.map(
                    lambda pt: _disaggregated(prefill, side, decode, tiny_model, pt[0], pt[1]),
                    zip(prompts, tids, strict=True),
                )
            )
        for n, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            assert out == ref, f"prompt {n} of attempt {attempt}: {out} != {ref}"
        wait_kv_idle(prefill)
        wait_kv_idle(decode)
        sends = {r["transfer_id"]: r for r in read_trace(trace) if r["side"] == "send"}
        preempted = [sends[t] for t in tids if t in sends and sends[t].get("preemptions", 0) > 0]
        if preempted:
            break
    assert preempted, f"no prefill request was preempted mid-send in 3 batches on {_BLOCKS} blocks"
    assert all(r["outcome"] == "loaded" for r in preempted), preempted
    loads = {r["transfer_id"]: r for r in read_trace(pd_pair.trace) if r["side"] == "recv"}
    for rec in preempted:  # decode loaded every block: it did not fall back to recomputing the prompt
        assert loads[rec["transfer_id"]]["state"] == "done", loads.get(rec["transfer_id"])
