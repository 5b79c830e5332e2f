"""One asyncio ZMQ SUB socket per replica: decodes KV-event batches and reports (re)connects; survives bad input."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ...events import EventBatch

log = logging.getLogger(__name__)


class EventSubscriber:
    """Calls `on_batch(batch)` per message, `on_connect()` on every TCP (re)connect, `on_bad(exc)` per bad message."""

    def __init__(self, endpoint: str, decode: Callable[[list[bytes]], EventBatch],
                 on_batch: Callable[[EventBatch], None], on_connect: Callable[[], None],
                 on_bad: Callable[[Exception], None], reconnect_ivl_ms: int = 100):
        self.endpoint, self.decode = endpoint, decode
        self._on_batch, self._on_connect, self._on_bad = on_batch, on_connect, on_bad
        self._reconnect_ivl_ms = reconnect_ivl_ms

    async def run(self) -> None:
        """Receive until cancelled."""
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        sock.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                for s, _ in await poller.poll():
                    if s is monitor:
                        event = parse_monitor_message(await monitor.recv_multipart())
                        if event["event"] == zmq.EVENT_CONNECTED:
                            self._on_connect()
                    else:
                        frames = await sock.recv_multipart()
                        try:
                            batch = self.decode(frames)
                        except Exception as exc:  # decode raises ValueError; anything else is a bug, not fatal
                            self._on_bad(exc)
                            continue
                        try:
                            self._on_batch(batch)
                        except Exception:  # a bug in one batch's handling must not stop the feed
                            log.exception("applying KV events from %s failed", self.endpoint)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)


async def cancel(task: asyncio.Task) -> None:
    """Cancel a task and wait for it to finish."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
