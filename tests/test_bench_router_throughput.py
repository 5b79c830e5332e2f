"""bench/router_throughput.py's targets: CPU ratios at the rates both routers sustained, added latency at half rate."""

from __future__ import annotations

from bench_scripts import load_bench

rt = load_bench("router_throughput.py")


def step(rate, cpu, sustained=True, added_p50=0.4, added_p99=1.0):
    return {"offered_rps": rate, "sustained": sustained, "router_cpu_ms_per_request_median": cpu,
            "added_p50_ms_median": added_p50, "added_p99_ms": added_p99, "direct_p99_ms": 9.0}


def result(wf_steps, sg_steps, wf_max, sg_max):
    return {"routers": {"warmfleet": {"steps": wf_steps, "max_sustained_rps": wf_max},
                        "sglang": {"steps": sg_steps, "max_sustained_rps": sg_max}}}


def test_cpu_ratio_counts_only_rates_both_sustained():
    res = result([step(600, 0.6), step(1200, 0.45), step(2400, 0.9, sustained=False)],
                 [step(600, 0.4), step(1200, 0.3), step(2400, 0.2)], 1200, 2400)
    assert rt.cpu_ratios(res) == {"600": 1.5, "1200": 1.5}
    t = rt.verdict(res)
    assert t["warmfleet_cpu_per_request_le_1.5x_sglang"] is True
    assert t["warmfleet_sustained_rate_ge_1.0x_sglang"] is False and t["warmfleet_sustained_rate_ge_0.5x_sglang"]


def test_one_rate_over_the_ratio_fails_the_cpu_target():
    res = result([step(600, 0.61), step(1200, 0.3)], [step(600, 0.4), step(1200, 0.3)], 1200, 1200)
    assert rt.verdict(res)["warmfleet_cpu_per_request_le_1.5x_sglang"] is False
    assert rt.verdict(res)["warmfleet_sustained_rate_ge_1.0x_sglang"] is True


def test_added_latency_is_judged_at_the_step_nearest_half_the_sustained_rate():
    wf = [step(300, 0.6, added_p50=0.2, added_p99=9.0), step(600, 0.6, added_p50=1.4, added_p99=2.0),
          step(1200, 0.5, added_p50=0.1, added_p99=0.5)]
    res = result(wf, [step(r, 0.5) for r in (300, 600, 1200)], 1200, 1200)
    assert rt.half_rate_step(res)["offered_rps"] == 600
    t = rt.verdict(res)
    assert t["warmfleet_added_p50_le_1ms_at_half_rate"] is False and t["warmfleet_added_p99_le_3ms_at_half_rate"]


def test_no_sustained_rate_leaves_the_targets_undecided():
    res = result([step(600, 0.6, sustained=False)], [step(600, 0.4, sustained=False)], None, None)
    t = rt.verdict(res)
    assert t["warmfleet_cpu_per_request_le_1.5x_sglang"] is None and t["warmfleet_added_p50_le_1ms_at_half_rate"] is None
    assert t["warmfleet_sustained_rate_ge_1.0x_sglang"] is None


def test_unique_bodies_never_repeat_and_share_only_the_first_block(tiny_model_dir):
    import json

    from warmfleet.server.tokenizer import Tokenizer

    tok = Tokenizer(str(tiny_model_dir))
    words = rt.replay_workload.Words(tok, 16)
    unique = rt.UniqueBodies(words, 96)
    prompts = [json.loads(b)["prompt"] for b in unique.take(200) + unique.take(200)]  # two takes: no overlap either
    assert len(set(prompts)) == 400
    shared = "".join(unique.shared)
    assert all(p.startswith(shared) for p in prompts)
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts[:20]]
    assert all(len(i) == 96 for i in ids)  # one word, one token
    assert len({tuple(i[16:32]) for i in ids}) == 20  # the second block differs between every two prompts
