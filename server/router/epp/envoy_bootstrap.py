"""`warmfleet envoy-bootstrap`: an Envoy bootstrap that routes an InferencePool's traffic through `warmfleet epp`,
as GIE gateways configure it; a pure builder (dicts), stdlib only.

    listener ─ HTTP connection manager (x-request-id kept from the client, made when absent, returned)
                 ├ ext_proc filter ──gRPC (HTTP/2 over TLS)──▶ EPP   headers SEND, bodies FULL_DUPLEX_STREAMED,
                 │                                          trailers SEND (that body mode needs them); TLS as the
                 │                                          EPP serves it by default (its certificate verified
                 │                                          with --epp-ca-file, else not: self-signed), a client
                 │                                          certificate with --epp-client-cert-file; or h2c
                 │                                          (--epp-plaintext, for `warmfleet epp --no-secure-serving`)
                 └ router: retried on connect failure / reset / 503 (another host each time); the response carries
                   the endpoint that served it (x-gateway-destination-endpoint-served, read and removed by the EPP)
                     --lb override-host (default; needs the pool's endpoints, --endpoint): one STATIC cluster whose
                         override_host policy reads x-gateway-destination-endpoint = "ip:port,ip:port,..." and walks
                         the list on each retry; no pick (EPP down, failure_mode_allow) → round-robin over the pool
                     --lb original-dst: an ORIGINAL_DST cluster reading the host from that header (one ip:port only:
                         Envoy 1.40 cannot parse a list there, so run the EPP with --max-attempts 1 and retries go
                         to the same host); no pick → the pool round-robin (--endpoint) or a 503

A command of its own, not an `epp` flag: it needs no model or replicas and loads nothing of the router, so a
gateway's config can be rendered (and tested) anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Optional

DESTINATION = "x-gateway-destination-endpoint"  # epp/pick.py names the same headers (it imports the protos)
SERVED = "x-gateway-destination-endpoint-served"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # the EPP's gRPC health service of that name
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
ROUND_ROBIN = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
LB_KINDS = ("override-host", "original-dst")
HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
RETRY_PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"


@dataclass(frozen=True)
class GatewayConfig:
    """What the bootstrap varies; the defaults are the GIE gateways' choices."""

    epp: str = "127.0.0.1:9002"  # host:port of `warmfleet epp --port`
    listen_host: str = "0.0.0.0"
    listen_port: int = 8081
    admin_port: Optional[int] = 9901  # None: no admin listener
    failure_mode_allow: bool = False  # EPP unreachable: False → the gateway answers 500; True → the pool round-robin
    message_timeout_s: float = 5.0  # one ext_proc message's answer (the pick waits for the body and the render)
    num_retries: int = 2  # to the next endpoint of the pick's list (the EPP's --max-attempts minus one)
    connect_timeout_s: float = 1.0
    epp_health_interval_s: float = 1.0  # gRPC health checks of the EPP
    endpoints: list[str] = field(default_factory=list)  # ip:port of the pool's endpoints (override-host, fail open)
    lb: str = "override-host"  # "override-host" | "original-dst"
    request_body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED (then the EPP answers in the body response)
    response_body_mode: str = "FULL_DUPLEX_STREAMED"
    epp_tls: bool = True  # the EPP serves TLS (`warmfleet epp`'s default, as GIE's reference picker)
    epp_ca_file: Optional[str] = None  # verify the EPP's certificate against this CA (None: unverified, self-signed)
    epp_client_cert_file: Optional[str] = None  # this gateway's certificate, for an EPP with --tls-client-ca-file
    epp_client_key_file: Optional[str] = None


def _socket(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


def ext_proc_filter(c: GatewayConfig) -> dict:
    trailers = "SEND" if "FULL_DUPLEX_STREAMED" in (c.request_body_mode, c.response_body_mode) else "SKIP"
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
        "failure_mode_allow": c.failure_mode_allow,
        "message_timeout": f"{c.message_timeout_s}s",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": c.request_body_mode, "response_body_mode": c.response_body_mode,
                            "request_trailer_mode": trailers, "response_trailer_mode": trailers},
        # the subset hint (and envoy.lb) reach the EPP as metadata_context when something upstream sets them
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]}},
    }}


def routes(c: GatewayConfig) -> list[dict]:
    retry = {
        "retry_on": "connect-failure,refused-stream,reset-before-request,unavailable,retriable-status-codes",
        "retriable_status_codes": [503],
        "num_retries": c.num_retries,
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                  "typed_config": {"@type": RETRY_PREVIOUS_HOSTS}}],
        "host_selection_retry_max_attempts": 5,
    }
    served = [{"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
               "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    # timeout 0s: a generation streams for as long as it takes
    if c.lb == "override-host":
        return [{"match": {"prefix": "/"}, "route": {"cluster": "inference_pool", "timeout": "0s", "retry_policy": retry},
                 "response_headers_to_add": served}]
    picked = {"match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
              "route": {"cluster": "inference_pool", "timeout": "0s", "retry_policy": retry},
              "response_headers_to_add": served}
    if c.endpoints:
        unpicked = {"match": {"prefix": "/"}, "route": {"cluster": "inference_pool_fallback", "timeout": "0s"}}
    else:
        unpicked = {"match": {"prefix": "/"}, "direct_response": {"status": 503, "body": {
            "inline_string": json.dumps({"error": {"message": "no endpoint picked", "type": "service_unavailable",
                                                   "code": 503}})}}}
    return [picked, unpicked]


def _static(name: str, c: GatewayConfig) -> dict:
    return {"name": name, "type": "STATIC", "connect_timeout": f"{c.connect_timeout_s}s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _socket(*_hostport(e))}} for e in c.endpoints]}]}}


def epp_transport_socket(c: GatewayConfig) -> Optional[dict]:
    """TLS to the EPP (HTTP/2 by ALPN), None for h2c."""
    if not c.epp_tls:
        return None
    common: dict = {"alpn_protocols": ["h2"]}
    if c.epp_client_cert_file:
        common["tls_certificates"] = [{"certificate_chain": {"filename": c.epp_client_cert_file},
                                       "private_key": {"filename": c.epp_client_key_file}}]
    if c.epp_ca_file:
        common["validation_context"] = {"trusted_ca": {"filename": c.epp_ca_file}}
    return {"name": "envoy.transport_sockets.tls", "typed_config": {"@type": UPSTREAM_TLS, "common_tls_context": common}}


def clusters(c: GatewayConfig) -> list[dict]:
    host, port = _hostport(c.epp)
    out = [
        {"name": "epp", "type": "STRICT_DNS", "connect_timeout": f"{c.connect_timeout_s}s",
         # gRPC health of the ext_proc service (SERVING while a replica is routable) and no panic routing: an EPP
         # that is down or has nothing to route to is known before a request opens a stream to it, so
         # failure_mode_allow applies before any body chunk is on its way (Envoy cannot fail open after that in
         # FULL_DUPLEX_STREAMED: it keeps no copy of the chunks)
         "health_checks": [{"timeout": "1s", "interval": f"{c.epp_health_interval_s}s", "unhealthy_threshold": 1,
                            "healthy_threshold": 1, "no_traffic_interval": f"{c.epp_health_interval_s}s",
                            "grpc_health_check": {"service_name": EXT_PROC_SERVICE}}],
         "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
         "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
             "@type": HTTP_OPTIONS, "explicit_http_config": {"http2_protocol_options": {}}}},
         "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": _socket(host, port)}}]}]}},
    ]
    tls = epp_transport_socket(c)
    if tls is not None:
        out[0]["transport_socket"] = tls
    if c.lb == "override-host":
        if not c.endpoints:
            raise ValueError("--lb override-host needs the pool's endpoints (--endpoint IP:PORT, repeatable)")
        pool = _static("inference_pool", c)
        pool["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {"@type": OVERRIDE_HOST,
                             "override_host_sources": [{"header": DESTINATION},
                                                       {"metadata": {"key": "envoy.lb",
                                                                     "path": [{"key": DESTINATION}]}}],
                             "fallback_policy": {"policies": [{"typed_extension_config": {
                                 "name": "envoy.load_balancing_policies.round_robin",
                                 "typed_config": {"@type": ROUND_ROBIN}}}]}}}}]}
        return out + [pool]
    out.append({"name": "inference_pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": f"{c.connect_timeout_s}s",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}})
    if c.endpoints:
        out.append({**_static("inference_pool_fallback", c), "lb_policy": "ROUND_ROBIN"})
    return out


def bootstrap(c: GatewayConfig) -> dict:
    """The whole bootstrap (`envoy -c FILE.json`)."""
    if bool(c.epp_client_cert_file) != bool(c.epp_client_key_file):
        raise ValueError("--epp-client-cert-file and --epp-client-key-file go together")
    if not c.epp_tls and (c.epp_ca_file or c.epp_client_cert_file):
        raise ValueError("--epp-plaintext contradicts --epp-ca-file/--epp-client-cert-file")
    # x-request-id: a client's is kept (Envoy would replace an external one), one is made when absent, and the
    # answer carries it back; traceparent/tracestate pass untouched (no tracer configured here)
    hcm = {"@type": HCM, "stat_prefix": "gateway", "use_remote_address": True,
           "stream_idle_timeout": "0s", "preserve_external_request_id": True,
           "always_set_request_id_in_response": True,
           "route_config": {"name": "inference", "virtual_hosts": [
               {"name": "pool", "domains": ["*"], "routes": routes(c)}]},
           "http_filters": [ext_proc_filter(c), {"name": "envoy.filters.http.router",
                                                 "typed_config": {"@type": ROUTER}}]}
    out: dict = {"static_resources": {
        "listeners": [{"name": "gateway", "address": _socket(c.listen_host, c.listen_port),
                       "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                       "typed_config": hcm}]}]}],
        "clusters": clusters(c)}}
    if c.admin_port is not None:
        out["admin"] = {"address": _socket("127.0.0.1", c.admin_port)}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    p.add_argument("--epp", default=d.epp, help="host:port of the EPP's gRPC port.")
    p.add_argument("--listen-host", default=d.listen_host, help="Address the gateway listens on.")
    p.add_argument("--listen-port", type=int, default=d.listen_port, help="Port the gateway listens on.")
    p.add_argument("--admin-port", type=int, default=d.admin_port, help="Envoy admin port on 127.0.0.1 (0: none).")
    p.add_argument("--failure-mode-allow", action="store_true",
                   help="Let requests through when the EPP is unreachable (to --fallback-endpoint, else a 503); "
                   "default: the gateway answers 500 (fail closed).")
    p.add_argument("--message-timeout-s", type=float, default=d.message_timeout_s,
                   help="Longest wait for one ext_proc answer, seconds.")
    p.add_argument("--num-retries", type=int, default=d.num_retries,
                   help="Retries down the pick's endpoint list (connect failure, reset, 503).")
    p.add_argument("--endpoint", action="append", default=[], metavar="IP:PORT",
                   help="An endpoint of the pool (repeatable): the hosts the pick's list names (override-host) and "
                   "where requests the EPP did not pick go round-robin (fail open).")
    p.add_argument("--lb", default=d.lb, choices=LB_KINDS,
                   help="How the gateway reads the pick: override-host (walks the pick's fallback list on retries; "
                   "needs --endpoint) or original-dst (one ip:port, any host; the EPP then needs --max-attempts 1).")
    p.add_argument("--epp-plaintext", action="store_true",
                   help="Speak h2c to the EPP (for `warmfleet epp --no-secure-serving`); default: TLS.")
    p.add_argument("--epp-ca-file", help="Verify the EPP's certificate against this PEM CA (Envoy reads the file); "
                   "default: not verified (the EPP's self-signed certificate).")
    p.add_argument("--epp-client-cert-file", help="The gateway's PEM certificate for an EPP run with "
                   "--tls-client-ca-file (with --epp-client-key-file).")
    p.add_argument("--epp-client-key-file", help="The PEM key of --epp-client-cert-file.")
    p.add_argument("--request-body-mode", default=d.request_body_mode, choices=("FULL_DUPLEX_STREAMED", "BUFFERED"))
    p.add_argument("--response-body-mode", default=d.response_body_mode,
                   choices=("FULL_DUPLEX_STREAMED", "BUFFERED"))


def run(args: argparse.Namespace) -> int:
    cfg = GatewayConfig(epp=args.epp, listen_host=args.listen_host, listen_port=args.listen_port,
                        admin_port=args.admin_port or None, failure_mode_allow=args.failure_mode_allow,
                        message_timeout_s=args.message_timeout_s, num_retries=args.num_retries,
                        endpoints=list(args.endpoint), lb=args.lb, request_body_mode=args.request_body_mode,
                        response_body_mode=args.response_body_mode, epp_tls=not args.epp_plaintext,
                        epp_ca_file=args.epp_ca_file, epp_client_cert_file=args.epp_client_cert_file,
                        epp_client_key_file=args.epp_client_key_file)
    json.dump(bootstrap(cfg), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
