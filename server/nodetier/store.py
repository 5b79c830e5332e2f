"""NodeStore: the node tier's entries in host memory under a byte capacity, victims kept longest, with their KV events; no I/O.

An entry is committed whole or not at all, and once stored it is never overwritten (a second put of the key only
makes it most recently used, so a writer cannot swap an entry other replicas read for other bytes): `put` checks the checksum of the complete bytes first, then makes room
(evicting as below) and inserts. Used bytes (payload + ENTRY_OVERHEAD per entry) never exceed
the capacity; an entry larger than the whole capacity is refused. Keys are contract 1's: a KV block's chain hash
(model, adapter and tenant salt are in its root, so tenants and adapters never share an entry) or an image's
mm_hash; the two kinds never collide (the kind is part of the key).

Eviction is victims first: a replica that writes a block through, or loads one from here, says it holds it in its
primary pool (`holder`); such entries are copies of what some replica on the node still has, so a full tier evicts
them first (least recently used first) and keeps the blocks no replica holds any more (those replicas evicted and
handed back), least recently used last. A replica evicting a block `release`s it: the entry, if still here, only
becomes a victim again (no bytes sent: touch-or-put); `release` says which keys are missing so the replica sends
those. A holder's claims end with its last connection (`drop_holder`), so a replica that dies leaves no entry
marked held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Union

from ..events import NODE, BlockRemoved, BlockStored, EncoderRemoved, EncoderStored, KVEvent
from .wire import ENC, KV, checksum

ENTRY_OVERHEAD = 128  # bytes counted per entry besides its payload (key, maps, bookkeeping)
Key = Union[bytes, str]
Slot = tuple[str, Key]  # (kind, key)


@dataclass
class Entry:
    data: bytes
    sum: int  # wire.checksum (XXH3-64) of data
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
    released: int = 0  # evictions from a replica's primary pool answered without bytes (the entry was here)


class NodeStore:
    def __init__(self, capacity_bytes: int, block_size: int = 0):
        if capacity_bytes < 1:
            raise ValueError("--capacity-bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size  # tokens per block of the last KV put (published in BlockStored)
        self.used_bytes = 0
        # every entry is in exactly one of the two, each least recently used first
        self.held: OrderedDict[Slot, Entry] = OrderedDict()  # some replica of the node holds it too: evicted first
        self.free: OrderedDict[Slot, Entry] = OrderedDict()  # held here only: evicted last
        self.holders: dict[Slot, set[str]] = {}
        self.claims: dict[str, set[Slot]] = {}  # holder -> the slots it holds
        self.counters = StoreCounters()
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self.held) + len(self.free)

    def __contains__(self, slot: Slot) -> bool:
        return slot in self.held or slot in self.free

    def slots(self) -> list[Slot]:
        """Every entry's (kind, key), the next to be evicted first."""
        return [*self.held, *self.free]

    def put(self, kind: str, key: Key, layout: str, data: bytes, digest: int, lora: Optional[str] = None,
            holder: Optional[str] = None, held: bool = False) -> bool:
        """Store one whole entry from `holder` (which still holds it in its primary pool if `held`: written
        through; else it evicted it); False (refused, nothing changed) if its checksum is wrong or it cannot fit."""
        if kind not in (KV, ENC) or checksum(data) != digest:
            self.counters.refused += 1
            return False
        entry = Entry(bytes(data), digest, layout, lora)
        if entry.cost > self.capacity_bytes:
            self.counters.refused += 1
            return False
        slot = (kind, key)
        old = self._find(slot)
        if old is not None and old.layout == layout:  # first writer wins: a put never replaces a whole entry
            if held:
                self._claim(slot, holder)
            else:
                self._unclaim(slot, holder)
            self._touch(slot)
            return True
        if old is not None:
            self._remove(slot)
        while self.used_bytes + entry.cost > self.capacity_bytes:
            self._evict()
        self.free[slot] = entry
        self.used_bytes += entry.cost
        if held:
            self._claim(slot, holder)
        self.counters.puts += 1
        if old is None:
            self._events.append(_stored(kind, key, lora, self.block_size))
        return True

    def get(self, kind: str, keys: list, layout: str, holder: Optional[str] = None) -> list[Entry]:
        """The longest run of whole entries from keys[0] on under `layout`; each becomes most recently used (and
        held by `holder`, which copies them into its primary pool)."""
        out = []
        for key in keys:
            e = self._find((kind, key))
            if e is None or e.layout != layout:
                break
            self._claim((kind, key), holder)
            self._touch((kind, key))
            out.append(e)
        if out:
            self.counters.get_hits += len(out)
        else:
            self.counters.get_misses += 1
        return out

    def release(self, kind: str, keys: list, holder: Optional[str]) -> list:
        """`holder` evicted these from its primary pool: each entry here loses its claim and becomes most recently
        used; returns the keys not here (the caller sends their bytes)."""
        missing = []
        for key in keys:
            slot = (kind, key)
            if self._find(slot) is None:
                missing.append(key)
                continue
            self._unclaim(slot, holder)
            self._touch(slot)
        self.counters.released += len(keys) - len(missing)
        return missing

    def drop_holder(self, holder: str) -> None:
        """`holder` is gone (its last connection closed): none of its claims stand."""
        for slot in self.claims.pop(holder, ()):
            self._unclaim(slot, holder, forget=False)

    # ---- internals -------------------------------------------------------------------------
    def _find(self, slot: Slot) -> Optional[Entry]:
        e = self.held.get(slot)
        return e if e is not None else self.free.get(slot)

    def _touch(self, slot: Slot) -> None:
        (self.held if slot in self.held else self.free).move_to_end(slot)

    def _claim(self, slot: Slot, holder: Optional[str]) -> None:
        if holder is None or slot[0] != KV:
            return
        who = self.holders.setdefault(slot, set())
        if holder in who:
            return
        who.add(holder)
        self.claims.setdefault(holder, set()).add(slot)
        if slot in self.free:
            self.held[slot] = self.free.pop(slot)

    def _unclaim(self, slot: Slot, holder: Optional[str], forget: bool = True) -> None:
        who = self.holders.get(slot)
        if who is None or holder not in who:
            return
        who.discard(holder)
        if forget:
            self._forget(holder, slot)
        if not who:
            del self.holders[slot]
            if slot in self.held:
                self.free[slot] = self.held.pop(slot)

    def _remove(self, slot: Slot) -> Entry:
        e = self.held.pop(slot, None) or self.free.pop(slot)
        self.used_bytes -= e.cost
        for holder in self.holders.pop(slot, ()):
            self._forget(holder, slot)
        return e

    def _forget(self, holder: str, slot: Slot) -> None:
        mine = self.claims.get(holder)
        if mine is not None:
            mine.discard(slot)
            if not mine:
                del self.claims[holder]

    def _evict(self) -> None:
        kind, key = slot = next(iter(self.held or self.free))
        self._remove(slot)
        self.counters.evicted += 1
        self._events.append(BlockRemoved([key], NODE) if kind == KV else EncoderRemoved([key]))

    def take_events(self) -> list[KVEvent]:
        """Drain the events since the last call."""
        ev, self._events = self._events, []
        return ev

    def state_events(self) -> list[KVEvent]:
        """Everything the store holds as events, led by AllBlocksCleared (a subscriber syncs from them)."""
        from ..events import AllBlocksCleared

        blocks = [k for kind, k in self.slots() if kind == KV]
        images = [k for kind, k in self.slots() if kind == ENC]
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
