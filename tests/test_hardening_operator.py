"""Issue 40, the operator's side: the model cache isolated per namespace and endpoint and checked by content,
hostPath prefixes, the generated admin key, per-client keys, the server pods' NetworkPolicy, and the operator's own
I/O (SSRF guard on tenants' endpoints, no redirects, bounded reads, no body copied into status)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakehub import FakeHub
from operator_fixtures.shapes import l4, service
from warmfleet import fetch as f
from warmfleet.kube import KubeError
from warmfleet.operator.passes import adapters_pass, bounded_http
from warmfleet.operator.passes.admin_secret import ensure_admin_secret, secret_value
from warmfleet.operator.passes.model_config import _read
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.admin_policy import AdminPolicy, policy_from_env
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.source import parse_source

IMAGES = objects.Images(engine="engine:1", router="operator-slim:1")
WEIGHTS = hashlib.sha256(b"w").digest() * 4096


def children(spec: dict, ns: str = "default", name: str = "qwen", policy: AdminPolicy | None = None) -> dict:
    body = service(name, spec=spec, namespace=ns, uid=f"uid-{ns}-{name}")
    _, _, plan = plan_for(body, [node_info(l4())], IMAGES, policy=policy)
    return {(c["kind"], c["metadata"]["name"]): c for c in plan.children}


def pod(objs: dict, component: str) -> dict:
    return next(c for c in objs.values() if c["kind"] == "Deployment"
                and c["metadata"]["labels"]["app.kubernetes.io/component"] == component)["spec"]["template"]["spec"]


def env(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


HF = {"source": "hf://acme/m@main", "hiddenSize": 1024, "dtype": "bfloat16"}


# ---- model cache ----

def test_the_same_source_in_two_namespaces_or_through_two_endpoints_lands_in_different_cache_dirs():
    def where(ns: str, endpoint: str, policy: AdminPolicy | None = None) -> tuple[str, str]:
        p = pod(children({"model": {**HF, "hub": {"endpoint": endpoint}}}, ns, policy=policy), "server")
        (init,) = p["initContainers"]
        sub = next(m["subPath"] for m in p["containers"][0]["volumeMounts"] if m["name"] == "model-cache")
        return init["args"][init["args"].index("--dest") + 1], sub

    a = where("team-a", "https://huggingface.co")
    b = where("team-b", "https://huggingface.co")
    evil = where("team-b", "http://evil.example")
    assert len({a, b, evil}) == 3
    for dest, sub in (a, b, evil):
        assert dest == f"/models/{sub}"  # the init container writes exactly the directory the server mounts
    assert a[1].startswith("ns/team-a/hf/huggingface.co-") and evil[1].startswith("ns/team-b/hf/evil.example-")
    # an admin may share across namespaces: then only the endpoint and the source tell directories apart
    shared = AdminPolicy(share_model_cache=True)
    assert where("team-a", "https://huggingface.co", shared) == where("team-b", "https://huggingface.co", shared)
    assert where("team-a", "https://huggingface.co", shared) != where("team-b", "http://evil.example", shared)


def test_the_node_cache_is_written_only_by_the_operators_own_image():
    spec = {"model": HF, "server": {"image": "tenant/anything:1"}, "lora": {"maxLoras": 1, "modelShape": {"numLayers": 4, "intermediateSize": 64}}}
    p = pod(children(spec), "server")
    writers = [c for c in p["initContainers"] + p["containers"]
               if any(m["name"] == "model-cache" and not m.get("readOnly") for m in c.get("volumeMounts", []))]
    assert {c["name"] for c in writers} == {"fetch-model", "fetch-adapters", "adapter-fetch"}
    assert {c["image"] for c in writers} == {"operator-slim:1"}
    assert p["containers"][0]["image"] == "tenant/anything:1"  # the tenant's image runs, reading the cache read-only


def test_a_tampered_cached_file_is_fetched_again(tmp_path):
    with FakeHub() as hub:
        hub.add("acme/m", {"config.json": json.dumps({"hidden_size": 8}).encode(), "model.safetensors": WEIGHTS})
        remote = lambda: f.HubRemote(parse_source("hf://acme/m"), token=None, endpoint=hub.url, timeout_s=5)  # noqa: E731
        dest = tmp_path / "m"
        f.fetch(remote(), dest, retry_delay_s=0.01)
        weights = dest / "model.safetensors"
        st = weights.stat()
        with weights.open("r+b") as fh:  # same size, other bytes, mtime put back: only the content differs
            fh.write(b"\0" * 64)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        hub.reset_counts()
        r = f.fetch(remote(), dest, retry_delay_s=0.01)
        assert weights.read_bytes() == WEIGHTS
        assert r.progress.transferred_bytes == len(WEIGHTS) and r.progress.cached_files == 1  # config.json untouched


def test_host_path_outside_the_admins_prefixes_is_an_invalid_spec_naming_the_field():
    spec = {"model": {**HF, "cache": {"hostPath": "/"}}}
    with pytest.raises(SpecError) as err:
        children(spec)
    assert err.value.path == "spec.model.cache.hostPath" and "/var/cache/warmfleet" in err.value.message
    with pytest.raises(SpecError):
        children({"model": {**HF, "cache": {"hostPath": "/var/cache/warmfleet/../../etc"}}})
    ok = children({"model": {**HF, "cache": {"hostPath": "/var/cache/warmfleet/fast"}}})
    vol = next(v for v in pod(ok, "server")["volumes"] if v["name"] == "model-cache")
    assert vol["hostPath"]["path"] == "/var/cache/warmfleet/fast"
    assert children(spec, policy=AdminPolicy(host_path_prefixes=("/",)))  # an admin may allow it


@pytest.mark.parametrize("pod, field", [
    ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "spec.server.pod.volumes[0].hostPath.path"),
    ({"volumes": [{"name": "all", "hostPath": {"path": "/var/cache/warmfleet/models"}}]},
     "spec.server.pod.volumes[0].hostPath.path"),  # under the prefixes, but the whole node cache
    ({"volumes": [{"name": "up", "hostPath": {"path": "/var/cache/warmfleet"}}]}, "spec.server.pod.volumes[0].hostPath.path"),
    ({"volumeMounts": [{"name": "model-cache", "mountPath": "/all-models"}]}, "spec.server.pod.volumeMounts[0].name"),
])
def test_pod_overlays_cannot_reach_the_node_cache_or_other_host_paths(pod, field):
    with pytest.raises(SpecError) as err:
        children({"model": HF, "server": {"pod": pod}})
    assert err.value.path == field
    router = {"volumes": [{"name": "root", "hostPath": {"path": "/etc"}}]}
    with pytest.raises(SpecError, match=r"spec.router.pod.volumes\[0\].hostPath.path"):
        children({"model": HF, "router": {"pod": router}})
    # a host directory the admin allows, beside the cache, is fine
    ok = {"volumes": [{"name": "scratch", "hostPath": {"path": "/var/cache/warmfleet/scratch"}}],
          "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}
    assert children({"model": HF, "server": {"pod": ok}})


def test_the_admins_policy_comes_from_the_environment_and_refuses_bad_values():
    p = policy_from_env({"WARMFLEET_HOST_PATH_PREFIXES": "/a, /b", "WARMFLEET_SHARE_MODEL_CACHE": "true",
                         "POD_NAMESPACE": "wf-system", "WARMFLEET_ALLOWED_ENDPOINT_HOSTS": "10.0.0.0/8"})
    assert p == AdminPolicy(("/a", "/b"), True, "wf-system", ("10.0.0.0/8",))
    assert policy_from_env({}) == AdminPolicy()
    assert policy_from_env({"WARMFLEET_SERVER_HTTP_FROM_NAMESPACES": "monitoring, *"}).server_http_from == ("monitoring", "*")
    for bad in ({"WARMFLEET_HOST_PATH_PREFIXES": "relative"}, {"WARMFLEET_SHARE_MODEL_CACHE": "yes"},
                {"WARMFLEET_SERVER_HTTP_FROM_NAMESPACES": "Not_A_Namespace"}):
        with pytest.raises(ValueError):
            policy_from_env(bad)


# ---- keys ----

def test_the_admin_key_is_the_generated_secret_never_the_client_api_key():
    objs = children({"model": HF, "router": {"apiKeySecret": {"name": "client-keys"}}, "lora": {"maxLoras": 1, "modelShape": {"numLayers": 4, "intermediateSize": 64}}})
    generated = {"secretKeyRef": {"name": "qwen-admin", "key": "admin-key"}}
    assert env(pod(objs, "server")["containers"][0])["WARMFLEET_ADMIN_KEY"] == generated
    router = env(pod(objs, "router")["containers"][0])
    assert router["WARMFLEET_ADMIN_KEY"] == generated
    assert router["WARMFLEET_API_KEY"] == {"secretKeyRef": {"name": "client-keys", "key": "api-key"}}
    # without spec.lora the servers' admin routes are closed all the same
    plain = children({"model": HF})
    assert env(pod(plain, "server")["containers"][0])["WARMFLEET_ADMIN_KEY"] == generated


class FakeKube:
    """Secrets only: what ensure_admin_secret and the passes ask of the API."""

    def __init__(self, forbid_get: bool = False) -> None:
        self.secrets: dict[tuple[str, str], dict] = {}
        self.forbid_get = forbid_get
        self.creates = 0

    async def get(self, kind: str, ns: str, name: str) -> dict | None:
        if self.forbid_get:
            raise KubeError(403, "forbidden")
        return self.secrets.get((ns, name))

    async def create(self, obj: dict) -> dict:
        self.creates += 1
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.secrets:
            raise KubeError(409, "exists")
        self.secrets[key] = obj
        return obj


def test_the_admin_secret_is_created_once_random_and_never_rotated():
    owner = objects.Owner("qwen", "team-a")
    spec = parse_spec({"model": HF})
    kube = FakeKube()
    assert asyncio.run(ensure_admin_secret(kube, owner, spec)) == "created"
    first = secret_value(kube.secrets["team-a", "qwen-admin"], "admin-key")
    assert first and len(first) >= 40
    for _ in range(3):
        assert asyncio.run(ensure_admin_secret(kube, owner, spec)) == "exists"
    assert secret_value(kube.secrets["team-a", "qwen-admin"], "admin-key") == first and kube.creates == 1
    other = FakeKube()
    asyncio.run(ensure_admin_secret(other, objects.Owner("qwen", "team-b"), spec))
    assert secret_value(other.secrets["team-b", "qwen-admin"], "admin-key") != first
    blind = FakeKube(forbid_get=True)  # create without get: a 409 says it is there
    blind.secrets["team-a", "qwen-admin"] = kube.secrets["team-a", "qwen-admin"]
    assert asyncio.run(ensure_admin_secret(blind, owner, spec)) == "exists"
    named = parse_spec({"model": HF, "lora": {"adminKeySecret": {"name": "mine"}}})
    assert asyncio.run(ensure_admin_secret(FakeKube(), owner, named)) == "named"


def test_a_keys_secret_gives_the_front_doors_one_salt_per_client():
    objs = children({"model": HF, "router": {"keysSecret": {"name": "tenants"}}})
    p = pod(objs, "router")
    c = p["containers"][0]
    assert c["args"][c["args"].index("--api-keys-file") + 1] == "/etc/warmfleet/keys/keys.json"
    assert {"name": "client-keys", "mountPath": "/etc/warmfleet/keys", "readOnly": True} in c["volumeMounts"]
    vol = next(v for v in p["volumes"] if v["name"] == "client-keys")
    assert vol["secret"]["secretName"] == "tenants" and vol["secret"]["items"] == [{"key": "keys.json", "path": "keys.json"}]
    gw = children({"model": HF, "router": {"mode": "gateway", "keysSecret": {"name": "tenants"}}})
    assert "--api-keys-file" in pod(gw, "epp")["containers"][0]["args"]


# ---- NetworkPolicy ----

def test_server_pods_admit_kv_events_only_from_this_services_front_doors():
    objs = children({"model": HF}, ns="team-a", policy=AdminPolicy(operator_namespace="wf-system"))
    netpol = objs["NetworkPolicy", "qwen-server"]
    assert netpol["spec"]["podSelector"]["matchLabels"] == objects.server_selector(objects.Owner("qwen", "team-a"))
    rules = {tuple(p["port"] for p in r["ports"]): r.get("from") for r in netpol["spec"]["ingress"]}
    doors = [{"podSelector": {"matchExpressions": [
        {"key": "serving.warmfleet.io/service", "operator": "In", "values": ["qwen"]},
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["router", "epp"]}]}}]
    assert rules[("kv-events",)] == doors  # no namespaceSelector: this namespace only
    in_ns = lambda *ns: [{"namespaceSelector": {"matchExpressions": [  # noqa: E731
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(ns)}]}}]
    assert rules[("http",)] == doors + in_ns("wf-system")
    # Prometheus scrapes the engines' /metrics on the HTTP port: the admin names its namespace
    scraped = children({"model": HF}, ns="team-a", policy=AdminPolicy(operator_namespace="wf-system",
                                                                      server_http_from=("monitoring",)))
    http = next(r for r in scraped["NetworkPolicy", "qwen-server"]["spec"]["ingress"] if r["ports"][0]["port"] == "http")
    assert http["from"] == doors + in_ns("monitoring", "wf-system")
    # gateway mode: the Gateway's proxies reach the HTTP port directly; the event ports stay closed to them
    gw = children({"model": HF, "router": {"mode": "gateway"}}, ns="team-a")["NetworkPolicy", "qwen-server"]
    gw_rules = {tuple(p["port"] for p in r["ports"]): r.get("from") for r in gw["spec"]["ingress"]}
    assert gw_rules[("http",)] is None and gw_rules[("kv-events",)] == doors
    assert ("NetworkPolicy", "qwen-server") not in children({"model": HF, "server": {"networkPolicy": False}})


# ---- the operator's I/O ----

def test_tenant_endpoints_on_private_link_local_or_metadata_addresses_are_refused():
    dns = {"mirror.internal": ["10.1.2.3"], "hub.example": ["93.184.216.34"], "nat64.example": ["64:ff9b::a9fe:a9fe"]}
    resolve = lambda host, port: dns[host]  # noqa: E731
    for url in ("http://169.254.169.254/", "http://127.0.0.1:8080", "http://mirror.internal", "http://[::ffff:10.0.0.1]/",
                "http://nat64.example/", "http://[fd00:ec2::254]/"):
        assert bounded_http.endpoint_problem(url, (), resolve), url
    assert bounded_http.endpoint_problem("https://hub.example/", (), resolve) is None
    assert bounded_http.endpoint_problem("http://mirror.internal", ("mirror.internal",), resolve) is None
    assert bounded_http.endpoint_problem("http://mirror.internal", ("10.0.0.0/8",), resolve) is None


def test_the_operator_reads_no_config_json_from_a_refused_endpoint_and_follows_no_redirect():
    with FakeHub() as hub:
        hub.add("acme/m", {"config.json": json.dumps({"hidden_size": 8}).encode()})
        spec = parse_spec({"model": {"source": "hf://acme/m", "hub": {"endpoint": hub.url}}})
        refused = _read(spec, None, True, ())
        assert refused.reason == "EndpointRefused" and hub.requests == []
        allowed = _read(spec, None, True, ("127.0.0.1",))
        assert allowed.summary is not None and allowed.summary.hidden_size == 8


def serve(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_reads_are_capped_redirects_not_followed_and_bodies_kept_out_of_status():
    async def main() -> None:
        huge = serve(lambda req: httpx.Response(200, content=b"x" * (bounded_http.METRICS_MAX_BYTES + 1)))
        with pytest.raises(bounded_http.TooLarge):
            await bounded_http.request(huge, "GET", "http://r/metrics", limit=bounded_http.METRICS_MAX_BYTES, timeout_s=5)
        hops = []

        def redirect(req: httpx.Request) -> httpx.Response:
            hops.append(str(req.url))
            return httpx.Response(302, headers={"location": "http://169.254.169.254/"})
        reply = await bounded_http.request(serve(redirect), "GET", "http://r/metrics", limit=100, timeout_s=5)
        assert reply.status_code == 302 and hops == ["http://r/metrics"]
        secret = "internal detail the replica chose"
        bad = serve(lambda req: httpx.Response(400, json={"error": {"message": secret, "code": "bad_adapter"}}))
        err = await adapters_pass._post(bad, "http://s", "/v1/load_lora_adapter", {"lora_name": "a"}, {})
        assert err == "POST /v1/load_lora_adapter: HTTP 400 (bad_adapter) (the replica's log says why)"
        assert secret not in err
    asyncio.run(main())


def test_a_config_json_error_reaches_status_as_one_bounded_line(monkeypatch):
    spec = parse_spec({"model": {"source": "hf://acme/m", "hub": {"endpoint": "https://hub.example"}}})
    chatty = "HTTP 500 from the hub\n" + "whatever the endpoint wrote " * 100

    def refuse(*_, **__):
        raise f.FetchError("Unreachable", chatty)
    monkeypatch.setattr(f, "read_config", refuse)
    monkeypatch.setattr(bounded_http, "endpoint_problem", lambda *_: None)
    learned = _read(spec, None, True, ())
    assert learned.error == "HTTP 500 from the hub" and learned.reason == "Unreachable"
