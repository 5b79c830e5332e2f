"""The Secrets the operator generates once per InferenceService (passes/create_once.py creates each at the first
reconcile, with fresh random material): which ones a plan asks for, their keys and what each holds, and how
`warmfleet operator render` lists them; pure, no kopf, no I/O, no key material."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmfleet.operator.planning import kv_curve
from warmfleet.operator.planning.node_tier_objects import TOKEN_KEY, tier_names, tier_pools
from warmfleet.operator.planning.objects import ADMIN_KEY, Owner, admin_key_ref, names
from warmfleet.operator.spec.inference_service import InferenceServiceSpec


@dataclass(frozen=True)
class GeneratedSecret:
    """One Secret the operator creates once (passes/admin_secret.py, kv_curve_secret.py, node_tier_secret.py)."""

    name: str
    keys: tuple[str, ...]  # its data keys
    holds: str  # what it is for, in a few words


def generated_secrets(owner: Owner, spec: InferenceServiceSpec, planned: list[Any]) -> list[GeneratedSecret]:
    """The Secrets a reconcile of this plan creates when they do not exist yet, in the order it creates them: the
    admin key (unless spec.lora.adminKeySecret names one), the CURVE key pairs (spec.router.kvEventsCurve), the node
    tier's token (a pool with a node tier). `planned` is the plan's PlannedPools."""
    out = []
    if admin_key_ref(owner, spec)[0] == names(owner)["admin"]:
        out.append(GeneratedSecret(names(owner)["admin"], (ADMIN_KEY,),
                                   "the admin key of the servers' and routers' admin routes"))
    if spec.router.kv_events_curve:
        keys = tuple(f"{who}.{part}" for who in (kv_curve.REPLICA, kv_curve.ROUTER) for part in ("key", "key_secret"))
        out.append(GeneratedSecret(kv_curve.curve_secret_name(owner), keys,
                                   "CURVE key pairs of the KV-event streams (spec.router.kvEventsCurve)"))
    if tier_pools(planned):
        out.append(GeneratedSecret(tier_names(owner)["token"], (TOKEN_KEY,),
                                   "the node tier's shared token (spec.cache.nodeTier)"))
    return out


def secrets_comment(owner: Owner, secrets: list[GeneratedSecret]) -> str:
    """YAML comment lines listing `secrets` for a render ("" when there are none). They are not rendered as
    manifests: the operator uses a Secret of one of these names that already exists as it is, so applying a
    placeholder would make it the key."""
    if not secrets:
        return ""
    width = max(len(s.name) for s in secrets)
    lines = [f"Secrets the operator generates for InferenceService {owner.namespace}/{owner.name} (not manifests: it",
             "creates each once, at its first reconcile, with fresh random values, owned by the service; it never",
             "rewrites one, and uses a Secret of that name that exists as it is, so do not create them; delete one to",
             "rotate it):",
             *(f"  Secret {s.name:<{width}}  keys {', '.join(s.keys)}: {s.holds}" for s in secrets)]
    return "".join(f"# {line}\n" for line in lines)
