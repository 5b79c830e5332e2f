"""LoRA on Kubernetes: spec.lora / spec.adapters validation, engine flags, adapter sizing, the fetch steps, a pod
template that does not follow spec.adapters, and the runtime load/unload pass against fake server pods."""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import fcntl
import io
import json
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import pytest
import yaml

from operator_fixtures.memory import MemoryKube
from operator_fixtures.shapes import a100, l4, service
from warmfleet import fetch as fetch_mod
from warmfleet.operator.passes import adapters_pass
from warmfleet.operator.passes import model_config as mc
from warmfleet.operator.passes.reconcile import OperatorState, plan_for, render
from warmfleet.operator.planning import adapter_objects, engine_descriptions, lora_plan, objects
from warmfleet.operator.planning.nodes import GiB, MiB, node_info
from warmfleet.operator.planning.sizing import LORA_GPU_SHARE
from warmfleet.operator.spec import constants
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server import config as server_config
from warmfleet.server.config import LoraConfig, flag_of
from warmfleet.source import ConfigSummary, summarize_config

REPO = Path(__file__).resolve().parents[1]
IMAGES = objects.Images(engine="engine:1", router="slim:1")
VLLM = {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"}
# Qwen2.5-0.5B's language model
SHAPE = {"numLayers": 24, "intermediateSize": 4864, "numAttentionHeads": 14, "numKeyValueHeads": 2}
LORA = {"maxLoras": 2, "maxCpuLoras": 6, "maxLoraRank": 16, "modelShape": SHAPE}
SQL = {"name": "sql", "source": "hf://org/sql-lora", "rank": 8}
CHAT = {"name": "chat", "source": "s3://adapters/chat"}


def lora_service(adapters=(SQL,), lora_spec=None, **spec):
    model = spec.pop("model", {"path": "/models/qwen", "hiddenSize": 896})
    return service(spec={"model": model, "lora": lora_spec or LORA, "adapters": list(adapters), "replicas": 2, **spec})


def objs(body, nodes=(a100(),)):
    return render(body, [node_info(n) for n in nodes], IMAGES)


def servers(items):
    return [d for d in items if d["kind"] == "Deployment" and d["metadata"]["labels"][constants.COMPONENT_LABEL] == "server"]


def pod_spec(dep):
    return dep["spec"]["template"]["spec"]


def server_container(dep):
    return next(c for c in pod_spec(dep)["containers"] if c["name"] == "server")


def config_map(items, name):
    return next(o for o in items if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)


def parse_server_args(args):
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    assert args[0] == "serve"
    return server_config.from_namespace(parser.parse_args(args[1:]))


def flag_value(args, flag):
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


# ---- engines ----

def test_warmfleet_renders_the_lora_limits_with_the_servers_own_flags_and_no_adapters():
    (dep,) = servers(objs(lora_service(adapters=[SQL, CHAT])))
    args = server_container(dep)["args"]
    cfg = parse_server_args(args)  # the server's own argparse: a renamed flag fails here
    assert (cfg.lora.enable_lora, cfg.lora.max_loras, cfg.lora.max_cpu_loras, cfg.lora.max_lora_rank) == (True, 2, 6, 16)
    assert cfg.lora.lora_modules == []  # adapters are loaded at run time, never in the arguments
    for fname in ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank"):
        assert flag_of(LoraConfig, fname) in args
    assert set(engine_descriptions.render_flags(args)) <= set(engine_descriptions.WARMFLEET_FLAGS)


def test_warmfleet_renders_even_default_limits_explicitly():
    (dep,) = servers(objs(lora_service(lora_spec={"maxLoras": 1, "maxLoraRank": 16, "modelShape": SHAPE})))
    args = server_container(dep)["args"]
    assert (flag_value(args, "--max-loras"), flag_value(args, "--max-cpu-loras"), flag_value(args, "--max-lora-rank")) == \
        ("1", "1", "16")


def test_without_spec_lora_nothing_of_it_is_rendered():
    body = service(spec={"replicas": 2})
    (dep,) = servers(objs(body))
    args = server_container(dep)["args"]
    assert not {"--enable-lora", "--max-loras", "--max-cpu-loras", "--max-lora-rank"} & set(args)
    assert [c["name"] for c in pod_spec(dep)["containers"]] == ["server"]
    assert "initContainers" not in pod_spec(dep)
    assert not [o for o in objs(body) if o["metadata"]["name"].endswith("-adapters")]


def test_vllm_renders_its_own_lora_flags_and_runtime_updating():
    (dep,) = servers(objs(lora_service(engine=VLLM)))
    c = server_container(dep)
    args = c["args"]
    assert "--enable-lora" in args
    assert (flag_value(args, "--max-loras"), flag_value(args, "--max-lora-rank"), flag_value(args, "--max-cpu-loras")) == \
        ("2", "16", "6")
    assert "--lora-modules" not in args
    assert set(engine_descriptions.render_flags(args)) <= set(engine_descriptions.VLLM_FLAGS)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[engine_descriptions.VLLM_RUNTIME_LORA_ENV] == "True"


def test_vllm_lora_flag_table():
    expected = {"--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"}
    assert expected <= set(engine_descriptions.VLLM_FLAGS)
    for flag in expected:
        assert "vllm/engine/arg_utils.py" in engine_descriptions.VLLM_FLAGS[flag].source


def test_vllm_takes_only_its_own_rank_choices():
    assert engine_descriptions.VLLM_LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)
    with pytest.raises(SpecError, match="vLLM's --max-lora-rank takes one of 1, 8, 16"):
        objs(lora_service(engine=VLLM, lora_spec={**LORA, "maxLoraRank": 24}))
    (dep,) = servers(objs(lora_service(engine=VLLM, lora_spec={**LORA, "maxLoraRank": 320})))
    assert flag_value(server_container(dep)["args"], "--max-lora-rank") == "320"


def test_fastdeploy_with_lora_is_an_invalid_spec():
    body = lora_service(engine={"kind": "fastdeploy", "image": "fd:2"})
    with pytest.raises(SpecError, match="fastdeploy serves no LoRA adapters"):
        objs(body)


def test_admin_key_is_the_generated_secret_not_the_api_key_for_warmfleet():
    (dep,) = servers(objs(lora_service(router={"apiKeySecret": {"name": "keys", "key": "k"}})))
    env = {e["name"]: e.get("valueFrom") for e in server_container(dep)["env"]}
    assert env["WARMFLEET_ADMIN_KEY"] == {"secretKeyRef": {"name": "qwen-admin", "key": "admin-key"}}
    assert env["WARMFLEET_API_KEY"] == {"secretKeyRef": {"name": "keys", "key": "k"}}


def test_a_separate_admin_key_for_warmfleet():
    body = lora_service(lora_spec={**LORA, "adminKeySecret": {"name": "admin", "key": "k"}},
                        router={"apiKeySecret": {"name": "keys", "key": "api-key"}})
    (dep,) = servers(objs(body))
    env = {e["name"]: e.get("valueFrom") for e in server_container(dep)["env"]}
    assert env["WARMFLEET_ADMIN_KEY"] == {"secretKeyRef": {"name": "admin", "key": "k"}}
    assert env["WARMFLEET_API_KEY"] == {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    with pytest.raises(SpecError, match="adminKeySecret.*engine warmfleet only"):
        objs(lora_service(engine=VLLM, lora_spec={**LORA, "adminKeySecret": {"name": "admin"}}))


# ---- validation ----

@pytest.mark.parametrize("change, message", [
    ({"adapters": [{"name": "qwen", "source": "/a"}]}, "the served model name"),
    ({"adapters": [SQL, {**SQL, "source": "/b"}]}, "adapter names must be unique"),
    ({"adapters": [{**SQL, "rank": 32}]}, "above spec.lora.maxLoraRank 16"),
    ({"adapters": [{"name": "x", "source": "pvc://other/x"}]}, "names claim 'other'"),
    ({"adapters": [{"name": "x", "source": "ftp://x"}]}, "source must be"),
    ({"adapters": [{"name": "X_y", "source": "/a"}]}, "must match"),
    ({"adapters": [{"name": "x", "source": "/a/../b"}]}, "without '..' segments"),
    ({"lora": {**LORA, "maxCpuLoras": 1}}, "maxCpuLoras must be >= maxLoras"),
    ({"lora": {"maxLoras": 1}}, "needs numLayers and intermediateSize"),
    ({"lora": None}, "adapters need spec.lora"),
])
def test_invalid_specs_say_what_is_wrong(change, message):
    body = lora_service()
    body["spec"].update(change)
    if body["spec"]["lora"] is None:
        del body["spec"]["lora"]
    with pytest.raises(SpecError, match=message):
        plan_for(body, [node_info(a100())], IMAGES)


def test_invalid_adapters_become_invalid_spec_status_and_event():
    from warmfleet.operator.passes.reconcile import reconcile

    body = lora_service(adapters=[{"name": "qwen", "source": "/a"}])
    kube = MemoryKube()
    events = []
    state = OperatorState(default_images=IMAGES, kube=kube)
    out = asyncio.run(reconcile(state, body, [node_info(a100())], post_event=lambda b, t, r, msg: events.append((t, r, msg)),
                                now=lambda: "2026-01-01T00:00:00Z"))
    assert out.invalid and "served model name" in out.invalid
    assert events and events[0][:2] == ("Warning", "InvalidSpec") and "served model name" in events[0][2]
    patch = kube.status_patches[-1]
    cond = next(c for c in (patch.get("status") or patch)["conditions"] if c["type"] == "InvalidSpec")
    assert cond["status"] == "True" and "spec.adapters[0].name" in cond["message"]


def test_adapters_on_the_models_claim_are_read_in_place():
    body = lora_service(adapters=[{"name": "a", "source": "pvc://models/adapters/a"}, {"name": "b", "source": "/opt/b"}],
                        model={"source": "pvc://models/qwen", "hiddenSize": 896})
    items = objs(body)
    listed = json.loads(config_map(items, "qwen-adapters")["data"]["adapters.json"])
    assert [(a["name"], a["path"]) for a in listed] == [("a", "/models/adapters/a"), ("b", "/opt/b")]
    assert all("dir" not in a for a in listed)  # nothing to fetch


# ---- sizing ----

def qwen05_adapter_bytes(rank, modules=("q", "k", "v", "o", "gate", "up", "down")):
    h, inter, q, kv = 896, 4864, 14 * 64, 2 * 64
    dims = {"q": h + q, "k": h + kv, "v": h + kv, "o": q + h, "gate": h + inter, "up": h + inter, "down": inter + h}
    return 24 * rank * sum(dims[x] for x in modules) * 2  # bfloat16


def sizing_of(body, node=a100):
    _, _, plan = plan_for(body, [node_info(node())], IMAGES)
    (p,) = [p for p in plan.pools if p.sizing.fits] or plan.pools
    return p.sizing


def test_adapter_budget_is_max_loras_and_max_cpu_loras_times_the_largest_adapter():
    fixed = {"swapSpace": {"mode": "Fixed", "size": 4}, "processorCache": {"mode": "Fixed", "size": 1}}
    with_lora = sizing_of(lora_service(cache=fixed))
    base = service(spec={"model": {"path": "/models/qwen", "hiddenSize": 896}, "replicas": 2, "cache": fixed})
    without = sizing_of(base)
    per = qwen05_adapter_bytes(16)
    assert with_lora.inputs.bytes_per_adapter == per
    assert with_lora.sizes.lora_device_bytes == 2 * per
    assert with_lora.sizes.lora_host_bytes == 6 * per
    # host: inside the pod's memory request (both rounded up to MiB)
    assert without.sizes.memory_bytes + 6 * per <= with_lora.sizes.memory_bytes < without.sizes.memory_bytes + 6 * per + MiB
    assert with_lora.sizes.hash != without.sizes.hash
    assert "all seven projections at maxLoraRank 16" in with_lora.inputs.sources["lora"]
    assert "layers 24" in with_lora.inputs.sources["lora"] and "k/v 128" in with_lora.inputs.sources["lora"]


def test_auto_swap_leaves_room_for_the_host_adapters():
    big = {**LORA, "maxCpuLoras": 64, "maxLoraRank": 64}
    share = {"swapFraction": 0.5}  # below the 0.7 x H cap, so the swap tier is what is left
    a, b = sizing_of(lora_service(lora_spec=big, cache=share)), sizing_of(lora_service(cache=share))
    assert a.sizes.lora_host_bytes > b.sizes.lora_host_bytes
    assert a.sizes.swap_space_gib < b.sizes.swap_space_gib
    assert a.sizes.memory_bytes <= a.inputs.host_bytes_per_replica


def test_unknown_heads_assume_hidden_square_attention_and_say_so():
    shape = {"numLayers": 24, "intermediateSize": 4864}
    s = sizing_of(lora_service(lora_spec={"maxLoras": 1, "maxLoraRank": 8, "modelShape": shape}))
    assert s.inputs.bytes_per_adapter == 24 * 8 * (4 * 2 * 896 + 3 * (896 + 4864)) * 2
    assert "heads unknown" in s.inputs.sources["lora"]


def test_too_many_resident_adapters_for_the_gpu_do_not_fit():
    huge = {"maxLoras": 8, "maxLoraRank": 1024, "maxCpuLoras": 8, "modelShape": SHAPE}  # ~9 GB: fits the host, not the L4
    s = sizing_of(lora_service(lora_spec=huge, adapters=[]), node=l4)
    assert not s.fits and "LoRA adapters resident on the accelerator" in s.message
    assert s.sizes.lora_device_bytes > LORA_GPU_SHARE * s.inputs.gpu_bytes_per_replica


def test_report_shows_the_budget_and_each_adapters_own_size():
    items = objs(lora_service(adapters=[{**SQL, "targetModules": ["q_proj", "v_proj"]}, CHAT]))
    report = json.loads(config_map(items, "qwen-config")["data"]["sizing.json"])["lora"]
    assert (report["maxLoras"], report["maxCpuLoras"], report["maxLoraRank"]) == (2, 6, 16)
    assert report["deviceBytes"] == 2 * qwen05_adapter_bytes(16) and report["hostBytes"] == 6 * qwen05_adapter_bytes(16)
    sql, chat = report["adapters"]
    assert (sql["rank"], sql["bytes"]) == (8, qwen05_adapter_bytes(8, ("q", "v")))
    assert (chat["rank"], chat["bytes"]) == (16, qwen05_adapter_bytes(16))
    assert "rank unknown" in chat["note"] and "all seven" in chat["note"]


def test_shapes_come_from_config_json_where_the_spec_leaves_them():
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
           "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    summary = summarize_config(cfg)
    assert (summary.num_layers, summary.intermediate_size, summary.num_key_value_heads) == (24, 4864, 2)
    assert ConfigSummary.from_dict(summary.as_dict()) == summary
    spec = parse_spec({"model": {"source": "hf://Qwen/Qwen2.5-0.5B"}, "lora": {"maxLoras": 1, "modelShape": {"numLayers": 2}}})
    eff = mc.effective(spec, mc.resolve(spec, mc.Learned("hf://Qwen/Qwen2.5-0.5B", summary)))
    shape = eff.lora.model_shape
    assert (shape.num_layers, shape.intermediate_size, shape.num_attention_heads) == (2, 4864, 14)  # the spec wins


# ---- the pod template does not follow spec.adapters ----

def test_adding_and_removing_adapters_changes_no_pod_template():
    variants = [[], [SQL], [SQL, CHAT], [CHAT, {"name": "local", "source": "/opt/local"}]]
    rendered = [objs(lora_service(adapters=a)) for a in variants]
    templates = [[d["spec"]["template"] for d in servers(items)] for items in rendered]
    assert templates[0] and all(t == templates[0] for t in templates)
    lists = [config_map(items, "qwen-adapters")["data"]["adapters.json"] for items in rendered]
    assert len(set(lists)) == len(variants)  # the adapters reach the pods through this ConfigMap instead


def test_changing_a_limit_rolls_the_pool():
    a = servers(objs(lora_service()))[0]["spec"]["template"]
    b = servers(objs(lora_service(lora_spec={**LORA, "maxLoras": 3})))[0]["spec"]["template"]
    assert a != b
    assert a["metadata"]["annotations"] != b["metadata"]["annotations"]


def test_fetch_steps_read_the_adapters_config_map_with_fetch_models_own_flags():
    body = lora_service(lora_spec={**LORA, "credentialsSecret": "adapter-creds", "hub": {"endpoint": "https://hub.example"},
                                   "s3": {"endpoint": "https://minio.example", "region": "eu-1"}})
    (dep,) = servers(objs(body))
    ps = pod_spec(dep)
    (init,) = [c for c in ps["initContainers"] if c["name"] == adapter_objects.ADAPTER_FETCH_CONTAINER]
    (side,) = [c for c in ps["containers"] if c["name"] == adapter_objects.ADAPTER_WATCH_CONTAINER]
    parser = argparse.ArgumentParser()
    fetch_mod.add_arguments(parser)
    for c, watch in ((init, None), (side, 30.0)):
        assert c["command"] == ["warmfleet"] and c["args"][0] == "fetch-model" and c["image"] == "slim:1"
        ns = parser.parse_args(c["args"][1:])
        assert ns.source is None and ns.adapters == "/etc/warmfleet/adapters/adapters.json"
        assert ns.adapters_dir == "/models/lora/default/qwen" and ns.watch_s == watch
        assert (ns.hub_endpoint, ns.s3_endpoint, ns.s3_region) == ("https://hub.example", "https://minio.example", "eu-1")
        keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
        assert set(keys) == {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
        assert all(k["name"] == "adapter-creds" and k["optional"] for k in keys.values())
    vols = {v["name"]: v for v in ps["volumes"]}
    assert vols["adapters-list"]["configMap"]["name"] == "qwen-adapters"
    assert vols["model-cache"]["hostPath"]["path"] == "/var/cache/warmfleet/models"
    mount = next(x for x in server_container(dep)["volumeMounts"] if x["mountPath"] == lora_plan.ADAPTERS_MOUNT)
    assert (mount["subPath"], mount["readOnly"]) == ("lora/default/qwen", True)


def test_with_an_hf_model_the_adapters_share_its_cache_volume():
    body = lora_service(model={"source": "hf://Qwen/Qwen2.5-0.5B", "hiddenSize": 896, "cache": {"pvc": "cache"}})
    (dep,) = servers(objs(body))
    ps = pod_spec(dep)
    assert [c["name"] for c in ps["initContainers"]] == ["fetch-model", "fetch-adapters"]
    caches = [v for v in ps["volumes"] if v["name"] == "model-cache"]
    assert caches == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "cache"}}]


def test_fetched_adapter_paths_follow_their_source():
    a = lora_plan.adapter_path(parse_spec(lora_service()["spec"]), parse_spec(lora_service()["spec"]).adapters[0])
    moved = lora_service(adapters=[{**SQL, "source": "hf://org/sql-lora@v2"}])
    b = lora_plan.adapter_path(parse_spec(moved["spec"]), parse_spec(moved["spec"]).adapters[0])
    assert a.startswith("/adapters/sql-") and b.startswith("/adapters/sql-") and a != b


def test_lora_example_renders():
    from warmfleet.cli import main

    out = io.StringIO()
    with redirect_stdout(out), warnings.catch_warnings():
        rc = main(["operator", "render", "-f", str(REPO / "examples/inferenceservice-lora.yaml"),
                   "--nodes", str(REPO / "examples/nodes.yaml")])
    assert rc == 0
    docs = list(yaml.safe_load_all(out.getvalue()))
    listed = json.loads(next(d for d in docs if d["metadata"]["name"] == "qwen-lora-adapters")["data"]["adapters.json"])
    assert [a["name"] for a in listed] == ["sql", "support-chat"]
    for dep in servers(docs):
        assert "--enable-lora" in server_container(dep)["args"]


# ---- fetch-model --adapters ----

def test_fetch_adapters_fetches_each_remote_adapter_once_and_survives_failures(tmp_path):
    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps([{"name": "a", "dir": "a-1", "source": "hf://o/a"}, {"name": "b", "source": "s3://bkt/b"},
                                   {"name": "c", "source": "/opt/c"}, {"name": "d", "dir": "../x", "source": "hf://o/d"}]))
    args = argparse.Namespace(adapters=str(listing), adapters_dir=str(tmp_path / "root"), retries=1)
    calls = []

    def fetch_one(name, source, dest):
        calls.append((name, source, dest))
        if name == "b":
            raise fetch_mod.FetchError("NotFound", "no adapter_config.json")

    done: dict[str, str] = {}
    failed = fetch_mod.fetch_adapters(args, done, fetch_one)
    assert [c[0] for c in calls] == ["a-1", "b"] and calls[0][2] == tmp_path / "root" / "a-1"
    assert done == {"a-1": "hf://o/a"} and failed == {"b": "NotFound: no adapter_config.json"}
    calls.clear()
    fetch_mod.fetch_adapters(args, done, fetch_one)
    assert [c[0] for c in calls] == ["b"]  # a is done; b is tried again on the next pass


def test_the_sidecar_deletes_an_adapter_directory_only_after_it_has_been_unlisted_for_the_grace(tmp_path):
    root = tmp_path / "root"
    for name in ("keep-1", "old-1", "busy-1", "gone-1"):
        (root / name / fetch_mod.META_DIR).mkdir(parents=True)
        (root / name / "adapter_model.safetensors").write_bytes(b"x")
    (root / "mounted").mkdir()  # not made by fetch: never touched
    unlisted: dict[str, float] = {}
    assert fetch_mod.sweep_adapters(root, {"keep-1", "busy-1", "gone-1"}, unlisted, 100.0, 60.0) == []
    assert unlisted == {"old-1": 100.0}  # first seen unlisted now: kept through the grace
    assert fetch_mod.sweep_adapters(root, {"keep-1", "old-1", "busy-1"}, unlisted, 130.0, 60.0) == []
    assert unlisted == {"gone-1": 130.0}  # old-1 is listed again (a newer list): its clock is reset
    with (root / "busy-1" / fetch_mod.META_DIR / "lock").open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # a fetch of busy-1 in progress (another pod's newer list names it)
        assert fetch_mod.sweep_adapters(root, {"keep-1"}, unlisted, 190.0, 60.0) == ["gone-1"]
        assert fetch_mod.sweep_adapters(root, {"keep-1"}, unlisted, 300.0, 60.0) == ["old-1"]
    assert fetch_mod.sweep_adapters(root, {"keep-1"}, unlisted, 300.0, 60.0) == ["busy-1"]
    assert sorted(p.name for p in root.iterdir()) == ["keep-1", "mounted"] and unlisted == {}


def test_an_adapters_list_that_is_not_a_list_of_objects_is_unreadable_not_empty(tmp_path):
    listing = tmp_path / "adapters.json"
    for text in ('{"a": 1}', '["a"]'):
        listing.write_text(text)
        with pytest.raises(ValueError, match="not a JSON list of objects"):
            fetch_mod.read_adapters(listing)
    listing.write_text("")
    assert fetch_mod.read_adapters(listing) == []


def test_fetch_requires_the_adapter_config_in_adapter_mode(tmp_path):
    class OneFile:
        anonymous = True

        def listing(self):
            return fetch_mod.Listing(revision="r", files=[fetch_mod.RemoteFile("config.json", 2, "size:2", "x")])

        def close(self):
            pass

    with pytest.raises(fetch_mod.FetchError, match="no adapter_config.json.*PEFT adapter"):
        fetch_mod.fetch(OneFile(), tmp_path / "a", patterns=fetch_mod.ADAPTER_PATTERNS,
                        config_file=fetch_mod.ADAPTER_CONFIG_FILE)


# ---- the runtime pass against fake server pods ----

class FakeServer:
    """A server pod's /v1/models and vLLM's runtime LoRA routes (what warmfleet's engine serves too): `key` guards
    every route, `admin_key` (warmfleet's --admin-key) the load and unload routes instead."""

    def __init__(self, base="qwen", key=None, missing=(), admin_key=None):
        self.base, self.key, self.missing, self.admin_key = base, key, set(missing), admin_key
        self.loras: dict[str, str] = {}
        self.calls: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        need = self.admin_key if self.admin_key and path != "/v1/models" else self.key
        if need and request.headers.get("authorization") != f"Bearer {need}":
            return httpx.Response(401, json={"error": {"message": "admin routes need a key"}})
        if path == "/v1/models":
            cards = [{"id": self.base, "root": "/models/qwen"}] + [
                {"id": n, "root": p, "parent": self.base} for n, p in self.loras.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        body = json.loads(request.content)
        self.calls.append(f"{path.rsplit('/', 1)[1]} {body['lora_name']}")
        if path == "/v1/load_lora_adapter":
            if body["lora_path"] in self.missing:
                return httpx.Response(400, json={"error": {"message": f"{body['lora_path']}: no adapter_config.json"}})
            self.loras[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            self.loras.pop(body["lora_name"], None)
            return httpx.Response(200, text="Success")
        return httpx.Response(404)


GENERATED_ADMIN_KEY = "generated-admin"  # what the reconcile put into qwen-admin (passes/admin_secret.py)


class SecretKube(MemoryKube):
    """Objects by (kind, name), the service's generated admin Secret among them unless `admin` is False."""

    def __init__(self, objs, admin=True):
        generated = {"kind": "Secret", "metadata": {"name": "qwen-admin"},
                     "data": {"admin-key": base64.b64encode(GENERATED_ADMIN_KEY.encode()).decode()}}
        super().__init__([*objs, *([generated] if admin else [])])


def server_pod(name, ip, ready=True):
    labels = {**objects.labels(objects.Owner("qwen", "default"), "server", "p")}
    return {"kind": "Pod", "metadata": {"name": name, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def run_pass(body, fakes, kube):
    by_host = {f"10.0.0.{i}": f for i, f in enumerate(fakes, 1)}
    transport = httpx.MockTransport(lambda req: by_host[req.url.host].handle(req))
    patch: dict = {}

    async def go():
        async with httpx.AsyncClient(transport=transport) as http:
            return await adapters_pass.run_pass(OperatorState(default_images=IMAGES, kube=kube), body, [node_info(a100())],
                                                patch, http=http)
    return asyncio.run(go()), patch


def paths(body):
    spec = parse_spec(body["spec"])
    return {a.name: lora_plan.adapter_path(spec, a) for a in spec.adapters}


def test_pass_loads_missing_unloads_extra_and_reports_per_adapter():
    body = lora_service(adapters=[SQL, CHAT])
    p = paths(body)
    a, b, c = FakeServer(), FakeServer(missing={p["chat"]}), FakeServer()
    a.loras = {"sql": p["sql"], "old": "/adapters/old-1"}
    kube = SecretKube([server_pod("s-1", "10.0.0.1"), server_pod("s-2", "10.0.0.2"), server_pod("s-3", "10.0.0.3", ready=False)])
    results, patch = run_pass(body, [a, b, c], kube)
    assert a.calls == ["unload_lora_adapter old", "load_lora_adapter chat"]  # sql was there already
    assert b.calls == ["load_lora_adapter chat", "load_lora_adapter sql"]
    assert c.calls == []  # not Ready: the next pass after it is
    assert a.loras == {"sql": p["sql"], "chat": p["chat"]} and b.loras == {"sql": p["sql"]}
    status = {s["name"]: s for s in patch["status"]["adapters"]}
    assert (status["sql"]["loadedReplicas"], status["sql"]["readyReplicas"]) == (2, 2) and "message" not in status["sql"]
    # the status names the HTTP status, never the replica's own words (issue 40: no response body in status)
    assert status["chat"]["loadedReplicas"] == 1 and "load_lora_adapter: HTTP 400" in status["chat"]["message"]
    assert "adapter_config" not in status["chat"]["message"]
    assert status["chat"]["path"] == p["chat"] and status["chat"]["source"] == CHAT["source"]


def test_pass_is_quiet_once_in_line_and_reloads_a_moved_adapter():
    body = lora_service(adapters=[SQL])
    p = paths(body)
    srv = FakeServer()
    kube = SecretKube([server_pod("s-1", "10.0.0.1")])
    _, patch = run_pass(body, [srv], kube)
    body["status"] = {"adapters": patch["status"]["adapters"]}
    srv.calls.clear()
    _, patch = run_pass(body, [srv], kube)
    assert srv.calls == [] and patch == {}  # nothing to do, and status unchanged: not written again
    moved = copy.deepcopy(body)
    moved["spec"]["adapters"] = [{**SQL, "source": "hf://org/sql-lora@v2"}]
    run_pass(moved, [srv], kube)
    assert srv.calls == ["unload_lora_adapter sql", "load_lora_adapter sql"]
    assert srv.loras["sql"] == paths(moved)["sql"] != p["sql"]


def test_pass_removes_every_adapter_when_spec_adapters_empties():
    body = lora_service(adapters=[])
    srv = FakeServer()
    srv.loras = {"sql": "/adapters/sql-1", "chat": "/adapters/chat-1"}
    _, patch = run_pass(body, [srv], SecretKube([server_pod("s-1", "10.0.0.1")]))
    assert srv.loras == {} and patch["status"]["adapters"] == []


def test_pass_lists_with_the_api_key_and_loads_with_the_generated_admin_key():
    body = lora_service(router={"apiKeySecret": {"name": "keys", "key": "api-key"}})
    secret = {"kind": "Secret", "metadata": {"name": "keys"}, "data": {"api-key": base64.b64encode(b"s3cret").decode()}}
    srv = FakeServer(key="s3cret", admin_key=GENERATED_ADMIN_KEY)
    _, patch = run_pass(body, [srv], SecretKube([server_pod("s-1", "10.0.0.1"), secret]))
    assert "sql" in srv.loras and patch["status"]["adapters"][0]["loadedReplicas"] == 1
    # the client API key alone no longer loads adapters (issue 40: any client could)
    srv = FakeServer(key="s3cret", admin_key=GENERATED_ADMIN_KEY)
    _, patch = run_pass(body, [srv], SecretKube([server_pod("s-1", "10.0.0.1"), secret], admin=False))
    assert srv.loras == {} and "Secret default/qwen-admin not found" in patch["status"]["adapters"][0]["message"]


def test_pass_sends_the_admin_key_to_load_and_the_api_key_to_list():
    body = lora_service(router={"apiKeySecret": {"name": "keys", "key": "api-key"}},
                        lora_spec={**LORA, "adminKeySecret": {"name": "admin", "key": "k"}})
    secrets = [{"kind": "Secret", "metadata": {"name": "keys"}, "data": {"api-key": base64.b64encode(b"api").decode()}},
               {"kind": "Secret", "metadata": {"name": "admin"}, "data": {"k": base64.b64encode(b"adm").decode()}}]
    srv = FakeServer(key="api", admin_key="adm")
    _, patch = run_pass(body, [srv], SecretKube([server_pod("s-1", "10.0.0.1"), *secrets]))
    assert "sql" in srv.loras and patch["status"]["adapters"][0]["loadedReplicas"] == 1


def test_pass_reports_a_missing_secret_instead_of_calling_pods():
    body = lora_service(router={"apiKeySecret": {"name": "keys", "key": "api-key"}})
    srv = FakeServer(key="s3cret")
    _, patch = run_pass(body, [srv], SecretKube([server_pod("s-1", "10.0.0.1")]))
    (entry,) = patch["status"]["adapters"]
    assert srv.calls == [] and entry["loadedReplicas"] == 0 and "Secret default/keys not found" in entry["message"]


def test_pass_does_nothing_for_invalid_specs_or_without_lora():
    bad = lora_service(adapters=[{"name": "qwen", "source": "/a"}])
    srv = FakeServer()
    assert run_pass(bad, [srv], SecretKube([server_pod("s-1", "10.0.0.1")])) == (None, {})
    off = service(spec={"replicas": 1})
    off["status"] = {"adapters": [{"name": "sql"}]}
    result, patch = run_pass(off, [srv], SecretKube([server_pod("s-1", "10.0.0.1")]))
    assert result is None and patch == {"status": {"adapters": None}} and srv.calls == []


def test_unreachable_pod_is_reported_not_fatal():
    body = lora_service(adapters=[SQL])

    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    patch: dict = {}

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
            await adapters_pass.run_pass(OperatorState(default_images=IMAGES, kube=SecretKube([server_pod("s-1", "10.0.0.1")])),
                                         body, [node_info(a100())], patch, http=http)
    asyncio.run(go())
    (entry,) = patch["status"]["adapters"]
    assert entry["loadedReplicas"] == 0 and "ConnectError" in entry["message"]




# ---- the pass as the operator runs it: kopf in-process against kmock, fake server pods over HTTP ----

class FakeServerPods:
    """FakeServer per pod behind one HTTP server: the adapter pass reaches pod NAME at URL/NAME (server_url_template)."""

    def __init__(self, names):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        import threading

        self.pods = {n: FakeServer() for n in names}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                pod, _, rest = self.path.lstrip("/").partition("/")
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                req = httpx.Request(self.command, f"http://pod/{rest}", content=body, headers=dict(self.headers))
                resp = owner.pods[pod].handle(req)
                self.send_response(resp.status_code)
                self.send_header("content-type", resp.headers.get("content-type", "text/plain"))
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_POST = _serve  # noqa: N815 (http.server's names)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def kmock_pod(name, ip, ready=True):
    pod = server_pod(name, ip, ready)
    pod["apiVersion"] = "v1"
    pod["metadata"].update(namespace="default", resourceVersion="1", uid=f"uid-{name}")
    pod["spec"] = {"containers": [{"name": "server", "image": "img:test"}]}
    return pod


async def test_the_operator_loads_and_unloads_adapters_on_running_pods_without_touching_deployments(cluster):
    from operator_fixtures.cluster import DEPLOY, ISVC, PODS, eventually, obj, seed, server_deployments, status
    from operator_fixtures.running import run_operator

    seed(cluster, a100("a1"))
    seed(cluster, lora_service(adapters=[SQL]), res=ISVC)
    seed(cluster, kmock_pod("qwen-p1", "10.0.0.1"), kmock_pod("qwen-p2", "10.0.0.2"), res=PODS)
    with FakeServerPods(["qwen-p1", "qwen-p2"]) as fakes:
        async with run_operator(cluster, 30, adapters_interval_s=1.0, server_url_template=fakes.url + "/{name}"):
            def loaded(name, n):
                entry = next((a for a in status(cluster).get("adapters") or [] if a["name"] == name), {})
                return entry.get("loadedReplicas") == n and entry.get("readyReplicas") == 2

            await eventually(lambda: loaded("sql", 2), "sql loaded on both pods")
            assert all(set(f.loras) == {"sql"} for f in fakes.pods.values())
            (dep_name,) = server_deployments(cluster)
            template = copy.deepcopy(obj(cluster, DEPLOY, dep_name)["spec"]["template"])
            await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                                json={"metadata": {"generation": 2}, "spec": {"adapters": [CHAT]}})
            await eventually(lambda: loaded("chat", 2) and len(status(cluster)["adapters"]) == 1, "chat instead of sql")
            assert all(set(f.loras) == {"chat"} for f in fakes.pods.values())
            assert all(f.calls[-2:] == ["unload_lora_adapter sql", "load_lora_adapter chat"] for f in fakes.pods.values())
            await eventually(lambda: status(cluster).get("observedGeneration") == 2, "generation 2 reconciled")
            assert obj(cluster, DEPLOY, dep_name)["spec"]["template"] == template


def test_fetch_model_adapters_command_is_one_pass_and_never_fails_the_pod(tmp_path, monkeypatch):
    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps([{"name": "local", "source": "/opt/local"},
                                   {"name": "bad", "dir": "bad-1", "source": "s3://no-such-bucket/x"}]))
    seen = []

    def failing_fetch(remote, dest, **kw):
        seen.append((str(dest), kw["config_file"]))
        raise fetch_mod.FetchError("Unreachable", "no network here")

    monkeypatch.setattr(fetch_mod, "fetch", failing_fetch)
    parser = argparse.ArgumentParser()
    fetch_mod.add_arguments(parser)
    args = parser.parse_args(["--adapters", str(listing), "--adapters-dir", str(tmp_path / "root")])
    assert fetch_mod.run(args) == 0  # the init step: a failed adapter is logged, the server still starts
    assert seen == [(str(tmp_path / "root" / "bad-1"), "adapter_config.json")] and (tmp_path / "root").is_dir()
    assert fetch_mod.run(parser.parse_args(["--adapters", str(listing)])) == 2  # --adapters-dir is required
    assert fetch_mod.run(parser.parse_args(["hf://o/m"])) == 2  # SOURCE needs --dest
