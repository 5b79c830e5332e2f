"""Pure manifest builders and offline render: contract 3 args, probes, sizing-hash rollouts, RBAC, schemas."""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout
from pathlib import Path

import yaml

from operator_fixtures.shapes import GiB, TiB, a100, h200, l4, node, service
from warmfleet.operator import manifests as m
from warmfleet.operator.nodes import node_info, parse_quantity
from warmfleet.operator.reconcile import render
from warmfleet.server import config as server_config

REPO = Path(__file__).resolve().parents[1]
NODES = [h200("h200-a"), h200("h200-b"), a100("a100-a"), l4("l4-a"), node("cpu-a")]


def objs(body=None, nodes=NODES):
    return render(body or service(spec={"replicas": 12}), [node_info(n) for n in nodes], "img:1")


def by_kind(items, kind):
    return [o for o in items if o["kind"] == kind]


def servers(items):
    return [d for d in by_kind(items, "Deployment") if d["metadata"]["labels"][m.COMPONENT_LABEL] == "server"]


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
    assert kinds.count("Deployment") == 4  # three GPU pools + router; the CPU pool gets none
    for kind in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"):
        assert kinds.count(kind) == 1
    assert kinds.count("Service") == 2
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
        pool = next(p for p in report["pools"] if p["name"] == dep["metadata"]["labels"][m.POOL_LABEL])
        assert cfg.cache.swap_space == pool["sizes"]["swapSpaceGib"]
        assert cfg.cache.max_encoder_cache == pool["sizes"]["encoderCacheTokens"]
        assert cfg.cache.max_processor_cache == pool["sizes"]["processorCacheGib"]
        assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching) == (128, False)
        assert cfg.scheduler.max_num_seqs == 32
        assert (cfg.model.model, cfg.model.served_model_name) == ("/models/qwen", "qwen")
        assert (cfg.server.host, cfg.server.port, cfg.server.kv_events_port) == ("0.0.0.0", m.HTTP_PORT, m.KV_EVENTS_PORT)
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
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": m.HTTP_PORT, "kv-events": m.KV_EVENTS_PORT}
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
    replicas = {d["metadata"]["labels"][m.POOL_LABEL].split("-")[0]: d["spec"]["replicas"] for d in servers(items)}
    assert replicas == {"a100": 3, "h200": 7, "l4": 2}
    (pdb,) = by_kind(items, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == m.server_selector(m.Owner("qwen", "default"))


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
            assert tpl["metadata"]["annotations"][m.SIZING_HASH_ANNOTATION] != before[name]["metadata"]["annotations"][m.SIZING_HASH_ANNOTATION]


def test_headless_service_router_and_rbac():
    items = objs(service(spec={"router": {"replicas": 3, "apiKeySecret": {"name": "keys"}, "serviceType": "LoadBalancer"}}))
    svcs = {s["metadata"]["name"]: s for s in by_kind(items, "Service")}
    headless = svcs["qwen-replicas"]
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in headless["spec"]["ports"]} == {"http", "kv-events"}
    assert svcs["qwen"]["spec"]["type"] == "LoadBalancer"
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    rc = container(router)
    assert rc["command"] == ["warmfleet"] and rc["args"][0] == "route"
    assert rc["args"][rc["args"].index("--discover-service") + 1] == "default/qwen-replicas"
    assert rc["args"][rc["args"].index("--model") + 1] == "/models/qwen"
    assert rc["args"][rc["args"].index("--host") + 1] == "0.0.0.0"
    assert router["spec"]["replicas"] == 3
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "qwen-router"
    env = {e["name"]: e for e in rc["env"]}
    assert env["WARMFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    (role,) = by_kind(items, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    (binding,) = by_kind(items, "RoleBinding")
    assert binding["subjects"][0]["name"] == "qwen-router" and binding["roleRef"]["name"] == "qwen-router"


def test_router_args_parse_with_the_routers_own_argparse():
    from warmfleet.server.router import main

    items = objs(service(spec={"router": {"loadBound": 1.5}, "cache": {"blockSize": 32}}), [l4()])
    router = next(d for d in by_kind(items, "Deployment") if d["metadata"]["name"] == "qwen-router")
    args = container(router)["args"]
    assert args[0] == "route"
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    ns = parser.parse_args(args[1:])
    assert (ns.discover_service, ns.host, ns.port, ns.model) == ("default/qwen-replicas", "0.0.0.0", m.HTTP_PORT, "/models/qwen")
    assert ns.balance_epsilon == 0.5
    assert vars(ns)[next(k for k in vars(ns) if k.endswith("block_size"))] == 32


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


def test_render_command_prints_the_example(tmp_path):
    from warmfleet.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["operator", "render", "-f", str(REPO / "examples/inferenceservice.yaml"), "--nodes", str(REPO / "examples/nodes.yaml")])
    assert rc == 0
    docs = list(yaml.safe_load_all(out.getvalue()))
    assert "*id" not in out.getvalue()  # no YAML aliases
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Deployment")
    assert len(names) == 4 and "qwen-vl-router" in names
    assert sum(d["spec"]["replicas"] for d in servers(docs)) == 12


def test_render_reports_a_bad_spec(tmp_path, capsys):
    from warmfleet.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(service(spec={"replicas": 2, "autoscaling": {"maxReplicas": 4}})))
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump(h200()))
    assert main(["operator", "render", "-f", str(bad), "--nodes", str(nodes)]) == 2
    assert "mutually exclusive" in capsys.readouterr().err
