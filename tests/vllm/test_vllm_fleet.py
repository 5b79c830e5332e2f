"""Two real vLLM replicas behind `warmfleet route --engine vllm`: exact prediction from vLLM's own KV events."""

from __future__ import annotations

import base64
import io
import time

import httpx
from PIL import Image

from .conftest import wait_for

SYSTEM = "You are the warmfleet assistant. Answer briefly and precisely about caches and routing. " * 8
A, B = {"authorization": "Bearer key-tenant-a"}, {"authorization": "Bearer key-tenant-b"}


def ask(fleet, question: str, headers=A, system: str = SYSTEM, messages=None) -> tuple[str, int, int]:
    """(replica, predicted cached tokens, vLLM's cached tokens) of one chat request through the router."""
    messages = messages or [{"role": "system", "content": system}, {"role": "user", "content": question}]
    r = httpx.post(fleet.router + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": "tiny", "max_tokens": 2, "messages": messages})
    assert r.status_code == 200, r.text
    route = r.headers["x-warmfleet-route"]
    predicted = int(route.rsplit("predicted_cached_tokens=", 1)[1])
    return r.headers["x-warmfleet-replica"], predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def blocks_on(fleet, replica: str) -> int:
    return fleet.replicas_view()[replica]["gpu_blocks"]


def test_shared_prefix_lands_where_vllm_holds_it_and_prediction_is_exact(vllm_fleet):
    f = vllm_fleet
    system = "Prefix test. " + SYSTEM
    first, predicted, cached = ask(f, "What is a KV cache?", system=system)
    assert predicted == 0 and cached == 0
    wait_for(lambda: blocks_on(f, first) >= 8, "vLLM's BlockStored events in the router's index", [], 10)
    for q in ("And what is a block?", "And what is eviction?", "And the swap tier?"):
        replica, predicted, cached = ask(f, q, system=system)
        assert replica == first
        assert cached > 0 and predicted == cached  # vLLM's own count equals the router's prediction
    check = httpx.get(f.router + "/v1/router/replicas").json()["hash_check"]
    assert check["checked_blocks"] > 0 and check["mismatched_blocks"] == 0


def test_a_tenant_never_hits_another_tenants_blocks(vllm_fleet):
    f = vllm_fleet
    system = "Tenant test. " + SYSTEM
    home, _, _ = ask(f, "Secret question?", headers=A, system=system)
    wait_for(lambda: blocks_on(f, home) >= 8, "tenant A's blocks in the index", [], 10)
    _, predicted, cached = ask(f, "Secret question?", headers=B, system=system)
    assert predicted == 0 and cached == 0  # same text, other tenant: other salt, other block names
    replica, predicted, cached = ask(f, "Secret question?", headers=A, system=system)
    assert replica == home and cached > 0 and predicted == cached


def png_url(seed: int) -> str:
    img = Image.new("RGB", (224, 168), (seed * 40 % 256, 30, 200))
    for x in range(0, 224, 8):
        img.putpixel((x, (x * seed) % 168), (x, seed, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_conversation_stays_on_one_replica_with_exact_predictions(vllm_fleet):
    f = vllm_fleet
    image = {"type": "image_url", "image_url": {"url": png_url(3)}}
    history = [{"role": "system", "content": "You describe pictures. " + SYSTEM},
               {"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]}]
    home, predicted, cached = ask(f, "", messages=history)
    assert predicted == cached == 0
    wait_for(lambda: blocks_on(f, home) >= 8, "the image conversation's blocks in the index", [], 10)
    for turn in ("And its colours?", "And the dots?"):
        history += [{"role": "assistant", "content": "A picture."}, {"role": "user", "content": turn}]
        replica, predicted, cached = ask(f, "", messages=history)
        assert replica == home and cached > 0 and predicted == cached
    # the same image and text from another tenant: its own image identity and salt, no hit
    _, predicted, cached = ask(f, "", headers=B, messages=history)
    assert predicted == 0 and cached == 0
    check = httpx.get(f.router + "/v1/router/replicas").json()["hash_check"]
    assert check["checked_blocks"] > 0 and check["mismatched_blocks"] == 0


# Last: it restarts a replica, and the warm-up's replays leave the fleet's request counts uneven for a while.
def test_a_restarted_replica_is_resynced(vllm_fleet):
    f = vllm_fleet
    system = "Restart test. " + SYSTEM
    home, _, _ = ask(f, "Before the restart?", system=system)
    victim = next(r for r in f.replicas if r.url == home)
    wait_for(lambda: blocks_on(f, home) >= 8, "the prefix in the index", [], 10)
    victim.kill()
    wait_for(lambda: not f.replicas_view()[home]["healthy"], "the router to take the killed replica out", [], 5)
    assert blocks_on(f, home) == 0  # its cache died with it
    # meanwhile the prefix is served (and cached) by the survivor
    replica, _, _ = ask(f, "During the restart?", system=system)
    assert replica != home
    victim.start()
    victim.wait_ready([])
    wait_for(lambda: (v := f.replicas_view()[home])["healthy"] and v["synced"], "the restarted replica resynced",
             [f.router_proc], 30)
    # the router replays its hot prefixes into it before routing to it again (warm-up), then it is ready
    wait_for(lambda: f.replicas_view()[home]["state"] == "ready", "the restarted replica's warm-up", [f.router_proc], 60)
    assert f.replicas_view()[home]["last_warmup"]["prefixes"] > 0
    # the survivor holds the prefix now and keeps it; a new prefix placed on the restarted replica is exact too
    replica, predicted, cached = ask(f, "After the restart?", system=system)
    assert cached > 0 and predicted == cached
    for i in range(12):  # cold prefixes spread by rendezvous hashing; find one that lands on the restarted replica
        system_i = f"Fresh prefix {i}. " + SYSTEM
        replica, _, _ = ask(f, "hello", system=system_i)
        if replica == home:
            wait_for(lambda: blocks_on(f, home) >= 8, "the restarted replica's new events", [], 10)
            replica, predicted, cached = ask(f, "hello again", system=system_i)
            assert replica == home and cached > 0 and predicted == cached
            return
        time.sleep(0.1)
    raise AssertionError("no cold prefix was placed on the restarted replica in 12 tries")
