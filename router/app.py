"""The P/D proxy: an OpenAI-compatible front that routes each request to a transfer, recompute or colocated plan.

Per request: tokenize (as the instances do), look up cached prefixes (PrefixIndex), read load, ask the policy for a
Plan, run it, and stream the decoding instance's bytes to the client as they arrive. A transfer dispatches prefill
and decode in parallel with a shared transfer id (the decode instance registers with prefill, which pushes KV layer
by layer). Every fallback is explicit: counted in ``vllm_disagg_decisions_total{mode,reason}`` and shown in the
``x-disagg-path`` response header.

Fallback ladder:
  * prefill fails before decode produced a token -> abort that decode leg; try the backup prefill, else recompute
    on the decode instance;
  * decode fails before its first token -> run the request elsewhere (another plan without that instance);
  * decode fails after tokens streamed -> a clean in-stream OpenAI error event, then ``[DONE]``.
A client that disconnects aborts both legs at once (the prefill frees its held blocks immediately).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_disagg.policy.api import ClusterView, NoRoute, Outcome, Plan, Policy, RequestView
from vllm_disagg.policy.builtin import LeastLoaded
from vllm_disagg.router.config import InstanceConfig, ProxySettings, read_instances_file
from vllm_disagg.router.exchange import CLIENT_GONE, DEADLINE, PREFILL, DeadlineHook, Exchange
from vllm_disagg.router.instances import Instance, InstanceRegistry
from vllm_disagg.router.ledger import TransferLedger
from vllm_disagg.router.legs import (
    cached_tokens,
    completion_tokens,
    count_sse_events,
    patch_sse_usage,
    patch_usage_json,
    prefill_leg_body,
    prefill_usage,
    single_instance_reason,
    split_complete_events,
    take_client_kv_params,
)
from vllm_disagg.router.metrics import ProxyMetrics
from vllm_disagg.router.tokenizer import PromptTokenizer, remote_tokenize
from vllm_disagg.router.upstream import HTTPStatusError, UpstreamError, UpstreamPool, UpstreamResponse

logger = logging.getLogger("vllm_disagg.proxy")

PASS_HEADERS = ("authorization", "x-request-id")
_OFF_LOOP_CHARS = 32_768  # prompts longer than this are tokenized in a worker thread


_DECODE = msgspec.json.Decoder().decode
_ENCODE = msgspec.json.Encoder().encode


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


class _Retry(Exception):
    """A leg failed before the client saw anything: the request can run elsewhere."""

    def __init__(self, instance: str, reason: str) -> None:
        super().__init__(f"{instance}: {reason}")
        self.instance, self.reason = instance, reason


@dataclass
class _Ctx:
    request_id: str
    kind: str  # "completions" | "chat/completions"
    body: dict[str, Any]
    tokens: list[int]
    stream: bool
    headers: dict[str, str]
    t0: float
    cached: dict[str, int]
    # tokens after ``cached`` held by a tier beneath the instance
    tier: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    flow: str = ""  # of a transfer: "parallel" or "sequential" (see _run)
    exchange: Exchange = field(default_factory=lambda: Exchange(None))

    def prompt_split(self, instance: str | None) -> tuple[int, int, int]:
        """The prompt on ``instance``: (tokens in its cache, tokens it loads from its tier, tokens it computes)."""
        n = len(self.tokens)
        cached = min(self.cached.get(instance or "", 0), n)
        tier = min(self.tier.get(instance or "", 0), n - cached)
        return cached, tier, n - cached - tier


class Proxy:
    def __init__(self, settings: ProxySettings, policy: Policy, index: Any = None) -> None:
        self.settings = settings
        self.policy = policy
        self.index = index  # PrefixIndex or None
        self.metrics = ProxyMetrics()
        self.ledger = TransferLedger(deadline_s=settings.transfer_deadline_s)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s),
            # Idle upstream connections are dropped before the instances drop them (uvicorn: 5 s), so a request is
            # never written into a connection the server is closing.
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=256,
                keepalive_expiry=settings.upstream_keepalive_s,
            ),
        )
        # The request path's legs: keep-alive connections with a C parser. Idle connections are dropped before the
        # instances drop them (uvicorn: 5 s), so a request is rarely written into a connection the server is closing
        # (and is sent once more when it is).
        self.upstream = UpstreamPool(
            settings.connect_timeout_s, settings.request_timeout_s, settings.upstream_keepalive_s
        )
        secret = settings.shared_secret.encode() if settings.shared_secret else None
        self.registry = InstanceRegistry(
            self.client, secret, settings.breaker_failures, settings.breaker_open_s
        )
        self.tokenizer = PromptTokenizer(settings.tokenizer) if settings.tokenizer else None
        self.decisions: collections.deque[tuple[Any, ...]] = collections.deque(
            maxlen=settings.recent_decisions
        )
        self.active = 0
        self.subscribers: dict[str, Any] = {}
        self._legs: dict[str, list[asyncio.Task[Any] | DeadlineHook]] = {}  # what aborting a hand-off cancels
        self._learning: set[str] = set()
        self._bg: list[asyncio.Task[None]] = []
        self._file_mtime = 0.0
        self._discovery: Any = None
        self.admin_app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prom, methods=["GET"]),
                Route("/admin/instances", self.admin_list, methods=["GET"]),
                Route("/admin/instances", self.admin_add, methods=["POST"]),
                Route("/admin/instances/{id}", self.admin_remove, methods=["DELETE"]),
                Route("/admin/instances/{id}/drain", self.admin_drain, methods=["POST"]),
                Route("/admin/decisions", self.admin_decisions, methods=["GET"]),
                Route("/admin/index", self.admin_index, methods=["GET"]),
                Route("/admin/transfers", self.admin_transfers, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )
        self.app = _ASGIApp(self)

    # ------------------------------------------------------------------ ASGI

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The two inference routes are served here directly; Starlette serves the rest (admin, metrics, models)
        and the lifespan. Its routing, middleware and streaming task group cost more than the proxy's own work."""
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _HOT_ROUTES.get(scope["path"])
            if kind is not None:
                request = Request(scope, receive)
                ex = Exchange(asyncio.current_task())
                try:
                    resp = await self._serve(request, kind, ex)
                    if isinstance(resp, _Stream):
                        await _write_stream(resp, ex, send)
                    else:
                        await resp(scope, receive, send)
                finally:
                    ex.close()
                return
        await self.admin_app(scope, receive, send)

    def _release_slot(self) -> None:
        self.active -= 1

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        for cfg in self.settings.instances:
            await self.add_instance(cfg)
        if self.settings.instances_file:
            await self._sync_instances_file()
        if self.settings.k8s_namespace:
            from vllm_disagg.router.k8s_discovery import KubernetesDiscovery

            async def on_remove(instance_id: str) -> None:
                if instance_id in self.registry.instances:
                    self.remove_instance(instance_id)

            self._discovery = KubernetesDiscovery(
                self.settings.k8s_namespace, self.settings.k8s_selector, self._add_discovered, on_remove
            )
            self._bg.append(asyncio.create_task(self._discovery.run()))
        self._bg.append(asyncio.create_task(self._background()))

    async def _add_discovered(self, cfg: InstanceConfig) -> None:
        if cfg.instance_id() not in self.registry.instances:
            await self.add_instance(cfg)

    async def stop(self) -> None:
        for t in self._bg:
            t.cancel()
        for sub in self.subscribers.values():
            with contextlib.suppress(Exception):
                sub.stop()
        await self.client.aclose()
        self.upstream.close()

    async def add_instance(self, cfg: InstanceConfig) -> Instance:
        inst = await self.registry.add(cfg)
        if self.index is not None:
            if cfg.kv_events:
                from vllm_disagg.router.kv_events import KVEventSubscriber

                sub = KVEventSubscriber(
                    self.index, inst.id, cfg.kv_events, replay_endpoint=cfg.kv_events_replay
                )
                sub.start()
                self.subscribers[inst.id] = sub
                self.index.set_precise(inst.id, True)
                # A (re)started proxy replays what the instance already caches before routing to it; an instance
                # that does not answer the replay costs at most this wait (its live events still arrive).
                await asyncio.to_thread(sub.wait_caught_up, 2.0)
            else:
                self.index.set_precise(inst.id, False)
        return inst

    def remove_instance(self, instance_id: str) -> Instance:
        inst = self.registry.remove(instance_id)
        sub = self.subscribers.pop(instance_id, None)
        if sub is not None:
            sub.stop()
        if self.index is not None:
            self.index.remove_instance(instance_id)
        return inst

    async def _background(self) -> None:
        while True:
            try:
                await self.registry.probe_all()
                for h in self.ledger.expired():
                    logger.warning(
                        "transfer %s (request %s, %s -> %s): %s; aborting both legs (the client gets a 504)",
                        h.transfer_id,
                        h.request_id,
                        h.prefill,
                        h.decode,
                        h.note,
                    )
                    self.metrics.transfers_stranded.inc()
                    for t in self._legs.pop(h.transfer_id, []):
                        t.cancel()
                if self.settings.instances_file:
                    await self._sync_instances_file()
                self._export_instance_metrics()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("proxy background loop error")
            await asyncio.sleep(self.settings.health_interval_s)

    async def _sync_instances_file(self) -> None:
        """File discovery: add what appeared, remove what disappeared (checked every health interval)."""
        path = self.settings.instances_file
        assert path is not None
        try:
            import os

            mtime = os.stat(path).st_mtime
            if mtime == self._file_mtime:
                return
            wanted = {c.instance_id(): c for c in read_instances_file(path)}
            self._file_mtime = mtime
        except Exception as exc:
            logger.error("instances file %s unreadable: %s (keeping the current instances)", path, exc)
            return
        static = {c.instance_id() for c in self.settings.instances}
        for iid in list(self.registry.instances):
            if iid not in wanted and iid not in static:
                self.remove_instance(iid)
                logger.info("instance %s removed (no longer in %s)", iid, path)
        for iid, cfg in wanted.items():
            if iid not in self.registry.instances:
                await self.add_instance(cfg)

    def _export_instance_metrics(self) -> None:
        m = self.metrics
        running_decode = 0.0
        for inst in self.registry.instances.values():
            lbl = (inst.id, inst.role)
            m.instance_in_flight.labels(*lbl).set(inst.in_flight)
            m.instance_healthy.labels(*lbl).set(1 if inst.available(time.monotonic()) else 0)
            m.instance_waiting.labels(*lbl).set(inst.waiting)
            m.instance_running.labels(*lbl).set(inst.running)
            m.instance_kv_usage.labels(*lbl).set(inst.kv_usage)
            if inst.role in ("decode", "both"):
                running_decode += inst.running
        m.pool_running_streams.labels("decode").set(running_decode)
        m.transfers_in_flight.set(self.ledger.in_flight())
        if self.index is not None:
            m.index_blocks.clear()  # instances and tiers come and go
            for iid, st in self.index.stats()["instances"].items():
                m.index_blocks.labels(iid, "device").set(st["blocks"])
                for medium, n in st["tier_blocks"].items():
                    m.index_blocks.labels(iid, medium).set(n)

    # ------------------------------------------------------------------ OpenAI endpoints

    async def models(self, request: Request) -> Response:
        for inst in self.registry.instances.values():
            if inst.healthy:
                try:
                    r = await self.client.get(
                        inst.url + "/v1/models", headers=self._pass_headers(request), timeout=5
                    )
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    continue
        return openai_error(
            503, "no healthy instance to list models from", "service_unavailable", **{"Retry-After": "2"}
        )

    async def health(self, request: Request) -> Response:
        ok = self.registry.serving()
        body = {"status": "ok" if ok else "unavailable", "instances": len(self.registry.instances)}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prom(self, request: Request) -> Response:
        self._export_instance_metrics()
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ admin

    def _admin_denied(self, request: Request) -> Response | None:
        key = self.settings.admin_key
        if not key:
            return openai_error(403, "admin API disabled: start the proxy with --admin-key", "forbidden")
        given = request.headers.get("x-admin-key") or request.headers.get("authorization", "").removeprefix(
            "Bearer "
        )
        import hmac

        if not hmac.compare_digest(given.encode(), key.encode()):
            return openai_error(401, "admin key missing or wrong (header x-admin-key)", "unauthorized")
        return None

    async def admin_list(self, request: Request) -> Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        return JSONResponse({"instances": [i.admin() for i in self.registry.instances.values()]})

    async def admin_add(self, request: Request) -> Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        try:
            cfg = InstanceConfig.model_validate(parse_json_object(await request.body()))
            inst = await self.add_instance(cfg)
        except (ValueError, TypeError) as exc:
            return openai_error(400, f"cannot add instance: {exc}", "invalid_request_error")
        return JSONResponse(inst.admin(), status_code=201)

    async def admin_remove(self, request: Request) -> Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        try:
            inst = self.remove_instance(request.path_params["id"])
        except KeyError as exc:
            return openai_error(404, str(exc.args[0]), "not_found")
        return JSONResponse({"removed": inst.id})

    async def admin_drain(self, request: Request) -> Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        try:
            inst = self.registry.get(request.path_params["id"])
        except KeyError as exc:
            return openai_error(404, str(exc.args[0]), "not_found")
        inst.draining = True
        return JSONResponse(inst.admin())

    async def admin_decisions(self, request: Request) -> Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        rendered = [
            {
                "request_id": rid,
                "time": t,
                "path": plan.describe(),
                "prompt_tokens": n,
                "cached": cached,
                "tier": tier,
                "alternatives": list(plan.alternatives),
                "fallbacks": list(fallbacks),
            }
            for rid, t, plan, n, cached, tier, fallbacks in list(self.decisions)
        ]
        return JSONResponse({"decisions": rendered})

    async def admin_index(self, request: Request) -> Response:
        """The prefix index's counters: blocks per instance and tier, lookups, hits, ignored event streams."""
        if (denied := self._admin_denied(request)) is not None:
            return denied
        return JSONResponse(self.index.stats() if self.index is not None else {"enabled": False})

    async def admin_transfers(self, request: Request) -> Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        return JSONResponse(
            {"open": self.ledger.snapshot(), "closed": self.ledger.counts, "stranded": self.ledger.stranded()}
        )

    # ------------------------------------------------------------------ request path

    def _pass_headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in PASS_HEADERS}

    def _reject(self, reason: str, resp: Response) -> Response:
        self.metrics.rejected.labels(reason).inc()
        return resp

    async def _read_body(self, request: Request) -> bytes | Response:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return self._reject(
                "body_too_large",
                openai_error(413, f"request body over {limit} bytes", "invalid_request_error"),
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return self._reject(
                    "body_too_large",
                    openai_error(413, f"request body over {limit} bytes", "invalid_request_error"),
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def _tokenize(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                if prompt and not all(0 <= t < 2**31 for t in prompt):
                    raise ValueError("token ids must be between 0 and 2**31 - 1")
                return list(prompt)
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise ValueError(
                    "'prompt' must be a string or a list of token ids (batched prompts: one per request)"
                )
            if self.tokenizer is not None:
                return await _encode(len(prompt), self.tokenizer.encode_prompt, prompt)
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("'messages' must be a non-empty list")
            if self.tokenizer is not None:
                size = sum(len(str(m)) for m in messages)
                gen = body.get("add_generation_prompt", True)
                return await _encode(size, self.tokenizer.encode_chat, messages, gen)
        return await self._remote_tokenize(body)

    async def _remote_tokenize(self, body: dict[str, Any]) -> list[int]:
        """Tokenize on an instance (no local tokenizer): the healthy ones in turn, like any other leg."""
        now = time.monotonic()
        tried: list[str] = []
        for inst in sorted(
            self.registry.instances.values(), key=lambda i: (not i.available(now), i.in_flight)
        ):
            if not inst.healthy:
                continue
            try:
                return await remote_tokenize(self.upstream, inst.url, str(body.get("model", "")), body)
            except HTTPStatusError as exc:
                if exc.status < 500:
                    raise  # the prompt itself is bad: every instance would say so
                self.registry.report_failure(inst.id, f"tokenize: HTTP {exc.status}")
                tried.append(f"{inst.id}: HTTP {exc.status}")
            except UpstreamError as exc:
                self.registry.report_failure(inst.id, f"tokenize: {exc}")
                tried.append(f"{inst.id}: {type(exc).__name__}")
        raise NoRoute(
            "no healthy instance could tokenize the prompt" + (f" ({'; '.join(tried)})" if tried else "")
        )

    def _served_models(self) -> set[str]:
        return {m for i in self.registry.instances.values() for m in i.models}

    def _max_model_len(self) -> int | None:
        if self.settings.max_model_len:
            return self.settings.max_model_len
        lens = [i.max_model_len for i in self.registry.instances.values() if i.max_model_len]
        return min(lens) if lens else None

    async def _serve(self, request: Request, kind: str, ex: Exchange) -> Response | _Stream:
        if self.active >= self.settings.max_concurrency:
            return self._reject(
                "concurrency",
                openai_error(
                    429,
                    f"the proxy has {self.active} requests in flight (max_concurrency); retry shortly",
                    "rate_limit_exceeded",
                    **{"Retry-After": "1"},
                ),
            )
        self.active += 1
        streaming = False
        try:
            resp = await self._serve_admitted(request, kind, ex)
            if isinstance(resp, _Stream):
                # A stream holds its slot until its last byte (or the client's disconnect), not until headers.
                streaming = True
                resp.on_close.append(self._release_slot)
            return resp
        finally:
            if not streaming:
                self.active -= 1

    async def _serve_admitted(self, request: Request, kind: str, ex: Exchange) -> Response | _Stream:
        t0 = time.monotonic()
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return raw
        ex.watch(request.receive)
        try:
            body = parse_json_object(raw)
        except ValueError as exc:
            return self._reject(
                "malformed", openai_error(400, f"malformed JSON body: {exc}", "invalid_request_error")
            )
        request_id = request.headers.get("x-request-id") or f"vd-{uuid.uuid4().hex[:16]}"
        if take_client_kv_params(body):
            # Only the proxy may name transfer peers: a client's params could make an instance dial an address of
            # its choosing or pin KV blocks for a phantom transfer.
            self.metrics.client_kv_params.inc()
            logger.warning(
                "request %s: removed client-sent kv_transfer_params (the proxy sets them)", request_id
            )
        served = self._served_models()
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return self._reject(
                "malformed", openai_error(400, "'model' must be a string", "invalid_request_error")
            )
        try:
            max_tokens = requested_max_tokens(body)
        except ValueError as exc:
            return self._reject("malformed", openai_error(400, str(exc), "invalid_request_error"))
        if model is not None and served and model not in served:
            return self._reject(
                "unknown_model",
                openai_error(
                    404,
                    f"model {model!r} is not served here; available: {', '.join(sorted(served))}",
                    "invalid_request_error",
                    "model_not_found",
                ),
            )
        try:
            tokens = await self._tokenize(kind, body)
        except NoRoute as exc:
            return openai_error(503, str(exc), "service_unavailable", **{"Retry-After": "2"})
        except (ValueError, TypeError, KeyError, HTTPStatusError) as exc:
            return self._reject(
                "bad_prompt", openai_error(400, f"cannot tokenize the prompt: {exc}", "invalid_request_error")
            )
        limit = self._max_model_len()
        if limit is not None and len(tokens) + max_tokens > limit:
            return self._reject(
                "too_long",
                openai_error(
                    400,
                    f"prompt of {len(tokens)} tokens plus max_tokens {max_tokens} exceeds the model's context of "
                    f"{limit} tokens; shorten the prompt or lower max_tokens",
                    "invalid_request_error",
                    "context_length_exceeded",
                ),
            )
        hits = self.index.match_tiers(tokens) if self.index is not None else {}
        ctx = _Ctx(
            request_id=request_id,
            kind=kind,
            body=body,
            tokens=tokens,
            stream=bool(body.get("stream")),
            headers=self._pass_headers(request),
            t0=t0,
            cached={iid: h.cached_tokens for iid, h in hits.items()},
            tier={iid: h.tier_tokens for iid, h in hits.items() if h.tier_tokens},
            exchange=ex,
        )
        self.metrics.prompt_tokens.inc(len(tokens))
        excluded: set[str] = set()
        for _attempt in range(3):
            try:
                plan = self._plan(ctx, excluded)
            except NoRoute as exc:
                self.metrics.decisions.labels("none", "no_route").inc()
                return openai_error(
                    503,
                    f"no instance can serve this request: {exc}",
                    "service_unavailable",
                    **{"Retry-After": "2"},
                )
            try:
                return await self._run(ctx, plan)
            except _Retry as exc:
                excluded.add(exc.instance)
                ctx.fallbacks.append(exc.reason)
                self.metrics.decisions.labels(plan.mode, exc.reason).inc()
                logger.warning(
                    "request %s: %s on %s failed before its first token (%s); retrying elsewhere",
                    ctx.request_id,
                    plan.mode,
                    exc.instance,
                    exc.reason,
                )
        return openai_error(
            502,
            f"request failed on every instance tried ({'; '.join(ctx.fallbacks)})",
            "upstream_error",
            **{"Retry-After": "2"},
        )

    def _kv_bytes_per_token(self) -> int:
        """From the instances' KV geometry (all layers of one token on one TP rank, times the TP size)."""
        for inst in self.registry.instances.values():
            g = inst.geometry
            if g is not None and g.block_size:
                return g.num_layers * g.block_bytes * g.tp_size // g.block_size
        return 0

    def _plan(self, ctx: _Ctx, excluded: set[str]) -> Plan:
        views = tuple(v for v in self.registry.views(ctx.cached, ctx.tier) if v.id not in excluded)
        cluster = ClusterView(
            instances=views,
            kv_bytes_per_token=self.settings.kv_bytes_per_token or self._kv_bytes_per_token(),
            link_bytes_per_s=self.settings.link_bytes_per_s,
            tier_bytes_per_s=self.settings.tier_bytes_per_s,
        )
        req = RequestView(
            request_id=ctx.request_id,
            prompt_tokens=len(ctx.tokens),
            max_tokens=requested_max_tokens(ctx.body),
            stream=ctx.stream,
            model=str(ctx.body.get("model", "")),
        )
        try:
            plan = self.policy.plan(req, cluster)
            for iid in (plan.decode, plan.prefill):
                if iid is not None and iid not in self.registry.instances:
                    raise ValueError(f"policy chose unknown instance {iid!r}")
        except NoRoute:
            raise
        except Exception:
            logger.exception(
                "request %s: policy %s raised; serving it with least-loaded instead (fix the policy)",
                ctx.request_id,
                type(self.policy).__name__,
            )
            fallback = LeastLoaded().plan(req, cluster)
            plan = dataclasses.replace(fallback, reason="policy_error")
        if plan.mode == "transfer":
            prefill_id = plan.prefill
            assert prefill_id is not None
            split = single_instance_reason(ctx.body)
            if split:
                plan = Plan.recompute(plan.decode, reason=split)
            elif self.registry.get(prefill_id).no_connector:
                plan = Plan.recompute(plan.decode, reason="prefill_without_connector")
        self.metrics.decisions.labels(plan.mode, plan.reason or "policy").inc()
        # Rendered when /admin/decisions is read, not per request.
        self.decisions.append(
            (ctx.request_id, time.time(), plan, len(ctx.tokens), ctx.cached, ctx.tier, tuple(ctx.fallbacks))
        )
        if plan.alternatives and logger.isEnabledFor(logging.INFO):
            logger.info(
                "request %s: %s; not taken: %s",
                ctx.request_id,
                plan.describe(),
                " | ".join(plan.alternatives),
            )
        return plan

    def _path_header(self, ctx: _Ctx, plan: Plan, extra: str = "") -> str:
        s = plan.describe()
        if plan.mode == "transfer" and ctx.flow:
            s += f"; flow={ctx.flow}"
        _, tier, _ = ctx.prompt_split(plan.computing)
        if tier:
            s += f"; tier_tokens={tier}"
        fb = ctx.fallbacks + ([extra] if extra else [])
        return s + (f"; fallback={','.join(fb)}" if fb else "")

    async def _run(self, ctx: _Ctx, plan: Plan) -> Response | _Stream:
        decode = self.registry.get(plan.decode)
        if plan.mode != "transfer":
            d_body = dict(ctx.body)
            return await self._finish(ctx, plan, decode, d_body, prefill_task=None, transfer_id=None)
        assert plan.prefill is not None
        prefill = self.registry.get(plan.prefill)
        tid = uuid.uuid4().hex
        p_body = prefill_leg_body(ctx.body, {"do_remote_decode": True, "transfer_id": tid})
        side = prefill.cfg.side_channel_addr()
        self.ledger.open(tid, ctx.request_id, prefill.id, decode.id)
        _, _, uncached = ctx.prompt_split(prefill.id)
        self.metrics.pool_queued_prefill_tokens.labels("prefill").inc(uncached)
        p_task = asyncio.create_task(self._prefill_leg(ctx, prefill, p_body, tid, uncached))
        p_task.add_done_callback(_consume)
        if side is not None:
            p_task.add_done_callback(ctx.exchange.on_prefill_done)
        self._legs[tid] = [p_task]
        ctx.flow = "sequential" if side is None else "parallel"
        try:
            if side is None:
                # Sequential flow (the instance was given as a URL only): prefill first, then decode loads from
                # the side channel its answer names. Later requests use the parallel flow.
                try:
                    d_params = await self._sequential_params(ctx, prefill, p_task, tid)
                except _Interrupted as exc:
                    if exc.why == CLIENT_GONE:
                        self._abort_legs(tid, "client disconnected during prefill")
                        self.metrics.client_disconnects.inc()
                        return Response(status_code=499)
                    return self._deadline_passed(ctx, plan, tid)
            else:
                d_params = {
                    "do_remote_prefill": True,
                    "transfer_id": tid,
                    "remote_host": side[0],
                    "remote_port": side[1],
                }
            d_body = dict(ctx.body)
            d_body["kv_transfer_params"] = d_params
            return await self._finish(ctx, plan, decode, d_body, prefill_task=p_task, transfer_id=tid)
        except _PrefillFailed as exc:
            for t in self._legs.pop(tid, []):
                t.cancel()
            self.ledger.mark(tid, "failed", exc.reason)
            if plan.backup_prefill and plan.backup_prefill in self.registry.instances:
                ctx.fallbacks.append("prefill_failed:backup")
                self.metrics.decisions.labels("transfer", "prefill_failed:backup").inc()
                backup = Plan.transfer(plan.backup_prefill, plan.decode, reason="backup_prefill")
                return await self._run(ctx, backup)
            ctx.fallbacks.append(f"{exc.reason}:recompute")
            self.metrics.decisions.labels("recompute", exc.reason).inc()
            return await self._run(ctx, Plan.recompute(plan.decode, reason=exc.reason))

    def _deadline_passed(self, ctx: _Ctx, plan: Plan, transfer_id: str | None) -> Response:
        self._abort_legs(transfer_id, "transfer deadline passed before the first token")
        self.metrics.requests.labels(plan.mode, "5xx").inc()
        return openai_error(
            504,
            f"request {ctx.request_id}: no first token within transfer_deadline_s="
            f"{self.settings.transfer_deadline_s:g} (prefill {plan.prefill} -> decode {plan.decode}); retry, or "
            "raise transfer_deadline_s for very long prompts",
            "timeout",
            **{"x-request-id": ctx.request_id},
        )

    async def _sequential_params(
        self, ctx: _Ctx, prefill: Instance, p_task: asyncio.Task[_PrefillResult], tid: str
    ) -> dict[str, Any]:
        """Wait for the prefill leg and build decode's params from its answer; ``_Interrupted`` when the client
        leaves or the hand-off passes its deadline meanwhile."""
        ex = ctx.exchange
        self._legs.setdefault(tid, []).append(DeadlineHook(ex))
        try:
            ex.arm(CLIENT_GONE, DEADLINE)
            await asyncio.wait({p_task})
            ex.disarm()
        except asyncio.CancelledError:
            why = ex.take()
            if why is None:
                raise
            raise _Interrupted(why) from None
        if p_task.cancelled():
            raise _Interrupted(DEADLINE)  # the reaper cancelled the leg
        result = p_task.result()  # raises _PrefillFailed
        params = result.params or {}
        host, port = params.get("remote_host"), params.get("remote_port")
        if (
            params.get("transfer_id") != tid
            or not isinstance(host, str)
            or not host
            or isinstance(port, bool)
            or not isinstance(port, int)
            or not 0 < port < 65536
        ):
            # A preempted or aborted prefill answers without params too: only repeated misses mean no connector.
            prefill.connector_misses += 1
            prefill.no_connector = prefill.connector_misses >= 3
            logger.error(
                "request %s: prefill %s answered without usable kv_transfer_params (%s); recomputing on decode. After "
                "3 such answers in a row it is no transfer source until it recovers: is it running DisaggConnector "
                "with kv_role kv_producer or kv_both?",
                ctx.request_id,
                prefill.id,
                params or "none",
            )
            raise _PrefillFailed(prefill.id, "prefill_without_connector")
        prefill.connector_misses = 0
        self._learn_side_channel(prefill, host, port)
        d_params: dict[str, Any] = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": host,
            "remote_port": port,
        }
        cached = params.get("remote_prefill_cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            d_params["remote_prefill_cached_tokens"] = cached  # vLLM then reports P's cache hits in usage
        return d_params

    def _learn_side_channel(self, inst: Instance, host: str, port: int) -> None:
        """A prefill's answer named its side channel: describe it (geometry, pairing) and, if that works, use the
        parallel flow for it from now on."""
        if inst.cfg.side_channel or inst.learn_failed or inst.id in self._learning:
            return
        self._learning.add(inst.id)

        async def learn() -> None:
            try:
                cfg = inst.cfg.model_copy(update={"side_channel": f"{host}:{port}"})
                geometry, why = await self.registry._ask_geometry(cfg)
                if geometry is None:
                    inst.learn_failed = why or "no description"
                    logger.warning(
                        "instance %s: side channel %s:%d from its answers cannot be described (%s); staying with "
                        "the sequential flow. Give it as URL;side=HOST:PORT to use the parallel flow.",
                        inst.id,
                        host,
                        port,
                        inst.learn_failed,
                    )
                    return
                inst.cfg = cfg
                await self.registry.redescribe(inst)
                logger.info("instance %s: KV transfers from it: %s", inst.id, inst.transfer_flow())
            finally:
                self._learning.discard(inst.id)

        task = asyncio.create_task(learn())
        self._bg.append(task)
        task.add_done_callback(lambda t: self._bg.remove(t) if t in self._bg else None)

    async def _prefill_leg(
        self, ctx: _Ctx, inst: Instance, body: dict[str, Any], tid: str, uncached: int
    ) -> _PrefillResult:
        t = time.monotonic()
        idle = (
            inst.in_flight == 0 and inst.waiting == 0
        )  # only then is the leg's duration prefill, not queueing
        inst.in_flight += 1
        r: UpstreamResponse | None = None
        try:
            raw = self.upstream.build(inst.url, "POST", f"/v1/{ctx.kind}", _ENCODE(body), ctx.headers)
            r = await self.upstream.request(inst.url, raw)
            content = await r.read()
            if r.status_code != 200:
                raise _PrefillFailed(inst.id, f"prefill_http_{r.status_code}")
            self.registry.report_success(inst.id)
            self.ledger.mark(tid, "prefill_done")
            dt = time.monotonic() - t
            self.metrics.prefill_leg.observe(dt)
            if self.index is not None:
                self.index.record_routed(inst.id, ctx.tokens)
            usage, params = prefill_usage(content)
            return _PrefillResult(
                seconds=dt if idle else None, cached_tokens=cached_tokens(usage), params=params
            )
        except UpstreamError as exc:
            self.registry.report_failure(inst.id, str(exc))
            raise _PrefillFailed(inst.id, "prefill_unreachable") from None
        finally:
            if r is not None:
                r.close()  # a leg cancelled mid-answer closes its connection: vLLM aborts it and frees its blocks
            inst.in_flight -= 1
            self.metrics.pool_queued_prefill_tokens.labels("prefill").dec(uncached)

    async def _finish(
        self,
        ctx: _Ctx,
        plan: Plan,
        inst: Instance,
        body: dict[str, Any],
        prefill_task: asyncio.Task[_PrefillResult] | None,
        transfer_id: str | None,
    ) -> Response | _Stream:
        """Send the decoding leg; return once its first bytes (or its whole answer) arrived.

        The wait is inline; the client leaving, the prefill leg failing and the hand-off's deadline interrupt it
        (``Exchange``)."""
        ex = ctx.exchange
        inst.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                inst.in_flight -= 1

        upstream: UpstreamResponse | None = None
        if transfer_id is not None:
            # The ledger's reaper cancels this when the hand-off passes its deadline before decode's first token,
            # whether or not the prefill leg already answered.
            self._legs.setdefault(transfer_id, []).append(DeadlineHook(ex))
        try:
            ex.arm(CLIENT_GONE, PREFILL, DEADLINE)
            if prefill_task is not None and prefill_task.done():
                ex.on_prefill_done(prefill_task)  # failed while the request was being built: interrupt now
            raw = self.upstream.build(inst.url, "POST", f"/v1/{ctx.kind}", _ENCODE(body), ctx.headers)
            stage = "decode_unreachable"
            upstream = await self.upstream.request(inst.url, raw)
            if upstream.status_code >= 500:
                ex.disarm()
                upstream.close()
                self.registry.report_failure(inst.id, f"HTTP {upstream.status_code}")
                self._abort_legs(transfer_id, "decode failed")
                release()
                raise _Retry(inst.id, f"decode_http_{upstream.status_code}")
            stage = "decode_failed_before_first_token"
            chunk = await upstream.next_chunk()
            ex.disarm()
            if chunk is None and upstream.status_code == 200:
                raise UpstreamError("the answer ended with no body")
            first = chunk or b""
        except asyncio.CancelledError:
            why = ex.take()
            if upstream is not None:
                upstream.close()  # decode sent the client nothing yet: closing aborts it in vLLM
            release()
            if why is None:
                self._abort_legs(transfer_id, "proxy shutting down before the first token")
                raise
            if why == CLIENT_GONE:
                self._abort_legs(transfer_id, "client disconnected before the first token")
                self.metrics.client_disconnects.inc()
                return Response(status_code=499)
            assert prefill_task is not None or why == DEADLINE
            if why == DEADLINE or prefill_task is None or prefill_task.cancelled():
                return self._deadline_passed(ctx, plan, transfer_id)
            failure = prefill_task.exception()
            assert failure is not None
            raise failure from None  # _PrefillFailed: _run picks the next rung
        except UpstreamError as exc:
            ex.disarm()
            if upstream is not None:
                upstream.close()
            self.registry.report_failure(inst.id, str(exc))
            self._abort_legs(
                transfer_id, "decode unreachable" if stage == "decode_unreachable" else "decode failed"
            )
            release()
            raise _Retry(inst.id, stage) from None
        except _Retry:
            raise
        except BaseException:
            ex.disarm()
            if upstream is not None:
                upstream.close()
            release()
            self._abort_legs(transfer_id, "proxy error before the first token")
            raise
        assert upstream is not None and first is not None
        if transfer_id is not None:
            self.ledger.mark(transfer_id, "decoding")  # decode has its KV: prefill holds nothing for it now
        self.registry.report_success(inst.id)
        if self.index is not None:
            try:
                self.index.record_routed(inst.id, ctx.tokens)
            except Exception:  # the approximate index is an optimisation: never fail a request over it
                logger.exception("request %s: could not record its prefix", ctx.request_id)
        ttft = time.monotonic() - ctx.t0
        header = {"x-disagg-path": self._path_header(ctx, plan), "x-request-id": ctx.request_id}
        if upstream.status_code != 200:
            rest = first + await upstream.read()
            upstream.close()
            release()
            self._abort_legs(transfer_id, f"decode answered HTTP {upstream.status_code}")
            self.metrics.requests.labels(plan.mode, f"{upstream.status_code // 100}xx").inc()
            return Response(
                rest, status_code=upstream.status_code, headers=header, media_type="application/json"
            )
        if not ctx.stream:
            rest = first + await upstream.read()
            upstream.close()
            release()
            self._close_transfer(transfer_id, "done")
            if b'"cached_tokens"' in rest and (p_cached := await _prefill_cached(prefill_task)) is not None:
                rest = patch_usage_json(rest, p_cached)
            self._observe(ctx, plan, prefill_task, ok=True, ttft=None, output_tokens=completion_tokens(rest))
            self.metrics.requests.labels(plan.mode, "2xx").inc()
            self.metrics.e2e.labels(plan.mode).observe(time.monotonic() - ctx.t0)
            return Response(rest, status_code=200, headers=header, media_type="application/json")
        self.metrics.ttft.labels(plan.mode).observe(ttft)
        return _Stream(
            [(k.encode(), v.encode("latin-1")) for k, v in header.items()] + [_SSE],
            self._relay(ctx, plan, upstream, first, release, prefill_task, transfer_id, ttft),
        )

    async def _relay(
        self,
        ctx: _Ctx,
        plan: Plan,
        upstream: UpstreamResponse,
        first: bytes,
        release: Any,
        prefill_task: asyncio.Task[_PrefillResult] | None,
        transfer_id: str | None,
        ttft: float,
    ) -> AsyncIterator[bytes]:
        finished = failed = False
        last = time.monotonic()
        itl = self.metrics.itl.labels(plan.mode)
        events = usage_tokens = 0
        held = b""  # the incomplete tail of a usage event split across chunks
        p_cached: list[int | None] = []  # the prefill leg's cached tokens, asked for once

        async def usage_fixed(events_: bytes) -> bytes:
            nonlocal usage_tokens
            if b'"cached_tokens"' in events_ and prefill_task is not None:
                if not p_cached:
                    p_cached.append(await _prefill_cached(prefill_task))
                if p_cached[0] is not None:
                    events_ = patch_sse_usage(events_, p_cached[0])
            usage_tokens = completion_tokens(events_) or usage_tokens
            return events_

        try:
            events += count_sse_events(first)
            yield first
            async for chunk in upstream.chunks():
                now = time.monotonic()
                itl.observe(now - last)
                last = now
                events += count_sse_events(chunk)
                if held or b'"usage"' in chunk:
                    complete, held = split_complete_events(held + chunk)
                    if not complete:
                        continue
                    chunk = await usage_fixed(complete)
                yield chunk
            if held:
                yield await usage_fixed(held)
                held = b""
            finished = True
        except UpstreamError as exc:
            # Tokens already reached the client: end the stream cleanly with an OpenAI-style error event.
            failed = True
            self.registry.report_failure(plan.decode, str(exc))
            logger.error("request %s: decode %s failed mid-stream: %s", ctx.request_id, plan.decode, exc)
            err = {
                "error": {
                    "message": f"decode instance {plan.decode} failed mid-stream",
                    "type": "upstream_error",
                }
            }
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            self.metrics.decisions.labels(plan.mode, "decode_failed_mid_stream").inc()
        finally:
            upstream.close()
            release()
            if finished:
                self._close_transfer(transfer_id, "done")
                self._observe(
                    ctx, plan, prefill_task, ok=True, ttft=ttft, output_tokens=usage_tokens or events
                )
                self.metrics.requests.labels(plan.mode, "2xx").inc()
                self.metrics.e2e.labels(plan.mode).observe(time.monotonic() - ctx.t0)
            elif failed:  # the decode instance failed, not the client: count it as the upstream error it is
                self._close_transfer(transfer_id, "failed")
                self._observe(ctx, plan, prefill_task, ok=False, ttft=ttft)
                self.metrics.requests.labels(plan.mode, "5xx").inc()
            else:
                self.metrics.client_disconnects.inc()
                self._abort_legs(transfer_id, "client disconnected mid-stream")

    def _abort_legs(self, transfer_id: str | None, why: str) -> None:
        if transfer_id is None:
            return
        for t in self._legs.pop(transfer_id, []):
            t.cancel()  # closes the prefill connection: vLLM aborts it and the connector frees its blocks
        self.ledger.mark(transfer_id, "aborted", why)

    def _close_transfer(self, transfer_id: str | None, state: str) -> None:
        if transfer_id is None:
            return
        self._legs.pop(transfer_id, None)
        self.ledger.mark(transfer_id, state)  # type: ignore[arg-type]

    def _observe(
        self,
        ctx: _Ctx,
        plan: Plan,
        prefill_task: asyncio.Task[_PrefillResult] | None,
        ok: bool,
        ttft: float | None,
        output_tokens: int = 0,
    ) -> None:
        cached, tier, uncached = ctx.prompt_split(plan.computing)
        if ok:
            self.metrics.cached_prompt_tokens.inc(cached)
            if tier:
                self.metrics.tier_prompt_tokens.inc(tier)
        observe = getattr(self.policy, "observe", None)
        if observe is None:
            return
        if single_instance_reason(ctx.body):
            output_tokens = 0  # n/best_of/beam count tokens over several sequences: not one stream's steps
        prefill_s = None
        if (
            prefill_task is not None
            and prefill_task.done()
            and not prefill_task.cancelled()
            and prefill_task.exception() is None
        ):
            prefill_s = prefill_task.result().seconds
        try:
            observe(
                Outcome(
                    request_id=ctx.request_id,
                    plan=plan,
                    ok=ok,
                    prompt_tokens=len(ctx.tokens),
                    uncached_tokens=uncached,
                    ttft_s=ttft,
                    prefill_s=prefill_s,
                    e2e_s=time.monotonic() - ctx.t0,
                    output_tokens=output_tokens,
                )
            )
        except Exception:
            logger.exception("policy.observe raised; ignoring")


@dataclass
class _PrefillResult:
    seconds: float | None  # the leg's duration when the instance was idle (a prefill time to fit), else None
    cached_tokens: int | None  # prompt tokens the prefill instance had cached (its usage), for decode's usage
    params: (
        dict[str, Any] | None
    )  # kv_transfer_params of its answer (sequential flow: where decode loads from)


class _Interrupted(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _PrefillFailed(Exception):
    def __init__(self, instance: str, reason: str) -> None:
        super().__init__(f"{instance}: {reason}")
        self.instance, self.reason = instance, reason


async def _prefill_cached(task: asyncio.Task[_PrefillResult] | None) -> int | None:
    """The prefill leg's own cached-token count (decode's usage then reports it). Decode had the KV, so the
    prefill's answer is at most moments away; a leg that failed (decode recomputed) gives None."""
    if task is None:
        return None
    if not task.done():
        await asyncio.wait({task}, timeout=2.0)
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result().cached_tokens


def _consume(task: asyncio.Task[Any]) -> None:
    """Retrieve a leg's exception once the response no longer waits for it (avoids asyncio's warning)."""
    if not task.cancelled():
        task.exception()


async def _encode(size: int, encode: Callable[..., list[int]], *args: Any) -> list[int]:
    """Tokenize on the event loop, or in a worker thread for long inputs so every other stream keeps moving."""
    if size > _OFF_LOOP_CHARS:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)


_HOT_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat/completions"}
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")


@dataclass
class _Stream:
    """A streamed answer: its headers and the relay generator; ``on_close`` runs once the stream ended."""

    headers: list[tuple[bytes, bytes]]
    body: AsyncIterator[bytes]
    on_close: list[Callable[[], None]] = field(default_factory=list)


async def _write_stream(resp: _Stream, ex: Exchange, send: Any) -> None:
    """Relay chunks with one ``send`` each. A client that disconnects interrupts the relay (its ``finally`` aborts
    the legs); the server's own send would otherwise drop the bytes silently and the stream would run on."""
    try:
        ex.arm(CLIENT_GONE)
        await send({"type": "http.response.start", "status": 200, "headers": resp.headers})
        async for chunk in resp.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ex.disarm()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if ex.take() is None:
            raise  # cancelled from outside (shutdown), not by the client leaving
    finally:
        ex.disarm()
        with contextlib.suppress(Exception):
            await resp.body.aclose()  # type: ignore[attr-defined]
        for fn in resp.on_close:
            fn()


class _ASGIApp:
    """The proxy as an ASGI 3 callable (servers detect the interface from an ``async __call__``)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.proxy.asgi(scope, receive, send)
