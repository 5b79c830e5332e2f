"""bench/scaleout.py in a tiny bounded run: the real router over simulated replicas under load gains a replica,
loses one with drain, and replaces both one by one; no client sees an error and the joiner takes no normal
request before its warm-up replays are done (order of arrivals in its own log, no timing)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from bench_scripts import load_bench

pytestmark = pytest.mark.slow


scaleout = load_bench("scaleout.py", "wf_test_scaleout")


def test_scale_in_with_drain_loses_no_request_and_the_joiner_waits_for_its_warm_up(tiny_model_dir):
    with tempfile.TemporaryDirectory(prefix="scaleout-test-") as cwd:
        res = scaleout.run_config("warmfleet", Path(tiny_model_dir), n=2, rate=8.0, warm_in_s=3.0, window_s=3.0,
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
