"""spec.cache.nodeTier (issue 41, operator): per pool a tier sized from the node's allocatable memory after the
replicas' own requests, within min/max or Manual, never above what the node can spare; a DaemonSet per pool
(memory request = limit) placed like the pool's server pods, its node-local and events Services, its NetworkPolicy;
server pods with --node-tier/--node-name and --swap-space 0, routers and pickers with --node-tier-events;
status.pools[].nodeTier; a node change that changes the size rolls it; `mode: Off` renders exactly today's objects."""

from __future__ import annotations

import base64
import copy
import json

import pytest

from operator_fixtures.shapes import GiB, h200, l4, node, service
from warmfleet.operator.passes.reconcile import plan_for, render
from warmfleet.operator.planning import node_tier
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.planning.objects import Images
from warmfleet.operator.planning.service_status import healthy_status
from warmfleet.operator.spec.schema import SpecError

IMAGES = Images(engine="e:1", router="r:1")
TOKEN = {"name": "WARMFLEET_NODE_TIER_TOKEN", "valueFrom": {"secretKeyRef": {"name": "qwen-node-tier", "key": "token"}}}
MiB = 1 << 20


def svc(tier: dict | None = None, **spec) -> dict:
    body = service(spec={"engine": {"kind": "warmfleet"}, "replicas": 2, **spec})
    if tier is not None:
        body["spec"]["cache"] = {**body["spec"].get("cache", {}), "nodeTier": tier}
    return body


def of(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def server_container(dep: dict) -> dict:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def memory_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


def planned(body: dict, nodes: list[dict]):
    return plan_for(body, [node_info(n) for n in nodes], IMAGES)[2]


def test_mode_off_renders_exactly_what_is_rendered_without_the_field():
    for nodes in ([l4()], [h200(), l4()]):
        infos = [node_info(n) for n in nodes]
        today = render(svc(), infos, IMAGES)
        assert render(svc({"mode": "Off"}), infos, IMAGES) == today
        assert not of(today, "DaemonSet")
        assert all("--node-tier" not in server_container(d)["args"] for d in of(today, "Deployment")
                   if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server")


def test_auto_takes_a_share_of_what_the_node_spares_after_its_replicas_and_both_fit_its_memory():
    plan = planned(svc({"mode": "Auto"}), [l4()])
    (p,) = plan.pools
    tier, sizes = p.sizing.node_tier, p.sizing.sizes
    assert sizes.swap_space_gib == 0 and p.sizing.inputs.sources["swapSpace"] == "nodeTier"
    alloc = 192 * GiB
    reserved = int(alloc * 0.1)
    spare = alloc - reserved - sizes.replicas_per_node * sizes.memory_bytes
    assert (tier.allocatable_bytes, tier.reserved_bytes, tier.spare_bytes) == (alloc, reserved, spare)
    assert tier.replicas_per_node == 4 and tier.replica_memory_bytes == sizes.memory_bytes
    largest = int((spare - node_tier.NODE_TIER_BASE_BYTES) / 1.1 / GiB * 4) / 4  # floored to 0.25 GiB
    assert tier.source == "auto" and tier.size_gib == int(0.9 * largest * 4) / 4
    assert tier.capacity_bytes == int(tier.size_gib * GiB)
    assert tier.memory_bytes >= tier.capacity_bytes * 1.1 + node_tier.NODE_TIER_BASE_BYTES
    assert tier.memory_bytes <= spare
    # the node holds its replicas and its tier, with the reserve left over
    assert sizes.replicas_per_node * sizes.memory_bytes + tier.memory_bytes <= alloc - reserved


def test_the_tier_takes_the_place_of_the_replicas_swap_tier():
    off, on = planned(svc(), [l4()]).pools[0], planned(svc({"mode": "Auto"}), [l4()]).pools[0]
    assert off.sizing.sizes.swap_space_gib > 0 and on.sizing.sizes.swap_space_gib == 0
    assert on.sizing.sizes.memory_bytes < off.sizing.sizes.memory_bytes  # the swap tier left each replica's request
    assert on.sizing.node_tier.capacity_bytes > off.sizing.sizes.swap_space_gib * GiB  # shared, at least one replica's


@pytest.mark.parametrize("tier,source,size_gib", [
    ({"mode": "Auto", "max": 8}, "max", 8.0),
    ({"mode": "Auto", "min": 4000}, "spare", None),  # a bound above what the node spares is lowered to it
    ({"mode": "Manual", "size": 12.5}, "manual", 12.5),
    ({"mode": "Manual", "size": 4000}, "spare", None),
])
def test_bounds_and_manual_sizes_never_exceed_what_the_node_spares(tier, source, size_gib):
    t = planned(svc(tier), [l4()]).pools[0].sizing.node_tier
    assert t.source == source
    largest = int((t.spare_bytes - node_tier.NODE_TIER_BASE_BYTES) / 1.1 / GiB * 4) / 4
    assert t.size_gib == (size_gib if size_gib is not None else largest)
    assert t.memory_bytes <= t.spare_bytes


def test_a_pool_whose_nodes_spare_nothing_keeps_its_swap_tier_and_status_says_why():
    small = node("l4-small", product="NVIDIA-L4", gpu_mib=23034, gpus=4, memory=44 * GiB)  # 4 replicas fit, barely
    body = svc({"mode": "Auto"}, server={"engineMemoryGib": 8})
    plan = planned(body, [small])
    (p,) = plan.pools
    assert p.sizing.fits and p.sizing.node_tier.capacity_bytes == 0
    assert "too little for a node tier" in p.sizing.node_tier.message
    assert p.sizing.inputs.sources.get("swapSpace") != "nodeTier"
    assert not of(plan.children, "DaemonSet")
    assert all("--node-tier" not in server_container(d)["args"] for d in of(plan.children, "Deployment")
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server")


def test_another_engine_gets_no_tier_and_status_says_it_has_no_client():
    body = svc({"mode": "Auto"}, engine={"kind": "vllm", "image": "vllm:1"})
    (p,) = planned(body, [l4()]).pools
    assert p.sizing.node_tier.capacity_bytes == 0 and "no node-tier client" in p.sizing.node_tier.message
    assert not of(render(body, [node_info(l4())], IMAGES), "DaemonSet")


def test_a_daemonset_per_pool_placed_like_its_server_pods_memory_requested_and_limited_and_hardened():
    objs = render(svc({"mode": "Auto"}), [node_info(h200()), node_info(l4())], IMAGES)
    servers = {d["metadata"]["labels"]["serving.warmfleet.io/pool"]: d for d in of(objs, "Deployment")
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"}
    sets = {d["metadata"]["labels"]["serving.warmfleet.io/pool"]: d for d in of(objs, "DaemonSet")}
    assert set(sets) == set(servers) and len(sets) == 2
    assert min(objs.index(d) for d in sets.values()) < min(objs.index(d) for d in servers.values())
    plan = planned(svc({"mode": "Auto"}), [h200(), l4()])
    for p in plan.pools:
        ds, server_pod = sets[p.pool.name], servers[p.pool.name]["spec"]["template"]["spec"]
        pod = ds["spec"]["template"]["spec"]
        for key in ("affinity", "tolerations"):
            assert pod[key] == server_pod[key], key
        (c,) = pod["containers"]
        res = c["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"]
        assert memory_bytes(res["limits"]["memory"]) == p.sizing.node_tier.memory_bytes
        assert c["args"] == ["node-tier", "--capacity-bytes", str(p.sizing.node_tier.capacity_bytes), "--port", "7100",
                             "--events-port", "5560", "--node-name", "$(NODE_NAME)"]
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
        assert TOKEN in c["env"]  # connections without the token are closed
        assert c["image"] == "r:1" and c["command"] == ["warmfleet"]
        # baseline (and restricted) Pod Security: no host namespaces, paths or ports, non-root, nothing escalates
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        assert c["securityContext"]["allowPrivilegeEscalation"] is False and c["securityContext"]["readOnlyRootFilesystem"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        text = json.dumps(pod)
        assert "hostPath" not in text and "hostPort" not in text and "hostNetwork" not in text
        assert ds["spec"]["template"]["metadata"]["annotations"]["serving.warmfleet.io/sizing-hash"] == p.sizing.node_tier.hash
        assert ds["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"


def test_servers_routers_and_pickers_are_pointed_at_the_tier_through_its_services():
    objs = render(svc({"mode": "Auto"}), [node_info(l4())], IMAGES)
    tier_svc, events = (next(s for s in of(objs, "Service") if s["metadata"]["name"] == n)
                        for n in ("qwen-node-tier", "qwen-node-tier-events"))
    assert tier_svc["spec"]["internalTrafficPolicy"] == "Local" and tier_svc["spec"]["ports"][0]["port"] == 7100
    assert events["spec"]["clusterIP"] == "None" and events["spec"]["ports"][0]["port"] == 5560
    # the API server omits a Service's false and empty fields (omitempty): one rendered would never match the live
    # object, and the operator re-applied the Service on every reconcile
    for s in of(objs, "Service"):
        assert not [k for k, v in s["spec"].items() if v is False or v == ""], s["metadata"]["name"]
    assert tier_svc["spec"]["selector"] == events["spec"]["selector"] == {
        "serving.warmfleet.io/service": "qwen", "app.kubernetes.io/component": "node-tier"}
    deps = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in of(objs, "Deployment")}
    server = server_container(deps["server"])
    assert flag(server["args"], "--node-tier") == "qwen-node-tier:7100"
    assert flag(server["args"], "--node-name") == "$(NODE_NAME)" and flag(server["args"], "--swap-space") in ("0", "0.0")
    assert server["env"][0] == {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert TOKEN in server["env"]  # the replicas' node-tier client sends it
    router = deps["router"]["spec"]["template"]["spec"]["containers"][0]
    assert flag(router["args"], "--node-tier-events") == "qwen-node-tier-events:5560"
    (pol,) = [p for p in of(objs, "NetworkPolicy") if p["metadata"]["name"] == "qwen-node-tier"]
    assert pol["spec"]["podSelector"]["matchLabels"] == tier_svc["spec"]["selector"]
    tier_rule, events_rule = pol["spec"]["ingress"]
    assert tier_rule["ports"] == [{"port": 7100, "protocol": "TCP"}]
    assert tier_rule["from"][0]["podSelector"]["matchLabels"] == {"serving.warmfleet.io/service": "qwen",
                                                                  "app.kubernetes.io/component": "server"}
    assert events_rule["ports"] == [{"port": 5560, "protocol": "TCP"}]
    assert events_rule["from"][0]["podSelector"]["matchExpressions"] == [
        {"key": "serving.warmfleet.io/service", "operator": "In", "values": ["qwen"]},
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["router", "epp"]}]
    # gateway mode: the endpoint picker follows the tiers' events
    gw = render(svc({"mode": "Auto"}, router={"mode": "gateway", "gateway": {"name": "gw"}}), [node_info(l4())], IMAGES)
    epp = next(d for d in of(gw, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "epp")
    assert flag(epp["spec"]["template"]["spec"]["containers"][0]["args"], "--node-tier-events") == "qwen-node-tier-events:5560"


def test_status_pools_show_the_tier_and_its_inputs():
    plan = planned(svc({"mode": "Auto", "max": 16}), [l4()])
    st = healthy_status(plan=plan, generation=1, model="qwen", endpoint="http://x", selector="s", ready_by_pool={},
                        router_ready=0, previous={}, now="2026-12-05T07:00:00Z")
    (pool,) = st["pools"]
    t = pool["nodeTier"]
    assert t["sizeGib"] == 16 and t["source"] == "max" and t["capacityBytes"] == 16 * GiB
    assert {"allocatableBytes", "reservedBytes", "replicasPerNode", "replicaMemoryBytes", "spareBytes", "memoryBytes",
            "hash"} <= set(t)
    assert "nodeTier" not in healthy_status(plan=planned(svc(), [l4()]), generation=1, model="qwen", endpoint="x",
                                            selector="s", ready_by_pool={}, router_ready=0, previous={},
                                            now="2026-12-05T07:00:00Z")["pools"][0]


def test_a_node_change_that_changes_the_size_rolls_the_tier_and_one_that_does_not_leaves_it():
    def tier_set(memory: int) -> dict:
        (ds,) = of(render(svc({"mode": "Auto"}), [node_info(l4(memory=memory))], IMAGES), "DaemonSet")
        return ds

    before, same, bigger = tier_set(192 * GiB), tier_set(192 * GiB), tier_set(256 * GiB)
    assert same == before
    key = "serving.warmfleet.io/sizing-hash"
    assert bigger["spec"]["template"]["metadata"]["annotations"][key] != before["spec"]["template"]["metadata"]["annotations"][key]
    assert bigger["spec"]["template"]["spec"]["containers"][0]["args"] != before["spec"]["template"]["spec"]["containers"][0]["args"]
    assert bigger["metadata"]["name"] == before["metadata"]["name"]  # the same DaemonSet, rolled (not a new one)


@pytest.mark.parametrize("tier,path", [({"mode": "Manual"}, "size is required"), ({"mode": "Auto", "min": 8, "max": 4},
                                                                                  "min must be <= max")])
def test_an_incomplete_node_tier_spec_is_refused_with_a_readable_error(tier, path):
    with pytest.raises(SpecError, match=path):
        planned(svc(tier), [l4()])


def test_render_command_prints_the_tier_and_its_status(tmp_path, capsys):
    import argparse

    import yaml

    from warmfleet.operator.wiring.command import render_cmd

    (tmp_path / "svc.yaml").write_text(yaml.safe_dump(svc({"mode": "Auto"})))
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump({"kind": "List", "items": [l4()]}))
    args = argparse.Namespace(filename=str(tmp_path / "svc.yaml"), nodes=str(tmp_path / "nodes.yaml"),
                              default_image="e:1", router_image="r:1", output="yaml", strict=False)
    assert render_cmd(args) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in docs].count("DaemonSet") == 1
    assert docs[-1]["status"]["pools"][0]["nodeTier"]["capacityBytes"] > 0


def test_the_node_tier_spec_is_in_the_crd():
    from warmfleet.operator.spec.crd import crd

    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    tier = schema["properties"]["spec"]["properties"]["cache"]["properties"]["nodeTier"]
    assert tier["properties"]["mode"]["enum"] == ["Off", "Auto", "Manual"]
    assert tier["properties"]["mode"]["default"] == "Off"
    assert {r["message"] for r in tier["x-kubernetes-validations"]} == {"size is required when mode is Manual",
                                                                         "min must be <= max"}
    pools = schema["properties"]["status"]["properties"]["pools"]["items"]["properties"]
    assert "sizeGib" in pools["nodeTier"]["properties"]
    assert copy.deepcopy(tier) == tier


def test_render_warns_when_a_pool_gets_no_tier_or_a_smaller_one():
    from warmfleet.operator.wiring.command import render_warnings

    small = node("l4-small", product="NVIDIA-L4", gpu_mib=23034, gpus=4, memory=44 * GiB)
    (w,) = [w for w in render_warnings(planned(svc({"mode": "Auto"}, server={"engineMemoryGib": 8}), [small]))
            if "node tier" in w]
    assert "no node tier: " in w and "too little for a node tier" in w
    assert any("node tier lowered to the" in w for w in render_warnings(planned(svc({"mode": "Manual", "size": 4000}), [l4()])))
    assert not [w for w in render_warnings(planned(svc({"mode": "Auto"}), [l4()])) if "node tier" in w]


def test_the_flags_parse_with_each_processs_own_parser():
    """Server, router and picker args as their own argparse and settings read them (contract 3, and the routers')."""
    import argparse

    from warmfleet.server import config as server_config
    from warmfleet.server import flagfields
    from warmfleet.server.router.core import runtime
    from warmfleet.server.router.epp.settings import EppSettings
    from warmfleet.server.router.http import main

    objs = render(svc({"mode": "Auto"}), [node_info(l4())], IMAGES)
    deps = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in of(objs, "Deployment")}
    args = server_container(deps["server"])["args"]
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    cfg = server_config.from_namespace(parser.parse_args(args[1:]))
    assert cfg.cache.node_tier == "qwen-node-tier:7100" and cfg.cache.swap_space == 0
    assert cfg.server.node_name == "$(NODE_NAME)"  # the kubelet expands it from the env before the process starts
    router_args = deps["router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert runtime.settings_from_args(parser.parse_args(router_args[1:])).node_tier_events == ["qwen-node-tier-events:5560"]
    gw = render(svc({"mode": "Auto"}, router={"mode": "gateway", "gateway": {"name": "gw"}}), [node_info(l4())], IMAGES)
    epp = next(d for d in of(gw, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "epp")
    parser = argparse.ArgumentParser()
    flagfields.add_arguments(parser, EppSettings)
    got = flagfields.from_namespace(parser.parse_args(epp["spec"]["template"]["spec"]["containers"][0]["args"][1:]), EppSettings)
    assert got.node_tier_events == ["qwen-node-tier-events:5560"]


async def test_the_operator_applies_the_tier_and_prunes_it_when_turned_off(cluster):
    """In-process operator against kmock: the DaemonSet and Services applied with the rest, status shows the tier,
    `mode: Off` prunes them and gives the replicas their swap tier back."""
    from operator_fixtures.cluster import ISVC, eventually, obj, operator, seed, server_deployments, status

    seed(cluster, l4("l1"))
    seed(cluster, svc({"mode": "Auto"}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: (status(cluster).get("pools") or [{}])[0].get("nodeTier"), "status with the node tier")
        (pool,) = status(cluster)["pools"]
        ds = obj(cluster, "apps/v1/daemonsets", f"qwen-node-tier-{pool['name']}")
        assert ds is not None and ds["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"
        assert obj(cluster, "v1/services", "qwen-node-tier") and obj(cluster, "v1/services", "qwen-node-tier-events")
        (dep,) = server_deployments(cluster).values()
        assert "--node-tier" in server_container(dep)["args"]
        secret = obj(cluster, "v1/secrets", "qwen-node-tier")  # the token, generated once, owned by the service
        assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"
        token = secret["data"]["token"]
        assert len(base64.b64decode(token)) >= 32
        await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                            json={"metadata": {"generation": 2}, "spec": {"cache": {"nodeTier": {"mode": "Off"}}}})
        await eventually(lambda: status(cluster).get("observedGeneration") == 2, "generation 2 observed")
        await eventually(lambda: obj(cluster, "apps/v1/daemonsets", f"qwen-node-tier-{pool['name']}") is None,
                         "the DaemonSet pruned")
        assert obj(cluster, "v1/services", "qwen-node-tier") is None
        assert "nodeTier" not in status(cluster)["pools"][0] and status(cluster)["pools"][0]["sizes"]["swapSpaceGib"] > 0
        (dep,) = server_deployments(cluster).values()
        assert "--node-tier" not in server_container(dep)["args"]
        assert obj(cluster, "v1/secrets", "qwen-node-tier")["data"]["token"] == token  # never rewritten


@pytest.mark.parametrize("engine, flags", [
    ({"kind": "vllm", "image": "vllm:1"}, ["--kv-offloading-size", "--kv-offloading-backend"]),
    ({"kind": "fastdeploy", "image": "fd:1"}, ["--swap-space"]),
])
def test_a_vllm_or_fastdeploy_pool_keeps_its_per_replica_cpu_tier_and_status_and_render_say_so(engine, flags):
    from warmfleet.operator.wiring.command import render_warnings

    body = svc({"mode": "Auto"}, engine=engine)
    plan = planned(body, [l4()])
    (p,) = plan.pools
    message = p.sizing.node_tier.message
    assert p.sizing.node_tier.capacity_bytes == 0 and "keep their own CPU tier" in message
    assert all(f in message for f in flags)
    assert ("LMCache" in message) == (engine["kind"] == "vllm")  # what vLLM pools lack yet, named
    assert f"pool {p.pool.name}: no node tier: {message}" in render_warnings(plan)
    (server,) = [d for d in of(render(body, [node_info(l4())], IMAGES), "Deployment")
                 if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"]
    args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    assert all(f in args for f in flags)  # the tier the message names is the one rendered


def test_with_kv_events_curve_the_tier_publishes_with_the_replicas_key_pair_and_off_renders_as_before():
    """spec.router.kvEventsCurve: the tier's DaemonSet mounts the server pods' half of NAME-kv-curve and takes the
    replicas' flags (parsed by `warmfleet node-tier`'s own parser), so the routers' one server key covers it; without
    kvEventsCurve the DaemonSet is what it was."""
    import argparse

    from warmfleet.server.nodetier import server as node_server

    def tier_and_server(body: dict) -> tuple[dict, dict]:
        objs = render(body, [node_info(l4())], IMAGES)
        (ds,) = of(objs, "DaemonSet")
        (dep,) = [d for d in of(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"]
        return ds["spec"]["template"]["spec"], dep["spec"]["template"]["spec"]

    pod, server_pod = tier_and_server(svc({"mode": "Auto"}, router={"kvEventsCurve": True}))
    (c,) = pod["containers"]
    parser = argparse.ArgumentParser()
    node_server.add_arguments(parser)
    got = parser.parse_args(c["args"][1:])
    assert got.kv_events_curve_secret_key == "/etc/warmfleet/kv-curve/replica.key_secret"
    assert got.kv_events_curve_clients == "/etc/warmfleet/kv-curve/clients"
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-curve")
    assert volume == next(v for v in server_pod["volumes"] if v["name"] == "kv-curve")  # the same Secret, same items
    assert volume["secret"]["secretName"] == "qwen-kv-curve"
    assert {i["path"] for i in volume["secret"]["items"]} == {"replica.key_secret", "clients/router.key"}  # no router secret
    assert {"name": "kv-curve", "mountPath": "/etc/warmfleet/kv-curve", "readOnly": True} in c["volumeMounts"]
    server_args = server_container({"spec": {"template": {"spec": server_pod}}})["args"]
    assert flag(server_args, "--kv-events-curve-secret-key") == got.kv_events_curve_secret_key
    plain, _ = tier_and_server(svc({"mode": "Auto"}))
    assert "kv-curve" not in json.dumps(plain) and plain["containers"][0]["args"][-2:] == ["--node-name", "$(NODE_NAME)"]
