"""spec.router.keysSecret on the server pods (`--api-keys-file`) and the fleet key doors send them; pure, no kopf, no I/O.

With the keys file a replica accepts each client key under that key's cache salt (the recipe of the routers and
pickers, server/tenant_keys.py), so a client reaching a replica directly (gateway mode, or any pod the NetworkPolicy
lets in) gets the isolation it gets through the front door, and a gateway passing the client's key through is served.
The fleet key (`--api-key`, whose requests' cache_salt the replica trusts) is spec.router.apiKeySecret; without one,
the service's admin key, which no client holds.
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


def replicas_check_client_keys(spec: InferenceServiceSpec) -> bool:
    """Whether the server pods get the keys file: keysSecret is set and the engine is warmfleet's (vLLM and
    FastDeploy take one API key, so their replicas cannot tell tenants apart: docs/security.md)."""
    return spec.router.keys_secret is not None and engine_of(spec).kind == "warmfleet"


def fleet_key_ref(owner: Owner, spec: InferenceServiceSpec) -> Optional[tuple[str, str]]:
    """(Secret, key) of the key routers, pickers and the operator send the replicas: apiKeySecret, else (replicas
    checking client keys) the service's admin key; None when the replicas check no key."""
    ref = spec.router.api_key_secret
    if ref is not None:
        return ref.name, ref.key
    return admin_key_ref(owner, spec) if replicas_check_client_keys(spec) else None


def _env(name: str, ref: tuple[str, str]) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref[0], "key": ref[1]}}}


def with_client_keys(owner: Owner, spec: InferenceServiceSpec, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `objs` whose server containers mount the keys Secret and get `--api-keys-file` (and, without
    apiKeySecret, the fleet key as WARMFLEET_API_KEY), and whose router and picker containers then send the fleet key
    (WARMFLEET_REPLICA_API_KEY); `objs` unchanged unless `replicas_check_client_keys`."""
    if not replicas_check_client_keys(spec):
        return objs
    _, vols, mounts = keys_file(spec)
    fleet = fleet_key_ref(owner, spec)
    assert fleet is not None
    keyless = spec.router.api_key_secret is None  # else api_key_env already rendered both ends
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
            c["env"] = [*c.get("env", []), *([_env("WARMFLEET_API_KEY", fleet)] if keyless else [])]
        elif keyless:
            c["env"] = [*c.get("env", []), _env("WARMFLEET_REPLICA_API_KEY", fleet)]
        out.append(obj)
    return out
