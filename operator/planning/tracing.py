"""spec.tracing rendered per pod: OTEL_* env for warmfleet's router, picker and server, each engine's own switches; pure.

    spec.tracing.otlpEndpoint ─┬─ router / picker / warmfleet server: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT + sampler env
    (OTLP/HTTP base URL)       │    (server/otel.py turns spans on from that env; the images carry the tracing extra)
                               ├─ vLLM: --otlp-traces-endpoint URL/v1/traces, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
                               │    http/protobuf (vLLM's exporter choice) + the same sampler env
                               └─ FastDeploy: TRACES_ENABLE, TRACES_EXPORTER=otlp, EXPORTER_OTLP_ENDPOINT (its envs.py)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from warmfleet.operator.planning.objects import Owner
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.operator.spec.tracing import TracingSpec
from warmfleet.server import engine_kinds

VLLM_FLAG = "--otlp-traces-endpoint"  # vLLM's ObservabilityConfig.otlp_traces_endpoint (0.32 `--help=all`)
HTTP_PROTOBUF = "http/protobuf"  # the OTLP protocol of every exporter rendered here (the collector's port 4318)


def _env(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in pairs]


def otel_pairs(owner: Owner, t: TracingSpec, service_name: str) -> list[tuple[str, str]]:
    """The OpenTelemetry SDK's standard environment: where spans go, over which protocol, under which service name,
    with which resource attributes and what share of new traces is kept (parent-based)."""
    return [
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", t.traces_url),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", HTTP_PROTOBUF),
        ("OTEL_SERVICE_NAME", service_name),
        ("OTEL_RESOURCE_ATTRIBUTES", f"k8s.namespace.name={owner.namespace},warmfleet.inference_service={owner.name}"),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", repr(float(t.sampling_ratio))),
    ]


def front_door_env(owner: Owner, spec: InferenceServiceSpec, component: str) -> list[dict[str, Any]]:
    """The router's or picker's OTEL_* env (`warmfleet route`/`epp` trace from it), [] without spec.tracing."""
    t = spec.tracing
    return [] if t is None else _env(otel_pairs(owner, t, f"warmfleet-{component}"))


def _warmfleet(owner: Owner, t: TracingSpec) -> tuple[list[str], list[tuple[str, str]]]:
    return [], otel_pairs(owner, t, "warmfleet-server")


def _vllm(owner: Owner, t: TracingSpec) -> tuple[list[str], list[tuple[str, str]]]:
    # vLLM exports only with --otlp-traces-endpoint; it picks its exporter from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    # (grpc by default, http/protobuf here) and its sampler from the SDK's env, like ours
    return [VLLM_FLAG, t.traces_url], otel_pairs(owner, t, "vllm")


def _fastdeploy(owner: Owner, t: TracingSpec) -> tuple[list[str], list[tuple[str, str]]]:
    # FastDeploy 2.3 switches tracing on from its own env (fastdeploy/envs.py: TRACES_ENABLE, TRACES_EXPORTER,
    # EXPORTER_OTLP_ENDPOINT, FD_SERVICE_NAME) and reads the OTLP protocol from the standard variable
    return [], [("TRACES_ENABLE", "true"), ("TRACES_EXPORTER", "otlp"), ("EXPORTER_OTLP_ENDPOINT", t.traces_url),
                ("FD_SERVICE_NAME", "fastdeploy"), *otel_pairs(owner, t, "fastdeploy")]


ENGINE_TRACING: Mapping[str, Callable[[Owner, TracingSpec], tuple[list[str], list[tuple[str, str]]]]] = \
    MappingProxyType({"warmfleet": _warmfleet, "vllm": _vllm, "fastdeploy": _fastdeploy})
assert tuple(ENGINE_TRACING) == engine_kinds.KINDS, "one tracing rendering per registered engine kind"


def engine_tracing(owner: Owner, spec: InferenceServiceSpec, kind: str) -> tuple[list[str], list[dict[str, Any]]]:
    """A server container's tracing (its extra arguments, its env) for engine `kind`; nothing without spec.tracing."""
    t: Optional[TracingSpec] = spec.tracing
    if t is None:
        return [], []
    args, pairs = ENGINE_TRACING[kind](owner, t)
    return args, _env(pairs)
