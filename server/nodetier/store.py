"""NodeStore: the node tier's entries in host memory, LRU under a byte capacity, with their KV events; no I/O.

An entry is committed whole or not at all, and once stored it is never overwritten (a second put of the key only
makes it most recently used, so a writer cannot swap an entry other replicas read for other bytes): `put` checks the checksum of the complete bytes first, then makes room
(evicting least recently used entries) and inserts. Used bytes (payload + ENTRY_OVERHEAD per entry) never exceed
the capacity; an entry larger than the whole capacity is refused. Keys are contract 1's: a KV block's chain hash
(model, adapter and tenant salt are in its root, so tenants and adapters never share an entry) or an image's
mm_hash; the two kinds never collide (the kind is part of the key).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Union

from ..events import NODE, BlockRemoved, BlockStored, EncoderRemoved, EncoderStored, KVEvent
from .wire import ENC, KV, checksum

ENTRY_OVERHEAD = 128  # bytes counted per entry besides its payload (key, maps, bookkeeping)
Key = Union[bytes, str]


@dataclass
class Entry:
    data: bytes
    crc: int  # zlib.crc32 of data
    layout: str  # shape of the bytes (dtype, block geometry): another layout's get is a miss
    lora: Optional[str] = None  # LoRA adapter of a KV block's chain (published in BlockStored), None: base model

    @property
    def cost(self) -> int:
        return len(self.data) + ENTRY_OVERHEAD


@dataclass
class StoreCounters:
    puts: int = 0  # entries stored
    refused: int = 0  # entries refused (bad checksum, larger than the capacity)
    evicted: int = 0  # entries evicted for room
    get_hits: int = 0  # entries served
    get_misses: int = 0  # gets whose first key was absent


class NodeStore:
    def __init__(self, capacity_bytes: int, block_size: int = 0):
        if capacity_bytes < 1:
            raise ValueError("--capacity-bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size  # tokens per block of the last KV put (published in BlockStored)
        self.used_bytes = 0
        self.lru: OrderedDict[tuple[str, Key], Entry] = OrderedDict()  # first = least recently used
        self.counters = StoreCounters()
        self._events: list[KVEvent] = []

    def put(self, kind: str, key: Key, layout: str, data: bytes, crc: int, lora: Optional[str] = None) -> bool:
        """Store one whole entry; False (refused, nothing changed) if its checksum is wrong or it cannot fit."""
        if kind not in (KV, ENC) or checksum(data) != crc:
            self.counters.refused += 1
            return False
        entry = Entry(bytes(data), crc, layout, lora)
        if entry.cost > self.capacity_bytes:
            self.counters.refused += 1
            return False
        old = self.lru.get((kind, key))
        if old is not None and old.layout == layout:  # first writer wins: a put never replaces a whole entry
            self.lru.move_to_end((kind, key))
            return True
        if old is not None:
            del self.lru[(kind, key)]
            self.used_bytes -= old.cost
        while self.used_bytes + entry.cost > self.capacity_bytes:
            self._evict()
        self.lru[(kind, key)] = entry
        self.used_bytes += entry.cost
        self.counters.puts += 1
        if old is None:
            self._events.append(_stored(kind, key, lora, self.block_size))
        return True

    def get(self, kind: str, keys: list, layout: str) -> list[Entry]:
        """The longest run of whole entries from keys[0] on under `layout`; each becomes most recently used."""
        out = []
        for key in keys:
            e = self.lru.get((kind, key))
            if e is None or e.layout != layout:
                break
            self.lru.move_to_end((kind, key))
            out.append(e)
        if out:
            self.counters.get_hits += len(out)
        else:
            self.counters.get_misses += 1
        return out

    def _evict(self) -> None:
        (kind, key), e = self.lru.popitem(last=False)
        self.used_bytes -= e.cost
        self.counters.evicted += 1
        self._events.append(BlockRemoved([key], NODE) if kind == KV else EncoderRemoved([key]))

    def take_events(self) -> list[KVEvent]:
        """Drain the events since the last call."""
        ev, self._events = self._events, []
        return ev

    def state_events(self) -> list[KVEvent]:
        """Everything the store holds as events, led by AllBlocksCleared (a subscriber syncs from them)."""
        from ..events import AllBlocksCleared

        blocks = [k for kind, k in self.lru if kind == KV]
        images = [k for kind, k in self.lru if kind == ENC]
        out: list[KVEvent] = [AllBlocksCleared()]
        if blocks:
            out.append(BlockStored(blocks, None, [], self.block_size or 1, NODE))
        if images:
            out.append(EncoderStored(images))
        return out


def _stored(kind: str, key: Key, lora: Optional[str], block_size: int) -> KVEvent:
    if kind == KV:
        return BlockStored([key], None, [], block_size or 1, NODE, lora_name=lora)
    return EncoderStored([key])
