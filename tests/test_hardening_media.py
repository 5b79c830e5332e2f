"""Media hardening (issue 40): embedded-IPv4 SSRF spellings, one deadline for a request's concurrent downloads,
cancellation when the client leaves, --limit-mm-per-prompt, and the pixel limit read from the header."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import select
import socket
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from fakes import FakeEngine
from warmfleet.server.api.app import build_app
from warmfleet.server.config import EngineConfig
from warmfleet.server.multimodal.media import HostPolicy, MediaConfig, MediaError, MediaLoader, is_blocked_address
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from warmfleet.server.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"


# ---- SSRF: IPv4 inside IPv6 -----------------------------------------------------------------------
@pytest.mark.parametrize("addr", [
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "64:ff9b::a9fe:a9fe", "64:ff9b::c0a8:101",  # NAT64 well-known prefix
    "64:ff9b:1::a00:1", "64:ff9b:1:abcd::808:808",  # local-use NAT64 (RFC 8215): never public
    "2002:7f00:1::1", "2002:a00:1::", "2002:a9fe:a9fe::1", "2002:ac10:1::5",  # 6to4
    "::127.0.0.1", "::10.0.0.1", "::169.254.169.254", "::192.168.1.1",  # IPv4-compatible
    "::ffff:10.0.0.1", "::ffff:169.254.169.254",  # IPv4-mapped
])
def test_private_ipv4_embedded_in_ipv6_is_blocked(addr):
    assert is_blocked_address(ipaddress.ip_address(addr))


@pytest.mark.parametrize("addr", ["64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8"])
def test_public_ipv4_embedded_in_ipv6_passes(addr):
    assert not is_blocked_address(ipaddress.ip_address(addr))


@pytest.mark.parametrize("host", ["[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::1]", "[::127.0.0.1]", "[64:ff9b:1::a00:1]"])
def test_embedded_private_url_hosts_are_refused(host):
    with pytest.raises(MediaError, match="non-public address"):
        MediaLoader(MediaConfig()).load(f"http://{host}/latest/meta-data/", "p")


def test_allow_list_by_ipv4_cidr_covers_its_embedded_spellings():
    p = HostPolicy(["10.0.0.0/8"])
    assert p.allows("x", ipaddress.ip_address("64:ff9b::a00:1"))
    assert not p.allows("x", ipaddress.ip_address("64:ff9b::c0a8:101"))


# ---- a slow image host -----------------------------------------------------------------------------
class _SlowHandler(BaseHTTPRequestHandler):
    """Answers nothing; holds each connection until the client closes it (or 60 s), counting connections."""

    def do_GET(self):  # noqa: N802
        srv = self.server
        with srv.lock:
            srv.active += 1
            srv.max_active = max(srv.max_active, srv.active)
        try:
            for _ in range(1200):
                ready, _, _ = select.select([self.connection], [], [], 0.05)
                if ready and self.connection.recv(1, socket.MSG_PEEK) == b"":
                    return  # the client hung up
        finally:
            with srv.lock:
                srv.active -= 1
                srv.closed += 1

    def log_message(self, *a):
        pass


@pytest.fixture
def slow_host():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    srv.daemon_threads = True
    srv.lock, srv.active, srv.max_active, srv.closed = threading.Lock(), 0, 0, 0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


async def until(cond, what: str) -> None:
    for _ in range(3000):  # a hang fails the test (30 s) instead of blocking it
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def vl_app(tiny_vl_dir, **server):
    tok = Tokenizer(tiny_vl_dir)
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(tiny_vl_dir), "tiny"
    cfg.server.allowed_media_hosts = ["127.0.0.1"]
    for k, v in server.items():
        setattr(cfg.server, k, v)
    engine = FakeEngine(tok, tiny_vl_dir, multimodal=True, max_model_len=4096)
    return build_app(engine, tok, cfg), engine


def chat(*urls: str) -> dict:
    return {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": [*(image_part(u) for u in urls), {"type": "text", "text": "?"}]}]}


def slow_urls(srv, n: int) -> list[str]:
    return [f"http://127.0.0.1:{srv.server_address[1]}/slow/{i}.png" for i in range(n)]


async def test_forty_slow_images_download_together_and_end_at_one_deadline(tiny_vl_dir, slow_host):
    """All 40 downloads are open at once (not one after another); the request ends with a 400 naming the
    deadline and closes them; a request with an image sent meanwhile is served."""
    app, engine = vl_app(tiny_vl_dir, media_request_timeout_s=5.0, limit_mm_per_prompt='{"image": 40}')
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=60) as c:
        assert (await c.post(CHAT, json=chat(data_uri(image_bytes(seed=1))))).status_code == 200  # pipeline built
        slow = asyncio.create_task(c.post(CHAT, json=chat(*slow_urls(slow_host, 40))))
        await until(lambda: slow_host.max_active == 40, "40 downloads open at once")
        other = await c.post(CHAT, json=chat(data_uri(image_bytes(seed=2))))
        assert other.status_code == 200 and not slow.done()
        r = await slow
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and "--media-request-timeout-s" in err["message"]
    await until(lambda: slow_host.closed == 40, "every download closed")
    assert len(engine.requests) == 2


async def test_a_client_that_leaves_cancels_its_downloads(tiny_vl_dir, slow_host):
    app, engine = vl_app(tiny_vl_dir, media_request_timeout_s=600.0, limit_mm_per_prompt='{"image": 8}')
    body = json.dumps(chat(*slow_urls(slow_host, 8))).encode()
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await until(lambda: slow_host.max_active == 8, "8 downloads open")
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("test", 80)}
    await asyncio.wait_for(app(scope, receive, send), 30)
    assert sent[0]["status"] == 499
    await until(lambda: slow_host.closed == 8, "every download closed after the client left")
    assert engine.requests == []


async def test_more_images_than_the_limit_is_400_before_any_download(tiny_vl_dir, slow_host):
    app, engine = vl_app(tiny_vl_dir, limit_mm_per_prompt='{"image": 2}')
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        r = await c.post(CHAT, json=chat(*slow_urls(slow_host, 3)))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.2" and "--limit-mm-per-prompt" in err["message"]
    assert slow_host.max_active == 0 and engine.requests == []


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header says w x h and whose pixel data is a few bytes: decoding it would fail as truncated."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


async def test_an_8192_square_image_is_refused_from_its_header(tiny_vl_dir):
    """Refused for its size, not found truncated: the limit is checked before any pixel is decoded."""
    app, engine = vl_app(tiny_vl_dir)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        r = await c.post(CHAT, json=chat(data_uri(png_header(8192, 8192))))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and "8192x8192" in err["message"] and "more than the limit" in err["message"]
    assert engine.requests == []


@pytest.mark.parametrize("value", ['{"image": -1}', '{"picture": 2}', "image=4", '{"image": "4"}', "[4]"])
def test_malformed_limit_mm_per_prompt_is_refused(value):
    cfg = EngineConfig()
    cfg.server.limit_mm_per_prompt = value
    with pytest.raises(ValueError, match="--limit-mm-per-prompt takes a JSON object"):
        cfg.validate()
