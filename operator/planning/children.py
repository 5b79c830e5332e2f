"""Every child of an InferenceService in apply order, and the sizing report ConfigMap; pure, no kopf, no I/O."""

from __future__ import annotations

import json
from typing import Any

from warmfleet.operator.planning import gateway, lora_plan
from warmfleet.operator.planning.adapter_objects import adapters_config_map
from warmfleet.operator.planning.client_keys import with_client_keys
from warmfleet.operator.planning.kv_curve import with_kv_curve
from warmfleet.operator.planning.admin_policy import AdminPolicy
from warmfleet.operator.planning.network_policy import server_network_policy
from warmfleet.operator.planning.node_tier_objects import node_tier_children
from warmfleet.operator.planning.objects import Images, Owner, endpoint_url, k8s_name, meta, names
from warmfleet.operator.planning.router_objects import (
    router_deployment,
    router_pdb,
    router_peers_service,
    router_rbac,
    router_service,
)
from warmfleet.operator.planning.server_pool import PlannedPool, replicas_service, server_deployment, server_pdb
from warmfleet.operator.spec.inference_service import InferenceServiceSpec, served_name
from warmfleet.operator.spec.schema import to_dict


def config_map(owner: Owner, spec: InferenceServiceSpec, plan: list[PlannedPool]) -> dict[str, Any]:
    """ConfigMap with the sizing report (pools, sizes, inputs) for humans and tools."""
    report = {
        "model": served_name(spec, owner.name),
        "engine": spec.engine.kind,
        "endpoint": endpoint_url(owner, spec) if spec.router.mode == "proxy" else "",
        **({"inferencePool": k8s_name(owner.name)} if spec.router.mode == "gateway" else {}),
        "pools": [
            {
                "name": p.pool.name, "nodes": list(p.pool.nodes), "replicas": p.replicas, "fits": p.sizing.fits,
                "message": p.sizing.message, "sizes": to_dict(p.sizing.sizes), "inputs": to_dict(p.sizing.inputs),
            }
            for p in plan
        ],
        **({"lora": lora_report(spec)} if spec.lora else {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(owner, names(owner)["config"], "config"),
        "data": {"sizing.json": json.dumps(report, indent=2, sort_keys=True)},
    }


def lora_report(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The adapter budget with its inputs, and each adapter's own size from its hints (the ConfigMap's `lora`)."""
    assert spec.lora is not None
    budget = lora_plan.budget_size(spec)
    return {
        "maxLoras": spec.lora.max_loras, "maxCpuLoras": spec.lora.num_cpu_loras, "maxLoraRank": spec.lora.max_lora_rank,
        "bytesPerAdapter": budget.bytes, "deviceBytes": spec.lora.max_loras * budget.bytes,
        "hostBytes": spec.lora.num_cpu_loras * budget.bytes, "budgetedAs": budget.note, "shapes": lora_plan.shape_note(spec),
        "adapters": [{"name": a.name, "path": lora_plan.adapter_path(spec, a), "rank": sz.rank, "bytes": sz.bytes, "note": sz.note}
                     for a, sz in ((a, lora_plan.known_size(spec, a)) for a in spec.adapters)],
    }


def build_children(owner: Owner, spec: InferenceServiceSpec, images: Images, plan: list[PlannedPool],
                   policy: AdminPolicy = AdminPolicy()) -> list[dict[str, Any]]:
    """Every child object, in apply order; pools that cannot host replicas get no Deployment. Proxy mode: the router's
    Deployment, Services and PDB; gateway mode instead the endpoint picker's objects and the InferencePool (gateway.py).
    The server pods' NetworkPolicy comes before their Deployments, so no pod ever runs unguarded."""
    gateway_mode = spec.router.mode == "gateway"
    objs = [config_map(owner, spec, plan)] + ([adapters_config_map(owner, spec)] if spec.lora else [])
    objs += gateway.epp_rbac(owner) if gateway_mode else router_rbac(owner)
    objs.append(replicas_service(owner, spec))
    netpol = server_network_policy(owner, spec, policy)
    objs += [netpol] if netpol is not None else []
    objs += [server_deployment(owner, spec, images.engine, p, images.fetch_image, policy) for p in plan if p.sizing.fits]
    objs.append(server_pdb(owner, spec))
    objs += (gateway.gateway_children(owner, spec, images.router) if gateway_mode else
             [router_pdb(owner), router_deployment(owner, spec, images.router), router_service(owner, spec),
              router_peers_service(owner)])
    objs = with_client_keys(owner, spec, objs)  # spec.router.keysSecret: the replicas check client keys too
    # spec.cache.nodeTier: its DaemonSets, Services and NetworkPolicy; server, router and picker pods pointed at it
    objs = node_tier_children(owner, plan, images.router, spec.server.image_pull_policy, objs)
    return with_kv_curve(owner, spec, objs)  # spec.router.kvEventsCurve: KV events (replicas', node tiers') over CURVE
