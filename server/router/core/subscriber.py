"""One asyncio ZMQ SUB socket per replica (a CURVE client when keys are given): decodes KV-event batches and reports
(re)connects; survives bad input."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from ...events import EventBatch

log = logging.getLogger(__name__)
DRAIN_BATCH = 64  # messages one reader callback handles before it yields to the loop (and continues after)


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE client's keys (Z85 bytes): the replicas' public key, and this subscriber's own pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_key_file: str, secret_key_file: str) -> "CurveKeys":
        """Read zmq.auth certificate files; ValueError with one readable line when one is missing or wrong."""
        import zmq.auth

        if not zmq.has("curve"):
            raise ValueError("--kv-events-curve-server-key: this libzmq was built without CURVE (libsodium)")
        try:
            server_public, _ = zmq.auth.load_certificate(server_key_file)
            public, secret = zmq.auth.load_certificate(secret_key_file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"KV-event CURVE keys: {exc}") from None
        if secret is None:
            raise ValueError(f"--kv-events-curve-secret-key {secret_key_file}: the file holds no secret key")
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.server_public, self.public, self.secret


class EventSubscriber:
    """Calls `on_batch(batch)` per message, `on_connect()` on every TCP (re)connect, `on_bad(exc)` per bad message.

    With `curve` the socket is a CURVE client: the replica (a CURVE server, `--kv-events-curve-secret-key`) sends
    only to subscribers whose public key it lists, encrypted."""

    def __init__(self, endpoint: str, decode: Callable[[list[bytes]], EventBatch],
                 on_batch: Callable[[EventBatch], None], on_connect: Callable[[], None],
                 on_bad: Callable[[Exception], None], reconnect_ivl_ms: int = 100,
                 curve: Optional[CurveKeys] = None):
        self.endpoint, self.decode, self.curve = endpoint, decode, curve
        self._on_batch, self._on_connect, self._on_bad = on_batch, on_connect, on_bad
        self._reconnect_ivl_ms = reconnect_ivl_ms

    async def run(self) -> None:
        """Receive until cancelled.

        The sockets are plain (not zmq.asyncio) and read from the loop's own reader callback on their file
        descriptors: a replica publishes a batch per engine step, and zmq.asyncio's poll and recv futures per
        message cost more than decoding it (~10 % of the router's CPU on a stream of new prompts). ZMQ's descriptor
        is edge-triggered, so every wake drains the socket until EAGAIN, DRAIN_BATCH messages per loop turn."""
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self.curve is not None:
            self.curve.apply(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        sock.connect(self.endpoint)
        await pump(sock, monitor, self._handle,
                   lambda event: self._on_connect() if event == zmq.EVENT_CONNECTED else None)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            batch = self.decode(frames)
        except Exception as exc:  # decode raises ValueError; anything else is a bug, not fatal
            self._on_bad(exc)
            return
        try:
            self._on_batch(batch)
        except Exception:  # a bug in one batch's handling must not stop the feed
            log.exception("applying KV events from %s failed", self.endpoint)


async def cancel(task: asyncio.Task) -> None:
    """Cancel a task and wait for it to finish."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


async def pump(sock: zmq.Socket, monitor: zmq.Socket, on_frames: Callable[[list[bytes]], None],
               on_event: Callable[[int], None]) -> None:
    """Read a SUB socket and its monitor from the loop's reader callbacks until cancelled, then close both.

    ZMQ's descriptor is edge-triggered: every wake drains the socket until EAGAIN, DRAIN_BATCH messages per loop turn,
    and what arrived before the reader was added is read at once."""
    loop = asyncio.get_running_loop()

    def drain(s: zmq.Socket) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if s is monitor:
                on_event(parse_monitor_message(frames)["event"])
            else:
                on_frames(frames)
        loop.call_soon(drain, s)  # more may wait, and the descriptor will not signal them again

    for s in (sock, monitor):
        loop.add_reader(s.FD, drain, s)
        drain(s)
    try:
        await asyncio.Future()  # until cancelled
    finally:
        for s in (sock, monitor):
            loop.remove_reader(s.FD)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
