"""`warmfleet envoy-bootstrap`: what GIE gateways configure is in the bootstrap, and Envoy 1.40 accepts every variant."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from envoy_gateway import envoy_binary
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig, bootstrap

POOL = ["10.0.0.7:8000", "10.0.0.8:8000"]
VARIANTS = {
    "override-host": GatewayConfig(endpoints=POOL),
    "override-host-fail-open": GatewayConfig(endpoints=POOL, failure_mode_allow=True),
    "original-dst": GatewayConfig(lb="original-dst"),
    "original-dst-fail-open": GatewayConfig(lb="original-dst", endpoints=POOL, failure_mode_allow=True),
    "buffered": GatewayConfig(endpoints=POOL, request_body_mode="BUFFERED", response_body_mode="BUFFERED"),
    "epp-plaintext": GatewayConfig(endpoints=POOL, epp_tls=False),
}


def hcm(b: dict) -> dict:
    return b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def cluster(b: dict, name: str) -> dict:
    return next(c for c in b["static_resources"]["clusters"] if c["name"] == name)


def test_ext_proc_is_configured_as_gie_gateways_do():
    b = bootstrap(GatewayConfig(endpoints=POOL, failure_mode_allow=True))
    ext_proc = hcm(b)["http_filters"][0]
    assert ext_proc["name"] == "envoy.filters.http.ext_proc" and hcm(b)["http_filters"][-1]["name"].endswith("router")
    cfg = ext_proc["typed_config"]
    assert cfg["processing_mode"] == {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"}
    assert cfg["failure_mode_allow"] is True and cfg["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp"
    epp = cluster(b, "epp")
    assert "http2_protocol_options" in json.dumps(epp)
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert bootstrap(GatewayConfig(endpoints=POOL))["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]["http_filters"][0]["typed_config"]["failure_mode_allow"] is False


def test_the_pick_is_read_from_the_destination_header_and_retried_elsewhere():
    b = bootstrap(GatewayConfig(endpoints=POOL, num_retries=3))
    pool = cluster(b, "inference_pool")
    override = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"][0] == {"header": "x-gateway-destination-endpoint"}
    addresses = [e["endpoint"]["address"]["socket_address"] for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert [f"{a['address']}:{a['port_value']}" for a in addresses] == POOL
    route = hcm(b)["route_config"]["virtual_hosts"][0]["routes"][0]
    retry = route["route"]["retry_policy"]
    assert retry["num_retries"] == 3 and "connect-failure" in retry["retry_on"]
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert route["response_headers_to_add"][0]["header"]["key"] == "x-gateway-destination-endpoint-served"
    odst = cluster(bootstrap(GatewayConfig(lb="original-dst")), "inference_pool")
    assert odst["type"] == "ORIGINAL_DST" and odst["original_dst_lb_config"] == {
        "use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}


def test_override_host_needs_the_pool_and_bad_addresses_are_refused():
    with pytest.raises(ValueError, match="--endpoint"):
        bootstrap(GatewayConfig())
    with pytest.raises(ValueError, match="host:port"):
        bootstrap(GatewayConfig(epp="no-port"))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_envoy_accepts_the_bootstrap(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(bootstrap(VARIANTS[name])))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_command_prints_the_builders_bootstrap(tmp_path):
    cmd = [sys.executable, "-P", "-m", "warmfleet.cli", "envoy-bootstrap", "--epp", "10.0.0.2:9002",
           "--endpoint", POOL[0], "--endpoint", POOL[1], "--failure-mode-allow", "--listen-port", "8081"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True).stdout
    want = bootstrap(GatewayConfig(epp="10.0.0.2:9002", endpoints=POOL, failure_mode_allow=True, listen_port=8081))
    assert json.loads(out) == want


def test_the_gateway_speaks_tls_to_the_epp_unless_told_plaintext():
    tls = cluster(bootstrap(GatewayConfig(endpoints=POOL)), "epp")["transport_socket"]
    assert tls["name"] == "envoy.transport_sockets.tls"
    common = tls["typed_config"]["common_tls_context"]
    assert common == {"alpn_protocols": ["h2"]}  # the self-signed certificate: not verified, no client certificate
    assert "transport_socket" not in cluster(bootstrap(GatewayConfig(endpoints=POOL, epp_tls=False)), "epp")
    mtls = cluster(bootstrap(GatewayConfig(endpoints=POOL, epp_ca_file="/ca.crt", epp_client_cert_file="/c.crt",
                                           epp_client_key_file="/c.key")), "epp")["transport_socket"]
    common = mtls["typed_config"]["common_tls_context"]
    assert common["validation_context"] == {"trusted_ca": {"filename": "/ca.crt"}}
    assert common["tls_certificates"] == [{"certificate_chain": {"filename": "/c.crt"},
                                           "private_key": {"filename": "/c.key"}}]
    with pytest.raises(ValueError, match="go together"):
        bootstrap(GatewayConfig(endpoints=POOL, epp_client_cert_file="/c.crt"))
    with pytest.raises(ValueError, match="contradicts"):
        bootstrap(GatewayConfig(endpoints=POOL, epp_tls=False, epp_ca_file="/ca.crt"))


def test_request_ids_are_kept_made_and_returned():
    h = hcm(bootstrap(GatewayConfig(endpoints=POOL)))
    assert h["preserve_external_request_id"] is True and h["always_set_request_id_in_response"] is True
    assert h.get("generate_request_id", True) is not False


def test_the_command_takes_the_tls_flags(tmp_path):
    cmd = [sys.executable, "-P", "-m", "warmfleet.cli", "envoy-bootstrap", "--endpoint", POOL[0],
           "--epp-ca-file", "/ca.crt", "--epp-client-cert-file", "/c.crt", "--epp-client-key-file", "/c.key"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == bootstrap(GatewayConfig(endpoints=[POOL[0]], epp_ca_file="/ca.crt",
                                                      epp_client_cert_file="/c.crt", epp_client_key_file="/c.key"))
    plain = [sys.executable, "-P", "-m", "warmfleet.cli", "envoy-bootstrap", "--endpoint", POOL[0], "--epp-plaintext"]
    out = subprocess.run(plain, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "transport_socket" not in cluster(json.loads(out), "epp")
