"""One request's lifetime after intake: plan, legs, fallback ladder, relay and outcome, in one object.

A transfer dispatches prefill and decode in parallel with a shared transfer id (the decode instance registers with
prefill, which pushes KV layer by layer). Every fallback is explicit: counted in
``vllm_disagg_decisions_total{mode,reason}`` and shown in the ``x-disagg-path`` response header.

Fallback ladder:
  * prefill fails before decode produced a token -> abort that decode leg; try the backup prefill, else recompute
    on the decode instance;
  * decode fails before its first token -> run the request elsewhere (another plan without that instance);
  * decode fails after tokens streamed -> a clean in-stream OpenAI error event, then ``[DONE]``.
A client that disconnects aborts both legs at once (the prefill frees its held blocks immediately).

The exchange waits inline on one thing at a time; the client leaving, the prefill leg failing and the hand-off's
deadline interrupt those waits (``Interrupts``). A streamed answer is written by the relay straight into a ``Sink``
(the client connection), one write per upstream chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from starlette.responses import Response

from vllm_disagg.policy.api import NoRoute, Outcome, Plan
from vllm_disagg.router.http_server import error_type
from vllm_disagg.router.instances import Instance
from vllm_disagg.router.intake import RequestContext, openai_error
from vllm_disagg.router.interrupts import CLIENT_GONE, DEADLINE, PREFILL, DeadlineHook
from vllm_disagg.router.legs import (
    completion_tokens,
    count_sse_events,
    decode_leg_params,
    has,
    load_failed_answer,
    patch_sse_usage,
    patch_usage_json,
    prefill_leg_body,
    prefill_leg_params,
    prefill_usage,
    prompt_cache_counts,
    single_instance_reason,
    split_complete_events,
)
from vllm_disagg.router.metrics import BucketCounts
from vllm_disagg.router.upstream import UpstreamAnswer, UpstreamError, UpstreamTimeout
from vllm_disagg.transfer_params import PROOF_KEY

if TYPE_CHECKING:
    from vllm_disagg.router.app import Proxy

_ENCODE = msgspec.json.Encoder().encode
SSE = (b"content-type", b"text/event-stream; charset=utf-8")
MAX_ATTEMPTS = 3
_ERROR_BODY_WAIT_S = 2.0  # how long an instance's 5xx answer is read for relaying, at most
_ERROR_BODY_MAX = 65536


class Sink(Protocol):
    """Where a streamed answer's chunks go: ``write`` never blocks; ``drain`` waits while ``paused``; ``end`` writes
    the last chunk together with the end of the answer (one write instead of two)."""

    @property
    def paused(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    def end(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


_DONE = b"data: [DONE]\n\n"


def _forward(sink: Sink, chunk: bytes) -> bool:
    """An OpenAI stream's last event is ``data: [DONE]``: the chunk that carries it also ends the answer (True)."""
    if chunk.endswith(_DONE):
        sink.end(chunk)
        return True
    sink.write(chunk)
    return False


@dataclass
class Stream:
    """A streamed answer: its headers, the relay that writes its body into a sink, and what runs when it ends.

    ``discard`` releases what the relay would have (the upstream connection, the instance slot) when the client
    left before the relay started."""

    headers: list[tuple[bytes, bytes]]
    run: Callable[[Sink], Awaitable[None]]
    discard: Callable[[], None]
    on_close: list[Callable[[], None]] = field(default_factory=list)


class _Retry(Exception):
    """A leg failed before the client saw anything: the request can run elsewhere (unless ``final``)."""

    def __init__(self, instance: str, reason: str, final: bool = False) -> None:
        super().__init__(f"{instance}: {reason}")
        self.instance, self.reason, self.final = instance, reason, final


def _retried_elsewhere(status: int) -> bool:
    """Whether an instance's 5xx before the first token sends the request to another instance. 502/503/504 say
    "not here, not now". A 500 is an internal error the request itself may have caused (vLLM's engine dies on
    some requests and answers 500): sent on, the same request could take down every instance in turn."""
    return status != 500


@dataclass
class _PrefillResult:
    seconds: float | None  # the leg's duration when the instance was idle (a prefill time to fit), else None
    # the prompt-cache counts of its usage (``PROMPT_CACHE_COUNTS``), reported in decode's usage in their place
    prompt_counts: dict[str, int] | None
    params: (
        dict[str, Any] | None
    )  # kv_transfer_params of its answer (sequential flow: where decode loads from)


class _Interrupted(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _PrefillFailed(Exception):
    """``final``: not recomputed elsewhere (see ``_retried_elsewhere``)."""

    def __init__(self, instance: str, reason: str, final: bool = False) -> None:
        super().__init__(f"{instance}: {reason}")
        self.instance, self.reason, self.final = instance, reason, final


class Exchange:
    """Serves one admitted request: ``serve()`` returns its answer (a ``Response`` or a ``Stream``)."""

    def __init__(self, proxy: Proxy, ctx: RequestContext, raw: bytes | None) -> None:
        self.p = proxy
        self.ctx = ctx
        self.ix = ctx.interrupts
        self.raw = raw  # the client's body, forwarded as is on local plans (None: it was changed at intake)
        # Instances that answered this request with a 5xx before its first token, and the last such answer. Whether
        # that was the instance's fault is known only once another instance served the request: one that fails
        # everywhere is the request's (a body vLLM cannot handle), so no instance is ejected for it and the client
        # gets the instance's own error.
        self.http_failed: list[tuple[str, str]] = []
        self.http_error: tuple[int, bytes, str] | None = None  # status, body, content type
        self.mode = "none"  # the last plan's mode (its label on an error answer)
        self.last_plan: Plan | None = None  # the last plan tried (its path header goes on a relayed error)

    async def serve(self) -> Response | Stream:
        """Plan and run; a leg that fails before the client saw anything sends the request elsewhere. An error
        answer counts in ``vllm_disagg_requests_total`` here, under the last plan's mode (a success counts when
        its answer has gone out, a stream at its end)."""
        answer = await self._serve()
        if isinstance(answer, Response) and answer.status_code >= 300:
            status = answer.status_code
            # 499: the client left (vllm_disagg_client_disconnects_total counts it), no answer went out
            if status != 499:
                self.p.metrics.child(self.p.metrics.requests, self.mode, f"{status // 100}xx").inc()
                if "x-request-id" not in answer.headers:
                    answer.headers["x-request-id"] = self.ctx.request_id
            self._log_unserved(status)
        return answer

    def _others_left(self, excluded: set[str]) -> bool:
        """Whether an instance not yet excluded could still serve the request (for the log line's next step): one
        that decodes, since every plan ends on one."""
        now = time.monotonic()
        return any(
            i.id not in excluded and i.available(now) and i.role != "prefill"
            for i in self.p.registry.instances.values()
        )

    def _log_unserved(self, status: int) -> None:
        """The per-request line of a request that ended without a served answer: an instance's error relayed, no
        instance able to serve it, or the client gone first (499)."""
        plan = self.last_plan
        outcome = "client left before its answer" if status == 499 else f"answered HTTP {status}"
        self._log_done(False, status, f"{outcome}; last plan:", plan)

    def _log_done(
        self,
        ok: bool,
        status: int,
        outcome: str,
        plan: Plan | None,
        output_tokens: int = 0,
        ttft: float | None = None,
    ) -> None:
        """The request's ``request_done`` line: one per request, served or not (at the proxy's request log level)."""
        p, ctx = self.p, self.ctx
        if not p.log.isEnabledFor(p.request_log_level):
            return
        p.log.log(
            p.request_log_level,
            "request %s: %s %s",
            ctx.request_id,
            outcome,
            plan.describe() if plan is not None else "none",
            extra={
                "event": "request_done",
                "request_id": ctx.request_id,
                "ok": ok,
                "status": status,
                "mode": plan.mode if plan is not None else self.mode,
                "decode": plan.decode if plan is not None else None,
                "prefill": plan.prefill if plan is not None else None,
                "reason": plan.reason if plan is not None else None,
                "fallbacks": list(ctx.fallbacks),
                "prompt_tokens": ctx.prompt_tokens,
                "output_tokens": output_tokens,
                "ttft_s": ttft,
                "e2e_s": round(time.monotonic() - ctx.t0, 6),
                "worker": p.worker,
            },
        )

    async def _serve(self) -> Response | Stream:
        p, ctx = self.p, self.ctx
        excluded: set[str] = set(ctx.excluded)  # instances that do not serve its model, then failed ones
        for attempt in range(MAX_ATTEMPTS):
            try:
                plan = p.plan(ctx, excluded)
                self.mode, self.last_plan = plan.mode, plan
                if ctx.span is not None and p.tracing is not None:
                    p.tracing.child("plan", ctx.span, mode=plan.mode, decode=plan.decode, prefill=plan.prefill,
                                    reason=plan.reason).end()  # fmt: skip
            except NoRoute as no_route:
                p.metrics.child(p.metrics.decisions, "none", "no_route").inc()
                if self.http_error is not None:
                    return self._relay_http_error()
                return openai_error(
                    503,
                    f"no instance can serve this request: {no_route}",
                    **{"Retry-After": "2"},
                )
            try:
                answer = await self._run(plan)
                for instance, error in self.http_failed:  # another instance served it: theirs was the fault
                    p.registry.report_failure(instance, error)
                return answer
            except _Retry as retry:
                excluded.add(retry.instance)
                ctx.fallbacks.append(retry.reason)
                if not retry.final:  # a decision only when the request is planned again
                    p.metrics.child(p.metrics.decisions, plan.mode, retry.reason).inc()
                if retry.final:
                    next_step = (
                        "not retried: an internal error may be the request's own (see the instance's log)"
                    )
                elif attempt < MAX_ATTEMPTS - 1 and self._others_left(excluded):
                    next_step = "retrying elsewhere"
                else:
                    next_step = "no other instance is available to try it"
                p.log.warning(
                    "request %s: %s on %s failed before its first token (%s); %s",
                    ctx.request_id,
                    plan.mode,
                    retry.instance,
                    retry.reason,
                    next_step,
                )
                if retry.final:
                    break
        if self.http_error is not None:
            return self._relay_http_error()
        return openai_error(
            502,
            f"request {ctx.request_id} failed on every instance tried ({'; '.join(ctx.fallbacks)})",
            **{"Retry-After": "2"},
        )

    def _relay_http_error(self) -> Response:
        """The last instance's own 5xx answer: every instance tried failed this request the same way."""
        assert self.http_error is not None
        status, body, media = self.http_error
        self.p.log.warning(
            "request %s failed with HTTP %d on every instance tried (%s): relaying the instance's answer; no "
            "instance is ejected for a request that fails everywhere",
            self.ctx.request_id,
            status,
            ", ".join(i for i, _ in self.http_failed),
        )
        headers = {"x-request-id": self.ctx.request_id}
        if self.last_plan is not None:
            headers["x-disagg-path"] = self._path_header(self.last_plan)
        return Response(body, status_code=status, media_type=media, headers=headers)

    def _path_header(self, plan: Plan, extra: str = "") -> str:
        ctx = self.ctx
        s = plan.describe()
        if plan.mode == "transfer" and ctx.flow:
            s += f"; flow={ctx.flow}"
        _, tier, _ = ctx.prompt_split(plan.computing)
        if tier:
            s += f"; tier_tokens={tier}"
        fb = ctx.fallbacks + ([extra] if extra else [])
        if fb:
            s += f"; fallback={','.join(fb)}"
        return s + (f"; worker={self.p.worker}" if self.p.workers > 1 else "")

    async def _run(self, plan: Plan) -> Response | Stream:
        p, ctx = self.p, self.ctx
        decode = p.registry.get(plan.decode)
        if plan.mode != "transfer":
            body = self.raw if self.raw is not None else _ENCODE(ctx.body)
            return await self._finish(plan, decode, body, prefill_task=None, transfer_id=None)
        assert plan.prefill is not None
        prefill = p.registry.get(plan.prefill)
        tid = uuid.uuid4().hex
        p_body = prefill_leg_body(ctx.body, prefill_leg_params(tid, p.registry.secret))
        side = None if prefill.side_refused else prefill.cfg.side_channel_addr()
        p.ledger.open(tid, ctx.request_id, prefill.id, decode.id)
        _, _, uncached = ctx.prompt_split(prefill.id)
        p.metrics.pool_queued_prefill_tokens.labels("prefill").inc(uncached)
        p_task = asyncio.create_task(self._prefill_leg(prefill, p_body, tid, uncached))
        p_task.add_done_callback(_consume)
        if side is not None:
            p_task.add_done_callback(self.ix.on_prefill_done)
        p.legs[tid] = [p_task]
        ctx.flow = "sequential" if side is None else "parallel"
        try:
            if side is None:
                # Sequential flow (the instance was given as a URL only): prefill first, then decode loads from
                # the side channel its answer names. Later requests use the parallel flow.
                try:
                    d_params = await self._sequential_params(prefill, p_task, tid)
                except _Interrupted as stop:
                    if stop.why == CLIENT_GONE:
                        p.abort_legs(tid, "client disconnected during prefill")
                        p.metrics.client_disconnects.inc()
                        return Response(status_code=499)
                    return self._deadline_passed(plan, tid)
            else:
                d_params = decode_leg_params(tid, side[0], side[1], p.registry.secret)
            d_body = dict(ctx.body)
            d_body["kv_transfer_params"] = d_params
            return await self._finish(plan, decode, _ENCODE(d_body), prefill_task=p_task, transfer_id=tid)
        except _PrefillFailed as failed:
            for t in p.legs.pop(tid, []):
                t.cancel()
            p.release_on_prefill(tid, failed.reason)
            p.ledger.mark(tid, "failed", failed.reason)
            if not failed.final:  # a final one is logged where it is relayed
                has_backup = bool(plan.backup_prefill) and plan.backup_prefill in p.registry.instances
                p.log.warning(
                    "request %s: prefill on %s failed (%s); %s",
                    ctx.request_id,
                    failed.instance,
                    failed.reason,
                    f"prefilling on {plan.backup_prefill} instead"
                    if has_backup
                    else f"recomputing the prompt on decode {plan.decode}",
                )
            if failed.final:  # as for decode: the request may be what failed the prefill
                raise _Retry(failed.instance, failed.reason, final=True) from None
            if plan.backup_prefill and plan.backup_prefill in p.registry.instances:
                ctx.fallbacks.append("prefill_failed:backup")
                p.metrics.child(p.metrics.decisions, "transfer", "prefill_failed:backup").inc()
                backup = Plan.transfer(plan.backup_prefill, plan.decode, reason="backup_prefill")
                return await self._run(backup)
            ctx.fallbacks.append(f"{failed.reason}:recompute")
            p.metrics.child(p.metrics.decisions, "recompute", failed.reason).inc()
            return await self._run(Plan.recompute(plan.decode, reason=failed.reason))

    def _deadline_passed(self, plan: Plan, transfer_id: str | None) -> Response:
        p, ctx = self.p, self.ctx
        p.abort_legs(transfer_id, "transfer deadline passed before the first token")
        return openai_error(
            504,
            f"request {ctx.request_id}: no first token within transfer_deadline_s="
            f"{p.settings.transfer_deadline_s:g} (prefill {plan.prefill} -> decode {plan.decode}); retry, or "
            "raise transfer_deadline_s for very long prompts",
            **{"x-request-id": ctx.request_id},
        )

    def _generation_timed_out(self, plan: Plan, inst: Instance, transfer_id: str | None) -> Response:
        """A non-streamed answer that sent nothing for request_timeout_s. vLLM writes such an answer, head included,
        only once generation ends: the instance may be working on it, so it is not run again elsewhere (a whole
        generation each time) but answered 504. It still counts against the instance (the caller reports it): a
        hung engine answers /health, and only its failures take it out of routing."""
        p, ctx = self.p, self.ctx
        p.abort_legs(transfer_id, "decode answer timed out")
        p.log.warning(
            "request %s: instance %s sent no byte of its non-streamed answer for request_timeout_s=%g; answered 504",
            ctx.request_id, inst.id, p.settings.request_timeout_s,
        )  # fmt: skip
        return openai_error(
            504,
            f"request {ctx.request_id}: instance {inst.id} sent no byte of its answer within request_timeout_s="
            f"{p.settings.request_timeout_s:g} (a non-streamed answer arrives whole when generation ends); stream "
            "long generations, or raise --request-timeout-s",
            **{"x-request-id": ctx.request_id},
        )

    async def _sequential_params(
        self, prefill: Instance, p_task: asyncio.Task[_PrefillResult], tid: str
    ) -> dict[str, Any]:
        """Wait for the prefill leg and build decode's params from its answer; ``_Interrupted`` when the client
        leaves or the hand-off passes its deadline meanwhile."""
        p, ix = self.p, self.ix
        p.legs.setdefault(tid, []).append(DeadlineHook(ix))
        try:
            ix.arm(CLIENT_GONE, DEADLINE)
            await asyncio.wait({p_task})
            ix.disarm()
        except asyncio.CancelledError:
            why = ix.take()
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
            p.log.error(
                "request %s: prefill %s answered without usable kv_transfer_params (%s); recomputing on decode. After "
                "3 such answers in a row it is no transfer source until it recovers: is it running DisaggConnector "
                "with kv_role kv_producer or kv_both?",
                self.ctx.request_id,
                prefill.id,
                params or "none",
            )
            raise _PrefillFailed(prefill.id, "prefill_without_connector")
        prefill.connector_misses = 0
        p.learn_side_channel(prefill, host, port)
        d_params = decode_leg_params(tid, host, port, p.registry.secret, params.get(PROOF_KEY))
        cached = params.get("remote_prefill_cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            d_params["remote_prefill_cached_tokens"] = cached  # vLLM then reports P's cache hits in usage
        return d_params

    async def _prefill_leg(
        self, inst: Instance, body: dict[str, Any], tid: str, uncached: int
    ) -> _PrefillResult:
        p, ctx = self.p, self.ctx
        t = time.monotonic()
        idle = (
            inst.in_flight == 0 and inst.waiting_now == 0
        )  # only then is the leg's duration prefill, not queueing
        inst.acquire()
        r: UpstreamAnswer | None = None
        headers, span = ctx.headers, None
        if ctx.span is not None and p.tracing is not None:
            span = p.tracing.child("prefill_leg", ctx.span, instance=inst.id, transfer_id=tid)
            headers = p.tracing.headers_for(span, headers)
        try:
            raw = p.upstream.build(inst.url, "POST", f"/v1/{ctx.kind}", _ENCODE(body), headers)
            r = await p.upstream.request(inst.url, raw)
            content = await r.read()
            if r.status_code != 200:
                final = r.status_code >= 500 and not _retried_elsewhere(r.status_code)
                if final:
                    self.http_failed.append((inst.id, f"HTTP {r.status_code}"))
                    self.http_error = (r.status_code, content[:_ERROR_BODY_MAX], _content_type(r))
                raise _PrefillFailed(inst.id, f"prefill_http_{r.status_code}", final=final)
            p.registry.report_success(inst.id)
            p.ledger.mark(tid, "prefill_done")
            dt = time.monotonic() - t
            p.metrics.prefill_leg.observe(dt)
            if p.index is not None and ctx.index_keys and p.registry.instances.get(inst.id) is inst:
                p.index.record_routed(inst.id, ctx.index_keys)  # not for an instance removed meanwhile
            usage, params = prefill_usage(content)
            return _PrefillResult(
                seconds=dt if idle else None, prompt_counts=prompt_cache_counts(usage), params=params
            )
        except UpstreamError as exc:
            p.registry.report_failure(inst.id, str(exc))
            raise _PrefillFailed(inst.id, "prefill_unreachable") from None
        finally:
            if span is not None:
                span.end()
            if r is not None:
                r.close()  # a leg cancelled mid-answer closes its connection: vLLM aborts it and frees its blocks
            inst.release()
            p.metrics.pool_queued_prefill_tokens.labels("prefill").dec(uncached)

    async def _rest(
        self, upstream: UpstreamAnswer, release: Callable[[], None], transfer_id: str | None
    ) -> bytes:
        """The rest of a whole (non-streamed) answer; cut off or cancelled, the leg's slot and the transfer go."""
        try:
            return await upstream.read()
        except BaseException:
            upstream.close()
            release()
            self.p.abort_legs(transfer_id, "decode answer cut off")
            raise

    async def _finish(
        self,
        plan: Plan,
        inst: Instance,
        body: bytes,
        prefill_task: asyncio.Task[_PrefillResult] | None,
        transfer_id: str | None,
    ) -> Response | Stream:
        """Send the decoding leg; return once its first bytes (or its whole answer) arrived."""
        p, ctx, ix = self.p, self.ctx, self.ix
        load = transfer_id is not None  # its KV comes from the prefill leg: no prompt to compute here
        inst.acquire(load=load)
        released = started = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                inst.release(streaming=started, load=load, tokens=ctx.stream_tokens)

        upstream: UpstreamAnswer | None = None
        if transfer_id is not None:
            # The ledger's reaper cancels this when the hand-off passes its deadline before decode's first token,
            # whether or not the prefill leg already answered.
            p.legs.setdefault(transfer_id, []).append(DeadlineHook(ix))
        stage = "decode_unreachable"
        headers, span = ctx.headers, None
        if ctx.span is not None and p.tracing is not None:
            span = p.tracing.child(
                "decode_leg", ctx.span, instance=inst.id, mode=plan.mode, transfer_id=transfer_id
            )
            headers = p.tracing.headers_for(span, headers)
        try:
            ix.arm(CLIENT_GONE, PREFILL, DEADLINE)
            if prefill_task is not None and prefill_task.done():
                ix.on_prefill_done(prefill_task)  # failed while the request was being built: interrupt now
            raw = p.upstream.build(inst.url, "POST", f"/v1/{ctx.kind}", body, headers)
            upstream = await p.upstream.request(inst.url, raw)
            if upstream.status_code >= 500:
                ix.disarm()
                error = b""
                with contextlib.suppress(UpstreamError, asyncio.TimeoutError):
                    error = await asyncio.wait_for(upstream.read(), _ERROR_BODY_WAIT_S)
                upstream.close()
                self.http_failed.append((inst.id, f"HTTP {upstream.status_code}"))
                self.http_error = (upstream.status_code, error[:_ERROR_BODY_MAX], _content_type(upstream))
                p.abort_legs(transfer_id, f"decode {inst.id} answered HTTP {upstream.status_code}")
                release()
                final = not _retried_elsewhere(upstream.status_code)
                raise _Retry(inst.id, f"decode_http_{upstream.status_code}", final=final)
            stage = "decode_failed_before_first_token"
            chunk = await upstream.next_chunk()
            ix.disarm()
            if chunk is None and upstream.status_code == 200:
                raise UpstreamError("the answer ended with no body")
            first = chunk or b""
            inst.started(load=load, tokens=ctx.stream_tokens)
            started = True
        except asyncio.CancelledError:
            why = ix.take()
            if upstream is not None:
                upstream.close()  # decode sent the client nothing yet: closing aborts it in vLLM
            release()
            if why is None:
                p.abort_legs(transfer_id, "proxy shutting down before the first token")
                raise
            if why == CLIENT_GONE:
                p.abort_legs(transfer_id, "client disconnected before the first token")
                p.metrics.client_disconnects.inc()
                return Response(status_code=499)
            assert prefill_task is not None or why == DEADLINE
            if why == DEADLINE or prefill_task is None or prefill_task.cancelled():
                return self._deadline_passed(plan, transfer_id)
            failure = prefill_task.exception()
            assert failure is not None
            raise failure from None  # _PrefillFailed: _run picks the next rung
        except UpstreamError as exc:
            ix.disarm()
            if upstream is not None:
                upstream.close()
            p.registry.report_failure(inst.id, str(exc))  # a timeout too: a hung engine still answers /health
            if isinstance(exc, UpstreamTimeout) and not ctx.stream:
                release()
                return self._generation_timed_out(plan, inst, transfer_id)
            p.abort_legs(
                transfer_id, "decode unreachable" if stage == "decode_unreachable" else "decode failed"
            )
            release()
            raise _Retry(inst.id, stage) from None
        except _Retry:
            raise
        except BaseException:
            ix.disarm()
            if upstream is not None:
                upstream.close()
            release()
            p.abort_legs(transfer_id, "proxy error before the first token")
            raise
        finally:
            if span is not None:
                span.end()  # the leg up to its first byte (or its failure); the relay has its own span
        assert upstream is not None
        if transfer_id is not None:
            p.ledger.mark(transfer_id, "decoding")  # decode has its KV: prefill holds nothing for it now
            if prefill_task is not None and not prefill_task.done():
                self._abandon_prefill_later(plan, prefill_task)
        if not ctx.stream or upstream.status_code != 200:
            # a whole answer: its body, read before anything reaches the client (a cut or a stall is still a
            # failure before the first token)
            try:
                first += await self._rest(upstream, release, transfer_id)
            except UpstreamError as cut:
                p.registry.report_failure(inst.id, str(cut))
                if isinstance(cut, UpstreamTimeout) and not ctx.stream:
                    return self._generation_timed_out(plan, inst, transfer_id)
                raise _Retry(inst.id, "decode_failed_before_first_token") from None
        p.registry.report_success(inst.id)
        loaded = True  # as far as the proxy can tell: a streamed answer cannot say its load failed
        if transfer_id is not None and not ctx.stream and upstream.status_code == 200:
            cleared = load_failed_answer(first)
            if cleared is not None:  # decode could not load the KV and computed the prompt itself
                first, loaded = cleared, False
                self._decode_recomputed(plan)
        if p.index is not None and ctx.index_keys and p.registry.instances.get(inst.id) is inst:
            try:
                p.index.record_routed(inst.id, ctx.index_keys)  # not for an instance removed meanwhile
            except Exception:  # the approximate index is an optimisation: never fail a request over it
                p.log.exception("request %s: could not record its prefix", ctx.request_id)
        ttft = time.monotonic() - ctx.t0
        header = {"x-disagg-path": self._path_header(plan), "x-request-id": ctx.request_id}
        if upstream.status_code != 200:
            upstream.close()
            release()
            p.abort_legs(transfer_id, f"decode answered HTTP {upstream.status_code}")
            return Response(
                first, status_code=upstream.status_code, headers=header, media_type=_content_type(upstream)
            )
        if not ctx.stream:
            rest = first
            upstream.close()
            release()
            p.close_transfer(transfer_id, "done" if loaded else "failed")
            if (
                has(rest, b'"prompt_tokens_details"')
                and (p_counts := await _prefill_counts(prefill_task)) is not None
            ):
                rest = patch_usage_json(rest, p_counts)
            self._observe(
                plan,
                prefill_task,
                ok=True,
                ttft=None,
                output_tokens=completion_tokens(rest),
                error="" if loaded else "decode's KV load failed: it computed the prompt",
            )
            by_mode, tally = p.metrics.of_mode(plan.mode), p.metrics.tally
            tally.inc(by_mode.ok)
            tally.observe(by_mode.e2e, time.monotonic() - ctx.t0)
            return Response(rest, status_code=200, headers=header, media_type="application/json")
        p.metrics.tally.observe(p.metrics.of_mode(plan.mode).ttft, ttft)

        async def run(sink: Sink) -> None:
            await self._relay(sink, plan, upstream, first, release, prefill_task, transfer_id, ttft)

        def discard() -> None:
            upstream.close()
            release()
            p.metrics.client_disconnects.inc()
            p.abort_legs(transfer_id, "client disconnected before the stream began")

        return Stream(
            [
                (b"x-disagg-path", header["x-disagg-path"].encode("latin-1")),
                (b"x-request-id", ctx.request_id.encode("latin-1")),
                SSE,
            ],
            run,
            discard,
        )

    async def _relay(
        self,
        sink: Sink,
        plan: Plan,
        upstream: UpstreamAnswer,
        first: bytes,
        release: Callable[[], None],
        prefill_task: asyncio.Task[_PrefillResult] | None,
        transfer_id: str | None,
        ttft: float,
    ) -> None:
        """Copy the decode leg's stream into ``sink`` chunk by chunk; usage events get the prefill's cache hits."""
        p, ctx = self.p, self.ctx
        finished = failed = False
        last = time.monotonic()
        itl = BucketCounts(p.metrics.itl_buckets)
        span = None
        if ctx.span is not None and p.tracing is not None:
            span = p.tracing.child("relay", ctx.span, instance=plan.decode)
        events = usage_tokens = 0
        held = b""  # the incomplete tail of a usage event split across chunks
        p_counts: list[dict[str, int] | None] = []  # the prefill leg's prompt-cache counts, asked for once
        answered = False  # the client has the whole answer: its [DONE] went out

        def send(chunk: bytes) -> None:
            nonlocal answered
            if _forward(sink, chunk) and not answered:
                answered = True
                # The client may hang up now: that is the end of a complete answer, not a disconnect. The relay
                # still reads the instance's answer to its end, so the connection goes back to the pool.
                self.ix.disarm()

        async def usage_fixed(events_: bytes) -> bytes:
            nonlocal usage_tokens
            if has(events_, b'"prompt_tokens_details"') and prefill_task is not None:
                if not p_counts:
                    p_counts.append(await _prefill_counts(prefill_task))
                if p_counts[0] is not None:
                    events_ = patch_sse_usage(events_, p_counts[0])
            usage_tokens = completion_tokens(events_) or usage_tokens
            return events_

        def direct(chunk: bytes) -> bool:
            """The per-chunk fast path, run from the upstream connection's callback: ITL, event count, one write.
            Declines (False) when the chunk needs the async path: usage to patch, or a client that is not keeping
            up (the async path waits for it)."""
            nonlocal last, events
            if held or sink.paused or has(chunk, b'"usage"'):
                return False
            now = time.monotonic()
            itl.observe(now - last)
            last = now
            events += count_sse_events(chunk)
            send(chunk)
            return True

        try:
            events += count_sse_events(first)
            if has(first, b'"usage"'):  # the whole answer can come in the first read, usage event and all
                complete, held = split_complete_events(first)
                first = await usage_fixed(complete) if complete else b""
            if first:
                send(first)
            if sink.paused:
                await sink.drain()
            upstream.pipe(direct)
            async for chunk in upstream.chunks():
                now = time.monotonic()
                itl.observe(now - last)
                last = now
                events += count_sse_events(chunk)
                if held or has(chunk, b'"usage"'):
                    complete, held = split_complete_events(held + chunk)
                    if not complete:
                        continue
                    chunk = await usage_fixed(complete)
                send(chunk)
                if sink.paused:
                    await sink.drain()
            if held:
                send(await usage_fixed(held))
                held = b""
            finished = True
        except UpstreamError as exc:
            if (
                answered
            ):  # the instance's connection ended after the client had its whole answer: nothing to say
                finished = True
            else:
                failed = True
                self._fail_mid_stream(sink, plan, exc)
        finally:
            # A shutdown cancelling the drain of a complete answer is no failure.
            finished = finished or answered
            if span is not None:
                span.set_attribute("outcome", "done" if finished else "failed" if failed else "client_gone")
                span.end()
            upstream.pipe(None)
            upstream.close()
            release()
            by_mode, tally = p.metrics.of_mode(plan.mode), p.metrics.tally
            tally.merge(by_mode.itl, itl)
            if finished:
                p.close_transfer(transfer_id, "done")
                self._observe(plan, prefill_task, ok=True, ttft=ttft, output_tokens=usage_tokens or events)
                tally.inc(by_mode.ok)
                tally.observe(by_mode.e2e, time.monotonic() - ctx.t0)
            elif failed:  # the decode instance failed, not the client: count it as the upstream error it is
                p.close_transfer(transfer_id, "failed")
                self._observe(plan, prefill_task, ok=False, ttft=ttft)
                p.metrics.child(p.metrics.requests, plan.mode, "5xx").inc()
            else:
                p.metrics.client_disconnects.inc()
                p.abort_legs(transfer_id, "client disconnected mid-stream")

    def _decode_recomputed(self, plan: Plan) -> None:
        """Decode's answer says its KV load failed (DisaggConnector reports it in a whole answer): the request was
        served, but as a recompute on decode, and its header, decisions and log say so."""
        p, ctx = self.p, self.ctx
        ctx.fallbacks.append("decode_load_failed:recompute")
        p.metrics.child(p.metrics.decisions, "recompute", "decode_load_failed").inc()
        p.log.warning(
            "request %s: decode %s could not load the KV from prefill %s and computed the prompt itself (the "
            "answer is whole and correct); decode's log says why. If this repeats, check that prefill's side channel "
            "is reachable from decode and that it prefills within decode's load_timeout_s",
            ctx.request_id,
            plan.decode,
            plan.prefill,
        )

    def _abandon_prefill_later(self, plan: Plan, prefill_task: asyncio.Task[_PrefillResult]) -> None:
        """Decode streams, so its KV is in place or it recomputed: prefill's answer is at most a step away unless
        the prompt still waits in prefill's queue. Past the grace period the leg is aborted there."""
        p = self.p
        handle = asyncio.get_running_loop().call_later(
            p.settings.prefill_leg_grace_s, self._abandon_prefill, plan, prefill_task
        )
        prefill_task.add_done_callback(lambda _: handle.cancel())

    def _abandon_prefill(self, plan: Plan, prefill_task: asyncio.Task[_PrefillResult]) -> None:
        if prefill_task.done():
            return
        p = self.p
        prefill_task.cancel()  # closes the leg's connection: vLLM aborts the request on the prefill instance
        p.metrics.prefill_legs_abandoned.labels(plan.prefill).inc()
        p.log.warning(
            "request %s: prefill %s had not answered %.1f s after decode %s began streaming (decode recomputed the "
            "prompt); aborted it there. If this repeats, that prefill queues past decode's load_timeout_s: add "
            "prefill capacity or raise load_timeout_s",
            self.ctx.request_id,
            plan.prefill,
            p.settings.prefill_leg_grace_s,
            plan.decode,
        )

    def _fail_mid_stream(self, sink: Sink, plan: Plan, exc: UpstreamError) -> None:
        """Tokens already reached the client: end the stream cleanly with an OpenAI-style error event."""
        p, ctx = self.p, self.ctx
        p.registry.report_failure(plan.decode, str(exc))
        p.log.error(
            "request %s: decode %s failed mid-stream: %s; the client got an error event",
            ctx.request_id,
            plan.decode,
            exc,
        )
        err = {
            "error": {
                "message": f"request {ctx.request_id}: decode instance {plan.decode} failed mid-stream",
                "type": error_type(500),  # as vLLM names an error event in a stream
                "param": None,
                "code": 500,
            }
        }
        sink.end(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
        p.metrics.child(p.metrics.decisions, plan.mode, "decode_failed_mid_stream").inc()

    def _observe(
        self,
        plan: Plan,
        prefill_task: asyncio.Task[_PrefillResult] | None,
        ok: bool,
        ttft: float | None,
        output_tokens: int = 0,
        error: str = "",
    ) -> None:
        p, ctx = self.p, self.ctx
        # status 200 for a stream cut after its head too: the status the client was sent
        self._log_done(ok, 200, "done" if ok else "failed", plan, output_tokens, ttft)
        cached, tier, uncached = ctx.prompt_split(plan.computing)
        if ok:
            if cached:
                p.metrics.tally.inc(p.metrics.cached_prompt_tokens, cached)
            if tier:  # a tier hit counts whether or not the instance's own cache held a prefix
                p.metrics.tally.inc(p.metrics.tier_prompt_tokens, tier)
        observe = getattr(p.policy, "observe", None)
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
        p.guard.observe(  # an observe() that raises is logged by kind, never per request
            Outcome(
                request_id=ctx.request_id,
                plan=plan,
                ok=ok and not error,  # a transfer whose load failed measures no transfer
                prompt_tokens=ctx.prompt_tokens,
                uncached_tokens=uncached,
                ttft_s=ttft,
                prefill_s=prefill_s,
                e2e_s=time.monotonic() - ctx.t0,
                output_tokens=output_tokens,
                error=error,
            )
        )


def _content_type(answer: UpstreamAnswer) -> str:
    """An instance answer's content type (JSON where it names none), for relaying its body as it is."""
    return next(
        (v.decode("latin-1") for k, v in answer.headers if k.lower() == b"content-type"), "application/json"
    )


# the end of an answer waits at most this for the prefill leg's prompt-cache counts
PREFILL_COUNT_WAIT_S = 0.1


async def _prefill_counts(task: asyncio.Task[_PrefillResult] | None) -> dict[str, int] | None:
    """The prefill leg's own prompt-cache counts (decode's usage then reports them). Decode had the KV, so the
    prefill's answer is at most moments away; a leg that failed, or has not answered within
    ``PREFILL_COUNT_WAIT_S`` (decode recomputed: its own count stands), gives None."""
    if task is None:
        return None
    if not task.done():
        await asyncio.wait({task}, timeout=PREFILL_COUNT_WAIT_S)
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result().prompt_counts


def _consume(task: asyncio.Task[Any]) -> None:
    """Retrieve a leg's exception once the response no longer waits for it (avoids asyncio's warning)."""
    if not task.cancelled():
        task.exception()
