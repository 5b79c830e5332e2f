"""Pure manifest builders and offline render: contract 3 args, probes, sizing-hash rollouts, RBAC, schemas."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from operator_fixtures.shapes import GiB, TiB, a100, h200, l4, node, service
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning import engine_descriptions, objects, router_objects
from warmfleet.operator.planning.nodes import node_info, parse_quantity
from warmfleet.operator.spec import constants
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server import flagfields
from warmfleet.server import config as server_config

IMAGES = objects.Images(engine="engine:1", router="slim:1")  # the operator's --default-image and --router-image

REPO = Path(__file__).resolve().parents[1]
NODES = [h200("h200-a"), h200("h200-b"), a100("a100-a"), l4("l4-a"), node("cpu-a")]


def objs(body=None, nodes=NODES):
    return render(body or service(spec={"replicas": 12}), [node_info(n) for n in nodes], IMAGES)


def by_kind(items, kind):
    return [o for o in items if o["kind"] == kind]


def servers(items):
    return [d for d in by_kind(items, "Deployment") if d["metadata"]["labels"][constants.COMPONENT_LABEL] == "server"]


def container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def parse_server_args(args):
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    assert args[0] == "serve"
    return server_config.from_namespace(parser.parse_args(args[1:]))


def test_children_and_owner_references():
    items = objs()
    kinds = [o["kind"] for o in items]
    assert kinds.count("Deployment") == 5  # three GPU pools, the CPU pool (engine warmfleet: CPU attention), router
    for kind in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding"):
        assert kinds.count(kind) == 1
    assert kinds.count("PodDisruptionBudget") == 2  # server pods, router pods
    assert kinds.count("Service") == 3  # replicas (headless), the endpoint, the routers' peers (headless)
    for o in items:
        (ref,) = o["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceService", "qwen", "uid-qwen", True)
        assert o["metadata"]["namespace"] == "default"


def test_server_args_parse_with_the_servers_own_argparse():
    items = objs(service(spec={"replicas": 3, "server": {"extraArgs": ["--max-num-seqs", "32"]},
                               "cache": {"blockSize": 128, "prefixCaching": False}}))
    for dep in servers(items):
        c = container(dep)
        cfg = parse_server_args(c["args"])
        report = yaml.safe_load(by_kind(items, "ConfigMap")[0]["data"]["sizing.json"])
        pool = next(p for p in report["pools"] if p["name"] == dep["metadata"]["labels"][constants.POOL_LABEL])
        assert cfg.cache.swap_space == pool["sizes"]["swapSpaceGib"]
        assert cfg.cache.max_encoder_cache == pool["sizes"]["encoderCacheTokens"]
        assert cfg.cache.max_processor_cache == pool["sizes"]["processorCacheGib"]
        assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching) == (128, False)
        assert cfg.scheduler.max_num_seqs == 32
        assert (cfg.model.model, cfg.model.served_model_name) == ("/models/qwen", "qwen")
        assert (cfg.server.host, cfg.server.port, cfg.server.kv_events_port) == ("0.0.0.0", engine_descriptions.HTTP_PORT, engine_descriptions.KV_EVENTS_PORT)
        assert cfg.server.replica_id == "$(POD_NAME)"


def test_sizes_are_rendered_even_when_they_equal_server_defaults():
    body = service(spec={"cache": {"swapSpace": {"mode": "Fixed", "size": 0}}})
    (dep,) = servers(objs(body, [l4()]))
    args = container(dep)["args"]
    for flag in ("--swap-space", "--max-encoder-cache", "--max-processor-cache"):
        assert args.count(flag) == 1


def test_server_pod_resources_shm_probes_and_security():
    (dep,) = servers(objs(service(), [h200()]))
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    res = c["resources"]
    assert res["requests"] == res["limits"]
    assert res["requests"]["nvidia.com/gpu"] == "1"
    mem = parse_quantity(res["requests"]["memory"])
    assert mem == int((16 + 5 + 161.25) * GiB)
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm["medium"] == "Memory" and parse_quantity(shm["sizeLimit"]) == 5 * GiB < mem
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "30"]
    assert pod["terminationGracePeriodSeconds"] > 30
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": engine_descriptions.HTTP_PORT, "kv-events": engine_descriptions.KV_EVENTS_PORT}
    spread = pod["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_node_affinity_pins_the_pool_shape():
    body = service(spec={"nodeSelector": {"serve": "yes"}})
    (dep,) = servers(objs(body, [h200(labels={"serve": "yes"})]))
    exprs = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
    assert {"key": "serve", "operator": "In", "values": ["yes"]} in exprs
    assert {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]} in exprs
    assert {"key": "nvidia.com/gpu.memory", "operator": "In", "values": ["143771"]} in exprs


def test_replicas_split_across_pools_and_pdb():
    items = objs()
    replicas = {d["metadata"]["labels"][constants.POOL_LABEL].split("-")[0]: d["spec"]["replicas"] for d in servers(items)}
    # capacities 8, 16, 4 and the CPU node's 2 (64 GiB: memory binds; warmfleet's engine runs CPU attention there)
    assert replicas == {"a100": 3, "h200": 6, "l4": 2, "cpu": 1}
    pdb, router_pdb = by_kind(items, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == objects.server_selector(objects.Owner("qwen", "default"))
    # the routers have their own: a node drain never evicts every router at once (kube-score's
    # deployment-has-poddisruptionbudget; docs/security.md)
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    assert router_pdb["metadata"]["name"] == "qwen-router" and router_pdb["spec"]["maxUnavailable"] == 1
    assert router_pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]


def test_a_node_in_another_pool_changes_no_pool_template():
    before = {d["metadata"]["name"]: d["spec"]["template"] for d in servers(objs())}
    after = {d["metadata"]["name"]: d["spec"]["template"] for d in servers(objs(nodes=NODES + [h200("h200-c")]))}
    assert before == after


def test_changed_allocatable_rolls_only_that_pool():
    shrunk = [h200("h200-a", memory=2 * TiB - 20 * GiB), h200("h200-b", memory=2 * TiB - 20 * GiB)] + NODES[2:]
    before = {d["metadata"]["name"]: d["spec"]["template"] for d in servers(objs())}
    after = {d["metadata"]["name"]: d["spec"]["template"] for d in servers(objs(nodes=shrunk))}
    changed = {name for name in before if before[name] != after.get(name)}
    assert len(changed) == 1 and "h200" in changed.pop()
    for name, tpl in after.items():
        if "h200" in name:
            assert tpl["metadata"]["annotations"][constants.SIZING_HASH_ANNOTATION] != before[name]["metadata"]["annotations"][constants.SIZING_HASH_ANNOTATION]


def test_headless_service_router_and_rbac():
    items = objs(service(spec={"router": {"replicas": 3, "apiKeySecret": {"name": "keys"}, "serviceType": "LoadBalancer"}}))
    svcs = {s["metadata"]["name"]: s for s in by_kind(items, "Service")}
    headless = svcs["qwen-replicas"]
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in headless["spec"]["ports"]} == {"http", "kv-events"}
    assert svcs["qwen"]["spec"]["type"] == "LoadBalancer"
    peers = svcs["qwen-router-peers"]  # active-active: the routers find each other by this name
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    rc = container(router)
    assert rc["command"] == ["warmfleet"] and rc["args"][0] == "route"
    assert rc["args"][rc["args"].index("--discover-service") + 1] == "default/qwen-replicas"
    assert rc["args"][rc["args"].index("--model") + 1] == "/models/qwen"
    assert rc["args"][rc["args"].index("--host") + 1] == "0.0.0.0"
    assert rc["args"][rc["args"].index("--peers") + 1] == f"http://qwen-router-peers.default.svc:{engine_descriptions.HTTP_PORT}"
    assert router["spec"]["replicas"] == 3
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "qwen-router"
    env = {e["name"]: e for e in rc["env"]}
    assert env["WARMFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    (role,) = by_kind(items, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    (binding,) = by_kind(items, "RoleBinding")
    assert binding["subjects"][0]["name"] == "qwen-router" and binding["roleRef"]["name"] == "qwen-router"


def test_router_args_parse_with_the_routers_own_argparse():
    from warmfleet.server.router.core import runtime
    from warmfleet.server.router.http import main

    items = objs(service(spec={"router": {"loadBound": 1.5}, "cache": {"blockSize": 32}}), [l4()])
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    args = container(router)["args"]
    assert args[0] == "route"
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    got = runtime.settings_from_args(parser.parse_args(args[1:]))
    assert (got.discover_service, got.host, got.port, got.model) == ("default/qwen-replicas", "0.0.0.0", engine_descriptions.HTTP_PORT, "/models/qwen")
    assert got.policy.epsilon == 0.5 and got.block_size == 32
    assert got.peers == f"http://qwen-router-peers.default.svc:{engine_descriptions.HTTP_PORT}"
    assert flagfields.to_args(got, router_objects.ROUTER_FIELDS) == args[1:]  # args → settings → args: the same pod spec


def test_pvc_is_mounted_read_only():
    items = objs(service(spec={"model": {"path": "/models/q", "pvc": "store"}}), [l4()])
    for dep in by_kind(items, "Deployment"):
        vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": "store", "readOnly": True}


def test_long_names_are_dns_labels():
    items = objs(service(name="a" * 60), [h200()])
    for o in items:
        assert len(o["metadata"]["name"]) <= 63


def test_rendered_objects_match_kubernetes_schemas():
    import kubernetes_validate as kv
    for o in objs(service(spec={"model": {"path": "/m", "pvc": "store"}, "router": {"apiKeySecret": {"name": "k"}}})):
        kv.validate(o, "1.32", strict=True)


def test_render_command_prints_the_example(tmp_path, monkeypatch):
    from importlib.metadata import version

    from warmfleet.cli import main

    monkeypatch.delenv("WARMFLEET_IMAGE", raising=False)
    monkeypatch.delenv("WARMFLEET_ROUTER_IMAGE", raising=False)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["operator", "render", "-f", str(REPO / "examples/inferenceservice.yaml"), "--nodes", str(REPO / "examples/nodes.yaml")])
    assert rc == 0
    docs = list(yaml.safe_load_all(out.getvalue()))
    assert "*id" not in out.getvalue()  # no YAML aliases
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Deployment")
    assert len(names) == 4 and "qwen-vl-router" in names
    assert sum(d["spec"]["replicas"] for d in servers(docs)) == 12
    # without --default-image / --router-image: the two images released with this version, never `latest`
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "qwen-vl-router")
    assert container(router)["image"] == f"ghcr.io/warmfleet/warmfleet-slim:{version('warmfleet')}"
    # the example's engine.kind is auto: its GPU pools run vLLM's pinned official image
    assert {container(d)["image"] for d in servers(docs)} == {engine_descriptions.VLLM_IMAGE}


def test_render_ends_with_status_and_warns_about_what_will_not_run(tmp_path, capsys):
    from warmfleet.cli import main

    example = yaml.safe_load((REPO / "examples/inferenceservice.yaml").read_text())
    assert main(["operator", "render", "-f", str(REPO / "examples/inferenceservice.yaml"),
                 "--nodes", str(REPO / "examples/nodes.yaml")]) == 0
    captured = capsys.readouterr()
    last = list(yaml.safe_load_all(captured.out))[-1]
    assert last["kind"] == "InferenceService" and last["metadata"]["name"] == example["metadata"]["name"]
    assert last["status"]["replicas"] == 12 and last["status"]["ready"] == "False"
    assert "fits no replica" in captured.err  # the example's CPU node matches the selector but has no GPU
    # a selector that matches no node: no server Deployment, a warning that says so; --strict makes it an error
    example["spec"]["nodeSelector"] = {"warmfleet.io/serving": "nowhere"}
    nomatch = tmp_path / "nomatch.yaml"
    nomatch.write_text(yaml.safe_dump(example))
    args = ["operator", "render", "-f", str(nomatch), "--nodes", str(REPO / "examples/nodes.yaml")]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "matches no Ready, schedulable node" in captured.err and not servers(list(yaml.safe_load_all(captured.out)))
    reasons = {c["type"]: c["reason"] for c in list(yaml.safe_load_all(captured.out))[-1]["status"]["conditions"]}
    assert reasons["Degraded"] == "NoMatchingNodes"
    assert main(args + ["--strict"]) == 1
    # clamped sizes are reported too
    example["spec"]["nodeSelector"] = {"warmfleet.io/serving": "true"}
    example["spec"].setdefault("cache", {})["swapSpace"] = {"mode": "Auto", "max": 1}
    clamped = tmp_path / "clamped.yaml"
    clamped.write_text(yaml.safe_dump(example))
    assert main(["operator", "render", "-f", str(clamped), "--nodes", str(REPO / "examples/nodes.yaml")]) == 0
    assert "swapSpace clamped to its max" in capsys.readouterr().err


def test_render_reports_a_bad_spec(tmp_path, capsys):
    from warmfleet.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(service(spec={"replicas": 2, "autoscaling": {"minReplicas": 5, "maxReplicas": 4}})))
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump(h200()))
    assert main(["operator", "render", "-f", str(bad), "--nodes", str(nodes)]) == 2
    assert "minReplicas must be <= maxReplicas" in capsys.readouterr().err


# ---- engines: vLLM and FastDeploy rendered from their descriptions ----

VLLM = {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"}
FD = {"kind": "fastdeploy", "image": "fastdeploy:2.3"}
KINDS = {"warmfleet": {}, "vllm": VLLM, "fastdeploy": FD}


def engine_service(kind, **spec):
    return service(spec={"engine": KINDS[kind], **spec}) if KINDS[kind] else service(spec=spec)


def flag_value(args, flag):
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def report_pool(items, dep):
    report = yaml.safe_load(by_kind(items, "ConfigMap")[0]["data"]["sizing.json"])
    return next(p for p in report["pools"] if p["name"] == dep["metadata"]["labels"][constants.POOL_LABEL])


def test_vllm_args_carry_sizes_in_its_own_flags_and_units():
    items = objs(engine_service("vllm", replicas=3, model={"path": "/models/q", "maxModelLen": 8192}))
    assert len(servers(items)) == 3  # one per GPU pool
    for dep in servers(items):
        c, pool = container(dep), report_pool(items, dep)
        args = c["args"]
        assert c["image"] == VLLM["image"]
        assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert (flag_value(args, "--model"), flag_value(args, "--served-model-name")) == ("/models/q", "qwen")
        assert (flag_value(args, "--host"), flag_value(args, "--port")) == ("0.0.0.0", str(engine_descriptions.HTTP_PORT))
        assert flag_value(args, "--block-size") == "64" and "--enable-prefix-caching" in args
        assert flag_value(args, "--prefix-caching-hash-algo") == "sha256_cbor"
        assert float(flag_value(args, "--kv-offloading-size")) == pool["sizes"]["swapSpaceGib"] > 0
        assert flag_value(args, "--kv-offloading-backend") == "native"
        assert float(flag_value(args, "--mm-processor-cache-gb")) == pool["sizes"]["processorCacheGib"]
        assert flag_value(args, "--max-num-batched-tokens") == "2048" and flag_value(args, "--max-model-len") == "8192"
        assert float(flag_value(args, "--gpu-memory-utilization")) == pool["sizes"]["gpuMemoryUtilization"] == 0.9
        assert flag_value(args, "--tensor-parallel-size") == "1" and "--enable-prompt-tokens-details" in args
        # no encoder-cache size: vLLM has no such flag and sizes it from max_num_batched_tokens
        assert "encoderCacheTokens" not in pool["sizes"] and not any("encoder" in a for a in args if a.startswith("--"))
        events = json.loads(flag_value(args, "--kv-events-config"))
        assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{engine_descriptions.KV_EVENTS_PORT}",
                          "replay_endpoint": f"tcp://*:{engine_descriptions.KV_REPLAY_PORT}", "topic": "kv-events"}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PYTHONHASHSEED"] == "0" and "POD_NAME" not in env
        shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert parse_quantity(shm["sizeLimit"]) == pool["sizes"]["shmBytes"] >= pool["sizes"]["swapSpaceGib"] * GiB


def test_fastdeploy_args_carry_sizes_in_its_own_flags_and_units():
    items = objs(engine_service("fastdeploy", replicas=3, cache={"prefixCaching": False}))
    for dep in servers(items):
        c, pool = container(dep), report_pool(items, dep)
        args = c["args"]
        assert c["command"] == ["python3", "-m", "fastdeploy.entrypoints.openai.api_server"]
        assert flag_value(args, "--metrics-port") == str(engine_descriptions.METRICS_PORT)
        assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
        # GiB as is: FastDeploy's source multiplies --swap-space by 1024**3 (its docs say GB)
        assert float(flag_value(args, "--swap-space")) == pool["sizes"]["swapSpaceGib"] > 0
        assert int(flag_value(args, "--max-encoder-cache")) == pool["sizes"]["encoderCacheTokens"] > 0
        assert float(flag_value(args, "--max-processor-cache")) == pool["sizes"]["processorCacheGib"]
        assert float(flag_value(args, "--gpu-memory-utilization")) == pool["sizes"]["gpuMemoryUtilization"] < 0.9
        assert "--max-model-len" not in args and "--dtype" not in args  # FastDeploy has no --dtype flag
        assert c["workingDir"] == "/tmp" and {"name": "FD_LOG_DIR", "value": "/tmp/log"} in c["env"]


def test_a_cpu_tier_of_zero_is_left_out_not_passed_as_zero():
    fixed0 = {"swapSpace": {"mode": "Fixed", "size": 0}}
    (v,) = servers(objs(engine_service("vllm", cache=fixed0), [l4()]))
    (f,) = servers(objs(engine_service("fastdeploy", cache=fixed0), [l4()]))
    assert not {"--kv-offloading-size", "--kv-offloading-backend"} & set(container(v)["args"])  # vLLM refuses 0
    assert "--swap-space" not in container(f)["args"]  # any value, 0 too, turns FastDeploy's CPU tier on


@pytest.mark.parametrize("kind", KINDS)
def test_every_rendered_flag_is_in_the_engines_flag_table(kind):
    engine = engine_descriptions.ENGINES[kind]
    variants = [{}, {"cache": {"prefixCaching": False, "swapSpace": {"mode": "Fixed", "size": 0}}},
                {"model": {"path": "/m", "maxModelLen": 4096}, "cache": {"processorCache": {"mode": "Fixed", "size": 0}}}]
    if engine.tensor_parallel:
        variants.append({"server": {"gpusPerReplica": 2}})
    seen = set()
    for extra in variants:
        for dep in servers(objs(engine_service(kind, **extra))):
            flags = engine_descriptions.render_flags(container(dep)["args"])
            assert flags and set(flags) <= set(engine.flags), set(flags) - set(engine.flags)
            seen |= set(flags)
    sized = {"warmfleet": {"--swap-space", "--max-encoder-cache", "--max-processor-cache"},
             "vllm": {"--kv-offloading-size", "--mm-processor-cache-gb", "--tensor-parallel-size", "--block-size"},
             "fastdeploy": {"--swap-space", "--max-encoder-cache", "--max-processor-cache", "--tensor-parallel-size"}}
    assert sized[kind] <= seen  # the variants exercised every sized cache's flag
    for doc in engine.flags.values():
        assert doc.unit and doc.meaning and doc.source


def test_warmfleet_flag_table_is_the_servers_own_config():
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    accepted = {s for a in parser._actions for s in a.option_strings}
    assert set(engine_descriptions.WARMFLEET_FLAGS) <= accepted


def test_extra_args_come_last_so_they_override():
    items = objs(engine_service("vllm", server={"extraArgs": ["--seed", "1"]},
                                engine={**VLLM, "extraArgs": ["--gpu-memory-utilization", "0.8"]}), [l4()])
    (dep,) = servers(items)
    assert container(dep)["args"][-4:] == ["--seed", "1", "--gpu-memory-utilization", "0.8"]


@pytest.mark.parametrize("kind", ["vllm", "fastdeploy"])
def test_gpus_per_replica_is_tensor_parallelism_for_peer_engines(kind):
    items = objs(engine_service(kind, replicas=4, server={"gpusPerReplica": 2}))
    deps = servers(items)
    assert deps
    for dep in deps:
        c = container(dep)
        assert flag_value(c["args"], "--tensor-parallel-size") == "2"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert report_pool(items, dep)["sizes"]["replicasPerNode"] == {"h200": 4, "a100": 4, "l4": 2}[dep["metadata"]["labels"][constants.POOL_LABEL].split("-")[0]]


def test_warmfleet_with_several_gpus_per_replica_is_an_invalid_spec():
    with pytest.raises(SpecError) as err:
        objs(service(spec={"server": {"gpusPerReplica": 2}}))
    assert err.value.path == "spec.server.gpusPerReplica"
    assert "engine warmfleet runs one GPU per replica" in str(err.value)


def test_render_refuses_warmfleet_tensor_parallelism_with_one_line(tmp_path, capsys):
    from warmfleet.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(service(name="tp", spec={"server": {"gpusPerReplica": 4}})))
    assert main(["operator", "render", "-f", str(bad), "--nodes", str(REPO / "examples/nodes.yaml")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "spec.server.gpusPerReplica" in lines[0] and "InferenceService tp" in lines[0]


@pytest.mark.parametrize("kind,ports", [
    ("warmfleet", {"http": 8000, "kv-events": 5557}),
    ("vllm", {"http": 8000, "kv-events": 5557, "kv-replay": 5558}),
    ("fastdeploy", {"http": 8000, "metrics": 8001}),  # no KV events; load from its metrics port
])
def test_ports_per_engine_on_pods_and_the_headless_service(kind, ports):
    items = objs(engine_service(kind), [h200()])
    (dep,) = servers(items)
    assert {p["name"]: p["containerPort"] for p in container(dep)["ports"]} == ports
    headless = next(s for s in by_kind(items, "Service") if s["metadata"]["name"] == "qwen-replicas")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in headless["spec"]["ports"]} == {n: (v, n) for n, v in ports.items()}
    load = engine_descriptions.ENGINES[kind].load
    assert load.port in ports  # where the router reads load is a port the Service exposes


@pytest.mark.parametrize("kind,probes,key_env", [
    ("warmfleet", ("/health", "/ready", "/health"), "WARMFLEET_API_KEY"),
    ("vllm", ("/health", "/health", "/health"), "VLLM_API_KEY"),
    ("fastdeploy", ("/health", "/health", "/health"), "FD_API_KEY"),
])
def test_probes_and_api_key_per_engine(kind, probes, key_env):
    (dep,) = servers(objs(engine_service(kind, router={"apiKeySecret": {"name": "keys"}}), [h200()]))
    c = container(dep)
    got = tuple(c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert got == probes and all(c[p]["httpGet"]["port"] == "http" for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    env = {e["name"]: e for e in c["env"]}
    assert env[key_env]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}


@pytest.mark.parametrize("kind", KINDS)
def test_router_gets_the_engine_and_its_argparse_accepts_it(kind):
    from warmfleet.server.router.core import runtime
    from warmfleet.server.router.http import main

    items = objs(engine_service(kind), [l4()])
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    rc = container(router)
    args = rc["args"]
    assert flag_value(args, "--engine") == kind
    assert rc["command"] == ["warmfleet"] and rc["image"] == "slim:1"  # the router is ours (the slim image) whatever the engine
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert runtime.settings_from_args(parser.parse_args(args[1:])).engine == kind


def test_engine_image_defaults_for_warmfleet_only():
    items = objs(service(spec={}), [l4()])
    (dep,) = servers(items)
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    assert (container(dep)["image"], container(router)["image"]) == ("engine:1", "slim:1")  # the two default images
    (dep,) = servers(objs(service(spec={"server": {"image": "ours:2"}}), [l4()]))
    assert container(dep)["image"] == "ours:2"
    (dep,) = servers(objs(service(spec={"engine": {"image": "ours:3"}}), [l4()]))
    assert container(dep)["image"] == "ours:3"
    items = objs(engine_service("vllm", server={"image": "ours:2"}), [l4()])
    (dep,) = servers(items)
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    assert (container(dep)["image"], container(router)["image"]) == (VLLM["image"], "ours:2")


@pytest.mark.parametrize("kind", ["vllm", "fastdeploy"])
def test_peer_engine_objects_match_kubernetes_schemas(kind):
    import kubernetes_validate as kv
    for o in objs(engine_service(kind, model={"path": "/m", "pvc": "store"}, router={"apiKeySecret": {"name": "k"}},
                                 server={"gpusPerReplica": 2})):
        kv.validate(o, "1.32", strict=True)


def test_render_command_shows_all_three_engines(tmp_path):
    from warmfleet.cli import main

    ours = yaml.safe_load((REPO / "examples/inferenceservice.yaml").read_text())
    ours["spec"]["engine"] = {"kind": "warmfleet"}  # on GPU pools only by choice (a warning, not an error)
    (tmp_path / "inferenceservice.yaml").write_text(yaml.safe_dump(ours))
    seen = {}
    for example in (tmp_path / "inferenceservice.yaml", REPO / "examples/inferenceservice-vllm.yaml",
                    REPO / "examples/inferenceservice-fastdeploy.yaml"):
        out = io.StringIO()
        with redirect_stdout(out):
            rc = main(["operator", "render", "-f", str(example), "--nodes", str(REPO / "examples/nodes.yaml")])
        assert rc == 0, example
        docs = list(yaml.safe_load_all(out.getvalue()))
        report = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["sizing.json"])
        deps = servers(docs)
        assert deps and sum(d["spec"]["replicas"] for d in deps) == yaml.safe_load(example.read_text())["spec"]["replicas"]
        seen[report["engine"]] = container(deps[0])["command"]
    assert seen == {"warmfleet": ["warmfleet"], "vllm": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                    "fastdeploy": ["python3", "-m", "fastdeploy.entrypoints.openai.api_server"]}


def test_pool_status_names_the_engine():
    from warmfleet.operator.planning.plan import make_plan
    from warmfleet.operator.planning.service_status import healthy_status

    for kind in KINDS:
        body = engine_service(kind)
        spec = parse_spec(body["spec"])
        plan = make_plan(objects.Owner("qwen", "default"), spec, [node_info(h200())], objects.images_for(spec, IMAGES))
        st = healthy_status(plan=plan, generation=1, model="qwen", endpoint="", selector="", ready_by_pool={},
                            router_ready=0, previous={}, now="2026-01-01T00:00:00Z")
        assert [p["engine"] for p in st["pools"]] == [kind]


# ---- what kube-score rightly flagged (.ci/static.sh; docs/security.md) ----

@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("source", [None, "hf://acme/tiny-vl@main"])
def test_every_container_runs_as_the_images_user_with_bounded_ephemeral_storage(kind, source):
    model = {"source": source, "hiddenSize": 1536, "dtype": "bfloat16"} if source else {"path": "/models/qwen"}
    deps = by_kind(objs(engine_service(kind, model=model), [l4()]), "Deployment")
    assert sorted(d["metadata"]["labels"][constants.COMPONENT_LABEL] for d in deps) == ["router", "server"]
    for dep in deps:
        pod = dep["spec"]["template"]["spec"]
        sec = pod["securityContext"]
        # the images' own user (Dockerfile: useradd --uid 10001), above 10000: no node account shares it
        assert (sec["runAsUser"], sec["runAsGroup"], sec["fsGroup"], sec["runAsNonRoot"]) == (10001, 10001, 10001, True)
        disk = [v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"]
        want = sum(parse_quantity(e["sizeLimit"]) for e in disk) + objects.LOG_MIB * 2**20
        containers = pod["containers"] + pod.get("initContainers", [])
        assert len(containers) == (2 if source else 1)
        for c in containers:
            res = c["resources"]
            got = {parse_quantity(res["requests"]["ephemeral-storage"]), parse_quantity(res["limits"]["ephemeral-storage"])}
            assert got == {want}, (dep["metadata"]["name"], c["name"], res)
            assert res["limits"]["memory"] and res["limits"]["cpu"]  # every container is bounded
    server = next(d for d in deps if d["metadata"]["labels"][constants.COMPONENT_LABEL] == "server")
    router = next(d for d in deps if d["metadata"]["labels"][constants.COMPONENT_LABEL] == "router")
    # engines never call the API server; routers do (EndpointSlices), with their own ServiceAccount
    assert server["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "automountServiceAccountToken" not in router["spec"]["template"]["spec"]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "qwen-router"
    tmp = next(v for v in server["spec"]["template"]["spec"]["volumes"] if v["name"] == "tmp")["emptyDir"]
    assert parse_quantity(tmp["sizeLimit"]) == engine_descriptions.ENGINES[kind].tmp_gib * GiB
    # spelled as the API server spells it back (the e2e suite compares live objects with rendered ones)
    assert objects.pod_ephemeral_storage([{"name": "t", "emptyDir": {"sizeLimit": "768Mi"}}]) == {"ephemeral-storage": "1Gi"}
    assert objects.pod_ephemeral_storage([{"name": "t", "emptyDir": {"sizeLimit": "1Gi"}},
                                    {"name": "s", "emptyDir": {"medium": "Memory", "sizeLimit": "5Gi"}}]) == {"ephemeral-storage": "1280Mi"}


def test_rendered_status_of_a_file_has_no_null_generation(capsys):
    """`warmfleet operator render` of an object without metadata.generation (every example): observedGeneration is
    absent, not null (the CRD's status says integer: kubeconform rejected the rendered object)."""
    from warmfleet.cli import main

    assert "generation" not in yaml.safe_load((REPO / "examples/inferenceservice.yaml").read_text())["metadata"]
    assert main(["operator", "render", "-f", str(REPO / "examples/inferenceservice.yaml"),
                 "--nodes", str(REPO / "examples/nodes.yaml")]) == 0
    last = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
    assert last["kind"] == "InferenceService" and last["status"]["conditions"]
    assert "observedGeneration" not in last["status"]
    assert all("observedGeneration" not in c for c in last["status"]["conditions"])
