"""Node-tier feeds: the KV events of every node tier (`--node-tier-events HOST:PORT`) into the index; no HTTP.

    --node-tier-events node-tier.ns.svc:5560 ──DNS, every RESOLVE_S──▶ tcp://10.0.0.7:5560, tcp://10.0.0.8:5560, ...
        one SUB socket each ──batches, topic node:<NAME>──▶ KVIndex entry "node:<NAME>" (medium NODE)

A name may resolve to several node tiers (a headless Service over a DaemonSet): each address gets its own
subscription, and addresses that stop resolving are dropped with what they published. A node tier has no HTTP
snapshot: on every (re)connect it publishes its whole state (a batch led by AllBlocksCleared, which the index takes
as a snapshot: `apply_batch(self_syncing=True)`); after a gap the feed asks again by subscribing to a fresh
NODE_STATE_TOPIC topic. A disconnect purges what that address published (the tier may come back empty; it says so
with AllBlocksCleared when it does). With the router's CURVE keys (--kv-events-curve-*, the ones it uses for replicas)
every feed is a CURVE client: a node tier runs with the replicas' key pair, so one server key covers both.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from typing import Optional

import zmq

from ...events import NODE_STATE_TOPIC, NODE_TOPIC_PREFIX, EventBatch, decode
from .index import Applied, KVIndex
from .settings import parse_node_tier_events
from .subscriber import CurveKeys, pump

log = logging.getLogger(__name__)
RESOLVE_S = 10.0  # how often the names are resolved again
STATE_ASK_MIN_S = 0.5  # spacing of state requests to one node tier


def node_key(node_name: str) -> str:
    """The index entry of node `node_name`'s tier (its events' topic)."""
    return NODE_TOPIC_PREFIX + node_name


class NodeFeed:
    """One node tier's address: a SUB socket read from the loop's reader callback (as subscriber.py does); a CURVE
    client when `curve` is given."""

    def __init__(self, endpoint: str, index: KVIndex, curve: Optional[CurveKeys] = None):
        self.endpoint, self.index, self.curve = endpoint, index, curve
        self.keys: set[str] = set()  # topics seen on this address (one node tier: one)
        self.connected = False
        self.bad_batches = 0
        self._sock: Optional[zmq.Socket] = None
        self._asks = itertools.count()
        self._asked_at = 0.0

    def ask_state(self) -> None:
        """Subscribe to a fresh state topic: the node tier answers every new subscription with its whole state."""
        now = time.monotonic()
        if self._sock is None or now - self._asked_at < STATE_ASK_MIN_S:
            return
        self._asked_at = now
        self._sock.setsockopt(zmq.SUBSCRIBE, NODE_STATE_TOPIC + str(next(self._asks)).encode())

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            batch: EventBatch = decode(frames)
        except ValueError:
            self.bad_batches += 1
            return
        if not batch.replica_id.startswith(NODE_TOPIC_PREFIX):
            self.bad_batches += 1
            return
        self.keys.add(batch.replica_id)
        if self.index.apply_batch(batch.replica_id, batch, self_syncing=True) is not Applied.OK:
            self.ask_state()  # a gap, or not synced yet: its whole state replaces what the index has

    def on_disconnect(self) -> None:
        self.connected = False
        for k in self.keys:
            self.index.purge(k)

    async def run(self) -> None:
        sock = self._sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.setsockopt(zmq.SUBSCRIBE, NODE_TOPIC_PREFIX.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        try:
            await pump(sock, monitor, self.on_frames, self._on_monitor_event)
        finally:
            self._sock = None
            self.on_disconnect()

    def _on_monitor_event(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True  # the subscription's arrival makes it publish its state
        elif event == zmq.EVENT_DISCONNECTED:
            self.on_disconnect()


class NodeTiers:
    """Every node tier the flags name, followed (over CURVE with `curve`); `key_of(replica)` pairs a replica with its
    node's tier."""

    def __init__(self, addresses: list[str], index: KVIndex, resolve_s: float = RESOLVE_S,
                 curve: Optional[CurveKeys] = None):
        self.addresses = [parse_node_tier_events(a) for a in addresses]
        self.index, self.resolve_s, self.curve = index, resolve_s, curve
        self.feeds: dict[str, NodeFeed] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    async def resolve(self) -> set[str]:
        loop = asyncio.get_running_loop()
        out: set[str] = set()
        for host, port in self.addresses:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("node tier %s:%d does not resolve: %s", host, port, exc)
                continue
            for family, *_, addr in infos:
                ip = addr[0]
                out.add(f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}")
        return out

    async def refresh(self) -> None:
        """Follow exactly the addresses the names resolve to now."""
        endpoints = await self.resolve()
        for ep in list(self._tasks):
            if ep not in endpoints:
                task = self._tasks.pop(ep)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.feeds.pop(ep, None)
                log.info("node tier %s left", ep)
        for ep in endpoints - set(self._tasks):
            self.feeds[ep] = NodeFeed(ep, self.index, self.curve)
            self._tasks[ep] = asyncio.create_task(self.feeds[ep].run())
            log.info("following node tier %s", ep)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("node tier refresh failed")
            await asyncio.sleep(self.resolve_s)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    def key_of(self, replica: str) -> Optional[str]:
        """The index entry of the node tier on `replica`'s node, when its snapshot named a node."""
        st = self.index.replicas.get(replica)
        return node_key(st.node_name) if st is not None and st.node_name else None

    def view(self) -> list[dict]:
        out = []
        for ep, feed in sorted(self.feeds.items()):
            for k in sorted(feed.keys) or [None]:
                st = self.index.replicas.get(k) if k else None
                out.append({"endpoint": ep, "node_tier": k, "connected": feed.connected,
                            "synced": bool(st and st.synced), "blocks": len(st.node) if st else 0,
                            "encoder": len(st.encoder) if st else 0, "bad_batches": feed.bad_batches})
        return out
