"""Gateway mode (spec.router.mode: gateway): pure builders of the InferencePool, the `warmfleet epp` endpoint picker's
objects and the HTTPRoute, and the status they add; no kopf, no I/O (reconcile.py reads the cluster)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from warmfleet.operator.planning import objects, router_objects
from warmfleet.operator.planning.engine_descriptions import HTTP_PORT
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.server.flagfields import flag_of, to_args
from warmfleet.server.router.epp.settings import DRAIN_GRACE_S, EppSettings, GRPC_PORT
from warmfleet.server.router.epp.settings import HTTP_PORT as EPP_HTTP_PORT

# The kinds gateway mode writes, and the CRDs that serve them (a cluster may lack either: reconcile.py asks discovery)
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
HTTPROUTE_API = "gateway.networking.k8s.io/v1"
GIE_CRD = "inferencepools.inference.networking.k8s.io"
HTTPROUTE_CRD = "httproutes.gateway.networking.k8s.io"
GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension@v1.6.0"  # the CRD version our InferencePool is written for
GATEWAY_API_MODULE = "sigs.k8s.io/gateway-api@v1.6.3"
GIE_CRD_URL = "https://github.com/kubernetes-sigs/gateway-api-inference-extension/config/crd?ref=v1.6.0"  # kubectl apply -k
GATEWAY_API_CRD_URL = "https://github.com/kubernetes-sigs/gateway-api/config/crd?ref=v1.6.3"

# Ready=False reasons of a cluster that lacks a CRD (service_status.py): a Warning Event and a retry with backoff
GIE_MISSING = "GatewayAPIInferenceExtensionMissing"
GATEWAY_API_MISSING = "GatewayAPIMissing"
CONDITION_TYPES = ("InferencePoolReady", "EndpointPickerReady", "HTTPRouteReady")

# How the endpoint picker is started: the EppSettings fields the operator sets, in this order. Every router field
# but `peers` (the EPP's HTTP side, as settings.py declares it, serves no peer-load route: docs/gateway.md), plus
# the EPP's two ports.
EPP_COMMAND = ["warmfleet", "epp"]
EPP_FIELDS = ("discover_service", "host", "port", "http_port", "model", "policy.epsilon", "engine", "block_size",
              "drain_grace_s", "max_choices_per_request", "limit_mm_per_prompt")  # the last two: where the pools set theirs
# The gateway's timeout for one request: long generations stream for minutes (HTTPRoute rules[].timeouts.request)
ROUTE_REQUEST_TIMEOUT = "600s"


def names(owner: objects.Owner) -> dict[str, str]:
    """Names of the gateway-mode children: the pool and route carry the service's name, the EPP's objects `-epp`."""
    return {"pool": objects.k8s_name(owner.name), "route": objects.k8s_name(owner.name), "epp": objects.k8s_name(owner.name, "epp")}


def epp_settings(owner: objects.Owner, spec: InferenceServiceSpec) -> EppSettings:
    """What the endpoint picker runs with: the router's `front_door_values`, the gRPC port (TLS, self-signed: the
    picker's default, as GIE's reference picker), the HTTP side port, and the drain that fits the pod's grace."""
    return EppSettings(**router_objects.front_door_values(owner, spec), port=GRPC_PORT, http_port=EPP_HTTP_PORT,
                       drain_grace_s=DRAIN_GRACE_S)  # within the pod's grace: router_objects.FRONT_DOOR_GRACE_S


def epp_args(owner: objects.Owner, spec: InferenceServiceSpec) -> list[str]:
    """`warmfleet epp` arguments: EPP_FIELDS of `epp_settings`, rendered by the settings' own flags."""
    return [*EPP_COMMAND[1:], *to_args(epp_settings(owner, spec), EPP_FIELDS)]


PICKER_TLS_VOLUME, PICKER_TLS_MOUNT = "picker-tls", "/etc/warmfleet/picker-tls"  # spec.router.pickerCertificate


def picker_certificate(spec: InferenceServiceSpec) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """spec.router.pickerCertificate as the picker takes it: (its --tls-* flags, the Secret volume, its mount); all
    empty without one (the picker's self-signed certificate)."""
    cert = spec.router.picker_certificate
    if cert is None:
        return [], [], []
    items = [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]
    args = [flag_of(EppSettings, "tls_cert_file"), f"{PICKER_TLS_MOUNT}/tls.crt",
            flag_of(EppSettings, "tls_key_file"), f"{PICKER_TLS_MOUNT}/tls.key"]
    if cert.verify_clients_with:
        items.append({"key": cert.verify_clients_with, "path": "client-ca.crt"})
        args += [flag_of(EppSettings, "tls_client_ca_file"), f"{PICKER_TLS_MOUNT}/client-ca.crt"]
    volume = {"name": PICKER_TLS_VOLUME, "secret": {"secretName": cert.secret_name, "defaultMode": 0o440,
                                                    "items": items}}
    return args, [volume], [{"name": PICKER_TLS_VOLUME, "mountPath": PICKER_TLS_MOUNT, "readOnly": True}]


def epp_deployment(owner: objects.Owner, spec: InferenceServiceSpec, image: str) -> dict[str, Any]:
    """The endpoint picker's Deployment: the router's pod (front_door_deployment) running `warmfleet epp`, with HTTP
    probes on its side port (/ready: a replica is routable, as the gRPC readiness service says): the kubelet's gRPC
    probes speak no TLS, and the gRPC port serves only TLS."""
    tls_args, tls_volumes, tls_mounts = picker_certificate(spec)
    dep = router_objects.front_door_deployment(owner, spec, image, router_objects.FrontDoorPod(
        name=names(owner)["epp"], component="epp", command=[EPP_COMMAND[0], *epp_args(owner, spec), *tls_args],
        ports=[{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
               {"name": "http", "containerPort": EPP_HTTP_PORT, "protocol": "TCP"}],
        probes={"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                                  "failureThreshold": 3}},
    ))
    pod = dep["spec"]["template"]["spec"]
    pod["volumes"] = [*pod.get("volumes", []), *tls_volumes]
    pod["containers"][0]["volumeMounts"] = [*pod["containers"][0].get("volumeMounts", []), *tls_mounts]
    return dep


def epp_service(owner: objects.Owner) -> dict[str, Any]:
    """The Service endpointPickerRef names: gRPC (HTTP/2 over TLS, as GIE's reference picker serves it: `http2`, not
    `kubernetes.io/h2c`, which would claim cleartext) and `http` (/metrics, the port the chart's ServiceMonitor
    scrapes on every Service of ours)."""
    return objects.service(owner, names(owner)["epp"], "epp", router_objects.front_door_selector(owner, "epp"), [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"},
        {"name": "http", "port": EPP_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
    ])


def epp_rbac(owner: objects.Owner) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding of the endpoint picker: get/list/watch EndpointSlices, all it reads."""
    return router_objects.front_door_rbac(owner, names(owner)["epp"], "epp")


def epp_pdb(owner: objects.Owner) -> dict[str, Any]:
    """At most one endpoint picker down in a voluntary disruption (rendered for spec.router.replicas > 1)."""
    return router_objects.front_door_pdb(owner, names(owner)["epp"], "epp")


def inference_pool(owner: objects.Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The InferencePool (GIE v1): every server pod of the service (all node pools) on the engines' HTTP port, its
    endpoint picker the EPP Service's gRPC port, failing open or closed as spec.router.failureMode says."""
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": objects.meta(owner, names(owner)["pool"], "gateway"),
        "spec": {
            "selector": {"matchLabels": objects.server_selector(owner)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": names(owner)["epp"], "port": {"number": GRPC_PORT},
                                  "failureMode": spec.router.failure_mode},
        },
    }


# The paths the HTTPRoute sends to the pool: the OpenAI routes `warmfleet route` serves too (a test checks they are
# its OPENAI_ROUTES), so the servers' admin routes (LoRA load/unload, drain) are not reachable through the gateway.
PUBLIC_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize")


def http_route(owner: objects.Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """An HTTPRoute from spec.router.gateway's Gateway (listener sectionName, if set) to the InferencePool: the
    OpenAI paths only (PUBLIC_PATHS)."""
    gw = spec.router.gateway
    assert gw is not None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw.name}
    if gw.namespace:
        parent["namespace"] = gw.namespace
    if gw.section_name:
        parent["sectionName"] = gw.section_name
    return {
        "apiVersion": HTTPROUTE_API,
        "kind": "HTTPRoute",
        "metadata": objects.meta(owner, names(owner)["route"], "gateway"),
        "spec": {
            "parentRefs": [parent],
            "rules": [{
                "matches": [{"path": {"type": "Exact", "value": path}} for path in PUBLIC_PATHS],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": names(owner)["pool"]}],
                "timeouts": {"request": ROUTE_REQUEST_TIMEOUT},
            }],
        },
    }


def gateway_children(owner: objects.Owner, spec: InferenceServiceSpec, image: str) -> list[dict[str, Any]]:
    """Gateway mode's objects after the shared ones, in apply order: EPP (PDB if several), its Service, the pool, the route."""
    objs = [epp_pdb(owner)] if spec.router.replicas > 1 else []
    objs += [epp_deployment(owner, spec, image), epp_service(owner), inference_pool(owner, spec)]
    if spec.router.gateway is not None:
        objs.append(http_route(owner, spec))
    return objs


# ---- status ----

@dataclass(frozen=True)
class GatewayState:
    """What a reconcile observed of gateway mode's objects (passes/reconcile.py), the input of its conditions (service_status.py)."""

    pool: str  # InferencePool name
    epp: str  # endpoint picker Deployment/Service name
    failure_mode: str
    pool_served: bool  # the cluster serves inference.networking.k8s.io/v1 inferencepools
    route_wanted: bool  # spec.router.gateway is set
    route_served: bool  # the cluster serves gateway.networking.k8s.io/v1 httproutes
    epp_ready: int  # ready endpoint-picker pods
    gateway: str = ""  # "namespace/name" of spec.router.gateway
    route_accepted: Optional[bool] = None  # the Gateway's verdict in the HTTPRoute's status.parents (None: none yet)
    route_message: str = ""
    endpoint: str = ""  # the Gateway's OpenAI base URL, once it has an address

    @property
    def pool_missing(self) -> Optional[tuple[str, str]]:
        """(reason, message) when the cluster does not serve InferencePool, else None."""
        if self.pool_served:
            return None
        return GIE_MISSING, (
            f"the cluster does not serve InferencePool ({INFERENCE_POOL_API}, CRD {GIE_CRD}): install the Gateway API "
            f"Inference Extension CRDs, e.g. kubectl apply -k \"{GIE_CRD_URL}\" (config/crd/bases of {GIE_MODULE}; "
            "docs/gateway.md); the operator retries with backoff")

    @property
    def route_missing(self) -> Optional[tuple[str, str]]:
        """(reason, message) when spec.router.gateway asks for an HTTPRoute the cluster does not serve, else None."""
        if not self.route_wanted or self.route_served:
            return None
        return GATEWAY_API_MISSING, (
            f"spec.router.gateway is set but the cluster does not serve HTTPRoute ({HTTPROUTE_API}, CRD {HTTPROUTE_CRD}): "
            f"install the Gateway API standard CRDs, e.g. kubectl apply -k \"{GATEWAY_API_CRD_URL}\" (config/crd/standard "
            f"of {GATEWAY_API_MODULE}; a gateway's own install usually brings them); the operator retries with backoff")

    @property
    def missing(self) -> Optional[tuple[str, str]]:
        """(reason, message) of the first CRD this service needs that the cluster does not serve, else None."""
        return self.pool_missing or self.route_missing


def gateway_state(owner: objects.Owner, spec: InferenceServiceSpec, live: Mapping[tuple[str, str], Mapping[str, Any]], *,
                  pool_served: bool, route_served: bool, gateway_obj: Mapping[str, Any] | None) -> GatewayState:
    """GatewayState from the applied objects (`live`, keyed by (kind, name)) and the Gateway as read (None: unknown)."""
    n = names(owner)
    dep = live.get(("Deployment", n["epp"])) or {}
    gw = spec.router.gateway
    gw_ns = (gw.namespace or owner.namespace) if gw else ""
    accepted, message = None, ""
    route = live.get(("HTTPRoute", n["route"]))
    if gw is not None and route is not None:
        accepted, message = route_verdict(route, gw.name, gw_ns, owner.namespace)
    return GatewayState(
        pool=n["pool"], epp=n["epp"], failure_mode=spec.router.failure_mode, pool_served=pool_served,
        route_wanted=gw is not None, route_served=route_served,
        epp_ready=int((dep.get("status") or {}).get("readyReplicas") or 0),
        gateway=f"{gw_ns}/{gw.name}" if gw else "", route_accepted=accepted, route_message=message,
        endpoint=gateway_endpoint(gateway_obj, gw.section_name if gw else None) if gateway_obj else "",
    )


def route_verdict(route: Mapping[str, Any], gateway: str, gateway_ns: str, route_ns: str) -> tuple[Optional[bool], str]:
    """The Accepted condition the Gateway's controller wrote for our parentRef in the HTTPRoute's status, if any."""
    for parent in ((route.get("status") or {}).get("parents") or []):
        ref = parent.get("parentRef") or {}
        if ref.get("name") != gateway or (ref.get("namespace") or route_ns) != gateway_ns:
            continue
        for cond in parent.get("conditions") or []:
            if cond.get("type") == "Accepted":
                return cond.get("status") == "True", str(cond.get("message") or cond.get("reason") or "")
    return None, ""


def gateway_endpoint(gateway: Mapping[str, Any], section_name: str | None) -> str:
    """The OpenAI base URL of a Gateway: its first status address and the port of the listener the route attaches to
    (sectionName, else the first HTTP or HTTPS one); "" while it has no address."""
    addresses = [a.get("value") for a in ((gateway.get("status") or {}).get("addresses") or []) if a.get("value")]
    listeners = [li for li in ((gateway.get("spec") or {}).get("listeners") or [])
                 if (li.get("name") == section_name if section_name else li.get("protocol") in ("HTTP", "HTTPS"))]
    if not addresses or not listeners:
        return ""
    host, listener = str(addresses[0]), listeners[0]
    scheme = "https" if listener.get("protocol") == "HTTPS" else "http"
    port = int(listener.get("port") or (443 if scheme == "https" else 80))
    if ":" in host:  # IPv6
        host = f"[{host}]"
    default = 443 if scheme == "https" else 80
    return f"{scheme}://{host}{'' if port == default else f':{port}'}/v1"
