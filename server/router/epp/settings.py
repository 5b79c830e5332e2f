"""`warmfleet epp` flags: every `warmfleet route` flag (one declaration, core/settings.py) plus the EPP's ports; no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...flagfields import opt
from ..core.settings import RouterSettings

GRPC_PORT = 9002  # GIE's conventional Endpoint Picker port (InferencePool endpointPickerRef.port)
HTTP_PORT = 9090  # /metrics and /v1/router/replicas


@dataclass(frozen=True)
class EppSettings(RouterSettings):
    """`warmfleet route`'s settings with `--port` as the gRPC port (ext_proc + gRPC health) and an HTTP side port."""

    port: int = field(default=GRPC_PORT, metadata=opt(
        "--port", "gRPC port: Envoy's ext_proc ExternalProcessor and the gRPC health services (liveness, readiness)."))
    http_port: int = field(default=HTTP_PORT, metadata=opt(
        "--http-port", "HTTP port of /metrics, /v1/router/replicas and the admin drain routes."))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.port < 65536 or not 0 < self.http_port < 65536 or self.port == self.http_port:
            raise ValueError("--port and --http-port must be two different ports in 1..65535")
