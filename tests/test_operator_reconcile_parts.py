"""The steps of reconcile._reconcile, each on its own: report an invalid spec, apply and prune, read readiness,
post the Warnings a new status raises (against an in-memory API, no cluster)."""

from __future__ import annotations

from typing import Any

from operator_fixtures.memory import MemoryKube
from operator_fixtures.shapes import h200, service
from warmfleet.operator.passes.reconcile import (
    OperatorState,
    _apply_and_prune,
    _post_new_warnings,
    _report_invalid_spec,
    owned,
    plan_for,
    ready_replicas,
)
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec import constants

IMAGES = objects.Images(engine="engine:1", router="slim:1")


class Events(list):
    def __call__(self, body, type_, reason, message):
        self.append((type_, reason, message))


def stale_pool(body: dict[str, Any], name: str, owner_uid: str) -> dict[str, Any]:
    """A server Deployment of a pool the plan no longer has."""
    return {"kind": "Deployment", "metadata": {"name": name, "ownerReferences": [{"uid": owner_uid}],
            "labels": {constants.SERVICE_LABEL: body["metadata"]["name"], constants.COMPONENT_LABEL: "server", **constants.MANAGED_BY}}}


async def test_apply_and_prune_applies_every_child_and_deletes_only_owned_stale_pools():
    body = service(spec={"replicas": 2})
    _, _, plan = plan_for(body, [node_info(h200())], IMAGES)
    children = owned(plan.children, body)
    kube = MemoryKube([stale_pool(body, "qwen-old", "uid-qwen"), stale_pool(body, "qwen-foreign", "uid-other")])
    live, actions = await _apply_and_prune(kube, children, "qwen", "default", "uid-qwen")
    assert set(live) == {(c["kind"], c["metadata"]["name"]) for c in children}
    assert actions["Deployment/qwen-old"] == "deleted" and kube.deleted == ["Deployment/qwen-old"]
    assert all(actions[f"{c['kind']}/{c['metadata']['name']}"] == "created" for c in children)
    _, again = await _apply_and_prune(kube, children, "qwen", "default", "uid-qwen")
    assert set(again.values()) == {"unchanged"} and kube.deleted == ["Deployment/qwen-old"]


def test_ready_replicas_reads_each_pool_and_the_router_from_the_applied_objects():
    body = service(spec={"replicas": 2})
    owner, _, plan = plan_for(body, [node_info(h200())], IMAGES)
    pool = plan.pools[0].pool.name
    live = {("Deployment", objects.k8s_name("qwen", pool)): {"status": {"readyReplicas": 2}},
            ("Deployment", objects.names(owner)["router"]): {"status": {"readyReplicas": 1}}}
    assert ready_replicas(plan, live, "qwen", owner) == ({pool: 2}, 1)
    assert ready_replicas(plan, {}, "qwen", owner) == ({pool: 0}, 0)  # not applied yet / no status


async def test_invalid_spec_is_one_event_per_new_error_and_a_status_write():
    state, kube, events = OperatorState(default_images=IMAGES), MemoryKube(), Events()
    body = service()
    assert await _report_invalid_spec(state, kube, body, "uid-qwen", "spec.replicas: bad", None, events, lambda: "T")
    assert events == [("Warning", "InvalidSpec", "spec.replicas: bad")]
    invalid = next(c for c in state.conditions["uid-qwen"] if c["type"] == "InvalidSpec")
    assert invalid["status"] == "True" and invalid["message"] == "spec.replicas: bad"
    await _report_invalid_spec(state, kube, body, "uid-qwen", "spec.replicas: bad", None, events, lambda: "T")
    assert len(events) == 1  # the same error again: no second Event
    await _report_invalid_spec(state, kube, body, "uid-qwen", "spec.model: bad", None, events, lambda: "T")
    assert events[-1] == ("Warning", "InvalidSpec", "spec.model: bad")


def test_new_warnings_are_posted_once_against_what_was_last_written():
    state, events = OperatorState(default_images=IMAGES), Events()
    ok = {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": ""}]}
    stuck = {"conditions": [{"type": "Ready", "status": "False", "reason": "Unschedulable", "message": "no node"}]}
    _post_new_warnings(state, service(), "u", ok, stuck, events)
    assert events == [("Warning", "Unschedulable", "no node")] and state.conditions["u"] == stuck["conditions"]
    _post_new_warnings(state, service(), "u", ok, stuck, events)  # the body still shows `ok`: de-dup by memory
    assert len(events) == 1
