"""spec.server.pod and spec.router.pod merged into the pod templates the operator renders: the operator's entries stay,
the user's are added after them, and one that collides with the operator's is a SpecError (InvalidSpec) naming the
field; pure (plain dicts), imports spec/ and nodes.py only (docs/pod-overlays.md)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable

from warmfleet.operator.planning.nodes import parse_quantity
from warmfleet.operator.spec.constants import GROUP
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.operator.spec.pod_overlay import ROUTER_FIELD, SERVER_FIELD, Affinity, PodOverlay, check_labels
from warmfleet.operator.spec.schema import SpecError, to_dict

def overlay_server_pod(template: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """A server pool's pod template with spec.server.pod added (its nodeSelector is already in the node affinity:
    server_node_selector); cpu, memory, ephemeral-storage and the GPU stay the sizing's."""
    pod = spec.server.pod
    if pod is None:
        return template
    out = overlay_pod(template, dataclasses.replace(pod, node_selector=None), SERVER_FIELD, "server")
    if pod.service_account_name:
        _set_scalar(out["spec"], "serviceAccountName", pod.service_account_name, f"{SERVER_FIELD}.serviceAccountName")
    if pod.resources is not None:
        main = _container(out["spec"], "server")
        main["resources"] = _merge_resources(main["resources"], to_dict(pod.resources), f"{SERVER_FIELD}.resources",
                                             replaceable=())
    return out


def overlay_router_pod(template: dict[str, Any], spec: InferenceServiceSpec, container: str) -> dict[str, Any]:
    """A router's (or endpoint picker's) pod template with spec.router.pod added; its resources replace the
    operator's per resource (cpu, memory), ephemeral-storage stays the operator's."""
    pod = spec.router.pod
    if pod is None:
        return template
    out = overlay_pod(template, pod, ROUTER_FIELD, container)
    if pod.resources is not None:
        main = _container(out["spec"], container)
        main["resources"] = _merge_resources(main["resources"], to_dict(pod.resources), f"{ROUTER_FIELD}.resources",
                                             replaceable=("cpu", "memory"))
    return out


def overlay_pod(template: dict[str, Any], pod: PodOverlay, field: str, container: str) -> dict[str, Any]:
    """`template` (a Deployment's spec.template) with the fields every overlay shares added; raises SpecError."""
    out = copy.deepcopy(template)
    meta, spec = out["metadata"], out["spec"]
    main = _container(spec, container)
    for key in ("labels", "annotations"):
        _add_map(meta, key, getattr(pod, key), f"{field}.{key}", labels=key == "labels")
    if pod.node_selector:
        check_labels(pod.node_selector, f"{field}.nodeSelector")
        _add_map(spec, "nodeSelector", pod.node_selector, f"{field}.nodeSelector", labels=False)
    if pod.tolerations:
        own = spec.get("tolerations") or []
        spec["tolerations"] = own + [t for t in _clean(pod.tolerations) if t not in own]
    if pod.affinity is not None:
        spec["affinity"] = merge_affinity(spec.get("affinity") or {}, pod.affinity)
    _add_spread(spec, pod, field)
    _add_named(main, "env", pod.env, f"{field}.env", "name", what="variable")
    if pod.env_from:
        main["envFrom"] = (main.get("envFrom") or []) + _clean(pod.env_from)
    _add_named(spec, "imagePullSecrets", pod.image_pull_secrets, f"{field}.imagePullSecrets", "name", what="pull secret")
    for key, value in (("priorityClassName", pod.priority_class_name), ("runtimeClassName", pod.runtime_class_name)):
        if value:
            _set_scalar(spec, key, value, f"{field}.{key}")
    _add_named(spec, "volumes", pod.volumes, f"{field}.volumes", "name", what="volume")
    _add_mounts(spec, main, pod, field)
    return out


def merge_affinity(own: dict[str, Any], extra: Affinity) -> dict[str, Any]:
    """The operator's affinity and the user's: required node terms are ANDed (each of the user's terms gets the
    operator's expressions, since terms are ORed), everything else is added."""
    user = _clean(extra)
    out = copy.deepcopy(own)
    node_user = user.get("nodeAffinity") or {}
    node = out.setdefault("nodeAffinity", {}) if node_user else out.get("nodeAffinity", {})
    required = node_user.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required:
        own_terms = (node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [{}]
        terms = [_and_terms(o, u) for u in required["nodeSelectorTerms"] for o in own_terms]
        node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": terms}
    preferred = node_user.get("preferredDuringSchedulingIgnoredDuringExecution")
    if preferred:
        node["preferredDuringSchedulingIgnoredDuringExecution"] = (
            node.get("preferredDuringSchedulingIgnoredDuringExecution") or []) + preferred
    for key in ("podAffinity", "podAntiAffinity"):
        if key in user:
            out[key] = user[key]  # the operator sets neither
    return out


def _and_terms(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    term = {key: (a.get(key) or []) + (b.get(key) or []) for key in ("matchExpressions", "matchFields")}
    return {k: v for k, v in term.items() if v}


def _add_spread(spec: dict[str, Any], pod: PodOverlay, field: str) -> None:
    if not pod.topology_spread_constraints:
        return
    own = spec.get("topologySpreadConstraints") or []
    taken = {(c["topologyKey"], c["whenUnsatisfiable"]) for c in own}
    for i, c in enumerate(_clean(pod.topology_spread_constraints)):
        key = (c["topologyKey"], c["whenUnsatisfiable"])
        if key in taken:
            raise SpecError(f"{field}.topologySpreadConstraints[{i}]",
                            f"{key[0]} with {key[1]} is already a constraint of the pod (the operator's or an earlier one); "
                            "Kubernetes allows one per topologyKey and whenUnsatisfiable")
        taken.add(key)
        own.append(c)
    spec["topologySpreadConstraints"] = own


def _add_mounts(spec: dict[str, Any], main: dict[str, Any], pod: PodOverlay, field: str) -> None:
    if not pod.volume_mounts:
        return
    volumes = {v["name"] for v in spec.get("volumes") or []}
    mounts = main.setdefault("volumeMounts", [])
    for i, m in enumerate(_clean(pod.volume_mounts)):
        if m["name"] not in volumes:
            raise SpecError(f"{field}.volumeMounts[{i}].name", f"{m['name']!r} is no volume of the pod (add it to volumes)")
        if any(m["mountPath"].rstrip("/") == have["mountPath"].rstrip("/") for have in mounts):
            raise SpecError(f"{field}.volumeMounts[{i}].mountPath",
                            f"{m['mountPath']} is already mounted (the operator's mount or an earlier one)")
        mounts.append(m)


def _add_named(owner: dict[str, Any], key: str, items: Iterable[Any] | None, path: str, name_key: str, *, what: str) -> None:
    """Append `items` to owner[key], refusing a name the list already holds (the operator's, or an earlier item)."""
    if not items:
        return
    have = owner.get(key) or []
    taken = {h[name_key] for h in have}
    # volumes are kept as written (`emptyDir: {}` is a source); the typed parts are cleaned
    added = copy.deepcopy(list(items)) if key == "volumes" else _clean(list(items))
    for i, item in enumerate(added):
        if item[name_key] in taken:
            raise SpecError(f"{path}[{i}].{name_key}",
                            f"{what} {item[name_key]!r} is already set (by the operator, or earlier in the list); docs/pod-overlays.md")
        taken.add(item[name_key])
        have.append(item)
    owner[key] = have


def _add_map(owner: dict[str, Any], key: str, extra: dict[str, str] | None, path: str, *, labels: bool) -> None:
    if not extra:
        return
    if labels:
        check_labels(extra, path)
    have = owner.setdefault(key, {})
    for k, v in extra.items():
        if k in have or k.startswith(f"{GROUP}/"):
            raise SpecError(f"{path}.{k}", f"is the operator's own (it sets {k}={have.get(k, '...')!r}); docs/pod-overlays.md")
        have[k] = v


def _set_scalar(owner: dict[str, Any], key: str, value: str, path: str) -> None:
    if owner.get(key, value) != value:
        raise SpecError(path, f"is {value!r}, but the operator sets {owner[key]!r}")
    owner[key] = value


def _merge_resources(own: dict[str, Any], extra: dict[str, Any], path: str, *, replaceable: tuple[str, ...]) -> dict[str, Any]:
    """Requests and limits with the user's added: a resource the operator sets is refused unless `replaceable` (or
    equal); every request must stay within its limit."""
    out = {kind: dict(own.get(kind) or {}) for kind in ("requests", "limits")}
    for kind in ("requests", "limits"):
        for name, amount in (extra.get(kind) or {}).items():
            have = out[kind].get(name)
            if have is not None and name not in replaceable and parse_quantity(have) != parse_quantity(amount):
                raise SpecError(f"{path}.{kind}.{name}", f"is {amount}, but the operator sizes it to {have} (docs/sizing.md)")
            out[kind][name] = amount
    for name, amount in out["requests"].items():
        limit = out["limits"].get(name)
        if limit is not None and parse_quantity(amount) > parse_quantity(limit):
            raise SpecError(f"{path}.requests.{name}", f"is {amount}, above its limit {limit}; set limits.{name} too")
    return out


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in spec["containers"] if c["name"] == name)


def _clean(value: Any) -> Any:
    """A parsed overlay part as Kubernetes stores it: camelCase, no None, no empty list or map (the API server drops
    those, and an intent holding them would never read back as applied). Volumes are kept as written."""
    value = to_dict(value)
    if isinstance(value, dict):
        items = {k: _clean(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not None and v != [] and v != {}}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
