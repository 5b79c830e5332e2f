"""KV index: which replica holds which block in which tier, fed by KV events and snapshots; no I/O.

Sequence tracking per replica (contract 2):

    unsynced ──snapshot(seq=S)──▶ synced(seq=S) ──batch S+1, S+2, ...──▶ synced
        ▲                              │ any other seq (gap, duplicate, reordered, restart, junk):
        │                              │ kept aside, state kept, NEED_RESYNC
      purge (replica down)             ▼
                                  snapshot(seq=S') replaces the state; the batches kept aside
                                  that continue it (S'+1, S'+2, ...) are replayed, the rest dropped

No single message can wipe a replica's state: a frame with a wild sequence number (a bug, a
foreign publisher, a replayed capture) only costs a snapshot fetch, and the index keeps
predicting from what it knew until the snapshot says otherwise. Only `purge` (the replica is
down) or an `AllBlocksCleared` event in order forgets blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..events import (
    CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, EncoderRemoved, EncoderStored, EventBatch, Load,
    Snapshot,
)

_TIER_BITS = {GPU: 1, CPU: 2}
MAX_PENDING_BATCHES = 10_000  # buffered while waiting for a snapshot; beyond this the oldest are dropped


class Applied(enum.Enum):
    OK = "ok"  # applied in order
    BUFFERED = "buffered"  # replica is waiting for a snapshot; kept for replay
    NEED_RESYNC = "need_resync"  # gap or restart mid-stream: fetch a snapshot
    STALE = "stale"  # a snapshot older than events applied while it was fetched: ignored


@dataclass
class ReplicaKV:
    """What one replica's cache holds, as far as its events tell."""

    gpu: set = field(default_factory=set)  # block hashes in the primary pool
    cpu: set = field(default_factory=set)  # block hashes in the swap tier
    encoder: set = field(default_factory=set)  # mm hashes in the encoder cache
    seq: Optional[int] = None  # last applied sequence number; None while unsynced
    pending: list = field(default_factory=list)  # EventBatch buffered while unsynced
    load: Optional[Load] = None  # latest engine load figures
    load_time: float = 0.0  # monotonic time the load figures arrived
    last_event_ts: float = 0.0  # publisher timestamp (wall clock) of the last applied batch
    block_size: Optional[int] = None  # from the last snapshot
    model_fingerprint: Optional[str] = None  # from the last snapshot

    @property
    def synced(self) -> bool:
        return self.seq is not None


@dataclass(frozen=True)
class PrefixMatch:
    """Leading blocks of a request cached on one replica."""

    gpu_blocks: int  # blocks of the prefix found in the primary pool
    cpu_blocks: int  # blocks of the prefix found only in the swap tier

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


class KVIndex:
    """hash → {replica: tier bits} plus per-replica sets, so a purge costs the replica's size only."""

    def __init__(self) -> None:
        self._where: dict[bytes, dict[str, int]] = {}
        self.replicas: dict[str, ReplicaKV] = {}

    # --- membership -----------------------------------------------------------------------
    def state(self, replica: str) -> ReplicaKV:
        st = self.replicas.get(replica)
        if st is None:
            st = self.replicas[replica] = ReplicaKV()
        return st

    def is_synced(self, replica: str) -> bool:
        st = self.replicas.get(replica)
        return st is not None and st.synced

    def purge(self, replica: str) -> None:
        """Forget everything about a replica's cache and wait for a snapshot (dead, restarted, or lost events)."""
        st = self.replicas.get(replica)
        if st is None:
            return
        self._drop_blocks(replica, st)
        st.encoder.clear()
        st.seq = None
        st.pending.clear()
        st.load = None

    def remove(self, replica: str) -> None:
        """The replica left the fleet."""
        self.purge(replica)
        self.replicas.pop(replica, None)

    # --- events ---------------------------------------------------------------------------
    def apply_batch(self, replica: str, batch: EventBatch) -> Applied:
        st = self.state(replica)
        if st.synced and batch.seq == st.seq + 1:
            self._apply_events(replica, st, batch)
            return Applied.OK
        if len(st.pending) >= MAX_PENDING_BATCHES:
            del st.pending[0]
        st.pending.append(batch)
        return Applied.NEED_RESYNC if st.synced else Applied.BUFFERED

    def apply_snapshot(self, replica: str, snap: Snapshot, seq_at_request: Optional[int] = None) -> Applied:
        """Replace a replica's state with a snapshot, then replay the kept-aside batches that continue it.

        `seq_at_request` is the replica's last applied seq when the snapshot was requested. If
        in-order events moved past it and past the snapshot's own seq meanwhile, the snapshot
        predates state the index already has (applying it would forget those blocks): STALE.
        Kept-aside batches newer than the snapshot that do not continue it are dropped, and
        NEED_RESYNC says another snapshot is needed to cover them.
        """
        st = self.state(replica)
        if st.seq is not None and st.seq != seq_at_request and snap.seq < st.seq:
            return Applied.STALE
        pending = sorted((b for b in st.pending if b.seq > snap.seq), key=lambda b: b.seq)
        self._drop_blocks(replica, st)
        st.pending.clear()
        st.encoder = set(snap.encoder)
        st.block_size, st.model_fingerprint = snap.block_size, snap.model_fingerprint
        if snap.load is not None:
            st.load, st.load_time = snap.load, time.monotonic()
        self._add(replica, st, snap.gpu, GPU)
        self._add(replica, st, snap.cpu, CPU)
        st.seq = snap.seq
        for b in pending:
            if b.seq == st.seq + 1:
                self._apply_events(replica, st, b)
            elif b.seq > st.seq + 1:
                return Applied.NEED_RESYNC  # a gap after the snapshot: what follows needs another one
        return Applied.OK

    def _apply_events(self, replica: str, st: ReplicaKV, batch: EventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                self._add(replica, st, e.block_hashes, e.medium)
            elif isinstance(e, BlockRemoved):
                self._discard(replica, st, e.block_hashes, e.medium)
            elif isinstance(e, AllBlocksCleared):
                self._drop_blocks(replica, st)
            elif isinstance(e, EncoderStored):
                st.encoder.update(e.mm_hashes)
            elif isinstance(e, EncoderRemoved):
                st.encoder.difference_update(e.mm_hashes)
            elif isinstance(e, Load):
                st.load, st.load_time = e, time.monotonic()
        st.seq = batch.seq
        st.last_event_ts = batch.ts

    def _tier_set(self, st: ReplicaKV, medium: str) -> set:
        return st.cpu if medium == CPU else st.gpu

    def _add(self, replica: str, st: ReplicaKV, hashes: Iterable[bytes], medium: str) -> None:
        bit, tier = _TIER_BITS.get(medium, 1), self._tier_set(st, medium)
        for h in hashes:
            h = bytes(h)
            tier.add(h)
            owners = self._where.setdefault(h, {})
            owners[replica] = owners.get(replica, 0) | bit

    def _discard(self, replica: str, st: ReplicaKV, hashes: Iterable[bytes], medium: str) -> None:
        bit, tier = _TIER_BITS.get(medium, 1), self._tier_set(st, medium)
        for h in hashes:
            h = bytes(h)
            tier.discard(h)
            owners = self._where.get(h)
            if owners is None or replica not in owners:
                continue
            left = owners[replica] & ~bit
            if left:
                owners[replica] = left
            else:
                del owners[replica]
                if not owners:
                    del self._where[h]

    def _drop_blocks(self, replica: str, st: ReplicaKV) -> None:
        self._discard(replica, st, list(st.gpu), GPU)
        self._discard(replica, st, list(st.cpu), CPU)

    def add_blocks(self, replica: str, hashes: Iterable[bytes], medium: str = GPU) -> None:
        """Record blocks as held without an event (a predicted index for engines that publish none)."""
        self._add(replica, self.state(replica), hashes, medium)

    def remove_blocks(self, replica: str, hashes: Iterable[bytes], medium: str = GPU) -> None:
        self._discard(replica, self.state(replica), hashes, medium)

    # --- queries --------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes], replicas: Iterable[str]) -> dict[str, PrefixMatch]:
        """Longest cached prefix of `hashes` on each replica, split by tier (a block in both tiers counts GPU)."""
        counts = {r: [0, 0] for r in replicas}
        alive = set(counts)
        for h in hashes:
            if not alive:
                break
            owners = self._where.get(h)
            if not owners:
                break
            for r in list(alive):
                bits = owners.get(r, 0)
                if bits & 1:
                    counts[r][0] += 1
                elif bits & 2:
                    counts[r][1] += 1
                else:
                    alive.discard(r)
        return {r: PrefixMatch(g, c) for r, (g, c) in counts.items()}

    def encoder_hits(self, replica: str, mm_hashes: Iterable[str]) -> set:
        st = self.replicas.get(replica)
        return set() if st is None else st.encoder.intersection(mm_hashes)

    def num_blocks(self) -> int:
        """Distinct block hashes known anywhere in the fleet."""
        return len(self._where)
