"""OpenTelemetry spans (server/otel.py, issue 39): off without an endpoint (nothing imported), one readable line without
the extra, the picker's routing-decision span in-process, and live processes exporting to an in-process OTLP/HTTP
collector double (a real `warmfleet route`, or a real Envoy + `warmfleet epp`, in front of real `warmfleet serve`
replicas): the decision span (replica, reason, predicted cached tokens) and the replica's request span share the
trace id the client sent, the replica's span the decision's child."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from envoy_gateway import Envoy, envoy_binary
from epp_fakes import EppFleet, request_body, request_headers, set_headers
from router_fakes import chat
from warmfleet.livefleet import MODEL_NAME, Epp, LiveFleet, Replica, wait_for
from warmfleet.server import otel
from warmfleet.server.router.core.policy import COLD_HASH, LEAST_LOAD, LOAD_SPILL, PREFIX_HIT
from warmfleet.server.router.epp import pick
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CLIENT_SPAN}-01"


# --- on / off -----------------------------------------------------------------------------------------------------
def test_tracing_is_on_only_with_an_endpoint_and_not_when_the_sdk_is_disabled():
    assert not otel.wanted(None, {})
    assert otel.wanted("http://c:4318/v1/traces", {})
    assert otel.wanted(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert otel.wanted(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not otel.wanted("http://c:4318/v1/traces", {"OTEL_SDK_DISABLED": "true"})
    assert otel.start("x", None, env={}) is None


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in (env or {}).items()} or None)


def test_without_an_endpoint_the_doors_and_the_server_import_no_opentelemetry(tmp_path):
    code = ("import os, sys\n"
            "for k in list(os.environ):\n"
            "    if k.startswith('OTEL_'): del os.environ[k]\n"
            "import warmfleet.server.router.http.app, warmfleet.server.router.epp.service, warmfleet.server.api.main\n"
            "from warmfleet.server import otel\n"
            "assert otel.start('x', None) is None\n"
            # FastAPI itself imports the OpenTelemetry API when it is installed; the SDK and the exporter stay out
            "bad = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')))\n"
            "assert not bad, bad\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


def test_an_endpoint_without_the_extra_is_one_readable_line_and_exit_2(tiny_model_dir):
    code = ("import sys\n"
            "sys.modules['opentelemetry.sdk'] = None  # as if the tracing extra were not installed\n"
            "from warmfleet.cli import main\n"
            f"sys.exit(main(['route', '--model', {str(tiny_model_dir)!r}, '--replica', 'http://127.0.0.1:9',\n"
            "                '--otlp-traces-endpoint', 'http://127.0.0.1:9/v1/traces']))\n")
    proc = run_python(code)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "warmfleet[tracing]" in lines[0] and "opentelemetry" in lines[0], proc.stderr


def test_a_span_hands_on_its_own_traceparent_in_the_clients_trace_and_keeps_its_tracestate():
    exporter = InMemorySpanExporter()
    spans = otel.start("t", exporter=exporter)
    span = spans.start("s", {"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    out = spans.hand_on(span, {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "x-request-id": "r"})
    span.end()
    spans.provider.force_flush()
    (done,) = exporter.get_finished_spans()
    own = f"{done.context.span_id:016x}"
    assert out == {"traceparent": f"00-{TRACE}-{own}-01", "tracestate": "vendor=1", "x-request-id": "r"}
    assert f"{done.parent.span_id:016x}" == CLIENT_SPAN and own != CLIENT_SPAN
    headerless = spans.start("s", {})  # no (or an invalid) traceparent: a trace of its own
    assert f"{headerless.get_span_context().trace_id:032x}" != TRACE
    headerless.end()
    spans.shutdown()


# --- the picker ---------------------------------------------------------------------------------------------------
async def test_the_pickers_decision_span_continues_the_clients_trace_and_is_the_replicas_parent(tiny_model_dir):
    exporter = InMemorySpanExporter()
    spans = otel.start("warmfleet-epp", exporter=exporter)
    async with EppFleet(tiny_model_dir, spans=spans) as f:
        s = f.stream()
        await s.send(request_headers(headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1",
                                              "x-request-id": "epp-trace-1"}))
        await s.send(request_body(json.dumps(chat("Which replica holds me?")).encode(), eos=True))
        first = await s.recv()
        s.cancel()
        spans.provider.force_flush()
        (span,) = exporter.get_finished_spans()
        sent = set_headers(first.request_headers.response)
        primary = sent[pick.DESTINATION].split(",")[0]
        assert sent["traceparent"] == f"00-{TRACE}-{span.context.span_id:016x}-01"  # the replica's parent
        assert sent["tracestate"] == "vendor=1"
        assert f"{span.parent.span_id:016x}" == CLIENT_SPAN and span.name == "warmfleet.route"
        rep = f.replica_at(primary)
        assert span.attributes[otel.REPLICA] == rep.id
        assert span.attributes[otel.REASON] in (PREFIX_HIT, COLD_HASH, LOAD_SPILL, LEAST_LOAD)
        assert span.attributes[otel.PREDICTED] == 0  # nothing cached yet anywhere
        assert span.attributes[otel.REQUEST_ID] == "epp-trace-1"
    spans.shutdown()


# --- live: route + serve exporting OTLP/HTTP ----------------------------------------------------------------------
class FakeOTLPCollector:
    """An OTLP/HTTP traces receiver on loopback: decodes each ExportTraceServiceRequest (protobuf) into span dicts."""

    def __init__(self):
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                outer._add(req, self.path, self.headers.get("content-type"))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _add(self, req, path: str, content_type: str) -> None:
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    attrs = {a.key: (a.value.string_value or a.value.int_value) for a in sp.attributes}
                    with self._lock:
                        self.spans.append({"service": service, "name": sp.name, "trace_id": sp.trace_id.hex(),
                                           "span_id": sp.span_id.hex(), "parent": sp.parent_span_id.hex(),
                                           "attributes": attrs, "path": path, "content_type": content_type})

    def named(self, name: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["name"] == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def traced_fleet(tiny_model_dir, tmp_path_factory):
    collector = FakeOTLPCollector()
    flags = ("--otlp-traces-endpoint", collector.url)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans leave at once, the test need not wait 5 s
        mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        f = LiveFleet(tiny_model_dir, tmp_path_factory.mktemp("otel-live"), n=2, replica_args=flags,
                      router_args=flags).start()
    yield f, collector
    f.close()
    collector.close()


@pytest.mark.slow
def test_live_decision_span_and_replica_span_share_the_clients_trace(traced_fleet):
    fleet, collector = traced_fleet
    r = httpx.post(fleet.router.url + "/v1/completions", timeout=60,
                   headers={"traceparent": TRACEPARENT, "x-request-id": "otel-live-1"},
                   json={"model": MODEL_NAME, "prompt": "a prompt long enough to fill a block or two " * 4,
                         "max_tokens": 2})
    assert r.status_code == 200
    reason, _, predicted = r.headers["x-warmfleet-route"].partition("; predicted_cached_tokens=")

    def both() -> bool:
        return any(s["trace_id"] == TRACE for s in collector.named("warmfleet.route")) and \
            any(s["trace_id"] == TRACE for s in collector.named("warmfleet.request"))

    wait_for(both, "the router's and the replica's spans at the collector", [fleet.router, *fleet.replicas],
             timeout_s=30)
    (route,) = [s for s in collector.named("warmfleet.route") if s["trace_id"] == TRACE]
    (served,) = [s for s in collector.named("warmfleet.request") if s["trace_id"] == TRACE]
    assert route["service"] == "warmfleet-router" and served["service"] == "warmfleet-server"
    assert route["parent"] == CLIENT_SPAN  # the client's span
    assert served["parent"] == route["span_id"]  # the replica's span is the decision's child
    replica = fleet.by_id(r.headers["x-warmfleet-replica"])  # the replica names itself; the router's id is its URL
    assert route["attributes"][otel.REPLICA] == replica.url and served["attributes"][otel.REPLICA] == replica.name
    assert route["attributes"][otel.REASON] == reason
    assert route["attributes"][otel.PREDICTED] == int(predicted)
    assert route["attributes"][otel.REQUEST_ID] == served["attributes"][otel.REQUEST_ID] == "otel-live-1"
    assert served["attributes"][otel.STATUS] == 200 and served["attributes"]["url.path"] == "/v1/completions"
    assert route["path"] == "/v1/traces" and route["content_type"] == "application/x-protobuf"
    # the same prompt again, once the replica's KV events reached the router: the span says the prefix is cached
    wait_for(lambda: fleet.router.view()["index_blocks"] > 0, "the first prompt's blocks in the router's index",
             [fleet.router], timeout_s=30)
    again = httpx.post(fleet.router.url + "/v1/completions", timeout=60,
                       headers={"traceparent": f"00-{'1' * 32}-{CLIENT_SPAN}-01"},
                       json={"model": MODEL_NAME, "prompt": "a prompt long enough to fill a block or two " * 4,
                             "max_tokens": 2})
    assert again.status_code == 200
    wait_for(lambda: any(s["trace_id"] == "1" * 32 for s in collector.named("warmfleet.route")),
             "the second decision span", [fleet.router], timeout_s=30)
    (second,) = [s for s in collector.named("warmfleet.route") if s["trace_id"] == "1" * 32]
    assert second["attributes"][otel.REASON] == PREFIX_HIT and second["attributes"][otel.PREDICTED] > 0
    assert second["attributes"][otel.REPLICA] == route["attributes"][otel.REPLICA]


@pytest.mark.slow
def test_live_through_envoy_the_pickers_decision_span_is_the_replicas_parent(tiny_model_dir, tmp_path):
    envoy_binary()  # fails (never skips) without the tests' Envoy
    collector = FakeOTLPCollector()
    flags = ("--otlp-traces-endpoint", collector.url)
    r = Replica("r0", tiny_model_dir, tmp_path, flags)
    epp = Epp(tiny_model_dir, [r], tmp_path, flags)
    try:
        with pytest.MonkeyPatch.context() as mp:  # the processes' environment is taken when they start
            mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
            r.start()
            r.wait_ready()
            epp.start()
            epp.wait_synced()
        trace = "5" * 32
        with Envoy(GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{r.port}"]), tmp_path) as gw:
            resp = httpx.post(gw.url + "/v1/chat/completions", timeout=120,
                              headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01", "x-request-id": "otel-epp-1"},
                              json={"model": MODEL_NAME, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "Through the gateway."}]})
            assert resp.status_code == 200, resp.text

            def both() -> bool:
                return any(s["trace_id"] == trace for s in collector.named("warmfleet.route")) and \
                    any(s["trace_id"] == trace for s in collector.named("warmfleet.request"))

            wait_for(both, "the picker's and the replica's spans at the collector", [r, epp, gw], timeout_s=30)
        (route,) = [s for s in collector.named("warmfleet.route") if s["trace_id"] == trace]
        (served,) = [s for s in collector.named("warmfleet.request") if s["trace_id"] == trace]
        assert route["service"] == "warmfleet-epp" and route["parent"] == CLIENT_SPAN
        assert served["parent"] == route["span_id"]  # through Envoy: the picker's traceparent reached the replica
        assert route["attributes"][otel.REPLICA] == r.url and served["attributes"][otel.REPLICA] == r.name
        assert route["attributes"][otel.REASON] in (PREFIX_HIT, COLD_HASH, LOAD_SPILL, LEAST_LOAD)
        assert route["attributes"][otel.REQUEST_ID] == served["attributes"][otel.REQUEST_ID] == "otel-epp-1"
    finally:
        epp.stop()
        r.stop()
        collector.close()
