"""bench/harness.py: the spread counts a replica that got nothing, quantiles skip missing values, routers' commands and sync."""

from __future__ import annotations

import random
import sys
from collections import OrderedDict

import pytest

from bench_scripts import load_bench

harness = load_bench("harness.py")


def test_spread_is_over_every_replica_of_the_fleet():
    assert harness.spread([10, 10, 10, 10], 4) == 1.0
    assert harness.spread([40], 4) == 4.0  # all on one of four: not 1.0 (the mean over used replicas)
    assert harness.spread([30, 10, 0, 0], 4) == harness.spread([30, 10], 4) == 3.0
    assert harness.spread([], 4) is None and harness.spread([0, 0], 2) is None
    with pytest.raises(ValueError):
        harness.spread([1, 1, 1], 2)


def test_routing_and_trace_report_the_same_spread():
    rec = [{"i": i, "error": None, "ttft": 0.1, "cached": 0, "prompt": 10, "replica": "b0", "route": None}
           for i in range(8)]
    assert load_bench("routing_report.py").summarize(rec, 4)["spread"] == 4.0


def test_quantile_skips_missing_values():
    assert harness.quantile([None, 3.0, 1.0, 2.0], 0.5) == 2.0
    assert harness.quantile([None], 0.9) is None


def test_lru_prefix_hits_leading_blocks_and_evicts_the_oldest():
    seen: OrderedDict = OrderedDict()
    assert harness.lru_prefix(seen, ["a", "b"], 3) == 0
    assert harness.lru_prefix(seen, ["a", "c"], 3) == 1
    assert harness.lru_prefix(seen, ["d"], 3) == 0 and "b" not in seen  # b was the least recent


def test_a_router_is_in_sync_when_every_replica_it_waits_for_is_healthy_and_synced():
    view = [{"id": "a", "healthy": True, "synced": True}, {"id": "b", "healthy": True, "synced": False},
            {"id": "c", "healthy": True}]  # c has nothing to replay
    assert not harness.in_sync(view)
    assert harness.in_sync(view, ids={"a", "c"}) and not harness.in_sync(view, ids={"a", "c"}, count=3)
    assert not harness.in_sync([{"id": "a", "healthy": False, "synced": True}])


def test_route_command_puts_every_replica_after_the_flags():
    cmd = harness.route_command("/m", 8000, 16, ["http://r0,events=tcp://e0", "http://r1,events=tcp://e1"],
                                ["--engine", "vllm"])
    assert cmd[len(harness.EXE):] == ["route", "--model", "/m", "--port", "8000", "--block-size", "16",
                                      "--log-level", "warning", "--engine", "vllm",
                                      "--replica", "http://r0,events=tcp://e0", "--replica", "http://r1,events=tcp://e1"]
    with pytest.raises(ValueError):
        harness.peer_command("nginx", [], 1, 2, [])


def fake_proc(root, procs: dict) -> None:
    """A /proc with `procs`: pid -> (ppid, {tid: (on-CPU ns, run-queue ns)}); the command holds ') ' as some do."""
    for pid, (ppid, tasks) in procs.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} (a) b) S {ppid} 1 1 0 -1\n")
        for tid, (cpu, wait) in tasks.items():
            (root / str(pid) / "task" / str(tid)).mkdir(parents=True)
            (root / str(pid) / "task" / str(tid) / "schedstat").write_text(f"{cpu} {wait} 7\n")
    (root / "self").mkdir()


def test_schedstat_sums_every_thread_of_the_tree_and_nothing_else(tmp_path):
    fake_proc(tmp_path, {10: (1, {10: (100, 5), 11: (50, 20)}), 12: (10, {12: (7, 3)}), 13: (12, {13: (1, 1)}),
                         20: (1, {20: (1000, 1000)})})
    assert sorted(harness.tree_pids([10], tmp_path)) == [10, 12, 13]
    assert harness.schedstat_ns([10], tmp_path) == (158, 29)
    assert harness.sched_per_request((0, 0), (4_000_000, 6_000_000), 2) == {
        "router_cpu_ms_per_request": 2.0, "router_runq_wait_ms_per_request": 3.0, "router_runq_wait_over_cpu": 1.5}


def test_quantile_ratio_interval_brackets_the_ratio_and_narrows_with_more_samples():
    rng = random.Random(1)
    small_a, small_b = ([rng.expovariate(20) for _ in range(120)] for _ in range(2))
    big_a, big_b = ([rng.expovariate(20) for _ in range(4000)] for _ in range(2))
    lo, hi = harness.quantile_ratio_interval(small_a, small_b, 0.9)
    assert lo < 1.0 < hi  # the same distribution: the interval holds 1
    blo, bhi = harness.quantile_ratio_interval(big_a, big_b, 0.9)
    assert blo < 1.0 < bhi and bhi - blo < (hi - lo) / 3  # 33x the samples: a far narrower interval
    slow = [2 * x for x in big_b]  # twice as slow: the interval holds 2, not 1
    slo, shi = harness.quantile_ratio_interval(big_a, slow, 0.9)
    assert 1.0 < slo < 2.0 < shi
    assert harness.quantile_ratio_interval([], small_b, 0.9) is None


def test_trace_spread_arrivals_fills_each_timestamp_gap_in_order():
    reqs = [{"i": i, "t": t} for i, t in enumerate([0.0, 0.0, 0.0, 3.0, 3.0, 9.0, 9.0])]
    load_bench("replay_workload.py").spread_arrivals(reqs)
    assert [r["t"] for r in reqs] == [0.0, 1.0, 2.0, 3.0, 6.0, 9.0, 11.25]  # the last group: the median gap, 4.5
    assert [r["i"] for r in sorted(reqs, key=lambda r: r["t"])] == list(range(7))


def test_trace_verdict_holds_three_routers_to_issue_26s_bounds():
    verdict = load_bench("replay_report.py").verdict

    def run(ratio, p90, spread=1.0):
        return {"cached_ratio": ratio, "ttft_p90_s": p90, "spread": spread, "errors": 0}

    t = verdict({"warmfleet": run(0.30, 0.40), "warmfleet@3": run(0.295, 0.43)}, fleet_lru=0.31)
    assert t["ratio_ok_fleet_lru"] and not t["ratio_ge_0.97_fleet_lru"]  # 0.968 x the bound
    assert t["active_active_3_within_0.01"] and t["active_active_3_ttft_p90_le_1.1x"]  # 1.075x
    t = verdict({"warmfleet": run(0.30, 0.40), "warmfleet@3": run(0.285, 0.45)}, fleet_lru=0.30)
    assert t["ratio_ge_0.97_fleet_lru"] and t["active_active_3_within_0.02"]
    assert not t["active_active_3_within_0.01"] and not t["active_active_3_ttft_p90_le_1.1x"]  # 0.015 apart, 1.125x


def test_no_bench_script_takes_a_standard_library_modules_name():
    """bench/ goes on sys.path when a script runs: a script named after a stdlib module would shadow it."""
    scripts = {p.stem for p in harness.BENCH.glob("*.py")} | {p.name for p in harness.BENCH.iterdir() if p.is_dir()}
    assert "harness" in scripts and "trace_replay" in scripts  # the folder this test reads is bench/
    assert sorted(scripts & sys.stdlib_module_names) == []
