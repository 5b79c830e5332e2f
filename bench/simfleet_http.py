"""The simulator's small HTTP/1.1 server over httptools: a connection's parsing, its replies (whole or chunked
SSE) and the listening sockets. Knows nothing of replicas: requests go to the app's `handle`."""

from __future__ import annotations

import asyncio
import json
import socket
from collections import deque
from typing import Any, Optional, Protocol

import httptools




class App(Protocol):
    """What a connection needs of the server it belongs to (simfleet.SimFleet)."""

    conns: dict[str, set]

    async def handle(self, target: Any, method: str, path: str, body: bytes, headers: dict, reply: "HttpReply",
                     conn: "HttpConn") -> None: ...


# --- a small HTTP/1.1 server (httptools) ------------------------------------------------------
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
           503: "Service Unavailable"}


class HttpReply:
    """What a handler writes: one whole response, or a chunked stream whose headers leave with its first chunk."""

    def __init__(self, conn: "HttpConn", keep_alive: bool):
        self.conn, self.keep_alive = conn, keep_alive
        self.started = False
        self.finished = False

    def _head(self, status: int, headers: list[tuple[str, str]], extra: str) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'OK')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        lines.append(extra)
        if not self.keep_alive:
            lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def send(self, status: int, body: bytes, headers: list[tuple[str, str]] = (),
             content_type: str = "application/json") -> None:
        head = self._head(status, [("content-type", content_type), *headers], f"content-length: {len(body)}")
        self.conn.write(head + body)
        self.finished = True

    def stream_start(self, status: int, headers: list[tuple[str, str]], first: bytes) -> None:
        head = self._head(status, [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *headers],
                          "transfer-encoding: chunked")
        self.conn.write(head + b"%x\r\n%s\r\n" % (len(first), first))
        self.started = True

    def stream(self, data: bytes) -> None:
        if data:
            self.conn.write(b"%x\r\n%s\r\n" % (len(data), data))

    def stream_end(self, data: bytes = b"") -> None:
        self.conn.write((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n")
        self.finished = True


class HttpConn(asyncio.Protocol):
    """One client connection: parses requests with httptools, runs them one at a time (pipelining kept in order)."""

    def __init__(self, app: App, target: Any):
        self.app, self.target = app, target
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Optional[asyncio.Transport] = None
        self.queue: deque = deque()
        self.busy = False
        self.closed = False
        self._url = b""
        self._body: list[bytes] = []
        self._headers: dict[bytes, bytes] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.target is not None:
            self.app.conns.setdefault(self.target.rid, set()).add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.target is not None:
            self.app.conns.get(self.target.rid, set()).discard(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._body, self._headers = b"", [], {}

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        msg = (self.parser.get_method().decode(), self._url.decode().split("?", 1)[0], b"".join(self._body),
               self._headers, self.parser.should_keep_alive())
        self.queue.append(msg)
        if not self.busy:
            self.busy = True
            asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                method, path, body, headers, keep_alive = self.queue.popleft()
                reply = HttpReply(self, keep_alive)
                try:
                    await self.app.handle(self.target, method, path, body, headers, reply, self)
                except Exception as exc:  # a handler bug answers 500, never kills the server
                    if not reply.started and not reply.finished:
                        reply.send(500, json.dumps({"error": {"message": repr(exc)}}).encode())
                    elif not reply.finished:
                        reply.stream_end()
                if (not keep_alive or (self.target is not None and self.target.terminating)) \
                        and self.transport is not None:
                    self.transport.close()
                    return
        finally:
            self.busy = False


def error(message: str, status: int = 400) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _listen(host: str) -> socket.socket:
    s = _bound(host)
    s.listen(1024)
    return s


def _bound(host: str, port: int = 0) -> socket.socket:
    """A bound socket that does not listen yet: connections to it are refused."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.setblocking(False)
    return s


_PORTS: set[int] = set()


def _free_port(host: str) -> int:
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p not in _PORTS:
            _PORTS.add(p)
            return p
