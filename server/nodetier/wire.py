"""Node-tier wire format: msgpack metadata with raw payloads after it, over TCP, checksums; never pickle; no I/O policy.

One frame is an 8-byte header (two big-endian u32: the metadata's length, the payload's length), a msgpack map (the
metadata), then the payload: the raw bytes of the frame's entries, one after another, each entry's length as `size`
in its map. Blocks travel without being packed, copied into one body or unpacked again: the sender hands each
block's own buffer to the socket, the receiver reads the payload into one buffer and each entry's `data` is a view
of it. In memory, on both ends, an entry carries `data` (pack moves it to the payload, unpack puts it back). A
request's map has `op`; the answer a map with `ok` (and `error` when not ok):

    {op: "hello", holder?, token?}                                         -> {ok}       (first frame, optional)
    {op: "put", entries: [{kind, key, layout, data, sum, lora?, held?}, ...]} -> {ok, stored, refused}
    {op: "get", kind, keys: [key, ...], layout}                           -> {ok, entries: [{data, sum}, ...], cut}
    {op: "release", kind, keys: [key, ...]}                               -> {ok, missing: [key, ...]}
    {op: "stats"}                                                          -> {ok, capacity_bytes, used_bytes, ...}

`holder` names the replica behind the connection; `held` true on a put says that replica still holds the block in its
primary pool (written through), false that it evicted it; a get makes the getter a holder; `release` says the holder
evicted blocks it believes are here, and answers those that are not (their bytes follow in a put). The node tier
evicts blocks some replica still holds first (store.py).

`kind` is "kv" (key: a contract-1 block hash, bytes) or "enc" (key: an mm_hash, str). A get answers the longest
run of whole entries from the first key on (a KV prefix stops at its first miss); `sum` is XXH3-64 of `data`,
checked on both ends, so an entry is used only when it is whole. An answer stops short of MAX_FRAME_BYTES / 2 with
`cut` true when the run goes on; the client then asks again from where it stopped. `layout` names the bytes' shape (dtype and block
geometry); an entry stored under another layout is a miss, never a reinterpretation.
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgpack
import xxhash

MAX_FRAME_BYTES = 256 << 20  # one frame (a put's batch or a get's answer, metadata and payload) holds at most 256 MiB
MAX_META_BYTES = 16 << 20  # its metadata at most 16 MiB
HEADER = struct.Struct(">II")  # metadata bytes, payload bytes
KV, ENC = "kv", "enc"
MAX_KEYS = 4096  # keys one get or release may name
KINDS = (KV, ENC)
Buffer = Union[bytes, bytearray, memoryview]


class FrameError(ValueError):
    """A frame that is too large, not a msgpack map, or whose entries do not add up to its payload."""


def checksum(data: Buffer) -> int:
    """XXH3-64 of the bytes: catches a torn or corrupted entry (not a forged one), ~5x CRC-32's speed here."""
    return xxhash.xxh3_64_intdigest(data)


def pack(msg: dict) -> list[Buffer]:
    """One frame as buffers to send in order: header and metadata, then every entry's `data` as it is."""
    payload: list[Buffer] = []
    entries = msg.get("entries")
    if isinstance(entries, list) and any(isinstance(e, dict) and "data" in e for e in entries):
        meta_entries = []
        for e in entries:
            if isinstance(e, dict) and "data" in e:
                d = e["data"]
                payload.append(d)
                e = {k: v for k, v in e.items() if k != "data"}
                e["size"] = memoryview(d).nbytes
            meta_entries.append(e)
        msg = {**msg, "entries": meta_entries}
    meta = msgpack.packb(msg, use_bin_type=True)
    size = sum(memoryview(d).nbytes for d in payload)
    if len(meta) > MAX_META_BYTES or len(meta) + size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(meta) + size} bytes is over {MAX_FRAME_BYTES}")
    return [HEADER.pack(len(meta), size) + meta, *payload]


def frame_lengths(header: Buffer) -> tuple[int, int]:
    """(metadata bytes, payload bytes) a header announces; FrameError past the limits (before any is read)."""
    meta, payload = HEADER.unpack(header)
    if meta > MAX_META_BYTES or meta + payload > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {meta + payload} bytes announced, over {MAX_FRAME_BYTES}")
    return meta, payload


def unpack(meta: Buffer, payload: Buffer = b"") -> dict[str, Any]:
    """The map of a frame, each entry's `data` a view of `payload` (its `size` bytes, in order)."""
    try:
        msg = msgpack.unpackb(meta, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types
        raise FrameError(f"not msgpack: {type(exc).__name__}") from exc
    if not isinstance(msg, dict):
        raise FrameError("a frame must be a msgpack map")
    view, at = memoryview(payload), 0
    entries = msg.get("entries")
    for e in entries if isinstance(entries, list) else ():
        if isinstance(e, dict) and "size" in e:
            n = e.pop("size")
            if not isinstance(n, int) or n < 0 or at + n > len(view):
                raise FrameError("an entry's size runs past the frame's payload")
            e["data"], at = view[at:at + n], at + n
    if at != len(view):
        raise FrameError(f"the entries hold {at} of the payload's {len(view)} bytes")
    return msg
