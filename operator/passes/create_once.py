"""Generated Secrets (admin key, node-tier token, KV-event CURVE keys): created once, never rewritten by a reconcile."""

from __future__ import annotations

from typing import Any, Callable

from warmfleet.kube import Kube, KubeError


async def create_once(kube: Kube, namespace: str, name: str, make: Callable[[], dict[str, Any]],
                      own: Any = lambda objs: objs) -> str:
    """Create the Secret `make()` builds (with fresh random material) unless `name` exists; never touch an existing
    one, so running pods keep agreeing with it (delete it to rotate). `own` adds the owner reference. Needs only
    `create` on Secrets: a 403 on the read falls through to the create, whose 409 says it exists. → 'created' or
    'exists'."""
    try:
        if await kube.get("Secret", namespace, name) is not None:
            return "exists"
    except KubeError as exc:
        if exc.status != 403:  # may create but not read Secrets (chart value operator.readModelCredentials=false)
            raise
    try:
        await kube.create(own([make()])[0])
    except KubeError as exc:
        if exc.status != 409:  # another pass created it meanwhile: theirs stands
            raise
        return "exists"
    return "created"
