"""Two real replicas on one "node" sharing one real `warmfleet node-tier`, behind a real router (loopback)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from warmfleet.livefleet import LiveFleet, NodeTier, metric, wait_for

pytestmark = pytest.mark.slow

PROMPT = "The node tier keeps every replica's prefixes in the node's host memory for the others. " * 6


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("node-tier-live")
    nt = NodeTier(cwd).start()
    nt.wait_ready()
    lf = LiveFleet(tiny_model_dir, cwd, n=2, replica_args=nt.replica_args(),
                   router_args=("--node-tier-events", nt.events))
    try:
        lf.start()
        wait_for(lambda: [t["synced"] for t in lf.router.view()["node_tiers"]] == [True], "router synced with the "
                 "node tier", [lf.router, nt])
        yield lf, nt
    finally:
        lf.close()
        nt.stop()


def complete(url: str, prompt: str = PROMPT, salt: str | None = None, max_tokens: int = 6) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def node_blocks(lf: LiveFleet) -> int:
    return sum(t["blocks"] for t in lf.router.view()["node_tiers"])


def test_a_prefix_computed_on_one_replica_is_served_to_the_other_from_the_node_tier(fleet):
    lf, nt = fleet
    a, b = lf.replicas
    view = {r["id"]: r for r in lf.router.view()["replicas"]}
    assert {r["node"] for r in view.values()} == {nt.node_name}
    cold = complete(a.url)
    assert cached(cold) == 0
    wait_for(lambda: node_blocks(lf) >= 4, "router indexing the node tier's blocks", [lf.router, nt])
    warm = complete(b.url)
    assert cached(warm) > 0 and warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert metric(httpx.get(b.url + "/metrics").text, "warmfleet:prefix_cache_hits_total", tier="node") == cached(warm)
    # another tenant's salt shares nothing with it
    other = complete(b.url, salt="tenant-2")
    assert cached(other) == 0 and other["choices"][0]["text"] == cold["choices"][0]["text"]


def test_the_router_predicts_node_tier_hits_on_either_replica(fleet):
    lf, nt = fleet
    prompt = "A routed prompt that the node tier will hold for both replicas of the node. " * 6
    before = node_blocks(lf)
    first = httpx.post(lf.router.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert first.status_code == 200
    wait_for(lambda: node_blocks(lf) > before, "the node tier's new blocks indexed", [lf.router, nt])
    routed = httpx.post(lf.router.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert routed.status_code == 200 and routed.headers["x-warmfleet-route"].startswith("prefix_hit")
    assert cached(routed.json()) > 0


def test_the_node_tier_killed_mid_run_costs_no_request_and_comes_back_empty(fleet):
    lf, nt = fleet
    prompts = [f"Request {i} about a node tier that dies while serving. " * 5 for i in range(12)]
    expected = {p: complete(lf.replicas[0].url, p, salt="reference", max_tokens=4)["choices"][0]["text"]
                for p in prompts}

    def run(p: str) -> str:
        r = httpx.post(lf.router.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, p) for p in prompts[:6]]
        nt.kill()
        futures += [pool.submit(run, p) for p in prompts[6:]]
        assert [f.result() for f in futures] == [expected[p] for p in prompts]
    wait_for(lambda: node_blocks(lf) == 0, "router forgetting the dead node tier", [lf.router])
    assert [run(p) for p in prompts[:3]] == [expected[p] for p in prompts[:3]]  # still serving, recomputing
    nt.start()
    nt.wait_ready()
    wait_for(lambda: [t["synced"] for t in lf.router.view()["node_tiers"]] == [True], "node tier back", [lf.router, nt])
    assert node_blocks(lf) == 0  # it came back empty and said so
    fresh = (f"A prompt no replica has seen, number {i}, about node tiers coming back. " * 5 for i in range(1000))
    wait_for(lambda: (run(next(fresh)) and node_blocks(lf) > 0), "the new node tier filling", [lf.router, nt],
             timeout_s=60)
