"""ProcessedImage ⇄ msgpack header + raw pixel buffer (processor cache, engine IPC); never pickle, no paddle."""

from __future__ import annotations

import msgpack
import numpy as np

from .processor import ProcessedImage

ALLOWED_DTYPES = ("float32", "float16", "uint8")


def encode_header(img: ProcessedImage) -> bytes:
    """msgpack header describing the buffer that travels beside it."""
    pv = img.pixel_values
    return msgpack.packb({"grid": list(img.grid_thw), "merge": img.merge_size, "dtype": str(pv.dtype),
                          "shape": list(pv.shape)}, use_bin_type=True)


def encode(img: ProcessedImage) -> tuple[bytes, memoryview]:
    """(header, buffer) frames; the buffer is a view of the array, not a copy."""
    pv = np.ascontiguousarray(img.pixel_values)
    return encode_header(ProcessedImage(pv, img.grid_thw, img.merge_size)), memoryview(pv).cast("B")


def decode(header: bytes, buf) -> ProcessedImage:
    """Inverse of `encode`; ValueError for anything inconsistent (a bad peer must not crash us)."""
    try:
        h = msgpack.unpackb(bytes(header), raw=False, strict_map_key=True)
        grid = tuple(int(x) for x in h["grid"])
        shape = tuple(int(x) for x in h["shape"])
        dtype = h["dtype"]
        merge = int(h.get("merge", 2))
    except (msgpack.UnpackException, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed pixel header: {exc}") from None
    if dtype not in ALLOWED_DTYPES or len(grid) != 3 or len(shape) != 2 or merge < 1:
        raise ValueError(f"malformed pixel header: dtype={dtype!r} grid={grid} shape={shape}")
    if shape[0] != grid[0] * grid[1] * grid[2]:
        raise ValueError(f"pixel rows {shape[0]} do not match grid {grid}")
    arr = np.frombuffer(buf, dtype=np.dtype(dtype))
    if arr.size != shape[0] * shape[1]:
        raise ValueError(f"pixel buffer holds {arr.size} values, header says {shape}")
    return ProcessedImage(arr.reshape(shape), grid, merge)


def to_msgpack(img: ProcessedImage) -> dict:
    """One msgpack-able dict (header fields + `data` bytes) for the engine request channel."""
    header, buf = encode(img)
    return {"header": header, "data": bytes(buf)}


def from_msgpack(d: dict) -> ProcessedImage:
    return decode(d["header"], d["data"])
