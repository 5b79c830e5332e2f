"""The operator's HTTP reads: no redirects, capped bodies, and the SSRF guard for endpoints a spec names.

A cap keeps one router or hub from running the operator out of memory (and stopping reconciliation everywhere). The
address guard applies to tenants' endpoints only: the operator's own children are in-cluster and private by nature."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

import httpx

METRICS_MAX_BYTES = 4 << 20  # a router's /metrics: a few hundred KiB with every histogram; 4 MiB is ample
JSON_MAX_BYTES = 4 << 20  # /v1/router/replicas, /v1/models


class TooLarge(httpx.HTTPError):
    """A body past its cap: the read stopped there."""


@dataclass(frozen=True)
class Reply:
    """What a bounded request read: the status and at most `limit` bytes of body."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def raise_for_status(self, url: str) -> None:
        """An HTTPError naming the status only (never the body: it may be anything the peer chose)."""
        if self.status_code >= 300:  # a redirect is an error too: the operator follows none
            raise httpx.HTTPError(f"{url}: HTTP {self.status_code}")


async def request(http: httpx.AsyncClient, method: str, url: str, *, limit: int, timeout_s: float,
                  headers: Mapping[str, str] | None = None, json: Any = None) -> Reply:
    """One request without redirects whose body is read up to `limit` bytes (TooLarge past it), within `timeout_s`
    for the whole exchange."""
    async def go() -> Reply:
        async with http.stream(method, url, headers=headers, json=json, follow_redirects=False) as resp:
            size = int(resp.headers.get("content-length") or 0)
            if size > limit:
                raise TooLarge(f"{url}: body of {size} bytes, more than {limit}")
            chunks, got = [], 0
            async for chunk in resp.aiter_bytes():  # decoded: a compressed bomb is cut as it inflates
                got += len(chunk)
                if got > limit:
                    raise TooLarge(f"{url}: body longer than {limit} bytes")
                chunks.append(chunk)
            return Reply(resp.status_code, b"".join(chunks))
    try:
        return await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        raise httpx.TimeoutException(f"{url}: no complete answer within {timeout_s:g}s") from None


# ---- endpoints named in a spec (spec.model.hub.endpoint, spec.model.s3.endpoint) ----

def endpoint_problem(url: str, allowed: tuple[str, ...] = (), resolve: Any = None) -> str | None:
    """Why the operator must not contact `url`, a tenant-given endpoint: a private, loopback, link-local, metadata or
    otherwise non-global address (in any spelling, IPv4 inside IPv6 too), unless its host or a network holding it is
    in `allowed` (the admin's allow-list). None when it may. `resolve(host, port)` → addresses (default: DNS)."""
    from warmfleet.server.multimodal.media import HostPolicy

    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        return f"{url}: not an http(s) URL with a host"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    policy = HostPolicy(list(allowed))
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addresses = [ipaddress.ip_address(a) for a in (resolve or _resolve)(host, port)]
        except (OSError, ValueError) as exc:
            return f"{url}: cannot resolve {host} ({exc})"
    bad = [str(a) for a in addresses if not policy.allows(host, a)]
    if bad:
        return (f"{url}: {host} resolves to a private, link-local or metadata address ({', '.join(bad)}); the operator "
                "reads no such endpoint unless the cluster admin allows it (chart value operator.allowedEndpointHosts)")
    return None


def _resolve(host: str, port: int) -> list[str]:
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
