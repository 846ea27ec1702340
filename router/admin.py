"""The proxy's non-inference routes: models, health, metrics and the admin API (Starlette; off the hot path).

Admin routes are wrapped by ``_guarded``, the one place the admin key is checked: disabled without ``--admin-key``
(403), wrong or missing key (401). A change (add, remove, drain, resume) goes through ``Proxy.apply_admin``; with
several workers it goes to all of them through the admin journal (``admin_journal.py``), and the answer says how
many had applied it (``workers_applied``) when it was sent.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_disagg.router.config import InstanceConfig, one_line
from vllm_disagg.router.intake import HOT_ROUTES, openai_error, parse_json_object
from vllm_disagg.router.metrics import render
from vllm_disagg.router.passthrough import ROUTES, forward, version

if TYPE_CHECKING:
    from vllm_disagg.router.app import Proxy

_Endpoint = Callable[[Request], Awaitable[Response]]
ADMIN_WAIT_S = 5.0  # how long an admin call waits for the other workers to apply its change


def build_admin_app(proxy: Proxy) -> Starlette:
    def guarded(endpoint: _Endpoint) -> _Endpoint:
        async def checked(request: Request) -> Response:
            key = proxy.settings.admin_key
            if not key:
                return openai_error(403, "admin API disabled: start the proxy with --admin-key")
            given = request.headers.get("x-admin-key") or request.headers.get(
                "authorization", ""
            ).removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), key.encode()):
                return openai_error(401, "admin key missing or wrong (header x-admin-key)")
            return await endpoint(request)

        return checked

    def client_route(endpoint: _Endpoint) -> _Endpoint:
        """An OpenAI route: the API key (when the proxy has keys) is checked before anything else."""

        async def checked(request: Request) -> Response:
            if not proxy.authorized(request.headers.get("authorization")):
                return proxy.unauthorized(inference=False)
            return await endpoint(request)

        return checked

    async def models(request: Request) -> Response:
        """Every model a healthy instance serves (base models and LoRA adapters, from the probes), once each."""
        cards: dict[str, dict[str, object]] = {}
        for inst in proxy.registry.instances.values():
            if inst.healthy:
                for card in inst.model_cards:
                    cards.setdefault(str(card["id"]), card)
        if not cards:
            return openai_error(503, "no healthy instance to list models from", **{"Retry-After": "2"})
        return JSONResponse({"object": "list", "data": list(cards.values())})

    async def passthrough(request: Request) -> Response:
        return await forward(proxy, request)

    async def vllm_version(request: Request) -> Response:
        return await version(proxy)

    async def health(request: Request) -> Response:
        status, body = proxy.health()  # the proxy's own server answers GET /health without this app
        return Response(body, status_code=status, media_type="application/json")

    async def prom(request: Request) -> Response:
        proxy.export_instance_metrics()
        return Response(
            await render(proxy.metrics.registry, live=proxy.registry.instances),
            media_type="text/plain; version=0.0.4",
        )

    async def change(entry: dict[str, Any]) -> dict[str, Any]:
        """Apply an admin change here, and with several workers on every one of them: what to add to the answer
        (how many workers had applied it)."""
        journal = proxy.journal
        if journal is None:
            await proxy.apply_admin(entry)
            return {}
        seq = journal.append(entry)
        await proxy.follow_admin()
        failed = proxy.admin_errors.get(seq)
        if failed is not None:
            raise ValueError(failed)  # the others fail it the same way: the caller gets the reason
        deadline = time.monotonic() + ADMIN_WAIT_S
        while (applied := journal.applied_by(seq)) < journal.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {"workers_applied": applied, "workers": journal.workers}

    def known(request: Request) -> Response | None:
        """404 for an instance id no worker knows (every worker has the same instances)."""
        try:
            proxy.registry.get(request.path_params["id"])
        except KeyError as exc:
            return openai_error(404, str(exc.args[0]))
        return None

    async def admin_list(request: Request) -> Response:
        return JSONResponse({"instances": [i.admin() for i in proxy.registry.instances.values()]})

    async def admin_add(request: Request) -> Response:
        try:
            cfg = InstanceConfig.model_validate(parse_json_object(await request.body()))
            if cfg.instance_id() in proxy.registry.instances:
                raise ValueError(f"instance {cfg.instance_id()!r} is already registered")
            extra = await change(
                {"op": "add", "id": cfg.instance_id(), "config": cfg.model_dump(mode="json")}
            )
        except ValidationError as exc:
            return openai_error(400, f"cannot add instance: {one_line(exc)}")
        except (ValueError, TypeError, RuntimeError) as exc:
            return openai_error(400, f"cannot add instance: {exc}")
        inst = proxy.registry.instances.get(cfg.instance_id())
        if inst is None:
            return openai_error(500, "instance added but then gone (removed meanwhile?)")
        return JSONResponse({**inst.admin(), **extra}, status_code=201)

    async def admin_remove(request: Request) -> Response:
        missing = known(request)
        if missing is not None:
            return missing
        iid = request.path_params["id"]
        extra = await change({"op": "remove", "id": iid})
        return JSONResponse({"removed": iid, **extra})

    def set_draining(draining: bool) -> _Endpoint:
        """Drain (no new requests; those under way finish) or resume the instance named in the path."""

        async def endpoint(request: Request) -> Response:
            missing = known(request)
            if missing is not None:
                return missing
            iid = request.path_params["id"]
            extra = await change({"op": "drain" if draining else "resume", "id": iid})
            inst = proxy.registry.instances.get(iid)
            body = inst.admin() if inst is not None else {"id": iid, "removed": True}
            return JSONResponse({**body, **extra})

        return endpoint

    async def served_before_this_app(request: Request) -> Response:
        # POSTs to the inference routes are served by the proxy's request path before they reach this app; the
        # route exists so that another method gets 405 (with Allow), as vLLM answers, not 404
        return openai_error(500, "inference route reached the admin app")

    async def admin_decisions(request: Request) -> Response:
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
            for rid, t, plan, n, cached, tier, fallbacks in list(proxy.decisions)
        ]
        # with several workers, each keeps its own: the answer names the one that took this call
        return JSONResponse({"decisions": rendered, "worker": proxy.worker})

    async def admin_index(request: Request) -> Response:
        """The prefix index's counters: blocks per instance and tier, lookups, hits, ignored event streams."""
        return JSONResponse(proxy.index.stats() if proxy.index is not None else {"enabled": False})

    async def admin_transfers(request: Request) -> Response:
        ledger = proxy.ledger
        return JSONResponse(
            {
                "open": ledger.snapshot(),
                "closed": ledger.counts,
                "stranded": ledger.stranded(),
                "worker": proxy.worker,
            }
        )

    app = Starlette(
        routes=[
            Route("/v1/models", client_route(models), methods=["GET"]),
            *(Route(path, client_route(passthrough), methods=["POST"]) for path in ROUTES),
            Route("/version", vllm_version, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route(
                "/ping", health, methods=["GET", "POST"]
            ),  # vLLM's (and SageMaker's) name for the same probe
            Route("/metrics", prom, methods=["GET"]),
            Route("/admin/instances", guarded(admin_list), methods=["GET"]),
            Route("/admin/instances", guarded(admin_add), methods=["POST"]),
            Route("/admin/instances/{id}", guarded(admin_remove), methods=["DELETE"]),
            Route("/admin/instances/{id}/drain", guarded(set_draining(True)), methods=["POST"]),
            Route("/admin/instances/{id}/resume", guarded(set_draining(False)), methods=["POST"]),
            *(Route(path, served_before_this_app, methods=["POST"]) for path in HOT_ROUTES),
            Route("/admin/decisions", guarded(admin_decisions), methods=["GET"]),
            Route("/admin/index", guarded(admin_index), methods=["GET"]),
            Route("/admin/transfers", guarded(admin_transfers), methods=["GET"]),
        ],
        lifespan=proxy.lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    # "/v1/completions/" is a 404, as vLLM answers it: a redirect would name the client's own Host header back to it
    # (and come before the API-key check)
    app.router.redirect_slashes = False
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """An unknown route or method answered as vLLM (FastAPI) does: ``{"detail": ...}`` in JSON, not plain text."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
