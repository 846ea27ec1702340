"""What intake looks up in the prefix index is what vLLM will reuse: the kept tail of a truncated prompt, never a
prompt's last token, and chat rendered as vLLM reads its flags."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from vllm_disagg.policy.builtin import AlwaysTransfer
from vllm_disagg.router.app import Proxy
from vllm_disagg.router.config import ProxySettings
from vllm_disagg.router.intake import RequestContext, admit
from vllm_disagg.router.interrupts import Interrupts
from vllm_disagg.router.prefix_index import BlockKeys, PrefixIndex
from vllm_disagg.router.tokenizer import PromptTokenizer

BS = 16


def _proxy(tiny_model: str, max_model_len: int = 2048) -> tuple[Proxy, PrefixIndex]:
    index = PrefixIndex(BS)
    settings = ProxySettings(tokenizer=tiny_model, block_size=BS, max_model_len=max_model_len)
    return Proxy(settings, AlwaysTransfer(), index=index), index


def _admit(proxy: Proxy, body: dict[str, Any], kind: str = "completions") -> RequestContext:
    ctx = asyncio.run(admit(proxy, {}, json.dumps(body).encode(), kind, Interrupts(None), 0.0))
    assert isinstance(ctx, RequestContext), ctx
    return ctx


def test_a_truncated_prompt_is_looked_up_by_the_tail_vllm_keeps(tiny_model: str) -> None:
    proxy, index = _proxy(tiny_model)
    ids = list(range(10, 10 + 20 * BS))  # 20 blocks of token ids
    index.record_routed("a", ids)  # the whole prompt's blocks are on "a"
    whole = _admit(proxy, {"model": "m", "prompt": ids, "max_tokens": 1})
    assert whole.cached == {"a": 19 * BS}  # all but the block of the last token (below)
    kept = 8 * BS
    cut = _admit(proxy, {"model": "m", "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": kept})
    assert cut.prompt_tokens == kept and cut.cached == {"a": 0}, (
        cut.cached
    )  # the tail's blocks start elsewhere
    assert list(cut.index_keys) == list(index.block_keys(ids[-kept:]))  # what a routed record will plant
    index.record_routed("a", ids[-kept:])
    again = _admit(proxy, {"model": "m", "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": kept})
    assert again.cached == {"a": kept - BS}


def test_a_prompt_of_whole_blocks_reuses_all_but_its_last(tiny_model: str) -> None:
    proxy, index = _proxy(tiny_model)
    for blocks, extra in ((3, 0), (3, 1), (1, 0)):
        ids = list(range(100, 100 + blocks * BS + extra))
        index.record_routed("a", ids)
        ctx = _admit(proxy, {"model": "m", "prompt": ids, "max_tokens": 1})
        assert ctx.cached == {"a": (blocks - (extra == 0)) * BS}, (blocks, extra, ctx.cached)


def test_add_generation_prompt_is_read_as_vllm_reads_it(tiny_model: str) -> None:
    proxy, _ = _proxy(tiny_model)
    tok = PromptTokenizer(tiny_model)
    messages = [{"role": "user", "content": "hello there"}]  # short: tokenized whole, the count exact
    assert tok.encode_chat(messages, True) != tok.encode_chat(messages, False)
    for sent, meant in (("false", False), ("true", True), (0, False), (False, False), (True, True)):
        ctx = _admit(
            proxy, {"model": "m", "messages": messages, "add_generation_prompt": sent}, "chat/completions"
        )
        assert ctx.tokens == tok.encode_chat(messages, meant), sent


def test_a_reset_of_the_index_is_counted_in_metrics(tiny_model: str) -> None:
    from prometheus_client import generate_latest

    proxy, index = _proxy(tiny_model)
    index.clear(
        "a"
    )  # not an instance of the pool (never added, or removed): nothing to forget, nothing counted
    index.set_precise("a", True)  # as adding it does
    index.clear("a")
    index.clear("a", device_only=True)  # vLLM's own prefix-cache reset: nothing the proxy lost
    proxy.export_instance_metrics()
    index.clear("a")
    proxy.export_instance_metrics()
    proxy.export_instance_metrics()
    text = generate_latest(proxy.metrics.registry).decode()
    assert 'vllm_disagg_prefix_index_resets_total{instance="a"} 2.0' in text


def test_a_salted_request_is_looked_up_under_its_salt(tiny_model: str) -> None:
    proxy, index = _proxy(tiny_model)
    ids = list(range(500, 500 + 4 * BS + 3))
    hashes = list(range(4))
    index.apply_stored("a", hashes, None, ids[: 4 * BS], BS, extra_keys=[["t1"], None, None, None])
    body = {"model": "m", "prompt": ids, "max_tokens": 1}
    assert _admit(proxy, {**body, "cache_salt": "t1"}).cached == {"a": 4 * BS}
    assert _admit(proxy, {**body, "cache_salt": "t2"}).cached == {"a": 0}
    assert _admit(proxy, body).cached == {"a": 0}


def test_a_truncated_text_prompt_is_tokenized_whole_and_looked_up_by_its_tail(tiny_model: str) -> None:
    """A long text prompt is otherwise tokenized only as far as the index can use its beginning; truncated, its end
    is what vLLM keeps, so every id is read."""
    proxy, index = _proxy(tiny_model)
    text = " ".join(f"word{i}" for i in range(400))
    ids = PromptTokenizer(tiny_model).encode_text(text, True)
    kept = 8 * BS + 5
    index.record_routed("a", ids[-kept:])
    ctx = _admit(proxy, {"model": "m", "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": kept})
    assert ctx.prompt_tokens == kept and ctx.cached == {"a": 8 * BS}, ctx.cached
    plain = _admit(proxy, {"model": "m", "prompt": text, "max_tokens": 1})
    assert plain.cached == {"a": 0}  # untruncated, it starts with other blocks


def test_a_long_salted_text_prompt_finds_all_its_cached_blocks(tiny_model: str) -> None:
    """Staged tokenization reads on only while the index holds what it read, checked with unsalted keys: a salted
    prompt is read whole instead, or it would stop after its first stage."""
    from vllm_disagg.router.prefix_index import iter_block_keys, salted_root

    proxy, index = _proxy(tiny_model, max_model_len=1 << 20)  # room for any length: read in stages if it may
    text = " ".join(f"word{i}" for i in range(400))
    ids = PromptTokenizer(tiny_model).encode_text(text, True)
    blocks = len(ids) // BS
    index.record_routed("a", BlockKeys(list(iter_block_keys(ids, BS, blocks, salted_root("t1"))), BS))
    ctx = _admit(proxy, {"model": "m", "prompt": text, "max_tokens": 1, "cache_salt": "t1"})
    assert ctx.cached == {"a": min(blocks * BS, (len(ids) - 1) // BS * BS)}, (ctx.cached, len(ids))
