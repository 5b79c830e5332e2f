"""The endpoint picker's hardening through a real Envoy 1.40 and a real `warmfleet serve` replica (issue 40, issue 39's
trace headers): mutual TLS between gateway and picker, a picker restart (SIGTERM) mid-stream that loses no stream, a
client that leaves a non-streaming request aborting it on the replica, and trace headers reaching the replica."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from envoy_gateway import Envoy, envoy_binary
from tls_certs import make_pki
from warmfleet.livefleet import Epp, Replica, metric, wait_for
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

pytestmark = pytest.mark.slow

LONG = {"model": "tiny", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Talk for a long while."}]}


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory):
    envoy_binary()  # fail first, before starting anything, when no Envoy is given
    cwd = tmp_path_factory.mktemp("epp-hardening")  # never the repo root: its operator/ folder shadows the stdlib
    r = Replica("r0", tiny_model_dir, cwd, ("--log-level", "info"))
    try:
        r.start()
        r.wait_ready()
        yield r, cwd
    finally:
        r.stop()


def gateway_config(epp: Epp, r: Replica, **kw) -> GatewayConfig:
    return GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{r.port}"], **kw)


def running(r: Replica) -> float:
    return metric(httpx.get(r.url + "/metrics", timeout=5).text, "vllm:num_requests_running") or 0.0


def aborted(r: Replica) -> float:
    return metric(httpx.get(r.url + "/metrics", timeout=5).text, "vllm:request_success_total",
                  finished_reason="abort") or 0.0


def test_mutual_tls_between_gateway_and_picker(tiny_model_dir, replica):
    r, cwd = replica
    pki = make_pki(cwd)
    epp = Epp(tiny_model_dir, [r], cwd, ("--tls-cert-file", str(pki.server_cert), "--tls-key-file",
                                         str(pki.server_key), "--tls-client-ca-file", str(pki.ca)))
    epp.name = "epp-mtls"
    try:
        epp.start()
        epp.wait_synced()
        trusted = gateway_config(epp, r, epp_ca_file=str(pki.ca), epp_client_cert_file=str(pki.client_cert),
                                 epp_client_key_file=str(pki.client_key))
        with Envoy(trusted, cwd, name="envoy-mtls") as gw:
            ok = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={**LONG, "max_tokens": 2})
            assert ok.status_code == 200, ok.text
        with Envoy(gateway_config(epp, r, epp_ca_file=str(pki.ca)), cwd, name="envoy-no-client-cert") as gw:
            refused = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={**LONG, "max_tokens": 2})
            assert refused.status_code >= 500  # fail closed: the picker let no unauthenticated gateway in
    finally:
        epp.stop()


def test_a_picker_restart_mid_stream_loses_no_stream(tiny_model_dir, replica):
    """SIGTERM reaches the picker after the first event of a long stream: the stream still ends with every token
    and [DONE] (the picker drains; before, it cut streams after a second), and the picker then exits cleanly."""
    r, cwd = replica
    epp = Epp(tiny_model_dir, [r], cwd, ("--drain-grace-s", "60", "--log-level", "info"))
    epp.name = "epp-drain"
    try:
        epp.start()
        epp.wait_synced()
        with Envoy(gateway_config(epp, r), cwd, name="envoy-drain") as gw:
            events = []
            body = {**LONG, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=120, json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                events.append(next(line for line in lines if line.startswith("data: ")))
                os.killpg(epp.popen.pid, signal.SIGTERM)
                events += [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            usage = [json.loads(e[6:])["usage"] for e in events[:-1] if json.loads(e[6:]).get("usage")]
            assert usage and usage[-1]["completion_tokens"] == LONG["max_tokens"]
            assert epp.popen.wait(timeout=60) == 0
            assert "drained in" in epp.log_tail(200)
    finally:
        epp.stop()


def test_a_client_leaving_a_non_streaming_request_aborts_it_on_the_replica(tiny_model_dir, replica):
    """The client's connection closes while the replica generates a long non-streaming answer: Envoy closes its
    upstream connection, and the replica aborts the request (counted as an abort, its batch empty again) instead
    of generating the 3000 tokens nobody will read."""
    r, cwd = replica
    epp = Epp(tiny_model_dir, [r], cwd)
    epp.name = "epp-disconnect"
    try:
        epp.start()
        epp.wait_synced()
        with Envoy(gateway_config(epp, r), cwd, name="envoy-disconnect") as gw:
            before = aborted(r)
            body = json.dumps(LONG).encode()
            client = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: running(r) == 1, "the replica generating", [r, epp, gw], 60)
            client.close()
            t_close = time.monotonic()
            wait_for(lambda: aborted(r) == before + 1 and running(r) == 0, "the request aborted on the replica",
                     [r, epp, gw], 30)
            print(json.dumps({"abort_after_disconnect_s": round(time.monotonic() - t_close, 3)}))
    finally:
        epp.stop()


def test_trace_headers_reach_the_replica_through_envoy_and_the_picker(tiny_model_dir, replica):
    """traceparent/tracestate and x-request-id sent through Envoy + `warmfleet epp`: the replica's log lines for the
    request carry the trace id and the request id, and the id comes back; without one, the gateway's comes back."""
    r, cwd = replica
    epp = Epp(tiny_model_dir, [r], cwd)
    epp.name = "epp-trace"
    trace = os.urandom(16).hex()
    try:
        epp.start()
        epp.wait_synced()
        with Envoy(gateway_config(epp, r), cwd, name="envoy-trace") as gw:
            sent = {"traceparent": f"00-{trace}-{os.urandom(8).hex()}-01", "tracestate": "wf=1",
                    "x-request-id": f"req-{trace[:8]}"}
            resp = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers=sent,
                              json={**LONG, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-request-id"] == sent["x-request-id"]

            def logged() -> list[dict]:
                out = []
                for line in r.log_path.read_text(errors="replace").splitlines():
                    if trace in line and line.startswith("{"):
                        out.append(json.loads(line))
                return out

            wait_for(lambda: bool(logged()), "the replica logged the request with its trace id", [r, epp, gw], 30)
            assert all(rec.get("trace_id") == trace and rec.get("request_id") == sent["x-request-id"]
                       for rec in logged())
            unnamed = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={**LONG, "max_tokens": 2})
            assert unnamed.status_code == 200 and unnamed.headers.get("x-request-id")
    finally:
        epp.stop()
