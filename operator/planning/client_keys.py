"""spec.router.keysSecret on the server pods (`--api-keys-file`) and the fleet key doors send them; pure, no kopf, no I/O.

With the keys file a replica accepts each client key under that key's cache salt (the recipe of the routers and
pickers, server/tenant_keys.py), so a client reaching a replica directly (gateway mode, or any pod the NetworkPolicy
lets in) gets the isolation it gets through the front door, and a gateway passing the client's key through is served.
The fleet key (the replicas' `--api-key`, whose requests' cache_salt they trust) is then the service's admin key,
which no client holds; spec.router.apiKeySecret, which the routers accept as a client key, becomes one at the
replicas too (WARMFLEET_CLIENT_API_KEY), so its holders cannot name another tenant's salt there either.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from warmfleet.operator.planning.engine_descriptions import engine_of
from warmfleet.operator.planning.objects import Owner, admin_key_ref
from warmfleet.operator.planning.router_objects import KEYS_FILE, KEYS_MOUNT, keys_file
from warmfleet.operator.spec.constants import COMPONENT_LABEL
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.server.config import ServerConfig
from warmfleet.server.flagfields import flag_of
from warmfleet.server.tenant_keys import CLIENT_KEY_ENV


def replicas_check_client_keys(spec: InferenceServiceSpec) -> bool:
    """Whether the server pods get the keys file: keysSecret is set and the engine is warmfleet's (vLLM and
    FastDeploy take one API key, so their replicas cannot tell tenants apart: docs/security.md)."""
    return spec.router.keys_secret is not None and engine_of(spec).kind == "warmfleet"


def fleet_key_ref(owner: Owner, spec: InferenceServiceSpec) -> Optional[tuple[str, str]]:
    """(Secret, key) of the key routers, pickers and the operator send the replicas: the service's admin key where the
    replicas check client keys, else apiKeySecret; None when the replicas check no key."""
    if replicas_check_client_keys(spec):
        return admin_key_ref(owner, spec)
    ref = spec.router.api_key_secret
    return (ref.name, ref.key) if ref is not None else None


def _env(name: str, ref: tuple[str, str]) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref[0], "key": ref[1]}}}


def _set_env(c: dict[str, Any], *entries: dict[str, Any]) -> None:
    """Replace (or add) these variables in container `c`'s env."""
    names = {e["name"] for e in entries}
    c["env"] = [*(e for e in c.get("env", []) if e["name"] not in names), *entries]


def with_client_keys(owner: Owner, spec: InferenceServiceSpec, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `objs` whose server containers mount the keys Secret, take `--api-keys-file` and the fleet key
    (WARMFLEET_API_KEY; apiKeySecret as a client key, WARMFLEET_CLIENT_API_KEY), and whose router and picker
    containers send the fleet key (WARMFLEET_REPLICA_API_KEY); `objs` unchanged unless `replicas_check_client_keys`."""
    if not replicas_check_client_keys(spec):
        return objs
    _, vols, mounts = keys_file(spec)
    fleet = fleet_key_ref(owner, spec)
    assert fleet is not None
    shared = spec.router.api_key_secret
    out = []
    for obj in objs:
        component = (obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}).get(COMPONENT_LABEL)
        if obj.get("kind") != "Deployment" or component not in ("server", "router", "epp"):
            out.append(obj)
            continue
        obj = copy.deepcopy(obj)
        pod = obj["spec"]["template"]["spec"]
        c = next(c for c in pod["containers"] if c["name"] == component)
        if component == "server":
            c["args"] = [*c["args"], flag_of(ServerConfig, "api_keys_file"), f"{KEYS_MOUNT}/{KEYS_FILE}"]
            c["volumeMounts"] = [*c.get("volumeMounts", []), *mounts]
            pod["volumes"] = [*pod.get("volumes", []), *vols]
            _set_env(c, _env("WARMFLEET_API_KEY", fleet),
                     *([_env(CLIENT_KEY_ENV, (shared.name, shared.key))] if shared is not None else []))
        else:
            _set_env(c, _env("WARMFLEET_REPLICA_API_KEY", fleet))
        out.append(obj)
    return out
