"""`warmfleet node-tier`: the node tier's TCP server (asyncio) and its KV-event publisher; owns one NodeStore.

    replica engine cores on the node ──TCP, wire.py frames──▶ NodeServer ── NodeStore (host memory, LRU)
    router(s) ◀──ZMQ XPUB, contract 2, topic node:<NAME>, medium NODE── publisher

Each connection is served in order, one frame at a time; the store is touched only from the event loop, so a put
is committed whole between two frames of other connections. After every request the store's events go out as one
batch; every new subscription (a router connecting, or one asking for a resync) is answered with the whole state
led by AllBlocksCleared, and the first batch after a start is AllBlocksCleared alone (the tier starts empty).
A connection may open with {op: "hello", holder} naming the replica behind it (the store's claims: what that
replica holds in its primary pool; they end when its last connection closes). With WARMFLEET_NODE_TIER_TOKEN set,
a connection must open with {op: "hello", token, holder?} (the token compared in constant time) or it is closed; that first frame may be at most HELLO_MAX_BYTES and must arrive within HELLO_TIMEOUT_S, so a peer
without the token can make the tier hold neither a large frame nor an idle connection. The events port has no
token; with --kv-events-curve-secret-key and --kv-events-curve-clients (the replicas' flags, same meaning) it is a ZMQ
CURVE server that admits only the listed subscribers' keys, encrypted; either way its NetworkPolicy (operator) keeps
it to the service's routers and pickers.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
from typing import Optional

from ..events import NODE_TOPIC_PREFIX, AllBlocksCleared, EventPublisher
from .store import NodeStore
from .wire import ENC, HEADER, KINDS, KV, MAX_FRAME_BYTES, MAX_KEYS, Buffer, FrameError, frame_lengths, pack, unpack

log = logging.getLogger("warmfleet.nodetier")
TOKEN_ENV = "WARMFLEET_NODE_TIER_TOKEN"
SUBSCRIPTION_POLL_S = 0.05  # how often new subscriptions are looked for (each gets the whole state)
MAX_ANSWER_BYTES = MAX_FRAME_BYTES // 2  # entry bytes one get answers at most
WRITE_CHUNK = 1 << 20  # bytes handed to the transport at a time (write_frame)
HELLO_MAX_BYTES = 4096  # the first frame of a connection when a token is required
HELLO_TIMEOUT_S = 10.0  # seconds a connection may take to send it
MAX_HOLDER_CHARS = 256  # a hello's holder name


class NodeServer:
    def __init__(self, store: NodeStore, publisher: Optional[EventPublisher], token: Optional[str] = None):
        self.store, self.publisher, self.token = store, publisher, token
        self.num_connections = 0
        self.connections_of: dict[str, int] = {}  # holder -> its open connections
        self.hello_timeout_s = HELLO_TIMEOUT_S

    # ---- requests ------------------------------------------------------------------------
    def handle(self, msg: dict, holder: Optional[str] = None) -> dict:
        """One request map (from `holder`'s connection) -> its answer map; bad input gets {ok: False, error}, never
        an exception."""
        op = msg.get("op")
        try:
            if op == "put":
                return self._put(msg.get("entries"), holder)
            if op == "get":
                return self._get(msg, holder)
            if op == "release":
                return self._release(msg, holder)
            if op == "stats":
                return self.stats()
        except (TypeError, ValueError, KeyError) as exc:
            return {"ok": False, "error": f"bad {op} request: {exc}"}
        finally:
            self.flush_events()
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _put(self, entries, holder: Optional[str]) -> dict:
        if not isinstance(entries, list):
            raise ValueError("entries must be a list")
        stored = refused = 0
        for e in entries:
            kind, key, data = e["kind"], e["key"], e["data"]
            if kind not in KINDS or not isinstance(data, (bytes, memoryview)) or not _key_ok(kind, key):
                refused += 1
                continue
            if kind == KV and isinstance(e.get("block_size"), int) and e["block_size"] > 0:
                self.store.block_size = e["block_size"]
            lora = e.get("lora") if isinstance(e.get("lora"), str) else None
            ok = self.store.put(kind, key, str(e.get("layout", "")), data, int(e.get("sum", -1)), lora,
                                holder, e.get("held") is True)
            stored += ok
            refused += not ok
        return {"ok": True, "stored": stored, "refused": refused}

    def _get(self, msg: dict, holder: Optional[str]) -> dict:
        kind, keys = _kind_keys(msg, "get")
        entries = self.store.get(kind, keys, str(msg.get("layout", "")), holder)
        out, size = [], 0
        for e in entries:  # the answer stays one frame: a longer run is cut, and the caller asks for the rest
            size += len(e.data) + 64
            if size > MAX_ANSWER_BYTES and out:
                break
            out.append({"data": e.data, "sum": e.sum})
        return {"ok": True, "entries": out, "cut": len(out) < len(entries)}

    def _release(self, msg: dict, holder: Optional[str]) -> dict:
        kind, keys = _kind_keys(msg, "release")
        return {"ok": True, "missing": self.store.release(kind, keys, holder)}

    def stats(self) -> dict:
        s, c = self.store, self.store.counters
        return {"ok": True, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes, "entries": len(s),
                "puts": c.puts, "refused": c.refused, "evicted": c.evicted, "get_hits": c.get_hits,
                "get_misses": c.get_misses, "released": c.released, "connections": self.num_connections,
                "holders": len(self.connections_of)}

    # ---- events --------------------------------------------------------------------------
    def flush_events(self) -> None:
        events = self.store.take_events()
        if self.publisher is not None and events:
            self.publisher.publish(events)

    def answer_subscriptions(self) -> None:
        """Publish the whole state once if anyone subscribed since the last look."""
        if self.publisher is not None and self.publisher.take_new_subscriptions():
            self.flush_events()
            self.publisher.publish(self.store.state_events())

    # ---- connections ---------------------------------------------------------------------
    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        holder: Optional[str] = None
        try:
            if self.token is not None:
                ok, holder = await self._hello(reader, writer)
                if not ok:
                    return
                self._join(holder)
            while True:
                try:
                    msg = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if msg.get("op") == "hello" and holder is None:  # no token asked: a hello only names the holder
                    holder = _holder_of(msg)
                    self._join(holder)
                    answer = {"ok": True}
                else:
                    answer = self.handle(msg, holder)
                await write_frame(writer, pack(answer))
        except FrameError as exc:
            log.warning("closing a node-tier connection: %s", exc)
        except ConnectionError:
            pass
        finally:
            self.num_connections -= 1
            self._leave(holder)
            writer.close()

    def _join(self, holder: Optional[str]) -> None:
        if holder is not None:
            self.connections_of[holder] = self.connections_of.get(holder, 0) + 1

    def _leave(self, holder: Optional[str]) -> None:
        """A connection of `holder` closed; with its last one, its claims end (its replica is gone or reconnecting)."""
        if holder is None or holder not in self.connections_of:
            return
        self.connections_of[holder] -= 1
        if self.connections_of[holder] <= 0:
            del self.connections_of[holder]
            self.store.drop_holder(holder)

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[bool, Optional[str]]:
        try:
            msg = await asyncio.wait_for(read_frame(reader, HELLO_MAX_BYTES), self.hello_timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError):  # gone (the kubelet's TCP probes do this)
            return False, None
        except (asyncio.TimeoutError, FrameError) as exc:
            log.warning("closing a node-tier connection before its token: %s",
                        "no hello in time" if isinstance(exc, asyncio.TimeoutError) else exc)
            return False, None
        token = msg.get("token") if msg.get("op") == "hello" else None
        ok = isinstance(token, str) and hmac.compare_digest(token.encode(), self.token.encode())  # type: ignore[union-attr]
        await write_frame(writer, pack({"ok": ok} if ok else {"ok": False, "error": "bad or missing token"}))
        return ok, _holder_of(msg) if ok else None


def _holder_of(hello: dict) -> Optional[str]:
    h = hello.get("holder")
    return h if isinstance(h, str) and 0 < len(h) <= MAX_HOLDER_CHARS else None


def _kind_keys(msg: dict, op: str) -> tuple[str, list]:
    kind, keys = msg.get("kind"), msg.get("keys")
    if kind not in KINDS or not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise ValueError(f"{op} needs a kind of {KINDS} and at most {MAX_KEYS} keys")
    return kind, [k for k in keys if _key_ok(kind, k)]


def _key_ok(kind: str, key) -> bool:
    return isinstance(key, bytes) if kind == KV else isinstance(key, str) and kind == ENC


async def write_frame(writer: asyncio.StreamWriter, buffers: list[Buffer]) -> None:
    """Write a frame's buffers in WRITE_CHUNK pieces, draining each: asyncio's transport keeps what the socket did not
    take in one bytearray it trims from the front per send, so a 32 MB answer written at once cost ~10x its copy."""
    for buf in buffers:
        view = memoryview(buf)
        for i in range(0, len(view), WRITE_CHUNK):
            writer.write(view[i:i + WRITE_CHUNK])
            await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> dict:
    meta, payload = frame_lengths(await reader.readexactly(HEADER.size))
    if meta + payload > max_bytes:  # refused before any of it is read
        raise FrameError(f"frame of {meta + payload} bytes announced, over {max_bytes}")
    return unpack(await reader.readexactly(meta), await reader.readexactly(payload) if payload else b"")


# ---- the command -------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity-bytes", type=int, required=True, help="Host memory the tier may hold, in bytes "
                   "(payload + 128 bytes per entry); least recently used entries are evicted to stay under it.")
    p.add_argument("--host", default="0.0.0.0", help="Address both sockets bind (default all: the replicas and "
                   "routers reach it through a node-local Service).")
    p.add_argument("--port", type=int, default=7100, help="TCP port the replicas put and get entries on.")
    p.add_argument("--events-port", type=int, default=5560, help="ZMQ PUB port of its KV events (contract 2).")
    p.add_argument("--node-name", required=True, help="The node's name (downward API spec.nodeName); the events' "
                   "topic is node:<NAME>.")
    p.add_argument("--kv-events-curve-secret-key", metavar="FILE", help="ZMQ certificate file with the tier's CURVE "
                   "key pair (zmq.auth.create_certificates writes one; the operator gives it the replicas' pair): the "
                   "events socket is then encrypted and admits only the clients of --kv-events-curve-clients. Give both.")
    p.add_argument("--kv-events-curve-clients", metavar="DIR", help="Directory of the public-key certificates of the "
                   "subscribers (routers, pickers) allowed on the events socket (with --kv-events-curve-secret-key).")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    from ..logging_setup import setup_logging

    setup_logging(args.log_level)
    if args.capacity_bytes < 1:
        raise ValueError(f"--capacity-bytes must be positive, got {args.capacity_bytes}")
    if not args.node_name or any(c.isspace() for c in args.node_name):
        raise ValueError(f"--node-name must be a non-empty name without spaces, got {args.node_name!r}")
    for flag, port in (("--port", args.port), ("--events-port", args.events_port)):
        if not 0 < port < 65536:
            raise ValueError(f"{flag} must be a TCP port (1-65535), got {port}")
    curve = (args.kv_events_curve_secret_key, args.kv_events_curve_clients)
    if (curve[0] is None) != (curve[1] is None):
        raise ValueError("--kv-events-curve-secret-key and --kv-events-curve-clients go together")
    asyncio.run(serve(args.capacity_bytes, args.host, args.port, args.events_port, args.node_name,
                      os.environ.get(TOKEN_ENV) or None, curve if curve[0] is not None else None))
    return 0


async def serve(capacity_bytes: int, host: str, port: int, events_port: int, node_name: str,
                token: Optional[str] = None, curve: Optional[tuple[str, str]] = None) -> None:
    """Serve until cancelled; `curve`: (secret-key file, clients directory) of a CURVE events socket, None: plain."""
    bind = f"[{host}]" if ":" in host else host
    publisher = EventPublisher(NODE_TOPIC_PREFIX + node_name, f"tcp://{bind}:{events_port}", verbose=True,
                               curve_secret_key_file=curve[0] if curve else None,
                               curve_clients_dir=curve[1] if curve else None)
    node = NodeServer(NodeStore(capacity_bytes), publisher, token)
    publisher.publish([AllBlocksCleared()])  # it starts empty: seq 1 says so to anyone already listening
    server = await asyncio.start_server(node.serve_connection, host, port, limit=1 << 20)
    log.info("node tier up", extra={"fields": {"node": node_name, "port": port, "events_port": events_port,
                                                  "capacity_bytes": capacity_bytes, "token": token is not None,
                                                  "events_curve": curve is not None}})
    try:
        async with server:
            while True:
                await asyncio.sleep(SUBSCRIPTION_POLL_S)
                node.answer_subscriptions()
    finally:
        publisher.close()
