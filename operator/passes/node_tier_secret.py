"""The node tier's shared token, generated once per InferenceService into the owned Secret NAME-node-tier (key `token`).

`warmfleet node-tier` closes a connection that does not open with it, and the replicas send it (WARMFLEET_NODE_TIER_TOKEN,
both from this Secret): with the NetworkPolicy, a second lock on the tier's port. Created once and never rewritten
(delete the Secret to rotate, then restart the tier and server pods); only while a pool has a node tier."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from warmfleet.kube import Kube
from warmfleet.operator.passes.create_once import create_once
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.node_tier_objects import TOKEN_KEY, tier_names

TOKEN_BYTES = 32  # 256 bits from the OS's CSPRNG


def node_tier_secret(owner: objects.Owner, token: str) -> dict[str, Any]:
    """The generated Secret (before its owner reference)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": objects.meta(owner, tier_names(owner)["token"], "node-tier"),
            "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()}}


async def ensure_node_tier_secret(kube: Kube, owner: objects.Owner, wanted: bool, own: Any = lambda objs: objs) -> str:
    """Create NAME-node-tier with a fresh token if a pool has a tier (`wanted`) and it does not exist; never touch an
    existing one. Needs only `create` on Secrets (a 409 says it exists). Returns 'created', 'exists' or 'unwanted'."""
    if not wanted:
        return "unwanted"
    return await create_once(kube, owner.namespace, tier_names(owner)["token"],
                             lambda: node_tier_secret(owner, secrets.token_urlsafe(TOKEN_BYTES)), own)
