"""Scoring policy: tier weights, load, bounded load, cold-prefix rendezvous convergence (pure)."""

from collections import Counter

import pytest

from warmfleet.server.router.core.policy import (
    COLD_HASH, LEAST_LOAD, LOAD_SPILL, PREFIX_HIT, Candidate, PolicyConfig, cacheable_tokens, choose, load_cap,
    share_cap,
)

B = 16
REPLICAS = ["http://r0", "http://r1", "http://r2", "http://r3"]


def test_longest_gpu_prefix_wins():
    d = choose([Candidate("a", gpu_blocks=2), Candidate("b", gpu_blocks=5), Candidate("c")],
               block_size=B, num_prompt_tokens=10 * B, cold_key=b"k")
    assert d.order[0] == "b" and d.reason == PREFIX_HIT and d.predicted_cached_tokens == 5 * B
    assert d.order[1] == "a"


def test_cpu_tier_counts_partly():
    cfg = PolicyConfig(cpu_weight=0.5)
    # 4 GPU blocks beat 6 CPU-only blocks at weight 0.5 (64 vs 48 tokens)...
    d = choose([Candidate("gpu", gpu_blocks=4), Candidate("cpu", cpu_blocks=6)],
               block_size=B, num_prompt_tokens=20 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "gpu"
    # ...but 10 CPU-only blocks beat 4 GPU blocks (80 vs 64)
    d = choose([Candidate("gpu", gpu_blocks=4), Candidate("cpu", cpu_blocks=10)],
               block_size=B, num_prompt_tokens=20 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "cpu" and d.predicted_cached_tokens == 10 * B


def test_load_outweighs_a_short_hit():
    cfg = PolicyConfig(load_weight=32, epsilon=10)  # large epsilon: only the score decides
    d = choose([Candidate("busy", gpu_blocks=1, load=3), Candidate("idle", load=0)],
               block_size=B, num_prompt_tokens=8 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "idle" and d.reason == LEAST_LOAD


def test_queued_prefill_outweighs_a_short_warm_prefix_not_a_long_one():
    cfg = PolicyConfig(epsilon=10, share_epsilon=10, queue_weight=1.0)  # only the score decides
    # "busy" is computing a 300-token cold prompt for this router: a 4-block hit is not worth the wait...
    d = choose([Candidate("busy", gpu_blocks=4, load=1, queued_tokens=300), Candidate("idle")],
               block_size=B, num_prompt_tokens=40 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "idle" and d.uncached_for("idle") == 40 * B
    # ...a 30-block conversation history is
    d = choose([Candidate("busy", gpu_blocks=30, load=1, queued_tokens=300), Candidate("idle")],
               block_size=B, num_prompt_tokens=40 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "busy" and d.uncached_for("busy") == 10 * B
    # with the term off, only the request count weighs
    d = choose([Candidate("busy", gpu_blocks=4, load=1, queued_tokens=300), Candidate("idle")],
               block_size=B, num_prompt_tokens=40 * B, cold_key=b"k", cfg=PolicyConfig(epsilon=10, share_epsilon=10,
                                                                                      queue_weight=0))
    assert d.order[0] == "busy"


def test_queued_prefill_weighs_fully_only_when_no_cache_is_at_stake():
    cfg = PolicyConfig(epsilon=10, share_epsilon=10, queue_weight=0.0, cold_queue_weight=1.0)
    # a conversation's 4 blocks on "busy" (>= warm_min_tokens more than "idle" holds): kept despite the queue
    d = choose([Candidate("busy", gpu_blocks=4, load=1, queued_tokens=300), Candidate("idle", load=1)],
               block_size=B, num_prompt_tokens=40 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "busy" and d.reason == PREFIX_HIT
    # a new conversation, warm everywhere on one shared block: the queue decides, in full
    new = [Candidate("busy", gpu_blocks=1, load=1, queued_tokens=300), Candidate("idle", gpu_blocks=1, load=1)]
    assert choose(new, block_size=B, num_prompt_tokens=40 * B, cold_key=b"k", cfg=cfg).order[0] == "idle"
    # without the cold weight the queue weighs nothing there: equal scores, the name breaks the tie
    flat = PolicyConfig(epsilon=10, share_epsilon=10, queue_weight=0.0, cold_queue_weight=None)
    assert choose(new, block_size=B, num_prompt_tokens=40 * B, cold_key=b"k", cfg=flat).order[0] == "busy"


def test_bounded_load_spills_a_hot_prefix():
    cfg = PolicyConfig(epsilon=0.25, load_weight=0, warm_inflight_slack=0)
    cands = [Candidate("hot", gpu_blocks=8, load=4), Candidate("b", load=0), Candidate("c", load=1)]
    assert load_cap([4, 0, 1], 0.25) == 3
    d = choose(cands, block_size=B, num_prompt_tokens=10 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] != "hot" and d.reason == LOAD_SPILL and d.order[-1] == "hot"


def test_bounded_load_never_exceeds_cap_over_a_burst():
    """A hot prefix sent 100 times with nothing finishing: no replica above ceil((1+eps) * mean) + the warm slacks."""
    cfg = PolicyConfig(epsilon=0.25, load_weight=0)
    load = Counter()
    for i in range(100):
        cands = [Candidate(r, gpu_blocks=8 if r == "http://r0" else 0, load=load[r]) for r in REPLICAS]
        load[choose(cands, block_size=B, num_prompt_tokens=10 * B, cold_key=b"k", cfg=cfg).order[0]] += 1
        mean = sum(load.values()) / len(REPLICAS)
        assert max(load.values()) <= -(-(1.25 * mean) // 1) + cfg.warm_slack + cfg.warm_inflight_slack
    assert load["http://r0"] == max(load.values())


def test_cold_prefix_converges_and_spreads():
    """Same first block → same replica on every call; different prefixes spread over the fleet."""
    cands = [Candidate(r) for r in REPLICAS]
    first = {choose(cands, block_size=B, num_prompt_tokens=4 * B, cold_key=b"tenant-7").order[0] for _ in range(20)}
    assert len(first) == 1
    d = choose(cands, block_size=B, num_prompt_tokens=4 * B, cold_key=b"tenant-7")
    assert d.reason == COLD_HASH and d.predicted_cached_tokens == 0
    spread = Counter(choose(cands, block_size=B, num_prompt_tokens=4 * B, cold_key=f"t{i}".encode()).order[0]
                     for i in range(400))
    assert set(spread) == set(REPLICAS) and max(spread.values()) < 2 * 100


def test_cold_hash_is_stable_when_a_replica_leaves():
    """Rendezvous hashing: removing one replica only moves the keys that lived on it."""
    keys = [f"k{i}".encode() for i in range(200)]
    full = {k: choose([Candidate(r) for r in REPLICAS], block_size=B, num_prompt_tokens=2 * B, cold_key=k).order[0]
            for k in keys}
    less = {k: choose([Candidate(r) for r in REPLICAS[1:]], block_size=B, num_prompt_tokens=2 * B, cold_key=k).order[0]
            for k in keys}
    moved = [k for k in keys if full[k] != less[k]]
    assert moved and all(full[k] == REPLICAS[0] for k in moved)


def test_short_prompt_goes_to_least_loaded():
    d = choose([Candidate("a", load=2), Candidate("b", load=1)], block_size=B, num_prompt_tokens=3, cold_key=None)
    assert d.order == ["b", "a"] and d.reason == LEAST_LOAD


def test_warm_image_attracts_request():
    d = choose([Candidate("a"), Candidate("b", warm_image_tokens=256)], block_size=B, num_prompt_tokens=300,
               cold_key=b"k")
    assert d.order[0] == "b" and d.reason == PREFIX_HIT


def test_prediction_leaves_last_token_to_compute():
    assert cacheable_tokens(4 * B, B) == 3 * B
    assert cacheable_tokens(4 * B + 1, B) == 4 * B
    d = choose([Candidate("a", gpu_blocks=4)], block_size=B, num_prompt_tokens=4 * B, cold_key=b"k")
    assert d.predicted_cached_tokens == 3 * B


def test_no_replicas_is_an_error():
    with pytest.raises(ValueError):
        choose([], block_size=B, num_prompt_tokens=10, cold_key=None)


def test_warm_slack_keeps_a_long_prefix_one_over_the_cap():
    cfg = PolicyConfig(epsilon=0.25, load_weight=0, warm_slack=1, warm_min_tokens=64, warm_inflight_slack=0)
    assert load_cap([1, 0, 0, 0], 0.25) == 1  # the warm replica is one over
    cands = [Candidate("warm", gpu_blocks=20, load=1), Candidate("b"), Candidate("c"), Candidate("d")]
    d = choose(cands, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "warm" and d.reason == PREFIX_HIT
    # a short advantage is not worth the queue; strict bounded load never keeps it
    short = [Candidate("warm", gpu_blocks=3, load=1), Candidate("b"), Candidate("c"), Candidate("d")]
    assert choose(short, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).reason == LOAD_SPILL
    strict = PolicyConfig(epsilon=0.25, load_weight=0, warm_slack=0, warm_inflight_slack=0)
    d = choose(cands, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=strict)
    assert d.order[0] != "warm" and d.reason == LOAD_SPILL
    # two over the cap is beyond a slack of one
    busy = [Candidate("warm", gpu_blocks=20, load=2), Candidate("b"), Candidate("c"), Candidate("d")]
    assert choose(busy, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).order[0] != "warm"



def test_share_slack_grows_with_the_warm_tokens_at_stake():
    """A long warm prefix (a conversation's history) may take one more request of share slack per
    `share_slack_tokens` it holds beyond the best replica under the caps, up to `max_share_slack`."""
    cfg = PolicyConfig(load_weight=0, warm_slack=1, warm_min_tokens=64, share_slack_tokens=128, max_share_slack=1,
                       warm_inflight_slack=0)
    assert share_cap([8, 4, 4, 4], 0.15) == pytest.approx(7.0375)  # 9 requests is two over the cap

    def cands(blocks, sent0, load0=0):
        return [Candidate("warm", gpu_blocks=blocks, sent=sent0, load=load0)] + \
            [Candidate(r, gpu_blocks=1, sent=4) for r in "bcd"]

    d = choose(cands(21, 8), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "warm" and d.reason == PREFIX_HIT  # 320 tokens at stake: slack 2
    # 80 tokens at stake: only warm_slack (1), so it spills to a replica holding the system prompt
    d = choose(cands(6, 8), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] != "warm" and d.reason == LOAD_SPILL and d.predicted_cached_tokens == B
    # off, and capped
    off = PolicyConfig(load_weight=0, warm_slack=1, share_slack_tokens=0)
    assert choose(cands(21, 8), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=off).reason == LOAD_SPILL
    assert choose(cands(21, 9), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).reason == LOAD_SPILL
    two = PolicyConfig(load_weight=0, warm_slack=1, share_slack_tokens=128, max_share_slack=2)
    assert choose(cands(21, 9), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=two).order[0] == "warm"
    # the in-flight bound keeps its own slack: two over the load cap still spills
    others = [Candidate(r, gpu_blocks=1, sent=4) for r in "bcd"]
    busy = [Candidate("warm", gpu_blocks=21, sent=4, load=2)] + others
    assert choose(busy, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).order[0] != "warm"


def test_share_slack_keeps_the_spread_bounded():
    """Conversations pinned to one replica by their history plus a hot prefix warm everywhere: the extra
    slack keeps histories home, the hot requests even the counts out, spread stays within 1.25."""
    cfg = PolicyConfig()
    sent = Counter()
    decay = 1 - 1 / 512
    for i in range(600):
        pinned = i % 3 == 0  # a third of the traffic: long histories that live on r0 only
        cands = [Candidate(r, gpu_blocks=(30 if r == REPLICAS[0] else 2) if pinned else 10, sent=sent[r])
                 for r in REPLICAS]
        target = choose(cands, block_size=B, num_prompt_tokens=32 * B, cold_key=b"k", cfg=cfg).order[0]
        for r in REPLICAS:
            sent[r] *= decay
        sent[target] += 1
    counts = list(sent.values())
    assert max(counts) / (sum(counts) / len(counts)) <= 1.25

def test_share_cap_spreads_a_hot_prefix_that_never_queues():
    """Short requests (load always 0) on a prefix warm on one replica: the share cap alone keeps counts even,
    and a replica that took a spill holds the prefix afterwards (it is warm there too)."""
    cfg = PolicyConfig(share_epsilon=0.15)
    sent = Counter()
    warm = {"http://r0"}
    decay = 1 - 1 / 512
    for i in range(400):
        cands = [Candidate(r, gpu_blocks=8 if r in warm else 0, sent=sent[r]) for r in REPLICAS]
        target = choose(cands, block_size=B, num_prompt_tokens=10 * B, cold_key=b"k", cfg=cfg).order[0]
        for r in REPLICAS:
            sent[r] *= decay
        sent[target] += 1
        warm.add(target)
    counts = list(sent.values())
    assert max(counts) / (sum(counts) / len(counts)) <= 1.2
    assert warm == set(REPLICAS)


def test_equal_choices_go_to_the_replica_sent_the_least():
    cands = [Candidate("a", gpu_blocks=4, sent=9), Candidate("b", gpu_blocks=4, sent=3), Candidate("c", sent=0)]
    d = choose(cands, block_size=B, num_prompt_tokens=8 * B, cold_key=b"k")
    assert d.order[0] == "b"


def test_prediction_for_a_fallback_after_retry():
    d = choose([Candidate("a", gpu_blocks=6), Candidate("b", gpu_blocks=2), Candidate("c")],
               block_size=B, num_prompt_tokens=10 * B, cold_key=b"k")
    assert d.order[0] == "a" and d.predicted_for("a") == 6 * B
    assert d.predicted_for("b") == 2 * B and d.predicted_for("c") == 0 and d.predicted_for("gone") == 0


@pytest.mark.parametrize("flags, message", [
    (["--queue-weight", "-1"], "--queue-weight, --cold-queue-weight and --load-weight must be >= 0"),
    (["--cold-queue-weight", "-1"], "--queue-weight, --cold-queue-weight and --load-weight must be >= 0"),
    (["--cpu-tier-weight", "2"], "--cpu-tier-weight must be in [0, 1]"),
    (["--warm-inflight-slack", "-1"], "--warm-slack, --warm-inflight-slack, --warm-min-tokens"),
    (["--replica", "ftp://x"], "--replica needs an http(s)://host:port URL"),
])
def test_bad_router_flag_is_one_line_and_exit_2(tiny_model_dir, capsys, flags, message):
    from warmfleet.cli import main

    argv = ["route", "--model", str(tiny_model_dir), "--replica", "http://127.0.0.1:1", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("warmfleet route: error: ") and message in err and "\n" not in err


def test_tie_noise_reorders_equal_replicas_but_not_the_share_cap():
    """Routers sharing one view (peers.py) draw `tie` at random so that they do not all pick the same replica."""
    cands = [Candidate("a", sent=1.0), Candidate("b", sent=1.5)]
    assert choose(cands, block_size=B, num_prompt_tokens=4, cold_key=None).order[0] == "a"
    noisy = [Candidate("a", sent=1.0, tie=1.0), Candidate("b", sent=1.5)]
    assert choose(noisy, block_size=B, num_prompt_tokens=4, cold_key=None).order[0] == "b"
    warm = [Candidate("a", gpu_blocks=1, sent=1.0, tie=1.0), Candidate("b", gpu_blocks=1, sent=1.5)]
    assert choose(warm, block_size=B, num_prompt_tokens=4 * B, cold_key=b"k").order[0] == "b"
    # the share cap reads `sent` alone: a huge tie on an under-cap replica does not push it over
    capped = [Candidate("a", gpu_blocks=3, sent=0.0, tie=100.0), Candidate("b", gpu_blocks=1, sent=0.0)]
    assert choose(capped, block_size=B, num_prompt_tokens=8 * B, cold_key=b"k").order[0] == "a"


def test_unseen_peer_requests_widen_only_the_warm_in_flight_slack():
    """With peer routers a replica's in-flight figure is uncertain by ~one request per peer: a long warm prefix
    stays home that many requests further over the bound; a short one, and cold balancing, are unchanged."""
    cfg = PolicyConfig(epsilon=0.25, load_weight=0, warm_slack=1, warm_min_tokens=64, warm_inflight_slack=0)
    others = [Candidate("b"), Candidate("c"), Candidate("d")]
    busy = [Candidate("warm", gpu_blocks=20, load=3)] + others  # cap 2 (load 3 of 4 replicas): two over it
    assert choose(busy, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).reason == LOAD_SPILL
    busy = [Candidate("warm", gpu_blocks=20, load=3, unseen=2)] + others
    d = choose(busy, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "warm" and d.reason == PREFIX_HIT
    # beyond warm_slack + unseen it spills again
    over = [Candidate("warm", gpu_blocks=20, load=5, unseen=2)] + others
    assert choose(over, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).order[0] != "warm"
    # a short advantage is still not worth the queue
    short = [Candidate("warm", gpu_blocks=3, load=3, unseen=2)] + others
    assert choose(short, block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).reason == LOAD_SPILL


def test_warm_inflight_slack_widens_only_the_in_flight_bound():
    """Long conversations spill on the in-flight bound (docs/scale.md, "The routing defaults"; the runs:
    docs/history/scale-rounds.md, fourth round): `warm_inflight_slack` keeps a long warm prefix that many
    requests further over it, while the share cap stays as it is."""
    cfg = PolicyConfig(epsilon=0.25, load_weight=0, warm_slack=1, warm_min_tokens=64, warm_inflight_slack=1)
    others = [Candidate(r, sent=4) for r in "bcd"]
    assert load_cap([3, 0, 0, 0], 0.25) == 2  # load 3 takes the warm replica two over the in-flight bound

    def cands(load, sent=4.0, blocks=20):
        return [Candidate("warm", gpu_blocks=blocks, load=load, sent=sent)] + others

    d = choose(cands(3), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg)
    assert d.order[0] == "warm" and d.reason == PREFIX_HIT
    # without the knob the same request spills; three over is beyond warm_slack + warm_inflight_slack
    base = PolicyConfig(epsilon=0.25, load_weight=0, warm_slack=1, warm_min_tokens=64, warm_inflight_slack=0)
    assert choose(cands(3), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=base).reason == LOAD_SPILL
    assert choose(cands(4), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=cfg).reason == LOAD_SPILL
    # a short advantage is still not worth the queue
    assert choose(cands(3, blocks=3), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k",
                  cfg=cfg).reason == LOAD_SPILL
    # the share cap is unchanged: 320 tokens at stake give it slack 2 (7.04 + 2), so 9 recent requests keep
    # the prefix and 10 spill, however wide the in-flight slack
    wide = PolicyConfig(epsilon=0.25, load_weight=0, warm_slack=1, warm_min_tokens=64, warm_inflight_slack=5)
    assert share_cap([8, 4, 4, 4], 0.15) == pytest.approx(7.0375)
    assert choose(cands(0, sent=8), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=wide).order[0] == "warm"
    d = choose(cands(0, sent=9), block_size=B, num_prompt_tokens=24 * B, cold_key=b"k", cfg=wide)
    assert d.order[0] != "warm" and d.reason == LOAD_SPILL


def test_common_prefix_free_lets_a_replica_that_never_held_the_fleet_wide_first_block_win_new_conversations():
    """Every Mooncake request shares its first block: scored as a hit it keeps every new conversation off the
    replicas that never held it, which then stay empty (11 of 64 in docs/scale.md). The part of the prefix that
    more than half of the replicas hold scores nothing; what a replica holds beyond it still counts."""
    on = PolicyConfig(common_prefix_free=True)
    off = PolicyConfig(common_prefix_free=False)
    req = dict(block_size=B, num_prompt_tokens=10 * B, cold_key=b"k")

    def fleet(history_blocks=1):
        return ([Candidate(f"used{i}", gpu_blocks=1, sent=2) for i in range(3)]
                + [Candidate("hist", gpu_blocks=history_blocks, sent=2), Candidate("never", sent=1)])

    assert choose(fleet(), **req, cfg=off).order[0] != "never"
    d = choose(fleet(), **req, cfg=on)
    assert d.order[0] == "never" and d.predicted_cached_tokens == 0
    # a short history (3 blocks: under warm_min_tokens, so nothing "at stake") still stays home
    d = choose(fleet(3), **req, cfg=on)
    assert d.order[0] == "hist" and d.reason == PREFIX_HIT and d.predicted_cached_tokens == 3 * B
    # a long prefix that more than half hold (a history copied by a spill) counts beyond the cap (48 tokens here)
    hist = [Candidate("x", gpu_blocks=8, sent=2), Candidate("y", gpu_blocks=8, sent=2), Candidate("z", sent=1)]
    assert choose(hist, **req, cfg=on).order[0] in ("x", "y")
    # a block held by fewer than half of the replicas is not common: it counts in full
    few = [Candidate("a", gpu_blocks=1, sent=1), Candidate("b", sent=1), Candidate("c", sent=1)]
    assert choose(few, **req, cfg=on).order[0] == "a"
