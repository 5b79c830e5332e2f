"""Pools leave out nodes whose taints the server pods do not tolerate (Kubernetes' toleration matching), and say so:
TaintsTolerated, a Warning Event, `warmfleet operator render`; in-process against kmock as well."""

from __future__ import annotations

import pytest
import yaml

from operator_fixtures.cluster import ISVC, condition, eventually, operator, seed, server_deployments, status
from operator_fixtures.shapes import GiB, h200, l4, node, service
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import derive_pools, node_info, untolerated_nodes
from warmfleet.operator.planning.service_status import healthy_status, warnings
from warmfleet.operator.planning.taints import Taint, is_system, taints_of, tolerates, untolerated
from warmfleet.operator.spec.inference_service import parse_spec

IMAGES = objects.Images(engine="engine:1", router="slim:1")
DEDICATED = {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}
TOLERATE_DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
VLLM = {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"}
T = Taint("dedicated", "inference", "NoSchedule")

# ---- Kubernetes' ToleratesTaint, case by case ----

@pytest.mark.parametrize("toleration, taint, expected", [
    ({"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}, T, True),
    ({"key": "dedicated", "value": "inference"}, T, True),  # operator defaults to Equal, no effect matches every effect
    ({"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}, T, False),
    ({"key": "dedicated", "operator": "Equal", "effect": "NoSchedule"}, T, False),  # Equal with no value: only ""
    ({"key": "gpu", "operator": "Equal", "effect": "NoSchedule"}, Taint("gpu", "", "NoSchedule"), True),
    ({"key": "dedicated", "operator": "Exists"}, T, True),
    ({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}, T, False),  # another effect
    ({"key": "other", "operator": "Exists"}, T, False),  # another key
    ({"operator": "Exists"}, T, True),  # no key with Exists: every taint
    ({"operator": "Exists", "effect": "NoExecute"}, T, False),
    ({"operator": "Exists", "effect": "NoExecute"}, Taint("x", "y", "NoExecute"), True),
    ({"key": "dedicated", "operator": "Gt", "value": "1"}, T, False),  # an operator it does not know tolerates nothing
])
def test_toleration_matching_follows_kubernetes(toleration, taint, expected):
    assert tolerates(toleration, taint) is expected


def test_only_noschedule_and_noexecute_taints_keep_pods_off():
    taints = (Taint("a", "", "PreferNoSchedule"), Taint("b", "1", "NoSchedule"), Taint("c", "", "NoExecute"))
    assert untolerated(taints, []) == taints[1:]
    assert untolerated(taints, [{"key": "b", "operator": "Exists"}]) == (taints[2],)
    assert untolerated(taints, [{"operator": "Exists"}]) == ()


def test_taints_are_read_from_the_node_and_printed_as_kubectl_writes_them():
    body = node("n", taints=[DEDICATED, {"key": "gpu", "effect": "NoExecute"}])
    assert taints_of(body) == (T, Taint("gpu", "", "NoExecute"))
    assert node_info(body).taints == taints_of(body)
    assert [str(t) for t in taints_of(body)] == ["dedicated=inference:NoSchedule", "gpu:NoExecute"]
    assert taints_of(node("bare")) == ()


def test_the_clusters_own_taints_are_system_taints():
    for key in ("node.kubernetes.io/unschedulable", "node.kubernetes.io/memory-pressure",
                "node-role.kubernetes.io/control-plane", "ToBeDeletedByClusterAutoscaler", "karpenter.sh/disrupted",
                "node.cloudprovider.kubernetes.io/uninitialized"):
        assert is_system(Taint(key, "", "NoSchedule")), key
    assert not is_system(T) and not is_system(Taint("nvidia.com/gpu", "", "NoSchedule"))


# ---- pool formation ----

def pools_and_untolerated(nodes, **spec):
    parsed = parse_spec({"model": {"path": "/m"}, **spec})
    infos = [node_info(n) for n in nodes]
    return derive_pools(parsed, infos), untolerated_nodes(parsed, infos)


def test_an_untolerated_taint_leaves_the_node_out_and_a_toleration_brings_it_back():
    nodes = [h200("h1", taints=[DEDICATED]), h200("h2")]
    pools, out = pools_and_untolerated(nodes, engine=VLLM)
    assert [p.nodes for p in pools] == [("h2",)]
    assert [(u.node, u.pool, u.taints) for u in out] == [("h1", pools[0].name, (T,))]
    pools, out = pools_and_untolerated(nodes, engine=VLLM, server={"pod": {"tolerations": [TOLERATE_DEDICATED]}})
    assert [p.nodes for p in pools] == [("h1", "h2")] and out == []


def test_the_operators_gpu_toleration_counts_for_gpu_replicas_only():
    gpu_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}  # GKE's own on GPU nodes
    pools, out = pools_and_untolerated([h200("h1", taints=[gpu_taint])], engine=VLLM)
    assert [p.nodes for p in pools] == [("h1",)] and out == []
    # CPU-only replicas (warmfleet's engine, gpusPerReplica 0) take no GPU and tolerate no GPU taint
    pools, out = pools_and_untolerated([h200("h1", taints=[gpu_taint])], engine={"kind": "warmfleet"},
                                       server={"gpusPerReplica": 0})
    assert pools == [] and [str(t) for u in out for t in u.taints] == ["nvidia.com/gpu=present:NoSchedule"]
    # a NoExecute GPU taint is not the operator's to tolerate (its toleration is NoSchedule)
    pools, out = pools_and_untolerated([h200("h1", taints=[{**gpu_taint, "effect": "NoExecute"}])], engine=VLLM)
    assert pools == [] and len(out) == 1


def test_prefer_no_schedule_is_ignored_and_cordoned_or_system_tainted_nodes_are_left_out_silently():
    nodes = [h200("soft", taints=[{**DEDICATED, "effect": "PreferNoSchedule"}]), h200("cordoned", cordoned=True),
             h200("pressure", taints=[{"key": "node.kubernetes.io/memory-pressure", "effect": "NoSchedule"}]),
             h200("cp", taints=[{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}, DEDICATED])]
    pools, out = pools_and_untolerated(nodes, engine=VLLM)
    assert [p.nodes for p in pools] == [("soft",)] and out == []


def test_auto_still_picks_vllm_beside_gpu_nodes_it_does_not_tolerate_yet():
    body = service(spec={"replicas": 1})
    body["spec"].pop("engine")
    _, spec, plan = plan_for(body, [node_info(h200("h1", taints=[DEDICATED])), node_info(node("cpu", memory=256 * GiB))],
                             IMAGES)
    assert spec.engine.kind == "vllm"  # not warmfleet's CPU engine on the system node because of a forgotten toleration
    assert [u.node for u in plan.untolerated] == ["h1"]


# ---- status, Events and render ----

def planned(nodes, **spec):
    _, _, plan = plan_for(service(spec={"replicas": 2, "engine": VLLM, **spec}), [node_info(n) for n in nodes], IMAGES)
    return plan, healthy_status(plan=plan, generation=1, model="qwen", endpoint="", selector="", ready_by_pool={},
                                router_ready=0, previous={}, now="2026-01-01T00:00:00Z")


def cond(status_, type_):
    return next(c for c in status_["conditions"] if c["type"] == type_)


def test_a_pool_lost_to_a_taint_is_reported_not_sized():
    plan, st = planned([h200("h1", taints=[DEDICATED]), h200("h2", taints=[DEDICATED]), l4("l1")])
    assert [p["nodes"] for p in st["pools"]] == [["l1"]]  # the H200 pool is not sized: no replica waits Pending there
    c = cond(st, "TaintsTolerated")
    assert (c["status"], c["reason"]) == ("False", "UntoleratedTaints")
    h200_pool = plan.untolerated[0].pool
    assert f"pool {h200_pool}: 2 nodes (h1, h2) tainted dedicated=inference:NoSchedule" in c["message"]
    assert "it hosts no replica" in c["message"] and "spec.server.pod.tolerations" in c["message"]
    assert ("UntoleratedTaints", c["message"]) in warnings({}, st)
    assert ("UntoleratedTaints", c["message"]) not in warnings(st, st)  # once, not on every reconcile
    # a pool that keeps other nodes is not called lost
    _, st = planned([h200("h1", taints=[DEDICATED]), h200("h2")])
    assert "hosts no replica" not in cond(st, "TaintsTolerated")["message"]


def test_every_node_tainted_is_no_matching_nodes_pointing_at_the_taints():
    _, st = planned([h200("h1", taints=[DEDICATED])])
    assert st["pools"] == [] and cond(st, "Ready")["reason"] == "NoMatchingNodes"
    assert "TaintsTolerated" in cond(st, "Degraded")["message"]
    _, st = planned([h200("h1", taints=[DEDICATED])], server={"pod": {"tolerations": [TOLERATE_DEDICATED]}})
    assert [p["nodes"] for p in st["pools"]] == [["h1"]]
    assert (cond(st, "TaintsTolerated")["status"], cond(st, "TaintsTolerated")["reason"]) == ("True", "AllTaintsTolerated")


def test_render_warns_of_untolerated_taints(tmp_path, capsys):
    from warmfleet.cli import main

    nodes, f = tmp_path / "nodes.yaml", tmp_path / "svc.yaml"
    nodes.write_text(yaml.safe_dump_all([h200("h1", taints=[DEDICATED]), l4("l1")]))
    f.write_text(yaml.safe_dump(service(spec={"engine": VLLM})))
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes), "--strict"]) == 1
    assert "h1) tainted dedicated=inference:NoSchedule" in capsys.readouterr().err


# ---- the operator in-process: a taint appears, the toleration is added ----

def events(cluster, reason):
    return [o.raw for (r, _, _), o in cluster.objects.items()
            if r.plural == "events" and not o.deleted and o.raw.get("reason") == reason]


async def test_a_node_tainted_leaves_the_pool_with_an_event_and_a_toleration_brings_it_back(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 2, "engine": VLLM}), res=ISVC)
    url = f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen"
    async with operator(cluster):
        await eventually(lambda: len(server_deployments(cluster)) == 2, "two pools")
        await eventually(lambda: condition(cluster, "TaintsTolerated").get("reason") == "AllTaintsTolerated",
                         "TaintsTolerated True")
        # kubectl taint nodes h1 dedicated=inference:NoSchedule: the node event alone re-plans the service
        await cluster.patch("/api/v1/nodes/h1", json={"spec": {"taints": [DEDICATED]}})
        await eventually(lambda: len(server_deployments(cluster)) == 1, "the H200 pool pruned")
        assert "l4" in next(iter(server_deployments(cluster)))
        c = await eventually(lambda: condition(cluster, "TaintsTolerated").get("status") == "False"
                             and condition(cluster, "TaintsTolerated"), "TaintsTolerated False")
        assert "(h1) tainted dedicated=inference:NoSchedule" in c["message"]
        (event,) = await eventually(lambda: events(cluster, "UntoleratedTaints"), "an UntoleratedTaints Event")
        assert event["type"] == "Warning" and "dedicated=inference:NoSchedule" in event["message"]
        # the toleration in spec.server.pod: the H200 pool is back, with the toleration on its pods
        await cluster.patch(url, json={"metadata": {"generation": 2},
                                       "spec": {"server": {"pod": {"tolerations": [TOLERATE_DEDICATED]}}}})
        await eventually(lambda: len(server_deployments(cluster)) == 2, "the H200 pool back")
        await eventually(lambda: condition(cluster, "TaintsTolerated").get("status") == "True", "TaintsTolerated True")
        h200_dep = next(d for n, d in server_deployments(cluster).items() if "h200" in n)
        assert TOLERATE_DEDICATED in h200_dep["spec"]["template"]["spec"]["tolerations"]
        assert [p["nodes"] for p in status(cluster)["pools"] if "h200" in p["name"]] == [["h1"]]
