"""A request's intake: from the client's bytes to a ``RequestContext`` the exchange can plan, or an OpenAI error.

Checks run cheapest first (JSON, the model, ``max_tokens``), then the prompt is tokenized the way the instances do it
and looked up in the prefix index. Nothing a client sends reaches the data plane: ``kv_transfer_params`` is removed
here (only the proxy names transfer peers).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from starlette.responses import JSONResponse, Response

from vllm_disagg.policy.api import NoRoute
from vllm_disagg.router.http_server import error_type
from vllm_disagg.router.interrupts import Interrupts
from vllm_disagg.router.legs import take_client_kv_params
from vllm_disagg.router.prefix_index import BlockKeys, iter_block_keys, salted_root
from vllm_disagg.router.token_cache import follows_word
from vllm_disagg.router.tokenize_worker import TokenizeWorkerError
from vllm_disagg.router.tokenizer import NotLocal, PromptTokenizer, local_chat, remote_tokenize
from vllm_disagg.router.upstream import HTTPStatusError, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from vllm_disagg.router.app import Proxy
    from vllm_disagg.router.config import ProxySettings
    from vllm_disagg.router.token_cache import PrefixTokenCache
    from vllm_disagg.router.tokenize_worker import TokenizeWorker


class TokenizingProxy(Protocol):
    """What tokenizing a prompt reads of the proxy (``encode_bounded``; a test stands a namespace in for it)."""

    @property
    def tokenizer(self) -> PromptTokenizer | None: ...

    @property
    def settings(self) -> ProxySettings: ...

    @property
    def tokenize_worker(self) -> TokenizeWorker | None: ...

    @property
    def index(self) -> Any: ...

    @property
    def token_cache(self) -> PrefixTokenCache | None: ...


PASS_HEADERS = ("authorization", "x-request-id")
# A client's x-request-id is kept (in logs, the answer, both legs) only when it is 1-128 visible ASCII characters:
# anything else (a byte vLLM's log viewer takes for a line break, a 60 KB id) is replaced by one the proxy makes.
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")
# Request ids the proxy makes: unique per process start (a random prefix) and cheap (a counter, no urandom call).
_ID_PREFIX = uuid.uuid4().hex[:8]
_ids = itertools.count(1)
# Prompts longer than this are tokenized with the GIL released, off the event loop (on a small vocabulary 2,048
# characters are ~0.8 ms of tokenizing: the longest stall an on-loop prompt causes the other streams).
OFF_LOOP_CHARS = 2_048
# Longer texts go to the tokenize worker process (router/tokenize_worker.py: a thread would hold the GIL for
# milliseconds building their ids); its round trip costs more than a thread's below this.
WORKER_CHARS = 16_384

_DECODE = msgspec.json.Decoder().decode


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN/Infinity or out-of-range numbers, which could not be forwarded; UTF-8 without lone
    surrogates), bounded nesting; ValueError otherwise. A leading UTF-8 byte order mark is skipped, as vLLM does."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        body = _DECODE(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except msgspec.MsgspecError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


# The inference routes the proxy splits into prefill and decode, and the kind of request each carries.
HOT_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat/completions"}


def _lax_int(v: object) -> int | None:
    """``v`` as vLLM's request models read an integer field (pydantic's lax mode): an int, a bool, an integral float
    or a string of digits; None for anything else."""
    if isinstance(v, bool | int):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit() and len(v) <= 20:
        return int(v)
    return None


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(v: object) -> bool | None:
    """``v`` as vLLM's request models read a boolean field (pydantic's lax mode): a bool, 0/1, or a string such as
    "true"/"false"/"yes"/"off"; None for anything else (vLLM refuses it)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
    return None


class BadField(ValueError):
    """A request field vLLM would refuse, named in the error's ``param`` as vLLM names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    """Chat's ``max_completion_tokens``, else ``max_tokens``, as vLLM takes them (the first wins when both are set),
    None when the client set neither; ValueError for a value vLLM would refuse."""
    chosen = None
    for key in ("max_completion_tokens", "max_tokens"):
        raw = body.get(key)
        if raw is None:
            continue
        v = _lax_int(raw)
        if v is None or v < 1:
            if v == 0 and key == "max_tokens":
                continue  # 0 is treated as unset, like an absent field
            raise BadField(key, f"'{key}' must be a positive integer, got {raw!r}")
        chosen = v if chosen is None else chosen
    return chosen


def truncation(body: dict[str, Any], limit: int) -> int | None:
    """The prompt tokens vLLM keeps under ``truncate_prompt_tokens`` (-1: the context), None without it."""
    raw = body.get("truncate_prompt_tokens")
    v = None if raw is None or isinstance(raw, bool) else _lax_int(raw)
    if v is None or v < -1:
        return None  # vLLM refuses what is not an int >= -1 itself
    return limit if v == -1 else v


def client_request_id(value: str | None) -> str | None:
    """A client's x-request-id, or None when it is not one the proxy repeats (see ``_CLIENT_ID``)."""
    return value if value is not None and _CLIENT_ID.fullmatch(value) else None


def openai_error(status: int, message: str, param: str | None = None, **headers: str) -> JSONResponse:
    """An error shaped as vLLM's own (``type`` by status, ``code`` the status), so that a client sees one shape
    whether the proxy or an instance refused its request."""
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers or None)


@dataclass
class RequestContext:
    """What intake learned about one request; the exchange plans and serves from it."""

    request_id: str
    kind: str  # "completions" | "chat/completions"
    body: dict[str, Any]
    tokens: list[
        int
    ]  # the prompt's token ids, or those of its first whole blocks when it was long (see tokenize)
    # what the prefix index is asked with: ``tokens``, or their block keys if long (empty: less than one block)
    index_keys: Sequence[int]
    prompt_tokens: int  # the prompt's length (estimated beyond the tokenized prefix)
    max_tokens: int
    stream: bool
    # the output length the client set (max_tokens or max_completion_tokens), 0 when it set none: what the policy
    # is told of the request's stream once it runs (``InstanceView.shortest_stream``)
    stream_tokens: int
    headers: dict[str, str]  # the client's headers passed on to the instances
    t0: float
    cached: dict[str, int]
    interrupts: Interrupts
    # tokens after ``cached`` held by a tier beneath the instance
    tier: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    flow: str = ""  # of a transfer: "parallel" or "sequential"
    body_unchanged: bool = True  # the client's bytes can be forwarded as they are
    span: Any = None  # the request's tracing span (router/tracing.py), when tracing is on
    excluded: frozenset[str] = frozenset()  # instances that do not serve the request's model

    def prompt_split(self, instance: str | None) -> tuple[int, int, int]:
        """The prompt on ``instance``: (tokens in its cache, tokens it loads from its tier, tokens it computes)."""
        n = self.prompt_tokens
        cached = min(self.cached.get(instance or "", 0), n)
        tier = min(self.tier.get(instance or "", 0), n - cached)
        return cached, tier, n - cached - tier


def new_request_id() -> str:
    """An id for a request whose client sent none (or one that cannot be repeated safely)."""
    return f"vd-{_ID_PREFIX}{next(_ids):x}"


async def admit(
    proxy: Proxy, headers: dict[str, str], raw: bytes, kind: str, ix: Interrupts, t0: float
) -> RequestContext | Response:
    """Validate, tokenize and look up one request; an OpenAI-style error response for anything unservable."""
    metrics = proxy.metrics
    try:
        body = parse_json_object(raw)
    except ValueError as exc:
        return proxy.reject("malformed", openai_error(400, f"malformed JSON body: {exc}"))
    request_id = client_request_id(headers.get("x-request-id")) or new_request_id()
    kv_taken = take_client_kv_params(body)
    if kv_taken:
        # Only the proxy may name transfer peers: a client's params could make an instance dial an address of its
        # choosing or pin KV blocks for a phantom transfer.
        metrics.client_kv_params.inc()
        left_out = proxy.client_kv_params_log.due(time.monotonic())
        if left_out is not None:
            proxy.log.warning(
                "request %s: removed client-sent kv_transfer_params / ec_transfer_params (the proxy sets them)%s",
                request_id,
                f"; {left_out} more since the last such line (vllm_disagg_client_kv_params_total counts each)"
                if left_out
                else "",
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return proxy.reject("malformed", openai_error(400, "'model' must be a string", "model"))
    try:
        requested = requested_max_tokens(body)
    except BadField as bad_max:
        return proxy.reject("malformed", openai_error(400, str(bad_max), bad_max.param))
    stream = False if body.get("stream") is None else lax_bool(body["stream"])
    if stream is None:
        return proxy.reject(
            "malformed",
            openai_error(400, f"'stream' must be a boolean, got {body['stream']!r}", "stream"),
        )
    max_tokens = requested or 16  # the OpenAI completions default
    excluded: frozenset[str] = frozenset()
    if model is not None:
        if (unknown := unknown_model(proxy, model)) is not None:
            return unknown
        excluded = proxy.instances_without(model)
    limit = proxy.max_model_len()
    kept = None if limit is None else truncation(body, limit)
    # vLLM refuses a prompt longer than the context and shortens max_tokens to what is left beside it; a prompt it
    # truncates to ``kept`` tokens may be any length here
    room = limit if kept is None else None
    salt = body.get("cache_salt")
    root = salted_root(salt) if isinstance(salt, str) and salt else None
    # Read whole: a truncated prompt is looked up by its end; a salted one by keys the staged reading cannot check
    # against the index as it goes (it hashes from the unsalted root).
    whole = kept is not None or root is not None
    try:
        tokenized = await tokenize(proxy, kind, body, excluded, room, whole=whole)
    except NoRoute as no_route:
        return proxy.reject("no_route", openai_error(503, str(no_route), **{"Retry-After": "2"}))
    except TokenizeFailed as failed:
        proxy.log.warning("request %s: no instance could tokenize its prompt (%s)", request_id, failed)
        return proxy.reject(
            "bad_prompt",
            openai_error(
                failed.status,
                f"the instances failed to tokenize this prompt ({failed}); if it refers to media, check that they "
                "can fetch it",
            ),
        )
    except BadField as bad_field:  # the prompt or messages field itself, before any tokenizer saw it
        return proxy.reject("bad_prompt", openai_error(400, str(bad_field), bad_field.param))
    except (ValueError, TypeError, KeyError, HTTPStatusError) as bad:
        return proxy.reject("bad_prompt", openai_error(400, f"cannot tokenize the prompt: {bad}"))
    tokens, n = tokenized.tokens, tokenized.total
    if kept is not None:
        n = min(n, kept)
    if tokenized.exact and limit is not None:
        if n > limit:
            return proxy.reject(
                "too_long",
                openai_error(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your prompt contains {n} "
                    "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                    "length of the input prompt.",
                    "input_tokens",
                ),
            )
        max_tokens = max(1, min(max_tokens, limit - n))  # what vLLM will generate at most
    keys: Sequence[int] = ()  # less than one whole block: nothing to look up or record
    hits: dict[str, Any] = {}
    # vLLM keys a LoRA adapter's blocks apart from the same tokens' plain blocks (the index leaves those out): such
    # a request matches nothing here and records nothing. A salted request's chain starts from its salt.
    apart = model is not None and proxy.is_adapter(model)
    index = None if apart or (salt and root is None) else proxy.index
    truncated = kept is not None and tokenized.total > kept
    if index is None:
        pass
    elif truncated:
        # vLLM keeps the prompt's last ``kept`` tokens: their blocks are the ones to look up and record, and
        # they are known only when every token id is
        assert kept is not None
        if tokenized.exact and len(tokens) == tokenized.total and kept >= index.block_size:
            keys = await hash_blocks(tokens[-kept:], index.block_size, root)
            hits = index.match_tiers(keys)
    elif tokenized.keys is not None and root is None:  # keys hashed with the ids, from the unsalted root
        keys = tokenized.keys if tokenized.keys.block_size == index.block_size else ()
        hits = index.match_tiers(keys) if keys else {}
    elif len(tokens) >= index.block_size:
        keys = await hash_blocks(tokens, index.block_size, root)
        hits = index.match_tiers(keys)
    if hits and index is not None:
        # vLLM computes a prompt's last token whatever it caches: a prompt of whole blocks reuses all but its last
        reusable = (n - 1) // index.block_size * index.block_size if n > 0 else 0
        hits = {iid: h.capped(reusable) for iid, h in hits.items()}
    metrics.tally.inc(metrics.prompt_tokens, n)
    return RequestContext(
        request_id=request_id,
        kind=kind,
        body=body,
        tokens=tokens,
        index_keys=keys,
        prompt_tokens=n,
        max_tokens=max_tokens,
        stream=stream,
        stream_tokens=min(requested, max_tokens) if requested else 0,
        headers={
            k: request_id if k == "x-request-id" else v
            for k in PASS_HEADERS
            if (v := headers.get(k)) is not None
        },
        t0=t0,
        cached={iid: h.cached_tokens for iid, h in hits.items()},
        tier={iid: h.tier_tokens for iid, h in hits.items() if h.tier_tokens},
        interrupts=ix,
        body_unchanged=not kv_taken,
        excluded=excluded,
    )


@dataclass
class Tokenized:
    """What routing needs of a prompt's tokens: the ids of its first part (the prefix the index matches, in whole
    blocks when bounded) and its length (estimated when the prompt was longer than the bound)."""

    tokens: list[int]
    total: int
    exact: bool = True
    keys: BlockKeys | None = None  # the index keys of the tokenized whole blocks, when computed with the ids


def unknown_model(proxy: Proxy, model: str, inference: bool = True) -> Response | None:
    """A 404 naming what is served when no instance serves ``model`` (None while the instances' models are
    unknown: they are read by the first probe)."""
    served = proxy.served_models()
    if not served or model in served:
        return None
    return proxy.reject(
        "unknown_model",
        openai_error(
            404,
            f"The model `{model}` does not exist. Models served here: {', '.join(sorted(served))}",
            "model",
        ),
        inference,
    )


async def tokenize(
    proxy: Proxy,
    kind: str,
    body: dict[str, Any],
    excluded: frozenset[str] = frozenset(),
    room: int | None = None,
    whole: bool = False,
) -> Tokenized:
    """The prompt's token ids as the instances will see them: given ids, the local tokenizer, or an instance's.
    ``room``: the prompt tokens that fit the context (None: no known limit, or vLLM truncates the prompt).
    ``whole``: every id up to ``tokenize_max_chars`` (a truncated prompt is looked up by its tail).

    A policy that declares ``needs_tokens = False`` (and routes without the prefix index) gets no tokenization: the
    length is estimated from the characters and the instances check the context length themselves."""
    tokenizer = proxy.tokenizer
    needs = getattr(proxy.policy, "needs_tokens", True)
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one prompt, text or token ids
        if isinstance(prompt, list) and room is not None and len(prompt) > room:
            # longer than the context whatever its items are (refused as too long): not walked on the event loop
            return Tokenized([], len(prompt))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if prompt and not all(0 <= t < 2**31 for t in prompt):
                raise BadField("prompt", "token ids must be between 0 and 2**31 - 1")
            return Tokenized(list(prompt), len(prompt))
        if prompt is None or prompt == "":
            if body.get("prompt_embeds"):
                # vLLM's --enable-prompt-embeds: no ids to count or match, and one instance serves it
                # (``single_instance_reason``); the instance checks the length itself
                return Tokenized([], 0, exact=False)
            raise BadField("prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
        if not isinstance(prompt, str):
            raise BadField(
                "prompt",
                "'prompt' must be a string or a list of token ids (batched prompts: one per request)",
            )
        if not needs:
            return Tokenized([], _estimate(len(prompt)), exact=False)
        if tokenizer is not None:
            # as vLLM reads the field (an invalid one is refused there; counted here as the default)
            special = lax_bool(body.get("add_special_tokens", True))
            return await encode_bounded(proxy, prompt, special is not False, room, whole)
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadField("messages", "'messages' must be a non-empty list")
        if not needs:
            return Tokenized([], _estimate(sum(len(str(m)) for m in messages)), exact=False)
        if tokenizer is not None and local_chat(body):
            try:
                # as vLLM reads the field: "false" is false (an invalid value is refused there)
                generation_prompt = lax_bool(body.get("add_generation_prompt", True)) is not False
                text = tokenizer.render_chat(messages, generation_prompt)
            except NotLocal:
                pass
            else:
                return await encode_bounded(proxy, text, False, room, whole)
    ids = await tokenize_remotely(proxy, body, excluded)
    return Tokenized(ids, len(ids))


_HASH_SLICE = 16  # blocks hashed between two returns to the event loop (~0.2 ms at 128 tokens a block)


async def hash_blocks(tokens: list[int], block_size: int, root: bytes | None = None) -> BlockKeys:
    """The prefix index's keys of a prompt's whole blocks, computed once: the lookup, the pending record where it is
    computed and the routing record after it all read them (each would hash the ids again). A long prompt's are
    hashed in slices that let other streams run in between."""
    n_blocks = len(tokens) // block_size
    it = iter_block_keys(tokens, block_size, n_blocks, root)
    if n_blocks <= _HASH_SLICE:
        return BlockKeys(list(it), block_size)
    keys = BlockKeys(block_size=block_size)
    while len(keys) < n_blocks:
        keys.extend(itertools.islice(it, _HASH_SLICE))
        await asyncio.sleep(0)
    return keys


def _estimate(chars: int) -> int:
    return max(1, chars // 4)  # ~4 characters per token in English text


async def encode_bounded(
    proxy: TokenizingProxy, text: str, special: bool, room: int | None = None, whole: bool = False
) -> Tokenized:
    """Tokenize ``text``, or only a prefix of it, or none of it.

    An ASCII text too short to fill one KV block is not tokenized when the tokenizer bounds its length
    (``ascii_token_bound``) and that bound fits ``room``: the index matches whole blocks, so it has nothing to look up,
    and the context cannot overflow. Its length is then estimated.

    A long text is tokenized in stages: first about two KV blocks of text (``_probe_chars``), then four times as
    many, up to ``tokenize_max_chars``, continuing only while some instance holds every whole block tokenized so far
    (or while no whole block has been read yet). The index matches leading blocks, so past the first block no
    instance holds, more tokens cannot change a lookup; a long prompt with nothing cached costs its probe, one that
    is cached costs at most a third more than one pass. Stages stop early only where the count need not be exact:
    the text is over ``tokenize_max_chars`` anyway, or its length bound fits ``room``.

    A prefix ends before a space, so the words it keeps tokenize as they do in the whole text, and only whole blocks
    of it are kept. The length is estimated from the prefix's characters per token. Long inputs are tokenized with
    the GIL released, so other streams keep moving meanwhile. ``whole`` reads every stage up to
    ``tokenize_max_chars`` whatever the index holds (a truncated prompt is looked up by its end)."""
    tokenizer = proxy.tokenizer
    assert tokenizer is not None
    settings = proxy.settings
    block = max(settings.block_size, 1)
    bound = tokenizer.ascii_token_bound(len(text), special) if text.isascii() else None
    if bound is not None and bound < block and (room is None or bound <= room) and not whole:
        return Tokenized([], min(bound, _estimate(len(text))), exact=False)
    limit = settings.tokenize_max_chars
    size = limit
    index = proxy.index
    # keys of another block size would not match (intake looks such a prompt up by its ids instead)
    held = index.held_blocks if index is not None and index.block_size == block else None
    may_estimate = not whole and (len(text) > limit or room is None or (bound is not None and bound <= room))
    probe = _probe_chars(tokenizer.chars_per_token, block, settings.tokenize_probe_chars, limit)
    if may_estimate and probe < min(limit, len(text)):
        size = probe
    cut = 0
    ids: list[int] | None = None
    keys: list[int] = []
    while True:
        read, ids_read = cut, ids
        cut, spaced = _cut(text, size)
        count, ids, keys = await _prefix_ids(proxy, text, cut, special, read, ids_read)
        if count >= block:  # enough text to say how much of it a block holds
            tokenizer.note_length(cut, count)
        # whole blocks the index may match: without a space to end a prefix on, its last block may differ
        blocks = max(count // block - (0 if spaced else 1), 0)
        # the index keys of those blocks, hashed once: intake looks them up and the plan records them
        whole_keys = BlockKeys(keys[:blocks], block) if ids is None else None
        if size >= limit or cut == len(text) or held is None:
            break
        if blocks:
            if whole_keys is None:
                assert ids is not None
                whole_keys = await hash_blocks(ids[: blocks * block], block)
            if held(whole_keys) < blocks:
                break  # the lookup ends inside this prefix
        # else a prefix shorter than one block (a large block, long tokens): nothing to look up yet, read more.
        # Four times as much, or all of it where that would leave under three quarters to read: a stage short of
        # the whole text is then at most a quarter of it, so all the stages cost at most a third more than one pass
        size = limit if size * 16 >= min(len(text), limit) else size * 4
    exact = cut == len(text)
    total = count if exact else max(count, round(count * len(text) / cut))
    if ids is None:
        return Tokenized([], total, exact, whole_keys)
    return Tokenized(ids if exact else ids[: blocks * block], total, exact, whole_keys)


_MIN_PROBE_CHARS = 256
_PROBE_BLOCKS = 2


def _probe_chars(chars_per_token: float | None, block: int, most: int, limit: int) -> int:
    """The first stage of a long prompt's tokenization: about two KV blocks of text at the characters per token
    seen so far (the lookup needs one whole block; the second absorbs a denser text), at least 256 characters and
    at most ``most`` (``--tokenize-probe-chars``, also the size before any prompt was seen; at or over ``limit``,
    ``--tokenize-max-chars``, no stages). A stage that holds no whole block reads on (``encode_bounded``)."""
    if chars_per_token is None or most >= limit:
        return most
    return min(most, max(_MIN_PROBE_CHARS, int(_PROBE_BLOCKS * block * chars_per_token)))


def _continues(tokenizer: PromptTokenizer, text: str, read: int, cut: int) -> bool:
    """Whether the ids of ``text[:read]`` (a cut before a space that follows a word) and of ``text[read:cut]``
    joined are ``text[:cut]``'s: for a tokenizer that splits words at spaces, checked when it loads. The rest goes to
    the worker process when long (it returns keys, chained from the text's start), so that one is read whole."""
    return tokenizer.splits_at_spaces and follows_word(text, read) and cut - read <= WORKER_CHARS


async def _prefix_ids(
    proxy: TokenizingProxy, text: str, cut: int, special: bool, read: int, ids_read: list[int] | None
) -> tuple[int, list[int] | None, list[int]]:
    """Token count of ``text[:cut]`` and its ids (or, from the worker process, its whole blocks' keys), reading as
    little of it as it can: from ``read`` where ``ids_read`` are ``text[:read]``'s, or from the longest prefix of it
    the token cache holds, piece by piece from checkpoint to checkpoint (each one then held)."""
    tokenizer, cache = proxy.tokenizer, proxy.token_cache
    assert tokenizer is not None
    start, ids = (
        (read, ids_read) if ids_read is not None and _continues(tokenizer, text, read, cut) else (0, None)
    )
    points: list[int] = []
    if cache is not None and tokenizer.splits_at_spaces:
        points = cache.checkpoints(text, start, cut)
        hit = cache.lookup(text, special, points)
        if hit is not None:
            start, ids = hit
            points = [c for c in points if c > start]
    if (ids is None and not points) or (cut - start > WORKER_CHARS and proxy.tokenize_worker is not None):
        # nothing to start from or to hold, or too much left for this process: read whole (the worker's when long)
        return await _encode(proxy, text if cut == len(text) else text[:cut], special)
    bounds = [start, *points, cut]
    pieces = [(text[a:b], special and a == 0) for a, b in itertools.pairwise(bounds)]
    if len(pieces) == 1:
        read_ids = [await _encode_ids(tokenizer, *pieces[0])]
    elif cut - start <= OFF_LOOP_CHARS:
        read_ids = [tokenizer.encode_text(piece, sp) for piece, sp in pieces]
    else:  # as long inputs are: on a thread, the GIL released
        read_ids = await tokenizer.encode_pieces_off_loop(pieces)
    out = list(ids) if ids is not None else []
    for c, piece_ids in zip(bounds[1:], read_ids, strict=True):
        out += piece_ids
        if c != cut and cache is not None:
            cache.store(text, special, c, out)
    return len(out), out, []


async def _encode_ids(tokenizer: PromptTokenizer, part: str, special: bool) -> list[int]:
    """``part``'s ids in-process: on the loop when short, on a thread when long."""
    if len(part) <= OFF_LOOP_CHARS:
        return tokenizer.encode_text(part, special)
    return await tokenizer.encode_off_loop(part, special)


def _cut(text: str, size: int) -> tuple[int, bool]:
    """Where a prefix of at most ``size`` characters ends (before a space in its second half when there is one),
    and whether it ends before a space."""
    if len(text) <= size:
        return len(text), True
    cut = text.rfind(" ", size // 2, size)
    return (cut, True) if cut > 0 else (size, False)


async def _encode(
    proxy: TokenizingProxy, part: str, special: bool
) -> tuple[int, list[int] | None, list[int]]:
    """Token count of ``part`` and either its ids (in-process: on the loop when short, on a thread when long) or,
    from the tokenize worker process for the longest texts, the keys of its whole blocks."""
    tokenizer = proxy.tokenizer
    assert tokenizer is not None
    worker = proxy.tokenize_worker
    if worker is not None and len(part) > WORKER_CHARS:
        with contextlib.suppress(TokenizeWorkerError):  # else in-process, below
            count, keys = await worker.encode_keys(part, special)
            return count, None, keys
    ids = await _encode_ids(tokenizer, part, special)
    return len(ids), ids, []


# Instances that may time out on one prompt's /tokenize before it is taken to be the cause (each costs the timeout);
# a fast 5xx answer does not stop the search
_TOKENIZE_TIMEOUTS = 2


class TokenizeFailed(Exception):
    """Every instance tried answered /tokenize with a server error or timed out, and none tokenized the prompt:
    taken as the prompt's doing (an unreachable image URL, a prompt too slow to render), answered to the client and
    not counted against the instances."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


async def tokenize_remotely(
    proxy: Proxy, body: dict[str, Any], excluded: frozenset[str] = frozenset()
) -> list[int]:
    """Tokenize on an instance that serves the model (no local tokenizer): the healthy ones in turn, like any other
    leg, least busy first and ties in a random order (a pair that fails every prompt cannot stay first for good).
    An instance that cannot be reached is reported at once. A 5xx answer or a timeout may be the prompt's doing
    (vLLM fetches a chat's media to tokenize it): it counts against that instance only once another instance
    tokenized the same prompt, so a client cannot take instances out of routing with prompts that fail. When every
    instance answered 5xx, or ``_TOKENIZE_TIMEOUTS`` timed out, the client is told."""
    now = time.monotonic()
    tried: list[str] = []
    suspects: list[tuple[str, str]] = []  # (instance, what it answered) not yet reported
    status = 502
    registry = proxy.registry
    order = sorted(
        registry.instances.values(), key=lambda i: (not i.available(now), i.in_flight, random.random())
    )
    timeouts = 0
    for inst in order:
        if not inst.healthy or inst.id in excluded:
            continue
        try:
            ids = await remote_tokenize(proxy.upstream, inst.url, str(body.get("model", "")), body)
        except HTTPStatusError as http_error:
            if http_error.status < 500:
                raise  # the prompt itself is bad: every instance would say so
            status = http_error.status
            suspects.append((inst.id, f"tokenize: HTTP {http_error.status}"))
            tried.append(f"{inst.id}: HTTP {http_error.status} {http_error.body[:200]!r}")
        except UpstreamTimeout as slow:
            status, timeouts = 504, timeouts + 1
            suspects.append((inst.id, f"tokenize: {slow}"))
            tried.append(f"{inst.id}: no answer in time")
        except UpstreamError as unreachable:
            registry.report_failure(inst.id, f"tokenize: {unreachable}")
            tried.append(f"{inst.id}: {type(unreachable).__name__}")
            continue
        else:
            for iid, why in suspects:  # this prompt tokenizes: what they answered was theirs
                registry.report_failure(iid, why)
            return ids
        if timeouts >= _TOKENIZE_TIMEOUTS:
            break
    if suspects:
        raise TokenizeFailed(status, "; ".join(tried))
    raise NoRoute(
        "no healthy instance could tokenize the prompt" + (f" ({'; '.join(tried)})" if tried else "")
    )
