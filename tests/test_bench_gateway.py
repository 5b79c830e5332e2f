"""bench/gateway.py's pure parts: the issue's targets (gateway_report.py), lwepp's Envoy changes and its
InferencePool objects (gateway_fronts.py), and the /proc CPU accounting it takes from bench/harness.py."""

from __future__ import annotations

import pytest

from bench_scripts import load_bench

gateway_fronts = load_bench("gateway_fronts.py")
gateway_report = load_bench("gateway_report.py")
harness = load_bench("harness.py")


def stat(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    """A /proc/PID/stat line (52 fields) with these values and zeros elsewhere."""
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime), str(cutime), str(cstime)] + ["0"] * 37
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def test_parse_stat_counts_fields_after_the_last_parenthesis():
    p = harness.parse_stat(stat(41, "weird) name (x", 7, 100, 20, 3, 4))
    assert (p.pid, p.ppid, p.self_ticks, p.reaped_children_ticks) == (41, 7, 120, 7)


def test_parse_stat_of_this_process():
    with open("/proc/self/stat") as f:
        p = harness.parse_stat(f.read())
    assert p.self_ticks >= 0 and p.ppid > 0


def test_tree_ticks_counts_live_descendants_and_reaped_children_once():
    procs = [harness.parse_stat(line) for line in (
        stat(10, "envoy", 1, 5, 5),  # a root
        stat(11, "worker", 10, 2, 1, cutime=4),  # live child, which reaped its own child (4 ticks)
        stat(12, "grandchild", 11, 1, 0),
        stat(20, "lwepp", 1, 7, 0, cutime=1, cstime=1),  # the other root
        stat(30, "unrelated", 1, 1000, 1000),
        stat(31, "unrelated child", 30, 50, 50),
    )]
    assert harness.tree_ticks(procs, [10]) == 10 + 3 + 4 + 1
    assert harness.tree_ticks(procs, [10, 20]) == 18 + 9
    assert harness.tree_ticks(procs, [11, 10]) == 18  # a root inside another root's tree counts once
    assert harness.tree_ticks(procs, [99]) == 0  # gone: nothing
    assert gateway_report.per_1000(0.5, 250) == 2.0 and gateway_report.per_1000(None, 10) is None


def test_net_of_idle_takes_the_idle_rate_over_the_run():
    assert gateway_report.net_of_idle(3.0, 0.5, 5.0, 20.0) == 1.0  # 0.1 CPU s/s idle over a 20 s run
    assert gateway_report.net_of_idle(1.0, 1.0, 5.0, 20.0) == 0.0  # never negative
    assert gateway_report.net_of_idle(None, 0.5, 5.0, 20.0) is None and gateway_report.net_of_idle(1.0, None, 5.0, 20.0) is None
    assert gateway_report.total({"envoy": 0.25, "epp": 0.5}) == 0.75 and gateway_report.total(None) == 0.0


def test_cpu_seconds_of_this_process_grows_with_work():
    import os

    before = harness.cpu_seconds({"me": os.getpid()})["me"]
    assert sum(range(20_000_000)) > 0  # a few hundred ms of CPU: many clock ticks
    assert harness.cpu_seconds({"me": os.getpid()})["me"] > before


def front(ratio, p90=1.0, cpu=None):
    return {"cached_ratio": ratio, "ttft_p90_s": p90, "cpu_s_per_1000_requests": cpu}


def test_verdict_all_targets_met():
    t = gateway_report.verdict({"proxy": front(0.60, 1.0, 10.0), "epp": front(0.59, 0.9, 8.0),
                         "lwepp": front(0.40, 0.5, 3.0), "rr": front(0.41), "sglang": front(0.50, 0.8, 5.0)})
    assert t["epp_ratio_within_0.02_of_proxy"] and t["epp_ratio_ahead_of_lwepp_and_peers"]
    assert t["epp_ttft_p90_le_proxy"] and t["epp_cpu_per_request_below_proxy"]
    assert t["epp_minus_proxy_ratio"] == -0.01 and t["epp_minus_best_other_ratio"] == 0.09
    assert t["epp_cpu_vs_proxy"] == 0.8 and "lwepp_measured" not in t


def test_verdict_each_target_can_fail():
    t = gateway_report.verdict({"proxy": front(0.60, 1.0, 10.0), "epp": front(0.55, 1.1, 12.0), "sglang": front(0.56)})
    assert not t["epp_ratio_within_0.02_of_proxy"]  # 0.05 behind
    assert not t["epp_ratio_ahead_of_lwepp_and_peers"]  # sglang is ahead
    assert not t["epp_ttft_p90_le_proxy"] and not t["epp_cpu_per_request_below_proxy"]
    assert t["lwepp_measured"] is False
    assert not gateway_report.verdict({"proxy": front(0.60), "epp": front(0.65)})["epp_ratio_within_0.02_of_proxy"]


def test_verdict_needs_the_epp_and_the_proxy():
    assert gateway_report.verdict({"proxy": front(0.6), "rr": front(0.4)}) == {}
    assert gateway_report.verdict({"epp": front(0.6)}) == {}
    t = gateway_report.verdict({"proxy": front(0.6, 1.0, None), "epp": front(0.6, 1.0, 1.0)})
    assert "epp_cpu_per_request_below_proxy" not in t  # the proxy's CPU unknown: no verdict either way


def test_verdict_against_proxy_mode_behind_the_same_gateway():
    """gateway-proxy (Envoy + warmfleet route) is compared on CPU, and is no rival on cached ratio (it is warmfleet)."""
    res = {"proxy": front(0.60, 1.0, 10.0), "epp": front(0.59, 0.9, 14.0), "gateway-proxy": front(0.70, 1.0, 15.0)}
    t = gateway_report.verdict(res)
    assert t["epp_cpu_per_request_below_gateway_proxy"] and t["epp_cpu_vs_gateway_proxy"] == 0.933
    assert not t["epp_cpu_per_request_below_proxy"]
    assert "epp_ratio_ahead_of_lwepp_and_peers" not in t  # no rival measured
    res["gateway-proxy"] = front(0.70, 1.0, 12.0)
    assert not gateway_report.verdict(res)["epp_cpu_per_request_below_gateway_proxy"]


def test_for_gateway_proxy_leaves_envoy_forwarding_to_the_pool():
    from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig
    from warmfleet.server.router.epp.envoy_bootstrap import bootstrap as build

    boot = build(GatewayConfig(endpoints=["127.0.0.1:9000"]))
    gateway_fronts.for_gateway_proxy(boot)
    assert [f["name"] for f in gateway_fronts.http_filters(boot)] == ["envoy.filters.http.router"]
    assert [c["name"] for c in boot["static_resources"]["clusters"]] == ["inference_pool"]


def bootstrap() -> dict:
    ext_proc = {"name": "envoy.filters.http.ext_proc", "typed_config": {"processing_mode": {
        "request_header_mode": "SEND", "response_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"}}}
    hcm = {"http_filters": [ext_proc, {"name": "envoy.filters.http.router"}]}
    return {"static_resources": {"listeners": [{"filter_chains": [{"filters": [{"typed_config": hcm}]}]}]}}


def test_for_lwepp_buffers_the_body_and_streams_it_without_waiting():
    boot = gateway_fronts.for_lwepp(bootstrap())
    names = [f["name"] for f in gateway_fronts.http_filters(boot)]
    assert names == ["envoy.filters.http.buffer", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    cfg = gateway_fronts.http_filters(boot)[1]["typed_config"]
    assert cfg["send_body_without_waiting_for_header_response"] is True
    assert cfg["processing_mode"] == {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                      "request_body_mode": "STREAMED", "response_body_mode": "NONE",
                                      "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}


@pytest.mark.parametrize("edit", ["for_lwepp", "for_gateway_proxy"])
def test_envoy_accepts_the_bench_bootstraps(tmp_path, edit):
    """The generator's bootstrap with for_lwepp's (or for_gateway_proxy's) changes, validated by the real Envoy
    (WARMFLEET_ENVOY)."""
    import json
    import subprocess

    from envoy_gateway import envoy_binary
    from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig, bootstrap

    boot = bootstrap(GatewayConfig(epp="127.0.0.1:9002", listen_port=8081, admin_port=None,
                                   endpoints=["127.0.0.1:8001", "127.0.0.1:8002"]))
    getattr(gateway_fronts, edit)(boot)
    path = tmp_path / f"{edit}.json"
    path.write_text(json.dumps(boot))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_inference_pool_and_pods_for_lwepp():
    pool = gateway_fronts.pool_manifest([8001, 8002], 9002)
    assert pool["spec"]["targetPorts"] == [{"number": 8001}, {"number": 8002}]
    assert pool["spec"]["selector"]["matchLabels"] == {"app": gateway_fronts.POD_LABEL}
    pod = gateway_fronts.pod_manifest(1, 8002)
    assert pod["metadata"]["labels"] == {"app": gateway_fronts.POD_LABEL}
    assert pod["metadata"]["annotations"] == {"inference.networking.k8s.io/active-ports": "8002"}
    with pytest.raises(ValueError):
        gateway_fronts.pool_manifest(list(range(8000, 8009)), 9002)  # the CRD's maxItems is 8


def test_summary_means_runs_and_cpu_per_process_role():
    runs = [{"cached_ratio": 0.5, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "errors": 0, "spread": 1.0,
             "cpu_s": 3.0, "cpu_s_per_1000_requests": 50.0, "rate": 4.0, "seed": s,
             "cpu_s_by_process": {"envoy": 1.0 + s, "epp": 2.0 - s}} for s in (0, 1)]
    out = gateway_report.summary(runs)
    assert out["cpu_s_by_process"] == {"envoy": 1.5, "epp": 1.5}
    assert out["cached_ratio"] == 0.5 and "seed" not in out
    rr = gateway_report.summary([dict(runs[0], cpu_s=None, cpu_s_per_1000_requests=None, cpu_s_by_process=None)])
    assert rr["cpu_s_per_1000_requests"] is None and "cpu_s_by_process" not in rr


def test_ext_proc_floor_measures_every_stack_it_lists(capsys, monkeypatch):
    """bench/ext_proc_floor.py end to end on a few streams: one positive CPU figure per stack, per-round-trip
    figures consistent with the per-stream ones."""
    import json
    import sys

    floor = load_bench("ext_proc_floor.py")
    monkeypatch.setattr(sys, "argv", ["ext_proc_floor.py", "--streams", "64", "--concurrency", "4", "--rounds", "1",
                                      "--messages", "4"])
    assert floor.main() == 0
    out = json.loads(capsys.readouterr().out)
    per_stream, per_trip = out["server_cpu_ms_per_stream"], out["server_cpu_us_per_round_trip"]
    assert set(per_stream) == set(floor.stacks()) >= {"grpc.aio", "grpc.aio+uvloop", "grpc-threads"}
    for stack, ms in per_stream.items():
        assert ms > 0, stack
        assert per_trip[stack] == pytest.approx(ms * 1000 / 4, rel=0.01)


def sim_front(rates: dict) -> dict:
    """A --sim-rates front summary: rate -> CPU ms per request by process."""
    return {"idle_cpu_s_per_s": 0.01, "rates": {r: {"cpu_ms_per_request": round(sum(by.values()), 3),
                                                    "cpu_ms_per_request_by_process": by} for r, by in rates.items()}}


def test_sim_verdict_compares_the_tier_and_envoy_alone_with_the_proxy_at_every_rate():
    proxy = sim_front({"100.0": {"router": 1.0}, "400.0": {"router": 0.8}})
    epp = sim_front({"100.0": {"envoy": 0.5, "epp": 0.4}, "400.0": {"envoy": 0.9, "epp": 0.5}})
    v = gateway_report.sim_verdict({"proxy": proxy, "epp": epp})
    assert v["sim_epp_cpu_vs_proxy"] == {"100.0": 0.9, "400.0": 1.75}
    assert v["sim_epp_cpu_below_proxy"] is False  # below at 100/s only: every rate must be
    assert v["sim_envoy_alone_vs_proxy"] == {"100.0": 0.5, "400.0": 1.125}
    assert v["sim_envoy_alone_below_proxy"] is False
    cheap = sim_front({"100.0": {"envoy": 0.5, "epp": 0.4}, "400.0": {"envoy": 0.3, "epp": 0.4}})
    v = gateway_report.sim_verdict({"proxy": proxy, "epp": cheap})
    assert v["sim_epp_cpu_below_proxy"] is True and v["sim_envoy_alone_below_proxy"] is True
    assert gateway_report.sim_verdict({"proxy": proxy}) == {}


def test_sim_chart_draws_every_front_and_rate(tmp_path):
    res = {"sim": {"replicas": 2, "rates": [100.0, 400.0], "fronts": {
        "proxy": sim_front({"100.0": {"router": 1.0}, "400.0": {"router": 0.8}}),
        "epp": sim_front({"100.0": {"envoy": 0.5, "epp": 0.4}, "400.0": {"envoy": 0.9, "epp": 0.5}})}}}
    for f in res["sim"]["fronts"].values():
        for r in f["rates"].values():
            r.update(p50_ms=2.0, p99_ms=9.0)
    gateway_report.sim_chart(res, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 10_000
