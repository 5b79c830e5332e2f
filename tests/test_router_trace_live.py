"""A real `warmfleet route` in front of a real `warmfleet serve` on the tiny checkpoint: trace context and request ids
reach the replica's log (issue 39), and a client that leaves a non-streaming request aborts it on the replica
(issue 40)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from warmfleet.livefleet import MODEL_NAME, LiveFleet, metric, wait_for

pytestmark = pytest.mark.slow

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    f = LiveFleet(tiny_model_dir, tmp_path_factory.mktemp("trace-live"), n=1,
                  replica_args=("--log-level", "info")).start()  # info: the replica's request (access) lines
    yield f
    f.close()


def test_traceparent_through_the_router_reaches_the_replicas_log_and_the_id_comes_back(fleet):
    headers = {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01", "x-request-id": "live-trace-1"}
    r = httpx.post(fleet.router.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "live-trace-1"
    replica = fleet.replicas[0]

    def logged() -> list[dict]:
        lines = [json.loads(x) for x in replica.log_path.read_text().splitlines() if x.startswith("{")]
        return [d for d in lines if d.get("request_id") == "live-trace-1" and d.get("path") == "/v1/completions"]

    wait_for(logged, "the replica's request line with the request id", [replica], timeout_s=30)
    assert logged()[0]["trace_id"] == TRACE and logged()[0]["status"] == 200
    made = httpx.post(fleet.router.url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": "no ids", "max_tokens": 1}).headers["x-request-id"]
    assert len(made) == 32


def test_a_client_leaving_a_non_streaming_request_aborts_it_on_the_replica(fleet):
    replica = fleet.replicas[0]

    def aborted() -> float:
        text = httpx.get(replica.url + "/metrics", timeout=5).text
        return metric(text, "vllm:request_success_total", model_name=MODEL_NAME, finished_reason="abort") or 0.0

    before = aborted()
    body = json.dumps({"model": MODEL_NAME, "prompt": "count forever", "max_tokens": 4000, "ignore_eos": True})
    port = int(fleet.router.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\n\r\n{body}").encode())

        def running() -> bool:
            text = httpx.get(replica.url + "/metrics", timeout=5).text
            return (metric(text, "vllm:num_requests_running", model_name=MODEL_NAME) or 0) >= 1

        wait_for(running, "the generation running on the replica", [replica, fleet.router], timeout_s=30)
    # the client has left (socket closed) long before 4000 tokens: the replica counts an abort
    wait_for(lambda: aborted() == before + 1, "the replica aborting the request", [replica, fleet.router],
             timeout_s=30)
