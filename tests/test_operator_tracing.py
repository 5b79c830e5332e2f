"""spec.tracing rendered (planning/tracing.py): OTEL_* env for the router, the picker and warmfleet's server pods,
vLLM's --otlp-traces-endpoint, FastDeploy's TRACES_* env; nothing at all without it; the schema's bounds; and the env
our processes get turns their spans on (server/otel.py reads it)."""

from __future__ import annotations

import pytest

from operator_fixtures.shapes import h200, l4, service
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning import engine_descriptions, objects
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec import constants
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server import otel

IMAGES = objects.Images(engine="engine:1", router="slim:1")
NODES = [node_info(h200("h1")), node_info(l4("l1"))]
TRACING = {"otlpEndpoint": "http://otel-collector.observability:4318/", "samplingRatio": 0.25}
URL = "http://otel-collector.observability:4318/v1/traces"
ENGINES = {"warmfleet": {"kind": "warmfleet"}, "vllm": {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
           "fastdeploy": {"kind": "fastdeploy", "image": "fastdeploy:2.3"}}


def deployments(spec: dict, component: str) -> list[dict]:
    items = render(service(spec=spec), NODES, IMAGES)
    return [o for o in items if o["kind"] == "Deployment"
            and o["metadata"]["labels"][constants.COMPONENT_LABEL] == component]


def env_of(dep: dict) -> dict:
    return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def args_of(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def otel_env(service_name: str) -> dict:
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": service_name, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=default,warmfleet.inference_service=qwen"}


def test_router_and_warmfleet_servers_get_the_sdks_env_and_no_flag():
    (router,) = deployments({"replicas": 2, "tracing": TRACING}, "router")
    assert otel_env("warmfleet-router").items() <= env_of(router).items()
    for dep in deployments({"replicas": 2, "tracing": TRACING}, "server"):
        assert otel_env("warmfleet-server").items() <= env_of(dep).items()
        assert "--otlp-traces-endpoint" not in args_of(dep)  # ours trace from the env


def test_the_picker_gets_the_sdks_env_in_gateway_mode():
    (epp,) = deployments({"replicas": 2, "tracing": TRACING, "router": {"mode": "gateway"}}, "epp")
    assert otel_env("warmfleet-epp").items() <= env_of(epp).items()


def test_vllm_gets_its_flag_and_http_protobuf_and_every_flag_stays_in_its_table():
    for dep in deployments({"replicas": 2, "tracing": TRACING, "engine": ENGINES["vllm"]}, "server"):
        args = args_of(dep)
        assert args[args.index("--otlp-traces-endpoint") + 1] == URL
        assert set(engine_descriptions.render_flags(args)) <= set(engine_descriptions.VLLM_FLAGS)
        assert otel_env("vllm").items() <= env_of(dep).items()  # the exporter protocol vLLM picks from the env


def test_fastdeploy_gets_its_own_trace_switches():
    for dep in deployments({"replicas": 2, "tracing": TRACING, "engine": ENGINES["fastdeploy"]}, "server"):
        env = env_of(dep)
        assert {"TRACES_ENABLE": "true", "TRACES_EXPORTER": "otlp", "EXPORTER_OTLP_ENDPOINT": URL}.items() <= env.items()
        assert "--otlp-traces-endpoint" not in args_of(dep)


@pytest.mark.parametrize("kind", list(ENGINES))
def test_without_spec_tracing_nothing_is_rendered(kind):
    spec = {"replicas": 2, "engine": ENGINES[kind]}
    for component in ("router", "server"):
        for dep in deployments(spec, component):
            names = set(env_of(dep))
            assert not {n for n in names if n.startswith("OTEL_") or n.startswith("TRACES_")}, names
            assert "--otlp-traces-endpoint" not in args_of(dep)


def test_the_endpoint_must_be_an_http_url_and_the_ratio_within_0_and_1():
    with pytest.raises(SpecError, match="otlpEndpoint"):
        parse_spec(service(spec={"tracing": {"otlpEndpoint": "otel-collector:4318"}})["spec"])
    with pytest.raises(SpecError, match="samplingRatio"):
        parse_spec(service(spec={"tracing": {"otlpEndpoint": "http://c:4318", "samplingRatio": 1.5}})["spec"])
    assert parse_spec(service(spec={"tracing": {"otlpEndpoint": "https://c"}})["spec"]).tracing.sampling_ratio == 1.0


def test_the_rendered_env_turns_our_processes_spans_on_and_no_env_leaves_them_off():
    (router,) = deployments({"replicas": 2, "tracing": TRACING}, "router")
    assert otel.wanted(None, env_of(router))  # warmfleet route reads exactly these variables
    (plain,) = deployments({"replicas": 2}, "router")
    assert not otel.wanted(None, {k: v for k, v in env_of(plain).items() if v is not None})


def test_an_overlay_env_naming_a_rendered_otel_variable_is_refused_only_with_spec_tracing():
    overlay = {"pod": {"env": [{"name": "OTEL_SERVICE_NAME", "value": "mine"}]}}
    with pytest.raises(SpecError, match="OTEL_SERVICE_NAME"):
        render(service(spec={"tracing": TRACING, "router": overlay}), NODES, IMAGES)
    (router,) = deployments({"router": overlay}, "router")  # without spec.tracing the name is the user's
    assert env_of(router)["OTEL_SERVICE_NAME"] == "mine"
