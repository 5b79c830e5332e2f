"""The simulator's node tier: one host-memory LRU of KV blocks per node, shared by the replicas on that node.

With `--node-tier-blocks M`, replicas are grouped K per node (`--replicas-per-node K`) and each node has one
`NodeTier` of M blocks, keyed by the replicas' own block hashes (contract 1: model, adapter and salt in the
chain's root, so only what a replica on the node could hit itself is ever shared). A replica's pool is then a
`NodePool`: the engine's `BlockPool` with no swap tier of its own, whose host tier is the node's:

* a block the replica computes is written through to the node tier as soon as it is full (a swap-out, priced by
  the time model's `swap_s_per_block` in the replica's next step, when the engine reads it out), as the engine does (`BlockPool.cache_block`), so the node's other
  replicas can load a prefix while it is still hot on the replica that computed it; with `exclusive` (below) it
  is not (a block lives in one place on the node);
* a hashed block evicted from the replica's primary pool is copied to the node tier (priced the same), unless the
  node tier holds it already (then it is only refreshed: touch-or-put; the engine sends it again, off the step);
* `victims_first` (`--node-tier-victims-first`, not in the engine's tier yet): when full, the tier evicts first the
  blocks some replica of the node still holds in its primary pool (least recent first), so write-through copies
  use spare room and never push out a block held nowhere else on the node;
* a prefix lookup that misses the primary pool goes on in the node tier (the KV cache manager's host tier), and
  the blocks found there are copied into fresh primary blocks before prefill (swap-ins, priced the same), while
  the node tier keeps them for the other replicas.

The engine's KV cache manager and scheduler are unchanged: they see a host tier and the copies it costs. The
replica's KV events stay those of its primary pool (the node tier's content is not the replica's own); the node
tier publishes its own, as `warmfleet node-tier` does (contract 2: topic node:<id>, medium NODE, its own sequence
numbers, its whole state led by AllBlocksCleared to every new subscription), when `publish_to` gave it a socket.
Replicas name their node in their snapshot, so a router with `--node-tier-events` scores what the node holds.
Imports only the engine's block pool (no HTTP, no asyncio).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from warmfleet.server.engine.block_pool import BlockPool
from warmfleet.server.events import (
    CPU, GPU, NODE, NODE_TOPIC_PREFIX, AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher,
)
from warmfleet.server.hashing import BlockHash

NO_HOST_BLOCK = -1  # the host side of a node-tier copy in a SwapPlan (the simulator executes no copies)


class NodeTier:
    """One node's shared host-memory cache: block hash -> None, least recently used first, never over capacity."""

    def __init__(self, node_id: str, capacity: int):
        if capacity < 1:
            raise ValueError(f"node tier {node_id}: capacity must be at least one block, got {capacity}")
        self.node_id, self.capacity = node_id, capacity
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.stored_blocks = 0  # copies in (a block no replica of the node had put there yet)
        self.refreshed_blocks = 0  # evictions of a block the tier held already: no copy
        self.evicted_blocks = 0
        self.hit_blocks = 0  # copies out to a replica's primary pool
        self.hit_blocks_by_replica: dict[str, int] = {}
        self.exclusive = False  # a hit moves the block to the replica (--node-tier-exclusive), else copies it
        # --node-tier-victims-first: a full tier evicts first the entries some replica of the node also holds in its
        # primary pool (written through, or copied out), least recent first; entries held nowhere else go last
        self.victims_first = False
        self.holders: dict[BlockHash, int] = {}  # replicas of the node holding it in their primary pool (victims_first)
        self.dup: OrderedDict[BlockHash, None] = OrderedDict()  # entries with holders, least recent first
        self.block_size = 16
        self.publisher: Optional[EventPublisher] = None
        self.events_endpoint: Optional[str] = None
        self._stored: list[BlockHash] = []  # since the last publish
        self._removed: list[BlockHash] = []

    def publish_to(self, endpoint: str, block_size: int) -> None:
        """Publish this tier's KV events on `endpoint` (bound now); the first batch says it starts empty."""
        self.block_size, self.events_endpoint = block_size, endpoint
        self.publisher = EventPublisher(NODE_TOPIC_PREFIX + self.node_id, endpoint, verbose=True)
        self.publisher.publish([AllBlocksCleared()])

    def publish(self) -> None:
        """The stores and evictions since the last call, as one batch; the whole state to new subscribers."""
        if self.publisher is None:
            return
        events = []
        if self._stored:
            events.append(BlockStored(self._stored, None, [], self.block_size, NODE))
        if self._removed:
            events.append(BlockRemoved(self._removed, NODE))
        self._stored, self._removed = [], []
        self.publisher.publish(events)
        if self.publisher.take_new_subscriptions():
            state = [AllBlocksCleared()] + ([BlockStored(list(self.lru), None, [], self.block_size, NODE)]
                                            if self.lru else [])
            self.publisher.publish(state)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def store(self, h: BlockHash) -> bool:
        """Put `h` in as the most recent entry, evicting the least recent past capacity; True if it was copied in."""
        if h in self.lru:
            self.lru.move_to_end(h)
            if h in self.dup:
                self.dup.move_to_end(h)
            self.refreshed_blocks += 1
            return False
        self.lru[h] = None
        if self.holders.get(h):
            self.dup[h] = None
        self.stored_blocks += 1
        if self.publisher is not None:
            self._stored.append(h)
        while len(self.lru) > self.capacity:
            if self.dup:  # victims_first: a block a replica still holds goes before one held nowhere else
                gone, _ = self.dup.popitem(last=False)
                del self.lru[gone]
            else:
                gone, _ = self.lru.popitem(last=False)
            self.evicted_blocks += 1
            if self.publisher is not None:
                self._removed.append(gone)
        return True

    def hit(self, h: BlockHash, replica: str) -> None:
        """Replica `replica` copies `h` out: it becomes the most recent entry (the tier keeps it), or with
        `exclusive` it leaves the tier (the replica's primary pool holds it now; its eviction brings it back)."""
        if h in self.lru:
            if self.exclusive:
                del self.lru[h]
                self.dup.pop(h, None)
                if self.publisher is not None:
                    self._removed.append(h)
            else:
                self.lru.move_to_end(h)
        self.hit_blocks += 1
        self.hit_blocks_by_replica[replica] = self.hit_blocks_by_replica.get(replica, 0) + 1

    def hold(self, h: BlockHash) -> None:
        """A replica of the node now holds `h` in its primary pool (counted only with victims_first)."""
        if self.victims_first:
            self.holders[h] = self.holders.get(h, 0) + 1
            if h in self.lru:
                self.dup[h] = None
                self.dup.move_to_end(h)

    def release(self, h: BlockHash) -> None:
        """A replica of the node evicted `h` from its primary pool."""
        if self.victims_first and h in self.holders:
            self.holders[h] -= 1
            if self.holders[h] <= 0:
                del self.holders[h]
                self.dup.pop(h, None)

    def stats(self, block_size: int, replicas: list[str]) -> dict:
        return {"id": self.node_id, "replicas": replicas, "capacity_blocks": self.capacity,
                "used_blocks": len(self.lru), "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_blocks * block_size,
                "stored_blocks": self.stored_blocks, "refreshed_blocks": self.refreshed_blocks,
                "evicted_blocks": self.evicted_blocks}


class NodePool(BlockPool):
    """A replica's block pool whose host tier is its node's `NodeTier` (it has no swap tier of its own)."""

    def __init__(self, rid: str, num_gpu_blocks: int, node: NodeTier, block_size: int):
        super().__init__(num_gpu_blocks, 0, True, block_size)
        self.rid, self.node = rid, node
        self.node_hit_blocks = 0
        self.node_stored_blocks = 0

    def lookup(self, h: BlockHash) -> Optional[str]:
        """GPU if the primary pool holds `h`, CPU (the manager's host tier, copied in before prefill) if the node does."""
        if h in self.cached:
            return GPU
        return CPU if h in self.node else None

    def swap_in(self, hashes: list[BlockHash]) -> list[int]:
        """Copy `hashes` from the node tier into fresh primary blocks (one reference each); the node keeps them.

        They become the node's most recent entries first, so the evictions made to find room (which go to the
        node tier) cannot push out a block of this same batch."""
        for h in hashes:
            self.node.hit(h, self.rid)
        bids = self.allocate(len(hashes))
        for h, bid in zip(hashes, bids):
            self.plan.swap_in.append((NO_HOST_BLOCK, bid))
            self.counters.swap_in_blocks += 1
            self.node_hit_blocks += 1
            self._register(bid, h, parent=None, token_ids=[])
            self.node.hold(h)
        return bids

    def cache_block(self, bid: int, h: BlockHash, parent: Optional[BlockHash], token_ids: list[int],
                    lora_name: Optional[str] = None) -> int:
        """The engine's `cache_block`, then (inclusive tier) the block written through to the node tier."""
        fresh = self.enable_caching and self.block_hash[bid] != h and h not in self.cached
        kept = super().cache_block(bid, h, parent, token_ids, lora_name)
        if fresh:
            self.node.hold(h)
            if not self.node.exclusive:
                self._copy_out(kept, h)
        return kept

    def _evict_gpu(self, bid: int) -> None:
        h = self.block_hash[bid]
        super()._evict_gpu(bid)
        if h is not None:
            self.node.release(h)
            self._copy_out(bid, h)

    def _copy_out(self, bid: int, h: BlockHash) -> None:
        """`h` to the node tier: one priced copy unless the tier holds it already (then only refreshed)."""
        if self.node.store(h):
            self.plan.swap_out.append((bid, NO_HOST_BLOCK))
            self.counters.swap_out_blocks += 1
            self.node_stored_blocks += 1


def nodes_for(num_slots: int, per_node: int, blocks: int, exclusive: bool = False,
              victims_first: bool = False) -> list[NodeTier]:
    """One node tier of `blocks` for every `per_node` replica slots (none when `blocks` is 0); `exclusive`: a hit
    moves the block into the replica's primary pool (its eviction brings it back), else the tier keeps a copy;
    `victims_first`: a full tier evicts blocks some replica still holds before those held nowhere else."""
    if blocks <= 0:
        return []
    if per_node < 1:
        raise ValueError(f"replicas per node must be at least 1, got {per_node}")
    tiers = [NodeTier(f"n{j}", blocks) for j in range(-(-num_slots // per_node))]
    for t in tiers:
        t.exclusive, t.victims_first = exclusive, victims_first
    return tiers
