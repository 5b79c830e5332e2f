"""The node tier's data port with WARMFLEET_NODE_TIER_TOKEN (issue 41): every op needs the token first (compared
in constant time), a wrong or missing one closes the connection, and before it a peer can make the tier hold neither a
large frame nor an idle connection; the replicas' client sends it."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from warmfleet.server.nodetier import server as node_server
from warmfleet.server.nodetier.client import NodeTierClient
from warmfleet.server.nodetier.server import HELLO_MAX_BYTES, NodeServer
from warmfleet.server.nodetier.store import NodeStore
from warmfleet.server.nodetier.wire import HEADER, checksum, pack

TOKEN = "s3cret-token"


async def tier(token=TOKEN, hello_timeout_s=None):
    node = NodeServer(NodeStore(1 << 20), None, token)
    if hello_timeout_s is not None:
        node.hello_timeout_s = hello_timeout_s
    srv = await asyncio.start_server(node.serve_connection, "127.0.0.1", 0)
    return node, srv, srv.sockets[0].getsockname()[1]


async def answer(reader) -> dict:
    meta, payload = HEADER.unpack(await reader.readexactly(HEADER.size))
    assert payload == 0
    return msgpack.unpackb(await reader.readexactly(meta), raw=False)


async def closed(reader) -> bool:
    """The tier closed the connection (EOF, or reset)."""
    try:
        return await asyncio.wait_for(reader.read(1), 5.0) == b""
    except ConnectionError:
        return True


STATS = {"op": "stats"}


@pytest.mark.parametrize("first", [STATS, {"op": "hello"}, {"op": "hello", "token": "s3cret-tokeX"},
                                   {"op": "hello", "token": TOKEN[:-1]}, {"op": "hello", "token": 12345}])
async def test_no_op_is_served_without_the_token(first):
    node, srv, port = await tier()
    async with srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.writelines(pack(first))
        got = await answer(reader)
        assert got == {"ok": False, "error": "bad or missing token"}
        writer.writelines(pack(STATS))  # nothing after a refused hello is read
        assert await closed(reader)
        writer.close()


async def test_the_right_token_opens_every_op():
    node, srv, port = await tier()
    async with srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.writelines(pack({"op": "hello", "token": TOKEN}))
        assert await answer(reader) == {"ok": True}
        writer.writelines(pack({"op": "put", "entries": [{"kind": "kv", "key": b"k", "layout": "L", "data": b"d",
                                                     "sum": checksum(b"d")}]}))
        assert (await answer(reader))["stored"] == 1
        writer.close()


async def test_before_the_token_a_large_frame_is_refused_unread_and_an_idle_peer_is_dropped():
    node, srv, port = await tier(hello_timeout_s=0.2)
    async with srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEADER.pack(HELLO_MAX_BYTES + 1, 0))  # announces more than a hello, sends none of it
        assert await closed(reader)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing at all
        assert await closed(reader)
        writer.close()
        assert node.num_connections == 0


async def test_without_a_token_the_port_is_open():
    node, srv, port = await tier(token=None)
    async with srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.writelines(pack(STATS))
        assert (await answer(reader))["ok"] is True
        writer.close()


async def test_the_replicas_client_sends_the_token_and_a_wrong_one_is_a_miss():
    node, srv, port = await tier()
    async with srv:
        good = NodeTierClient(f"127.0.0.1:{port}", timeout_s=2.0, token=TOKEN)
        bad = NodeTierClient(f"127.0.0.1:{port}", timeout_s=2.0, token="wrong")
        try:
            good.put_async([{"kind": "kv", "key": b"h", "layout": "L", "data": b"x" * 64}])
            assert await asyncio.to_thread(good.flush)
            assert await asyncio.to_thread(good.get, "kv", [b"h"], "L") == [b"x" * 64]
            assert await asyncio.to_thread(bad.get, "kv", [b"h"], "L") == []
            assert bad.counters.failures == 1
        finally:
            good.close()
            bad.close()


def test_the_token_is_compared_in_constant_time():
    """hmac.compare_digest, not ==: the check does not stop at the first differing byte."""
    import inspect
    src = inspect.getsource(NodeServer._hello)
    assert "hmac.compare_digest" in src and "== self.token" not in src
    assert node_server.TOKEN_ENV == "WARMFLEET_NODE_TIER_TOKEN"
