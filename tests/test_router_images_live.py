"""Two real `warmfleet serve` replicas (tiny VL checkpoint) behind `warmfleet route`, images from a loopback media server.

The encoder cache steers a new conversation on a known image to the replica holding its encoder
output; a conversation whose image comes by URL is predicted (and served) as warm as a data: one,
and an object changed behind its URL is a miss, then warm again.
"""

from __future__ import annotations

import httpx
import pytest

from warmfleet.livefleet import BLOCK, MODEL_NAME, LiveFleet, MediaServer, metric, wait_for
from warmfleet.server.hashing import model_fingerprint
from warmfleet.server.router.core.policy import rendezvous_weight
from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer, prompt_block_hashes
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes

pytestmark = pytest.mark.slow

REPLICA_ARGS = ("--allowed-media-host", "127.0.0.1", "--max-encoder-cache", "8192", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    with MediaServer(tmp_path_factory.mktemp("media")) as m:
        yield m


@pytest.fixture(scope="module")
def fleet(tiny_vl_dir, tmp_path_factory):
    f = LiveFleet(tiny_vl_dir, tmp_path_factory.mktemp("images-live"), replica_args=REPLICA_ARGS).start()
    try:
        yield f
    finally:
        f.close()


def turn(system: str, url: str, question: str, history: tuple = ()) -> list[dict]:
    return [{"role": "system", "content": system}, *history,
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def ask(fleet: LiveFleet, messages: list[dict]) -> dict:
    r = httpx.post(fleet.router.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert "x-warmfleet-media" not in r.headers  # the replica's note to the router is not relayed to clients
    reason, _, predicted = r.headers["x-warmfleet-route"].partition("; predicted_cached_tokens=")
    usage = r.json()["usage"]
    return {"replica": r.headers["x-warmfleet-replica"], "reason": reason, "predicted": int(predicted),
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "prompt": usage["prompt_tokens"],
            "answer": r.json()["choices"][0]["message"]["content"]}


def encoder_hits(fleet: LiveFleet, name: str) -> float:
    return metric(httpx.get(fleet.by_id(name).url + "/metrics", timeout=5).text, "warmfleet:encoder_cache_hits_total") or 0


def router_metric(fleet: LiveFleet, name: str) -> float:
    return metric(fleet.router.metrics(), name) or 0


def wait_encoder_entries(fleet: LiveFleet, replica_url: str) -> None:
    """Until the router indexed the replica's EncoderStored and every replica's last Load says idle (a Load sent while
    the first request ran would make its replica look busy for a moment, and the bounded-load rule move the next)."""
    def settled() -> bool:
        view = fleet.router.view()["replicas"]
        home = next(r for r in view if r["id"] == replica_url)
        return home["encoder_entries"] > 0 and all(r["engine_requests"] == 0 for r in view)

    wait_for(settled, "the router indexed the replica's EncoderStored, replicas idle", [fleet.router])


def cold_replica(tiny_vl_dir, messages: list[dict], urls: list[str]) -> str:
    """Where the router places `messages` when no replica holds anything of it (rendezvous of its first block)."""
    prompt = PromptRenderer(str(tiny_vl_dir)).chat({"messages": messages})
    key = prompt_block_hashes(prompt, None, HashConfig(BLOCK, model_fingerprint(tiny_vl_dir)))[0]
    return max(urls, key=lambda u: rendezvous_weight(key, u))


def test_a_new_conversation_on_a_known_image_goes_where_its_encoder_output_is(fleet, media, tiny_vl_dir):
    url = media.put("shared.png", image_bytes(112, 168, seed=21))
    first = ask(fleet, turn("You describe pictures for the first team.", url, "What is it?"))
    home = fleet.by_id(first["replica"]).url
    wait_encoder_entries(fleet, home)
    urls = [r.url for r in fleet.replicas]
    # another conversation whose own cold placement is the other replica: only the encoder cache can bring it home
    system = next(s for s in (f"Team {k} asks about this picture in its own words." for k in range(64))
                  if cold_replica(tiny_vl_dir, turn(s, data_uri(image_bytes(112, 168, seed=21)), "Colour?"), urls) != home)
    hits_before, predicted_before = encoder_hits(fleet, first["replica"]), router_metric(
        fleet, "warmfleet_router_predicted_encoder_hits_total")
    second = ask(fleet, turn(system, url, "Colour?"))
    assert second["replica"] == first["replica"] and second["reason"] == "prefix_hit"
    assert second["cached"] == second["predicted"] == 0  # no KV prefix: the win is the encoder's alone
    assert encoder_hits(fleet, first["replica"]) > hits_before  # the replica served it from its encoder cache
    assert router_metric(fleet, "warmfleet_router_predicted_encoder_hits_total") == predicted_before + 1


def conversation(system: str, url: str, turns: list[tuple[str, str]], question: str) -> list[dict]:
    """System prompt, the earlier (question, answer) turns, then `question`; every user turn shows the image at `url`."""
    out = [{"role": "system", "content": system}]
    for q, a in turns:
        out += [turn(system, url, q)[-1], {"role": "assistant", "content": a}]
    return out + [turn(system, url, question)[-1]]


def test_a_url_conversation_is_predicted_and_served_as_warm_as_a_data_one(fleet, media, tiny_vl_dir):
    data = image_bytes(112, 168, seed=31)
    url = media.put("conv.png", data)
    system = "You answer questions about one picture, turn after turn."
    turns: list[tuple[str, str]] = []
    first = ask(fleet, conversation(system, url, turns, "What is in it?"))
    assert router_metric(fleet, "warmfleet_router_media_urls_learned_total") >= 1
    turns.append(("What is in it?", first["answer"]))
    second = ask(fleet, conversation(system, url, turns, "And the corners?"))
    image = PromptRenderer(str(tiny_vl_dir)).chat({"messages": turn(system, data_uri(data), "x")}).mm_items[0]
    image_end = image.offset + image.length
    assert second["replica"] == first["replica"] and second["reason"] == "prefix_hit"
    assert second["cached"] == second["predicted"] > image_end  # warm past the image, exactly as predicted

    # the object behind the URL changes: the replica hashes what it fetched, so this is a miss, never a wrong hit
    media.put("conv.png", image_bytes(112, 168, seed=32))
    turns.append(("And the corners?", second["answer"]))
    third = ask(fleet, conversation(system, url, turns, "Anything else?"))
    assert third["predicted"] > image_end and third["cached"] <= image.offset  # only the text before the image
    # that answer taught the router the new hash: the next turn is predicted and served warm again
    turns.append(("Anything else?", third["answer"]))
    fourth = ask(fleet, conversation(system, url, turns, "Last one?"))
    assert fourth["cached"] == fourth["predicted"] > image_end


@pytest.fixture(scope="module")
def tenant_fleet(tiny_vl_dir, tmp_path_factory):
    f = LiveFleet(tiny_vl_dir, tmp_path_factory.mktemp("images-tenants"), replica_args=REPLICA_ARGS,
                  router_args=("--api-key", "key-a", "--api-key", "key-b")).start()
    try:
        yield f
    finally:
        f.close()


def ask_as(fleet: LiveFleet, key: str, messages: list[dict]) -> dict:
    r = httpx.post(fleet.router.url + "/v1/chat/completions", timeout=120, headers={"authorization": f"Bearer {key}"},
                   json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return {"predicted": int(r.headers["x-warmfleet-route"].rsplit("=", 1)[1]),
            "cached": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
            "answer": r.json()["choices"][0]["message"]["content"]}


def test_what_a_tenant_taught_the_router_about_a_url_another_tenant_cannot_use(tenant_fleet, media, tiny_vl_dir):
    data = image_bytes(112, 168, seed=41)
    url = media.put("private.png", data)
    system = "You answer questions about one picture, turn after turn."
    image = PromptRenderer(str(tiny_vl_dir)).chat({"messages": turn(system, data_uri(data), "x")}).mm_items[0]
    first = ask_as(tenant_fleet, "key-a", conversation(system, url, [], "What is in it?"))
    assert first["predicted"] <= image.offset  # nobody has told the router what the URL holds yet
    turns = [("What is in it?", first["answer"])]
    second = ask_as(tenant_fleet, "key-a", conversation(system, url, turns, "And the corners?"))
    assert second["cached"] == second["predicted"] > image.offset + image.length  # tenant a learned it
    assert tenant_fleet.router.view()["media_urls"] == 1
    # tenant b sends the very same conversation: its salt keeps a's blocks and a's URL entry out of its reach
    other = ask_as(tenant_fleet, "key-b", conversation(system, url, turns, "And the corners?"))
    assert other["predicted"] == other["cached"] == 0
    assert tenant_fleet.router.view()["media_urls"] == 2  # b's answer filed under b's salt, beside a's entry
    again = ask_as(tenant_fleet, "key-b", conversation(system, url, turns, "Anything else?"))
    assert again["predicted"] > image.offset + image.length  # b's own answer taught b
