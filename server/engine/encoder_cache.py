"""Encoder cache: vision-encoder outputs per mm_hash under a token budget, LRU over unpinned entries; no paddle.

Values are opaque to this module (the model runner stores device tensors [num_tokens, hidden]).
An entry pinned by a running request is never evicted; an item larger than the whole budget
is computed by the caller but not stored. Stores and evictions queue `EncoderStored` /
`EncoderRemoved` events for the KV-event stream (`take_events` drains them).

Which embedding rows a step needs (`image_slices`), when a step's token span starts or ends
inside an image (prefix cache hit mid-image, chunked prefill):

    prompt        |....text....|<------ image: offset o, length L ------>|...text...|
    step span                          [start ................ end)
    rows needed                        [start - o, min(end, o+L) - o)  of the image's L rows
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..events import EncoderRemoved, EncoderStored
from ..hashing import MMPlaceholder


@dataclass
class _Entry:
    value: Any  # embeddings [num_tokens, hidden] on the model's device
    num_tokens: int


@dataclass
class EncoderCacheStats:
    num_hits: int = 0
    num_misses: int = 0
    num_stored: int = 0
    num_evictions: int = 0
    num_too_large: int = 0  # computed but larger than the budget, never stored
    num_no_room: int = 0  # not stored because pinned entries filled the budget
    usage_tokens: int = 0
    budget_tokens: int = 0
    num_entries: int = 0


class EncoderCache:
    """mm_hash → vision embeddings; `--max-encoder-cache` tokens (0 disables storing)."""

    def __init__(self, budget_tokens: int):
        if budget_tokens < 0:
            raise ValueError(f"--max-encoder-cache is tokens and must be >= 0, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._pins: dict[str, set[str]] = {}  # mm_hash -> request ids using it
        self._pinned_by: dict[str, set[str]] = {}  # request id -> mm_hashes it pins
        self._events: list = []
        self.stats = EncoderCacheStats(budget_tokens=budget_tokens)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def usage_tokens(self) -> int:
        return self.stats.usage_tokens

    def mm_hashes(self) -> list[str]:
        """Cached identities, for the router snapshot."""
        return list(self._entries)

    def lookup(self, mm_hash: str) -> Optional[Any]:
        """Cached embeddings (refreshing recency) or None; counts a hit or a miss."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.stats.num_misses += 1
            return None
        self._entries.move_to_end(mm_hash)
        self.stats.num_hits += 1
        return entry.value

    def pin(self, request_id: str, mm_hash: str) -> None:
        """Keep `mm_hash` (now or once stored) resident until `release(request_id)`."""
        self._pins.setdefault(mm_hash, set()).add(request_id)
        self._pinned_by.setdefault(request_id, set()).add(mm_hash)

    def release(self, request_id: str) -> None:
        """Drop every pin of a request (finished, aborted, preempted, or past all its images)."""
        for h in self._pinned_by.pop(request_id, ()):
            users = self._pins.get(h)
            if users is not None:
                users.discard(request_id)
                if not users:
                    del self._pins[h]

    def is_pinned(self, mm_hash: str) -> bool:
        return bool(self._pins.get(mm_hash))

    def evictable_tokens(self) -> int:
        return sum(e.num_tokens for h, e in self._entries.items() if not self.is_pinned(h))

    def can_store(self, num_tokens: int) -> bool:
        free = self.budget_tokens - self.stats.usage_tokens
        return num_tokens <= self.budget_tokens and num_tokens <= free + self.evictable_tokens()

    def store(self, mm_hash: str, value: Any, num_tokens: int) -> bool:
        """Cache embeddings, evicting least-recently-used unpinned entries; False when not stored."""
        if mm_hash in self._entries:
            self._entries.move_to_end(mm_hash)
            return True
        if num_tokens > self.budget_tokens:
            self.stats.num_too_large += 1
            return False
        if not self.can_store(num_tokens):
            self.stats.num_no_room += 1
            return False
        removed = []
        while self.stats.usage_tokens + num_tokens > self.budget_tokens:
            victim = next(h for h in self._entries if not self.is_pinned(h))
            self.stats.usage_tokens -= self._entries.pop(victim).num_tokens
            self.stats.num_evictions += 1
            removed.append(victim)
        if removed:
            self._events.append(EncoderRemoved(removed))
        self._entries[mm_hash] = _Entry(value, num_tokens)
        self.stats.usage_tokens += num_tokens
        self.stats.num_stored += 1
        self.stats.num_entries = len(self._entries)
        self._events.append(EncoderStored([mm_hash]))
        return True

    def clear(self) -> None:
        """Drop every unpinned entry (e.g. on reset); pinned ones stay for their requests."""
        removed = [h for h in self._entries if not self.is_pinned(h)]
        for h in removed:
            self.stats.usage_tokens -= self._entries.pop(h).num_tokens
        self.stats.num_entries = len(self._entries)
        if removed:
            self._events.append(EncoderRemoved(removed))

    def take_events(self) -> list:
        """Drain queued EncoderStored / EncoderRemoved events."""
        events, self._events = self._events, []
        return events


@dataclass(frozen=True)
class ImageSlice:
    """Rows of one image's embeddings that land in a step's token span."""

    index: int  # position of the image in the request's mm_placeholders / mm_inputs
    mm_hash: str
    rows: tuple[int, int]  # [start, end) rows of the image's embeddings
    dst: tuple[int, int]  # [start, end) positions relative to the step span's first token


def image_slices(placeholders: Sequence[MMPlaceholder], start: int, end: int) -> list[ImageSlice]:
    """Images overlapping token span [start, end), with exactly the rows that span needs."""
    out = []
    for i, ph in enumerate(placeholders):
        lo, hi = max(start, ph.offset), min(end, ph.offset + ph.length)
        if lo < hi:
            out.append(ImageSlice(i, ph.mm_hash, (lo - ph.offset, hi - ph.offset), (lo - start, hi - start)))
    return out


def chunk_end(placeholders: Sequence[MMPlaceholder], start: int, end: int) -> int:
    """Largest chunk end <= `end` that does not fall inside an image.

    If the span begins inside or at an image that does not fit, returns that image's end
    (the caller must then schedule the whole image or nothing).
    """
    for ph in sorted(placeholders, key=lambda p: p.offset):
        img_end = ph.offset + ph.length
        if ph.offset < end < img_end:
            return ph.offset if ph.offset > start else img_end
    return end
