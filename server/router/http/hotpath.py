"""The two cache-routed POST routes served straight from uvicorn's httptools protocol, without an ASGI cycle.

    bytes ─▶ httptools parser ─┬─ POST /v1/chat/completions or /v1/completions ─▶ HotRequest
                               │  (Content-Length within the cap, no Expect, no X-Forwarded-For)
                               │      ─▶ Frontend.respond ─▶ status line, headers, body written at once
                               └─ anything else ─▶ uvicorn's RequestResponseCycle ─▶ the ASGI app (FastAPI)

Per request, uvicorn's cycle builds an ASGI scope, an Event, ASGI message dicts for every send and
receive, and runs the request through the proxy-headers middleware and the app's ASGI wrapper; the
Starlette response then walks its headers once more to send them. For the hot routes that was
about a sixth of the router's CPU (docs/router.md, "Where a request's CPU goes"). Here the body
is collected from the parser's callbacks, the frontend answers, and the answer's status line,
headers and body are written at once (a stream as chunked frames, each as relayed). Whatever
this path does not handle exactly as the ASGI path would (a body over the cap or of unknown
length, `Expect: 100-continue`, a forwarded client address, an upgrade, a pipelined request
behind an unfinished one) goes the ASGI way, unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

import httptools
from starlette.responses import StreamingResponse
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ...api.deadlines import deadline_protocol
from .app import FAST_PATHS, TRACE_HEADERS, Frontend
from .transport import CoalescingTransport

log = logging.getLogger(__name__)

_FALLBACK_HEADERS = frozenset((b"expect", b"x-forwarded-for", b"transfer-encoding", b"upgrade"))
_HOT_TARGETS = {path.encode(): (path, kind) for path, kind in FAST_PATHS.items()}  # raw request path -> route


class _NoWaiters:
    """HotRequest's `message_event`: uvicorn sets it when the client leaves, but no hot request waits on its body."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_WAITERS = _NoWaiters()


class HotRequest:
    """One hot-route request on a connection: what uvicorn's protocol reads of a cycle, plus the parsed request."""

    __slots__ = ("path", "kind", "auth", "trace", "body", "keep_alive", "message_event", "disconnected",
                 "response_started", "response_complete", "serving")

    def __init__(self, path: str, kind: str, auth: Optional[str], keep_alive: bool, trace: dict):
        self.path, self.kind, self.auth, self.keep_alive = path, kind, auth, keep_alive
        self.trace = trace  # the request's trace headers (tracing.HEADERS) by name
        self.body = bytearray()
        self.message_event = _NO_WAITERS  # set by uvicorn's connection_lost
        self.disconnected = False
        self.response_started = False  # read by the read deadlines (api/deadlines.py): nothing answered before the body
        self.response_complete = False
        self.serving: Optional[asyncio.Task] = None  # the task serving it: cancelled if the client leaves first


class HotPathProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with coalesced writes, serving the hot routes itself through `frontend`."""

    frontend: Frontend  # set by hot_protocol on a subclass per app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        hot = self.cycle
        super().connection_lost(exc)
        if isinstance(hot, HotRequest) and hot.serving is not None and not hot.response_complete:
            # the client left: stop serving it, whatever the phase (routing, awaiting the replica, relaying). The
            # proxy closes its upstream connection, and the replica aborts the generation on that disconnect.
            hot.serving.cancel()

    def on_headers_complete(self) -> None:
        hot = self._hot_request()
        if hot is None:
            return super().on_headers_complete()
        self.cycle = hot  # type: ignore[assignment]  # what on_body / connection_lost / shutdown read

    def _hot_request(self) -> Optional[HotRequest]:
        """The request as a HotRequest when this path serves it exactly as the ASGI path would, else None."""
        if self.parser.get_method() != b"POST" or "proxy" not in self.frontend.state:
            return None
        if self.cycle is not None and not self.cycle.response_complete:  # pipelined: uvicorn queues it
            return None
        url = self.url  # origin form ("/path?query") as clients send it; anything else through the URL parser
        target = _HOT_TARGETS.get(url.partition(b"?")[0] if url[:1] == b"/" else httptools.parse_url(url).path)
        if target is None:
            return None
        path, kind = target
        auth, length = None, None
        trace: dict = {}
        for name, value in self.headers:  # lower-cased by on_header
            if name in _FALLBACK_HEADERS:
                return None
            if name == b"authorization" and auth is None:
                auth = value.decode("latin-1")
            elif name == b"content-length" and length is None:
                length = value
            elif name in TRACE_HEADERS:
                trace.setdefault(name.decode(), value.decode("latin-1"))
        if length is None or not length.isdigit() or int(length) > self.frontend.max_request_bytes:
            return None  # the ASGI path answers 411-less bodies and the 413 before buffering
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        return HotRequest(path, kind, auth, keep_alive, trace)

    def on_body(self, body: bytes) -> None:
        hot = self.cycle
        if not isinstance(hot, HotRequest):
            return super().on_body(body)
        hot.body += body  # bounded: its declared length is within the cap (_hot_request)

    def on_message_complete(self) -> None:
        hot = self.cycle
        if not isinstance(hot, HotRequest):
            return super().on_message_complete()
        task = hot.serving = self.loop.create_task(self._serve(hot))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _serve(self, hot: HotRequest) -> None:
        client_addr = self.client[0] if self.client else "unknown"
        started = False
        try:
            resp, slot = await self.frontend.respond(hot.path, hot.kind, bytes(hot.body), hot.auth, client_addr,
                                                     hot.trace)
            try:
                started = True
                await self._write(hot, resp)
                if resp.background is not None:
                    await resp.background()
            finally:
                if slot is not None:
                    self.frontend.limiter.release(slot)
        except Exception:
            log.exception("router request failed")
            if not started and not hot.disconnected:
                self._write_head(hot, 500, [(b"content-type", b"text/plain; charset=utf-8"),
                                            (b"content-length", b"21")], close=True)
                self.transport.write(b"Internal Server Error")
            self.transport.close()
            return
        self._complete(hot)

    def _write_head(self, hot: HotRequest, status: int, headers: list, close: bool = False) -> None:
        out = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        for name, value in headers:
            out += (name, b": ", value, b"\r\n")
        if close or not hot.keep_alive:
            hot.keep_alive = False
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        self.transport.write(b"".join(out))

    async def _write(self, hot: HotRequest, resp) -> None:
        if not isinstance(resp, StreamingResponse):
            if not hot.disconnected:
                self._write_head(hot, resp.status_code, resp.raw_headers)
                self.transport.write(resp.body)
            return
        # a stream is started even if the client has gone (a closing transport drops the bytes): closing a
        # relay that never started would skip its finally, which gives the replica's in-flight count back
        self._write_head(hot, resp.status_code, [*resp.raw_headers, (b"transfer-encoding", b"chunked")])
        async with contextlib.aclosing(resp.body_iterator) as chunks:
            async for chunk in chunks:
                if hot.disconnected:
                    return
                if chunk:
                    data = chunk if isinstance(chunk, bytes) else chunk.encode()
                    self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                if self.flow.write_paused:
                    await self.flow.drain()
        if not hot.disconnected:
            self.transport.write(b"0\r\n\r\n")

    def _complete(self, hot: HotRequest) -> None:
        hot.response_complete = True
        if hot.disconnected:
            return
        if not hot.keep_alive:
            self.transport.close()
        self.on_response_complete()  # uvicorn: resume reading, start a queued request, arm keep-alive


def hot_protocol(frontend: Frontend, header_timeout_s: Optional[float] = None,
                 body_timeout_s: Optional[float] = None) -> type:
    """HotPathProtocol serving through `frontend` (uvicorn makes one protocol instance per connection); with the
    timeouts, under the replicas' read deadlines too (api/deadlines.py: a late head or body is a 408)."""
    if header_timeout_s is None or body_timeout_s is None:
        return type("HotPathProtocol", (HotPathProtocol,), {"frontend": frontend})
    return type("HotPathProtocol", (deadline_protocol(header_timeout_s, body_timeout_s), HotPathProtocol),
                {"frontend": frontend})
