"""The router at fleet scale: the KV index's per-replica cap, and the linear-time lookup and policy.

`KVIndex.match` and `policy.choose` were rewritten to cost O(holders) and O(replicas) instead of
O(replicas) per block and O(replicas^2) (docs/scale.md); these tests hold them to the previous
implementations' answers on random fleets, and check the cap's policy (least recently stored or
routed-to entries go first, CPU tier first; a forgotten block never becomes a wrong hit).
"""

from __future__ import annotations

import hashlib
import random
from typing import Optional, Sequence

import pytest

from warmfleet.server.events import CPU, GPU, BlockRemoved, BlockStored, EventBatch, Snapshot
from warmfleet.server.router.core.index import KVIndex, PrefixMatch
from warmfleet.server.router.core.policy import (
    COLD_HASH, LEAST_LOAD, LOAD_SPILL, PREFIX_HIT, Candidate, Decision, PolicyConfig, cacheable_tokens, choose,
    load_cap, rendezvous_weight, share_cap,
)


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def synced(index: KVIndex, *replicas: str) -> None:
    for r in replicas:
        index.apply_snapshot(r, Snapshot(r, 0, 16, "fp", [], [], []))


def store(index: KVIndex, r: str, seq: int, hashes: list[bytes], medium: str = GPU) -> None:
    index.apply_batch(r, EventBatch(r, seq, [BlockStored(hashes, None, [], 16, medium)]))


# --- the cap --------------------------------------------------------------------------------------
def test_cap_forgets_least_recently_used_cpu_tier_first():
    index = KVIndex(max_blocks_per_replica=6)
    synced(index, "a", "b")
    store(index, "a", 1, [h(i) for i in range(4)])          # GPU 0..3
    store(index, "a", 2, [h(10), h(11)], CPU)               # CPU 10, 11: at the cap
    store(index, "b", 1, [h(0), h(1)])
    assert index.evicted == 0
    store(index, "a", 3, [h(4)])                            # over by one: the oldest CPU entry goes
    assert index.state("a").cpu == {h(11)} and index.evicted == 1
    store(index, "a", 4, [h(5), h(6)])                      # over by two: the last CPU entry, then GPU 0
    assert index.state("a").cpu == set() and h(0) not in index.state("a").gpu and index.evicted == 3
    assert index.match([h(0), h(1)], ["a", "b"]) == {"a": PrefixMatch(0, 0), "b": PrefixMatch(2, 0)}
    # b's entries are its own: a's cap never touched them
    assert index.state("b").gpu == {h(0), h(1)}
    # a later BlockRemoved for a forgotten block is a no-op
    index.apply_batch("a", EventBatch("a", 5, [BlockRemoved([h(0)], GPU)]))
    assert len(index.state("a").gpu) == 6


def test_touch_and_restore_keep_used_blocks():
    index = KVIndex(max_blocks_per_replica=4)
    synced(index, "a")
    store(index, "a", 1, [h(0), h(1), h(2), h(3)])
    index.touch("a", [h(0), h(1)])                          # the router sent a request over 0, 1
    store(index, "a", 2, [h(4), h(5)])                      # evicts the least recently used: 2, 3
    assert index.state("a").gpu == {h(0), h(1), h(4), h(5)}
    store(index, "a", 3, [h(4)])                            # stored again: newest
    store(index, "a", 4, [h(6)])
    assert h(0) not in index.state("a").gpu and h(4) in index.state("a").gpu
    # a snapshot larger than the cap keeps its newest entries (the engine lists them oldest first)
    index.apply_snapshot("a", Snapshot("a", 10, 16, "fp", [h(i) for i in range(20, 30)], [], []))
    assert index.state("a").gpu == {h(i) for i in range(26, 30)}


def test_uncapped_index_is_unbounded_and_touch_is_free():
    index = KVIndex()
    synced(index, "a")
    store(index, "a", 1, [h(i) for i in range(1000)])
    index.touch("a", [h(0)])
    assert len(index.state("a").gpu) == 1000 and index.evicted == 0
    with pytest.raises(ValueError):
        KVIndex(max_blocks_per_replica=0)


# --- match: same answers as the per-replica scan it replaced ------------------------------------------
def reference_match(index: KVIndex, hashes, replicas):
    counts = {r: [0, 0] for r in replicas}
    alive = set(counts)
    for x in hashes:
        if not alive:
            break
        owners = index._where.get(x)
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


@pytest.mark.parametrize("seed", range(5))
def test_match_equals_the_reference(seed):
    rng = random.Random(seed)
    reps = [f"r{i}" for i in range(rng.randrange(1, 40))]
    index = KVIndex()
    synced(index, *reps)
    chain = [h(1000 * seed + i) for i in range(30)]
    for r in reps:
        depth = rng.randrange(0, 31)
        gpu = [x for x in chain[:depth] if rng.random() < 0.8]
        cpu = [x for x in chain[:depth] if rng.random() < 0.4]
        store(index, r, 1, gpu)
        store(index, r, 2, cpu, CPU)
    for _ in range(20):
        asked = rng.sample(reps, rng.randrange(1, len(reps) + 1))
        hashes = chain[:rng.randrange(0, 31)]
        assert index.match(hashes, asked) == reference_match(index, hashes, asked)


# --- choose: same decisions as the quadratic version it replaced ---------------------------------
def reference_choose(cands: Sequence[Candidate], *, block_size: int, num_prompt_tokens: int,
                     cold_key: Optional[bytes], cfg: PolicyConfig = PolicyConfig()) -> Decision:
    """The quadratic policy.choose it replaced, kept apart as the oracle its decisions must equal (it shares
    no code with the product on purpose: the test would otherwise compare choose with itself)."""
    if not cands:
        raise ValueError("no routable replicas")
    cap = load_cap([c.load for c in cands], cfg.epsilon)
    limit = cacheable_tokens(num_prompt_tokens, block_size)

    def hit_tokens(c: Candidate) -> int:
        return min(c.gpu_blocks * block_size + c.cpu_blocks * block_size, limit)

    def score(c: Candidate) -> float:
        gpu = min(c.gpu_blocks * block_size, limit)
        cpu = min(c.cpu_blocks * block_size, limit - gpu)
        return (gpu + cfg.cpu_weight * cpu + cfg.encoder_weight * c.warm_image_tokens
                - cfg.queue_weight * c.queued_tokens - cfg.load_weight * c.load)

    scap = share_cap([c.sent for c in cands], cfg.share_epsilon)
    in_share = [c for c in cands if c.sent + 1 <= scap] or list(cands)
    fits = [c for c in in_share if c.load + 1 <= cap]
    over = [c for c in cands if c not in fits]
    warm = any(hit_tokens(c) > 0 or c.warm_image_tokens > 0 for c in cands)

    def by_score(cs: list[Candidate]) -> list[Candidate]:
        return sorted(cs, key=lambda c: (-score(c), c.load, c.sent, c.replica))

    if warm:
        ranked = by_score(fits) + by_score(over)
        best_anywhere = by_score(list(cands))[0]
        kept_warm = False
        best_fit_hits = max((hit_tokens(c) for c in fits), default=0)
        advantage = hit_tokens(best_anywhere) - best_fit_hits
        share_slack = cfg.warm_slack
        if cfg.share_slack_tokens > 0 and advantage > 0:
            share_slack += min(cfg.max_share_slack, advantage // cfg.share_slack_tokens)
        if (best_anywhere in over and best_anywhere.load + 1 <= cap + cfg.warm_slack
                and best_anywhere.sent + 1 <= scap + share_slack):
            if advantage >= cfg.warm_min_tokens:
                ranked = [best_anywhere] + [c for c in ranked if c is not best_anywhere]
                kept_warm = True
        target = ranked[0]
        if score(best_anywhere) > score(target) and best_anywhere in over and not kept_warm:
            reason = LOAD_SPILL
        elif hit_tokens(target) > 0 or target.warm_image_tokens > 0:
            reason = PREFIX_HIT
        else:
            reason = LEAST_LOAD  # the warm replicas are too busy to be worth it
    elif cold_key is not None:
        ranked = sorted(fits, key=lambda c: -rendezvous_weight(cold_key, c.replica)) + by_score(over)
        top_any = max(cands, key=lambda c: rendezvous_weight(cold_key, c.replica))
        reason = COLD_HASH if ranked[0] is top_any else LOAD_SPILL
    else:  # shorter than one block: nothing to cache, spread by load
        ranked = sorted(cands, key=lambda c: (c.load, c.sent, c.replica))
        reason = LEAST_LOAD
    return Decision([c.replica for c in ranked], reason, hit_tokens(ranked[0]),
                    {c.replica: hit_tokens(c) for c in cands}, num_prompt_tokens)


@pytest.mark.parametrize("seed", range(30))
def test_choose_equals_the_reference(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 70)
    q = rng.choice([0.0, 0.3, 1.0])
    cfg = PolicyConfig(queue_weight=q, cold_queue_weight=q, warm_slack=rng.choice([0, 1, 2]),
                       share_slack_tokens=rng.choice([0, 128]),
                       warm_inflight_slack=0, common_prefix_free=False)  # rules the reference predates
    for _ in range(10):
        warm = rng.random() < 0.7
        cands = [Candidate(f"http://10.0.0.{i}:8000", gpu_blocks=rng.randrange(6) if warm else 0,
                           cpu_blocks=rng.randrange(3) if warm and rng.random() < 0.3 else 0,
                           warm_image_tokens=rng.choice([0, 0, 0, 40]) if warm else 0, load=rng.randrange(4),
                           queued_tokens=rng.randrange(200), sent=round(rng.random() * 8, 3)) for i in range(n)]
        kw = dict(block_size=16, num_prompt_tokens=rng.randrange(1, 120),
                  cold_key=rng.choice([None, bytes([seed]) * 32]), cfg=cfg)
        assert choose(cands, **kw) == reference_choose(cands, **kw)


# --- tokenizing without offsets: the same ids as the replica's encoder ------------------------------
def test_router_completion_ids_equal_the_replicas(tiny_model_dir):
    from warmfleet.server import rendering
    from warmfleet.server.router.core.prompt import PromptRenderer, ids_encoder
    from warmfleet.server.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    renderer = PromptRenderer(str(tiny_model_dir), tokenizer=tok)
    assert ids_encoder(tok) is not tok.encode  # the offset-free path is the one in use
    rng = random.Random(0)
    pieces = [" the", " KV", "cache", "  ", "\n", "\t", "ü", "☃", "12345", "<|im_start|>", "<|endoftext|>", ",", "."]
    texts = ["", "x", "<|im_start|>user\nhi<|im_end|>"] + [
        "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 200))) for _ in range(50)]
    for text in texts:
        assert renderer.completion({"prompt": text}).token_ids == rendering.completion_ids(tok, text), text
        assert renderer._encode(text, False) == tok.encode(text, add_special_tokens=False), text
