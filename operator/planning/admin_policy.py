"""What the cluster admin allows tenants' InferenceServices, and a spec's check against it; pure, no I/O.

Set by the chart through the operator's environment (policy_from_env): hostPath prefixes, a model cache shared across
namespaces or not, the operator's namespace (for the server pods' NetworkPolicy), private endpoints allowed."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Mapping

from warmfleet.operator.planning.model_volumes import MODEL_CACHE_VOLUME
from warmfleet.operator.spec.inference_service import DEFAULT_MODEL_CACHE, InferenceServiceSpec
from warmfleet.operator.spec.schema import SpecError

DEFAULT_HOST_PATH_PREFIXES = (posixpath.dirname(DEFAULT_MODEL_CACHE),)  # /var/cache/warmfleet


@dataclass(frozen=True)
class AdminPolicy:
    """Operator-wide settings that bound what a tenant's spec may ask for (flags of `warmfleet operator run`)."""

    # spec.model.cache.hostPath must lie under one of these directories (the node-wide cache default lies under the
    # first); empty: no hostPath may be named at all (the default cache still is used)
    host_path_prefixes: tuple[str, ...] = DEFAULT_HOST_PATH_PREFIXES
    # True: one node cache directory per (endpoint, source) for every namespace (bytes are still checked against each
    # service's own listing, with its own credentials); False: one per namespace as well
    share_model_cache: bool = False
    # the operator's own namespace: server pods' NetworkPolicy admits it on the HTTP port (adapters, probes of
    # the routers' view); None: any namespace may reach the HTTP port (the API key still guards it)
    operator_namespace: str | None = None
    # hosts or networks (CIDR) a spec's hub or S3 endpoint may resolve to although private (an in-cluster mirror);
    # every other private, loopback, link-local or metadata address is refused before the operator connects
    allowed_endpoint_hosts: tuple[str, ...] = ()
    # namespaces whose pods may also reach the server pods' HTTP port (Prometheus's: the engines serve /metrics there);
    # "*": every namespace
    server_http_from: tuple[str, ...] = ()


def policy_from_env(env: Mapping[str, str]) -> AdminPolicy:
    """The policy the chart sets through the operator's environment: WARMFLEET_HOST_PATH_PREFIXES (comma-separated
    absolute directories; unset: the default, empty: none), WARMFLEET_SHARE_MODEL_CACHE (true/false),
    WARMFLEET_ALLOWED_ENDPOINT_HOSTS (comma-separated hosts or CIDRs), WARMFLEET_SERVER_HTTP_FROM_NAMESPACES
    (comma-separated namespaces, or *), POD_NAMESPACE (the operator's own).
    Raises ValueError with one readable line for a bad value."""
    raw = env.get("WARMFLEET_HOST_PATH_PREFIXES")
    prefixes = DEFAULT_HOST_PATH_PREFIXES if raw is None else tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in prefixes if not p.startswith("/") or ".." in p.split("/")]
    if bad:
        raise ValueError(f"WARMFLEET_HOST_PATH_PREFIXES: {', '.join(bad)}: each prefix must be an absolute path without '..'")
    share = (env.get("WARMFLEET_SHARE_MODEL_CACHE") or "false").strip().lower()
    if share not in ("true", "false"):
        raise ValueError(f"WARMFLEET_SHARE_MODEL_CACHE: must be true or false, got {share!r}")
    hosts = tuple(h.strip() for h in (env.get("WARMFLEET_ALLOWED_ENDPOINT_HOSTS") or "").split(",") if h.strip())
    http_from = tuple(n.strip() for n in (env.get("WARMFLEET_SERVER_HTTP_FROM_NAMESPACES") or "").split(",") if n.strip())
    bad = [n for n in http_from if n != "*" and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", n)]
    if bad:
        raise ValueError(f"WARMFLEET_SERVER_HTTP_FROM_NAMESPACES: {', '.join(bad)}: not a namespace name (or *)")
    return AdminPolicy(host_path_prefixes=prefixes, share_model_cache=share == "true",
                       operator_namespace=(env.get("POD_NAMESPACE") or "").strip() or None, allowed_endpoint_hosts=hosts,
                       server_http_from=http_from)


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or lies below it, after normalizing both (no `..` escapes, no trailing '/')."""
    p, root = posixpath.normpath(path), posixpath.normpath(prefix)
    return root == "/" or p == root or p.startswith(root + "/")


def check(spec: InferenceServiceSpec, policy: AdminPolicy) -> None:
    """Refuse what the admin does not allow; raises SpecError naming the field."""
    cache = spec.model.cache
    host = cache.host_path if cache is not None else None
    if host is not None:
        _check_host_path("spec.model.cache.hostPath", host, policy)
    _check_overlays(spec, policy)


def _check_host_path(field: str, path: str, policy: AdminPolicy) -> None:
    if not any(under(path, p) for p in policy.host_path_prefixes):
        allowed = ", ".join(policy.host_path_prefixes) or "none (the operator allows no hostPath)"
        raise SpecError(field, f"{path} is outside the directories the cluster admin allows ({allowed}; chart value "
                               "operator.hostPathPrefixes, env WARMFLEET_HOST_PATH_PREFIXES)")


def _check_overlays(spec: InferenceServiceSpec, policy: AdminPolicy) -> None:
    """spec.server.pod / spec.router.pod may add volumes and mounts: no hostPath outside the prefixes, none over the
    node model cache, and no mount of the operator's cache volume (the server already mounts its own model's directory
    read-only; the whole cache holds every namespace's models)."""
    cache = spec.model.cache
    cache_host = None if cache is not None and cache.pvc else (cache.host_path if cache is not None else None) or DEFAULT_MODEL_CACHE
    for field, pod in (("spec.server.pod", getattr(spec.server, "pod", None)), ("spec.router.pod", getattr(spec.router, "pod", None))):
        if pod is None:
            continue
        for i, vol in enumerate(pod.volumes or []):
            if "hostPath" not in vol:
                continue
            path = str((vol.get("hostPath") or {}).get("path") or "")
            where = f"{field}.volumes[{i}].hostPath.path"
            _check_host_path(where, path, policy)
            if cache_host is not None and (under(path, cache_host) or under(cache_host, path)):
                raise SpecError(where, f"{path} overlaps the node model cache {cache_host}, which only the operator's "
                                       "fetch steps write (each pod mounts its own model's directory read-only)")
        for i, mount in enumerate(pod.volume_mounts or []):
            if mount.name == MODEL_CACHE_VOLUME:
                raise SpecError(f"{field}.volumeMounts[{i}].name",
                                f"{MODEL_CACHE_VOLUME} is the node's shared model cache; the server mounts its model's own "
                                "directory read-only already")
