"""`warmfleet epp` flags: every `warmfleet route` flag (one declaration, core/settings.py) plus the EPP's ports, its
gRPC TLS and its drain on SIGTERM; no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...flagfields import opt
from ..core.settings import RouterSettings

GRPC_PORT = 9002  # GIE's conventional Endpoint Picker port (InferencePool endpointPickerRef.port)
HTTP_PORT = 9090  # /metrics and /v1/router/replicas
DRAIN_GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds


@dataclass(frozen=True)
class EppSettings(RouterSettings):
    """`warmfleet route`'s settings with `--port` as the gRPC port (ext_proc + gRPC health) and an HTTP side port."""

    port: int = field(default=GRPC_PORT, metadata=opt(
        "--port", "gRPC port: Envoy's ext_proc ExternalProcessor and the gRPC health services (liveness, readiness)."))
    http_port: int = field(default=HTTP_PORT, metadata=opt(
        "--http-port", "HTTP port of /metrics, /v1/router/replicas and the admin drain routes."))
    # GIE's reference picker: --secure-serving (default on) with a self-signed certificate unless one is given
    secure_serving: bool = field(default=True, metadata=opt(
        "--secure-serving", "Serve gRPC over TLS (default), with --tls-cert-file/--tls-key-file or, without them, a "
        "self-signed certificate made at startup (as GIE's reference picker does); --no-secure-serving: plaintext "
        "h2c, for a gateway on a trusted network only."))
    tls_cert_file: Optional[str] = field(default=None, metadata=opt(
        "--tls-cert-file", "PEM certificate (chain) of the gRPC port, e.g. tls.crt of a kubernetes.io/tls Secret.",
        metavar="FILE"))
    tls_key_file: Optional[str] = field(default=None, metadata=opt(
        "--tls-key-file", "PEM private key of --tls-cert-file (tls.key).", metavar="FILE"))
    tls_client_ca_file: Optional[str] = field(default=None, metadata=opt(
        "--tls-client-ca-file", "Require a client certificate signed by one of these PEM CAs on the gRPC port "
        "(mutual TLS: only the gateway may open ext_proc streams).", metavar="FILE"))
    drain_grace_s: float = field(default=DRAIN_GRACE_S, metadata=opt(
        "--drain-grace-s", "On SIGTERM: health turns NOT_SERVING, new streams are refused and in-flight ones get "
        "this long to finish before the process exits, seconds (keep it under the pod's "
        "terminationGracePeriodSeconds)."))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.port < 65536 or not 0 < self.http_port < 65536 or self.port == self.http_port:
            raise ValueError("--port and --http-port must be two different ports in 1..65535")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if not self.secure_serving and (self.tls_cert_file or self.tls_client_ca_file):
            raise ValueError("--no-secure-serving contradicts --tls-cert-file/--tls-client-ca-file")
        if self.drain_grace_s < 0:
            raise ValueError("--drain-grace-s must be >= 0")
