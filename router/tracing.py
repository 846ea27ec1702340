"""OpenTelemetry traces of the proxy's requests (optional: ``pip install vllm-disagg[tracing]``).

With ``--otlp-traces-endpoint`` each request is a server span ``proxy.request`` (its parent taken from the client's
``traceparent``), with children ``intake``, ``plan``, ``prefill_leg``, ``decode_leg`` and ``relay``; each leg
carries its own ``traceparent`` to the instance, so vLLM's spans (``--otlp-traces-endpoint`` there too) join the
same trace. Without it nothing here runs: the request path checks one attribute.
"""

from __future__ import annotations

from typing import Any


class Tracing:
    """A thin facade over an OpenTelemetry tracer: spans, and W3C context in and out of headers."""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry import propagate, trace

        self._tracer = tracer
        self._trace = trace
        self._propagate = propagate

    def request_span(self, headers: dict[str, str]) -> Any:
        """The request's root span, a child of the client's ``traceparent`` when it sent one."""
        from opentelemetry.trace import SpanKind

        parent = self._propagate.extract(headers)
        return self._tracer.start_span("proxy.request", context=parent, kind=SpanKind.SERVER)

    def child(self, name: str, parent: Any, **attributes: Any) -> Any:
        """A span under ``parent`` (started now; the caller ends it)."""
        ctx = self._trace.set_span_in_context(parent)
        return self._tracer.start_span(
            name, context=ctx, attributes={k: v for k, v in attributes.items() if v is not None}
        )

    def headers_for(self, span: Any, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` plus the ``traceparent`` (and ``tracestate``) of ``span``, for a leg to an instance."""
        out = dict(headers)
        self._propagate.inject(out, context=self._trace.set_span_in_context(span))
        return out


def make_tracing(endpoint: str | None, exporter: Any = None) -> Tracing | None:
    """Tracing to an OTLP (gRPC) collector at ``endpoint``, or to ``exporter`` (tests); None when neither."""
    if not endpoint and exporter is None:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise SystemExit(
            f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'vllm-disagg[tracing]' ({exc})"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm-disagg-proxy"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise SystemExit(
                f"--otlp-traces-endpoint needs the OTLP exporter: pip install 'vllm-disagg[tracing]' ({exc})"
            ) from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider.get_tracer("vllm_disagg.proxy"))
