"""Optional OpenTelemetry spans (the `tracing` extra): a process's `Spans`, or None when off (nothing imported then).

On when `--otlp-traces-endpoint URL` is given (vLLM's flag: the OTLP/HTTP traces URL, e.g.
http://collector:4318/v1/traces) or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT` is set (the SDK appends /v1/traces to the latter), unless
`OTEL_SDK_DISABLED=true`. The SDK reads its other settings from the standard environment:
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` (+ `_ARG`: the sampling ratio),
`OTEL_BSP_*` (batching), `OTEL_EXPORTER_OTLP_HEADERS`. Spans leave through OTLP/HTTP protobuf
in a background batch; a request never waits for the collector.

Spans continue the request's W3C `traceparent` and hand their own on, so the chain is

    client traceparent ─▶ router/picker "route" span (replica, reason, predicted cached tokens)
                                 └─▶ replica "request" span (warmfleet serve)

With tracing off, callers hold None and test it once per request: no import, no allocation.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

from . import tracing

log = logging.getLogger(__name__)

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXTRA = "pip install 'warmfleet[tracing]'"
# span attributes of a routing decision (the router's x-warmfleet-route header says the same to the client)
REPLICA = "warmfleet.replica"
REASON = "warmfleet.route.reason"
PREDICTED = "warmfleet.route.predicted_cached_tokens"
REQUEST_ID = "warmfleet.request_id"
STATUS = "http.response.status_code"


class TracingUnavailable(ValueError):
    """Tracing was asked for but opentelemetry-sdk / the OTLP exporter are not installed (a bad flag: one line)."""


def wanted(endpoint: Optional[str], env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process traces: a flag endpoint or the standard OTLP endpoint env, and the SDK not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint) or any(env.get(k) for k in ENDPOINT_ENVS)


class Spans:
    """A process's tracer: spans that continue an incoming `traceparent`, and the `traceparent` they hand on."""

    def __init__(self, provider: Any, exporter_note: str):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider, self.where = provider, exporter_note
        self._trace = trace
        self._tracer = provider.get_tracer("warmfleet")
        self._propagator = TraceContextTextMapPropagator()
        self._server = trace.SpanKind.SERVER

    def start(self, name: str, headers: Mapping[str, str], attributes: Optional[dict] = None) -> Any:
        """A started SERVER span, the child of `headers`' valid traceparent (a new trace without one); end it."""
        carrier = {k: headers[k] for k in (tracing.TRACEPARENT, tracing.TRACESTATE) if headers.get(k)}
        ctx = self._propagator.extract(carrier) if carrier else None
        return self._tracer.start_span(name, context=ctx, kind=self._server, attributes=attributes)

    def hand_on(self, span: Any, headers: dict) -> dict:
        """`headers` with `traceparent`/`tracestate` set to `span`'s context: the next hop becomes its child."""
        if span.get_span_context().is_valid:
            headers.pop(tracing.TRACESTATE, None)
            self._propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return headers

    def error(self, span: Any, status: int) -> None:
        """Record the answer's HTTP status on `span`, marked an error from 500 up (OTel's server-span rule)."""
        span.set_attribute(STATUS, status)
        if status >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))

    def shutdown(self) -> None:
        """Export what is batched and stop (at process exit)."""
        self.provider.shutdown()


def start(service_name: str, endpoint: Optional[str] = None, *, exporter: Any = None,
          env: Mapping[str, str] = os.environ) -> Optional[Spans]:
    """This process's Spans, or None when tracing is off (nothing imported). `endpoint`: --otlp-traces-endpoint;
    `exporter`: a SpanExporter to use instead of OTLP/HTTP (tests). TracingUnavailable without the extra."""
    if exporter is None and not wanted(endpoint, env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise TracingUnavailable(f"OpenTelemetry tracing is configured (--otlp-traces-endpoint or "
                                 f"OTEL_EXPORTER_OTLP_*ENDPOINT) but {exc.name} is not installed: {EXTRA}") from None
    if exporter is None:
        exporter = OTLPSpanExporter(endpoint=endpoint or None)  # None: the SDK reads the OTLP endpoint env
    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler: OTEL_TRACES_SAMPLER(_ARG), parent-based
    provider.add_span_processor(BatchSpanProcessor(exporter))
    where = endpoint or next((env[k] for k in ENDPOINT_ENVS if env.get(k)), type(exporter).__name__)
    log.info("OpenTelemetry spans exported to %s", where)
    return Spans(provider, where)


def decision_attributes(replica: str, reason: str, predicted_cached_tokens: int) -> dict:
    """A routing decision as span attributes: the chosen replica, why, and the cached tokens predicted there."""
    return {REPLICA: replica, REASON: reason, PREDICTED: predicted_cached_tokens}


def route_header_attributes(replica: Optional[str], route: Optional[str]) -> dict:
    """The decision attributes of the replica that answered (the router's id of it) and of a relayed answer's
    `x-warmfleet-route` ("REASON; predicted_cached_tokens=N", proxy.py), {} when there is none (refused before
    routing)."""
    if not replica or not route:
        return {}
    reason, _, rest = route.partition(";")
    n = rest.strip().removeprefix("predicted_cached_tokens=")
    return decision_attributes(replica, reason.strip(), int(n) if n.isdigit() else 0)
