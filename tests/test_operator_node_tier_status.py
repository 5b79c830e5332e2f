"""The node tier in status and on the network (issue 41): status.pools[].nodeTier shows its DaemonSet's ready and
desired pods and NodeTierReady says when a tier is short of pods (through the DaemonSet watch, against kmock); its
NetworkPolicy admits this service's server pods to 7100 and its routers and pickers to 5560, and nothing else."""

from __future__ import annotations

import pytest

from operator_fixtures.shapes import h200, l4
from test_operator_node_tier import IMAGES, of, planned, svc
from warmfleet.operator.passes.reconcile import render, tier_pods
from warmfleet.operator.planning.node_tier_objects import tier_daemonset_name
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.planning.service_status import healthy_status

NOW = "2026-12-05T07:00:00Z"


def status_of(plan, node_tiers, previous=None):
    return healthy_status(plan=plan, generation=1, model="qwen", endpoint="http://x", selector="s", ready_by_pool={},
                          router_ready=0, previous=previous or {}, now=NOW, node_tiers=node_tiers)


def cond(st: dict, type_: str) -> dict:
    return next((c for c in st["conditions"] if c["type"] == type_), {})


def test_status_shows_each_tiers_ready_pods_and_a_short_tier_is_not_ready():
    plan = planned(svc({"mode": "Auto"}), [h200(), l4()])
    a, b = sorted(p.pool.name for p in plan.pools)
    st = status_of(plan, {a: (2, 2), b: (1, 3)})
    tiers = {p["name"]: p["nodeTier"] for p in st["pools"]}
    assert (tiers[a]["readyPods"], tiers[a]["desiredPods"]) == (2, 2)
    assert (tiers[b]["readyPods"], tiers[b]["desiredPods"]) == (1, 3)
    c = cond(st, "NodeTierReady")
    assert c["status"] == "False" and c["reason"] == "NodeTierNotReady"
    assert f"pool {b}: 1/3 node-tier pods ready" in c["message"] and f"pool {a}" not in c["message"]
    assert cond(st, "Ready")["reason"] != "NodeTierNotReady"  # replicas serve without their tier (they recompute)
    # a DaemonSet its controller has not counted yet (desired 0) is not ready either
    fresh = cond(status_of(plan, {a: (0, 0), b: (3, 3)}), "NodeTierReady")
    assert fresh["status"] == "False" and f"pool {a}: 0/0 node-tier pods ready (none scheduled yet)" in fresh["message"]
    ok = status_of(plan, {a: (2, 2), b: (3, 3)}, previous=st)
    assert cond(ok, "NodeTierReady")["status"] == "True" and cond(ok, "NodeTierReady")["reason"] == "NodeTierPodsReady"
    # the tier turned off: the condition goes, and no pool shows pods
    off = status_of(planned(svc({"mode": "Off"}), [h200(), l4()]), {}, previous=ok)
    assert cond(off, "NodeTierReady") == {} and all("nodeTier" not in p for p in off["pools"])


def test_tier_pods_are_read_from_each_pools_daemonset_as_applied():
    plan = planned(svc({"mode": "Auto"}), [l4()])
    (p,) = plan.pools
    name = tier_daemonset_name("qwen", p.pool.name)
    assert name == f"qwen-node-tier-{p.pool.name}"
    assert name in {d["metadata"]["name"] for d in of(render(svc({"mode": "Auto"}), [node_info(l4())], IMAGES),
                                                      "DaemonSet")}
    live = {("DaemonSet", name): {"status": {"numberReady": 1, "desiredNumberScheduled": 2}}}
    assert tier_pods(plan, live, "qwen") == {p.pool.name: (1, 2)}
    assert tier_pods(plan, {("DaemonSet", name): {}}, "qwen") == {p.pool.name: (0, 0)}  # no status yet
    assert tier_pods(planned(svc(), [l4()]), live, "qwen") == {}


async def test_the_daemonsets_ready_pods_flow_into_status_through_its_watch(cluster):
    from operator_fixtures.cluster import ISVC, condition, eventually, obj, operator, seed, status

    seed(cluster, l4("l1"))
    seed(cluster, svc({"mode": "Auto"}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "NodeTierReady").get("reason") == "NodeTierNotReady",
                         "NodeTierNotReady while the DaemonSet has no ready pod")
        (pool,) = status(cluster)["pools"]
        name = f"qwen-node-tier-{pool['name']}"
        assert obj(cluster, "apps/v1/daemonsets", name) is not None
        await cluster.patch(f"/apis/apps/v1/namespaces/default/daemonsets/{name}",
                            json={"status": {"numberReady": 1, "desiredNumberScheduled": 1}})
        await eventually(lambda: condition(cluster, "NodeTierReady").get("status") == "True", "NodeTierReady=True")
        tier = status(cluster)["pools"][0]["nodeTier"]
        assert (tier["readyPods"], tier["desiredPods"]) == (1, 1)



def test_the_operator_watches_its_daemonsets():
    """Pod events alone may come before the DaemonSet controller counts the pod: its own events reconcile too."""
    from warmfleet.operator.wiring.handlers import make_registry

    watched = {(h.selector.group, h.selector.any_name) for h in
               make_registry(default_image="e:1")._watching.get_all_handlers()}
    assert {("apps", "daemonsets"), ("apps", "deployments"), ("", "pods")} <= watched


def peers_of(rule: dict) -> list[dict]:
    return rule.get("from", [])


@pytest.mark.parametrize("router", [None, {"mode": "gateway", "gateway": {"name": "gw"}}])
def test_the_tiers_ports_admit_only_this_services_servers_and_front_doors(router):
    """7100 only from this service's server pods, 5560 only from its routers and endpoint pickers, both in the
    service's namespace (no namespaceSelector, no ipBlock), and no other rendered policy selects the tier's pods."""
    spec = {"router": router} if router else {}
    objs = render(svc({"mode": "Auto"}, **spec), [node_info(l4())], IMAGES)
    pols = of(objs, "NetworkPolicy")
    (ds,) = of(objs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    (pol,) = [p for p in pols if p["metadata"]["name"] == "qwen-node-tier"]
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    assert all(pod_labels.get(k) == v for k, v in pol["spec"]["podSelector"]["matchLabels"].items())
    rules = {tuple((p["port"], p["protocol"]) for p in r["ports"]): peers_of(r) for r in pol["spec"]["ingress"]}
    assert set(rules) == {((7100, "TCP"),), ((5560, "TCP"),)}  # no rule without ports, no other port
    assert rules[((7100, "TCP"),)] == [{"podSelector": {"matchLabels": {"serving.warmfleet.io/service": "qwen",
                                                                         "app.kubernetes.io/component": "server"}}}]
    assert rules[((5560, "TCP"),)] == [{"podSelector": {"matchExpressions": [
        {"key": "serving.warmfleet.io/service", "operator": "In", "values": ["qwen"]},
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["router", "epp"]}]}}]
    ports = [p["containerPort"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
    assert sorted(ports) == [5560, 7100]  # the policy covers every port the tier listens on
    for other in pols:  # NetworkPolicies add up: none other may select the tier's pods
        if other is pol:
            continue
        sel = other["spec"]["podSelector"]
        matches = all(pod_labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()) and all(
            (pod_labels.get(e["key"]) in e["values"]) == (e["operator"] == "In") for e in sel.get("matchExpressions", []))
        assert not matches, other["metadata"]["name"]
