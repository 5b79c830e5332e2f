"""The proxy's HTTP/1.1 client (server/router/http/upstream.py) against raw asyncio servers on loopback."""

from __future__ import annotations

import asyncio

import pytest

from warmfleet.server.router.http.upstream import ConnectTimeout, Upstream, UpstreamError


class FakeRawServer:
    """Answers each request on a connection with the next of `answers` (raw bytes; None: close without answering)."""

    def __init__(self, answers: list, close_after: bool = False):
        self.answers, self.close_after = list(answers), close_after
        self.requests: list[bytes] = []
        self.connections = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(x.split(b":")[1] for x in head.split(b"\r\n")
                                  if x.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if answer is None:
                    break
                for part in answer if isinstance(answer, list) else [answer]:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.01)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra + \
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


async def test_keep_alive_reuses_one_connection_and_sends_one_request_each():
    async with FakeRawServer([ok(b'{"a": 1}', b"X-Request-Id: r1\r\nx-request-id: r2\r\n"), ok(b"{}")]) as s:
        up = Upstream(1.0, 5.0)
        r = await up.post(s.url, "/v1/completions", b'{"p": 1}',
                          {"content-type": "application/json", "authorization": "k"})
        assert (r.status, await r.read()) == (200, b'{"a": 1}')
        assert r.headers["x-request-id"] == "r1"  # names lower-cased, the first of repeated ones
        r.release()
        r2 = await up.post(s.url, "/v1/completions", b"{}", {})
        assert await r2.read() == b"{}"
        r2.release()
        await up.close()
    assert s.connections == 1
    first = s.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\ncontent-length: 8\r\n" in first and b"\r\nauthorization: k\r\n" in first
    assert first.endswith(b'{"p": 1}')
    assert f"host: {s.url.split('//')[1]}".encode() in first


async def test_chunked_answer_arrives_in_pieces_then_eof():
    parts = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"5\r\nhello\r\n", b"6\r\n world\r\n",
             b"0\r\n\r\n"]
    async with FakeRawServer([parts, ok(b"again")]) as s:
        up = Upstream(1.0, 5.0)
        r = await up.post(s.url, "/x", b"", {})
        got = [c async for c in r.chunks()]
        assert b"".join(got) == b"hello world" and r.at_eof()
        r.release()
        r2 = await up.post(s.url, "/x", b"", {})  # the same connection, read to its end, serves the next
        assert await r2.read() == b"again"
        await up.close()
    assert s.connections == 1


async def test_answer_delimited_by_close_and_a_cut_answer():
    async with FakeRawServer([b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"], close_after=True) as s:
        r = await Upstream(1.0, 5.0).post(s.url, "/x", b"", {})
        assert await r.read() == b"all of it"
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart"
    async with FakeRawServer([cut], close_after=True) as s:
        r = await Upstream(1.0, 5.0).post(s.url, "/x", b"", {})
        with pytest.raises(UpstreamError):
            await r.read()
    async with FakeRawServer([None]) as s:  # closed before any answer
        with pytest.raises(UpstreamError):
            await Upstream(1.0, 5.0).post(s.url, "/x", b"", {})


async def test_refused_silent_and_bad_header():
    async with FakeRawServer([]) as s:
        url = s.url
    with pytest.raises(UpstreamError) as refused:
        await Upstream(1.0, 5.0).post(url, "/x", b"", {})
    assert not isinstance(refused.value, ConnectTimeout)
    async with FakeRawServer([[b"HTTP/1.1 200 OK\r\n"], ok(b"")]) as s:  # headers never finished, kept open
        with pytest.raises(TimeoutError):
            await Upstream(1.0, 0.2).post(s.url, "/x", b"", {})
    with pytest.raises(ValueError):
        await Upstream(1.0, 5.0).post("http://127.0.0.1:9", "/x", b"", {"x-a": "v\r\nx-b: injected"})
