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

Memory bound (`max_blocks_per_replica`, `warmfleet route --index-max-blocks`): the index mirrors
the replicas' pools, so it is as large as they are (about 250 bytes per (block, replica) entry,
docs/scale.md), unless a replica's events say it holds more than the cap. Then the index forgets
that replica's least recently used entries, CPU tier first: "used" is stored (a BlockStored) or
the prefix of a request this router sent it (`touch`). A forgotten block only costs a predicted
hit (the router may send that prefix elsewhere), never a wrong one; its later BlockRemoved is a
no-op. Unset (the default), the index is unbounded as before.

Node tiers (server/nodetier) are entries of their own, keyed by their topic `node:<NAME>`, holding medium NODE;
a replica's snapshot names its node (`node_name`), which is how the router pairs it with its node's tier. A node
tier serves no snapshot: `apply_batch(..., self_syncing=True)` takes a batch that begins with AllBlocksCleared as
its whole state (it publishes one to each new subscription) in place of a snapshot.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ...events import (
    CPU, GPU, NODE, AllBlocksCleared, BlockRemoved, BlockStored, EncoderRemoved, EncoderStored, EventBatch, Load,
    Snapshot,
)

_TIER_BITS = {GPU: 1, CPU: 2, NODE: 4}
MAX_PENDING_BATCHES = 10_000  # buffered while waiting for a snapshot; beyond this the oldest are dropped


class BlockSet(dict):
    """A set of block hashes that remembers order (oldest first), for the per-replica cap; compares equal to sets."""

    __slots__ = ()

    def add(self, h: bytes) -> None:
        self[h] = None

    def discard(self, h: bytes) -> None:
        self.pop(h, None)

    def refresh(self, h: bytes) -> None:
        """Make `h` the newest entry (it was just stored again or used)."""
        if h in self:
            del self[h]
            self[h] = None

    def __eq__(self, other) -> bool:
        if isinstance(other, (set, frozenset)):
            return self.keys() == other
        return dict.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockSet({list(self)!r})"


class Applied(enum.Enum):
    OK = "ok"  # applied in order
    BUFFERED = "buffered"  # replica is waiting for a snapshot; kept for replay
    NEED_RESYNC = "need_resync"  # gap or restart mid-stream: fetch a snapshot
    STALE = "stale"  # a snapshot older than events applied while it was fetched: ignored


@dataclass
class ReplicaKV:
    """What one replica's cache holds, as far as its events tell."""

    gpu: BlockSet = field(default_factory=BlockSet)  # block hashes in the primary pool (oldest first)
    cpu: BlockSet = field(default_factory=BlockSet)  # block hashes in the swap tier (oldest first)
    node: BlockSet = field(default_factory=BlockSet)  # block hashes in a node tier (its own entry: node:<NAME>)
    node_name: Optional[str] = None  # the node a replica runs on (its snapshot's `node`), None: not said
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
    node_blocks: int = 0  # blocks of the prefix found only in a node tier (a node tier's own entry)

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks + self.node_blocks


NO_MATCH = PrefixMatch(0, 0)


class KVIndex:
    """hash → {replica: tier bits} plus per-replica sets, so a purge costs the replica's size only."""

    def __init__(self, max_blocks_per_replica: Optional[int] = None) -> None:
        if max_blocks_per_replica is not None and max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be >= 1 (or None: unbounded)")
        self._where: dict[bytes, dict[str, int]] = {}
        self.replicas: dict[str, ReplicaKV] = {}
        self.max_blocks_per_replica = max_blocks_per_replica
        self.evicted = 0  # entries forgotten for the cap (warmfleet_router_index_evicted_blocks_total)

    # --- membership -----------------------------------------------------------------------
    def state(self, replica: str) -> ReplicaKV:
        st = self.replicas.get(replica)
        if st is None:
            st = self.replicas[replica] = ReplicaKV()
        return st

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
    def apply_batch(self, replica: str, batch: EventBatch, self_syncing: bool = False) -> Applied:
        """`self_syncing` (node tiers): a batch out of order that begins with AllBlocksCleared is the whole state."""
        st = self.state(replica)
        if st.synced and batch.seq == st.seq + 1:
            self._apply_events(replica, st, batch)
            return Applied.OK
        if self_syncing and batch.events and isinstance(batch.events[0], AllBlocksCleared):
            st.pending.clear()
            st.encoder.clear()
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
        st.node_name = snap.node
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
        return st.cpu if medium == CPU else st.node if medium == NODE else st.gpu

    def _add(self, replica: str, st: ReplicaKV, hashes: Iterable[bytes], medium: str) -> None:
        bit, tier = _TIER_BITS.get(medium, 1), self._tier_set(st, medium)
        capped = self.max_blocks_per_replica is not None
        for h in hashes:
            h = bytes(h)
            if capped and h in tier:
                tier.refresh(h)
            else:
                tier.add(h)
            owners = self._where.setdefault(h, {})
            owners[replica] = owners.get(replica, 0) | bit
        if capped:
            self._enforce_cap(replica, st)

    def _enforce_cap(self, replica: str, st: ReplicaKV) -> None:
        """Forget the replica's least recently used entries beyond the cap, CPU tier first."""
        over = len(st.gpu) + len(st.cpu) - self.max_blocks_per_replica  # type: ignore[operator]
        if over <= 0:
            return
        for tier, medium in ((st.cpu, CPU), (st.gpu, GPU)):
            if over <= 0:
                break
            victims = list(itertools.islice(tier, over))
            self._discard(replica, st, victims, medium)
            over -= len(victims)
            self.evicted += len(victims)

    def touch(self, replica: str, hashes: Iterable[bytes]) -> None:
        """The router sent `replica` a request over these blocks: they are its most recently used (cap only)."""
        if self.max_blocks_per_replica is None:
            return
        st = self.replicas.get(replica)
        if st is None:
            return
        for h in hashes:
            if h in st.gpu:
                st.gpu.refresh(h)
            elif h in st.cpu:
                st.cpu.refresh(h)

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
        self._discard(replica, st, list(st.node), NODE)

    def add_blocks(self, replica: str, hashes: Iterable[bytes], medium: str = GPU) -> None:
        """Record blocks as held without an event (a predicted index for engines that publish none)."""
        self._add(replica, self.state(replica), hashes, medium)

    def remove_blocks(self, replica: str, hashes: Iterable[bytes], medium: str = GPU) -> None:
        self._discard(replica, self.state(replica), hashes, medium)

    # --- queries --------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes], replicas: Iterable[str]) -> dict[str, PrefixMatch]:
        """Longest cached prefix of `hashes` on each replica, split by tier (a block in both tiers counts GPU).

        Work per block is over the replicas still holding the prefix (a block's owners), not over
        the fleet: replicas that hold nothing share one NO_MATCH (0.47 ms -> a few us per lookup at
        128 replicas; docs/scale.md).
        """
        replicas = list(replicas)
        counts: dict[str, list[int]] = {}
        alive: list[str] = []
        run_owners: Optional[dict] = None  # owners of the current run of blocks held alike (a shared prefix: all)
        run = 0
        for h in hashes:
            owners = self._where.get(h)
            if not owners:
                break
            if owners == run_owners:  # the same replicas in the same tiers: one more block for each
                run += 1
                continue
            if run_owners is None:
                wanted = set(replicas)
                alive = [r for r in owners if r in wanted]
                for r in alive:
                    counts[r] = [0, 0, 0]
            else:
                _credit(counts, alive, run_owners, run)
                alive = [r for r in alive if r in owners]
            run_owners, run = owners, 1
            if not alive:
                break
        if run_owners is not None and alive:
            _credit(counts, alive, run_owners, run)
        return {r: (PrefixMatch(*counts[r]) if r in counts else NO_MATCH) for r in replicas}

    def node_run(self, hashes: Sequence[bytes], start: int, node: str) -> int:
        """Blocks of `hashes` from `start` on that index entry `node` (a node tier) holds without a gap: what an
        engine whose own prefix ends at `start` loads from its node's tier."""
        n = 0
        for h in hashes[start:]:
            owners = self._where.get(h)
            if not owners or node not in owners:
                break
            n += 1
        return n

    def encoder_hits(self, replica: str, mm_hashes: Iterable[str]) -> set:
        st = self.replicas.get(replica)
        return set() if st is None else st.encoder.intersection(mm_hashes)

    def num_blocks(self) -> int:
        """Distinct block hashes known anywhere in the fleet."""
        return len(self._where)


def _credit(counts: dict[str, list[int]], alive: list[str], owners: dict, run: int) -> None:
    """`run` blocks held by `owners` to each replica still `alive`: GPU where its bits have the GPU tier, else CPU
    where they have the swap tier, else NODE."""
    for r in alive:
        bits = owners[r]
        counts[r][0 if bits & 1 else 1 if bits & 2 else 2] += run
