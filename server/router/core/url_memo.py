"""What the replicas said each http(s) image URL hashed to, per tenant salt: bounded, expiring; no I/O.

Learned from the media header of a replica's answer (multimodal/url_hashes.py) under the
request's effective `cache_salt` (the tenant's, once the router salted the body), and looked up
under the same salt only: a tenant learns nothing from another tenant's fetches (which URLs
they sent, what they hashed to), and cannot make the router believe anything about another
tenant's URLs. The replica hashes the bytes it fetches on every request, so an object changed
behind its URL makes the router's prediction a miss there (never a wrong hit), and that answer's
header replaces the entry.

    (salt, url_key) ──▶ (mm_hash, grid, learned at)     LRU over `capacity`, older than `ttl_s`: forgotten
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Optional

from ...multimodal.url_hashes import Grid, url_key


class UrlHashMemo:
    """Thread-safe: learned on the event loop, read by the renderer's worker thread."""

    def __init__(self, capacity: int = 100_000, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if capacity < 1 or ttl_s <= 0:
            raise ValueError("url hash memo needs capacity >= 1 and ttl_s > 0")
        self.capacity, self.ttl_s, self._clock = capacity, ttl_s, clock
        self._entries: OrderedDict[tuple, tuple[str, Grid, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_learned = 0  # entries stored or replaced
        self.num_changed = 0  # entries whose URL now hashes to something else (the object changed)

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, salt: Optional[str], rows: Iterable[tuple[str, str, Grid]]) -> None:
        """Record a replica's (url_key, mm_hash, grid) rows for requests salted `salt`."""
        now = self._clock()
        with self._lock:
            for key, h, grid in rows:
                k = (salt or "", key)
                old = self._entries.pop(k, None)
                if old is not None and old[0] != h:
                    self.num_changed += 1
                self._entries[k] = (h, grid, now)
                self.num_learned += 1
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, salt: Optional[str], url: str) -> Optional[tuple[str, Grid]]:
        """(mm_hash, grid) the URL hashed to under `salt`, None if unknown or expired."""
        k = (salt or "", url_key(url))
        with self._lock:
            e = self._entries.get(k)
            if e is None:
                return None
            if self._clock() - e[2] > self.ttl_s:
                del self._entries[k]
                return None
            self._entries.move_to_end(k)
            return e[0], e[1]
