"""Two real `warmfleet serve` replicas with three LoRA adapters (one device slot each) behind a real `warmfleet route`:
the router's prediction equals the replica's cached_tokens per adapter, adapters never share blocks, affinity."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from warmfleet.livefleet import LiveFleet, wait_for
from warmfleet.server.tiny_checkpoints.lora import make_tiny_adapter

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "golden_lora" / "qwen2_tiny"
SYSTEM = "You are the warmfleet assistant. Answer briefly and precisely about adapters and routing. " * 6


@pytest.fixture(scope="module")
def lora_fleet(tiny_model_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("lora-live")  # never the repo root: its operator/ folder shadows the stdlib
    c = make_tiny_adapter(tiny_model_dir, cwd / "c", seed=3)
    modules = [f"a={GOLDEN / 'a'}", f"b={GOLDEN / 'b'}", f"c={c}"]
    fleet = LiveFleet(tiny_model_dir, cwd, replica_args=("--kv-cache-memory", "0.05", "--lora-modules", *modules,
                                                         "--max-loras", "1", "--max-cpu-loras", "3")).start()
    try:
        wait_for(lambda: all((x["adapters"] or {}).get("max_loras") == 1 for x in fleet.router.view()["replicas"]),
                 "the router synced with both replicas and learned their adapters", [fleet.router])
        yield fleet
    finally:
        fleet.close()


def ask(router: str, model: str, question: str, system: str = SYSTEM) -> tuple[str, int, int]:
    """(replica, predicted cached tokens, the replica's cached tokens)."""
    r = httpx.post(router + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    predicted = int(r.headers["x-warmfleet-route"].rsplit("predicted_cached_tokens=", 1)[1])
    return r.headers["x-warmfleet-replica"], predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def view(router: str) -> dict:
    return {x["id"]: x for x in httpx.get(router + "/v1/router/replicas").json()["replicas"]}


def url_of(fleet: LiveFleet, replica_id: str) -> str:
    return fleet.by_id(replica_id).url


def test_prediction_equals_the_replicas_cached_tokens_per_adapter(lora_fleet):
    router = lora_fleet.router.url
    system = "Per-adapter test. " + SYSTEM
    for model in ("a", "b", "c", "tiny"):
        before = {rid: x["gpu_blocks"] for rid, x in view(router).items()}
        home, predicted, cached = ask(router, model, "What is an adapter?", system=system)
        assert predicted == 0 and cached == 0  # the same text under every other adapter: none of their blocks
        url = url_of(lora_fleet, home)
        wait_for(lambda: view(router)[url]["gpu_blocks"] > before[url], "the replica's events indexed", [])
        for q in ("And a slot?", "And a rank?"):
            replica, predicted, cached = ask(router, model, q, system=system)
            assert replica == home, model  # the adapter's prefix (and the adapter) are there
            assert cached > 0 and predicted == cached, model  # our chain root with the adapter's digest: exact


def test_the_router_knows_what_each_replica_serves_and_holds(lora_fleet):
    router = lora_fleet.router.url
    home, _, _ = ask(router, "b", "Which replica holds b?", system="Residency test. " + SYSTEM)
    wait_for(lambda: view(router)[url_of(lora_fleet, home)]["adapters"]["resident"] == ["b"],
             "the replica's lora_requests_info scraped", [])
    entry = view(router)[url_of(lora_fleet, home)]["adapters"]
    assert entry["served"] == ["a", "b", "c"] and entry["max_loras"] == 1
    # a new conversation for b goes where b is resident (nothing cached of it anywhere)
    replica, predicted, _ = ask(router, "b", "Fresh question?", system="Another conversation. " + SYSTEM)
    assert replica == home and predicted == 0


def test_a_streamed_adapter_request_is_booked_until_its_last_byte(lora_fleet):
    router = lora_fleet.router.url
    with httpx.stream("POST", router + "/v1/chat/completions", timeout=60, json={
            "model": "c", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "Stream from c, please."}]}) as r:
        assert r.status_code == 200
        url = url_of(lora_fleet, r.headers["x-warmfleet-replica"])
        body = "".join(r.iter_text())
    assert "[DONE]" in body
    wait_for(lambda: view(router)[url]["adapters"]["in_flight"] == {}, "the stream's adapter booking released", [])
    assert "c" in view(router)[url]["adapters"]["resident"]
