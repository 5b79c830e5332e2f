"""spec.server.pod and spec.router.pod: Kubernetes' own pod fields (same names, same shapes) a user adds to the pods the
operator renders; the merge and its collision checks live in planning/pod_overlay.py; no kopf."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from warmfleet.operator.spec.schema import SpecError, prop

SERVER_FIELD = "spec.server.pod"
ROUTER_FIELD = "spec.router.pod"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|[munkMGTPE])?$")
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")


def check_labels(items: dict[str, str], path: str) -> None:
    """Label keys and values as Kubernetes takes them (else the pod would be refused at apply, not at reconcile)."""
    for k, v in items.items():
        if not _LABEL_KEY.match(k) or len(k.rsplit("/", 1)[0]) > 253:
            raise SpecError(f"{path}.{k}", "is not a valid label key ([prefix/]name, name at most 63 characters)")
        if not _LABEL_VALUE.match(v):
            raise SpecError(f"{path}.{k}", f"value {v!r} is not a valid label value (at most 63 alphanumerics, '-', '_', '.')")


def server_node_selector(service: Mapping[str, str], pod: "ServerPodOverlay | None") -> dict[str, str]:
    """spec.nodeSelector (`service`) with spec.server.pod.nodeSelector merged in (pools are derived from, and pinned
    to, both); a key the two set to different values is refused."""
    extra = (pod.node_selector if pod else None) or {}
    for key, value in extra.items():
        if service.get(key, value) != value:
            raise SpecError(f"{SERVER_FIELD}.nodeSelector.{key}", f"is {value!r}, but spec.nodeSelector sets it to {service[key]!r}")
    check_labels(extra, f"{SERVER_FIELD}.nodeSelector")
    return {**service, **extra}


class Quantity:
    """A Kubernetes quantity (int-or-string, e.g. 2, "500m", "4Gi"): its own schema and parser (schema.py's hook)."""

    __openapi_schema__ = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

    @staticmethod
    def __parse_spec__(value: Any, path: str) -> Any:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and _QUANTITY.match(value))
        if not ok:
            raise SpecError(path, f"must be a Kubernetes quantity (e.g. 2, 500m, 4Gi), got {value!r}")
        return value


class Volume:
    """A Kubernetes Volume, kept as written: its name is checked here, its source (one of some thirty kinds) by the
    API server when the pod is applied. The one place the CRD keeps unknown fields: a full schema of every volume
    source would be most of the CRD."""

    # no `properties`: kubeconform's schema conversion would close the object to every other key (a volume source)
    __openapi_schema__ = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

    @staticmethod
    def __parse_spec__(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise SpecError(path, "must be an object (a Kubernetes Volume)")
        name = value.get("name")
        if not isinstance(name, str) or not re.fullmatch(DNS_LABEL, name) or len(name) > 63:
            raise SpecError(f"{path}.name", f"must be a DNS label, got {name!r}")
        if len(value) < 2:
            raise SpecError(path, "needs a volume source beside its name (emptyDir, secret, configMap, persistentVolumeClaim, ...)")
        return copy.deepcopy(value)


# ---- Kubernetes' shapes, field for field (tests/test_operator_pod_overlay.py holds them against its schemas) ----

@dataclass(kw_only=True)
class Toleration:
    """A core/v1 Toleration."""

    key: Optional[str] = prop(None, doc="Taint key the toleration applies to; empty with operator Exists matches every key.")
    operator: Optional[str] = prop(None, doc="Exists or Equal (default Equal).")
    value: Optional[str] = prop(None, doc="Taint value the toleration matches (operator Equal).")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = prop(None, doc="Taint effect to match; empty matches all.")
    toleration_seconds: Optional[int] = prop(None, doc="NoExecute only: how long the pod stays bound after the taint appears.",
                                             format="int64")


@dataclass(kw_only=True)
class LabelSelectorRequirement:
    """A meta/v1 LabelSelectorRequirement."""

    key: str = prop(doc="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = prop(doc="How the key relates to the values.")
    values: Optional[list[str]] = prop(None, doc="Values (In, NotIn).")


@dataclass(kw_only=True)
class LabelSelector:
    """A meta/v1 LabelSelector."""

    match_labels: Optional[dict[str, str]] = prop(None, doc="Labels a pod must carry.")
    match_expressions: Optional[list[LabelSelectorRequirement]] = prop(None, doc="Requirements, ANDed.")


@dataclass(kw_only=True)
class NodeSelectorRequirement:
    """A core/v1 NodeSelectorRequirement."""

    key: str = prop(doc="Label key (matchExpressions) or field name (matchFields).")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = prop(doc="How the key relates to the values.")
    values: Optional[list[str]] = prop(None, doc="Values (In, NotIn: any number; Gt, Lt: one integer).")


@dataclass(kw_only=True)
class NodeSelectorTerm:
    """A core/v1 NodeSelectorTerm: its requirements are ANDed."""

    match_expressions: Optional[list[NodeSelectorRequirement]] = prop(None, doc="Requirements on node labels.")
    match_fields: Optional[list[NodeSelectorRequirement]] = prop(None, doc="Requirements on node fields.")


@dataclass(kw_only=True)
class NodeSelector:
    """A core/v1 NodeSelector: its terms are ORed."""

    node_selector_terms: list[NodeSelectorTerm] = prop(doc="Terms; a node matching any of them is chosen.")


@dataclass(kw_only=True)
class PreferredSchedulingTerm:
    """A core/v1 PreferredSchedulingTerm."""

    weight: int = prop(doc="Weight, 1 to 100.", minimum=1, maximum=100)
    preference: NodeSelectorTerm = prop(doc="The nodes preferred.")


@dataclass(kw_only=True)
class NodeAffinity:
    """A core/v1 NodeAffinity."""

    required_during_scheduling_ignored_during_execution: Optional[NodeSelector] = prop(
        None, doc="Nodes the pod must land on; ANDed with the operator's own pool term (each of your terms gets it).")
    preferred_during_scheduling_ignored_during_execution: Optional[list[PreferredSchedulingTerm]] = prop(
        None, doc="Nodes the scheduler prefers.")


@dataclass(kw_only=True)
class PodAffinityTerm:
    """A core/v1 PodAffinityTerm."""

    label_selector: Optional[LabelSelector] = prop(None, doc="The pods this term is about.")
    namespace_selector: Optional[LabelSelector] = prop(None, doc="Namespaces the pods are looked for in.")
    namespaces: Optional[list[str]] = prop(None, doc="Namespace names the pods are looked for in.")
    topology_key: str = prop(doc="Node label whose value defines the topology domain (e.g. kubernetes.io/hostname).")
    match_label_keys: Optional[list[str]] = prop(None, doc="Pod label keys whose values are ANDed into labelSelector.")
    mismatch_label_keys: Optional[list[str]] = prop(None, doc="Pod label keys whose values must differ.")


@dataclass(kw_only=True)
class WeightedPodAffinityTerm:
    """A core/v1 WeightedPodAffinityTerm."""

    weight: int = prop(doc="Weight, 1 to 100.", minimum=1, maximum=100)
    pod_affinity_term: PodAffinityTerm = prop(doc="The term.")


@dataclass(kw_only=True)
class PodAffinity:
    """A core/v1 PodAffinity (or PodAntiAffinity: the same shape)."""

    required_during_scheduling_ignored_during_execution: Optional[list[PodAffinityTerm]] = prop(None, doc="Hard terms.")
    preferred_during_scheduling_ignored_during_execution: Optional[list[WeightedPodAffinityTerm]] = prop(None, doc="Soft terms.")


@dataclass(kw_only=True)
class Affinity:
    """A core/v1 Affinity."""

    node_affinity: Optional[NodeAffinity] = prop(None, doc="Node affinity, added to the operator's (pool pinning).")
    pod_affinity: Optional[PodAffinity] = prop(None, doc="Pod affinity.")
    pod_anti_affinity: Optional[PodAffinity] = prop(None, doc="Pod anti-affinity.")


@dataclass(kw_only=True)
class TopologySpreadConstraint:
    """A core/v1 TopologySpreadConstraint."""

    max_skew: int = prop(doc="Most the pod count may differ between two domains.", minimum=1, format="int32")
    topology_key: str = prop(doc="Node label whose value defines the domain.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = prop(doc="What to do when the skew cannot be kept.")
    label_selector: Optional[LabelSelector] = prop(None, doc="The pods counted.")
    min_domains: Optional[int] = prop(None, doc="Fewest eligible domains (DoNotSchedule).", minimum=1, format="int32")
    node_affinity_policy: Optional[Literal["Honor", "Ignore"]] = prop(None, doc="Whether nodeAffinity/nodeSelector limit the domains.")
    node_taints_policy: Optional[Literal["Honor", "Ignore"]] = prop(None, doc="Whether taints limit the domains.")
    match_label_keys: Optional[list[str]] = prop(None, doc="Pod label keys whose values are ANDed into labelSelector.")


@dataclass(kw_only=True)
class KeySelector:
    """A core/v1 ConfigMapKeySelector or SecretKeySelector."""

    name: Optional[str] = prop(None, doc="ConfigMap or Secret name (same namespace).")
    key: str = prop(doc="Key within it.")
    optional: Optional[bool] = prop(None, doc="Whether it may be missing.")


@dataclass(kw_only=True)
class ObjectFieldSelector:
    """A core/v1 ObjectFieldSelector."""

    api_version: Optional[str] = prop(None, doc="Schema version fieldPath is written in (default v1).")
    field_path: str = prop(doc="A field of the pod, e.g. metadata.name, status.hostIP.")


@dataclass(kw_only=True)
class ResourceFieldSelector:
    """A core/v1 ResourceFieldSelector."""

    container_name: Optional[str] = prop(None, doc="Container (default: this one).")
    resource: str = prop(doc="limits.cpu, requests.memory, ...")
    divisor: Optional[Quantity] = prop(None, doc="Unit of the value (default 1).")


@dataclass(kw_only=True)
class FileKeySelector:
    """A core/v1 FileKeySelector."""

    volume_name: str = prop(doc="An emptyDir volume of the pod.")
    path: str = prop(doc="File in it, relative.")
    key: str = prop(doc="Key in the file (KEY=VALUE lines).")
    optional: Optional[bool] = prop(None, doc="Whether it may be missing.")


@dataclass(kw_only=True)
class EnvVarSource:
    """A core/v1 EnvVarSource."""

    field_ref: Optional[ObjectFieldSelector] = prop(None, doc="A field of the pod.")
    resource_field_ref: Optional[ResourceFieldSelector] = prop(None, doc="A container's resource.")
    config_map_key_ref: Optional[KeySelector] = prop(None, doc="A ConfigMap key.")
    secret_key_ref: Optional[KeySelector] = prop(None, doc="A Secret key.")
    file_key_ref: Optional[FileKeySelector] = prop(None, doc="A key in a file of an emptyDir.")


@dataclass(kw_only=True)
class EnvVar:
    """A core/v1 EnvVar."""

    name: str = prop(doc="Variable name; one the operator sets is refused (docs/pod-overlays.md).", pattern=ENV_NAME)
    value: Optional[str] = prop(None, doc="Value ($(VAR) references expand).")
    value_from: Optional[EnvVarSource] = prop(None, doc="Where the value comes from instead.")


@dataclass(kw_only=True)
class EnvSourceRef:
    """A core/v1 ConfigMapEnvSource or SecretEnvSource."""

    name: Optional[str] = prop(None, doc="ConfigMap or Secret name (same namespace).")
    optional: Optional[bool] = prop(None, doc="Whether it may be missing.")


@dataclass(kw_only=True)
class EnvFromSource:
    """A core/v1 EnvFromSource."""

    prefix: Optional[str] = prop(None, doc="Prepended to every key.")
    config_map_ref: Optional[EnvSourceRef] = prop(None, doc="Every key of a ConfigMap.")
    secret_ref: Optional[EnvSourceRef] = prop(None, doc="Every key of a Secret.")


@dataclass(kw_only=True)
class VolumeMount:
    """A core/v1 VolumeMount (of the main container)."""

    name: str = prop(doc="A volume of the pod: one of yours (volumes), or one of the operator's.")
    mount_path: str = prop(doc="Path in the container; one the operator mounts is refused.", pattern="^/.*$")
    read_only: Optional[bool] = prop(None, doc="Mount read-only.")
    sub_path: Optional[str] = prop(None, doc="Path within the volume (default: its root).")
    sub_path_expr: Optional[str] = prop(None, doc="subPath with $(VAR) references expanded.")
    mount_propagation: Optional[Literal["None", "HostToContainer", "Bidirectional"]] = prop(None, doc="Mount propagation.")
    recursive_read_only: Optional[Literal["Disabled", "IfPossible", "Enabled"]] = prop(None, doc="Recursive read-only (readOnly true).")


@dataclass(kw_only=True)
class ResourceRequirements:
    """A core/v1 ResourceRequirements (requests and limits)."""

    requests: Optional[dict[str, Quantity]] = prop(None, doc="Amounts requested, by resource name.")
    limits: Optional[dict[str, Quantity]] = prop(None, doc="Amounts allowed, by resource name.")


@dataclass(kw_only=True)
class LocalObjectReference:
    """A core/v1 LocalObjectReference."""

    name: str = prop(doc="Object name (same namespace).", pattern=DNS_SUBDOMAIN, maxLength=253)


# ---- the overlays ----

_LIST = 64  # items per list field: bounded, as everything in the CRD


@dataclass(kw_only=True)
class PodOverlay:
    """Pod fields added to the operator's pods, in Kubernetes' own names and shapes (docs/pod-overlays.md)."""

    labels: Optional[dict[str, str]] = prop(None, doc="Pod labels, beside the operator's (whose keys are refused).")
    annotations: Optional[dict[str, str]] = prop(None, doc="Pod annotations, beside the operator's.")
    node_selector: Optional[dict[str, str]] = prop(
        None, doc="Node labels the pods need (server pods: merged with spec.nodeSelector, which picks the pools too; a key set there to another value is refused).")
    tolerations: Optional[list[Toleration]] = prop(None, doc="Tolerations, after the operator's.", maxItems=_LIST)
    affinity: Optional[Affinity] = prop(None, doc="Affinity; required node terms are ANDed with the operator's.")
    topology_spread_constraints: Optional[list[TopologySpreadConstraint]] = prop(
        None, doc="Spread constraints, after the operator's (kubernetes.io/hostname, ScheduleAnyway).", maxItems=_LIST)
    env: Optional[list[EnvVar]] = prop(None, doc="Main container env, after the operator's (its names are refused).", maxItems=256)
    env_from: Optional[list[EnvFromSource]] = prop(None, doc="Main container envFrom (env, the operator's included, wins).",
                                                   maxItems=_LIST)
    image_pull_secrets: Optional[list[LocalObjectReference]] = prop(None, doc="Secrets to pull the pods' images with.",
                                                                    maxItems=_LIST)
    priority_class_name: Optional[str] = prop(None, doc="PriorityClass of the pods.", pattern=DNS_SUBDOMAIN, maxLength=253)
    runtime_class_name: Optional[str] = prop(None, doc="RuntimeClass of the pods (e.g. nvidia).", pattern=DNS_SUBDOMAIN,
                                             maxLength=253)
    volumes: Optional[list[Volume]] = prop(None, doc="Pod volumes, beside the operator's (whose names are refused).",
                                           maxItems=_LIST)
    volume_mounts: Optional[list[VolumeMount]] = prop(None, doc="Mounts of the main container, beside the operator's.",
                                                      maxItems=_LIST)


@dataclass(kw_only=True)
class ServerPodOverlay(PodOverlay):
    """Server pods of every pool: Kubernetes pod fields added to the operator's (docs/pod-overlays.md)."""

    service_account_name: Optional[str] = prop(
        None, doc="ServiceAccount of the server pods (its token is still not mounted: the engines never call the API).",
        pattern=DNS_SUBDOMAIN, maxLength=253)
    resources: Optional[ResourceRequirements] = prop(
        None, doc=("Extra resources of the server container (e.g. rdma/hca). cpu, memory, ephemeral-storage and the GPU "
                   "are the sizing's: a different value is refused."))


@dataclass(kw_only=True)
class RouterPodOverlay(PodOverlay):
    """Router pods (proxy mode) or endpoint-picker pods (gateway mode): pod fields added to the operator's."""

    resources: Optional[ResourceRequirements] = prop(
        None, doc="Requests and limits of the router container, replacing the operator's per resource (1-2 CPU, 2Gi).")
