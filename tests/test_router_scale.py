"""The router at fleet scale: the KV index's per-replica cap, and the linear-time lookup and policy.

`KVIndex.match` was rewritten to cost O(holders) instead of O(replicas) per block (docs/scale.md): these
tests hold it to the previous implementation's answers on random fleets, check the cap's policy (least
recently stored or routed-to entries go first, CPU tier first; a forgotten block never becomes a wrong
hit), and hold `policy.choose` to the invariants that any combination of its rule switches keeps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmfleet.server.events import CPU, GPU, BlockRemoved, BlockStored, EventBatch, Snapshot
from warmfleet.server.router.core.index import KVIndex, PrefixMatch
from warmfleet.server.router.core.policy import (
    ADAPTER_HIT, COLD_HASH, LEAST_LOAD, LOAD_SPILL, PREFIX_HIT, Candidate, PolicyConfig, cacheable_tokens, choose, load_cap,
    prefix_value, rendezvous_weight, share_cap,
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


# --- choose: what holds for any rule set ---------------------------------------------------------------
# (the parts are tested one by one in test_router_policy_parts.py)
configs = st.builds(
    PolicyConfig, cpu_weight=st.sampled_from([0.0, 0.5, 1.0]), load_weight=st.sampled_from([0.0, 1.0, 32.0]),
    queue_weight=st.sampled_from([0.0, 0.3, 1.0]), cold_queue_weight=st.sampled_from([None, 0.0, 1.0]),
    epsilon=st.sampled_from([0.0, 0.25, 2.0]), share_epsilon=st.sampled_from([0.0, 0.15, 1.0]),
    warm_slack=st.integers(0, 2), warm_inflight_slack=st.integers(0, 2), common_prefix_free=st.booleans(),
    warm_min_tokens=st.sampled_from([0, 16, 64, 100]), share_slack_tokens=st.sampled_from([0, 16, 128]),
    max_share_slack=st.integers(0, 2), encoder_weight=st.sampled_from([0.0, 0.5]))


@st.composite
def fleets(draw):
    """Candidates with unique names, often warm, with loads, queues, shares, tie noise and peers' unseen requests."""
    warm = draw(st.booleans())
    n = draw(st.integers(1, 12))
    return [Candidate(f"http://10.0.0.{i}:8000", gpu_blocks=draw(st.integers(0, 8)) if warm else 0,
                      cpu_blocks=draw(st.integers(0, 3)) if warm else 0,
                      warm_image_tokens=draw(st.sampled_from([0, 0, 40])) if warm else 0,
                      load=draw(st.integers(0, 4)), queued_tokens=draw(st.integers(0, 200)),
                      sent=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.7, 8.0])),
                      tie=draw(st.sampled_from([0.0, 0.0, 0.01])), unseen=draw(st.integers(0, 2)))
            for i in range(n)]


def under_both_caps(cands, cfg):
    """The replicas under the share cap and the in-flight bound, as policy.py's docstring states them."""
    cap, scap = load_cap([c.load for c in cands], cfg.epsilon), share_cap([c.sent for c in cands], cfg.share_epsilon)
    return [c for c in cands if c.load + 1 <= cap and c.sent + 1 <= scap]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cands=fleets(), cfg=configs, num_prompt_tokens=st.integers(1, 160),
       cold_key=st.one_of(st.none(), st.binary(min_size=1, max_size=32)), shuffle=st.randoms(use_true_random=False))
def test_choose_holds_its_invariants_for_any_rule_set(cands, cfg, num_prompt_tokens, cold_key, shuffle):
    bs = 16
    d = choose(cands, block_size=bs, num_prompt_tokens=num_prompt_tokens, cold_key=cold_key, cfg=cfg)
    by_name = {c.replica: c for c in cands}
    limit = cacheable_tokens(num_prompt_tokens, bs)
    t = by_name[d.order[0]]
    # every replica exactly once, target first; hits never above what an engine can serve from cache
    assert sorted(d.order) == sorted(by_name)
    assert d.hits.keys() == by_name.keys() and all(0 <= h <= limit for h in d.hits.values())
    assert d.predicted_cached_tokens == d.hits[t.replica]
    assert d.reason in (PREFIX_HIT, COLD_HASH, LOAD_SPILL, LEAST_LOAD)
    # the same answer whatever order the candidates come in (every router process agrees)
    mixed = list(cands)
    shuffle.shuffle(mixed)
    assert choose(mixed, block_size=bs, num_prompt_tokens=num_prompt_tokens, cold_key=cold_key, cfg=cfg) == d
    # warm images count only while they are worth something (--encoder-weight 0: encoder caches ignored)
    warm = any(d.hits[c.replica] > 0 or (c.warm_image_tokens > 0 and cfg.encoder_weight > 0) for c in cands)
    if not warm and cold_key is None:  # nothing to cache: least load, then fewest sent
        assert d.reason == LEAST_LOAD and t.load == min(c.load for c in cands)
        return
    allowed = under_both_caps(cands, cfg)
    # never over a cap while a replica under both exists, unless it keeps a long warm prefix within the slack
    if allowed and t not in allowed:
        assert warm
        assert d.hits[t.replica] - max(d.hits[c.replica] for c in allowed) >= cfg.warm_min_tokens
        slack = cfg.warm_slack + cfg.warm_inflight_slack + t.unseen
        assert t.load + 1 <= load_cap([c.load for c in cands], cfg.epsilon) + slack
        share_slack = cfg.warm_slack + cfg.max_share_slack
        assert t.sent + 1 <= share_cap([c.sent for c in cands], cfg.share_epsilon) + share_slack
    if warm:
        assert d.reason != COLD_HASH
        assert d.reason != PREFIX_HIT or d.hits[t.replica] > 0 or t.warm_image_tokens > 0
        # a replica under the caps with more of the prompt (past the fleet-common level) and no more load, queue
        # or fewer warm images is never passed over for a colder one
        for c in allowed:
            assert not (prefix_value(c, bs, limit, cfg.cpu_weight) > prefix_value(t, bs, limit, cfg.cpu_weight)
                        and prefix_value(c, bs, limit, cfg.cpu_weight) >= cfg.warm_min_tokens
                        and c.load <= t.load and c.queued_tokens <= t.queued_tokens
                        and c.warm_image_tokens >= t.warm_image_tokens), (c, t)
    else:  # a prefix nobody holds: its rendezvous order, a function of the key alone, among those under the caps
        assert d.reason in (COLD_HASH, LOAD_SPILL)
        if allowed:
            first = max(allowed, key=lambda c: rendezvous_weight(cold_key, c.replica))
            assert t is first
        top = max(cands, key=lambda c: rendezvous_weight(cold_key, c.replica))
        assert (d.reason == COLD_HASH) == (t is top)


@st.composite
def adapter_fleets(draw):
    """fleets() whose replicas have the request's LoRA adapter resident or not, a slot for it or not."""
    return [Candidate(c.replica, c.gpu_blocks, c.cpu_blocks, c.warm_image_tokens, c.load, c.queued_tokens, c.sent,
                      c.tie, c.unseen, adapter_resident=resident, adapter_slot=resident or draw(st.booleans()))
            for c in draw(fleets()) for resident in [draw(st.booleans())]]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cands=adapter_fleets(), cfg=configs, adapter_weight=st.sampled_from([0.0, 64.0, 256.0]),
       num_prompt_tokens=st.integers(1, 160), cold_key=st.one_of(st.none(), st.binary(min_size=1, max_size=32)),
       adapter=st.binary(min_size=1, max_size=16), shuffle=st.randoms(use_true_random=False))
def test_choose_for_an_adapter_holds_its_invariants(cands, cfg, adapter_weight, num_prompt_tokens, cold_key, adapter,
                                                    shuffle):
    bs = 16
    cfg = dataclasses.replace(cfg, adapter_weight=adapter_weight)
    d = choose(cands, block_size=bs, num_prompt_tokens=num_prompt_tokens, cold_key=cold_key, cfg=cfg,
               adapter_key=adapter)
    by_name = {c.replica: c for c in cands}
    t = by_name[d.order[0]]
    assert sorted(d.order) == sorted(by_name)
    mixed = list(cands)
    shuffle.shuffle(mixed)  # every router process agrees
    assert choose(mixed, block_size=bs, num_prompt_tokens=num_prompt_tokens, cold_key=cold_key, cfg=cfg,
                  adapter_key=adapter) == d
    # never a replica without a slot for the adapter while another has one; those go last, as fallbacks
    slots = [by_name[r].adapter_slot for r in d.order]
    assert slots == sorted(slots, reverse=True)
    assert d.reason != ADAPTER_HIT or (t.adapter_resident and d.hits[t.replica] == 0)
    assert d.reason != PREFIX_HIT or d.hits[t.replica] > 0 or t.warm_image_tokens > 0
    warm = any(d.hits[c.replica] > 0 or c.warm_image_tokens > 0 or c.adapter_resident for c in cands)
    if not warm:  # a cold adapter: its own rendezvous under the caps (the prompt's key plays no part)
        assert d.reason in (COLD_HASH, LOAD_SPILL)
        allowed = under_both_caps(cands, cfg)
        if allowed:
            first = max(allowed, key=lambda c: rendezvous_weight(adapter, c.replica))
            assert t is first or not first.adapter_slot


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
