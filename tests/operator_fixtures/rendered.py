"""A service's rendered children on one L4 node, keyed by (kind, name), and a component's pod and main container."""

from __future__ import annotations

from operator_fixtures.shapes import l4, service
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import node_info

IMAGES = objects.Images(engine="engine:1", router="operator-slim:1")
HF = {"source": "hf://acme/m@main", "hiddenSize": 1024, "dtype": "bfloat16"}


def children(spec: dict) -> dict:
    _, _, plan = plan_for(service("qwen", spec=spec, namespace="team-a", uid="uid-qwen"), [node_info(l4())], IMAGES)
    return {(c["kind"], c["metadata"]["name"]): c for c in plan.children}


def container(objs: dict, component: str) -> tuple[dict, dict]:
    pod = next(c for c in objs.values() if c["kind"] == "Deployment"
               and c["metadata"]["labels"]["app.kubernetes.io/component"] == component)["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c["name"] == component)
