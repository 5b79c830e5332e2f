"""Gateway mode (spec.router.mode: gateway): the InferencePool, the `warmfleet epp` objects and the HTTPRoute as rendered,
the EPP's flags against EppSettings, pruning when the mode changes, and the conditions a missing CRD gives."""

from __future__ import annotations

import argparse
import json

import pytest

from operator_fixtures.shapes import h200, l4, service
from operator_fixtures.memory import MemoryKube
from warmfleet.operator.passes.reconcile import _apply_and_prune, owned, plan_for, render
from warmfleet.operator.planning import engine_descriptions, model_volumes, objects, router_objects
from warmfleet.operator.planning import gateway as g
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.planning.service_status import healthy_status
from warmfleet.operator.spec import constants
from warmfleet.operator.spec.crd import crd
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server import flagfields
from warmfleet.server.router.epp.settings import EppSettings, GRPC_PORT
from warmfleet.server.router.epp.settings import HTTP_PORT as EPP_HTTP_PORT

IMAGES = objects.Images(engine="engine:1", router="slim:1")
NODES = [node_info(h200("h1")), node_info(l4("l1"))]
GATEWAY = {"name": "inference-gateway", "namespace": "gateway-system", "sectionName": "http"}


def gw_service(router=None, **spec):
    return service(spec={"replicas": 3, "router": {"mode": "gateway", **(router or {})}, **spec})


def kinds(items):
    return {(o["kind"], o["metadata"]["name"]) for o in items}


def one(items, kind, name=None):
    (found,) = [o for o in items if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return found


def test_gateway_mode_renders_pool_epp_and_route_instead_of_the_router():
    items = render(gw_service({"gateway": GATEWAY}), NODES, IMAGES)
    have = kinds(items)
    assert {("InferencePool", "qwen"), ("HTTPRoute", "qwen"), ("Deployment", "qwen-epp"), ("Service", "qwen-epp"),
            ("ServiceAccount", "qwen-epp"), ("Role", "qwen-epp"), ("RoleBinding", "qwen-epp"),
            ("PodDisruptionBudget", "qwen-epp"), ("Service", "qwen-replicas")} <= have
    # the proxy router's objects are not rendered in gateway mode
    assert not {k for k in have if k[1] in ("qwen-router", "qwen-router-peers")} and ("Service", "qwen") not in have
    proxy = kinds(render(service(spec={"replicas": 3}), NODES, IMAGES))
    assert ("Deployment", "qwen-router") in proxy and not {k for k in proxy if k[0] in ("InferencePool", "HTTPRoute")}
    assert not {k for k in proxy if k[1] == "qwen-epp"}


def test_inference_pool_selects_every_pools_server_pods_and_names_the_epp():
    items = render(gw_service({"failureMode": "FailOpen"}), NODES, IMAGES)
    pool = one(items, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    sel = pool["spec"]["selector"]["matchLabels"]
    servers = [d for d in items if d["kind"] == "Deployment" and d["metadata"]["labels"][constants.COMPONENT_LABEL] == "server"]
    assert len(servers) == 2  # one per node pool: the pool's selector covers both
    for dep in servers:
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    epp = one(items, "Deployment", "qwen-epp")
    assert not sel.items() <= epp["spec"]["template"]["metadata"]["labels"].items()  # not the EPP's own pods
    assert pool["spec"]["targetPorts"] == [{"number": engine_descriptions.HTTP_PORT}]
    server_ports = {p["containerPort"] for p in servers[0]["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http"}
    assert server_ports == {engine_descriptions.HTTP_PORT}
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "qwen-epp", "port": {"number": GRPC_PORT},
                                                 "failureMode": "FailOpen"}
    svc = one(items, "Service", "qwen-epp")
    assert GRPC_PORT in {p["port"] for p in svc["spec"]["ports"]}
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()


def test_failure_mode_defaults_to_the_gie_default():
    g_crd = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    assert g_crd["properties"]["failureMode"]["default"] == "FailClose"
    assert g_crd["properties"]["failureMode"]["enum"] == ["FailOpen", "FailClose"]
    assert g_crd["properties"]["mode"]["default"] == "proxy"
    pool = one(render(gw_service(), NODES, IMAGES), "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


def test_epp_service_speaks_http2_on_grpc_and_exposes_metrics_as_http():
    svc = one(render(gw_service(), NODES, IMAGES), "Service", "qwen-epp")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    # HTTP/2 over TLS (the picker's default), not kubernetes.io/h2c (cleartext)
    assert ports["grpc"]["port"] == GRPC_PORT and ports["grpc"]["appProtocol"] == "http2"
    assert ports["http"]["port"] == EPP_HTTP_PORT and "appProtocol" not in ports["http"]  # the ServiceMonitor's `http`
    assert svc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "warmfleet-operator"


def test_router_and_picker_pods_sleep_in_prestop_and_drain_within_their_grace():
    """preStop lets the EndpointSlice (and a gateway) drop a stopping pod before SIGTERM; the picker's drain, then
    its exit, fit in terminationGracePeriodSeconds after that sleep."""
    for body, name in ((gw_service(), "qwen-epp"), (service(spec={"replicas": 3}), "qwen-router")):
        pod = one(render(body, NODES, IMAGES), "Deployment", name)["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep > 0
        if name == "qwen-epp":
            i = c["args"].index("--drain-grace-s")
            assert sleep + float(c["args"][i + 1]) < pod["terminationGracePeriodSeconds"]
        else:
            assert pod["terminationGracePeriodSeconds"] > sleep


def test_epp_pod_follows_the_router_conventions_with_http_probes():
    body = gw_service(router={"apiKeySecret": {"name": "keys"}})
    items = render(body, NODES, IMAGES)
    epp = one(items, "Deployment", "qwen-epp")
    router = one(render(service(spec={"replicas": 3, "router": {"apiKeySecret": {"name": "keys"}}}), NODES, IMAGES),
                 "Deployment", "qwen-router")
    pod, rpod = epp["spec"]["template"]["spec"], router["spec"]["template"]["spec"]
    (c,), (rc,) = pod["containers"], rpod["containers"]
    assert c["image"] == "slim:1" and c["command"] == ["warmfleet"] and c["args"][0] == "epp"
    # the kubelet's gRPC probes speak no TLS, and the picker's gRPC port is TLS: the side port's /ready and /health
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "grpc" not in json.dumps(c["readinessProbe"]) + json.dumps(c["livenessProbe"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": GRPC_PORT, "http": EPP_HTTP_PORT}
    for key in ("resources", "securityContext", "env", "volumeMounts"):
        assert c[key] == rc[key], key
    assert {"name": "HOME", "value": "/tmp"} in c["env"]
    assert pod["securityContext"] == rpod["securityContext"] and pod["volumes"] == rpod["volumes"]
    assert pod["serviceAccountName"] == "qwen-epp" and epp["spec"]["replicas"] == 2
    role = one(items, "Role", "qwen-epp")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = one(items, "RoleBinding", "qwen-epp")
    assert binding["roleRef"]["name"] == "qwen-epp" and binding["subjects"][0]["name"] == "qwen-epp"


def test_epp_args_parse_with_epp_settings_and_render_back_the_same():
    body = gw_service()
    body["spec"]["router"]["loadBound"] = 1.5
    body["spec"]["cache"] = {"blockSize": 32}
    items = render(body, NODES, IMAGES)
    args = one(items, "Deployment", "qwen-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "epp"
    parser = argparse.ArgumentParser()
    flagfields.add_arguments(parser, EppSettings)
    got: EppSettings = flagfields.from_namespace(parser.parse_args(args[1:]), EppSettings)
    assert (got.discover_service, got.host, got.port, got.http_port) == ("default/qwen-replicas", "0.0.0.0", GRPC_PORT, EPP_HTTP_PORT)
    assert got.model == "/models/qwen" and got.policy.epsilon == 0.5 and got.block_size == 32 and got.engine == "warmfleet"
    assert got.peers is None
    assert flagfields.to_args(got, g.EPP_FIELDS) == args[1:]  # args → settings → args: the same pod spec
    # the same routing values as the router: one source, two front doors
    router = router_objects.router_settings(objects.Owner("qwen", "default"), parse_spec(body["spec"]))
    for f in ("discover_service", "host", "model", "engine", "block_size"):
        assert getattr(router, f) == getattr(got, f), f
    assert router.policy.epsilon == got.policy.epsilon


def test_http_route_attaches_the_pool_to_the_gateway_only_when_asked():
    route = one(render(gw_service({"gateway": GATEWAY}), NODES, IMAGES), "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway",
                                            "namespace": "gateway-system", "sectionName": "http"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "qwen"}]
    # the OpenAI routes the proxy serves, nothing more: the servers' admin routes (LoRA load/unload) stay private
    from warmfleet.server.router.http.app import OPENAI_ROUTES

    assert sorted(x["path"]["value"] for x in rule["matches"]) == sorted(p for _, p, _ in OPENAI_ROUTES.values())
    assert {x["path"]["type"] for x in rule["matches"]} == {"Exact"}
    local = one(render(gw_service({"gateway": {"name": "gw"}}), NODES, IMAGES), "HTTPRoute")
    assert local["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}]
    assert not [o for o in render(gw_service(), NODES, IMAGES) if o["kind"] == "HTTPRoute"]


def test_one_epp_replica_gets_no_pdb():
    items = render(gw_service({"replicas": 1}), NODES, IMAGES)
    assert ("PodDisruptionBudget", "qwen-epp") not in kinds(items)
    assert one(items, "Deployment", "qwen-epp")["spec"]["replicas"] == 1
    pdb = one(render(gw_service({"replicas": 3}), NODES, IMAGES), "PodDisruptionBudget", "qwen-epp")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == router_objects.front_door_selector(objects.Owner("qwen", "default"), "epp")


def test_gateway_only_with_mode_gateway():
    with pytest.raises(SpecError, match="gateway applies to mode gateway only"):
        parse_spec({"model": {"path": "/m"}, "router": {"gateway": {"name": "gw"}}})
    with pytest.raises(SpecError, match="mode"):
        parse_spec({"model": {"path": "/m"}, "router": {"mode": "ingress"}})
    with pytest.raises(SpecError, match="failureMode"):
        parse_spec({"model": {"path": "/m"}, "router": {"mode": "gateway", "failureMode": "FailSometimes"}})
    rules = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]["x-kubernetes-validations"]
    assert {"rule": "!has(self.gateway) || self.mode == 'gateway'", "message": "gateway applies to mode gateway only"} in rules


async def _apply(kube, body):
    _, _, plan = plan_for(body, NODES, IMAGES)
    children = owned(plan.children, body)
    return await _apply_and_prune(kube, children, "qwen", "default", "uid-qwen",
                                  ("Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
                                   "InferencePool", "HTTPRoute"))


async def test_mode_change_prunes_the_other_modes_objects_both_ways():
    kube = MemoryKube()
    await _apply(kube, service(spec={"replicas": 3}))
    proxy = set(kube.objects)
    assert ("Deployment", "qwen-router") in proxy
    _, actions = await _apply(kube, gw_service({"gateway": GATEWAY}))
    deleted = {k for k, v in actions.items() if v == "deleted"}
    assert deleted == {"Deployment/qwen-router", "Service/qwen", "Service/qwen-router-peers", "PodDisruptionBudget/qwen-router",
                       "ServiceAccount/qwen-router", "Role/qwen-router", "RoleBinding/qwen-router"}
    assert ("InferencePool", "qwen") in kube.objects and ("Deployment", "qwen-router") not in kube.objects
    # dropping spec.router.gateway removes only the HTTPRoute; one EPP replica drops its PDB
    _, actions = await _apply(kube, gw_service({"replicas": 1}))
    assert {k for k, v in actions.items() if v == "deleted"} == {"HTTPRoute/qwen", "PodDisruptionBudget/qwen-epp"}
    _, actions = await _apply(kube, service(spec={"replicas": 3}))
    assert {k for k, v in actions.items() if v == "deleted"} == {
        "Deployment/qwen-epp", "Service/qwen-epp", "ServiceAccount/qwen-epp", "Role/qwen-epp", "RoleBinding/qwen-epp",
        "InferencePool/qwen"}
    assert set(kube.objects) == proxy


async def test_prune_leaves_objects_of_another_owner():
    kube = MemoryKube()
    await _apply(kube, service(spec={"replicas": 3}))
    for key, o in kube.objects.items():
        o["metadata"]["ownerReferences"] = [{"uid": "uid-other"}]
    _, actions = await _apply(kube, gw_service())
    assert not [k for k, v in actions.items() if v == "deleted"]
    assert ("Deployment", "qwen-router") in kube.objects


def _status(body, *, pool_served=True, route_served=True, live=None, gateway_obj=None, epp_ready=0, previous=None):
    owner, spec, plan = plan_for(body, NODES, IMAGES)
    live = dict(live or {})
    live.setdefault(("Deployment", "qwen-epp"), {"status": {"readyReplicas": epp_ready}})
    gw = g.gateway_state(owner, spec, live, pool_served=pool_served, route_served=route_served, gateway_obj=gateway_obj)
    ready = {p.pool.name: p.replicas for p in plan.pools}
    st = healthy_status(plan=plan, generation=1, model="qwen", endpoint=gw.endpoint, selector="s", ready_by_pool=ready,
                        router_ready=0, previous=previous or {}, now="t", gateway=gw)
    return gw, st, {c["type"]: c for c in st["conditions"]}


def test_pool_and_epp_ready_make_the_service_ready():
    _, st, conds = _status(gw_service(), epp_ready=1)
    assert conds["InferencePoolReady"]["status"] == "True" and conds["EndpointPickerReady"]["status"] == "True"
    assert conds["Ready"]["status"] == "True" and "1 endpoint pickers" in conds["Ready"]["message"]
    assert "HTTPRouteReady" not in conds and st["endpoint"] == ""
    _, _, conds = _status(gw_service(), epp_ready=0)
    assert conds["EndpointPickerReady"]["status"] == "False" and conds["Ready"]["status"] == "False"


def test_missing_gie_crd_is_the_ready_reason_naming_the_crd():
    gw, _, conds = _status(gw_service(), pool_served=False, epp_ready=1)
    assert gw.missing is not None and gw.missing[0] == "GatewayAPIInferenceExtensionMissing"
    for type_ in ("Ready", "InferencePoolReady"):
        assert conds[type_]["status"] == "False" and conds[type_]["reason"] == "GatewayAPIInferenceExtensionMissing"
        assert "inferencepools.inference.networking.k8s.io" in conds[type_]["message"]
        assert "gateway-api-inference-extension" in conds[type_]["message"]


def test_missing_httproute_crd_matters_only_with_a_gateway():
    gw, _, conds = _status(gw_service({"gateway": GATEWAY}), route_served=False, epp_ready=1)
    assert gw.missing[0] == "GatewayAPIMissing" and conds["Ready"]["reason"] == "GatewayAPIMissing"
    assert conds["HTTPRouteReady"]["status"] == "False" and "httproutes.gateway.networking.k8s.io" in conds["HTTPRouteReady"]["message"]
    assert conds["InferencePoolReady"]["status"] == "True"
    gw, _, conds = _status(gw_service(), route_served=False, epp_ready=1)
    assert gw.missing is None and conds["Ready"]["status"] == "True"


def test_route_verdict_and_gateway_address_reach_status():
    route = {"status": {"parents": [{"parentRef": {"name": "inference-gateway", "namespace": "gateway-system"},
                                     "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}]}]}}
    gateway_obj = {"spec": {"listeners": [{"name": "other", "protocol": "HTTP", "port": 80},
                                          {"name": "http", "protocol": "HTTP", "port": 8080}]},
                   "status": {"addresses": [{"type": "IPAddress", "value": "10.0.0.7"}]}}
    _, st, conds = _status(gw_service({"gateway": GATEWAY}), live={("HTTPRoute", "qwen"): route}, gateway_obj=gateway_obj, epp_ready=1)
    assert conds["HTTPRouteReady"]["reason"] == "Accepted" and st["endpoint"] == "http://10.0.0.7:8080/v1"
    route["status"]["parents"][0]["conditions"][0].update(status="False", reason="NotAllowedByListeners", message="no")
    _, _, conds = _status(gw_service({"gateway": GATEWAY}), live={("HTTPRoute", "qwen"): route}, epp_ready=1)
    assert conds["HTTPRouteReady"]["status"] == "False" and conds["HTTPRouteReady"]["reason"] == "NotAccepted"
    assert g.gateway_endpoint({"spec": {"listeners": [{"name": "h", "protocol": "HTTPS", "port": 443}]},
                               "status": {"addresses": [{"value": "fd00::1"}]}}, None) == "https://[fd00::1]/v1"
    assert g.gateway_endpoint({"spec": {"listeners": [{"name": "h", "protocol": "HTTP", "port": 80}]}}, None) == ""


def test_back_to_proxy_mode_removes_the_gateway_conditions():
    _, gst, _ = _status(gw_service({"gateway": GATEWAY}), epp_ready=1)
    owner, spec, plan = plan_for(service(spec={"replicas": 3}), NODES, IMAGES)
    st = healthy_status(plan=plan, generation=2, model="qwen", endpoint=objects.endpoint_url(owner, spec), selector="s",
                        ready_by_pool={}, router_ready=0, previous=gst, now="t2")
    assert not {c["type"] for c in st["conditions"]} & set(g.CONDITION_TYPES)
    _, st, _ = _status(gw_service(), epp_ready=1, previous=gst)  # no gateway any more: only HTTPRouteReady goes
    assert {c["type"] for c in st["conditions"]} & set(g.CONDITION_TYPES) == {"InferencePoolReady", "EndpointPickerReady"}


def test_the_gateway_example_renders():
    from pathlib import Path

    import yaml

    repo = Path(__file__).resolve().parents[1]
    (body,) = [d for d in yaml.safe_load_all((repo / "examples/inferenceservice-gateway.yaml").read_text()) if d]
    assert body["spec"]["router"]["mode"] == "gateway"
    items = render(body, NODES, IMAGES)
    assert {"InferencePool", "HTTPRoute"} <= {o["kind"] for o in items}


def test_autoscaler_scrapes_the_endpoint_pickers_in_gateway_mode():
    """The EPP's HTTP side serves the routers' /metrics and /v1/router/replicas: the autoscaler reads those pods."""
    from warmfleet.operator.passes.autoscale_pass import router_urls

    owner = objects.Owner("qwen", "ml")
    ready = {"status": {"podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert router_urls(None, owner, EPP_HTTP_PORT, [ready], pod_port=EPP_HTTP_PORT, service="qwen-epp") == ["http://10.0.0.5:9090"]
    assert router_urls(None, owner, EPP_HTTP_PORT, [], pod_port=EPP_HTTP_PORT, service="qwen-epp") == ["http://qwen-epp.ml.svc:9090"]
    assert router_urls(None, owner, 8000, [ready]) == [f"http://10.0.0.5:{engine_descriptions.HTTP_PORT}"]


def test_missing_crd_retries_back_off_and_cap():
    from warmfleet.operator.wiring.handlers import missing_crd_delay

    delays = [missing_crd_delay(r) for r in range(10)]
    assert delays[:6] == [10, 20, 40, 80, 160, 300] and set(delays[6:]) == {300}
    assert missing_crd_delay(-1) == 10


def test_epp_of_a_downloaded_model_fetches_only_the_tokenizer_like_the_router():
    body = gw_service(model={"source": "hf://acme/tiny-vl@main", "hiddenSize": 1536, "dtype": "bfloat16"})
    pod = one(render(body, NODES, IMAGES), "Deployment", "qwen-epp")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == model_volumes.FETCH_CONTAINER and "--tokenizer-only" in init["args"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == init["args"][init["args"].index("--dest") + 1]


def test_a_picker_certificate_from_a_secret_is_mounted_and_named_by_the_tls_flags():
    """Without spec.router.pickerCertificate the picker makes its own self-signed certificate (no TLS flags); with
    it, the Secret's tls.crt/tls.key (and the client CA) are mounted and passed, and the args still parse."""
    plain = one(render(gw_service(), NODES, IMAGES), "Deployment", "qwen-epp")["spec"]["template"]["spec"]
    assert not any(a.startswith("--tls-") for a in plain["containers"][0]["args"])
    body = gw_service(router={"pickerCertificate": {"secretName": "epp-tls", "verifyClientsWith": "ca.crt"}})
    pod = one(render(body, NODES, IMAGES), "Deployment", "qwen-epp")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == g.PICKER_TLS_VOLUME]
    assert vol["secret"]["secretName"] == "epp-tls"
    assert {i["key"]: i["path"] for i in vol["secret"]["items"]} == {"tls.crt": "tls.crt", "tls.key": "tls.key",
                                                                      "ca.crt": "client-ca.crt"}
    assert {"name": g.PICKER_TLS_VOLUME, "mountPath": g.PICKER_TLS_MOUNT, "readOnly": True} in c["volumeMounts"]
    parser = argparse.ArgumentParser()
    flagfields.add_arguments(parser, EppSettings)
    got: EppSettings = flagfields.from_namespace(parser.parse_args(c["args"][1:]), EppSettings)
    assert got.secure_serving and got.tls_cert_file == f"{g.PICKER_TLS_MOUNT}/tls.crt"
    assert got.tls_key_file == f"{g.PICKER_TLS_MOUNT}/tls.key"
    assert got.tls_client_ca_file == f"{g.PICKER_TLS_MOUNT}/client-ca.crt"
    router = one(render(service(spec={"router": {"pickerCertificate": {"secretName": "epp-tls"}}}), NODES, IMAGES),
                 "Deployment", "qwen-router")["spec"]["template"]["spec"]
    assert not any(v["name"] == g.PICKER_TLS_VOLUME for v in router["volumes"])  # proxy mode: ignored
