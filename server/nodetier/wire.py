"""Node-tier wire format: length-prefixed msgpack frames over TCP, checksums; msgpack only, never pickle; no I/O policy.

One frame is a 4-byte big-endian length and a msgpack map of at most MAX_FRAME_BYTES. A request is a map with
`op`; the answer a map with `ok` (and `error` when not ok):

    {op: "hello", holder?, token?}                                         -> {ok}       (first frame, optional)
    {op: "put", entries: [{kind, key, layout, data, crc, lora?, held?}, ...]} -> {ok, stored, refused}
    {op: "get", kind, keys: [key, ...], layout}                           -> {ok, entries: [{data, crc}, ...], cut}
    {op: "release", kind, keys: [key, ...]}                               -> {ok, missing: [key, ...]}
    {op: "stats"}                                                          -> {ok, capacity_bytes, used_bytes, ...}

`holder` names the replica behind the connection; `held` true on a put says that replica still holds the block in its
primary pool (written through), false that it evicted it; a get makes the getter a holder; `release` says the holder
evicted blocks it believes are here, and answers those that are not (their bytes follow in a put). The node tier
evicts blocks some replica still holds first (store.py).

`kind` is "kv" (key: a contract-1 block hash, bytes) or "enc" (key: an mm_hash, str). A get answers the longest
run of whole entries from the first key on (a KV prefix stops at its first miss); `crc` is zlib.crc32 of `data`,
checked on both ends, so an entry is used only when it is whole. An answer stops short of MAX_FRAME_BYTES / 2 with
`cut` true when the run goes on; the client then asks again from where it stopped. `layout` names the bytes' shape (dtype and block
geometry); an entry stored under another layout is a miss, never a reinterpretation.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack

MAX_FRAME_BYTES = 256 << 20  # one frame (a put's batch or a get's answer) holds at most 256 MiB
HEADER = struct.Struct(">I")
KV, ENC = "kv", "enc"
KINDS = (KV, ENC)


class FrameError(ValueError):
    """A frame that is too large or not a msgpack map."""


def checksum(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack(msg: dict) -> bytes:
    """One frame: header and payload."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes is over {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {n} bytes announced, over {MAX_FRAME_BYTES}")
    return n


def unpack(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types
        raise FrameError(f"not msgpack: {type(exc).__name__}") from exc
    if not isinstance(msg, dict):
        raise FrameError("a frame must be a msgpack map")
    return msg
