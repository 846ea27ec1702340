"""The P/D proxy: an OpenAI-compatible front that routes each request to a transfer, recompute or colocated plan.

This module wires the parts together and holds the state they share: the instances (``InstanceRegistry``, kept by
``Discovery``), the prefix index, the policy, the transfer ledger and the legs its reaper may cancel, metrics and the
recent decisions. Per request: ``intake.admit`` validates, tokenizes and looks up the prompt; ``Exchange`` plans,
runs the legs with their fallback ladder and relays the answer. The two inference routes are served by the proxy's
own HTTP server (``http_server``) or, embedded in another server, through ``Proxy.app`` (ASGI); the other routes are
Starlette (``admin``).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import time
from collections.abc import Coroutine
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from vllm_disagg.policy.api import ClusterView, Plan, Policy, RequestView
from vllm_disagg.policy.guard import PolicyGuard
from vllm_disagg.router.admin import build_admin_app
from vllm_disagg.router.admin_journal import AdminJournal, undone_later
from vllm_disagg.router.admission import Admission, Refused
from vllm_disagg.router.config import InstanceConfig, ProxySettings, load_api_keys
from vllm_disagg.router.discovery import Discovery
from vllm_disagg.router.exchange import Exchange, Sink, Stream
from vllm_disagg.router.http_server import Connection, ServerRequest
from vllm_disagg.router.instances import Instance, InstanceRegistry
from vllm_disagg.router.intake import (
    HOT_ROUTES,
    RequestContext,
    admit,
    client_request_id,
    new_request_id,
    openai_error,
)
from vllm_disagg.router.interrupts import CLIENT_GONE, DeadlineHook, Interrupts
from vllm_disagg.router.ledger import Handoff, TransferLedger
from vllm_disagg.router.legs import single_instance_reason
from vllm_disagg.router.logs import Occasional, request_log_level
from vllm_disagg.router.loop_lag import LoopLagMonitor
from vllm_disagg.router.metrics import ProxyMetrics
from vllm_disagg.router.token_cache import PrefixTokenCache
from vllm_disagg.router.tokenize_worker import TokenizeWorker, TokenizeWorkerError
from vllm_disagg.router.tokenizer import PromptTokenizer
from vllm_disagg.router.tracing import make_tracing
from vllm_disagg.router.upstream import UpstreamClient, UpstreamPool
from vllm_disagg.tokenizer_files import local_tokenizer

logger = logging.getLogger("vllm_disagg.proxy")

# A probe waits this long for each read (the instance's /health, /v1/models, /metrics) before it counts as failed.
PROBE_READ_TIMEOUT_S = 5.0
ADMIN_POLL_S = 0.1  # how often a worker looks for admin changes another worker took


class _Catalog:
    """What intake reads of the instances on every request (the models served, the context length), computed once
    per change of ``InstanceRegistry.catalog_version``."""

    __slots__ = ("version", "served", "adapters", "max_model_len", "_instances", "_without")

    def __init__(self, version: int, instances: list[Instance]) -> None:
        self.version = version
        self._instances = instances
        self.served = frozenset(m for i in instances for m in i.models)
        # LoRA adapters (a model card with a parent): vLLM keys their blocks apart from the base model's
        self.adapters = frozenset(
            d["id"]
            for i in instances
            for d in i.model_cards
            if d.get("parent") and isinstance(d.get("id"), str)
        )
        lens = [i.max_model_len for i in instances if i.max_model_len]
        self.max_model_len = min(lens) if lens else None
        self._without: dict[str, frozenset[str]] = {}

    def without(self, model: str) -> frozenset[str]:
        got = self._without.get(model)
        if got is None:
            got = frozenset(i.id for i in self._instances if i.models and model not in i.models)
            if len(self._without) < 1024:  # model names come from clients: remember only so many
                self._without[model] = got
        return got


class Proxy:
    def __init__(self, settings: ProxySettings, policy: Policy, index: Any = None) -> None:
        self.settings = settings
        self.policy = policy
        self.guard = PolicyGuard(policy, logger)
        self.index = index  # PrefixIndex or None
        self.log = logger
        self.client_kv_params_log = (
            Occasional()
        )  # one line a minute: vLLM's example proxies send them every time
        self.metrics = ProxyMetrics()
        self.ledger = TransferLedger(deadline_s=settings.transfer_deadline_s)
        interval = settings.loop_lag_interval_s
        self.loop_lag = LoopLagMonitor(interval) if interval > 0 else None
        # Health, model and load probes, off the request path: their own pool, so a probe's deadline (a read that
        # stalls PROBE_READ_TIMEOUT_S) is not a request's (two failed probes in a row mark an instance down).
        self.probes = UpstreamPool(
            settings.connect_timeout_s, PROBE_READ_TIMEOUT_S, settings.upstream_keepalive_s
        )
        # The request path's legs: keep-alive connections with a C parser. Idle connections are dropped before the
        # instances drop them (uvicorn: 5 s), so a request is rarely written into a connection the server is closing
        # (and is sent once more when it is).
        self.upstream: UpstreamClient = UpstreamPool(
            settings.connect_timeout_s, settings.request_timeout_s, settings.upstream_keepalive_s
        )
        secret = settings.shared_secret.encode() if settings.shared_secret else None
        self.registry = InstanceRegistry(
            self.probes, secret, settings.breaker_failures, settings.breaker_open_s
        )
        if index is not None:
            self.registry.on_fresh_cache = index.clear
        local = local_tokenizer(settings.tokenizer) if settings.tokenizer else None
        self.tokenizer = PromptTokenizer(local) if local else None
        self.tokenize_worker = TokenizeWorker(local, settings.block_size) if local else None
        # prompts that repeat a recent prefix are tokenized only past it (router/token_cache.py)
        self.token_cache = PrefixTokenCache() if self.tokenizer is not None else None
        self._token_cache_seen = (0, 0)  # its hits and misses as last exported to /metrics
        # the prefix index's resets per instance, as last exported to /metrics
        self._index_resets_seen: dict[str, int] = {}
        self.decisions: collections.deque[tuple[Any, ...]] = collections.deque(
            maxlen=settings.recent_decisions
        )
        self.admission = Admission(settings.max_concurrency, settings.max_queued, settings.queue_timeout_s)
        self.legs: dict[str, list[asyncio.Task[Any] | DeadlineHook]] = {}  # what aborting a hand-off cancels
        self.discovery = Discovery(self)
        self._learning: set[str] = set()
        self._bg: list[asyncio.Task[None]] = []
        self.tracing = make_tracing(settings.otlp_traces_endpoint)
        self.api_keys = load_api_keys(settings)
        self.request_log_level = request_log_level(settings.log_format)  # the per-request line's level
        self.draining = False  # shutting down: /health says 503 so load balancers stop sending
        self._catalog_cache: _Catalog | None = None
        self.worker, self.workers = 0, 1
        self.journal: AdminJournal | None = None  # with several workers: the admin changes they all apply
        self._admin_lock = asyncio.Lock()
        # journal seq -> why this worker could not apply that change (the latest few)
        self.admin_errors: dict[int, str] = {}
        self._taken = self.metrics.worker_requests.labels("0")
        self.admin_app = build_admin_app(self)
        self.app = _ASGIApp(self)
        self.hot_routes = {
            path: (lambda req, conn, kind=kind: self.serve_native(req, conn, kind))
            for path, kind in HOT_ROUTES.items()
        }
        # /health is probed often and must answer at once even while 200 KB prompts are routed: no ASGI layers
        self.get_routes = {"/health": self.serve_health, "/ping": self.serve_health}

    def set_worker(self, worker: int, workers: int, shared: Any, journal: AdminJournal | None = None) -> None:
        """This proxy is worker ``worker`` of ``workers`` processes; ``shared`` holds their in-flight counts and
        ``journal`` the admin changes every worker applies."""
        self.worker, self.workers = worker, workers
        self.registry.shared = shared
        self.journal = journal
        self._taken = self.metrics.worker_requests.labels(str(worker))

    # ------------------------------------------------------------------ lifecycle

    def lifespan(self, app: Starlette) -> _Lifespan:
        """Starlette's lifespan: ``start`` on entry, ``stop`` on exit."""
        return _Lifespan(self)

    async def start(self) -> None:
        self._bg.extend(await self.discovery.start())
        if self.journal is not None:
            await self.follow_admin()  # a (re)started worker joins with the changes the others applied
            self._bg.append(asyncio.create_task(self._follow_admin_loop()))
        self._bg.append(asyncio.create_task(self._background()))
        self._bg.append(asyncio.create_task(self._flush_metrics()))
        if self.loop_lag is not None:
            self.loop_lag.start()
        if self.tokenize_worker is not None:
            try:
                await self.tokenize_worker.start()  # up before the first long prompt
            except TokenizeWorkerError as exc:
                logger.warning("%s; long prompts are tokenized in-process", exc)

    async def stop(self) -> None:
        for t in self._bg:
            t.cancel()
        if self.loop_lag is not None:
            self.loop_lag.stop()
        if self.tokenize_worker is not None:
            await self.tokenize_worker.close()
        self.discovery.stop()
        self.probes.close()
        self.upstream.close()

    async def add_instance(self, cfg: InstanceConfig) -> Instance:
        return await self.discovery.add(cfg)

    def remove_instance(self, instance_id: str) -> Instance:
        return self.discovery.remove(instance_id)

    async def apply_admin(self, change: dict[str, Any]) -> None:
        """One admin change as the journal carries it. A replay skips what is already so (an instance added by
        discovery meanwhile, one removed since)."""
        op, iid = change.get("op"), str(change.get("id", ""))
        if op == "add":
            cfg = InstanceConfig.model_validate(change.get("config"))
            if cfg.instance_id() not in self.registry.instances:
                await self.add_instance(cfg)
        elif op == "remove":
            if iid in self.registry.instances:
                self.remove_instance(iid)
        elif op in ("drain", "resume"):
            inst = self.registry.instances.get(iid)
            if inst is not None:
                inst.draining = op == "drain"
        else:
            raise ValueError(f"unknown admin change {op!r}")

    async def follow_admin(self) -> None:
        """Apply the journal's new changes in order (the worker that took an admin call applies it this way too)."""
        journal = self.journal
        if journal is None:
            return
        async with self._admin_lock:
            last = 0
            entries = journal.new_entries()
            undone = undone_later(entries)
            for seq, change in entries:
                if seq in undone:  # a replay: the instance is removed further on (see undone_later)
                    last = seq
                    continue
                try:
                    await self.apply_admin(change)
                except Exception as exc:
                    self.admin_errors[seq] = str(exc)
                    while len(self.admin_errors) > 64:
                        del self.admin_errors[next(iter(self.admin_errors))]
                    logger.error(
                        "admin change %s not applied on proxy worker %d: %s; this worker's instances may now "
                        "differ from the others' (GET /admin/instances on each shows them)",
                        change, self.worker, exc,
                    )  # fmt: skip
                last = seq
            if last:
                journal.mark_applied(last)

    async def _follow_admin_loop(self) -> None:
        while True:
            await asyncio.sleep(ADMIN_POLL_S)
            try:
                await self.follow_admin()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("proxy worker %d: reading the admin journal failed", self.worker)

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
                    for t in self.legs.pop(h.transfer_id, []):
                        t.cancel()
                    self.release_on_prefill(h.transfer_id, h.note, h)
                await self.discovery.sync_file()
                self.export_instance_metrics()
                # connections idle past the keep-alive, whoever they went to (a request that ended after its
                # instance was removed puts its connection back under a URL nothing asks for again)
                self.upstream.sweep()
                self.probes.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("proxy background loop error")
            await asyncio.sleep(self.settings.health_interval_s)

    async def _flush_metrics(self) -> None:
        """The request path's tally into the Prometheus metrics every second: /metrics flushes its own worker's
        before rendering, and with several workers the others' reach their files within a second."""
        while True:
            await asyncio.sleep(1.0)
            self._flush_tallies()

    def _flush_tallies(self) -> None:
        self.metrics.tally.flush()
        if self.loop_lag is not None:
            self.loop_lag.counts.flush(self.metrics.loop_lag)

    def forget_instance(self, inst: Instance) -> None:
        """What the proxy keeps for an instance that left the pool, dropped: its metric series, its idle
        connections (taken only by requests to its URL, which it no longer gets), its prefix-index entries and the
        policy's state for it."""
        self.metrics.forget_instance(inst.id, inst.role)
        self._index_resets_seen.pop(inst.id, None)
        self.upstream.forget(inst.url)
        self.probes.forget(inst.url)
        if self.index is not None:
            self.index.remove_instance(inst.id)
        forget = getattr(self.policy, "forget_instance", None)
        if forget is not None:
            try:
                forget(inst.id)
            except Exception:  # a user's policy: its bug must not fail the removal
                logger.exception("the policy's forget_instance(%r) failed", inst.id)

    def export_instance_metrics(self) -> None:
        m = self.metrics
        self._flush_tallies()
        running_decode = 0.0
        now = time.monotonic()
        for inst in self.registry.instances.values():
            lbl = (inst.id, inst.role)
            m.instance_in_flight.labels(*lbl).set(inst.in_flight)
            m.instance_healthy.labels(*lbl).set(1 if inst.available(now) else 0)
            m.instance_waiting.labels(*lbl).set(inst.waiting)
            m.instance_running.labels(*lbl).set(inst.running)
            m.instance_kv_usage.labels(*lbl).set(inst.kv_usage)
            if inst.role in ("decode", "both"):
                running_decode += inst.running
        m.pool_running_streams.labels("decode").set(running_decode)
        m.transfers_in_flight.set(self.ledger.in_flight())
        m.queue_depth.set(self.admission.queued)
        if self.token_cache is not None:
            cache, seen = self.token_cache, self._token_cache_seen
            m.token_cache_lookups.labels("hit").inc(cache.hits - seen[0])
            m.token_cache_lookups.labels("miss").inc(cache.misses - seen[1])
            self._token_cache_seen = (cache.hits, cache.misses)
            m.token_cache_bytes.set(cache.bytes)
        if self.index is not None:
            m.index_blocks.clear()  # instances and tiers come and go
            for iid, st in self.index.stats()["instances"].items():
                m.index_blocks.labels(iid, "device").set(st["blocks"])
                resets, exported = st["resets"], self._index_resets_seen.get(iid, 0)
                if resets != exported:
                    m.index_resets.labels(iid).inc(max(0, resets - exported))
                    self._index_resets_seen[iid] = resets
                for medium, n in st["tier_blocks"].items():
                    m.index_blocks.labels(iid, medium).set(n)

    # ------------------------------------------------------------------ the inference routes

    def authorized(self, authorization: str | None) -> bool:
        """Whether a client's ``Authorization`` header carries one of the API keys (always, without keys)."""
        if not self.api_keys:
            return True
        given = (authorization or "").removeprefix("Bearer ").strip().encode()
        ok = False
        for key in self.api_keys:  # every key compared: the time taken does not say which one was close
            ok |= hmac.compare_digest(given, key)
        return ok

    def unauthorized(self, inference: bool = True) -> Response:
        return self.reject(
            "unauthorized",
            openai_error(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY' with a key this proxy was given",
            ),
            inference,
        )

    async def serve_native(self, req: ServerRequest, conn: Connection, kind: str) -> None:
        """A hot route on the proxy's own server: the body is already read; the answer is written to ``conn``."""
        t0 = time.monotonic()
        # A dict update: with --workers a direct inc() writes prometheus_client's mmap file on every request.
        self.metrics.tally.inc(self._taken)
        ix = Interrupts(conn.task)  # the connection's serving task runs this handler
        req.on_disconnect = ix.client_left
        resp: Response | Stream
        if self.api_keys and not self.authorized(req.headers.get("authorization")):
            resp = self._refused_at_intake(self.unauthorized(), req.headers, t0)  # before the body is parsed
        elif req.too_large:
            resp = self._refused_at_intake(self._too_large(), req.headers, t0)
        else:
            resp = await self.serve(req.headers, req.body, kind, ix, t0)
        if isinstance(resp, Stream):
            await _write_stream(resp, ix, conn, conn=conn)
        elif not conn.closed:
            headers = [(k, v) for k, v in resp.raw_headers if k != b"content-length"]
            conn.respond(resp.status_code, headers, bytes(resp.body))

    def health(self) -> tuple[int, bytes]:
        """/health's status and JSON body: 503 while draining (load balancers stop sending while answers under way
        finish) or while no instance can serve."""
        n = len(self.registry.instances)
        if self.draining:
            return 503, b'{"status": "draining", "instances": %d}' % n
        if self.registry.serving():
            return 200, b'{"status": "ok", "instances": %d}' % n
        return 503, b'{"status": "unavailable", "instances": %d}' % n

    async def serve_health(self, req: ServerRequest, conn: Connection) -> None:
        status, body = self.health()
        conn.respond(status, [(b"content-type", b"application/json")], body)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The proxy as an ASGI app: the inference routes here, the rest (and the lifespan) in Starlette."""
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = HOT_ROUTES.get(scope["path"])
            if kind is not None:
                t0 = time.monotonic()
                request = Request(scope, receive)
                if not self.authorized(request.headers.get("authorization")):
                    refused = self._refused_at_intake(self.unauthorized(), dict(request.headers), t0)
                    await refused(scope, receive, send)
                    return
                ix = Interrupts(asyncio.current_task())
                try:
                    raw = await self._read_asgi_body(request)
                    if isinstance(raw, Response):
                        await self._refused_at_intake(raw, dict(request.headers), t0)(scope, receive, send)
                        return
                    ix.watch(request.receive)
                    headers = {k: v for k, v in request.headers.items()}
                    resp = await self.serve(headers, raw, kind, ix, t0)
                    if isinstance(resp, Stream):
                        await _write_stream(resp, ix, _ASGISink(send), send=send)
                    else:
                        await resp(scope, receive, send)
                finally:
                    ix.close()
                return
        await self.admin_app(scope, receive, send)

    async def _read_asgi_body(self, request: Request) -> bytes | Response:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> Response:
        limit = self.settings.max_body_bytes
        return self.reject("body_too_large", openai_error(413, f"request body over {limit} bytes"))

    async def serve(
        self, headers: dict[str, str], raw: bytes, kind: str, ix: Interrupts, t0: float
    ) -> Response | Stream:
        """Admission, intake, then the exchange. A stream holds its slot until its end."""
        admission = self.admission
        priority = 0
        raw_priority = headers.get("x-request-priority")
        if raw_priority is not None:
            try:
                priority = max(-100, min(100, int(raw_priority.strip())))
            except ValueError:
                message = f"x-request-priority must be an integer, got {raw_priority!r}"
                return self._refused_at_intake(
                    self.reject("malformed", openai_error(400, message)), headers, t0
                )
        if not admission.try_acquire():
            # the tenant the queue is fair between: the key as the check reads it (one key sent in several
            # spellings is one tenant)
            tenant = headers.get("authorization", "").removeprefix("Bearer ").strip()
            waited = await self._wait_for_slot(priority, tenant, ix)
            if isinstance(waited, Response):  # the queue refused it, or its client left while it waited
                return self._refused_at_intake(waited, headers, t0)
        if self.tracing is not None:
            return await self._serve_traced(headers, raw, kind, ix, t0)
        streaming = False
        ctx: RequestContext | Response | None = None
        try:
            ctx = await admit(self, headers, raw, kind, ix, t0)
            if isinstance(ctx, Response):
                return self._refused_at_intake(ctx, headers, t0)
            resp = await Exchange(self, ctx, raw if ctx.body_unchanged else None).serve()
            if isinstance(resp, Stream):
                streaming = True
                resp.on_close.append(admission.release)
            return resp
        except Exception as exc:
            return self.internal_error(ctx, headers, kind, exc)
        finally:
            if not streaming:
                admission.release()

    def _refused_at_intake(self, resp: Response, headers: dict[str, str], t0: float) -> Response:
        """A request the proxy answered itself before any plan (a wrong API key, a body over the cap, a full queue,
        malformed, an unknown model, too long, no route): the answer carries the request's id like every other, and
        the per-request log has its line."""
        request_id = resp.headers.get("x-request-id") or client_request_id(headers.get("x-request-id"))
        if request_id is None:
            request_id = new_request_id()
        resp.headers["x-request-id"] = request_id
        if self.log.isEnabledFor(self.request_log_level):
            self.log.log(
                self.request_log_level,
                "request %s: refused with HTTP %d",
                request_id,
                resp.status_code,
                extra={
                    "event": "request_done",
                    "request_id": request_id,
                    "ok": False,
                    "status": resp.status_code,
                    "mode": "none",
                    "e2e_s": round(time.monotonic() - t0, 6),
                    "worker": self.worker,
                },
            )
        return resp

    def internal_error(
        self, ctx: RequestContext | Response | None, headers: dict[str, str], kind: str, exc: Exception
    ) -> Response:
        """A bug's answer: ``exc`` logged with its traceback and the request's id, counted among the inference
        answers (an error-rate alert sees it), and a 500 that carries the id."""
        request_id = (
            ctx.request_id
            if isinstance(ctx, RequestContext)
            else client_request_id(headers.get("x-request-id")) or "(not yet numbered)"
        )
        self.log.error(
            "request %s (/v1/%s): unhandled error in the proxy; the client got HTTP 500. This is a bug: please "
            "report it with this traceback",
            request_id,
            kind,
            exc_info=exc,
        )
        resp = openai_error(
            500,
            f"internal proxy error serving request {request_id} (see the proxy log)",
            **{"x-request-id": request_id},
        )
        return self.reject("internal_error", resp)

    async def _serve_traced(
        self, headers: dict[str, str], raw: bytes, kind: str, ix: Interrupts, t0: float
    ) -> Response | Stream:
        """``serve`` with a span per request (and its stages, see router/tracing.py); a stream's ends with it."""
        tracing = self.tracing
        assert tracing is not None
        root = tracing.request_span(headers)
        root.set_attribute("http.route", f"/v1/{kind}")
        streaming = False
        ctx: RequestContext | Response | None = None
        try:
            intake = tracing.child("intake", root)
            try:
                ctx = await admit(self, headers, raw, kind, ix, t0)
            finally:
                intake.end()
            if isinstance(ctx, Response):
                root.set_attribute("http.response.status_code", ctx.status_code)
                return self._refused_at_intake(ctx, headers, t0)
            ctx.span = root
            root.set_attribute("vllm_disagg.request_id", ctx.request_id)
            resp = await Exchange(self, ctx, raw if ctx.body_unchanged else None).serve()
            if isinstance(resp, Stream):
                streaming = True
                root.set_attribute("http.response.status_code", 200)
                resp.on_close.append(self.admission.release)
                resp.on_close.append(root.end)
            else:
                root.set_attribute("http.response.status_code", resp.status_code)
            return resp
        except Exception as exc:
            err = self.internal_error(ctx, headers, kind, exc)
            root.set_attribute("http.response.status_code", 500)
            return err
        finally:
            if not streaming:
                self.admission.release()
                root.end()

    async def _wait_for_slot(self, priority: int, tenant: str, ix: Interrupts) -> float | Response:
        """Queue for a slot (by priority, tenants in turn); the seconds waited, or the refusal."""
        try:
            ix.arm(CLIENT_GONE)
            waited = await self.admission.acquire(priority, tenant)
            ix.disarm()
        except Refused as exc:
            ix.disarm()
            self.metrics.tally.observe(self.metrics.queue_wait, exc.waited_s)
            why = (
                f"the proxy's queue is full ({self.admission.max_queued} waiting)"
                if exc.why == "queue_full"
                else f"no slot freed within queue_timeout_s={self.settings.queue_timeout_s:g}"
            )
            return self.reject(
                exc.why,
                openai_error(
                    429,
                    f"{why}; {self.admission.active} requests in flight (max_concurrency); retry shortly",
                    **{"Retry-After": "1"},
                ),
            )
        except asyncio.CancelledError:
            if ix.take() is None:
                raise
            self.metrics.client_disconnects.inc()
            return Response(status_code=499)
        self.metrics.tally.observe(self.metrics.queue_wait, waited)
        return waited

    @property
    def active(self) -> int:
        """Requests admitted and not finished (streams until their last byte)."""
        return self.admission.active

    # ------------------------------------------------------------------ shared by intake and the exchanges

    def reject(self, reason: str, resp: Response, inference: bool = True) -> Response:
        """A request refused before any plan: counted by ``reason`` and, on the inference routes (whose answers
        ``vllm_disagg_requests_total`` counts), as answered under mode "none"."""
        self.metrics.rejected.labels(reason).inc()
        if inference:
            self.metrics.child(self.metrics.requests, "none", f"{resp.status_code // 100}xx").inc()
        return resp

    def _catalog(self) -> _Catalog:
        version = self.registry.catalog_version
        c = self._catalog_cache
        if c is None or c.version != version:
            c = self._catalog_cache = _Catalog(version, list(self.registry.instances.values()))
        return c

    def served_models(self) -> frozenset[str]:
        return self._catalog().served

    def is_adapter(self, model: str) -> bool:
        """Whether ``model`` names a LoRA adapter an instance serves."""
        return model in self._catalog().adapters

    def instances_without(self, model: str) -> frozenset[str]:
        """Instances that list their models and ``model`` is not among them (base model or LoRA adapter)."""
        return self._catalog().without(model)

    def max_model_len(self) -> int | None:
        return self.settings.max_model_len or self._catalog().max_model_len

    def kv_bytes_per_token(self) -> int:
        """From the instances' KV geometry (all layers of one token on one TP rank, times the TP size)."""
        for inst in self.registry.instances.values():
            g = inst.geometry
            if g is not None and g.block_size:
                return g.num_layers * g.block_bytes * g.tp_size // g.block_size
        return 0

    def plan(self, ctx: RequestContext, excluded: set[str]) -> Plan:
        """Ask the policy (through its guard: a plan that cannot be served is replaced by least-loaded's)."""
        views = tuple(v for v in self.registry.views(ctx.cached, ctx.tier) if v.id not in excluded)
        cluster = ClusterView(
            instances=views,
            kv_bytes_per_token=self.settings.kv_bytes_per_token or self.kv_bytes_per_token(),
            link_bytes_per_s=self.settings.link_bytes_per_s,
            tier_bytes_per_s=self.settings.tier_bytes_per_s,
            now_s=time.monotonic(),
        )
        req = RequestView(
            request_id=ctx.request_id,
            prompt_tokens=ctx.prompt_tokens,
            max_tokens=ctx.max_tokens,
            stream=ctx.stream,
            model=str(ctx.body.get("model", "")),
        )
        plan = self.guard.plan(req, cluster)
        proxy_reason = plan.reason == "policy_error"  # reasons the proxy gives keep their own metric label
        prefill_id = plan.prefill
        if prefill_id is not None and plan.mode == "transfer":  # the guard saw to it that a transfer has one
            split = single_instance_reason(ctx.body)
            if split:
                plan, proxy_reason = Plan.recompute(plan.decode, reason=split), True
            elif self.registry.get(prefill_id).no_connector:
                plan, proxy_reason = Plan.recompute(plan.decode, reason="prefill_without_connector"), True
        if self.index is not None and ctx.index_keys:
            # where it is computed: prompts sharing its prefix find it there while it is (vLLM shares its blocks as
            # they are computed; a transfer's decode instance holds them only once the load completes)
            try:
                self.index.record_pending(plan.prefill or plan.decode, ctx.index_keys)
            except Exception:  # the index is an optimisation: never fail a request over it
                logger.exception("request %s: could not record its prefix as pending", ctx.request_id)
        self.metrics.tally.inc(self.metrics.decision(plan.mode, plan.reason or "policy", not proxy_reason))
        # Rendered when /admin/decisions is read, not per request.
        self.decisions.append(
            (ctx.request_id, time.time(), plan, ctx.prompt_tokens, ctx.cached, ctx.tier, tuple(ctx.fallbacks))
        )
        if plan.alternatives and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: %s; not taken: %s",
                ctx.request_id,
                plan.describe(),
                " | ".join(plan.alternatives),
            )
        return plan

    def learn_side_channel(self, inst: Instance, host: str, port: int) -> None:
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

        self._one_off(learn())

    def abort_legs(self, transfer_id: str | None, why: str) -> None:
        if transfer_id is None:
            return
        for t in self.legs.pop(transfer_id, []):
            t.cancel()  # closes the prefill connection: vLLM aborts it and the connector frees its blocks
        self.release_on_prefill(transfer_id, why)
        self.ledger.mark(transfer_id, "aborted", why)

    def release_on_prefill(self, transfer_id: str, why: str, handoff: Handoff | None = None) -> None:
        """The hand-off is over without decode's load: a prefill that already finished its leg holds the blocks
        for a decode that will not come (closing its connection frees nothing then), so tell its side channel."""
        h = handoff or self.ledger.open_handoffs.get(transfer_id)
        if h is None or h.state == "decoding":  # decode had its KV: prefill holds nothing for it
            return
        inst = self.registry.instances.get(h.prefill)
        if inst is None:
            return
        self._one_off(self.registry.release_transfer(inst, transfer_id, why))

    def _one_off(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, held (and cancelled at shutdown) with the proxy's tasks until it ends."""
        task = asyncio.create_task(work)
        self._bg.append(task)
        task.add_done_callback(lambda t: self._bg.remove(t) if t in self._bg else None)

    def close_transfer(self, transfer_id: str | None, state: str) -> None:
        if transfer_id is None:
            return
        self.legs.pop(transfer_id, None)
        self.ledger.mark(transfer_id, state)  # type: ignore[arg-type]


class _ASGISink:
    """A ``Sink`` over an ASGI ``send``: every write is sent before the relay reads on."""

    paused = True

    def __init__(self, send: Any) -> None:
        self._send = send
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if data:
            self._pending.append(data)

    def end(self, data: bytes) -> None:
        self.write(data)  # the caller sends the final, empty body message

    async def drain(self) -> None:
        pending, self._pending = self._pending, []
        for data in pending:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})


async def _write_stream(
    resp: Stream, ix: Interrupts, sink: Sink, conn: Connection | None = None, send: Any = None
) -> None:
    """Run the relay into ``sink`` (the connection, or an ASGI ``send``). A client that disconnects interrupts it:
    the relay's ``finally`` aborts the legs; a stream that never began releases what it held (``discard``)."""
    started = False
    try:
        ix.arm(CLIENT_GONE)
        if conn is not None:
            conn.start_stream(200, resp.headers, openai_events=True)
        else:
            await send({"type": "http.response.start", "status": 200, "headers": resp.headers})
        started = True
        await resp.run(sink)
        if sink.paused:
            await sink.drain()
        ix.disarm()
        if conn is not None:
            conn.end_stream()
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if ix.take() is None:
            raise  # cancelled from outside (shutdown), not by the client leaving
    finally:
        ix.disarm()
        if not started:
            resp.discard()
        for fn in resp.on_close:
            fn()


class _ASGIApp:
    """The proxy as an ASGI 3 callable (servers detect the interface from an ``async __call__``)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.proxy.asgi(scope, receive, send)


class _Lifespan:
    """The proxy's lifespan context (a class: mypyc, which compiles this module, has no async generators)."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy

    async def __aenter__(self) -> None:
        await self._proxy.start()

    async def __aexit__(self, *exc: object) -> None:
        await self._proxy.stop()
