"""Connector faults with extra real vLLM instances: incompatible peers, a prefill killed mid-transfer, bad config."""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid
from collections.abc import Iterator

import pytest
from support.pd_pair import PDPair, decode_params_for, prefill_params, random_prompt
from support.vllm_servers import complete, disagg_args, log_contains, tokens, wait_kv_idle

from vllm_disagg.tools.harness import ServerStartError, VLLMServer, free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def odd_decode(tiny_model: str) -> Iterator[tuple[VLLMServer, int]]:
    """A decode instance whose KV blocks differ from the pair's (block size 64 instead of 128)."""
    side = free_port()
    server = VLLMServer(
        tiny_model, args=[*disagg_args(side), "--block-size", "64"], cpu_cores="1", name="odd-decode"
    )
    with server:
        yield server, side


def test_incompatible_block_size_is_refused_and_request_still_answered(
    pd_pair: PDPair, odd_decode: tuple[VLLMServer, int], tiny_model: str
) -> None:
    decode, _ = odd_decode
    prompt = random_prompt(600, 901)
    ref = tokens(complete(pd_pair.prefill, tiny_model, prompt))
    tid = uuid.uuid4().hex
    params = decode_params_for(pd_pair.p_side, tid)
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(complete, decode, tiny_model, prompt, 12, kv_transfer_params=params)
        ex.submit(
            complete,
            pd_pair.prefill,
            tiny_model,
            prompt,
            1,
            kv_transfer_params=prefill_params(tid),
        ).result()
        out = tokens(fd.result())
    assert out == ref  # recomputed locally after the refusal
    assert log_contains(decode, r"refused this decode: incompatible KV layout: block_size")
    assert log_contains(pd_pair.prefill, r"block_size is 128 here \(prefill\) but 64 on decode")
    wait_kv_idle(decode)
    wait_kv_idle(pd_pair.prefill)


def test_prefill_killed_mid_transfer_decode_recomputes_correctly(pd_pair: PDPair, tiny_model: str) -> None:
    side = free_port()
    victim = VLLMServer(tiny_model, args=disagg_args(side), cpu_cores="0", name="victim-prefill")
    with victim:
        prompt = random_prompt(1500, 902)
        ref = tokens(complete(pd_pair.prefill, tiny_model, prompt))
        tid = uuid.uuid4().hex
        params = decode_params_for(side, tid)
        with cf.ThreadPoolExecutor(2) as ex:
            fd = ex.submit(complete, pd_pair.decode, tiny_model, prompt, 12, kv_transfer_params=params)
            time.sleep(2.0)  # decode has registered with the victim and waits for its layers
            t0 = time.monotonic()
            victim.kill()
            out = tokens(fd.result())
        took = time.monotonic() - t0
    assert out == ref
    # before load_timeout_s=15 (waiting that out, then recomputing, takes longer than this bound)
    assert took < 14, f"decode noticed the dead prefill only after {took:.1f} s"
    assert log_contains(pd_pair.decode, r"disconnected|unreachable")
    wait_kv_idle(pd_pair.decode)


def test_unknown_config_key_stops_the_server_naming_the_key(tiny_model: str) -> None:
    server = VLLMServer(
        tiny_model, args=disagg_args(free_port(), trasport="tcp"), cpu_cores="0", name="bad-config"
    )
    with pytest.raises(ServerStartError) as err:
        server.start().wait_healthy(timeout=240)
    assert "unknown key 'trasport'" in str(err.value)
    assert "transport" in str(err.value)  # the allowed keys are listed
