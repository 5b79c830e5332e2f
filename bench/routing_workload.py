"""bench/routing.py's workloads: multi-turn conversations (text, shared images, recurring images, images by URL) and the oracle and fleet-sized LRU bounds over them."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402


BLOCK = 16


# --- workload -------------------------------------------------------------------------------
def workload(seed: int, n: int, tenants: int = 8) -> list[list[dict]]:
    """Seeded list of chat `messages`: half on one hot prefix, the rest Zipf over tenants, multi-turn."""
    rng = random.Random(seed)
    words = "cache block prefix replica router token engine swap tier image tenant stream batch".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    systems = [f"Tenant {t} policy: " + text(120) for t in range(tenants)]
    hot = "Hot shared instructions: " + text(160)
    zipf = [1 / (i + 1) for i in range(tenants)]
    convs: dict[int, list[dict]] = {}
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            out.append([{"role": "system", "content": hot}, {"role": "user", "content": text(12)}])
            continue
        t = rng.choices(range(tenants), zipf)[0]
        cid = t * 4 + rng.randrange(4)  # four conversations per tenant
        hist = convs.setdefault(cid, [{"role": "system", "content": systems[t]}])
        hist.append({"role": "user", "content": text(16)})
        out.append(list(hist))
        hist.append({"role": "assistant", "content": text(8)})
    return out


def photo_uri(seed: int, side: int = 224) -> str:
    """A deterministic PNG as a data: URI (a gradient with noise, like bench/multimodal.py)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    img = np.stack([xx / side * 255, yy / side * 255, (np.sin(xx / (10 + seed)) + 1) * 127], -1)
    img = img + rng.normal(0, 6, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_workload(seed: int, n: int, images: int = 12) -> list[list[dict]]:
    """Requests that share images but not text: Zipf over a set of images, a fresh question each time."""
    rng = random.Random(seed)
    words = "what where colour shape count left right top corner gradient noise texture bright dark".split()
    uris = [photo_uri(1000 * seed + k) for k in range(images)]
    zipf = [1 / (i + 1) for i in range(images)]
    out = []
    for _ in range(n):
        k = rng.choices(range(images), zipf)[0]
        question = " ".join(rng.choice(words) for _ in range(10 + rng.randrange(10)))
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[k]}},
                                                 {"type": "text", "text": question}]}])
    return out


def recurring_image_workload(seed: int, n: int, images: int = 12, turns: int = 3) -> list[list[dict]]:
    """The same images in different conversations: each conversation its own system prompt (so no KV prefix reaches
    its image), one image Zipf-picked from a set in its first user turn, then up to `turns` turns; interleaved."""
    rng = random.Random(seed)
    words = "what where colour shape count left right top corner gradient noise texture bright dark".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    uris = [photo_uri(1000 * seed + 500 + k) for k in range(images)]
    zipf = [1 / (i + 1) for i in range(images)]
    open_convs: list[list[dict]] = []
    out, num_convs = [], 0
    for _ in range(n):
        if not open_convs or rng.random() < 0.5:  # a new conversation on a (likely known) image
            num_convs += 1
            k = rng.choices(range(images), zipf)[0]
            hist = [{"role": "system", "content": f"Conversation {num_convs}: " + text(24)},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[k]}},
                                                 {"type": "text", "text": text(10)}]}]
            open_convs.append(hist)
        else:
            hist = rng.choice(open_convs)
            hist.append({"role": "user", "content": text(10)})
        out.append(list(hist))
        hist.append({"role": "assistant", "content": text(6)})
        if sum(1 for m in hist if m["role"] == "user") >= turns:
            open_convs.remove(hist)
    return out


def by_url(trace: list[list[dict]], media) -> list[list[dict]]:
    """`trace` with every data: image served by `media` (livefleet.MediaServer) and sent by its http URL instead."""
    import base64
    import hashlib

    def swap(part):
        url = part.get("image_url", {}).get("url", "") if isinstance(part, dict) else ""
        if not url.startswith("data:"):
            return part
        data = base64.b64decode(url.split(",", 1)[1])
        return {**part, "image_url": {"url": media.put(hashlib.blake2b(data, digest_size=8).hexdigest() + ".png", data)}}

    return [[{**m, "content": [swap(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
             for m in msgs] for msgs in trace]


def oracle_hits(model: Path, trace: list[list[dict]], capacity: int | None = None,
                block: int = BLOCK) -> list[tuple[int, int]]:
    """Per request (cached, prompt) tokens for one cache that saw every earlier request (contract 1).

    Unbounded by default (the issue's oracle). With `capacity` blocks it is one LRU cache as large as
    the whole fleet's KV pools: what a router could reach if routing cost no cache space at all (no
    prefix held twice); a reference for how much of the gap to the oracle is capacity, not routing.
    """
    from collections import OrderedDict

    from warmfleet.server.hashing import block_hashes, model_fingerprint
    from warmfleet.server.router.core.policy import cacheable_tokens
    from warmfleet.server.router.core.prompt import PromptRenderer

    r, fp = PromptRenderer(str(model)), model_fingerprint(model)
    seen: OrderedDict = OrderedDict()
    out = []
    for msgs in trace:
        p = r.chat({"messages": msgs})
        hs = block_hashes(p.token_ids, p.mm_items, block, fp)
        hit = lru_prefix(seen, hs, capacity)
        out.append((min(hit * block, cacheable_tokens(p.num_tokens, block)), p.num_tokens))
    return out


lru_prefix = harness.lru_prefix


def oracle_ratio(model: Path, trace: list[list[dict]]) -> float:
    hits = oracle_hits(model, trace)
    return sum(c for c, _ in hits) / sum(t for _, t in hits)
