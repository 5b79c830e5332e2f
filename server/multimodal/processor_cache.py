"""Processor cache: one process per pod holding preprocessed pixels per mm_hash (LRU, byte budget), served over ZMQ IPC; no paddle.

Wire (ZMQ DEALER → ROUTER, multipart; msgpack + raw buffers, never pickle):

    request                                 reply
    [req_id, b"GET", mm_hash]               [req_id, b"HIT_SHM", header, file name]
                                            | [req_id, b"HIT", header, pixels] | [req_id, b"MISS"]
    [req_id, b"PUT", mm_hash, header, px]   (none: fire and forget)
    [req_id, b"STATS"]                      [req_id, b"STATS", msgpack{hits, misses, ...}]
    [req_id, b"PING"]                       [req_id, b"PONG"]
    anything else                           [req_id, b"ERR", reason]  (the server keeps running)

Pixels are handed over through shared memory: the server writes each entry once into its own
file under `shm_dir_for(address)` (/dev/shm, a tmpfs, where there is one) and a hit carries
only the file's name; the client maps the file read-only and reads the pixels in place, so a
hit costs one small round trip instead of copying megabytes through the socket. Evicting
unlinks the file; a reader's mapping stays valid until it lets go, and a file gone between
the reply and the open is a miss. Where the file cannot be written (e.g. /dev/shm full), the
entry stays in the server's memory and a hit carries the pixels (`HIT`), as before.

Clients keep one socket for their lifetime; replies carry the request id, so a reply that
arrives after its call timed out is recognised and dropped instead of answering the next
call. If the server is down, calls fail fast (ZMQ_IMMEDIATE) and callers preprocess locally;
`ProcessorCacheProcess` restarts the server when it exits.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import msgpack
import zmq

from . import wire
from .processor import ProcessedImage

log = logging.getLogger("warmfleet.processor_cache")

DEFAULT_TIMEOUT_S = 0.5
CRASH_LOOP_S = 2.0  # a cache process that exits sooner than this after its start is restarted after a pause
MAX_BACKOFF_S = 5.0
_FILE_NAME = re.compile(r"[0-9a-f]{1,32}")


def shm_dir_for(address: str) -> Path:
    """Directory of the pixel files of the server at `address` (client and server derive it alike)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"warmfleet-pc-{os.getuid()}-{hashlib.blake2s(address.encode(), digest_size=8).hexdigest()}"


class PixelFile:
    """One entry's pixels in a file of the shm directory; `release` unlinks it (mappings stay valid)."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size

    def __len__(self) -> int:
        return self.size

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class PixelFiles:
    """The server's shm directory: emptied at start (a predecessor's files), one file per PUT."""

    def __init__(self, directory: Path):
        self.dir = directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(mode=0o700, parents=True)
        self._next = 0

    def write(self, data) -> Optional[PixelFile]:
        """A new file holding `data`, or None when it cannot be written (the caller keeps the bytes)."""
        self._next += 1
        path = self.dir / f"{self._next:x}"
        view = memoryview(data).cast("B")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot write pixels to %s (%s); keeping them in memory", path, exc)
            PixelFile(path, 0).release()
            return None
        return PixelFile(path, len(view))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def map_pixels(path: Path) -> mmap.mmap:
    """Read-only mapping of a pixel file (FileNotFoundError when it was evicted meanwhile)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)




@dataclass
class CacheStats:
    """Counters since the server process started."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    puts: int = 0
    rejected: int = 0  # items larger than the whole budget, never stored
    bad_messages: int = 0
    entries: int = 0
    usage_bytes: int = 0
    capacity_bytes: int = 0


Pixels = Union[bytes, PixelFile]


class LRUStore:
    """mm_hash → (header, pixels: bytes or a PixelFile), least recently used evicted first; reads refresh recency.

    `release` is called with the pixels of every entry that leaves (evicted or replaced).
    """

    def __init__(self, capacity_bytes: int, release: Optional[Callable[[Pixels], None]] = None):
        self.capacity_bytes = capacity_bytes
        self.items: OrderedDict[bytes, tuple[bytes, Pixels]] = OrderedDict()
        self.stats = CacheStats(capacity_bytes=capacity_bytes)
        self.release = release

    @staticmethod
    def _size(entry: tuple[bytes, Pixels]) -> int:
        return len(entry[0]) + len(entry[1])

    def get(self, key: bytes) -> Optional[tuple[bytes, Pixels]]:
        entry = self.items.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self.items.move_to_end(key)
        self.stats.hits += 1
        return entry

    def fits(self, header: bytes, size: int) -> bool:
        return len(header) + size <= self.capacity_bytes

    def put(self, key: bytes, header: bytes, data: Pixels) -> None:
        entry = (header, data)
        size = self._size(entry)
        if size > self.capacity_bytes:
            self.stats.rejected += 1
            self._release(data)
            return
        old = self.items.pop(key, None)
        if old is not None:
            self.stats.usage_bytes -= self._size(old)
            self._release(old[1])
        while self.items and self.stats.usage_bytes + size > self.capacity_bytes:
            _, ev = self.items.popitem(last=False)
            self.stats.usage_bytes -= self._size(ev)
            self.stats.evictions += 1
            self._release(ev[1])
        self.items[key] = entry
        self.stats.usage_bytes += size
        self.stats.puts += 1
        self.stats.entries = len(self.items)

    def _release(self, data: Pixels) -> None:
        if self.release is not None:
            self.release(data)


def handle(store: LRUStore, frames: list[bytes], files: Optional[PixelFiles] = None) -> Optional[list[bytes]]:
    """Reply frames (without routing id) for one request; None for PUT. Never raises.

    With `files`, PUT writes the pixels to a file of the shm directory and a hit names it.
    """
    if len(frames) < 2:
        store.stats.bad_messages += 1
        return None  # no request id to answer to
    req_id, cmd, args = frames[0], frames[1], frames[2:]
    try:
        if cmd == b"GET" and len(args) == 1:
            entry = store.get(args[0])
            if entry is None:
                return [req_id, b"MISS"]
            if isinstance(entry[1], PixelFile):
                return [req_id, b"HIT_SHM", entry[0], entry[1].path.name.encode()]
            return [req_id, b"HIT", entry[0], entry[1]]
        if cmd == b"PUT" and len(args) == 3:
            wire.decode(args[1], args[2])  # validate before storing: a bad PUT must not poison later GETs
            data: Pixels = args[2]
            if files is not None and store.fits(args[1], len(args[2])):
                data = files.write(args[2]) or data
            store.put(args[0], args[1], data)
            return None
        if cmd == b"STATS" and not args:
            store.stats.entries = len(store.items)
            return [req_id, b"STATS", msgpack.packb(asdict(store.stats))]
        if cmd == b"PING":
            return [req_id, b"PONG"]
        raise ValueError(f"unknown command {cmd[:16]!r} with {len(args)} arguments")
    except Exception as exc:  # noqa: BLE001 - one bad message must never stop the server
        store.stats.bad_messages += 1
        return [req_id, b"ERR", str(exc).encode()[:500]]


def serve(address: str, capacity_bytes: int) -> None:
    """Server loop (the processor-cache process's main); runs until terminated, then removes its files."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)  # a stale socket file from a crashed predecessor
    sock.bind(address)
    files = PixelFiles(shm_dir_for(address))
    store = LRUStore(capacity_bytes, release=lambda data: data.release() if isinstance(data, PixelFile) else None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so `finally` removes the files
    log.info("processor cache serving %s with %.2f GiB, pixels in %s", address, capacity_bytes / (1 << 30), files.dir)
    parent = os.getppid()
    try:
        while True:
            if not sock.poll(500, zmq.POLLIN):
                if os.getppid() != parent:  # the server that owns us is gone: never linger holding memory
                    log.warning("owner process exited; processor cache stopping")
                    return
                continue
            msg = sock.recv_multipart()
            reply = handle(store, msg[1:], files)
            if reply is not None:
                sock.send_multipart([msg[0], *reply], copy=False)
    finally:
        files.remove()


class LocalProcessorCache:
    """In-process processor cache (offline `LLM`): the same LRU and byte budget, no process, no socket."""

    def __init__(self, capacity_bytes: int):
        self.store = LRUStore(capacity_bytes)

    def get(self, mm_hash: str) -> Optional[ProcessedImage]:
        entry = self.store.get(mm_hash.encode())
        return None if entry is None else wire.decode(*entry)

    def put(self, mm_hash: str, img: ProcessedImage) -> None:
        header, buf = wire.encode(img)
        self.store.put(mm_hash.encode(), header, bytes(buf))

    def stats(self) -> CacheStats:
        return self.store.stats


class ProcessorCacheClient:
    """One frontend's connection: `get` / `put` / `stats` with timeouts; thread-safe, one socket reused."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, ctx: Optional[zmq.Context] = None):
        self.address = address
        self.shm_dir = shm_dir_for(address)
        self.timeout_s = timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._sock: Optional[zmq.Socket] = None
        self._lock = threading.Lock()
        self._next_id = 0
        self.num_timeouts = 0
        self.num_unavailable = 0
        self.num_errors = 0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a server that is not there: fail fast
            s.setsockopt(zmq.SNDHWM, 64)
            s.setsockopt(zmq.RECONNECT_IVL, 50)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            s.connect(self.address)
            self._sock = s
        return self._sock

    def _send(self, frames: list, expect_reply: bool, connect_wait_s: float = 0.0) -> Optional[list[zmq.Frame]]:
        """`connect_wait_s` > 0 waits that long for a connection; 0 fails at once when there is none."""
        with self._lock:
            sock = self._socket()
            self._next_id += 1
            req_id = self._next_id.to_bytes(8, "big")
            try:
                if connect_wait_s > 0:
                    sock.setsockopt(zmq.SNDTIMEO, int(connect_wait_s * 1000))
                    sock.send_multipart([req_id, *frames], copy=False)
                else:
                    sock.send_multipart([req_id, *frames], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.num_unavailable += 1
                return None
            if not expect_reply:
                return None
            deadline = time.monotonic() + self.timeout_s
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                    self.num_timeouts += 1
                    return None
                reply = sock.recv_multipart(copy=False)
                if reply and reply[0].bytes == req_id:
                    return reply[1:]
                # a late reply to an earlier, timed-out call: drop it

    def get(self, mm_hash: str) -> Optional[ProcessedImage]:
        """Cached pixels, or None on a miss, a timeout or a dead server (the caller preprocesses)."""
        reply = self._send([b"GET", mm_hash.encode()], expect_reply=True)
        kind = reply[0].bytes if reply else None
        if kind not in (b"HIT", b"HIT_SHM") or len(reply) != 3:
            if kind == b"ERR":
                self.num_errors += 1
            return None
        try:
            if kind == b"HIT":
                return wire.decode(reply[1].bytes, reply[2].buffer)
            name = reply[2].bytes.decode("ascii", "replace")
            if not _FILE_NAME.fullmatch(name):
                raise ValueError(f"bad pixel file name {name[:40]!r}")
            return wire.decode(reply[1].bytes, map_pixels(self.shm_dir / name))  # read-only, no copy
        except FileNotFoundError:  # evicted between the reply and the open: a miss
            return None
        except (OSError, ValueError):
            self.num_errors += 1
            return None

    def put(self, mm_hash: str, img: ProcessedImage) -> None:
        """Offer pixels to the cache; never blocks and never fails the caller."""
        header, buf = wire.encode(img)
        self._send([b"PUT", mm_hash.encode(), header, buf], expect_reply=False)

    def stats(self) -> Optional[CacheStats]:
        reply = self._send([b"STATS"], expect_reply=True)
        if not reply or reply[0].bytes != b"STATS":
            return None
        return CacheStats(**msgpack.unpackb(reply[1].bytes))

    def ping(self, timeout_s: float = 1.0) -> bool:
        """True when the server answers; waits up to `timeout_s` for a connection, then for the reply."""
        reply = self._send([b"PING"], expect_reply=True, connect_wait_s=timeout_s)
        return bool(reply) and reply[0].bytes == b"PONG"

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None


class ProcessorCacheProcess:
    """Owns the pod's cache server process: starts it, restarts it whenever it exits, stops it.

    The process is a fresh `python -P` interpreter (its address and byte budget on argv, nothing
    pickled), so it never imports from the current directory.
    """

    def __init__(self, address: str, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError("processor cache needs a positive byte budget (--max-processor-cache 0 disables it)")
        self.address = address
        self.capacity_bytes = capacity_bytes
        self.process: Optional[subprocess.Popen] = None
        self.num_restarts = 0
        self._stopping = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    @classmethod
    def from_gib(cls, address: str, gib: float) -> "ProcessorCacheProcess":
        return cls(address, int(gib * (1 << 30)))

    def _spawn(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-P", "-m", "warmfleet.server.multimodal.processor_cache",
                                         self.address, str(self.capacity_bytes)])

    def start(self) -> "ProcessorCacheProcess":
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="processor-cache-watch", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        backoff_s = 0.0
        while not self._stopping.is_set():
            proc, started = self.process, time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            # a process that dies at once (bad address, no memory) is retried with a growing pause, not in a spin
            backoff_s = 0.0 if time.monotonic() - started > CRASH_LOOP_S else min(max(2 * backoff_s, 0.1), MAX_BACKOFF_S)
            log.warning("processor cache process exited with %s; restarting in %.1f s "
                        "(requests are preprocessed by the frontend meanwhile)", code, backoff_s)
            if self._stopping.wait(backoff_s):
                return
            self.num_restarts += 1
            self._spawn()

    def stop(self) -> None:
        self._stopping.set()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        shutil.rmtree(shm_dir_for(self.address), ignore_errors=True)  # whatever a killed server left


if __name__ == "__main__":
    from ..logging_setup import setup_logging

    setup_logging("info")
    serve(sys.argv[1], int(sys.argv[2]))
