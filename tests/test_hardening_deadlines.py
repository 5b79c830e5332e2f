"""Read deadlines on the replica's HTTP server (issue 40): a trickling head or body gets a 408 and a closed connection."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn

from fakes import FakeEngine
from warmfleet.localprocs import free_port
from warmfleet.server.api.app import build_app
from warmfleet.server.api.main import uvicorn_config
from warmfleet.server.config import EngineConfig
from warmfleet.server.tokenizer import Tokenizer


@pytest.fixture
async def server(tiny_model_dir):
    """A replica's HTTP server (the uvicorn config `warmfleet serve` uses) on loopback, 1 s read deadlines."""
    tok = Tokenizer(tiny_model_dir)
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(tiny_model_dir), "tiny"
    cfg.server.port = free_port()
    cfg.server.request_header_timeout_s = 1.0
    cfg.server.request_body_timeout_s = 1.0
    engine = FakeEngine(tok, tiny_model_dir)
    srv = uvicorn.Server(uvicorn_config(build_app(engine, tok, cfg), cfg))
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield cfg.server.port, engine
    srv.should_exit = True
    await task


async def trickle(port: int, head: bytes, drip: bytes) -> bytes:
    """Send `head`, then one byte of `drip` every 5 s; return all the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)

    async def drip_bytes() -> None:
        for b in drip:
            await asyncio.sleep(5)
            writer.write(bytes([b]))
            await writer.drain()

    dripper = asyncio.create_task(drip_bytes())
    try:
        return await asyncio.wait_for(reader.read(), 60)  # EOF once the server closes; a hang fails here
    finally:
        dripper.cancel()
        writer.close()


def assert_408(answer: bytes, phase: str) -> None:
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer
    err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error" and phase in err["message"]


async def test_a_body_sent_one_byte_per_5_s_is_cut_off(server):
    port, engine = server
    body = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    assert_408(await trickle(port, head + body[:1], body[1:]), "body")
    assert engine.requests == []


async def test_headers_sent_one_byte_per_5_s_are_cut_off(server):
    port, _ = server
    assert_408(await trickle(port, b"G", b"ET /health HTTP/1.1\r\nhost: x\r\n\r\n"), "head")


async def test_each_request_on_a_kept_alive_connection_gets_its_own_deadline(server):
    """The deadlines end with each request: a second request on the same connection gets its own."""
    port, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(2):
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 200")
        while (await reader.readline()) != b"\r\n":
            pass
        await reader.readexactly(len(b'{"status":"ok"}'))
        await asyncio.sleep(1.5)  # longer than either deadline, shorter than uvicorn's keep-alive (5 s)
    writer.close()
