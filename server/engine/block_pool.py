"""BlockPool: physical KV blocks of both tiers, ref counts, hash maps, LRU free lists and KV events.

Mechanism only; which blocks a request gets is decided by KVCacheManager. No paddle: the
pool records the copies a step must perform (`SwapPlan`); the model runner has the attention
backend execute them (its `copy_blocks`), since the backend owns the cache layout.

Tiers:
  primary ("GPU")  every block a running request uses lives here; free blocks that still hold
                   a full, hashed block stay findable until they are reused (LRU order).
  swap ("CPU")     a hashed block evicted from the primary pool is copied here instead of
                   vanishing; a later prefix hit is copied back before prefill. Own LRU.
  node ("NODE")    with `node_tier` on (it replaces the swap tier): a block computed and hashed here
                   (`held`: still here), and again one evicted from the primary pool (released there,
                   its bytes sent only if the tier lost it), is read
                   out at the start of the next step (`SwapPlan.node_out`, before that step's
                   forward can overwrite it) and handed to the node tier; blocks the node tier served are written into fresh
                   primary blocks before prefill (`node_in`, the bytes already in hand). The node
                   tier publishes its own events; the pool publishes only the primary pool's.

A hash lives in at most one tier at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from ..events import CPU, GPU, BlockRemoved, BlockStored, KVEvent
from ..hashing import BlockHash


@dataclass
class SwapPlan:
    """Copies the runner performs at the start of a step, swap-outs first, then swap-ins."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block id, cpu block id)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block id, gpu block id)
    # (gpu block id, hash, adapter, held: True written through and still here, False evicted from here)
    node_out: list[tuple[int, bytes, Optional[str], bool]] = field(default_factory=list)
    node_in: list[tuple[int, bytes]] = field(default_factory=list)  # (gpu block id, the node tier's block bytes)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.node_out or self.node_in)


@dataclass
class PoolCounters:
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    evicted_gpu_blocks: int = 0
    evicted_cpu_blocks: int = 0
    node_out_blocks: int = 0  # blocks handed to the node tier (computed here, or evicted from the primary pool)
    node_in_blocks: int = 0  # blocks loaded from the node tier


class CpuTier:
    """Host-memory tier: hash → cpu block id with its own LRU; evicts silently to make room."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[BlockHash, int] = OrderedDict()  # first = least recently used
        self.released_after_step: list[int] = []  # ids whose content is still a swap-in source this step

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.lru

    @property
    def num_used(self) -> int:
        return len(self.lru)


class BlockPool:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int = 0, enable_caching: bool = True,
                 block_size: int = 64, node_tier: bool = False):
        if num_gpu_blocks < 1:
            raise ValueError("the primary KV pool needs at least one block")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[Optional[BlockHash]] = [None] * num_gpu_blocks
        # Free blocks in eviction order: first is evicted first. Hashed free blocks stay in `cached`.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_gpu_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.lora_of: dict[BlockHash, str] = {}  # adapter name of hashed blocks (either tier) of adapter chains
        self.node_tier = node_tier and enable_caching  # evictions go to the node tier (then there is no swap tier)
        self.cpu = CpuTier(num_cpu_blocks) if (num_cpu_blocks > 0 and enable_caching and not self.node_tier) else None
        self.plan = SwapPlan()
        self.counters = PoolCounters()
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def lookup(self, h: BlockHash) -> Optional[str]:
        """Tier holding `h` (GPU or CPU), or None."""
        if h in self.cached:
            return GPU
        if self.cpu is not None and h in self.cpu:
            return CPU
        return None

    def usage(self) -> float:
        """Fraction of primary blocks held by running requests."""
        return 1.0 - len(self.free) / self.num_gpu_blocks

    # ---- primary pool ----------------------------------------------------------------------
    def take_cached(self, h: BlockHash) -> int:
        """Reference the primary block holding `h` (removing it from the free list if idle)."""
        bid = self.cached[h]
        if self.ref_cnt[bid] == 0:
            del self.free[bid]
        self.ref_cnt[bid] += 1
        return bid

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (LRU first); evicted hashed blocks move to the swap tier if any."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free; check can_allocate first")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            self._evict_gpu(bid)
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def swap_in(self, hashes: list[BlockHash]) -> list[int]:
        """Bring `hashes` from the swap tier into fresh primary blocks (referenced once each).

        All entries leave the CPU LRU before any primary block is allocated, so evictions made
        to make room cannot push out a block of this same batch.
        """
        assert self.cpu is not None
        cpu_ids = [self.cpu.lru.pop(h) for h in hashes]
        self.cpu.released_after_step.extend(cpu_ids)
        bids = self.allocate(len(hashes))
        for h, cpu_id, bid in zip(hashes, cpu_ids, bids):
            self.plan.swap_in.append((cpu_id, bid))
            self.counters.swap_in_blocks += 1
            self._events.append(BlockRemoved([h], CPU))
            self._register(bid, h, parent=None, token_ids=[], lora_name=self.lora_of.get(h))
        return bids

    def load_from_node(self, hashes: list[BlockHash], data: list[bytes], lora_name: Optional[str]) -> list[int]:
        """Fresh primary blocks (referenced once each) for blocks the node tier served; their bytes are written
        at the start of the step (`plan.node_in`), before the forward reads them."""
        bids = self.allocate(len(hashes))
        for h, d, bid in zip(hashes, data, bids):
            self.plan.node_in.append((bid, d))
            self.counters.node_in_blocks += 1
            self._register(bid, h, parent=None, token_ids=[], lora_name=lora_name)
        return bids

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Pass a request's table in reverse so tails go first.

        Hashed blocks join the end of the free list (evicted last, still findable); blocks with
        no hash hold nothing reusable and go to the front.
        """
        for bid in block_ids:
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] < 0:
                raise RuntimeError(f"block {bid} freed more often than referenced")
            if self.ref_cnt[bid] == 0:
                self.free[bid] = None
                if self.block_hash[bid] is None:
                    self.free.move_to_end(bid, last=False)

    def cache_block(self, bid: int, h: BlockHash, parent: Optional[BlockHash], token_ids: list[int],
                    lora_name: Optional[str] = None) -> int:
        """Record that full block `bid` now holds `h` (of adapter `lora_name`'s chain, None: the base model).
        Returns the block the request should keep: `bid`, or an identical block already cached (then `bid`
        is released and the caller swaps ids)."""
        if not self.enable_caching or self.block_hash[bid] == h:
            return bid
        existing = self.cached.get(h)
        if existing is not None and existing != bid:
            # Another request computed the same block first; share it and give ours back.
            self.take_cached(h)
            self.free_blocks([bid])
            return existing
        if self.cpu is not None and h in self.cpu:
            self._drop_cpu(h)
        self._register(bid, h, parent, token_ids, lora_name)
        if self.node_tier:  # written through at once, so the node's other replicas can use it while it is hot here
            self.plan.node_out.append((bid, h, lora_name, True))
            self.counters.node_out_blocks += 1
        return bid

    # ---- internals -------------------------------------------------------------------------
    def _register(self, bid: int, h: BlockHash, parent: Optional[BlockHash], token_ids: list[int],
                  lora_name: Optional[str] = None) -> None:
        self.block_hash[bid] = h
        self.cached[h] = bid
        if lora_name is not None:
            self.lora_of[h] = lora_name
        self._events.append(BlockStored([h], parent, list(token_ids), self.block_size, GPU, lora_name=lora_name))

    def _evict_gpu(self, bid: int) -> None:
        h = self.block_hash[bid]
        if h is None:
            return
        self.block_hash[bid] = None
        del self.cached[h]
        self.counters.evicted_gpu_blocks += 1
        self._events.append(BlockRemoved([h], GPU))
        if self.cpu is not None:
            cpu_id = self._allocate_cpu()
            if cpu_id is not None:
                self.cpu.lru[h] = cpu_id
                self.plan.swap_out.append((bid, cpu_id))
                self.counters.swap_out_blocks += 1
                self._events.append(BlockStored([h], None, [], self.block_size, CPU, lora_name=self.lora_of.get(h)))
                return
        elif self.node_tier:
            self.plan.node_out.append((bid, h, self.lora_of.get(h), False))
            self.counters.node_out_blocks += 1
        self.lora_of.pop(h, None)

    def _allocate_cpu(self) -> Optional[int]:
        cpu = self.cpu
        assert cpu is not None
        if cpu.free_ids:
            return cpu.free_ids.pop()
        if not cpu.lru:
            return None  # every slot is a swap-in source this step
        h, cpu_id = cpu.lru.popitem(last=False)
        self.lora_of.pop(h, None)
        self.counters.evicted_cpu_blocks += 1
        self._events.append(BlockRemoved([h], CPU))
        return cpu_id

    def _drop_cpu(self, h: BlockHash) -> None:
        assert self.cpu is not None
        self.cpu.free_ids.append(self.cpu.lru.pop(h))
        self._events.append(BlockRemoved([h], CPU))


    def take_plan(self) -> SwapPlan:
        """Drain the copies scheduled since the last call; swap-in sources become reusable after it."""
        plan, self.plan = self.plan, SwapPlan()
        if self.cpu is not None:
            self.cpu.free_ids.extend(self.cpu.released_after_step)
            self.cpu.released_after_step.clear()
        return plan

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events produced since the last call."""
        ev, self._events = self._events, []
        return ev


    def snapshot(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Hashes held per tier (GPU, CPU)."""
        return list(self.cached), list(self.cpu.lru) if self.cpu is not None else []
