"""A small async Kubernetes REST client over httpx, built from kopf's ConnectionInfo; idempotent apply."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import httpx

from warmfleet.operator.spec import GROUP, PLURAL, VERSION

# kind → (apiVersion, plural); every kind the operator reads or writes
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Pod": ("v1", "pods"),  # list (router and server pods' IPs) and apply of the pod-deletion-cost annotation (autoscaler.py)
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),  # read only: does a pod's claim exist?
    "Secret": ("v1", "secrets"),  # read only: spec.model.credentialsSecret, to read config.json (modelconfig.py)
    "Service": ("v1", "services"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferenceService": (f"{GROUP}/{VERSION}", PLURAL),
}


class KubeError(Exception):
    """An API error: HTTP status and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def collection_path(kind: str, namespace: str) -> str:
    """URL path of a namespaced collection."""
    api_version, plural = RESOURCES[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}"


def object_path(kind: str, namespace: str, name: str) -> str:
    """URL path of one namespaced object."""
    return f"{collection_path(kind, namespace)}/{name}"


def is_subset(want: Any, have: Any) -> bool:
    """True if every field of `want` equals the one in `have` (server defaults in `have` are ignored)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(is_subset(w, h) for w, h in zip(want, have))
    return want == have


@dataclass
class Kube:
    """An httpx.AsyncClient bound to one API server; created on the operator's loop (startup hook)."""

    client: httpx.AsyncClient
    field_manager: str = "warmfleet-operator"
    _tempfiles: list[str] = field(default_factory=list)

    @classmethod
    def from_connection(cls, info: Any) -> "Kube":
        """Build from a kopf ConnectionInfo (server, CA, token or client certificate)."""
        # kopf builds the TLS context: kubeconfig `*-data` fields are base64 (not PEM), and the
        # in-cluster login gives a CA path; both, plus client certificates and `insecure`, are handled there.
        verify: Any = info.as_ssl_context()
        headers = info.as_http_headers()
        client = httpx.AsyncClient(base_url=info.server, verify=verify, headers=headers, timeout=30.0)
        return cls(client=client)

    async def close(self) -> None:
        """Close the connection pool and remove temporary credential files."""
        await self.client.aclose()
        for path in self._tempfiles:
            try:
                os.unlink(path)
            except OSError:
                pass

    async def _send(self, method: str, path: str, **kw: Any) -> dict[str, Any] | None:
        resp = await self.client.request(method, path, **kw)
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise KubeError(resp.status_code, message)
        return resp.json() if resp.content else {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        return await self._send("GET", object_path(kind, namespace, name))

    async def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        """Objects matching the label selector (filtered again client-side: some servers ignore it)."""
        sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        data = await self._send("GET", collection_path(kind, namespace), params={"labelSelector": sel}) or {}
        items = data.get("items") or []
        return [o for o in items if is_subset(selector, (o.get("metadata") or {}).get("labels") or {})]

    async def apply(self, obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Create or merge-patch `obj` so it holds every desired field; returns (live object, action).

        action is "created", "patched" or "unchanged": an object that already holds every
        desired field is not written, so a no-change reconcile issues reads only.
        """
        kind, meta = obj["kind"], obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        live = await self.get(kind, ns, name)
        params = {"fieldManager": self.field_manager}
        if live is None:
            created = await self._send("POST", collection_path(kind, ns), json=obj, params=params)
            return created or obj, "created"
        if is_subset(obj, live):
            return live, "unchanged"
        patched = await self._send(
            "PATCH", object_path(kind, ns, name), json=obj, params=params,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return patched or obj, "patched"

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object; absent is fine."""
        await self._send("DELETE", object_path(kind, namespace, name), params={"propagationPolicy": "Background"})

    async def patch_status(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """Merge-patch the status subresource."""
        await self._send(
            "PATCH", object_path(kind, namespace, name) + "/status", json={"status": patch},
            headers={"Content-Type": "application/merge-patch+json"},
        )

