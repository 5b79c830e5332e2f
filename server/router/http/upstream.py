"""The proxy's HTTP/1.1 client to the replicas: keep-alive connections per replica, httptools' parser.

What forwarding needs and no more: POST a body with a few headers in one write, the status and
headers, then the body whole (`read`) or as it arrives (`chunks`); a connection goes back to its
replica's pool when its answer was read to the end and the replica keeps it alive. aiohttp did the
same for ~28% of the router's CPU per request (docs/router.md, "Where a request's CPU goes"); this
is the part of it the relay uses. Failures are OSErrors (`UpstreamError`: reset, closed or malformed
answer; `NotSent`: refused or timed-out connection, the request never left), silence longer than
`read_timeout_s` is `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit

import httptools

PAUSE_ABOVE = 1 << 18  # bytes buffered from a replica before reading from it pauses (a slow client)
KEEPALIVE_S = 60.0  # an idle connection older than this is not reused


class UpstreamError(ConnectionError):
    """The replica refused, reset or closed the connection, or answered something that is not HTTP/1.1."""


class NotSent(UpstreamError):
    """The request never reached the replica (no connection, or an unusable URL): retrying it elsewhere is safe.
    Any other UpstreamError came after the request went out: the replica may have run it, and died of it."""


class ConnectTimeout(NotSent):
    """No connection to the replica within the connect timeout."""


class UpstreamResponse:
    """One answer: `status`, `headers` (lower-case names, the first of repeated ones), its body by `read`/`chunks`."""

    def __init__(self, conn: "_Connection"):
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._body: list[bytes] = []
        self._size = 0
        self._done = False  # the whole body has arrived
        self._error: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None

    def at_eof(self) -> bool:
        return self._done and not self._body

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        while not self._done:
            await self._wait()
        out = b"".join(self._body)
        self._body.clear()
        return out

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything buffered at each wake-up, joined."""
        while True:
            if self._body:
                out = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                self._size = 0
                self._conn.resume()
                yield out
            elif self._done:
                return
            else:
                await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._conn.loop.create_future()
        await self._conn.wait(self._waiter)
        if self._error is not None and not self._body:
            raise self._error

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def release(self) -> None:
        """Done with this answer: its connection is reused when the answer was read whole, else closed."""
        self._conn.finish(self._done)

    def close(self) -> None:
        self._conn.finish(False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; one answer at a time."""

    def __init__(self, pool: "_Pool", read_timeout_s: float):
        self.pool, self.read_timeout_s = pool, read_timeout_s
        self.loop = asyncio.get_running_loop()
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Optional[UpstreamResponse] = None
        self.head: Optional[asyncio.Future] = None  # resolved when the answer's headers are in
        self.closed = False
        self.paused = False
        self.keep_alive = False  # the last answer allows another request on this connection
        self.idle_since = 0.0

    # --- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # bytes nobody asked for: this connection cannot be trusted with the next answer
            self.closed = True
            self.pool.forget(self)
            self.transport.close()  # type: ignore[union-attr]
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad answer: {exc}"))
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.closed = True
        self.pool.forget(self)
        r = self.resp
        if exc is None and r is not None and not r._done and r.status and "content-length" not in r.headers \
                and "chunked" not in r.headers.get("transfer-encoding", ""):
            r._done = True  # an answer delimited by the connection's end
            r._wake()
            return
        self._fail(UpstreamError("connection closed by the replica" if exc is None else f"connection lost: {exc!r}"))

    # --- httptools callbacks --------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        self.resp.headers.setdefault(key, value.decode("latin-1"))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        r = self.resp
        if r is None:
            return
        r.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(r)

    def on_body(self, body: bytes) -> None:
        r = self.resp
        if r is None:
            return
        r._body.append(body)
        r._size += len(body)
        if r._size > PAUSE_ABOVE and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        r._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # only meaningful inside the parser's callbacks
        r = self.resp
        if r is not None:
            r._done = True
            r._wake()

    # --- the client side -----------------------------------------------------------------------
    async def request(self, head: bytes, body: bytes) -> UpstreamResponse:
        self.resp, self.keep_alive = UpstreamResponse(self), False
        self.head = self.loop.create_future()
        self.transport.write(head + body if len(body) < 65536 else head)  # type: ignore[union-attr]
        if len(body) >= 65536:
            self.transport.write(body)  # type: ignore[union-attr]
        try:
            return await self.wait(self.head)
        except asyncio.CancelledError:  # the caller gave up (its client left): the replica sees the connection close
            self.finish(False)
            raise

    async def wait(self, fut: asyncio.Future):
        """`fut`'s result, or TimeoutError after `read_timeout_s` of it pending (the connection is closed then)."""
        timer = self.loop.call_later(self.read_timeout_s, self._timed_out, fut)
        try:
            return await fut
        finally:
            timer.cancel()

    def _timed_out(self, fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError(f"no answer for {self.read_timeout_s} s"))
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        r = self.resp
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        if r is not None and not r._done:
            r._error = exc
            w, r._waiter = r._waiter, None
            if w is not None and not w.done():
                w.set_exception(exc)

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def finish(self, complete: bool) -> None:
        """The caller is done with the answer: back to the pool when it was read whole and may be kept."""
        if self.resp is None:
            return
        self.resp = self.head = None
        if complete and not self.closed and self.keep_alive:
            self.idle_since = time.monotonic()
            self.pool.put(self)
        else:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()


class _Pool:
    """Idle connections to one replica (last used first)."""

    def __init__(self, host: str, port: int, tls: bool = False):
        self.host, self.port, self.tls = host, port, tls
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()

    def take(self) -> Optional[_Connection]:
        now = time.monotonic()
        while self.idle:
            c = self.idle.pop()
            if not c.closed and now - c.idle_since < KEEPALIVE_S:
                return c
            c.closed = True
            if c.transport is not None:
                c.transport.close()
        return None

    def put(self, c: _Connection) -> None:
        self.idle.append(c)

    def forget(self, c: _Connection) -> None:
        self.open.discard(c)
        if c in self.idle:
            self.idle.remove(c)


class Upstream:
    """Pooled keep-alive HTTP/1.1 to the replicas (`post`); `close()` closes every connection."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float):
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._pools: dict[str, tuple[_Pool, bytes, bytes]] = {}  # base URL -> (pool, Host header, path prefix)
        self.closed = False
        self._ssl: Optional[ssl.SSLContext] = None

    def _pool(self, base: str) -> tuple[_Pool, bytes, bytes]:
        found = self._pools.get(base)
        if found is None:
            u = urlsplit(base)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise NotSent(f"unsupported replica URL {base!r}")
            tls = u.scheme == "https"
            pool = _Pool(u.hostname, u.port or (443 if tls else 80), tls)
            found = self._pools[base] = (pool, u.netloc.encode("latin-1"), u.path.rstrip("/").encode("latin-1"))
        return found

    async def post(self, base: str, path: str, body: bytes, headers: dict) -> UpstreamResponse:
        """POST `body` to `base` + `path` with `headers` (names and values without CR/LF); the answer's head is in."""
        pool, host, prefix = self._pool(base)
        lines = [b"POST ", prefix, path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", host,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers.items():
            if "\r" in v or "\n" in v or "\r" in k or "\n" in k:
                raise ValueError(f"header {k!r} holds a line break")
            lines += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        lines.append(b"\r\n")
        conn = pool.take() or await self._connect(pool)
        return await conn.request(b"".join(lines), body)

    async def _connect(self, pool: _Pool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool, self.read_timeout_s), pool.host, pool.port,
                                       ssl=self._tls() if pool.tls else None),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectTimeout(f"no connection to {pool.host}:{pool.port} in {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise NotSent(f"cannot connect to {pool.host}:{pool.port}: {exc}") from exc
        pool.open.add(conn)
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def close(self) -> None:
        self.closed = True
        for pool, _, _ in self._pools.values():
            for c in list(pool.open):
                if c.transport is not None:
                    c.transport.close()
            pool.idle.clear()
            pool.open.clear()
