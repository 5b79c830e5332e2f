"""Model sources in the operator: what it learns from config.json (kopf in-process against kmock, config.json
from the fake hub), how explicit values win, what it renders (init container, cache volume, Secret env),
and the spec rules for source, path, pvc, cache and credentials."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time

import kmock
import pytest

from fakehub import FakeHub
from operator_fixtures.cluster import DEPLOY, ISVC, condition, eventually, obj, operator, seed, server_deployments, status
from operator_fixtures.shapes import h200, l4, service
from warmfleet import fetch
from warmfleet.operator.passes import model_config as mc
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec import constants
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.source import ConfigSummary, origin_key

SECRETS = "v1/secrets"
CONFIG = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 1536,
          "torch_dtype": "float16", "vision_config": {"embed_dim": 1280}}


@pytest.fixture()
def hub():
    with FakeHub() as h:
        h.add("acme/tiny-vl", {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": b"w" * 1000},
              token="hf_good")
        yield h


def secret(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "default", "resourceVersion": "1"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def with_secrets(cluster: kmock.KubernetesEmulator, *secrets: dict) -> None:
    cluster.resources[SECRETS] = kmock.ResourceInfo(kind="Secret", namespaced=True, verbs={"get", "list", "watch", "create"})
    for s in secrets:
        seed(cluster, s, res=SECRETS)


def hf_service(hub: FakeHub, **model) -> dict:
    return service(spec={"replicas": 1, "model": {"source": "hf://acme/tiny-vl", "credentialsSecret": "hf-creds",
                                                  "hub": {"endpoint": hub.url}, **model}})


def patch_spec(cluster, generation: int, spec: dict):
    return cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                         json={"metadata": {"generation": generation}, "spec": spec})


# ---- kopf + kmock ----

async def test_config_json_is_learned_into_status_and_sizes_and_the_spec_wins(cluster, hub):
    with_secrets(cluster, secret("hf-creds", HF_TOKEN="hf_good"))
    seed(cluster, h200("h1"))
    seed(cluster, hf_service(hub), res=ISVC)
    async with operator(cluster):
        learned = await eventually(lambda: status(cluster)["modelConfig"]["learned"], "learned values in status")
        assert learned == {"hiddenSize": {"value": 1536, "from": "config.json"}, "dtype": {"value": "float16", "from": "config.json"}}
        mcs = status(cluster)["modelConfig"]
        assert mcs["source"] == "hf://acme/tiny-vl" and mcs["revision"] == hub.repos["acme/tiny-vl"].commit
        assert mcs["configJson"] == {"architecture": "Qwen2VLForConditionalGeneration", "modelType": "qwen2_vl",
                                     "hiddenSize": 1536, "dtype": "float16", "vision": True, "visionHiddenSize": 1280}
        cond = condition(cluster, "ModelConfigUnavailable")
        assert (cond["status"], cond["reason"]) == ("False", "ConfigRead") and condition(cluster, "InvalidSpec")["status"] == "False"
        (pool,) = status(cluster)["pools"]
        assert pool["inputs"]["bytesPerEncoderToken"] == 1536 * 2
        (dep,) = server_deployments(cluster).values()
        pod = dep["spec"]["template"]["spec"]
        server = pod["containers"][0]
        assert server["args"][server["args"].index("--dtype") + 1] == "float16"
        (init,) = pod["initContainers"]
        assert init["args"][:2] == ["fetch-model", "hf://acme/tiny-vl"]
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-creds", "key": "HF_TOKEN"}
        assert env["HF_ENDPOINT"]["value"] == hub.url
        # the token went to the hub, config.json was read once however often the service was reconciled
        assert [q.authorization for q in hub.requests] == ["Bearer hf_good"]

        # explicit values win; config.json stays in status for reference
        await patch_spec(cluster, 2, {"model": {"hiddenSize": 2048, "dtype": "bfloat16"}})
        await eventually(lambda: status(cluster).get("observedGeneration") == 2, "generation 2 observed")
        mcs = status(cluster)["modelConfig"]
        assert mcs["learned"] == {"hiddenSize": {"value": 2048, "from": "spec"}, "dtype": {"value": "bfloat16", "from": "spec"}}
        assert mcs["configJson"]["hiddenSize"] == 1536
        assert status(cluster)["pools"][0]["inputs"]["bytesPerEncoderToken"] == 2048 * 2
        assert len(hub.requests) == 1  # still cached


async def test_bad_credentials_are_a_condition_and_hidden_size_becomes_required(cluster, hub):
    with_secrets(cluster, secret("hf-creds", HF_TOKEN="hf_wrong"))
    seed(cluster, h200("h1"))
    seed(cluster, hf_service(hub), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "ModelConfigUnavailable").get("status") == "True"
                                and condition(cluster, "ModelConfigUnavailable"), "ModelConfigUnavailable")
        assert cond["reason"] == "Unauthorized"
        assert "the hub refused the credentials (HTTP 401: Invalid credentials in Authorization header)" in cond["message"]
        invalid = condition(cluster, "InvalidSpec")
        assert invalid["status"] == "True" and invalid["message"].startswith(
            "spec.model.hiddenSize: is needed to size the encoder cache and config.json could not be read")
        assert server_deployments(cluster) == {}
        assert status(cluster)["modelConfig"]["message"] == cond["message"]
        posted = await eventually(lambda: [r.data for r in list(cluster) if str(r.method).upper().endswith("POST")
                                           and r.url.path.endswith("/events") and isinstance(r.data, dict)
                                           and r.data.get("reason") == "ModelConfigUnavailable"], "a Warning Event")
        assert posted[0]["type"] == "Warning" and "Unauthorized" in posted[0]["message"]

        # an explicit hidden size is enough to size and run: sizing falls back to the spec, the condition stays
        await patch_spec(cluster, 2, {"model": {"hiddenSize": 3584}})
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False", "InvalidSpec cleared")
        assert len(server_deployments(cluster)) == 1
        assert condition(cluster, "ModelConfigUnavailable")["status"] == "True"
        learned = status(cluster)["modelConfig"]["learned"]
        assert learned == {"hiddenSize": {"value": 3584, "from": "spec"}, "dtype": {"value": "bfloat16", "from": "default"}}


async def test_the_operator_tries_again_until_config_json_can_be_read(cluster, hub, monkeypatch):
    monkeypatch.setattr(mc, "RETRY_DELAY_S", 0.5)  # the timer's interval (60 s in the operator)
    monkeypatch.setattr(mc, "RETRY_S", 0.0)  # failed reads are not cached
    with_secrets(cluster, secret("hf-creds", HF_TOKEN="hf_wrong"))
    seed(cluster, h200("h1"))
    seed(cluster, hf_service(hub), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "ModelConfigUnavailable").get("status") == "True", "ModelConfigUnavailable")
        assert server_deployments(cluster) == {}
        # the timer's period on this host, measured: two more failed reads (the baseline for the check below)
        n = len(hub.requests)
        await eventually(lambda: len(hub.requests) > n, "a timer read")
        t_read, n = time.monotonic(), len(hub.requests)
        await eventually(lambda: len(hub.requests) > n, "the next timer read")
        period_s = time.monotonic() - t_read
        # the user fixes the token: no spec change, no child event; the timer reconciles and recovers
        await cluster.patch("/api/v1/namespaces/default/secrets/hf-creds",
                            json={"data": {"HF_TOKEN": base64.b64encode(b"hf_good").decode()}})
        await eventually(lambda: condition(cluster, "ModelConfigUnavailable").get("status") == "False", "config.json read")
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False" and server_deployments(cluster),
                         "the service sized from config.json")
        assert status(cluster)["modelConfig"]["learned"]["hiddenSize"] == {"value": 1536, "from": "config.json"}
        count = len(hub.requests)
        # the timer stops once the condition is False: no read in three of its periods (measured above; at
        # least the configured one)
        await asyncio.sleep(3 * max(period_s, mc.RETRY_DELAY_S))
        assert len(hub.requests) == count


async def test_a_missing_secret_is_named(cluster, hub):
    with_secrets(cluster)
    seed(cluster, l4("l1"))
    seed(cluster, hf_service(hub, hiddenSize=1536), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "ModelConfigUnavailable").get("status") == "True"
                                and condition(cluster, "ModelConfigUnavailable"), "ModelConfigUnavailable")
        assert (cond["reason"], cond["message"]) == ("MissingSecret", "Secret default/hf-creds not found")
        assert hub.requests == []
        assert obj(cluster, DEPLOY, "qwen-router") is not None  # the spec's hidden size sizes the service meanwhile


async def test_a_path_source_has_no_condition_and_says_its_values_are_defaults(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1}), res=ISVC)
    async with operator(cluster):
        mcs = await eventually(lambda: status(cluster).get("modelConfig"), "modelConfig in status")
        assert mcs == {"source": "/models/qwen", "revision": "", "learned": {
            "hiddenSize": {"value": 4096, "from": "default"}, "dtype": {"value": "bfloat16", "from": "default"}}, "message": ""}
        assert condition(cluster, "ModelConfigUnavailable") == {}


# ---- resolution (pure) ----

def learned(hidden=1536, dtype="float16", error="") -> mc.Learned:
    summary = ConfigSummary("A", "t", hidden, dtype, False, None) if hidden or dtype else None
    return mc.Learned("hf://a/b", summary, "c0ffee", error=error, reason="Unauthorized" if error else "")


@pytest.mark.parametrize("model,learn,want", [
    ({"source": "hf://a/b"}, learned(), (1536, "config.json", "float16", "config.json")),
    ({"source": "hf://a/b", "hiddenSize": 64, "dtype": "float32"}, learned(), (64, "spec", "float32", "spec")),
    ({"source": "hf://a/b"}, learned(dtype="float8_e4m3fn"), (1536, "config.json", "bfloat16", "default")),
    ({"source": "hf://a/b", "hiddenSize": 64}, learned(None, None, error="401"), (64, "spec", "bfloat16", "default")),
    ({"path": "/m"}, None, (4096, "default", "bfloat16", "default")),
    ({"source": "pvc://store/m"}, None, (4096, "default", "bfloat16", "default")),
])
def test_resolve_explicit_then_config_json_then_default(model, learn, want):
    r = mc.resolve(parse_spec({"model": model}), learn)
    assert (r.hidden_size, r.hidden_from, r.dtype, r.dtype_from) == want


def test_hidden_size_is_required_only_when_an_engine_takes_our_encoder_cache():
    with pytest.raises(SpecError) as err:
        mc.resolve(parse_spec({"model": {"source": "s3://bkt/m"}, "engine": {"kind": "warmfleet"}}), learned(None, None, error="HTTP 403"))
    assert err.value.path == "spec.model.hiddenSize" and "config.json could not be read (HTTP 403)" in err.value.message
    vllm = parse_spec({"model": {"source": "s3://bkt/m"}, "engine": {"kind": "vllm", "image": "v:1"}})
    assert mc.resolve(vllm, None).hidden_from == "default"  # vLLM sizes its own encoder cache


def test_a_failed_read_keeps_the_values_read_before():
    body = {"spec": {"model": {"source": "hf://a/b"}},
            "status": {"modelConfig": {"source": "hf://a/b", "revision": "abc", "configJson": {"hiddenSize": 1536, "dtype": "float16"}}}}
    failed = mc.with_earlier(mc.Learned("hf://a/b", None, error="timeout", reason="Unreachable"), body)
    assert failed.earlier and failed.summary.hidden_size == 1536 and failed.error == "timeout"
    new = mc.with_model_config({"conditions": []}, body, failed, "now", 3)
    assert new["modelConfig"]["learned"]["hiddenSize"] == {"value": 1536, "from": "config.json"}
    assert new["modelConfig"]["message"] == "timeout; using the config.json read before (revision abc)"
    (cond,) = new["conditions"]
    assert (cond["type"], cond["status"], cond["reason"], cond["observedGeneration"]) == ("ModelConfigUnavailable", "True", "Unreachable", 3)
    other = {**body, "spec": {"model": {"source": "hf://a/other"}}}
    assert not mc.with_earlier(mc.Learned("hf://a/other", None, error="x"), other).earlier  # another model's values never apply


def test_the_cache_keeps_reads_fresh_and_retries_failures_sooner():
    t = [0.0]
    cache = mc.ConfigCache(clock=lambda: t[0])
    cache.put(("ok",), learned())
    cache.put(("bad",), learned(error="x"))
    t[0] = mc.RETRY_S + 1
    assert cache.get(("ok",)) is not None and cache.get(("bad",)) is None
    t[0] = mc.FRESH_S + 1
    assert cache.get(("ok",)) is None


# ---- rendering ----

def rendered(model: dict, engine: dict | None = None, nodes=(l4(),)) -> list[dict]:
    spec = {"model": model, **({"engine": engine} if engine else {})}
    body = service(spec=spec)
    return render(body, [node_info(n) for n in nodes], objects.Images(engine="engine:1", router="slim:1"),
                  learned=mc.Learned(model.get("source", ""), ConfigSummary("A", "t", 1536, "bfloat16", True, None), "c"))


def pods(items: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["labels"][constants.COMPONENT_LABEL]: d["spec"]["template"]["spec"] for d in items if d["kind"] == "Deployment"}


def test_hf_source_renders_a_fetch_init_container_and_the_cache_volume():
    p = pods(rendered({"source": "hf://Qwen/Qwen2-VL-2B-Instruct@v1.0", "credentialsSecret": "hf", "hub": {"endpoint": "https://mirror.example"}}))
    server, router = p["server"], p["router"]
    model_dir = "/models/hf/Qwen/Qwen2-VL-2B-Instruct/v1.0"
    # in the node cache: per namespace and per endpoint (docs/security.md "Model cache")
    node_dir = "ns/default/hf/mirror.example-" + origin_key("hf", "https://mirror.example")[-12:] + "/Qwen/Qwen2-VL-2B-Instruct/v1.0"
    (init,) = server["initContainers"]
    assert init["name"] == "fetch-model" and init["image"] == "slim:1" and init["command"] == ["warmfleet"]
    assert init["args"] == ["fetch-model", "hf://Qwen/Qwen2-VL-2B-Instruct@v1.0", "--dest", f"/models/{node_dir}",
                            "--termination-log", "/dev/termination-log"]
    assert init["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert {e["name"]: e.get("value") for e in init["env"]} == {"HOME": "/tmp", "HF_HUB_DISABLE_TELEMETRY": "1",
                                                                "HF_ENDPOINT": "https://mirror.example", "HF_TOKEN": None}
    assert init["volumeMounts"] == [{"name": "model-cache", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    cache = next(v for v in server["volumes"] if v["name"] == "model-cache")
    assert cache["hostPath"] == {"path": "/var/cache/warmfleet/models", "type": "DirectoryOrCreate"}
    c = server["containers"][0]
    assert {"name": "model-cache", "mountPath": model_dir, "subPath": node_dir, "readOnly": True} in c["volumeMounts"]
    assert c["args"][c["args"].index("--model") + 1] == model_dir
    # the router gets only tokenizer files, into an emptyDir: no node cache needed on router nodes
    (rinit,) = router["initContainers"]
    assert "--tokenizer-only" in rinit["args"] and rinit["volumeMounts"][0]["name"] == "model"
    assert next(v for v in router["volumes"] if v["name"] == "model") == {"name": "model", "emptyDir": {"sizeLimit": "1Gi"}}
    rc = router["containers"][0]
    assert rc["args"][rc["args"].index("--model") + 1] == model_dir


def test_s3_source_with_a_cache_pvc_and_the_aws_keys():
    p = pods(rendered({"source": "s3://models/qwen/7b", "credentialsSecret": "s3", "s3": {"endpoint": "http://minio:9000", "region": "eu-1"},
                       "cache": {"pvc": "model-cache"}}))
    server = p["server"]
    (init,) = server["initContainers"]
    assert init["args"][init["args"].index("--s3-endpoint") + 1] == "http://minio:9000"
    assert init["args"][init["args"].index("--s3-region") + 1] == "eu-1"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"] if "valueFrom" in e}
    assert refs == {"AWS_ACCESS_KEY_ID": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"},
                    "AWS_SECRET_ACCESS_KEY": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"},
                    "AWS_SESSION_TOKEN": {"name": "s3", "key": "AWS_SESSION_TOKEN", "optional": True}}
    assert next(v for v in server["volumes"] if v["name"] == "model-cache") == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    assert server["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_peer_engines_fetch_with_the_warmfleet_image():
    p = pods(rendered({"source": "hf://a/b"}, engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"}))
    assert p["server"]["containers"][0]["image"] == "vllm/vllm-openai:v0.32.0"
    assert p["server"]["initContainers"][0]["image"] == "slim:1"


def test_pvc_and_path_sources_mount_like_the_older_fields():
    old = pods(rendered({"path": "/models/q", "pvc": "store"}))
    new = pods(rendered({"source": "pvc://store/q"}))
    assert new == old and "initContainers" not in new["server"]
    baked = pods(rendered({"source": "/opt/model"}))
    assert pods(rendered({"path": "/opt/model"})) == baked and "initContainers" not in baked["server"]


def test_rendered_fetch_args_parse_with_fetch_models_own_argparse():
    for model in ({"source": "hf://a/b@main"}, {"source": "s3://bkt/p", "s3": {"endpoint": "http://x:9000", "region": "r"}}):
        for spec in pods(rendered(model)).values():
            (init,) = spec["initContainers"]
            parser = argparse.ArgumentParser()
            fetch.add_arguments(parser)
            args = parser.parse_args(init["args"][1:])
            assert args.source == model["source"] and args.dest.startswith("/models/")


def test_rendered_objects_validate_against_kubernetes_schemas():
    import kubernetes_validate as kv

    for model in ({"source": "hf://a/b", "credentialsSecret": "hf"}, {"source": "s3://bkt/p", "cache": {"pvc": "c"}, "credentialsSecret": "s3"}):
        for o in rendered(model):
            kv.validate(o, "1.32", strict=True)


# ---- the spec rules (CEL has the same messages; e2e checks them on a real API server) ----

@pytest.mark.parametrize("model,needle", [
    ({}, "exactly one of source and path is required"),
    ({"source": "hf://a/b", "path": "/m"}, "exactly one of source and path is required"),
    ({"source": "hf://just-a-name"}, "source must be hf://ORG/NAME[@REVISION]"),
    ({"source": "/models/../etc"}, "without '..' segments"),
    ({"source": "pvc://store/m", "pvc": "store"}, "pvc goes with path"),
    ({"path": "/m", "credentialsSecret": "x"}, "cache and credentialsSecret apply to hf:// and s3:// sources only"),
    ({"source": "pvc://store", "cache": {"hostPath": "/c"}}, "cache and credentialsSecret apply to hf:// and s3:// sources only"),
    ({"source": "s3://bkt/p", "hub": {"endpoint": "https://x"}}, "hub applies to hf:// sources only"),
    ({"source": "hf://a/b", "s3": {"region": "r"}}, "s3 applies to s3:// sources only"),
    ({"source": "hf://a/b", "cache": {"hostPath": "/c", "pvc": "c"}}, "hostPath and pvc are mutually exclusive"),
    ({"source": "hf://a/b", "cache": {"hostPath": "relative"}}, "spec.model.cache.hostPath: must match"),
])
def test_bad_model_specs_are_readable_errors(model, needle):
    with pytest.raises(SpecError) as err:
        parse_spec({"model": model})
    assert needle in str(err.value)


# ---- `warmfleet operator render` reads config.json too ----

def test_render_reads_config_json_and_says_when_it_cannot(hub, tmp_path, capsys, monkeypatch):
    import yaml

    from warmfleet.cli import main

    monkeypatch.delenv("HF_TOKEN", raising=False)  # render uses this machine's credentials

    hub.add("acme/public-vl", {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": b"w"})
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump(h200()))
    body = service(spec={"replicas": 1, "model": {"source": "hf://acme/public-vl", "hub": {"endpoint": hub.url}}})
    f = tmp_path / "svc.yaml"
    f.write_text(yaml.safe_dump(body))
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes)]) == 0
    last = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
    assert last["status"]["modelConfig"]["learned"]["hiddenSize"] == {"value": 1536, "from": "config.json"}
    (pool,) = last["status"]["pools"]
    assert pool["inputs"]["bytesPerEncoderToken"] == 1536 * 2

    body["spec"]["model"]["source"] = "hf://acme/tiny-vl"  # private: this machine has no token for it
    f.write_text(yaml.safe_dump(body))
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes)]) == 2
    assert "spec.model.hiddenSize: is needed" in capsys.readouterr().err
    body["spec"]["model"]["hiddenSize"] = 1024
    f.write_text(yaml.safe_dump(body))
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes), "--strict"]) == 1
    err = capsys.readouterr().err
    assert "config.json: hf://acme/tiny-vl: config.json: repository not found, or private" in err


def test_a_status_patch_removes_what_model_config_lost():
    from warmfleet.operator.planning.service_status import status_patch

    old = {"modelConfig": {"source": "hf://a/b", "configJson": {"hiddenSize": 1}, "message": ""}, "ready": "True"}
    new = {"modelConfig": {"source": "/m", "message": ""}, "ready": "True"}
    assert status_patch(old, new) == {"modelConfig": {"source": "/m", "configJson": None}}
