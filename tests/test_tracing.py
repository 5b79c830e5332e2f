"""Request ids and W3C trace context (issue 39): through the router to the replica, and into the replica's log."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import uvicorn

from fakes import FakeEngine
from router_fakes import Fleet2, chat
from warmfleet.localprocs import free_port
from warmfleet.server import tracing
from warmfleet.server.api.app import build_app
from warmfleet.server.api.main import uvicorn_config
from warmfleet.server.config import EngineConfig
from warmfleet.server.logging_setup import StructuredFormatter
from warmfleet.server.tokenizer import Tokenizer

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


@pytest.mark.parametrize("header, expected", [
    (PARENT, TRACE),
    (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),  # all-zero trace id: invalid
    (f"ff-{TRACE}-00f067aa0ba902b7-01", None),  # version ff: invalid
    (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),  # upper-case hex: invalid
    ("garbage", None), (None, None),
])
def test_trace_id_of_a_traceparent(header, expected):
    assert tracing.trace_id(header) == expected


def test_request_ids_are_kept_when_plain_and_made_otherwise():
    assert tracing.request_id("abc-123") == "abc-123"
    for bad in (None, "", "x" * 129, "has space", "new\nline"):
        made = tracing.request_id(bad)
        assert made != bad and len(made) == 32 and int(made, 16) >= 0
    assert tracing.request_id(None) != tracing.request_id(None)
    out = tracing.forwarded({"traceparent": "junk", "tracestate": "a=b"})
    assert set(out) == {"x-request-id"}  # no trace state without a valid parent


@pytest.fixture
async def replica(tiny_model_dir):
    """A replica's HTTP server as `warmfleet serve` runs it (uvicorn_config), on loopback, over a fake engine."""
    tok = Tokenizer(tiny_model_dir)
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(tiny_model_dir), "tiny"
    cfg.server.port = free_port()
    srv = uvicorn.Server(uvicorn_config(build_app(FakeEngine(tok, tiny_model_dir), tok, cfg), cfg))
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{cfg.server.port}"
    srv.should_exit = True
    await task


class FakeLogSink(logging.Handler):
    """A log handler as setup_logging's: each record formatted when written (inside the request), kept as a dict."""

    def __init__(self):
        super().__init__()
        self.setFormatter(StructuredFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


async def test_the_replicas_request_log_line_carries_the_trace_and_request_ids(replica):
    sink, access = FakeLogSink(), logging.getLogger("uvicorn.access")
    access.addHandler(sink)
    level = access.level
    access.setLevel(logging.INFO)  # setLevel, not .level =: it clears the loggers' isEnabledFor caches
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    try:
        async with httpx.AsyncClient(base_url=replica, timeout=30) as c:
            r = await c.post("/v1/completions", json=body, headers={"traceparent": PARENT, "x-request-id": "req-42"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
            r2 = await c.post("/v1/completions", json=body)  # no ids given: one is made and returned
            made = r2.headers["x-request-id"]
            assert len(made) == 32 and made != "req-42"
    finally:
        access.removeHandler(sink)
        access.setLevel(level)
    mine = [d for d in sink.lines if d.get("request_id") == "req-42"]
    assert mine and mine[0]["trace_id"] == TRACE and mine[0]["path"] == "/v1/completions" and mine[0]["status"] == 200
    other = [d for d in sink.lines if d.get("request_id") == made]
    assert other and "trace_id" not in other[0]


@pytest.mark.parametrize("protocol", ["hot", "asgi"])
async def test_the_router_passes_trace_context_and_request_id_to_the_replica(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, protocol=protocol) as f:
        given = {"traceparent": PARENT, "tracestate": "vendor=abc", "x-request-id": "client-7"}
        r = await f.client.post("/v1/chat/completions", json=chat("traced"), headers=given)
        assert r.status_code == 200 and r.headers["x-request-id"] == "client-7"
        seen = [h for x in f.replicas for h in x.headers_seen]
        assert len(seen) == 1 and all(seen[0][k] == v for k, v in given.items())
        r = await f.client.post("/v1/chat/completions", json=chat("untraced", stream=True))
        made = r.headers["x-request-id"]
        seen = [h for x in f.replicas for h in x.headers_seen]
        assert len(made) == 32 and seen[-1]["x-request-id"] == made and "traceparent" not in seen[-1]
        r = await f.client.post("/tokenize", json={"model": "tiny", "prompt": "hi"}, headers=given)
        assert r.headers["x-request-id"] == "client-7"
        r = await f.client.post("/v1/completions", json={"model": "tiny", "prompt": ["x"] * 300})  # the router's own 400
        assert r.status_code == 400 and len(r.headers["x-request-id"]) == 32
