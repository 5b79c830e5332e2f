"""The operator's Kubernetes client: the kinds it reads or writes and its field manager, on warmfleet.kube."""

from __future__ import annotations

from typing import Any

from warmfleet.kube import Kube, Login
from warmfleet.operator.spec.constants import GROUP, PLURAL, VERSION

FIELD_MANAGER = "warmfleet-operator"  # server-side apply: the fields of every child the operator sets

# kind → (apiVersion, plural); every kind the operator reads or writes (the chart's RBAC is tested against it)
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Pod": ("v1", "pods"),  # list (router and server pods' IPs) and apply of the pod-deletion-cost annotation (autoscale_pass.py)
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),  # read only: does a pod's claim exist?
    "Secret": ("v1", "secrets"),  # get: credentials, API and admin keys; create: the generated admin key (admin_secret.py)
    "Service": ("v1", "services"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Deployment": ("apps/v1", "deployments"),
    "DaemonSet": ("apps/v1", "daemonsets"),  # the node tier, one per pool (node_tier_objects.py)
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),  # the server pods' (network_policy.py)
    "InferenceService": (f"{GROUP}/{VERSION}", PLURAL),
    # gateway mode (gateway.py); served only where their CRDs are installed, which reconcile asks discovery first
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
    "Gateway": ("gateway.networking.k8s.io/v1", "gateways"),  # read only: spec.router.gateway's address for status.endpoint
}


def connect(info: Any, login: Login | None = None) -> Kube:
    """A client for kopf's ConnectionInfo `info`; `login` (kopf's login handler again) refreshes credentials."""
    return Kube.from_connection(info, RESOURCES, field_manager=FIELD_MANAGER, login=login)
