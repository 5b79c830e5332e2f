"""Media header v1 (replica → router, beside contract 2): the mm_hash of each http(s) image a replica fetched; no paddle.

    x-warmfleet-media: v1 [[url_key, mm_hash, t, h, w], ...]     (compact JSON after "v1 "; at most 32 entries)

`url_key` is `url_key(url)`: blake2b-128 of the URL as the client wrote it, so a signed URL's
token never travels in a header or sits in router memory in clear. `mm_hash` is what the
replica computed from the bytes it fetched (contract 1: a digest of the bytes and the
preprocessing parameters), and (t, h, w) its patch grid, which the router needs to expand the
image's placeholder tokens. The header only answers the request that made the replica fetch;
the router files it under that request's `cache_salt`, so a tenant learns only from its own
requests. Only http(s) parts
without a `uuid` are reported (data: URIs the router hashes itself, a uuid names itself).
The router keeps it per (salt, url_key), bounded and expiring (router/core/url_memo.py); the
replica's content hash stays the truth, so a changed object only makes a predicted hit a miss.
JSON only, never pickle; a malformed header is ignored as a whole.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Optional

Grid = tuple[int, int, int]  # (t, h, w) in patches

HEADER = "x-warmfleet-media"
VERSION = "v1"
MAX_ENTRIES = 32
_MAX_HEADER_BYTES = 8192


def url_key(url: str) -> str:
    """The name of an image URL in the header and the router's memory."""
    return hashlib.blake2b(url.encode(), digest_size=16).hexdigest()


def is_fetched_url(url: Optional[str]) -> bool:
    """Whether a part's URL is one the replica fetches over the network (what the router cannot hash itself)."""
    return bool(url) and url[:8].lower().startswith(("http://", "https://"))


def encode_header(fetched: Iterable[tuple[str, str, Grid]]) -> Optional[str]:
    """The header value for (url, mm_hash, grid) triples, None when there are none."""
    rows, seen = [], set()
    for url, h, grid in fetched:
        key = url_key(url)
        if key in seen:
            continue
        seen.add(key)
        rows.append([key, h, *grid])
        if len(rows) == MAX_ENTRIES:
            break
    return f"{VERSION} {json.dumps(rows, separators=(',', ':'))}" if rows else None


def parse_header(value: Optional[str]) -> list[tuple[str, str, Grid]]:
    """(url_key, mm_hash, grid) triples of a header value; [] for anything malformed or of another version."""
    if not value or len(value) > _MAX_HEADER_BYTES or not value.startswith(VERSION + " "):
        return []
    try:
        rows = json.loads(value[len(VERSION) + 1:])
    except ValueError:
        return []
    if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
        return []
    out = []
    for row in rows:
        if (not isinstance(row, list) or len(row) != 5 or not all(isinstance(s, str) and s for s in row[:2])
                or len(row[0]) != 32 or not all(type(n) is int and 0 < n <= 1 << 16 for n in row[2:])):
            return []
        out.append((row[0], row[1], (row[2], row[3], row[4])))
    return out
