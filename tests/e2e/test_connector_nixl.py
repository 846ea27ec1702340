"""DisaggConnector over the NIXL (UCX) data path between two real vLLM CPU processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from support.pd_pair import (
    LENGTHS,
    PDPair,
    decode_params,
    make_pair,
    random_prompt,
    run_parallel,
    run_sequential,
)
from support.vllm_servers import complete, find_trace, tokens, wait_kv_idle

from vllm_disagg.transport.nixl import nixl_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not nixl_available(), reason="nixl not installed")]


@pytest.fixture(scope="module")
def nixl_pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    with make_pair(tiny_model, str(tmp_path_factory.mktemp("nixl") / "transfers.jsonl"), "nixl") as pair:
        yield pair


@pytest.mark.parametrize("flow", ["sequential", "parallel"])
def test_nixl_output_equals_colocated(nixl_pair: PDPair, tiny_model: str, flow: str) -> None:
    for i, n in enumerate(LENGTHS):
        prompt = random_prompt(n, (3000 if flow == "sequential" else 4000) + i)
        ref = tokens(complete(nixl_pair.prefill, tiny_model, prompt))
        tid = uuid.uuid4().hex
        out = (
            run_sequential(nixl_pair, tiny_model, prompt)
            if flow == "sequential"
            else run_parallel(nixl_pair, tiny_model, prompt, tid)
        )
        assert out == ref, f"NIXL {flow}, {n} tokens"
        if flow == "parallel":
            recv = find_trace(nixl_pair.trace, tid, "recv")
            assert recv["reason"] == "all blocks arrived (NIXL)"  # the bytes really went over NIXL
    wait_kv_idle(nixl_pair.prefill)
    wait_kv_idle(nixl_pair.decode)


def test_nixl_decode_abort_waits_for_prefill_then_frees(nixl_pair: PDPair, tiny_model: str) -> None:
    prompt = random_prompt(900, 4401)
    tid = uuid.uuid4().hex
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            nixl_pair.decode.url + "/v1/completions",
            json={
                "model": tiny_model,
                "prompt": prompt,
                "max_tokens": 8,
                "kv_transfer_params": decode_params(nixl_pair, tid),
            },
            timeout=1.5,
        )
    assert wait_kv_idle(nixl_pair.decode, timeout=10) < 10
    p2 = random_prompt(300, 4402)
    assert run_parallel(nixl_pair, tiny_model, p2, uuid.uuid4().hex) == tokens(
        complete(nixl_pair.prefill, tiny_model, p2)
    )
