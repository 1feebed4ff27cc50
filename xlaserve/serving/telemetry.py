"""OpenTelemetry spans of a request, off unless `[tracing] otlp_endpoint` is set (then
exported over OTLP/HTTP in batches; the exporter is the `tracing` extra).  One trace per
request, joined to the client's by its `traceparent`:

    POST /v1/chat/completions            SERVER, parent: the client's traceparent (none: a
    │                                    new trace, whose ids the response's traceparent,
    │                                    x-request-id's audit line and the trace all share)
    ├─ gateway                           refuse while draining, JWT, request rate, body, parse
    ├─ router                            model group, tokenize, sampling (xlaserve.model)
    ├─ admission                         token reservation + queue wait (xlaserve.queue_time_s)
    └─ engine           one per choice   sent to its engine -> its last event (replica, engine
       │                                 request id, tokens, finish reason; a "first_token"
       │                                 event); its context rides the gRPC call's metadata
       ├─ prefill                        sent -> first token    } drawn afterwards from the
       ├─ decode                         first -> last token    } times of the engine's events
       └─ xlaserve.v1.Generation/Generate   SERVER, on the `xlaserve worker` (its own provider,
          ├─ prefill, decode                 its [tracing] table), child of the engine span

Stage times come from the events the engines already emit (the front end and the worker time
their arrival), so no engine code knows about tracing.  Without an endpoint the tracer is
OpenTelemetry's no-op one: no span is recorded and nothing is exported.  Tests hand
`Telemetry` an SDK provider with an in-memory exporter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.metrics import StreamTimes
from xlaserve.serving.server_config import TracingConfig

_PROPAGATOR = TraceContextTextMapPropagator()


class Telemetry:
    """The spans of one server or worker process; `provider` None: tracing off."""

    def __init__(self, provider: Any = None):   # an SDK TracerProvider, or None
        self.provider = provider
        self.tracer = (provider.get_tracer("xlaserve") if provider is not None
                       else trace.NoOpTracer())
        # monotonic -> epoch, fixed once: spans drawn from one event time meet exactly
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    def epoch_ns(self, monotonic_s: float) -> int:
        """A time.monotonic() reading as the Unix-epoch nanoseconds spans carry."""
        return self._epoch_offset_ns + int(monotonic_s * 1e9)

    @classmethod
    def from_config(cls, config: TracingConfig) -> Telemetry:
        if not config.otlp_endpoint:
            return cls()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(f"[tracing] otlp_endpoint={config.otlp_endpoint!r} needs the "
                             "OTLP exporter: pip install 'xlaserve[tracing]'") from None
        provider = TracerProvider(resource=Resource({"service.name": config.service_name}))
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=config.otlp_endpoint)))
        return cls(provider)

    def shutdown(self) -> None:
        """Flush what is still batched (on the way out of the process)."""
        if self.provider is not None:
            self.provider.shutdown()

    # -- the front end -------------------------------------------------------------------------

    def request_span(self, trace_ctx: TraceContext, method: str, path: str) -> Span:
        """The request's root span: a child of the client's traceparent when it sent one."""
        parent = (_PROPAGATOR.extract({"traceparent": trace_ctx.traceparent})
                  if trace_ctx.given else Context())
        return self.tracer.start_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": method,
                                                  "url.path": path,
                                                  "xlaserve.request_id": trace_ctx.request_id})

    @staticmethod
    def adopt(trace_ctx: TraceContext, span: Span) -> TraceContext:
        """`trace_ctx` naming `span` when the server started the trace (no traceparent came):
        the response's traceparent, the audit's trace id and the spans then agree."""
        sc = span.get_span_context()
        if trace_ctx.given or not sc.is_valid:
            return trace_ctx
        tid = format(sc.trace_id, "032x")
        return replace(trace_ctx, trace_id=tid,
                       traceparent=f"00-{tid}-{format(sc.span_id, '016x')}-01")

    @contextlib.contextmanager
    def stage(self, parent: Span, name: str) -> Iterator[Span]:
        """A child span of `parent` around a stage (an exception marks it failed)."""
        with self.tracer.start_as_current_span(
                name, context=trace.set_span_in_context(parent)) as span:
            yield span

    def child(self, parent: Span, name: str, start: float,
              attributes: Mapping[str, Any] | None = None) -> Span:
        """A child span of `parent` started at monotonic time `start` (end it yourself)."""
        return self.tracer.start_span(name, context=trace.set_span_in_context(parent),
                                      start_time=self.epoch_ns(start),
                                      attributes=dict(attributes or {}))

    def end_stream(self, span: Span, t: StreamTimes, end: float | None, error: str | None,
                   finish_reason: str) -> None:
        """End the span of one engine request's stream at its last token (none came: at `end`,
        None = now), under it prefill (submitted -> first token) and decode (first -> last
        token) drawn afterwards from the event times `t` (nothing when no token came)."""
        if t.first:
            span.add_event("first_token", timestamp=self.epoch_ns(t.first))
            for name, start, stop in (("prefill", t.submitted, t.first),
                                      ("decode", t.first, t.last)):
                self.child(span, name, start).end(self.epoch_ns(stop))
        self.end(span, t.last or end, error, {"xlaserve.finish_reason": finish_reason,
                                              "gen_ai.usage.output_tokens": t.tokens})

    # -- the gRPC hop --------------------------------------------------------------------------

    @staticmethod
    def inject() -> list[tuple[str, str]]:
        """gRPC metadata carrying the current span's traceparent (none when none records)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return list(carrier.items())

    def server_span(self, method: str, metadata: Any, attributes: Mapping[str, Any]) -> Span:
        """A worker's span of one call, a child of the traceparent in its `metadata`."""
        carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
        service, _, name = method.strip("/").partition("/")
        return self.tracer.start_span(
            f"{service}/{name}", context=_PROPAGATOR.extract(carrier), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name,
                        **attributes})

    def end(self, span: Span, end: float | None = None, error: str | None = None,
            attributes: Mapping[str, Any] | None = None) -> None:
        """Set `attributes`, mark `error` (if any) and end `span` at monotonic `end` (None:
        now)."""
        if attributes:
            span.set_attributes(dict(attributes))
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(None if end is None else self.epoch_ns(end))
