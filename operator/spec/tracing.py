"""spec.tracing: where the pods send OpenTelemetry spans (OTLP/HTTP) and what share of traces they keep; no kopf."""

from __future__ import annotations

from dataclasses import dataclass

from warmfleet.operator.spec.schema import prop


@dataclass(kw_only=True)
class TracingSpec:
    """OpenTelemetry spans of the routers, endpoint pickers and server pods (docs/observability.md): each continues
    the client's W3C traceparent; the router's and picker's span carries the routing decision."""

    otlp_endpoint: str = prop(doc=(
        "Base URL of an OpenTelemetry collector's OTLP/HTTP receiver (protobuf, usually port 4318), e.g. "
        "http://otel-collector.observability:4318; spans go to its /v1/traces. Rendered as OTEL_* env for warmfleet's "
        "router, picker and server pods, as --otlp-traces-endpoint for vLLM and as FastDeploy's TRACES_* env."),
        pattern="^https?://[!-~]+$", maxLength=2048)
    sampling_ratio: float = prop(1.0, doc=(
        "Share of new traces kept (0 to 1), parent-based: a request whose traceparent is sampled stays sampled "
        "(OTEL_TRACES_SAMPLER=parentbased_traceidratio)."), minimum=0, maximum=1)

    @property
    def traces_url(self) -> str:
        """The OTLP/HTTP traces URL (what vLLM's --otlp-traces-endpoint and OTEL_EXPORTER_OTLP_TRACES_ENDPOINT take)."""
        return self.otlp_endpoint.rstrip("/") + "/v1/traces"
