"""bench/routing.py's image variants (routing_workload.py, routing_report.py): images recur across conversations, the URL trace is the same requests, targets."""

from __future__ import annotations

import base64

import httpx

from bench_scripts import load_bench
from warmfleet.livefleet import MediaServer

routing_report = load_bench("routing_report.py")
routing_workload = load_bench("routing_workload.py")


def images_of(msgs: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for m in msgs if isinstance(m["content"], list) for p in m["content"]
            if p.get("type") == "image_url"]


def test_images_recur_across_conversations_that_share_no_system_prompt():
    trace = routing_workload.recurring_image_workload(0, 40)
    firsts = [msgs for msgs in trace if len(msgs) == 2]  # a conversation's first turn
    systems = [msgs[0]["content"] for msgs in firsts]
    assert len(set(systems)) == len(systems) >= 10  # every conversation its own text before the image
    image_per_conv = [images_of(msgs)[0] for msgs in firsts]
    assert len(set(image_per_conv)) < len(image_per_conv)  # ... and images recur among them
    assert any(len(msgs) > 2 for msgs in trace)  # later turns carry the history


def test_the_url_trace_is_the_same_requests_with_the_same_bytes(tmp_path):
    trace = routing_workload.recurring_image_workload(1, 12)
    with MediaServer(tmp_path) as media:
        by_url = routing_workload.by_url(trace, media)
        assert [len(m) for m in by_url] == [len(m) for m in trace]
        for inline, remote in zip(trace, by_url):
            for data, url in zip(images_of(inline), images_of(remote)):
                assert url.startswith(media.url + "/")
                assert httpx.get(url).content == base64.b64decode(data.split(",", 1)[1])
            assert [m["role"] for m in inline] == [m["role"] for m in remote]


def test_image_targets():
    res = {"sglang": {"ttft_p90_s": 0.2}, "vllm": {"ttft_p90_s": 0.1},
           "warmfleet": {"ttft_p90_s": 0.079, "encoder_hits_predicted": 9, "encoder_hits_reported": 10}}
    v = routing_report.image_verdict(res)
    assert v["image_ttft_p90_le_0_8_best_peer"] and v["image_ttft_p90_vs_best_peer"] == 0.79
    assert v["encoder_hits_predicted_match_reported"]
    res["warmfleet"].update(ttft_p90_s=0.09, encoder_hits_predicted=3)
    v = routing_report.image_verdict(res)
    assert not v["image_ttft_p90_le_0_8_best_peer"] and not v["encoder_hits_predicted_match_reported"]
