"""KVCacheManager: per-request policy over the BlockPool (prefix lookup, slot allocation, freeing).

    prompt:  |blk0|blk1|blk2|blk3|blk4|..
    cached:  |GPU |GPU |CPU |NODE|miss     -> blocks 0-1 referenced, block 2 swapped in, block 3 loaded
                                              from the node tier, prefill from 4*B

The node tier (`node`, a nodetier.client.NodeTierClient) is asked once the local tiers miss, for the longest
run of the remaining blocks it holds; its bytes come back whole (checksummed) before the request is admitted,
so a failure there is a shorter hit, never a block the step would read unwritten.

The hit is capped at (num_tokens - 1) tokens: the last prompt token is always recomputed
because its logits are needed to sample the first output token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Optional

from ..events import CPU, GPU, NODE
from ..hashing import BlockHash, block_hashes
from .block_pool import BlockPool
from .request import Request


@dataclass
class PrefixHit:
    hashes: list[BlockHash]  # hashes of the hit blocks, in order
    tiers: list[str]  # GPU, CPU or NODE per hit block
    node_data: list[bytes] = field(default_factory=list)  # the node tier's bytes of the NODE blocks, in order

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def num_cpu_blocks(self) -> int:
        return sum(t == CPU for t in self.tiers)

    @property
    def num_node_blocks(self) -> int:
        return len(self.node_data)


NO_HIT = PrefixHit([], [])


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_fingerprint: str, hash_algo: str = "blake3",
                 node=None, node_layout: str = ""):
        self.pool = pool
        self.node = node  # NodeTierClient, or None: no node tier
        self.node_layout = node_layout  # attention.interface.wire_layout of this engine's blocks
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.hash_algo = hash_algo
        # cumulative prefix-cache counters (tokens)
        self.num_query_tokens = 0
        self.num_hit_tokens_gpu = 0
        self.num_hit_tokens_cpu = 0
        self.num_hit_tokens_node = 0

    # ---- hashing --------------------------------------------------------------------------
    def update_block_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` to cover every full block of its current tokens."""
        n_have = len(req.block_hashes)
        if req.num_tokens // self.block_size <= n_have:
            return
        req.block_hashes.extend(block_hashes(
            req.all_token_ids, req.mm_placeholders, self.block_size, self.model_fingerprint, req.cache_salt,
            self.hash_algo, start_block=n_have, parent=req.block_hashes[-1] if n_have else None, adapter=req.adapter))

    # ---- admission ------------------------------------------------------------------------
    def find_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached blocks at the start of the request (either tier)."""
        if not self.pool.enable_caching:
            return NO_HIT
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = PrefixHit([], [])
        for h in req.block_hashes[:max_blocks]:
            tier = self.pool.lookup(h)
            if tier is None:
                break
            hit.hashes.append(h)
            hit.tiers.append(tier)
        if self.node is not None and hit.num_blocks < max_blocks:
            self._node_prefix(req, hit, max_blocks)
        return hit

    def _node_prefix(self, req: Request, hit: PrefixHit, max_blocks: int) -> None:
        """Extend `hit` with the run of following blocks the node tier holds (fetched once per start block: a
        request that waits for room is not fetched again every step)."""
        start = hit.num_blocks
        memo = req.node_prefetch
        if memo is None or memo[0] != start or len(memo[1]) > max_blocks - start:
            memo = req.node_prefetch = (start, self.node.get("kv", req.block_hashes[start:max_blocks],
                                                             self.node_layout))
        for h, data in zip(req.block_hashes[start:max_blocks], memo[1]):
            hit.hashes.append(h)
            hit.tiers.append(NODE)
            hit.node_data.append(data)

    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Whether `allocate` would succeed without evicting a block this request itself needs."""
        need_total = self.blocks_for(req.num_computed_tokens + hit.num_blocks * self.block_size + num_new_tokens)
        have = len(req.block_ids)
        new_blocks = max(0, need_total - have - hit.num_blocks) + hit.num_cpu_blocks + hit.num_node_blocks
        # GPU hits that sit idle in the free list stop being free once referenced.
        idle_hits = sum(1 for h, t in zip(hit.hashes, hit.tiers)
                        if t == GPU and self.pool.ref_cnt[self.pool.cached[h]] == 0)
        return new_blocks <= self.pool.num_free_blocks - idle_hits

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Reference hit blocks (swapping in CPU ones) and add blocks for `num_new_tokens`; False if no room."""
        if not self.can_allocate(req, num_new_tokens, hit):
            return False
        if hit.num_blocks:
            # GPU hits first, so evictions made for swap-ins cannot take a block we are about to use.
            ids = [self.pool.take_cached(h) if t == GPU else None for h, t in zip(hit.hashes, hit.tiers)]
            cpu_idx = [i for i, t in enumerate(hit.tiers) if t == CPU]
            for i, bid in zip(cpu_idx, self.pool.swap_in([hit.hashes[i] for i in cpu_idx]) if cpu_idx else []):
                ids[i] = bid
            if hit.node_data:  # the NODE blocks are the hit's tail
                first = hit.num_blocks - hit.num_node_blocks
                ids[first:] = self.pool.load_from_node(hit.hashes[first:], hit.node_data,
                                                       req.adapter.name if req.adapter is not None else None)
                req.node_prefetch = None
            req.block_ids.extend(ids)  # type: ignore[arg-type]
            req.num_computed_tokens += hit.num_blocks * self.block_size
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def record_admission(self, req: Request, hit: PrefixHit) -> None:
        """Count a first admission in the prefix-cache metrics and on the request."""
        cpu_tokens = hit.num_cpu_blocks * self.block_size
        node_tokens = hit.num_node_blocks * self.block_size
        req.num_cached_tokens = hit.num_blocks * self.block_size
        req.num_cached_tokens_cpu = cpu_tokens
        self.num_query_tokens += req.num_tokens
        self.num_hit_tokens_gpu += req.num_cached_tokens - cpu_tokens - node_tokens
        self.num_hit_tokens_cpu += cpu_tokens
        self.num_hit_tokens_node += node_tokens

    # ---- after a step ---------------------------------------------------------------------
    def cache_computed_blocks(self, req: Request) -> None:
        """Register every full block whose KV is now computed, so later requests can hit it.

        Incremental: only blocks past `req.num_registered_blocks` are looked at. A block the request
        holds stays registered under its hash (a referenced block is never evicted), so the ones
        before are done; `free` resets the count when the request gives its blocks back.
        """
        if not self.pool.enable_caching:
            return
        self.update_block_hashes(req)
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(req.num_registered_blocks, n_full):
            h = req.block_hashes[i]
            bid = req.block_ids[i]
            if self.pool.block_hash[bid] == h:
                continue
            parent = req.block_hashes[i - 1] if i else None
            s = i * self.block_size
            req.block_ids[i] = self.pool.cache_block(bid, h, parent, req.token_ids(s, s + self.block_size),
                                                     req.adapter.name if req.adapter is not None else None)
        req.num_registered_blocks = max(req.num_registered_blocks, n_full)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so shared heads outlive their tails."""
        self.pool.free_blocks(list(reversed(req.block_ids)))
        req.block_ids.clear()
        req.num_registered_blocks = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return self.pool.usage()
