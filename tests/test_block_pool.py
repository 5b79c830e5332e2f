"""Block pool and KV cache manager: hash chain reuse, ref counts, LRU eviction order, swap tier."""

from warmfleet.server.engine.block_pool import BlockPool
from warmfleet.server.engine.kv_cache_manager import KVCacheManager
from warmfleet.server.engine.request import Request
from warmfleet.server.engine.sampling_params import SamplingParams
from warmfleet.server.events import CPU, GPU, BlockRemoved, BlockStored

BS = 4


def make(num_gpu, num_cpu=0, caching=True):
    pool = BlockPool(num_gpu, num_cpu, caching, BS)
    return pool, KVCacheManager(pool, BS, "model-x")


def req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def run_prefill(kv, r):
    """Admit a request, pretend its prompt was computed, register its full blocks."""
    kv.update_block_hashes(r)
    hit = kv.find_prefix(r)
    assert kv.allocate(r, r.num_tokens - r.num_computed_tokens - hit.num_blocks * BS, hit)
    kv.record_admission(r, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    return hit


def test_shared_prefix_hits_and_last_token_is_recomputed():
    pool, kv = make(16)
    a = req("a", range(10))  # 2 full blocks + 2 tokens
    run_prefill(kv, a)
    b = req("b", list(range(8)) + [99, 98])
    hit = run_prefill(kv, b)
    assert hit.num_blocks == 2 and b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert pool.ref_cnt[a.block_ids[0]] == 2
    # exactly block-aligned prompt: the last block is not a hit, its last token must be computed
    c = req("c", range(8))
    hit = run_prefill(kv, c)
    assert hit.num_blocks == 1


def test_salt_and_model_isolate_entries():
    pool, kv = make(16)
    run_prefill(kv, req("a", range(9), salt="tenant-1"))
    assert run_prefill(kv, req("b", range(9), salt="tenant-2")).num_blocks == 0
    assert run_prefill(kv, req("c", range(9), salt="tenant-1")).num_blocks == 2
    other = KVCacheManager(pool, BS, "model-y")
    r = req("d", range(9), salt="tenant-1")
    other.update_block_hashes(r)
    assert other.find_prefix(r).num_blocks == 0


def test_free_keeps_blocks_findable_and_evicts_tail_first():
    pool, kv = make(4)
    a = req("a", range(13))  # 4 blocks: 3 full + 1 partial
    run_prefill(kv, a)
    full = a.block_ids[:3]
    kv.free(a)
    assert pool.num_free_blocks == 4 and all(pool.ref_cnt[b] == 0 for b in full)
    # unhashed partial block is reused first, then the tail (block 2) before the head (block 0)
    first_two = pool.allocate(2)
    assert first_two[1] == full[2]
    assert pool.lookup(a.block_hashes[0]) == GPU and pool.lookup(a.block_hashes[2]) is None
    ev = pool.take_events()
    assert any(isinstance(e, BlockRemoved) and e.block_hashes == [a.block_hashes[2]] for e in ev)


def test_evicted_block_moves_to_swap_tier_and_swaps_back():
    pool, kv = make(4, num_cpu=4)
    a = req("a", range(9))  # 2 full blocks + 1 token -> 3 blocks
    run_prefill(kv, a)
    kv.free(a)
    pool.take_plan()
    pool.take_events()
    filler = req("f", range(100, 116))  # needs all 4 blocks -> evicts a's blocks into the CPU tier
    run_prefill(kv, filler)
    plan = pool.take_plan()
    assert len(plan.swap_out) == 2
    assert pool.lookup(a.block_hashes[0]) == CPU and pool.lookup(a.block_hashes[1]) == CPU
    ev = pool.take_events()
    assert any(isinstance(e, BlockStored) and e.medium == CPU for e in ev)
    kv.free(filler)
    b = req("b", list(range(8)) + [7, 7])
    hit = run_prefill(kv, b)
    assert hit.tiers == [CPU, CPU] and b.num_cached_tokens_cpu == 8
    plan = pool.take_plan()
    assert len(plan.swap_in) == 2 and {g for _, g in plan.swap_in} == set(b.block_ids[:2])
    assert pool.lookup(a.block_hashes[0]) == GPU  # a hash lives in one tier at a time
    assert kv.num_hit_tokens_cpu == 8


def test_cpu_tier_lru_evicts_oldest():
    pool, kv = make(2, num_cpu=1)
    a = req("a", range(5))  # 1 full block + 1
    run_prefill(kv, a); kv.free(a)
    b = req("b", range(50, 55))
    run_prefill(kv, b); kv.free(b)  # evicts a's block to CPU
    assert pool.lookup(a.block_hashes[0]) == CPU
    c = req("c", range(80, 85))
    run_prefill(kv, c)  # evicts b's block to CPU; CPU tier has one slot -> a's entry goes
    assert pool.lookup(a.block_hashes[0]) is None and pool.lookup(b.block_hashes[0]) == CPU
    assert pool.counters.evicted_cpu_blocks == 1


def test_caching_disabled_never_hits():
    pool, kv = make(8, caching=False)
    run_prefill(kv, req("a", range(9)))
    assert run_prefill(kv, req("b", range(9))).num_blocks == 0
    assert pool.take_events() == []


def test_can_allocate_counts_idle_hit_blocks():
    pool, kv = make(3)
    a = req("a", range(9))  # 3 blocks
    run_prefill(kv, a); kv.free(a)
    b = req("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits 2 idle blocks, needs 2 more: 4 > 3
    kv.update_block_hashes(b)
    hit = kv.find_prefix(b)
    assert hit.num_blocks == 2
    assert not kv.can_allocate(b, b.num_tokens - 8, hit)
    assert kv.can_allocate(b, 4, hit)  # one more block fits


def test_double_free_is_an_error():
    pool, kv = make(2)
    (b,) = pool.allocate(1)
    pool.free_blocks([b])
    try:
        pool.free_blocks([b])
    except RuntimeError:
        return
    raise AssertionError("double free not detected")
