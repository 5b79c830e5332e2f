"""NodeTierClient: a replica's blocking link to its node tier, with deadlines and a circuit breaker; no paddle.

Gets run on the caller's thread (the engine core's, between steps) and take at most `timeout_s`; puts go to one
background thread through a queue bounded in bytes, so an eviction never waits on the network. Each connection
opens with a hello naming this replica (`holder`), so the node tier knows which of its blocks a replica still holds
(written through with `held`, or loaded from it) and evicts those first. An evicted block the replica believes the
tier holds is only released (touch-or-put): its bytes go only if the tier answers that it no longer has it. Any failure (refused,
reset, timed out, a bad answer, a checksum that does not match) reads as a miss, and opens the breaker: no call is
tried for `backoff_s`, which doubles on each failure in a row up to BACKOFF_MAX_S, so a dead or full node tier costs
the replica a recompute, never a wrong output or a hang. A node tier that comes back is empty; the first call that
works closes the breaker.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .wire import HEADER, MAX_KEYS, checksum, frame_lengths, pack, unpack

log = logging.getLogger("warmfleet.nodetier")
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 10.0
PUT_BATCH_BYTES = 8 << 20  # entries sent in one put frame
PUT_QUEUE_BYTES = 256 << 20  # queued put payload beyond which new puts are dropped (counted)
MAX_KNOWN_KEYS = 1 << 22  # keys believed in the tier (bounded by the primary pool; cleared if ever over this)


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT) -> (host, port); ValueError with one readable line."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--node-tier takes HOST:PORT, got {text!r}")
    return host, int(port)


@dataclass
class ClientCounters:
    get_calls: int = 0
    get_entries: int = 0  # KV blocks served whole (encoder outputs are not counted: they are not block-sized)
    get_seconds: float = 0.0  # wall time of the gets that served them (copy cost per block = this / get_entries)
    get_encoder_entries: int = 0  # encoder outputs served whole
    put_entries: int = 0  # entries handed to the node tier
    put_released: int = 0  # evicted blocks the tier still had: released, no bytes sent
    put_dropped: int = 0  # entries not sent (breaker open, queue full, failure)
    failures: int = 0  # calls that failed (each opened the breaker)


class Breaker:
    """Open after a failure for a backoff that doubles per failure in a row; closed by a success."""

    def __init__(self) -> None:
        self.backoff_s, self.open_until, self.failures_in_row = BACKOFF_MIN_S, 0.0, 0

    def allows(self) -> bool:
        return time.monotonic() >= self.open_until

    def failed(self) -> None:
        self.failures_in_row += 1
        self.backoff_s = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (self.failures_in_row - 1))
        self.open_until = time.monotonic() + self.backoff_s

    def succeeded(self) -> None:
        self.failures_in_row, self.open_until = 0, 0.0


class Connection:
    """One TCP connection; every call is bounded by its deadline; any error closes it (the next call reconnects)."""

    def __init__(self, address: tuple[str, int], timeout_s: float, token: Optional[str], holder: str):
        self.address, self.timeout_s, self.token, self.holder = address, timeout_s, token, holder
        self.sock: Optional[socket.socket] = None

    def call(self, msg: dict) -> dict:
        deadline = time.monotonic() + self.timeout_s
        try:
            if self.sock is None:
                self._connect(deadline)
            return self._exchange(msg, deadline)
        except BaseException:
            self.close()
            raise

    def _connect(self, deadline: float) -> None:
        self.sock = socket.create_connection(self.address, timeout=max(0.001, deadline - time.monotonic()))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {"op": "hello", "holder": self.holder} | ({"token": self.token} if self.token is not None else {})
        if not self._exchange(hello, deadline).get("ok"):
            raise ConnectionError("the node tier refused the token")

    def _exchange(self, msg: dict, deadline: float) -> dict:
        sock = self.sock
        assert sock is not None
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        for buf in pack(msg):  # each block's own buffer, no copy into one body
            sock.sendall(buf)
        meta, payload = frame_lengths(self._recv(HEADER.size, deadline))
        answer = unpack(self._recv(meta, deadline), self._recv(payload, deadline) if payload else b"")  # views
        if not answer.get("ok"):
            raise ConnectionError(f"node tier: {answer.get('error', 'refused')}")
        return answer

    def _recv(self, n: int, deadline: float) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("node tier: deadline passed")
            self.sock.settimeout(left)  # type: ignore[union-attr]
            k = self.sock.recv_into(view[got:])  # type: ignore[union-attr]
            if k == 0:
                raise ConnectionError("node tier closed the connection")
            got += k
        return buf

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


class NodeTierClient:
    def __init__(self, address: str, timeout_s: float = 0.5, token: Optional[str] = None):
        addr = parse_address(address)
        self.address = address
        self.counters = ClientCounters()
        self.breaker = Breaker()
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"  # this replica, to the tier
        self._get_conn = Connection(addr, timeout_s, token, self.holder)
        self._put_conn = Connection(addr, max(timeout_s, 2.0), token, self.holder)
        self._known: set = set()  # KV keys this replica put (held) or loaded and still holds: believed in the tier
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._put_loop, name="node-tier-put", daemon=True)
        self._thread.start()

    # ---- gets (caller's thread) ----------------------------------------------------------
    def get(self, kind: str, keys: list, layout: str) -> list[memoryview]:
        """The data of the longest run of whole entries from keys[0] on (views of the answer's one buffer); [] on a
        miss or any failure."""
        if not keys or not self.breaker.allows():
            return []
        self.counters.get_calls += 1
        start = time.perf_counter()
        out: list[memoryview] = []
        try:
            while len(out) < len(keys):  # an answer cut at the frame limit goes on where it stopped
                answer = self._get_conn.call({"op": "get", "kind": kind, "keys": keys[len(out):], "layout": layout})
                entries = answer.get("entries", [])[:len(keys) - len(out)]
                for e in entries:
                    data = e.get("data") if isinstance(e, dict) else None
                    if not isinstance(data, memoryview) or checksum(data) != e.get("sum"):
                        answer["cut"] = False  # a torn or foreign entry: what precedes it is still whole
                        break
                    out.append(data)
                if not answer.get("cut") or not entries:
                    break
        except Exception as exc:
            self._failed("get", exc)
            return []
        self.breaker.succeeded()
        if out and kind == "kv":
            self.counters.get_entries += len(out)
            self.counters.get_seconds += time.perf_counter() - start
            self._remember(keys[:len(out)])
        elif out:
            self.counters.get_encoder_entries += len(out)
        return out

    # ---- puts (background thread) --------------------------------------------------------
    def put_async(self, entries: list[dict]) -> None:
        """Queue entries ({kind, key, layout, data, lora?, block_size?, held?}; sum added here) for the node tier;
        `held`: this replica still holds the block (written through), else it evicted it."""
        size = sum(len(e["data"]) for e in entries)
        with self._lock:
            if not self.breaker.allows() or self._queued_bytes + size > PUT_QUEUE_BYTES:
                self.counters.put_dropped += len(entries)
                return
            self._queued_bytes += size
        for e in entries:
            e["sum"] = checksum(e["data"])
        self._queue.put((entries, size))

    def _put_loop(self) -> None:
        while True:
            entries, size = self._queue.get()
            if entries is None:
                return
            batch, nbytes = list(entries), size
            while nbytes < PUT_BATCH_BYTES and not self._queue.empty():
                more, msize = self._queue.get_nowait()
                if more is None:
                    self._queue.put((None, 0))
                    break
                batch += more
                nbytes += msize
            self._send_puts(batch)
            with self._lock:
                self._queued_bytes -= nbytes

    def _send_puts(self, batch: list[dict]) -> None:
        if not self.breaker.allows():
            self.counters.put_dropped += len(batch)
            return
        try:
            batch = self._release_known(batch)
            if batch:
                self._put_conn.call({"op": "put", "entries": batch})
        except Exception as exc:
            self.counters.put_dropped += len(batch)
            self._failed("put", exc)
            return
        self.breaker.succeeded()
        self.counters.put_entries += len(batch)
        self._remember([e["key"] for e in batch if e["kind"] == "kv" and e.get("held")])

    def _release_known(self, batch: list[dict]) -> list[dict]:
        """Evicted blocks believed in the tier are released (no bytes); returns the entries still to put."""
        evicted = [e["key"] for e in batch if e["kind"] == "kv" and not e.get("held")]
        with self._lock:
            known = [k for k in evicted if k in self._known]
            self._known.difference_update(evicted)
        released: set = set()
        for i in range(0, len(known), MAX_KEYS):
            part = known[i:i + MAX_KEYS]
            missing = self._put_conn.call({"op": "release", "kind": "kv", "keys": part}).get("missing", [])
            released.update(set(part) - set(missing))
        self.counters.put_released += len(released)
        if not released:
            return batch
        return [e for e in batch if not (e["kind"] == "kv" and not e.get("held") and e["key"] in released)]

    def _remember(self, keys: list) -> None:
        with self._lock:
            if len(self._known) + len(keys) > MAX_KNOWN_KEYS:
                self._known.clear()  # only costs bytes re-sent on a few evictions
            self._known.update(keys)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued puts are sent (tests, shutdown); False if that took longer than `timeout_s`."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if self._queued_bytes == 0 and self._queue.empty():
                    return True
            time.sleep(0.005)
        return False

    def _failed(self, what: str, exc: Exception) -> None:
        self.counters.failures += 1
        first = self.breaker.failures_in_row == 0
        self.breaker.failed()
        (log.warning if first else log.debug)(
            "node tier %s %s failed (%s: %s); recomputing, next try in %.2f s", self.address, what,
            type(exc).__name__, exc, self.breaker.backoff_s)

    def close(self) -> None:
        self._queue.put((None, 0))
        self._thread.join(timeout=1.0)
        self._get_conn.close()
        self._put_conn.close()
