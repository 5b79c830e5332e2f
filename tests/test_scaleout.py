"""bench/scaleout.py's runs and figures (scaleout_runners.py, scaleout_report.py) in a tiny bounded run: the real
router over simulated replicas under load gains a replica, loses one with drain, and replaces both one by one; no
client sees an error and the joiner takes no normal request before its warm-up replays are done (order of arrivals
in its own log, no timing)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from bench_scripts import load_bench

pytestmark = pytest.mark.slow


scaleout_report = load_bench("scaleout_report.py")
scaleout_runners = load_bench("scaleout_runners.py")


def test_scale_in_with_drain_loses_no_request_and_the_joiner_waits_for_its_warm_up(tiny_model_dir):
    with tempfile.TemporaryDirectory(prefix="scaleout-test-") as cwd:
        res = scaleout_runners.run_config("warmfleet", Path(tiny_model_dir), n=2, rate=8.0, warm_in_s=3.0, window_s=3.0,
                                  gpu_blocks=512, cwd=cwd, router_extra=["--warmup-budget-s", "3"])
    w, joiner = res["windows"], res["joiner"]
    assert w["scale_in"]["requests"] > 0 and w["scale_in"]["errors"] == 0, w["scale_in"]
    assert w["rolling_update"]["requests"] > 0 and w["rolling_update"]["errors"] == 0, w["rolling_update"]
    assert res["total_errors"] == 0
    # the joiner was warmed (replays of the router's hot prefixes), then served normal traffic, never before
    assert joiner["warmup_replays"] > 0 and joiner["first_requests"] > 0, joiner
    assert joiner["normal_requests_before_last_replay"] == 0, joiner
    # the scaled-in replica stays drained (a static member that is gone); every replaced one's drain ended
    states = sorted((r["draining"], r["state"]) for r in res["router_replicas"])
    assert states == [(False, "ready")] * (len(states) - 1) + [(True, "drained")], states


def test_autoscale_helpers_count_in_flight_requests_and_replica_seconds():
    text = ('# TYPE warmfleet_router_replica_in_flight gauge\n'
            'warmfleet_router_replica_in_flight{replica="http://a"} 3\n'
            'warmfleet_router_replica_in_flight{replica="http://b"} 2\n'
            '# TYPE warmfleet_router_replica_queued_tokens gauge\n'
            'warmfleet_router_replica_queued_tokens{replica="http://a"} 700\n')
    assert scaleout_runners.in_flight(text) == 5.0
    # 2 replicas for 10 s, 4 for 5 s, 3 until the end at 20 s
    assert scaleout_report.replica_seconds([(0.0, 2), (10.0, 4), (15.0, 3)], 20.0) == 55.0
    two = {"all": {"cached_ratio": 0.8}, "total_errors": 0, "scale_outs": 1, "scale_ins": 1}
    worse = {"all": {"cached_ratio": 0.7}, "total_errors": 2, "scale_outs": 1, "scale_ins": 0}
    assert scaleout_report.verdict_auto({"cache_aware": two, "queue_only": worse}) == {
        "autoscale_cache_aware_zero_client_errors": True, "autoscale_cache_aware_scaled_out_and_in": True,
        "autoscale_cache_aware_cached_ratio_ge_queue_only": True}
    assert scaleout_report.verdict_auto({"cache_aware": worse, "queue_only": two}) == {
        "autoscale_cache_aware_zero_client_errors": False, "autoscale_cache_aware_scaled_out_and_in": False,
        "autoscale_cache_aware_cached_ratio_ge_queue_only": False}


def test_the_operators_decide_in_the_loop_scales_the_fleet_out_under_a_load_step(tiny_model_dir):
    phases = [("warm_in", 4.0, 3.0), ("low", 4.0, 2.0), ("high", 24.0, 8.0), ("low_again", 4.0, 2.0)]
    with tempfile.TemporaryDirectory(prefix="scaleout-auto-test-") as cwd:
        res = scaleout_runners.run_autoscale("cache_aware", Path(tiny_model_dir), lo=1, hi=3, phases=phases, target=1,
                                     window_s=2, up_s=0, down_s=2, interval_s=0.5, gpu_blocks=512, cwd=cwd,
                                     router_extra=["--warmup-budget-s", "2"])
    assert res["total_requests"] > 0 and res["total_errors"] == 0, res["all"]
    # a target of 1 queued prefill token per replica: the step's uncached prompt work asks for more replicas
    assert res["scale_outs"] > 0 and res["decision_reasons"].get("ScaleOut", 0) > 0, res["decision_reasons"]
    counts = [n for _, n in res["timeline"]]
    assert min(counts) >= 1 and max(counts) <= 3, res["timeline"]
    assert res["autoscaling"] == {"metric": "queued_prefill_tokens", "target_per_replica": 1, "protect_hit_ratio": True,
                                  "warmup": True, "scale_in_victim": "coldest"}
