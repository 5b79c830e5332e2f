"""spec.router.kvEventsCurve: the CURVE key Secret's shape and the pods' `--kv-events-curve-*` flags; pure, no I/O.

passes/kv_curve_secret.py creates the Secret once; this module says what it holds and what each pod mounts:

    Secret NAME-kv-curve: replica.key_secret, replica.key (public), router.key_secret, router.key (public)
    server, node-tier pods: --kv-events-curve-secret-key .../replica.key_secret --kv-events-curve-clients .../clients
    router, picker pods: --kv-events-curve-server-key .../replica.key --kv-events-curve-secret-key .../router.key_secret

One key pair for every replica of the service and one for every router and picker: each side admits exactly the
other's public key (the clients directory holds router.key). The service's node tiers (spec.cache.nodeTier:
`warmfleet node-tier`, the same two flags) publish with the replicas' pair, so a router's one server key covers
replicas and node tiers alike. The certificate files are in zmq.auth's format (what zmq.auth.load_certificate reads).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from warmfleet.operator.planning.node_tier_objects import COMPONENT as NODE_TIER  # its label and container name
from warmfleet.operator.planning.objects import Owner, k8s_name, meta
from warmfleet.operator.spec.constants import COMPONENT_LABEL
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.server.config import ServerConfig
from warmfleet.server.flagfields import flag_of
from warmfleet.server.router.core.settings import RouterSettings

CURVE_MOUNT, CURVE_VOLUME = "/etc/warmfleet/kv-curve", "kv-curve"
REPLICA, ROUTER = "replica", "router"  # the key pairs' names: NAME.key (public), NAME.key_secret (both keys)
KEY_NAMES = tuple(f"{who}.{kind}" for who in (REPLICA, ROUTER) for kind in ("key", "key_secret"))


def curve_secret_name(owner: Owner) -> str:
    return k8s_name(owner.name, "kv-curve")


def certificate(public_key: str, secret_key: Optional[str] = None) -> str:
    """A zmq.auth certificate file: the public key, and the secret key for a `.key_secret` file."""
    kind = "Secret" if secret_key else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate (warmfleet operator)", "metadata", "curve",
             f'    public-key = "{public_key}"']
    return "\n".join(lines + ([f'    secret-key = "{secret_key}"'] if secret_key else [])) + "\n"


def curve_secret(owner: Owner, pairs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The Secret (before its owner reference) from `pairs` {REPLICA: (public, secret), ROUTER: (...)}, Z85 keys."""
    data = {}
    for who, (public, secret) in pairs.items():
        data[f"{who}.key"], data[f"{who}.key_secret"] = certificate(public), certificate(public, secret)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": meta(owner, curve_secret_name(owner), "kv-curve"), "stringData": data}


def _volume(owner: Owner, items: list[tuple[str, str]]) -> dict[str, Any]:
    return {"name": CURVE_VOLUME, "secret": {"secretName": curve_secret_name(owner), "defaultMode": 0o440,
                                             "items": [{"key": k, "path": p} for k, p in items]}}


def _server_side(owner: Owner) -> tuple[list[str], dict[str, Any]]:
    """The replicas' (and node tiers') flags and volume: their own key pair, the routers' public key as the one
    allowed client."""
    args = [flag_of(ServerConfig, "kv_events_curve_secret_key"), f"{CURVE_MOUNT}/{REPLICA}.key_secret",
            flag_of(ServerConfig, "kv_events_curve_clients"), f"{CURVE_MOUNT}/clients"]
    return args, _volume(owner, [(f"{REPLICA}.key_secret", f"{REPLICA}.key_secret"),
                                 (f"{ROUTER}.key", f"clients/{ROUTER}.key")])


def _front_door_side(owner: Owner) -> tuple[list[str], dict[str, Any]]:
    """The routers' (pickers') flags and volume: the replicas' public key, their own key pair."""
    args = [flag_of(RouterSettings, "kv_events_curve_server_key"), f"{CURVE_MOUNT}/{REPLICA}.key",
            flag_of(RouterSettings, "kv_events_curve_secret_key"), f"{CURVE_MOUNT}/{ROUTER}.key_secret"]
    return args, _volume(owner, [(f"{REPLICA}.key", f"{REPLICA}.key"),
                                 (f"{ROUTER}.key_secret", f"{ROUTER}.key_secret")])


def with_kv_curve(owner: Owner, spec: InferenceServiceSpec, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `objs` whose server, router and picker Deployments' and node-tier DaemonSets' containers mount their
    half of the CURVE Secret and take the matching flags; `objs` unchanged unless spec.router.kvEventsCurve
    (check_spec refuses it for other engines)."""
    if not spec.router.kv_events_curve:
        return objs
    sides = {("Deployment", "server"): _server_side(owner), ("Deployment", "router"): _front_door_side(owner),
             ("Deployment", "epp"): _front_door_side(owner), ("DaemonSet", NODE_TIER): _server_side(owner)}
    mount = {"name": CURVE_VOLUME, "mountPath": CURVE_MOUNT, "readOnly": True}
    out = []
    for obj in objs:
        component = (obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}).get(COMPONENT_LABEL)
        if (obj.get("kind"), component) not in sides:
            out.append(obj)
            continue
        obj = copy.deepcopy(obj)
        pod = obj["spec"]["template"]["spec"]
        c = next(c for c in pod["containers"] if c["name"] == component)
        args, volume = sides[obj["kind"], component]
        c["args"] = [*c["args"], *args]
        c["volumeMounts"] = [*c.get("volumeMounts", []), mount]
        pod["volumes"] = [*pod.get("volumes", []), volume]
        out.append(obj)
    return out
