"""The endpoint picker's gRPC port: TLS by default (self-signed, or a certificate from files), the optional client
certificate check, and the drain on SIGTERM (in-flight streams finish, new ones are refused); in process."""

from __future__ import annotations

import asyncio
import json
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_fakes import EppFleet, request_headers, response_body, response_headers, set_headers
from router_fakes import chat
from test_epp_service import pick_full_duplex
from tls_certs import make_pki
from waiting import until
from warmfleet.server.router.epp import pick

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(channel: grpc.aio.Channel, service: str = "readiness") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def tls_channel(port: int, ca: bytes, cert: bytes | None = None, key: bytes | None = None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override",
                                                                          "localhost")])


async def test_tls_by_default_with_a_self_signed_certificate(tiny_model_dir):
    async with EppFleet(tiny_model_dir, settings={"secure_serving": True}) as f:
        port = f.epp.grpc_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):  # plaintext h2c is not served
                await health(plain)
        pem = (await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port))).encode()
        async with tls_channel(port, pem) as ch:
            assert await health(ch) == SERVING


async def test_a_certificate_from_files_and_the_client_certificate_check(tiny_model_dir, tmp_path):
    pki = make_pki(tmp_path)
    async with EppFleet(tiny_model_dir, settings={
            "secure_serving": True, "tls_cert_file": str(pki.server_cert), "tls_key_file": str(pki.server_key),
            "tls_client_ca_file": str(pki.ca)}) as f:
        port, ca = f.epp.grpc_port, pki.ca.read_bytes()
        async with tls_channel(port, ca) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError):  # no client certificate: no handshake
                await health(anonymous)
        async with tls_channel(port, ca, pki.client_cert.read_bytes(), pki.client_key.read_bytes()) as gateway:
            assert await health(gateway) == SERVING
        async with tls_channel(port, pki.other_ca.read_bytes(), pki.client_cert.read_bytes(),
                               pki.client_key.read_bytes()) as wrong_ca:
            with pytest.raises(grpc.aio.AioRpcError):  # the server's certificate is not what this client trusts
                await health(wrong_ca)


async def test_a_drain_finishes_the_stream_in_flight_and_refuses_new_ones(tiny_model_dir):
    """SIGTERM's path (EppServer leaving its block): the stream open since before gets its whole answer through the
    EPP, longer than the old one-second stop allowed; a new stream and the readiness check are refused."""
    async with EppFleet(tiny_model_dir, drain_grace_s=30) as f:
        s, first, _, _ = await pick_full_duplex(f, json.dumps(chat("a long answer", stream=True)).encode())
        assert pick.DESTINATION in set_headers(first.request_headers.response)
        drained = asyncio.create_task(f.epp.__aexit__(None, None, None))
        await until(lambda: f.epp.draining, "draining")
        await s.exchange(response_headers(content_type="text/event-stream"))
        await asyncio.sleep(1.5)  # past the grace the old stop gave
        (chunk,) = await s.exchange(response_body(b'data: {"choices": []}\n\n', eos=False))
        assert chunk.response_body.response.body_mutation.streamed_response.body == b'data: {"choices": []}\n\n'
        with pytest.raises(grpc.aio.AioRpcError):
            await health(f.channel)
        with pytest.raises((grpc.aio.AioRpcError, AssertionError)):  # refused, or ended at once
            await f.stream().exchange(request_headers(eos=True))
        assert not drained.done()  # still waiting for the stream in flight
        (last,) = await s.exchange(response_body(b"data: [DONE]\n\n", eos=True))
        assert last.response_body.response.body_mutation.streamed_response.end_of_stream
        await s.close()
        await asyncio.wait_for(drained, 20)  # ends once the stream did, well before the grace period
        assert f.epp.processor.open_streams == 0


@pytest.mark.parametrize("flags, line", [
    (["--tls-cert-file", "CERT"], "--tls-cert-file and --tls-key-file go together"),
    (["--tls-cert-file", "CERT", "--tls-key-file", "MISSING"], "--tls-key-file MISSING: No such file or directory"),
    (["--tls-cert-file", "CERT", "--tls-key-file", "CERT", "--tls-client-ca-file", "NOTPEM"],
     "--tls-client-ca-file NOTPEM: not a PEM file"),
    (["--no-secure-serving", "--tls-client-ca-file", "CERT"],
     "--no-secure-serving contradicts --tls-cert-file/--tls-client-ca-file"),
    (["--drain-grace-s", "-1"], "--drain-grace-s must be >= 0"),
])
def test_bad_tls_and_drain_flags_exit_with_one_readable_line(tiny_model_dir, tmp_path, flags, line):
    import subprocess
    import sys

    from tls_certs import make_pki

    pki = make_pki(tmp_path)
    (tmp_path / "notpem").write_text("hello")
    names = {"CERT": str(pki.server_cert), "MISSING": str(tmp_path / "missing"), "NOTPEM": str(tmp_path / "notpem")}
    argv = [names.get(a, a) for a in flags]
    out = subprocess.run([sys.executable, "-P", "-m", "warmfleet.cli", "epp", "--model", str(tiny_model_dir),
                          "--replica", "http://127.0.0.1:1", *argv], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    want = line
    for k, v in names.items():
        want = want.replace(k, v)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"warmfleet epp: error: {want}"], out.stderr
