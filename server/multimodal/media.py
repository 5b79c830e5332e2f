"""Loading image content parts (data: URIs, http(s) with SSRF guards, allow-listed file://) and guarded decoding; no paddle.

Every failure raises `MediaError`, whose message starts with the content part that failed
(e.g. ``messages[0].content[1]``) so the API can answer 400 with it verbatim.

A download is checked at every hop:

    URL ──► resolve host ──► every address public (or allow-listed)? ──► connect to that
            same address (no second DNS lookup, so no rebinding) ──► 3xx? check Location again

An IPv6 address that carries an IPv4 one (mapped ::ffff:a.b.c.d, compatible ::a.b.c.d, NAT64
64:ff9b::/96, 6to4 2002::/16) is judged by that IPv4 address too; the local-use NAT64 prefix
64:ff9b:1::/48 is never public. A request's downloads run concurrently and share one deadline
(`fetch_all`); cancelling the request closes them.

Decoding never trusts the header: the pixel count is checked before any pixel is decoded,
and truncated or non-image data fails instead of producing a half-grey picture.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import unquote, urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from ..config import DEFAULT_MAX_IMAGE_PIXELS

# Formats Pillow may try; anything else is "not an image" (smaller decoder attack surface).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
MAX_REDIRECTS = 5

# Cloud metadata endpoints that are not covered by "not globally routable" on every platform.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)

NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the last 32 bits are an IPv4 address
NAT64_LOCAL_USE = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: a site's own translators, never public
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]


class MediaError(ValueError):
    """A content part could not be loaded or decoded; the message names the part (HTTP 400)."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


@dataclass
class MediaConfig:
    """Limits for fetching and decoding media; build from ServerConfig with `from_server_config`."""

    allowed_local_media_path: Optional[str] = None  # directory under which file:// may read; None forbids file://
    allowed_hosts: list[str] = field(default_factory=list)  # host names or CIDRs that may be private
    timeout_s: float = 10.0  # whole download including redirects, seconds
    request_timeout_s: float = 30.0  # every download of one request, together (they run concurrently), seconds
    max_bytes: int = 20 << 20  # largest raw media item, bytes (data: URIs, downloads, files)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height cap, checked on the header before decoding
    max_images_per_prompt: Optional[int] = None  # --limit-mm-per-prompt's "image"; None: no limit

    @classmethod
    def from_server_config(cls, server) -> "MediaConfig":
        return cls(
            allowed_local_media_path=server.allowed_local_media_path,
            allowed_hosts=list(server.allowed_media_hosts or []),
            timeout_s=server.media_fetch_timeout_s,
            request_timeout_s=server.media_request_timeout_s,
            max_bytes=server.media_max_bytes,
            max_image_pixels=server.media_max_pixels,
            max_images_per_prompt=server.mm_limits()["image"],
        )


@dataclass
class LoadedImage:
    """One image content part: the raw bytes (what mm_hash digests) and the decoded picture."""

    data: bytes  # raw media bytes after base64 decoding / download / file read
    image: Image.Image  # decoded, fully loaded (not yet converted to RGB)
    source: str  # "data" | "http" | "file"


def _system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def embedded_ipv4(ip: IPAddress) -> Optional[ipaddress.IPv4Address]:
    """The IPv4 address an IPv6 one carries (mapped, compatible, NAT64 well-known prefix, 6to4), else None."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64_WELL_KNOWN or (ip in IPV4_COMPATIBLE and int(ip) > 1):  # :: and ::1 are IPv6's own
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_blocked_address(ip: IPAddress) -> bool:
    """True for loopback, private, link-local, multicast, reserved, unspecified and cloud-metadata addresses,
    in any spelling: an IPv6 address is also judged by the IPv4 address it embeds."""
    inner = embedded_ipv4(ip)
    if inner is not None and _blocked(inner):
        return True
    return _blocked(ip) or ip in NAT64_LOCAL_USE


def _blocked(ip: IPAddress) -> bool:
    return ip in METADATA_ADDRESSES or not ip.is_global or ip.is_multicast


class HostPolicy:
    """Decides whether a (host, resolved address) may be contacted."""

    def __init__(self, allowed: list[str]):
        self.names: set[str] = set()
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allowed:
            entry = entry.strip()
            if not entry:
                continue
            try:
                self.nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))

    def allows(self, host: str, ip: IPAddress) -> bool:
        if host.lower().rstrip(".") in self.names:
            return True
        inner = embedded_ipv4(ip)
        if any((ip.version == n.version and ip in n) or (inner is not None and n.version == 4 and inner in n)
               for n in self.nets):
            return True
        return not is_blocked_address(ip)


def decode_data_uri(uri: str, where: str, max_bytes: int) -> bytes:
    """Bytes of a base64 `data:` URI; only base64 payloads are accepted."""
    header, sep, payload = uri.partition(",")
    if not sep:
        raise MediaError(where, "malformed data: URI (no comma)")
    params = header[5:].split(";")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaError(where, "data: URI must be base64-encoded")
    mime = params[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise MediaError(where, f"data: URI has media type {mime!r}, expected image/*")
    payload = "".join(payload.split())
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise MediaError(where, f"image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(where, f"invalid base64 in data: URI ({exc})") from None
    if len(data) > max_bytes:
        raise MediaError(where, f"image is larger than {max_bytes} bytes")
    return data


def read_local_file(url: str, where: str, cfg: MediaConfig) -> bytes:
    """Bytes of a file:// URL whose real path lies under `cfg.allowed_local_media_path`."""
    if not cfg.allowed_local_media_path:
        raise MediaError(where, "file:// URLs are disabled (start the server with --allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(where, f"file:// URL must not name a host, got {parts.netloc!r}")
    root = os.path.realpath(cfg.allowed_local_media_path)
    path = os.path.realpath(unquote(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise MediaError(where, f"file is outside the allowed media directory {root}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > cfg.max_bytes:
                raise MediaError(where, f"image is larger than {cfg.max_bytes} bytes")
            return f.read(cfg.max_bytes + 1)
    except OSError as exc:
        raise MediaError(where, f"cannot read file: {exc.strerror or exc}") from None


class Fetcher:
    """Downloads http(s) media with a byte cap, a timeout and address checks on every hop.

    Connections go to the already-checked IP with the original Host header and TLS server name,
    so a second DNS answer can never redirect the request.
    """

    def __init__(self, cfg: MediaConfig, resolver: Optional[Resolver] = None,
                 transport: Optional[httpx.AsyncBaseTransport] = None):
        self.cfg = cfg
        self.policy = HostPolicy(cfg.allowed_hosts)
        self.resolver = resolver or _system_resolver
        self.transport = transport

    def client(self) -> httpx.AsyncClient:
        """A connection pool for one request's downloads; leaving it closes them."""
        return httpx.AsyncClient(follow_redirects=False, transport=self.transport, trust_env=False)

    async def _pick_address(self, host: str, port: int, where: str) -> IPAddress:
        try:
            literal = ipaddress.ip_address(host.strip("[]"))
            addrs: list[IPAddress] = [literal]
        except ValueError:
            try:
                answers = await asyncio.to_thread(self.resolver, host, port)
                addrs = [ipaddress.ip_address(a.split("%")[0]) for a in answers]
            except (OSError, UnicodeError) as exc:
                raise MediaError(where, f"cannot resolve host {host!r}: {exc}") from None
        if not addrs:
            raise MediaError(where, f"host {host!r} has no addresses")
        # Every address must pass: an attacker's DNS may return one public and one private answer.
        for ip in addrs:
            if not self.policy.allows(host, ip):
                raise MediaError(where, f"URL host {host!r} resolves to a non-public address ({ip}); refused")
        return addrs[0]

    def fetch(self, url: str, where: str) -> bytes:
        """Blocking download, for callers without an event loop (the offline LLM); the API uses `fetch_async`."""

        async def once() -> bytes:
            async with self.client() as client:
                return await self.fetch_async(url, where, client)

        return asyncio.run(once())

    async def fetch_async(self, url: str, where: str, client: httpx.AsyncClient) -> bytes:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeout_s
        for _hop in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https"):
                raise MediaError(where, f"redirect to unsupported scheme {parts.scheme!r}")
            host = parts.hostname
            if not host:
                raise MediaError(where, "URL has no host")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            ip = await self._pick_address(host, port, where)
            ip_host = f"[{ip}]" if ip.version == 6 else str(ip)
            netloc = ip_host if parts.port is None else f"{ip_host}:{parts.port}"
            pinned = parts._replace(netloc=netloc).geturl()
            host_header = parts.netloc.rsplit("@", 1)[-1]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MediaError(where, f"download timed out after {cfg.timeout_s} s")
            try:
                async with client.stream(
                    "GET", pinned, headers={"Host": host_header, "Accept": "image/*"},
                    timeout=httpx.Timeout(remaining), extensions={"sni_hostname": host},
                ) as resp:
                    if resp.is_redirect:
                        loc = resp.headers.get("location")
                        if not loc:
                            raise MediaError(where, f"redirect {resp.status_code} without Location")
                        url = urljoin(url, loc)
                        continue
                    return await self._read_body(resp, where, deadline)
            except httpx.TimeoutException:
                raise MediaError(where, f"download timed out after {cfg.timeout_s} s") from None
            except httpx.HTTPError as exc:
                raise MediaError(where, f"download failed: {exc}") from None
        raise MediaError(where, f"more than {MAX_REDIRECTS} redirects")

    async def _read_body(self, resp: httpx.Response, where: str, deadline: float) -> bytes:
        cfg = self.cfg
        if resp.status_code != 200:
            raise MediaError(where, f"download failed with HTTP {resp.status_code}")
        declared = resp.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cfg.max_bytes:
            raise MediaError(where, f"image is larger than {cfg.max_bytes} bytes")
        buf = bytearray()
        async for chunk in resp.aiter_bytes():
            buf += chunk
            if len(buf) > cfg.max_bytes:
                raise MediaError(where, f"image is larger than {cfg.max_bytes} bytes")
            if time.monotonic() > deadline:
                raise MediaError(where, f"download timed out after {cfg.timeout_s} s")
        return bytes(buf)


def image_size(data: bytes, where: str, max_pixels: int) -> tuple[int, int]:
    """(width, height) from the header only; enough for the router to count image tokens."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
                w, h = im.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _too_many_pixels(where, max_pixels, exc) from None
    except UnidentifiedImageError:
        raise MediaError(where, "data is not a supported image (png, jpeg, webp, gif, bmp, tiff)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(where, f"cannot read image header: {exc}") from None
    _check_pixels(w, h, where, max_pixels)
    return w, h


def _check_pixels(w: int, h: int, where: str, max_pixels: int) -> None:
    if w < 1 or h < 1:
        raise MediaError(where, f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise MediaError(where, f"image has {w}x{h} pixels, more than the limit of {max_pixels}")


def _too_many_pixels(where: str, max_pixels: int, exc: Exception) -> MediaError:
    """Pillow's own bomb check fires at open, before ours, for images past twice its limit."""
    return MediaError(where, f"image has more pixels than the limit of {max_pixels} (a decompression bomb?): {exc}")


def decode_image(data: bytes, where: str, max_pixels: int) -> Image.Image:
    """Fully decoded image; refuses oversize, truncated and non-image data before/while decoding."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            _check_pixels(im.size[0], im.size[1], where, max_pixels)
            im.load()
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _too_many_pixels(where, max_pixels, exc) from None
    except UnidentifiedImageError:
        raise MediaError(where, "data is not a supported image (png, jpeg, webp, gif, bmp, tiff)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(where, f"image data is truncated or corrupt: {exc}") from None
    return im


class MediaLoader:
    """Turns an image URL (data:, http(s), file://) into raw bytes and a decoded image."""

    def __init__(self, cfg: MediaConfig, fetcher: Optional[Fetcher] = None):
        self.cfg = cfg
        self.fetcher = fetcher or Fetcher(cfg)

    async def fetch_all(self, items: list[tuple[str, str]]) -> dict[str, bytes]:
        """Bytes of every http(s) URL of one request, as (url, where) pairs: downloaded concurrently, all within
        `cfg.request_timeout_s`; the first failure, the deadline or a cancelled caller ends the others."""
        first_where: dict[str, str] = {}  # each URL once, named by its first part
        for url, where in items:
            first_where.setdefault(url, where)
        if not first_where:
            return {}
        async with self.fetcher.client() as client:
            tasks = {url: asyncio.ensure_future(self.fetcher.fetch_async(url, where, client))
                     for url, where in first_where.items()}
            try:
                async with asyncio.timeout(self.cfg.request_timeout_s):
                    await asyncio.gather(*tasks.values())
            except TimeoutError:
                late = next((first_where[u] for u, t in tasks.items() if t.cancelled()), items[0][1])
                raise MediaError(late, f"the request's images did not all arrive within {self.cfg.request_timeout_s:g} s "
                                       "(--media-request-timeout-s)") from None
            finally:
                for t in tasks.values():
                    t.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {url: t.result() for url, t in tasks.items()}

    def load_bytes(self, url: str, where: str) -> tuple[bytes, str]:
        """Raw bytes of the item and its source kind, without decoding."""
        if not isinstance(url, str) or not url:
            raise MediaError(where, "image_url.url must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_data_uri(url, where, self.cfg.max_bytes), "data"
        if scheme in ("http", "https"):
            return self.fetcher.fetch(url, where), "http"
        if scheme == "file":
            return read_local_file(url, where, self.cfg), "file"
        raise MediaError(where, f"unsupported image URL scheme {scheme or url[:16]!r}; use data:, http(s): or file:")

    def load(self, url: str, where: str) -> LoadedImage:
        data, source = self.load_bytes(url, where)
        return LoadedImage(data, decode_image(data, where, self.cfg.max_image_pixels), source)
