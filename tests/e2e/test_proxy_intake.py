"""The proxy's intake and fallback ladder on paths the e2e tests do not reach cheaply: a tokenizing instance that
dies, a user policy that raises, and the pure rules for what each leg carries (router/legs.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.paths import POLICIES
from support.proxy_harness import ADMIN_KEY, mock_backend, running_proxy

from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.router.intake import openai_error
from vllm_disagg.router.legs import (
    completion_tokens,
    count_sse_events,
    patch_sse_usage,
    patch_usage_json,
    prefill_leg_body,
    prefill_usage,
    prompt_cache_counts,
    single_instance_reason,
    take_client_kv_params,
)


def test_tokenization_falls_over_when_the_instance_it_used_dies(tiny_model: str) -> None:
    """No --tokenizer: the proxy tokenizes through an instance. One that died since its last probe must not turn
    requests into 500s: tokenization falls over like any other leg."""
    with mock_backend(tiny_model) as alive:
        dead = "http://127.0.0.1:9"
        instances = [InstanceConfig(url=dead, role="both", id="dead"), InstanceConfig(url=alive, role="both")]
        with running_proxy(
            alive, tiny_model, instances=instances, tokenizer=None, health_interval_s=30
        ) as rp:
            rp.proxy.registry.get("dead").healthy = True  # died after its last probe
            for _ in range(3):
                r = httpx.post(
                    rp.url + "/v1/completions",
                    json={"model": tiny_model, "prompt": "hi", "max_tokens": 2},
                    timeout=30,
                )
                assert r.status_code == 200, r.text


def test_a_prompt_that_fails_to_tokenize_everywhere_ejects_no_instance(tiny_model: str) -> None:
    """vLLM's /tokenize answers 500 for a chat whose image it cannot fetch. That is the prompt's doing: the client is
    told, and no instance is held to it (three such requests used to take every instance out of routing). An
    instance that fails a prompt another instance tokenizes is held to it."""
    with mock_backend(tiny_model) as a, mock_backend(tiny_model) as b:
        instances = [InstanceConfig(url=a, role="both", id="a"), InstanceConfig(url=b, role="both", id="b")]
        with running_proxy(a, tiny_model, instances=instances, tokenizer=None, health_interval_s=30) as rp:

            def chat(text: str) -> httpx.Response:
                content = [{"type": "text", "text": text}]
                return httpx.post(
                    rp.url + "/v1/chat/completions",
                    json={
                        "model": tiny_model,
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": 2,
                    },
                    timeout=30,
                )

            for _ in range(4):
                r = chat("look at mock-tokenize-fail")
                assert (
                    r.status_code == 500 and "failed to tokenize this prompt" in r.json()["error"]["message"]
                )
            registry = rp.proxy.registry
            assert [registry.get(i).last_error for i in ("a", "b")] == ["", ""]
            assert chat("hello").status_code == 200
            port_a = a.rsplit(":", 1)[1]
            for _ in range(
                40
            ):  # equally busy instances are tried in a random order: a comes first in about half
                assert chat(f"look at mock-tokenize-fail:{port_a}").status_code == 200  # b tokenizes it
                if registry.get("a").last_error:
                    break
            assert registry.get("a").last_error == "tokenize: HTTP 500" and registry.get("b").last_error == ""


@pytest.mark.parametrize("policy", ["Broken", "NoPrefill"])
def test_a_policy_that_raises_or_plans_nonsense_serves_the_request_with_a_fallback_plan(
    tiny_model: str, policy: str
) -> None:
    with mock_backend(tiny_model) as url:
        spec = f"{POLICIES}:{policy}"
        with running_proxy(url, tiny_model, policy=spec) as rp:
            r = httpx.post(
                rp.url + "/v1/completions",
                json={"model": tiny_model, "prompt": "hi", "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert "policy_error" in r.headers["x-disagg-path"]
            text = httpx.get(rp.url + "/metrics", timeout=5).text
            assert 'reason="policy_error"' in text


def test_bodies_are_parsed_as_vllm_parses_them() -> None:
    from vllm_disagg.router.intake import lax_bool, parse_json_object

    assert parse_json_object(b'\xef\xbb\xbf{"prompt": "x"}') == {
        "prompt": "x"
    }  # a byte order mark is skipped
    for bad in (b"[1]", b'{"a": NaN}', b'{"a": 1e999}'):
        with pytest.raises(ValueError):
            parse_json_object(bad)
    assert [lax_bool(v) for v in (True, 0, 1.0, "false", " YES ", "off", "t")] == [
        True, False, True, False, True, False, True,
    ]  # fmt: skip
    assert lax_bool("maybe") is None and lax_bool(2) is None and lax_bool(None) is None


def test_client_kv_params_are_taken_and_legs_carry_only_what_they_need() -> None:
    body: dict[str, Any] = {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}, "min_tokens": 5,
                            "response_format": {"type": "json_object"}, "logprobs": 3, "n": 1, "max_tokens": 9}  # fmt: skip
    assert take_client_kv_params(body) and "kv_transfer_params" not in body
    assert not take_client_kv_params(body)
    # vLLM copies vllm_xargs into the extra_args the connector reads kv_transfer_params from
    xargs: dict[str, Any] = {"prompt": "x", "vllm_xargs": {"kv_transfer_params": "x", "mine": 1}}
    assert take_client_kv_params(xargs) and xargs["vllm_xargs"] == {"mine": 1}
    # an encoder-cache connector's peer parameters too; and a key sent as null (a duplicate key before it could
    # hold a value that vLLM's parser and ours read differently) makes the body re-encoded
    ec: dict[str, Any] = {"ec_transfer_params": {"x": 1}, "vllm_xargs": {"ec_transfer_params": {}}}
    assert take_client_kv_params(ec) and ec == {"vllm_xargs": {}}
    assert take_client_kv_params({"prompt": "x", "kv_transfer_params": None})
    leg = prefill_leg_body(body, {"do_remote_decode": True, "transfer_id": "t"})
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert not {"min_tokens", "response_format", "logprobs", "n"} & set(leg)
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "t"}
    assert body["min_tokens"] == 5  # the client's body (decode's leg) is untouched


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"n": 2}, "n_gt_1"),
        ({"best_of": 3}, "best_of_gt_1"),
        ({"echo": True}, "echo"),
        ({"prompt_embeds": "dGVuc29y"}, "prompt_embeds"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"use_beam_search": True}, "beam_search"),
        ({"n": 1, "best_of": 1}, ""),
        ({"n": True}, ""),
    ],
)
def test_requests_that_cannot_be_split_are_named(body: dict[str, Any], reason: str) -> None:
    assert single_instance_reason(body) == reason


def test_usage_reports_the_prefill_legs_prompt_cache_counts() -> None:
    """Decode loaded the prompt prefill computed: the client's usage says what prefill had cached and what it
    wrote into its cache, as one instance serving the request would have said."""
    prefill = json.dumps({"usage": {"prompt_tokens": 300, "prompt_tokens_details": {
        "cached_tokens": 128, "created_cache_tokens": 128}}, "kv_transfer_params": {"remote_host": "h"}}).encode()  # fmt: skip
    usage, params = prefill_usage(prefill)
    counts = prompt_cache_counts(usage)
    assert counts == {"cached_tokens": 128, "created_cache_tokens": 128} and params == {"remote_host": "h"}
    decode = {
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0},
        }
    }
    fixed = json.loads(patch_usage_json(json.dumps(decode).encode(), counts))
    assert fixed["usage"]["prompt_tokens_details"] == {"cached_tokens": 128, "created_cache_tokens": 128}
    assert fixed["usage"]["completion_tokens"] == 7
    no_details = json.dumps({"usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}).encode()
    assert patch_usage_json(no_details, counts) == no_details
    only_cached = json.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": 299}}}).encode()
    assert json.loads(patch_usage_json(only_cached, counts))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 128
    }
    sse = (
        b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":7,'
        b'"prompt_tokens_details":{"cached_tokens":299,"created_cache_tokens":0}}}\n\ndata: [DONE]\n\n'
    )
    out = patch_sse_usage(sse, counts)
    last = json.loads(out.split(b"\n\n")[1][6:])
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 128, "created_cache_tokens": 128}
    assert out.split(b"\n\n")[0] == sse.split(b"\n\n")[0]  # token events pass through untouched
    assert completion_tokens(out) == 7 and count_sse_events(sse) == 2


def test_completion_tokens_of_answers_without_usage_is_zero() -> None:
    assert completion_tokens(b'{"choices": []}') == 0
    assert completion_tokens(b'{"usage": {"completion_tokens": 42}}') == 42


@contextlib.contextmanager
def _pd_behind_a_short_deadline(tiny_model: str) -> Iterator[Any]:
    """Mock prefill and decode instances behind an in-process proxy whose transfer deadline is 1 s."""
    with mock_backend(tiny_model) as p_url, mock_backend(tiny_model) as d_url:
        instances = [
            InstanceConfig(url=p_url, role="prefill", id="p"),
            InstanceConfig(url=d_url, role="decode", id="d"),
        ]
        with running_proxy(
            d_url,
            tiny_model,
            instances=instances,
            policy="always-transfer",
            transfer_deadline_s=1.0,
            health_interval_s=0.2,
        ) as rp:
            yield rp


def test_a_transfer_past_its_deadline_is_a_504_with_nothing_left_open(tiny_model: str) -> None:
    """The prefill leg outlives transfer_deadline_s: the client gets a 504 naming the request and the pair, the
    hand-off is counted stranded once, and no leg, ledger entry or in-flight count is left behind."""
    with _pd_behind_a_short_deadline(tiny_model) as rp:
        body = {"model": tiny_model, "prompt": "hello", "max_tokens": 4, "mock_prefill_delay_s": 30}
        r = httpx.post(rp.url + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 504, r.text
        assert "transfer_deadline_s" in r.json()["error"]["message"]
        proxy = rp.proxy
        assert proxy.ledger.in_flight() == 0 and proxy.ledger.stranded() == 1 and not proxy.legs
        assert all(i.in_flight == 0 for i in proxy.registry.instances.values())
        ok = httpx.post(rp.url + "/v1/completions", json={**body, "mock_prefill_delay_s": 0}, timeout=20)
        assert ok.status_code == 200 and "flow=sequential" in ok.headers["x-disagg-path"]


def test_a_decoding_stream_is_never_reclaimed_as_stranded() -> None:
    from vllm_disagg.router.ledger import TransferLedger

    now = [0.0]
    ledger = TransferLedger(deadline_s=60, clock=lambda: now[0])
    ledger.open("a", "r1", "p", "d")
    ledger.open("b", "r2", "p", "d")
    ledger.mark("b", "decoding")  # decode's first token: it has its KV
    now[0] = 3600.0  # a long reasoning stream
    assert [h.transfer_id for h in ledger.expired()] == ["a"]
    assert ledger.stranded() == 1 and ledger.in_flight() == 1


def test_long_prompts_are_tokenized_off_the_event_loop_and_the_decode_step_is_fitted(tiny_model: str) -> None:
    with (
        mock_backend(tiny_model) as url,
        running_proxy(
            url, tiny_model, max_model_len=1_000_000, max_body_bytes=1_000_000, tokenize_probe_chars=1_000_000
        ) as rp,
    ):  # one pass per prompt here: the stages of a long one are the next test's
        proxy = rp.proxy
        proxy.token_cache = None  # no pieces: where a whole prompt is read (the cache's test is further down)
        calls: list[tuple[str, int]] = []
        on_loop, off_loop = proxy.tokenizer.encode_text, proxy.tokenizer.encode_off_loop

        def recording_on(text: str, special: bool) -> list[int]:
            calls.append(("on_loop", len(text)))
            return on_loop(text, special)

        async def recording_off(text: str, special: bool) -> list[int]:
            calls.append(("off_loop", len(text)))
            return await off_loop(text, special)

        worker = proxy.tokenize_worker
        in_worker = worker.encode_keys

        async def recording_worker(text: str, special: bool) -> tuple[int, list[int]]:
            calls.append(("worker", len(text)))
            return await in_worker(text, special)

        proxy.tokenizer.encode_text = recording_on
        proxy.tokenizer.encode_off_loop = recording_off
        worker.encode_keys = recording_worker
        step0 = proxy.policy.decode_step_s
        prompts = (
            "short prompt",
            "kurz: Straße",
            "word " * 300,
            "word " * 1_000,
            "word " * 10_000,
            "word " * 40_000,
        )
        for prompt in prompts:
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 16, "stream": True}
            assert httpx.post(rp.url + "/v1/completions", json=body, timeout=30).status_code == 200
        limit = proxy.settings.tokenize_max_chars
        # "short prompt" cannot fill a 128-token block: not tokenized at all. A non-ASCII one has no cheap bound.
        assert calls[0] == ("on_loop", len("kurz: Straße"))
        assert calls[1] == ("on_loop", 1_500)
        assert calls[2] == ("off_loop", 5_000)  # a thread: GIL released while it encodes
        assert calls[3] == ("worker", 50_000)  # the worker process: no GIL shared with the event loop
        assert calls[4][0] == "worker" and limit // 2 < calls[4][1] <= limit  # 200 KB: only a bounded prefix
        assert len(calls) == 5
        assert proxy.policy.decode_step_s != step0  # fitted from the streams' output tokens and durations


def test_a_short_prompt_is_tokenized_only_when_its_bound_could_overflow_the_context(tiny_model: str) -> None:
    """A prompt too short to fill a KV block skips the tokenizer unless its upper bound might not fit the context:
    then it is tokenized, and rejected only if the prompt alone does not fit. As vLLM does, ``max_tokens`` past the
    room left is shortened rather than refused, ``max_completion_tokens`` wins over ``max_tokens``, and a prompt
    vLLM truncates (``truncate_prompt_tokens``) is measured as truncated."""
    with mock_backend(tiny_model) as url, running_proxy(url, tiny_model, max_model_len=100) as rp:
        proxy = rp.proxy
        calls: list[int] = []
        on_loop = proxy.tokenizer.encode_text

        def recording(text: str, special: bool) -> list[int]:
            calls.append(len(text))
            return on_loop(text, special)

        proxy.tokenizer.encode_text = recording

        def post(prompt: str, **extra: Any) -> httpx.Response:
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 16, **extra}
            return httpx.post(rp.url + "/v1/completions", json=body, timeout=30)

        short = "The quick brown fox jumps over the lazy dog"  # 10 tokens with <s>; bound 45
        assert post(short).status_code == 200 and calls == []  # 45 <= 100: nothing to check
        assert post(short, max_tokens=1000).status_code == 200 and calls == []  # vLLM shortens max_tokens
        assert post(short, max_tokens=1000, max_completion_tokens=5).status_code == 200
        assert post(short, max_tokens="7").status_code == 200  # vLLM reads "7" as 7
        bounded = " ".join(["fox"] * 30)  # 119 characters: its bound might not fit, its ~31 tokens do
        assert len(on_loop(bounded, True)) <= 100 < len(bounded)
        assert post(bounded).status_code == 200 and calls == [len(bounded)]
        long = " ".join(["fox"] * 120)
        assert len(on_loop(long, True)) > 100
        r = post(long)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens", r.text
        assert post(long, truncate_prompt_tokens=50).status_code == 200


def test_the_ascii_bound_holds_on_the_tokenizer(tiny_model: str) -> None:
    """``ascii_token_bound`` is an upper bound on the real count for any ASCII text, however it is spaced."""
    import random
    import string

    from vllm_disagg.router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(tiny_model)
    rnd = random.Random(5)
    alphabet = string.printable + "     "
    for n in (0, 1, 2, 7, 40, 127, 300):
        for _ in range(40):
            text = "".join(rnd.choice(alphabet) for _ in range(n))
            for special in (True, False):
                bound = tok.ascii_token_bound(len(text), special)
                assert bound is not None and len(tok.encode_text(text, special)) <= bound, repr(text)


def test_a_long_prompt_is_tokenized_only_as_far_as_an_instance_holds_its_prefix(tiny_model: str) -> None:
    """Stages of 4x from the probe: a prompt nobody holds costs its probe; each stage whose whole blocks one
    instance holds leads to the next, up to the bound; the ids kept are the whole prompt's own, in whole blocks."""
    import asyncio
    import random
    from types import SimpleNamespace

    from vllm_disagg.router.config import ProxySettings
    from vllm_disagg.router.intake import encode_bounded
    from vllm_disagg.router.prefix_index import PrefixIndex, block_keys
    from vllm_disagg.router.tokenize_worker import TokenizeWorker
    from vllm_disagg.router.tokenizer import PromptTokenizer

    block = 128
    tok = PromptTokenizer(tiny_model)
    rnd = random.Random(11)
    words = ["alpha", "beta,", "gamma.", "delta", "123", "(x)", "epsilon"]
    text = " ".join(rnd.choice(words) for _ in range(30_000))  # ~200 KB, ASCII
    full = tok.encode_text(text, True)
    calls: list[int] = []
    on_loop, off_loop = tok.encode_text, tok.encode_off_loop

    def recording_on(t: str, special: bool) -> list[int]:
        calls.append(len(t))
        return on_loop(t, special)

    async def recording_off(t: str, special: bool) -> list[int]:
        calls.append(len(t))
        return await off_loop(t, special)

    tok.encode_text = recording_on  # type: ignore[method-assign]
    tok.encode_off_loop = recording_off  # type: ignore[method-assign]

    def run(held_tokens: int, room: int | None = None, probe: int = 1024, worker: bool = False) -> Any:
        index = PrefixIndex(block_size=block, pending_ttl_s=1e6)
        if held_tokens:
            index.record_pending("a", block_keys(full[:held_tokens], block))
        settings = ProxySettings(block_size=block, tokenize_probe_chars=probe)
        proxy = SimpleNamespace(
            tokenizer=tok, settings=settings, tokenize_worker=None, index=index, token_cache=None
        )
        calls.clear()
        tok.chars_per_token = None  # no prompt seen: the probe is tokenize_probe_chars

        async def go() -> Any:
            if worker:
                proxy.tokenize_worker = TokenizeWorker(tiny_model, block)
            try:
                return await encode_bounded(proxy, text, True, room)  # type: ignore[arg-type]
            finally:
                if worker:
                    await proxy.tokenize_worker.close()

        return asyncio.run(go())

    limit = ProxySettings().tokenize_max_chars
    cold = run(0)
    assert len(calls) == 1 and calls[0] <= 1024  # nothing held: the probe only
    assert not cold.exact and cold.tokens == full[: len(cold.tokens)] and len(cold.tokens) % block == 0
    assert abs(cold.total - len(full)) / len(full) < 0.2, (cold.total, len(full))

    probe_blocks = len(cold.tokens) // block
    part = run((probe_blocks + 3) * block)  # the probe held, the next stage not wholly
    assert len(calls) == 2 and calls[0] <= 1024 and calls[0] + calls[1] <= 4 * 1024
    assert part.tokens == full[: len(part.tokens)] and len(part.tokens) > len(cold.tokens)
    assert (
        tok.splits_at_spaces
    )  # so the second stage read only what the first did not, and its ids are the whole's

    # every block held: 4x a stage while that leaves over three quarters of the bound to read, then the bound
    hot = run(len(full))
    assert len(calls) == 3 and calls[0] + calls[1] <= 4 * 1024 < limit // 2 < calls[2] <= limit
    assert hot.tokens == full[: len(hot.tokens)] and len(hot.tokens) > len(part.tokens)
    assert sum(calls) <= 4 / 3 * calls[-1]  # the stages cost at most a third more than the last pass alone

    # the keys hashed to ask the index come with the ids kept (intake looks them up, the plan records them)
    assert part.keys == block_keys(part.tokens, block)

    # a probe shorter than one block reads more even with nothing held: a lookup needs a whole block
    tiny = run(0, probe=100)
    assert len(calls) == 2 and calls[0] <= 100 < calls[1] <= 400
    assert len(tiny.tokens) >= block and tiny.tokens == full[: len(tiny.tokens)]

    # once prompts were seen, the probe is about two blocks of their text (~2.1 characters a token here)
    tok.chars_per_token = None
    seen_ids = tok.encode_text(text[:4096], True)
    tok.note_length(4096, len(seen_ids))
    proxy = SimpleNamespace(
        tokenizer=tok,
        settings=ProxySettings(block_size=block),
        tokenize_worker=None,
        index=PrefixIndex(block),
        token_cache=None,
    )
    calls.clear()
    seen = asyncio.run(encode_bounded(proxy, text, True))  # type: ignore[arg-type]
    assert len(calls) == 1 and 2 * block * 4096 / len(seen_ids) - 10 <= calls[0] <= 2 * block * 4096 / len(
        seen_ids
    )
    assert 1 <= len(seen.tokens) // block <= 2 and seen.tokens == full[: len(seen.tokens)]

    off = run(0, probe=limit)  # no stages: the bounded prefix in one pass
    assert len(calls) == 1 and limit // 2 < calls[0] <= limit and off.tokens == hot.tokens

    by_worker = run(
        len(full), probe=5_000, worker=True
    )  # stages past 16 KB are hashed into keys by the worker
    assert len(calls) == 1 and calls[0] <= 5_000  # the probe in-process, the rest in the worker
    assert by_worker.tokens == [] and by_worker.keys == block_keys(hot.tokens, block)

    # a prompt whose length could overflow the context is counted whole, whatever is held
    short = text[:20_000]
    room = 15_000  # its bound (20,002 tokens) does not fit; its ~10,600 tokens do
    calls.clear()
    index = PrefixIndex(block_size=block)
    proxy = SimpleNamespace(
        tokenizer=tok,
        settings=ProxySettings(block_size=block),
        tokenize_worker=None,
        index=index,
        token_cache=None,
    )
    counted = asyncio.run(encode_bounded(proxy, short, True, room))  # type: ignore[arg-type]
    assert counted.exact and counted.total == len(on_loop(short, True)) and calls == [len(short)]


async def _in_worker(proxy: Any, tokenizer_dir: str, block: int, text: str) -> Any:
    """``encode_bounded`` of ``text`` with a tokenize worker process of its own."""
    from vllm_disagg.router.intake import encode_bounded
    from vllm_disagg.router.tokenize_worker import TokenizeWorker

    worker = TokenizeWorker(tokenizer_dir, block)
    try:
        proxy.tokenize_worker = worker
        return await encode_bounded(proxy, text, True)
    finally:
        await worker.close()


def test_a_bounded_prefix_tokenizes_as_the_whole_prompt_does(tiny_model: str) -> None:
    """The prefix the index sees is exactly the whole prompt's first tokens (whole blocks), and the estimated length
    is close to the real one; the GIL-free encoder gives the same ids as the plain one."""
    import asyncio
    import random
    from types import SimpleNamespace

    from vllm_disagg.router.config import ProxySettings
    from vllm_disagg.router.intake import WORKER_CHARS, encode_bounded
    from vllm_disagg.router.prefix_index import block_keys
    from vllm_disagg.router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(tiny_model)
    rnd = random.Random(3)
    words = ["alpha", "beta,", "gamma.", "delta", "123", "straße", "東京", "(x)", "  ", "\n"]
    text = " ".join(rnd.choice(words) for _ in range(40_000))
    full = tok.encode_text(text, True)
    for limit, block in ((65_536, 128), (10_000, 16)):
        settings = ProxySettings(tokenize_max_chars=limit, block_size=block, tokenize_probe_chars=limit)
        proxy = SimpleNamespace(
            tokenizer=tok, settings=settings, tokenize_worker=None, index=None, token_cache=None
        )
        got = asyncio.run(encode_bounded(proxy, text, True))  # type: ignore[arg-type]
        assert not got.exact
        assert got.tokens and len(got.tokens) % block == 0
        assert got.tokens == full[: len(got.tokens)]
        assert abs(got.total - len(full)) / len(full) < 0.1, (got.total, len(full))

        by_worker = asyncio.run(_in_worker(proxy, tiny_model, block, text))
        if limit <= WORKER_CHARS:  # a prefix this short stays in-process, worker or not
            assert by_worker.keys is None and by_worker.tokens == got.tokens
            continue
        # the worker process: the same prefix, as block keys, and the same estimate
        assert by_worker.tokens == [] and by_worker.total == got.total and not by_worker.exact
        assert by_worker.keys == block_keys(got.tokens, block)
        whole = text[: limit - 1]  # within the bound: tokenized whole, exact
        by_worker = asyncio.run(_in_worker(proxy, tiny_model, block, whole))
        ids = tok.encode_text(whole, True)
        assert by_worker.exact and by_worker.total == len(ids) and by_worker.keys == block_keys(ids, block)
    assert asyncio.run(tok.encode_off_loop(text[:50_000], True)) == tok.encode_text(text[:50_000], True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_queued_past_the_deadline_after_prefill_answered_is_a_504(
    tiny_model: str, stream: bool
) -> None:
    """The reaper must stop the decode leg too, not only a prefill leg that already finished."""
    with _pd_behind_a_short_deadline(tiny_model) as rp:
        body = {
            "model": tiny_model,
            "prompt": "hi",
            "max_tokens": 4,
            "stream": stream,
            "mock_decode_delay_s": 30,
        }
        r = httpx.post(rp.url + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 504, r.text
        proxy = rp.proxy
        assert proxy.ledger.in_flight() == 0 and not proxy.legs and proxy.active == 0
        assert all(i.in_flight == 0 for i in proxy.registry.instances.values())


def test_a_late_prefill_answer_never_makes_a_decoding_stream_reclaimable() -> None:
    from vllm_disagg.router.ledger import TransferLedger

    now = [0.0]
    ledger = TransferLedger(deadline_s=1, clock=lambda: now[0])
    ledger.open("t", "r", "p", "d")
    ledger.mark("t", "decoding")
    ledger.mark("t", "prefill_done")  # prefill's HTTP answer after decode's first token
    now[0] = 100.0
    assert ledger.expired() == [] and ledger.in_flight() == 1


def test_split_rules_coerce_like_vllm_and_sse_patching_survives_chunk_splits() -> None:
    from vllm_disagg.router.legs import split_complete_events

    assert (
        single_instance_reason({"n": 2.0}) == "n_gt_1"
        and single_instance_reason({"best_of": "3"}) == "best_of_gt_1"
    )
    assert single_instance_reason({"prompt_logprobs": 0}) == "prompt_logprobs"
    assert single_instance_reason({"tool_choice": "required"}) == "forced_tool_choice"
    assert single_instance_reason({"tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert single_instance_reason({"tool_choice": "auto"}) == ""
    event = b'data: {"usage":{"completion_tokens":123,"prompt_tokens_details":{"cached_tokens":9}}}\r\n\r\n'
    head, tail = split_complete_events(event[:40])
    assert head == b"" and tail == event[:40]  # held back until the event is whole
    done, rest = split_complete_events(tail + event[40:])
    assert rest == b"" and completion_tokens(done) == 123
    five = {"cached_tokens": 5}
    assert patch_sse_usage(done, five).endswith(b"}\r\n\r\n") and b'"cached_tokens": 5' in patch_sse_usage(
        done, five
    )
    assert count_sse_events(b'data: {"text":"data: x"}\n\n') == 1
    assert count_sse_events(b'data: {"text":"data: [DONE]"}\n\ndata: [DONE]\n\n') == 1


def test_a_stage_reads_only_the_rest_where_the_last_cut_is_a_word_boundary() -> None:
    """``_continues``: the ids of the text read so far are kept only where they end before a single space after a
    word, for a tokenizer that splits at spaces, and the rest is short enough to be read in-process."""
    from types import SimpleNamespace

    from vllm_disagg.router.intake import WORKER_CHARS, _continues

    splits, whole = SimpleNamespace(splits_at_spaces=True), SimpleNamespace(splits_at_spaces=False)
    text = "alpha beta  gamma delta"
    at_beta, in_run = text.index(" beta"), text.index(" gamma")  # before " gamma" is another space
    assert _continues(splits, text, at_beta, len(text))  # type: ignore[arg-type]
    assert not _continues(whole, text, at_beta, len(text))  # type: ignore[arg-type]
    assert not _continues(splits, text, in_run, len(text))  # type: ignore[arg-type]
    assert not _continues(splits, text, 0, len(text))  # type: ignore[arg-type]
    assert not _continues(splits, text, text.index("eta"), len(text))  # type: ignore[arg-type]  # mid-word
    long = "word " * WORKER_CHARS
    assert not _continues(splits, long, 4, 4 + WORKER_CHARS + 1)  # type: ignore[arg-type]  # the worker's


def test_a_prompt_that_repeats_a_recent_prefix_is_tokenized_only_past_it(tiny_model: str) -> None:
    """With the prefix token cache, a second prompt sharing a first one's beginning reads only from the last
    checkpoint they share, and its ids are the whole text's; over 2 KB to read, the pieces are read off the loop."""
    import asyncio
    import random
    from types import SimpleNamespace

    from vllm_disagg.router.config import ProxySettings
    from vllm_disagg.router.intake import encode_bounded
    from vllm_disagg.router.token_cache import PrefixTokenCache
    from vllm_disagg.router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(tiny_model)
    rnd = random.Random(5)
    words = ["system:", "you", "are", "a", "helpful", "assistant.", "Answer", "briefly,", "42", "(yes)"]
    shared = " ".join(rnd.choice(words) for _ in range(900))  # ~5,000 characters
    first = shared + " " + " ".join(rnd.choice(words) for _ in range(60))
    second = shared + " " + " ".join(rnd.choice(words) for _ in range(60))
    calls: list[tuple[str, int]] = []
    on_loop, off_loop = tok.encode_text, tok.encode_pieces_off_loop

    def recording_on(t: str, special: bool) -> list[int]:
        calls.append(("on_loop", len(t)))
        return on_loop(t, special)

    async def recording_off(pieces: list[tuple[str, bool]]) -> list[list[int]]:
        calls.extend(("off_loop", len(t)) for t, _ in pieces)
        return await off_loop(pieces)

    tok.encode_text = recording_on  # type: ignore[method-assign]
    tok.encode_pieces_off_loop = recording_off  # type: ignore[method-assign]
    limit = ProxySettings().tokenize_max_chars
    proxy = SimpleNamespace(
        tokenizer=tok,
        settings=ProxySettings(block_size=128, tokenize_probe_chars=limit),  # one stage: the whole prompt
        tokenize_worker=None,
        index=None,
        token_cache=PrefixTokenCache(step_chars=1024),
    )
    got = asyncio.run(encode_bounded(proxy, first, True))  # type: ignore[arg-type]
    assert got.exact and got.tokens == on_loop(first, True)
    assert {where for where, _ in calls} == {"off_loop"} and sum(n for _, n in calls) == len(first)  # once
    calls.clear()
    got = asyncio.run(encode_bounded(proxy, second, True))  # type: ignore[arg-type]
    assert got.exact and got.tokens == on_loop(second, True)
    assert 0 < sum(n for _, n in calls) < len(second) - len(shared) + 1024  # past the last shared checkpoint
    assert proxy.token_cache.hits == 1


def test_the_proxy_counts_token_cache_hits_in_its_metrics(tiny_model: str) -> None:
    """Three prompts sharing a ~5 KB beginning through a running proxy. The first is read as far as its probe (no
    instance holds it); the second, whose beginning is now pending where the first went, is read whole and its
    checkpoints kept; the third is a hit, and /metrics says so."""
    shared = "you are a helpful assistant, answer briefly. " * 110
    with mock_backend(tiny_model) as url, running_proxy(url, tiny_model, max_model_len=1_000_000) as rp:
        for tail in ("first question here", "another one", "a third"):
            body = {"model": tiny_model, "prompt": shared + tail, "max_tokens": 4, "stream": True}
            assert httpx.post(rp.url + "/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(rp.url + "/metrics", timeout=30).text
    assert 'vllm_disagg_token_cache_lookups_total{result="hit"} 1.0' in text, text[-3000:]
    assert "vllm_disagg_token_cache_bytes " in text


def test_a_request_that_fails_everywhere_gets_the_instances_error_and_ejects_no_one(tiny_model: str) -> None:
    """An instance's 503 before the first token sends the request to another instance. Failing there too, it is the
    request's fault (a body vLLM cannot handle): the client gets the instance's own error and no instance is
    ejected for it. Failing only on one, that instance's errors count toward its circuit breaker. A 500 is relayed
    at once: the request may be what broke the instance, so it is not sent on to the next."""
    with mock_backend(tiny_model) as a, mock_backend(tiny_model) as b:
        instances = [InstanceConfig(url=a, role="both", id="a"), InstanceConfig(url=b, role="both", id="b")]
        with running_proxy(a, tiny_model, instances=instances, breaker_failures=3) as rp:
            admin = {"x-admin-key": ADMIN_KEY}

            def post(**extra: Any) -> httpx.Response:
                body = {"model": tiny_model, "prompt": "hi", "max_tokens": 2, **extra}
                return httpx.post(rp.url + "/v1/completions", json=body, timeout=30)

            def ejected() -> set[str]:
                listed = httpx.get(rp.url + "/admin/instances", headers=admin, timeout=5).json()["instances"]
                return {i["id"] for i in listed if i["breaker_open"]}

            for _ in range(4):
                r = post(mock_http_error=503)
                assert r.status_code == 503 and r.json()["error"]["type"] == "InternalServerError", r.text
            assert ejected() == set()
            assert post().status_code == 200
            port_a = int(a.rsplit(":", 1)[1])
            statuses = [post(mock_http_error=500, mock_http_error_port=port_a).status_code for _ in range(8)]
            assert (
                500 in statuses and set(statuses) <= {200, 500} and ejected() == set()
            )  # "a"'s 500s relayed
            # The pass-through routes alike (an idle proxy tries "a" first): its 500 comes back as it is, its 503
            # sends the request on to "b".
            for status, expected in ((500, 500), (503, 200)):
                tokenize = {"model": tiny_model, "prompt": "hi", "mock_http_error": status,
                            "mock_http_error_port": port_a}  # fmt: skip
                r = httpx.post(rp.url + "/tokenize", json=tokenize, timeout=30)
                assert r.status_code == expected, (status, r.text)
            for _ in range(20):  # requests planned on "a" first fail there and are served by "b"
                assert post(mock_http_error=503, mock_http_error_port=port_a).status_code == 200
                if ejected():
                    break
            assert ejected() == {"a"}


def test_instances_that_fail_every_prompt_do_not_hide_one_that_works(tiny_model: str) -> None:
    """Two instances whose /tokenize answers 500 for a prompt another instance tokenizes: the third, working one is
    still asked whatever the order, and the two are then held to their answers (the search used to stop at them,
    never reporting them, so the prompt failed for good)."""
    with mock_backend(tiny_model) as a, mock_backend(tiny_model) as b, mock_backend(tiny_model) as c:
        instances = [
            InstanceConfig(url=a, role="both", id="a"),
            InstanceConfig(url=b, role="both", id="b"),
            InstanceConfig(url=c, role="both", id="c"),
        ]
        with running_proxy(a, tiny_model, instances=instances, tokenizer=None, health_interval_s=30) as rp:
            fails = " ".join(f"mock-tokenize-fail:{u.rsplit(':', 1)[1]}" for u in (a, b))
            registry = rp.proxy.registry
            for _ in range(40):  # equally busy instances are tried in a random order
                r = httpx.post(
                    rp.url + "/v1/chat/completions",
                    json={
                        "model": tiny_model,
                        "messages": [{"role": "user", "content": [{"type": "text", "text": fails}]}],
                        "max_tokens": 2,
                    },
                    timeout=30,
                )
                assert r.status_code == 200, r.text
                if registry.get("a").last_error and registry.get("b").last_error:
                    break
            assert registry.get("a").last_error == registry.get("b").last_error == "tokenize: HTTP 500"
            assert registry.get("c").last_error == ""


def test_prompt_embeds_are_served_on_one_instance_and_a_missing_prompt_is_named(tiny_model: str) -> None:
    """A request with prompt_embeds (vLLM's --enable-prompt-embeds) has no prompt to tokenize: it is routed to one
    instance, not refused. A request with neither gets vLLM's own words."""
    with mock_backend(tiny_model) as url, running_proxy(url, tiny_model) as rp:
        body = {"model": tiny_model, "prompt_embeds": "dGVuc29y", "max_tokens": 2}
        r = httpx.post(rp.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        missing = httpx.post(
            rp.url + "/v1/completions", json={"model": tiny_model, "max_tokens": 2}, timeout=30
        )
        assert missing.status_code == 400
        error = missing.json()["error"]
        assert error["message"].startswith("Either prompt or prompt_embeds must be provided")
        assert error["param"] == "prompt"  # as vLLM names it; not a tokenizer's failure
        for bad, param in (
            ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
            ({"prompt": 5, "max_tokens": 2}, "prompt"),
        ):
            r = httpx.post(rp.url + "/v1/completions", json={"model": tiny_model, **bad}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(
            rp.url + "/v1/chat/completions", json={"model": tiny_model, "messages": "hi"}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "cannot tokenize" not in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("status", "type_"),
    [(400, "BadRequestError"), (404, "NotFoundError"), (429, "Too Many Requests"), (520, "Error")],
)
def test_the_proxys_own_errors_are_shaped_as_vllms(status: int, type_: str) -> None:
    """vLLM's type names where vLLM has one, the HTTP phrase otherwise, and a status no table knows (a gateway's
    520 relayed from /tokenize) still answers instead of raising."""
    resp = openai_error(status, "why", "prompt")
    assert resp.status_code == status
    assert json.loads(bytes(resp.body)) == {
        "error": {"message": "why", "type": type_, "param": "prompt", "code": status}
    }


def test_a_completion_without_special_tokens_is_counted_and_indexed_without_them(tiny_model: str) -> None:
    """vLLM honours ``add_special_tokens: false`` on /v1/completions: the proxy's ids (its count, its prefix-index
    keys) must be those the instance computes, or such prompts never match a cached prefix."""
    import asyncio

    from vllm_disagg.policy.builtin import AlwaysTransfer
    from vllm_disagg.router.app import Proxy
    from vllm_disagg.router.config import ProxySettings
    from vllm_disagg.router.intake import tokenize
    from vllm_disagg.router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(tiny_model)
    text = " ".join(["alpha beta gamma delta"] * 10)  # tokenized whole: a few blocks
    proxy = Proxy(
        ProxySettings(tokenizer=tiny_model, block_size=16), AlwaysTransfer()
    )  # a policy that reads token counts
    for special in (True, False):
        body = {"prompt": text, "add_special_tokens": special}
        got = asyncio.run(tokenize(proxy, "completions", body))
        assert got.exact and got.tokens == tok.encode_text(text, special)
    assert tok.encode_text(text, True) != tok.encode_text(text, False)  # the tiny model adds a BOS
