"""Encoder-cache-aware scoring: the router's decision over a real KVIndex fed encoder events, snapshots and blocks."""

from dataclasses import replace

import pytest

from warmfleet.server.events import BlockStored, EncoderRemoved, EncoderStored, EventBatch, Snapshot
from warmfleet.server.hashing import model_fingerprint
from warmfleet.server.router.core.fleet import Fleet
from warmfleet.server.router.core.metrics import RouterMetrics
from warmfleet.server.router.core.policy import COLD_HASH, PREFIX_HIT
from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
from warmfleet.server.router.core.registry import ReplicaSpec
from warmfleet.server.router.core.router import Router
from warmfleet.server.router.core.settings import PolicyConfig
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes

A, B, C = "http://a", "http://b", "http://c"


def body(system: str, seed: int = 7) -> dict:
    part = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(112, 168, seed=seed))}}
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]}


@pytest.fixture
def router(tiny_vl_dir):
    metrics = RouterMetrics()
    fleet = Fleet(None, metrics, block_size=16)
    fleet.registry.set_members([ReplicaSpec(u) for u in (A, B, C)])
    for r in fleet.registry.replicas.values():
        r.healthy = True
        fleet.index.apply_snapshot(r.id, Snapshot(r.id, 0, 16, "fp", [], [], []))
    return Router(fleet, PromptRenderer(str(tiny_vl_dir)), HashConfig(16, model_fingerprint(tiny_vl_dir)), metrics)


def image_hash(router, b: dict) -> str:
    return router.render("chat", b).mm_items[0].mm_hash


def decide(router, b: dict):
    return router.decide("chat", b, router.fleet.routable())[0]


def test_the_encoder_warm_replica_wins_when_no_kv_prefix_exists_anywhere(router):
    first = body("Conversation one.")
    second = body("Another conversation, another system prompt.")  # same image, no shared block
    h = image_hash(router, first)
    cold = decide(router, second)
    assert cold.reason == COLD_HASH
    warm = next(r for r in (A, B, C) if r != cold.order[0])  # not the replica it would pick anyway
    router.fleet.index.apply_batch(warm, EventBatch(warm, 1, [EncoderStored([h])]))
    d = decide(router, second)
    assert d.order[0] == warm and d.reason == PREFIX_HIT and d.predicted_cached_tokens == 0
    assert router.metrics.predicted_encoder_hits.value == 1
    # evicted there: back to the cold placement
    router.fleet.index.apply_batch(warm, EventBatch(warm, 2, [EncoderRemoved([h])]))
    assert decide(router, second).order[0] == cold.order[0]


def test_encoder_weight_zero_ignores_encoder_caches(router):
    second = body("Another conversation.")
    cold = decide(router, second).order[0]
    warm = next(r for r in (A, B, C) if r != cold)
    router.fleet.index.apply_batch(warm, EventBatch(warm, 1, [EncoderStored([image_hash(router, second)])]))
    router.policy = replace(router.policy, encoder_weight=0.0)
    assert decide(router, second).order[0] == cold


@pytest.mark.parametrize("weight", [0.5, 6.0])  # 6: the tiny VL checkpoint's measured encode cost (docs/router.md)
def test_a_kv_prefix_holding_the_image_outweighs_an_encoder_hit(router, weight):
    """The conversation's own replica saves the image's encode too (its KV is there): whatever the weight, it must
    not lose the next turn to a replica that merely holds the image's encoder output."""
    router.policy = replace(router.policy, encoder_weight=weight)
    b = body("Conversation one.")
    prompt = router.render("chat", b)
    hashes = router.fleet.dialect.block_hashes(prompt, None, router.hash_cfg)
    image_end = (prompt.mm_items[0].offset + prompt.mm_items[0].length) // 16
    assert len(hashes) > image_end
    router.fleet.index.apply_batch(A, EventBatch(A, 1, [BlockStored(hashes, None, [], 16)]))
    router.fleet.index.apply_batch(B, EventBatch(B, 1, [EncoderStored([prompt.mm_items[0].mm_hash])]))
    d = decide(router, b)
    assert d.order[0] == A and d.predicted_cached_tokens > 0
    assert router.metrics.predicted_encoder_hits.value == 0  # A holds the image as KV: no encoder hit needed


def test_encoder_state_comes_back_with_a_snapshot_after_a_purge(router):
    second = body("Another conversation.")
    cold = decide(router, second).order[0]
    warm = next(r for r in (A, B, C) if r != cold)
    router.fleet.index.purge(warm)
    assert decide(router, second).order[0] == cold
    router.fleet.index.apply_snapshot(warm, Snapshot(warm, 5, 16, "fp", [], [], [image_hash(router, second)]))
    assert decide(router, second).order[0] == warm


def test_encoder_weight_is_a_flag_and_refuses_negative_values():
    assert PolicyConfig(encoder_weight=1.5).encoder_weight == 1.5
    with pytest.raises(ValueError, match="--encoder-weight"):
        PolicyConfig(encoder_weight=-1)


def test_an_image_straddling_the_cached_prefix_counts_as_an_encode_saved(router):
    """The engine needs the image's rows past the prefix, and the vision encoder runs on whole images only."""
    b = body("Conversation one.")
    prompt = router.render("chat", b)
    hashes = router.fleet.dialect.block_hashes(prompt, None, router.hash_cfg)
    item = prompt.mm_items[0]
    inside = item.offset // 16 + 1  # the prefix ends inside the image
    assert inside * 16 < item.offset + item.length
    for rid, events in ((A, [BlockStored(hashes[:inside], None, [], 16), EncoderStored([item.mm_hash])]),
                        (B, [BlockStored(hashes[:inside], None, [], 16)])):
        router.fleet.index.apply_batch(rid, EventBatch(rid, 1, events))
    d = decide(router, b)
    assert d.order[0] == A and d.predicted_cached_tokens == inside * 16
    assert router.metrics.predicted_encoder_hits.value == 1
