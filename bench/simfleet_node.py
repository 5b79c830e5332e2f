"""The simulator's node tier: the product's NodeStore per node, shared by the replicas on that node.

With `--node-tier-blocks M`, replicas are grouped K per node (`--replicas-per-node K`) and each node has one
`NodeTier` of M blocks: `warmfleet node-tier`'s own `NodeStore` (server/nodetier/store.py) with empty payloads, so
the simulator measures the product's eviction, keyed by the replicas' own block hashes (contract 1: model, adapter
and salt in the chain's root, so only what a replica on the node could hit itself is ever shared). A replica's pool
is then a `NodePool`: the engine's `BlockPool` with no swap tier of its own, whose host tier is the node's, used as
the engine's node-tier client uses it:

* a block the replica computes is written through to the node tier as soon as it is full, as a claim (the
  replica still holds it), priced by the time model's `swap_s_per_block` in the replica's next step, when the
  engine reads it out (`BlockPool.cache_block`), so the node's other replicas can load a prefix while it is
  still hot on the replica that computed it;
* a hashed block evicted from the replica's primary pool is released there if the tier still holds it (no copy:
  touch-or-put), else copied in (priced the same);
* a full tier evicts first what some replica of the node still holds (victims first), so write-through copies use
  spare room and never push out a block held nowhere else on the node; `--node-tier-lru` names no holders, which
  makes it a plain LRU (the tier before claims), to compare;
* a prefix lookup that misses the primary pool goes on in the node tier (the KV cache manager's host tier), and
  the blocks found there are copied into fresh primary blocks before prefill (swap-ins, priced the same, claims),
  while the node tier keeps them for the other replicas.

The engine's KV cache manager and scheduler are unchanged: they see a host tier and the copies it costs. The
replica's KV events stay those of its primary pool (the node tier's content is not the replica's own); the node
tier publishes its own, as `warmfleet node-tier` does (contract 2: topic node:<id>, medium NODE, its own sequence
numbers, its whole state led by AllBlocksCleared to every new subscription), when `publish_to` gave it a socket.
Replicas name their node in their snapshot, so a router with `--node-tier-events` scores what the node holds.
Imports only the engine's block pool and the node tier's store (no HTTP, no asyncio).
"""

from __future__ import annotations

from typing import Optional

from warmfleet.server.engine.block_pool import BlockPool
from warmfleet.server.events import CPU, GPU, NODE_TOPIC_PREFIX, AllBlocksCleared, EventPublisher
from warmfleet.server.hashing import BlockHash
from warmfleet.server.nodetier.store import ENTRY_OVERHEAD, NodeStore
from warmfleet.server.nodetier.wire import KV, checksum

EMPTY_SUM = checksum(b"")  # the simulator stores no bytes

NO_HOST_BLOCK = -1  # the host side of a node-tier copy in a SwapPlan (the simulator executes no copies)


class NodeTier:
    """One node's shared host-memory cache: the product's `NodeStore` (same eviction, same claims), one block a unit."""

    def __init__(self, node_id: str, capacity: int, lru: bool = False):
        if capacity < 1:
            raise ValueError(f"node tier {node_id}: capacity must be at least one block, got {capacity}")
        self.node_id, self.capacity = node_id, capacity
        self.lru = lru  # --node-tier-lru: replicas name no holder, so the store is a plain LRU (the tier before claims)
        self.store = NodeStore(capacity * ENTRY_OVERHEAD)  # an empty payload: every entry costs one unit
        self.stored_blocks = 0  # copies in (the tier did not hold the block)
        self.released_blocks = 0  # evictions of a block the tier held already: no copy
        self.hit_blocks = 0  # copies out to a replica's primary pool
        self.hit_blocks_by_replica: dict[str, int] = {}
        self.block_size = 16
        self.publisher: Optional[EventPublisher] = None
        self.events_endpoint: Optional[str] = None

    @property
    def evicted_blocks(self) -> int:
        return self.store.counters.evicted

    def publish_to(self, endpoint: str, block_size: int) -> None:
        """Publish this tier's KV events on `endpoint` (bound now); the first batch says it starts empty."""
        self.block_size = self.store.block_size = block_size
        self.events_endpoint = endpoint
        self.publisher = EventPublisher(NODE_TOPIC_PREFIX + self.node_id, endpoint, verbose=True)
        self.publisher.publish([AllBlocksCleared()])

    def publish(self) -> None:
        """The stores and evictions since the last call, as one batch; the whole state to new subscribers."""
        events = self.store.take_events()
        if self.publisher is None:
            return
        if events:
            self.publisher.publish(events)
        if self.publisher.take_new_subscriptions():
            self.publisher.publish(self.store.state_events())

    def __contains__(self, h: BlockHash) -> bool:
        return (KV, h) in self.store

    def __len__(self) -> int:
        return len(self.store)

    def _holder(self, rid: str) -> Optional[str]:
        return None if self.lru else rid

    def put(self, h: BlockHash, rid: str, held: bool) -> bool:
        """Replica `rid` hands `h` over (`held`: written through, it keeps it; else evicted); True if it was copied
        in: a block the tier holds is only claimed or released, as the engine's client does (touch-or-put)."""
        if h in self:
            if held:
                self.store.put(KV, h, "", b"", EMPTY_SUM, holder=self._holder(rid), held=True)
            else:
                self.store.release(KV, [h], self._holder(rid))
                self.released_blocks += 1
            return False
        self.store.put(KV, h, "", b"", EMPTY_SUM, holder=self._holder(rid), held=held)
        self.stored_blocks += 1
        return True

    def hit(self, h: BlockHash, rid: str) -> None:
        """Replica `rid` copies `h` out into its primary pool (a claim); the tier keeps it."""
        self.store.get(KV, [h], "", self._holder(rid))
        self.hit_blocks += 1
        self.hit_blocks_by_replica[rid] = self.hit_blocks_by_replica.get(rid, 0) + 1

    def stats(self, block_size: int, replicas: list[str]) -> dict:
        return {"id": self.node_id, "replicas": replicas, "capacity_blocks": self.capacity,
                "used_blocks": len(self), "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_blocks * block_size,
                "stored_blocks": self.stored_blocks, "released_blocks": self.released_blocks,
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
        return bids

    def cache_block(self, bid: int, h: BlockHash, parent: Optional[BlockHash], token_ids: list[int],
                    lora_name: Optional[str] = None) -> int:
        """The engine's `cache_block`, then the block written through to the node tier (still held here)."""
        fresh = self.enable_caching and self.block_hash[bid] != h and h not in self.cached
        kept = super().cache_block(bid, h, parent, token_ids, lora_name)
        if fresh:
            self._copy_out(kept, h, held=True)
        return kept

    def _evict_gpu(self, bid: int) -> None:
        h = self.block_hash[bid]
        super()._evict_gpu(bid)
        if h is not None:
            self._copy_out(bid, h, held=False)

    def _copy_out(self, bid: int, h: BlockHash, held: bool) -> None:
        """`h` to the node tier: one priced copy unless the tier holds it already (then only claimed or released)."""
        if self.node.put(h, self.rid, held):
            self.plan.swap_out.append((bid, NO_HOST_BLOCK))
            self.counters.swap_out_blocks += 1
            self.node_stored_blocks += 1


def nodes_for(num_slots: int, per_node: int, blocks: int, lru: bool = False) -> list[NodeTier]:
    """One node tier of `blocks` for every `per_node` replica slots (none when `blocks` is 0); `lru`: a plain LRU
    (no claims), else the product's victims-first eviction."""
    if blocks <= 0:
        return []
    if per_node < 1:
        raise ValueError(f"replicas per node must be at least 1, got {per_node}")
    return [NodeTier(f"n{j}", blocks, lru) for j in range(-(-num_slots // per_node))]
