"""Seeded test pictures for the tiny VL checkpoints (tests, benches): encoded bytes, data URIs, OpenAI image content parts."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def image_bytes(w: int = 64, h: int = 48, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """An encoded w×h picture of seeded noise (same seed, same bytes)."""
    rng = np.random.default_rng(seed)
    shape = (h, w, 3) if mode == "RGB" else (h, w)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str | None = None, uuid: str | None = None) -> dict:
    """An OpenAI `image_url` content part, optionally carrying a uuid (FastDeploy's convention)."""
    part: dict = {"type": "image_url"}
    if url is not None:
        part["image_url"] = {"url": url}
    if uuid is not None:
        part["uuid"] = uuid
    return part
