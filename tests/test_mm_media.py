"""Media loading: data URIs, downloads with SSRF guards, file:// allow-list, guarded decoding."""

from __future__ import annotations

import ipaddress
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes
from warmfleet.server.multimodal.media import (
    Fetcher,
    HostPolicy,
    MediaConfig,
    MediaError,
    MediaLoader,
    decode_image,
    image_size,
    is_blocked_address,
)


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802
        self.server.seen_hosts.append(self.headers.get("Host"))  # before replying: the client may check at once
        status, headers, body = self.routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen_hosts = []
    _Handler.routes = {}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, _Handler.routes
    srv.shutdown()
    srv.server_close()


def test_data_uri_roundtrip_keeps_raw_bytes():
    raw = image_bytes(32, 24)
    img = MediaLoader(MediaConfig()).load(data_uri(raw), "messages[0].content[1]")
    assert img.data == raw and img.source == "data" and img.image.size == (32, 24)


@pytest.mark.parametrize("uri,needle", [
    ("data:image/png;base64,@@@@", "invalid base64"),
    ("data:image/png,abc", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "image/*"),
    ("data:image/png;base64", "malformed"),
    ("ftp://x/y.png", "unsupported image URL scheme"),
])
def test_bad_data_uris_name_the_part(uri, needle):
    with pytest.raises(MediaError) as e:
        MediaLoader(MediaConfig()).load(uri, "messages[2].content[0]")
    assert str(e.value).startswith("messages[2].content[0]: ") and needle in str(e.value)


def test_not_an_image_and_truncated_image():
    loader = MediaLoader(MediaConfig())
    with pytest.raises(MediaError, match="not a supported image"):
        loader.load(data_uri(b"hello world, not a picture"), "p")
    raw = image_bytes(64, 64)
    with pytest.raises(MediaError, match="truncated or corrupt"):
        loader.load(data_uri(raw[: len(raw) // 2]), "p")


def test_decompression_bomb_refused_before_decoding():
    buf = io.BytesIO()
    Image.new("L", (4000, 4000)).save(buf, "PNG")  # tiny file, 16 Mpx
    with pytest.raises(MediaError, match="more than the limit"):
        decode_image(buf.getvalue(), "p", max_pixels=1_000_000)
    with pytest.raises(MediaError, match="more than the limit"):
        image_size(buf.getvalue(), "p", max_pixels=1_000_000)
    assert image_size(buf.getvalue(), "p", max_pixels=20_000_000) == (4000, 4000)


def test_byte_cap_on_data_uri():
    with pytest.raises(MediaError, match="larger than 100 bytes"):
        MediaLoader(MediaConfig(max_bytes=100)).load(data_uri(image_bytes(32, 24)), "p")


@pytest.mark.parametrize("addr,blocked", [
    ("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.1", True), ("172.16.5.5", True),
    ("169.254.169.254", True), ("100.100.100.200", True), ("0.0.0.0", True), ("::1", True),
    ("fe80::1", True), ("fd00:ec2::254", True), ("::ffff:127.0.0.1", True), ("224.0.0.1", True),
    ("8.8.8.8", False), ("2606:4700:4700::1111", False),
])
def test_blocked_addresses(addr, blocked):
    assert is_blocked_address(ipaddress.ip_address(addr)) is blocked


def test_host_policy_allow_list_by_name_and_cidr():
    p = HostPolicy(["images.internal", "10.0.0.0/8"])
    assert p.allows("images.internal", ipaddress.ip_address("192.168.1.1"))
    assert p.allows("x", ipaddress.ip_address("10.9.9.9"))
    assert not p.allows("x", ipaddress.ip_address("192.168.1.1"))


def test_download_from_allow_listed_loopback(http_server):
    srv, routes = http_server
    raw = image_bytes(32, 24)
    routes["/a.png"] = (200, {"Content-Type": "image/png"}, raw)
    port = srv.server_address[1]
    loader = MediaLoader(MediaConfig(allowed_hosts=["127.0.0.1/32"]))
    img = loader.load(f"http://127.0.0.1:{port}/a.png", "messages[0].content[0]")
    assert img.data == raw and img.source == "http"


def test_loopback_refused_without_allow_list(http_server):
    srv, routes = http_server
    routes["/a.png"] = (200, {}, image_bytes(32, 24))
    with pytest.raises(MediaError, match="non-public address"):
        MediaLoader(MediaConfig()).load(f"http://127.0.0.1:{srv.server_address[1]}/a.png", "p")
    assert srv.seen_hosts == []  # never connected


def test_every_resolved_address_must_pass():
    fetcher = Fetcher(MediaConfig(), resolver=lambda h, p: ["8.8.8.8", "169.254.169.254"])
    with pytest.raises(MediaError, match="169.254.169.254"):
        MediaLoader(MediaConfig(), fetcher).load("http://rebind.example/x.png", "p")


def test_redirect_to_private_address_refused(http_server):
    srv, routes = http_server
    port = srv.server_address[1]
    # "public.test" is allow-listed by name and resolves to loopback; its redirect target is not.
    routes["/r"] = (302, {"Location": f"http://127.0.0.1:{port}/a.png"}, b"")
    routes["/a.png"] = (200, {}, image_bytes(32, 24))
    cfg = MediaConfig(allowed_hosts=["public.test"])
    fetcher = Fetcher(cfg, resolver=lambda h, p: ["127.0.0.1"])
    with pytest.raises(MediaError, match="non-public address"):
        MediaLoader(cfg, fetcher).load(f"http://public.test:{port}/r", "p")
    assert srv.seen_hosts == [f"public.test:{port}"]  # the pinned connection still sent the real Host


def test_redirect_followed_when_target_allowed(http_server):
    srv, routes = http_server
    port = srv.server_address[1]
    raw = image_bytes(32, 24, seed=3)
    routes["/r"] = (301, {"Location": "/a.png"}, b"")
    routes["/a.png"] = (200, {}, raw)
    cfg = MediaConfig(allowed_hosts=["127.0.0.1"])
    assert MediaLoader(cfg).load(f"http://127.0.0.1:{port}/r", "p").data == raw


def test_redirect_loop_and_http_errors(http_server):
    srv, routes = http_server
    port = srv.server_address[1]
    routes["/loop"] = (302, {"Location": "/loop"}, b"")
    loader = MediaLoader(MediaConfig(allowed_hosts=["127.0.0.1"]))
    with pytest.raises(MediaError, match="redirects"):
        loader.load(f"http://127.0.0.1:{port}/loop", "p")
    with pytest.raises(MediaError, match="HTTP 404"):
        loader.load(f"http://127.0.0.1:{port}/missing", "p")


def test_download_byte_cap(http_server):
    srv, routes = http_server
    routes["/big"] = (200, {}, b"x" * 5000)
    loader = MediaLoader(MediaConfig(allowed_hosts=["127.0.0.1"], max_bytes=1000))
    with pytest.raises(MediaError, match="larger than 1000 bytes"):
        loader.load(f"http://127.0.0.1:{srv.server_address[1]}/big", "p")


def test_download_timeout():
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)  # accepts the TCP handshake, never answers
    try:
        loader = MediaLoader(MediaConfig(allowed_hosts=["127.0.0.1"], timeout_s=0.3))
        with pytest.raises(MediaError, match="timed out"):
            loader.load(f"http://127.0.0.1:{lsock.getsockname()[1]}/x", "p")
    finally:
        lsock.close()


def test_file_urls_only_under_allowed_dir(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    raw = image_bytes(32, 24)
    (inside / "a.png").write_bytes(raw)
    (tmp_path / "secret.png").write_bytes(raw)
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(MediaError, match="disabled"):
        MediaLoader(MediaConfig()).load(f"file://{inside}/a.png", "p")
    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(inside)))
    assert loader.load(f"file://{inside}/a.png", "p").data == raw
    for bad in (f"file://{tmp_path}/secret.png", f"file://{inside}/../secret.png", f"file://{inside}/link.png"):
        with pytest.raises(MediaError, match="outside the allowed"):
            loader.load(bad, "p")
    with pytest.raises(MediaError, match="cannot read file"):
        loader.load(f"file://{inside}/nope.png", "p")


@pytest.mark.parametrize("host", [
    "127.0.0.1", "2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::1]", "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]", "localhost", "0.0.0.0", "[::]",
])
def test_ssrf_matrix_loopback_in_every_spelling_never_connects(http_server, host):
    """Decimal, hex, octal and short IPv4, IPv6 and mapped forms, and a DNS name: all refused before connecting."""
    srv, routes = http_server
    routes["/a.png"] = (200, {"Content-Type": "image/png"}, image_bytes(32, 24))
    with pytest.raises(MediaError, match="non-public address|cannot resolve"):
        MediaLoader(MediaConfig()).load(f"http://{host}:{srv.server_address[1]}/a.png", "p")
    assert srv.seen_hosts == []


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/", "http://100.100.100.200/",
    "http://10.0.0.1/", "http://192.168.1.1/", "http://172.16.0.1/", "http://[fe80::1]/",
])
def test_ssrf_matrix_private_link_local_and_metadata_refused(url):
    with pytest.raises(MediaError, match="non-public address"):
        MediaLoader(MediaConfig()).load(url, "p")


@pytest.mark.parametrize("url", ["gopher://127.0.0.1:70/_x", "file:///etc/passwd", "ftp://example.com/a.png",
                                 "dict://127.0.0.1:11211/stats", "jar:http://x/a!/b"])
def test_ssrf_matrix_other_schemes_refused(url):
    with pytest.raises(MediaError):
        MediaLoader(MediaConfig()).load(url, "p")
