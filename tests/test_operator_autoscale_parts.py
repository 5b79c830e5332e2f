"""The named parts of autoscale_policy.decide, each on its own: bounds, each metric's recommendation, the
scale-out step, and the scale-up and scale-down windows (pure)."""

from __future__ import annotations

from typing import Any

from warmfleet.operator.planning import autoscale_policy as a
from warmfleet.operator.spec.inference_service import Autoscaling, parse_spec


def autoscaling(**kw: Any) -> Autoscaling:
    base = {"minReplicas": 1, "maxReplicas": 10, "targetQueuedPrefillTokens": 1000, "scaleDownStabilizationSeconds": 0}
    return parse_spec({"model": {"path": "/m"}, "autoscaling": {**base, **kw}}).autoscaling


def at(t: float, queued: float = 0.0, cached: float = 0.0, prompt: float = 0.0, buckets=()) -> a.Sample:
    return a.Sample(t=t, sources=frozenset({"r"}), queued_tokens=queued, cached_tokens=cached,
                    usage_prompt_tokens=prompt, ttft_buckets=tuple(buckets))


def test_replica_range_takes_the_pool_minima_and_what_the_pools_host():
    c = autoscaling(minReplicas=1, maxReplicas=10)
    assert a.replica_range({"x": 4, "y": 3}, None, c) == ([0, 0], 1, 7)  # the pools host 7 < maxReplicas
    assert a.replica_range({"x": 4, "y": 30}, {"x": 9, "y": 2}, c) == ([4, 2], 6, 10)  # a floor is at most the capacity
    assert a.replica_range({"x": 0}, None, autoscaling(minReplicas=3)) == ([0], 3, 3)  # hi never below lo


def test_queued_recommendation_keeps_current_within_tolerance_else_ceils_to_target():
    window = [at(90, queued=3000), at(100, queued=5000)]  # mean 4000
    assert a.queued_recommendation(window, 4, 1000) == ("queued prefill tokens per replica 1000 (target 1000)", 4)
    assert a.queued_recommendation(window, 3, 1000)[1] == 4  # 1333 per replica: out of tolerance
    assert a.queued_recommendation(window, 0, 1000) == ("queued prefill tokens per replica 4000 (target 1000)", 4)
    assert a.queued_recommendation([at(100, queued=4050)], 4, 1000)[1] == 4  # 1012 per replica: within 10%


def test_ttft_recommendation_reads_the_p90_between_the_span_ends():
    before = [(0.5, 0.0), (1.0, 0.0), (float("inf"), 0.0)]
    after = [(0.5, 0.0), (1.0, 10.0), (float("inf"), 10.0)]  # every request between 0.5 and 1 s: p90 0.95 s
    figure, rec = a.ttft_recommendation([at(40, buckets=before), at(100, buckets=after)], 2, 0.5)
    assert figure == "TTFT p90 0.950 s (target 0.5 s)" and rec == 4
    assert a.ttft_recommendation([at(100, buckets=after)], 2, 0.5)[1] is None  # one sample: no rate
    assert a.ttft_recommendation([at(40, buckets=after), at(100, buckets=after)], 2, 0.5)[1] is None  # none streamed


def test_metric_recommendations_has_one_figure_per_target_and_a_rec_per_known_metric():
    c = autoscaling(targetTtftP90Seconds=0.5)
    figures, recs = a.metric_recommendations([], [at(100, queued=3000)], 1, c)
    assert len(figures) == 2 and figures[1].startswith("TTFT p90 unknown")
    assert recs == [(3, "queued prefill tokens")]
    assert a.metric_recommendations([], [at(100)], 1, autoscaling(targetQueuedPrefillTokens=None)) == ([], [])


def test_bounded_recommendation_takes_the_largest_limits_the_step_and_clamps():
    assert a.bounded_recommendation([(3, "queued prefill tokens"), (5, "TTFT p90")], 2, 1, 10) == (5, "TTFT p90")
    assert a.bounded_recommendation([(100, "q")], 1, 1, 50) == (5, "q")  # + 4
    assert a.bounded_recommendation([(100, "q")], 10, 1, 50) == (20, "q")  # doubled
    assert a.bounded_recommendation([(100, "q")], 10, 1, 12) == (12, "q")
    assert a.bounded_recommendation([(0, "q")], 3, 2, 12) == (2, "q")


def test_scale_up_goes_to_the_lowest_recommendation_of_its_window():
    c = autoscaling(scaleUpStabilizationSeconds=30)
    assert a.scale_up(6, 2, [(50, 9), (80, 4), (100, 6)], 100, c, "q", "m")[:2] == (4, "ScaleOut")  # 50: outside
    total, reason, message = a.scale_up(6, 2, [(80, 2), (100, 6)], 100, c, "q", "m")
    assert (total, reason) == (2, "Stabilizing") and message == "q asks 6, held by the scale-up window; m"


def test_scale_down_goes_to_the_highest_recommendation_of_a_window_watched_whole():
    c = autoscaling(scaleDownStabilizationSeconds=60, protectHitRatio=False)
    assert a.scale_down(1, 4, [(30, 9), (50, 3)], 100, c, [], "m") == (3, "ScaleIn", "4 -> 3; m")
    total, reason, message = a.scale_down(1, 4, [(50, 3)], 100, c, [], "m")  # nothing as old as the window
    assert (total, reason) == (4, "Stabilizing") and "not yet watched whole" in message
    assert a.scale_down(1, 4, [(30, 1), (50, 4)], 100, c, [], "m")[:2] == (4, "Stabilizing")


def test_scale_down_is_held_while_the_cached_token_ratio_falls():
    c = autoscaling(protectHitRatio=True, hitRatioDrop=0.02)
    falling = [at(0), at(50, cached=90, prompt=100), at(100, cached=140, prompt=200)]  # 0.9 then 0.5
    assert a.scale_down(1, 4, [], 100, c, falling, "m")[:2] == (4, "HitRatioFalling")
    steady = [at(0), at(50, cached=90, prompt=100), at(100, cached=180, prompt=200)]
    assert a.scale_down(1, 4, [], 100, c, steady, "m")[:2] == (1, "ScaleIn")
