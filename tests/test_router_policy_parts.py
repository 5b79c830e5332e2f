"""The named parts of policy.choose, each on its own: stake, queue weight, prefix worth, common level, caps,
warm-keep override, and the warm, cold and spread orders (pure)."""

from warmfleet.server.router.core.policy import (
    COLD_HASH, LEAST_LOAD, LOAD_SPILL, PREFIX_HIT, Candidate, PolicyConfig, common_prefix_level, cold_order,
    keeps_warm, prefix_at_stake, prefix_value, queue_weight_for, rendezvous_weight, spread_order, under_caps,
    warm_order, warm_share_slack,
)

B = 16


def test_prefix_is_at_stake_only_when_hits_differ_by_warm_min_tokens():
    assert prefix_at_stake([0, 64], 64)
    assert not prefix_at_stake([0, 63], 64)
    assert not prefix_at_stake([128, 128, 128], 64)  # a prefix every replica holds
    assert prefix_at_stake([5], 0)


def test_queue_weight_is_the_cold_one_only_when_nothing_is_at_stake():
    cfg = PolicyConfig(queue_weight=0.25, cold_queue_weight=1.0)
    assert queue_weight_for(True, cfg) == 0.25
    assert queue_weight_for(False, cfg) == 1.0
    assert queue_weight_for(False, PolicyConfig(queue_weight=0.25, cold_queue_weight=None)) == 0.25


def test_prefix_value_weighs_the_swap_tier_and_stops_at_the_cacheable_limit():
    assert prefix_value(Candidate("a", gpu_blocks=2, cpu_blocks=2), B, 10 * B, 0.5) == 2 * B + 0.5 * 2 * B
    assert prefix_value(Candidate("a", gpu_blocks=2, cpu_blocks=9), B, 4 * B, 0.5) == 2 * B + 0.5 * 2 * B
    assert prefix_value(Candidate("a", gpu_blocks=9, cpu_blocks=9), B, 4 * B, 0.5) == 4 * B
    assert prefix_value(Candidate("a", cpu_blocks=3), B, 10 * B, 0.0) == 0


def test_common_level_is_what_more_than_half_hold_capped_below_warm_min_tokens():
    # 3 of 4 hold one block: that block is the common level
    assert common_prefix_level([16, 16, 16, 0], 4, B, 64) == 16
    # only half hold it: the level is what the (n // 2 + 1)-th best holds
    assert common_prefix_level([32, 16, 0, 0], 4, B, 64) == 0
    # a long prefix held by most is capped at the longest whole block short of warm_min_tokens
    assert common_prefix_level([200, 200, 200], 3, B, 64) == 48
    assert common_prefix_level([200, 200, 200], 3, B, 65) == 64


def test_under_caps_applies_the_share_cap_then_the_load_cap():
    a, b, c = Candidate("a", load=0, sent=5), Candidate("b", load=3, sent=0), Candidate("c", load=0, sent=0)
    assert under_caps([a, b, c], cap=2, scap=3) == [c]  # a over the share cap, b over the load cap
    assert under_caps([a, b, c], cap=4, scap=6) == [a, b, c]
    # nobody under the share cap: the load cap alone decides
    assert under_caps([a, b], cap=2, scap=0) == [a]
    assert under_caps([b], cap=2, scap=3) == []


def test_share_slack_grows_one_per_share_slack_tokens_up_to_the_max():
    cfg = PolicyConfig(warm_slack=1, share_slack_tokens=128, max_share_slack=2)
    assert warm_share_slack(0, cfg) == 1
    assert warm_share_slack(127, cfg) == 1
    assert warm_share_slack(256, cfg) == 3
    assert warm_share_slack(10_000, cfg) == 3
    assert warm_share_slack(10_000, PolicyConfig(warm_slack=1, share_slack_tokens=0, max_share_slack=2)) == 1


def test_keeps_warm_needs_the_advantage_and_stays_within_each_slack():
    cfg = PolicyConfig(warm_min_tokens=64, warm_slack=1, warm_inflight_slack=1, share_slack_tokens=0)
    assert keeps_warm(Candidate("a", load=3, sent=0), 64, cap=2, scap=9, cfg=cfg)  # 4 <= 2 + 1 + 1
    assert not keeps_warm(Candidate("a", load=3, sent=0), 63, cap=2, scap=9, cfg=cfg)  # too little at stake
    assert not keeps_warm(Candidate("a", load=4, sent=0), 64, cap=2, scap=9, cfg=cfg)  # over the in-flight slack
    assert keeps_warm(Candidate("a", load=4, sent=0, unseen=1), 64, cap=2, scap=9, cfg=cfg)  # a peer's request
    assert keeps_warm(Candidate("a", load=0, sent=3), 64, cap=9, scap=3, cfg=cfg)  # 4 <= 3 + 1
    assert not keeps_warm(Candidate("a", load=0, sent=4), 64, cap=9, scap=3, cfg=cfg)  # in-flight slack: no help


def _scores_and_hits(cands, tokens):
    """Each replica scored by, and holding, `tokens` (no load or queue in the score)."""
    return {c: float(t) for c, t in zip(cands, tokens)}, {c.replica: t for c, t in zip(cands, tokens)}


def test_warm_order_ranks_under_the_caps_first_and_spills_the_best_over_them():
    cfg = PolicyConfig(warm_min_tokens=64, warm_slack=0, warm_inflight_slack=0)
    hot, a, b = Candidate("hot", load=5), Candidate("a", load=0), Candidate("b", load=1)
    scores, hits = _scores_and_hits([hot, a, b], [160, 32, 32])
    ranked, reason = warm_order([hot, a, b], [a, b], {a, b}, hits, scores, 2, 9, cfg)
    assert [c.replica for c in ranked] == ["a", "b", "hot"] and reason == LOAD_SPILL  # equal scores: less load first


def test_warm_order_keeps_a_long_prefix_on_a_replica_over_the_cap():
    cfg = PolicyConfig(warm_min_tokens=64, warm_slack=1, warm_inflight_slack=0, share_slack_tokens=0)
    hot, a = Candidate("hot", load=2), Candidate("a", load=0)
    scores, hits = _scores_and_hits([hot, a], [160, 0])
    ranked, reason = warm_order([hot, a], [a], {a}, hits, scores, 2, 9, cfg)
    assert [c.replica for c in ranked] == ["hot", "a"] and reason == PREFIX_HIT


def test_warm_order_is_least_load_when_the_target_holds_nothing():
    cfg = PolicyConfig(warm_min_tokens=64, warm_slack=0, warm_inflight_slack=0)
    warm, idle = Candidate("warm", load=1), Candidate("idle")
    scores, hits = {warm: -16.0, idle: 0.0}, {"warm": 16, "idle": 0}
    ranked, reason = warm_order([warm, idle], [warm, idle], {warm, idle}, hits, scores, 3, 9, cfg)
    assert ranked[0] is idle and reason == LEAST_LOAD


def test_cold_order_follows_the_rendezvous_weight_under_the_caps():
    cands = [Candidate(f"r{i}") for i in range(6)]
    key = b"k" * 32
    by_weight = sorted(cands, key=lambda c: -rendezvous_weight(key, c.replica))
    scores = {c: 0.0 for c in cands}
    ranked, reason = cold_order(cands, list(cands), set(cands), scores, key)
    assert ranked == by_weight and reason == COLD_HASH
    # the top replica over the caps: the next in rendezvous order takes it, the top one goes last
    fits = by_weight[1:]
    ranked, reason = cold_order(cands, fits, set(fits), scores, key)
    assert ranked == by_weight[1:] + by_weight[:1] and reason == LOAD_SPILL


def test_spread_order_is_least_load_then_fewest_sent_then_name():
    cands = [Candidate("c", load=1), Candidate("b", load=0, sent=2), Candidate("a", load=0, sent=2),
             Candidate("d", load=0, sent=1)]
    assert [c.replica for c in spread_order(cands)] == ["d", "a", "b", "c"]
