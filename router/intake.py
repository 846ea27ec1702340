"""A request's intake: from the client's bytes to a ``RequestContext`` the exchange can plan, or an OpenAI error.

Checks run cheapest first (JSON, the model, ``max_tokens``), then the prompt is tokenized the way the instances do it
and looked up in the prefix index. Nothing a client sends reaches the data plane: ``kv_transfer_params`` is removed
here (only the proxy names transfer peers).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import JSONResponse, Response

from vllm_disagg.policy.api import NoRoute
from vllm_disagg.router.interrupts import Interrupts
from vllm_disagg.router.legs import take_client_kv_params
from vllm_disagg.router.tokenizer import remote_tokenize
from vllm_disagg.router.upstream import HTTPStatusError, UpstreamError

if TYPE_CHECKING:
    from vllm_disagg.router.app import Proxy

PASS_HEADERS = ("authorization", "x-request-id")
OFF_LOOP_CHARS = 32_768  # prompts longer than this are tokenized in a worker thread

_DECODE = msgspec.json.Decoder().decode


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN/Infinity or out-of-range numbers, which could not be forwarded; UTF-8 without lone
    surrogates), bounded nesting; ValueError otherwise."""
    try:
        body = _DECODE(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except msgspec.MsgspecError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def requested_max_tokens(body: dict[str, Any]) -> int:
    """``max_tokens`` (or chat's ``max_completion_tokens``) as a positive int; ValueError for anything else."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            if v == 0 and key == "max_tokens":
                continue  # 0 is treated as unset, like an absent field
            raise ValueError(f"'{key}' must be a positive integer, got {v!r}")
        return v
    return 16


def openai_error(
    status: int, message: str, type_: str, code: str | None = None, **headers: str
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers or None)


@dataclass
class RequestContext:
    """What intake learned about one request; the exchange plans and serves from it."""

    request_id: str
    kind: str  # "completions" | "chat/completions"
    body: dict[str, Any]
    tokens: list[int]
    max_tokens: int
    stream: bool
    headers: dict[str, str]  # the client's headers passed on to the instances
    t0: float
    cached: dict[str, int]
    interrupts: Interrupts
    # tokens after ``cached`` held by a tier beneath the instance
    tier: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    flow: str = ""  # of a transfer: "parallel" or "sequential"
    body_unchanged: bool = True  # the client's bytes can be forwarded as they are

    def prompt_split(self, instance: str | None) -> tuple[int, int, int]:
        """The prompt on ``instance``: (tokens in its cache, tokens it loads from its tier, tokens it computes)."""
        n = len(self.tokens)
        cached = min(self.cached.get(instance or "", 0), n)
        tier = min(self.tier.get(instance or "", 0), n - cached)
        return cached, tier, n - cached - tier


async def admit(
    proxy: Proxy, headers: dict[str, str], raw: bytes, kind: str, ix: Interrupts, t0: float
) -> RequestContext | Response:
    """Validate, tokenize and look up one request; an OpenAI-style error response for anything unservable."""
    metrics = proxy.metrics
    try:
        body = parse_json_object(raw)
    except ValueError as exc:
        return proxy.reject(
            "malformed", openai_error(400, f"malformed JSON body: {exc}", "invalid_request_error")
        )
    request_id = headers.get("x-request-id") or f"vd-{uuid.uuid4().hex[:16]}"
    kv_taken = take_client_kv_params(body)
    if kv_taken:
        # Only the proxy may name transfer peers: a client's params could make an instance dial an address of its
        # choosing or pin KV blocks for a phantom transfer.
        metrics.client_kv_params.inc()
        proxy.log.warning(
            "request %s: removed client-sent kv_transfer_params (the proxy sets them)", request_id
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return proxy.reject(
            "malformed", openai_error(400, "'model' must be a string", "invalid_request_error")
        )
    try:
        max_tokens = requested_max_tokens(body)
    except ValueError as exc:
        return proxy.reject("malformed", openai_error(400, str(exc), "invalid_request_error"))
    if model is not None:
        served = proxy.served_models()
        if served and model not in served:
            return proxy.reject(
                "unknown_model",
                openai_error(
                    404,
                    f"model {model!r} is not served here; available: {', '.join(sorted(served))}",
                    "invalid_request_error",
                    "model_not_found",
                ),
            )
    try:
        tokens = await tokenize(proxy, kind, body)
    except NoRoute as exc:
        return openai_error(503, str(exc), "service_unavailable", **{"Retry-After": "2"})
    except (ValueError, TypeError, KeyError, HTTPStatusError) as exc:
        return proxy.reject(
            "bad_prompt", openai_error(400, f"cannot tokenize the prompt: {exc}", "invalid_request_error")
        )
    limit = proxy.max_model_len()
    if limit is not None and len(tokens) + max_tokens > limit:
        return proxy.reject(
            "too_long",
            openai_error(
                400,
                f"prompt of {len(tokens)} tokens plus max_tokens {max_tokens} exceeds the model's context of "
                f"{limit} tokens; shorten the prompt or lower max_tokens",
                "invalid_request_error",
                "context_length_exceeded",
            ),
        )
    hits = proxy.index.match_tiers(tokens) if proxy.index is not None else {}
    metrics.prompt_tokens.inc(len(tokens))
    return RequestContext(
        request_id=request_id,
        kind=kind,
        body=body,
        tokens=tokens,
        max_tokens=max_tokens,
        stream=bool(body.get("stream")),
        headers={k: v for k in PASS_HEADERS if (v := headers.get(k)) is not None},
        t0=t0,
        cached={iid: h.cached_tokens for iid, h in hits.items()},
        tier={iid: h.tier_tokens for iid, h in hits.items() if h.tier_tokens},
        interrupts=ix,
        body_unchanged=not kv_taken,
    )


async def tokenize(proxy: Proxy, kind: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the instances will see them: given ids, the local tokenizer, or an instance's."""
    tokenizer = proxy.tokenizer
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if prompt and not all(0 <= t < 2**31 for t in prompt):
                raise ValueError("token ids must be between 0 and 2**31 - 1")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError(
                "'prompt' must be a string or a list of token ids (batched prompts: one per request)"
            )
        if tokenizer is not None:
            return await encode_off_loop(len(prompt), tokenizer.encode_prompt, prompt)
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        if tokenizer is not None:
            size = sum(len(str(m)) for m in messages)
            gen = body.get("add_generation_prompt", True)
            return await encode_off_loop(size, tokenizer.encode_chat, messages, gen)
    return await tokenize_remotely(proxy, body)


async def tokenize_remotely(proxy: Proxy, body: dict[str, Any]) -> list[int]:
    """Tokenize on an instance (no local tokenizer): the healthy ones in turn, like any other leg."""
    now = time.monotonic()
    tried: list[str] = []
    registry = proxy.registry
    for inst in sorted(registry.instances.values(), key=lambda i: (not i.available(now), i.in_flight)):
        if not inst.healthy:
            continue
        try:
            return await remote_tokenize(proxy.upstream, inst.url, str(body.get("model", "")), body)
        except HTTPStatusError as exc:
            if exc.status < 500:
                raise  # the prompt itself is bad: every instance would say so
            registry.report_failure(inst.id, f"tokenize: HTTP {exc.status}")
            tried.append(f"{inst.id}: HTTP {exc.status}")
        except UpstreamError as exc:
            registry.report_failure(inst.id, f"tokenize: {exc}")
            tried.append(f"{inst.id}: {type(exc).__name__}")
    raise NoRoute(
        "no healthy instance could tokenize the prompt" + (f" ({'; '.join(tried)})" if tried else "")
    )


async def encode_off_loop(size: int, encode: Callable[..., list[int]], *args: Any) -> list[int]:
    """Tokenize on the event loop, or in a worker thread for long inputs so every other stream keeps moving."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)
