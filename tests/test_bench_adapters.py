"""bench/adapters.py's pure parts: the Zipf adapter workload, the adapter-load scrape and the issue's targets."""

from __future__ import annotations

from bench_scripts import load_bench

adapters = load_bench("adapters.py")

NAMES = [f"lora-{i}" for i in range(6)]


def test_workload_is_seeded_skewed_and_shares_prompts_per_adapter():
    models, trace = adapters.workload(0, 400, NAMES, 2, 1.1)
    assert (models, trace) == adapters.workload(0, 400, NAMES, 2, 1.1)
    counts = sorted((models.count(n) for n in NAMES), reverse=True)
    assert counts[0] > 3 * counts[-1]  # Zipf: the hottest adapter far above the coldest
    for name in NAMES:  # each adapter's requests share its 2 system prompts, no other adapter's
        systems = {t[0]["content"] for m, t in zip(models, trace) if m == name}
        assert 1 <= len(systems) <= 2 and all(s.startswith(f"You are the {name} assistant") for s in systems)
    assert len({t[1]["content"] for t in trace}) > 300  # fresh questions


def test_device_loads_are_read_from_the_replicas_counter():
    page = ('# TYPE warmfleet:lora_device_loads counter\n'
            'warmfleet:lora_device_loads_total{model_name="bench"} 17.0\n'
            'warmfleet:lora_disk_loads_total{model_name="bench"} 5.0\n')
    assert float(adapters.LOADS.search(page).group(1)) == 17.0


def row(ratio, p90, loads, spread):
    return {"cached_ratio": ratio, "ttft_p90_s": p90, "adapter_loads_per_1000": loads, "spread": spread}


def test_targets_compare_warmfleet_with_every_peer_and_round_robin():
    res = {"rr": row(0.5, 0.05, 400, 1.0), "sglang": row(0.6, 0.06, 300, 1.9), "vllm": row(0.55, 0.04, 350, 1.1),
           "warmfleet": row(0.7, 0.045, 150, 1.2)}
    t = adapters.verdict(res)
    assert t == {"spread_ok": True, "adapter_loads_le_half_rr": True, "cached_ratio_ahead_of_every_peer": True,
                 "ttft_p90_ahead_of_every_peer": False}  # vllm's p90 is lower
    res["warmfleet"] = row(0.7, 0.03, 250, 1.3)
    t = adapters.verdict(res)
    assert not t["adapter_loads_le_half_rr"] and not t["spread_ok"] and t["ttft_p90_ahead_of_every_peer"]
    assert adapters.verdict({"rr": res["rr"]}) == {}
