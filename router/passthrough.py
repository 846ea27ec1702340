"""Routes the proxy forwards to one instance as they are: ``/v1/embeddings``, ``/tokenize``, ``/detokenize`` and
``/v1/responses`` (stateless: each request is served whole on one instance, colocated; no P/D split, no stored
responses across instances).

The instance is the least-loaded available one that serves the request's model (any role for embeddings and
tokenization; a decode-capable one for responses). Failures before the answer's head try the next instance.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from vllm_disagg.router.instances import Instance
from vllm_disagg.router.intake import (
    PASS_HEADERS,
    client_request_id,
    new_request_id,
    openai_error,
    parse_json_object,
    unknown_model,
)
from vllm_disagg.router.legs import take_client_kv_params
from vllm_disagg.router.upstream import UpstreamAnswer, UpstreamError

if TYPE_CHECKING:
    from vllm_disagg.router.app import Proxy

# route -> whether the instance must be able to generate (decode) for it
ROUTES = {"/v1/embeddings": False, "/tokenize": False, "/detokenize": False, "/v1/responses": True}
_TRIES = 2
_ENCODE = msgspec.json.Encoder().encode


def candidates(proxy: Proxy, model: str | None, generate: bool) -> list[Instance]:
    now = time.monotonic()
    out = [
        i
        for i in proxy.registry.instances.values()
        if i.available(now)
        and (not generate or i.role in ("decode", "both"))
        and (model is None or not i.models or model in i.models)
    ]
    return sorted(out, key=lambda i: (i.in_flight + i.waiting_now + i.running_now, i.id))


async def forward(proxy: Proxy, request: Request) -> Response:
    """Serve ``request`` on one instance; the answer, whatever it is, carries the request's id (the client's plain
    x-request-id or one made here), which the instance was sent too, so its log lines match the proxy's."""
    request_id = client_request_id(request.headers.get("x-request-id")) or new_request_id()
    resp = await _forward(proxy, request, request_id)
    resp.headers["x-request-id"] = request_id
    return resp


async def _forward(proxy: Proxy, request: Request, request_id: str) -> Response:
    path = request.url.path
    raw = await request.body()
    if len(raw) > proxy.settings.max_body_bytes:
        return proxy.reject("body_too_large", openai_error(413, "request body too large"), inference=False)
    try:
        body = parse_json_object(raw)
    except ValueError as exc:
        return proxy.reject("malformed", openai_error(400, f"malformed JSON body: {exc}"), inference=False)
    take_client_kv_params(body)  # only the proxy sets them, on any route
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return proxy.reject(
            "malformed", openai_error(400, "'model' must be a string", "model"), inference=False
        )
    if model is not None and (unknown := unknown_model(proxy, model, inference=False)) is not None:
        return unknown
    headers = {
        k: v for k, v in request.headers.items() if k.lower() in PASS_HEADERS and k.lower() != "x-request-id"
    }
    headers["x-request-id"] = request_id
    tried: list[str] = []
    for inst in candidates(proxy, model, ROUTES[path])[:_TRIES]:
        inst.acquire()
        upstream: UpstreamAnswer | None = None
        try:
            raw_req = proxy.upstream.build(inst.url, "POST", path, _ENCODE(body), headers)
            upstream = await proxy.upstream.request(inst.url, raw_req)
        except UpstreamError as exc:
            inst.release()
            proxy.registry.report_failure(inst.id, f"{path}: {exc}")
            tried.append(f"{inst.id}: {type(exc).__name__}")
            continue
        except BaseException:  # cancelled (the client left, shutdown): the slot is freed all the same
            inst.release()
            raise
        if upstream.status_code >= 500:
            try:
                content = await upstream.read()
            finally:
                upstream.close()
                inst.release()
            tried.append(f"{inst.id}: HTTP {upstream.status_code}")
            # As on the inference routes: a 500 may be the request's own doing, so it is not sent on (nor held
            # against the instance); 502/503/504 are.
            if upstream.status_code != 500:
                proxy.registry.report_failure(inst.id, f"{path}: HTTP {upstream.status_code}")
                if len(tried) < _TRIES:
                    continue
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        proxy.registry.report_success(inst.id)
        media = next((v.decode("latin-1") for k, v in upstream.headers if k.lower() == b"content-type"), None)
        extra = {"x-disagg-path": f"passthrough; instance={inst.id}"}
        if media and media.startswith("text/event-stream"):
            return StreamingResponse(_relay(upstream, inst), media_type=media, headers=extra)
        try:
            content = await upstream.read()
        finally:
            upstream.close()
            inst.release()
        return Response(content, status_code=upstream.status_code, media_type=media, headers=extra)
    return openai_error(
        503,
        f"no instance could serve {path} for model {model!r}" + (f" ({'; '.join(tried)})" if tried else ""),
        **{"Retry-After": "2"},
    )


async def version(proxy: Proxy) -> Response:
    """GET /version: an available instance's answer (vLLM's version, which clients read to tell what serves them)."""
    for inst in candidates(proxy, None, False)[:_TRIES]:
        try:
            status, content = await proxy.probes.get(inst.url, "/version")
        except UpstreamError:
            continue
        if status == 200:
            return Response(content, media_type="application/json")
    return openai_error(503, "no instance answered /version", **{"Retry-After": "2"})


async def _relay(upstream: UpstreamAnswer, inst: Instance) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.chunks():
            yield chunk
    finally:
        upstream.close()
        inst.release()
