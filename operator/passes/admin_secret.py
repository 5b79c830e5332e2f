"""The admin key the operator generates per InferenceService into the owned Secret NAME-admin, and its reads.

Only where spec.lora.adminKeySecret is unset; created once and never rewritten, so the key stays what the running pods
read (delete the Secret to rotate)."""

from __future__ import annotations

import base64
import secrets
from typing import Any, Mapping

from warmfleet.kube import Kube
from warmfleet.operator.passes.create_once import create_once
from warmfleet.operator.planning import objects
from warmfleet.operator.spec.inference_service import InferenceServiceSpec

KEY_BYTES = 32  # 256 bits from the OS's CSPRNG


def admin_secret(owner: objects.Owner, key: str) -> dict[str, Any]:
    """The generated Secret (before its owner reference): NAME-admin with key admin-key."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": objects.meta(owner, objects.names(owner)["admin"], "admin"),
            "data": {objects.ADMIN_KEY: base64.b64encode(key.encode()).decode()}}


async def ensure_admin_secret(kube: Kube, owner: objects.Owner, spec: InferenceServiceSpec,
                              own: Any = lambda objs: objs) -> str:
    """Create NAME-admin with a fresh random key if it does not exist; never touch an existing one (no rotation on
    a reconcile; delete the Secret to rotate). `own` adds the owner reference (GC deletes it with the service).
    Needs only `create` on Secrets (a 409 says it exists). Returns 'created', 'exists' or 'named'
    (spec.lora.adminKeySecret is set: nothing to generate)."""
    secret, _ = objects.admin_key_ref(owner, spec)
    if secret != objects.names(owner)["admin"]:
        return "named"
    return await create_once(kube, owner.namespace, secret,
                             lambda: admin_secret(owner, secrets.token_urlsafe(KEY_BYTES)), own)


def secret_value(secret: Mapping[str, Any] | None, key: str) -> str | None:
    """A key's value in a Secret as the API returns it (data: base64; stringData when a test or kmock stores it)."""
    if secret is None:
        return None
    raw = (secret.get("data") or {}).get(key)
    value = base64.b64decode(raw).decode(errors="replace").strip() if raw else (secret.get("stringData") or {}).get(key)
    return value or None
