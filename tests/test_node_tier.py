"""The node tier (server/nodetier): whole entries under a byte capacity, its wire and events, and two engines sharing one."""

import time

import msgpack
import pytest

from warmfleet import LLM, SamplingParams
from warmfleet.livefleet import NodeTier
from warmfleet.server.events import NODE, AllBlocksCleared, BlockRemoved, BlockStored, EncoderStored
from warmfleet.server.nodetier.client import NodeTierClient, parse_address
from warmfleet.server.nodetier.server import NodeServer
from warmfleet.server.nodetier.store import ENTRY_OVERHEAD, NodeStore
from warmfleet.server.nodetier.wire import HEADER, FrameError, checksum, frame_lengths, pack, unpack

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 7) % 300 + 20 for i in range(70)]


def put(store, key, data, layout="L", kind="kv"):
    return store.put(kind, key, layout, data, checksum(data))


def test_store_never_exceeds_capacity_and_evicts_least_recently_used():
    store = NodeStore(3 * (100 + ENTRY_OVERHEAD))
    for k in (b"a", b"b", b"c"):
        assert put(store, k, bytes(100))
    assert [e.data for e in store.get("kv", [b"a"], "L")] == [bytes(100)]  # a is now the most recently used
    assert put(store, b"d", bytes(100))
    assert store.used_bytes <= store.capacity_bytes
    assert {k for _, k in store.slots()} == {b"a", b"c", b"d"}  # b was the least recently used
    assert not put(store, b"huge", bytes(7 * 100))  # larger than the whole tier: refused, nothing evicted
    assert {k for _, k in store.slots()} == {b"a", b"c", b"d"}
    ev = store.take_events()
    assert BlockRemoved([b"b"], NODE) in ev and sum(isinstance(e, BlockStored) for e in ev) == 4


def test_store_evicts_copies_replicas_still_hold_before_blocks_held_nowhere_else():
    store = NodeStore(3 * (10 + ENTRY_OVERHEAD))
    assert store.put("kv", b"victim", "L", bytes(10), checksum(bytes(10)), holder="r1", held=False)  # evicted by r1
    for k in (b"a", b"b"):  # written through: r1 still holds them
        assert store.put("kv", k, "L", bytes(10), checksum(bytes(10)), holder="r1", held=True)
    assert put(store, b"c", bytes(10))  # full: "a" goes first although "victim" is older
    assert store.slots() == [(("kv", b"b")), ("kv", b"victim"), ("kv", b"c")]
    assert store.release("kv", [b"b", b"gone"], "r1") == [b"gone"]  # r1 evicted b: a victim now; "gone" must be sent
    assert ("kv", b"b") in store.free and not store.held and store.counters.released == 1
    assert [e.data for e in store.get("kv", [b"victim"], "L", holder="r2")] == [bytes(10)]  # r2 copies it in
    assert store.slots()[0] == ("kv", b"victim")  # held by r2: the next to go
    store.drop_holder("r2")  # r2's connections closed: nothing it claimed stands
    assert not store.held and store.holders == {} and store.claims == {}
    assert store.used_bytes == 3 * (10 + ENTRY_OVERHEAD)


def test_store_eviction_put_of_an_entry_it_has_only_ends_the_claim():
    store = NodeStore(1 << 20)
    assert store.put("kv", b"x", "L", b"d", checksum(b"d"), holder="r1", held=True)
    assert store.put("kv", b"x", "L", b"d", checksum(b"d"), holder="r2", held=True)
    assert store.put("kv", b"x", "L", b"d", checksum(b"d"), holder="r1", held=False)
    assert store.holders[("kv", b"x")] == {"r2"} and ("kv", b"x") in store.held
    assert store.release("kv", [b"x"], "r2") == [] and ("kv", b"x") in store.free and store.counters.puts == 1


def test_store_serves_only_whole_entries_of_the_same_layout_and_never_overwrites():
    store = NodeStore(1 << 20)
    assert not store.put("kv", b"x", "L", b"data", checksum(b"datA"))  # torn: the checksum is of other bytes
    assert store.get("kv", [b"x"], "L") == []
    assert put(store, b"x", b"first") and put(store, b"y", b"second")
    assert put(store, b"x", b"other")  # a second put of the key keeps the first bytes
    assert [e.data for e in store.get("kv", [b"x", b"y", b"z", b"w"], "L")] == [b"first", b"second"]  # prefix run
    assert store.get("kv", [b"x"], "other layout") == []
    assert store.get("enc", [b"x"], "L") == []  # the kinds never share keys


def test_state_events_carry_everything_led_by_all_blocks_cleared():
    store = NodeStore(1 << 20, block_size=16)
    put(store, b"h1", b"1")
    put(store, "mm", b"img", kind="enc")
    ev = store.state_events()
    assert isinstance(ev[0], AllBlocksCleared)
    assert BlockStored([b"h1"], None, [], 16, NODE) in ev and EncoderStored(["mm"]) in ev


def test_server_answers_bad_requests_with_errors_not_exceptions():
    node = NodeServer(NodeStore(1 << 20), None)
    assert node.handle({"op": "nope"})["ok"] is False
    assert node.handle({"op": "get", "kind": "kv", "keys": "notalist"})["ok"] is False
    assert node.handle({"op": "put", "entries": [{"kind": "kv"}]})["ok"] is False
    r = node.handle({"op": "put", "entries": [{"kind": "kv", "key": "str-not-bytes", "data": b"d", "sum": checksum(b"d")}]})
    assert r == {"ok": True, "stored": 0, "refused": 1}
    with pytest.raises(FrameError):
        frame_lengths(HEADER.pack(1 << 10, 1 << 30))
    with pytest.raises(FrameError):
        unpack(msgpack.packb([1, 2]))
    meta = msgpack.packb({"op": "put", "entries": [{"kind": "kv", "size": 5}]})
    with pytest.raises(FrameError):
        unpack(meta, b"1234")  # an entry runs past the payload
    with pytest.raises(FrameError):
        unpack(meta, b"123456")  # bytes no entry accounts for


def test_a_frame_carries_entries_raw_after_its_metadata():
    blocks = [bytes([i]) * (1000 + i) for i in range(3)]
    msg = {"op": "put", "entries": [{"kind": "kv", "key": b"k%d" % i, "data": d, "sum": checksum(d)}
                                    for i, d in enumerate(blocks)]}
    head, *payload = pack(msg)
    assert [p for p in payload] == blocks and all(p is d for p, d in zip(payload, blocks))  # the blocks' own buffers
    meta_n, payload_n = frame_lengths(head[:HEADER.size])
    assert payload_n == sum(map(len, blocks)) and len(head) == HEADER.size + meta_n
    back = unpack(head[HEADER.size:], b"".join(payload))
    assert [bytes(e["data"]) for e in back["entries"]] == blocks and "size" not in back["entries"][0]
    assert msg["entries"][0]["data"] is blocks[0]  # the caller's map is left as it was


def test_parse_address():
    assert parse_address("node-tier.ns.svc:7100") == ("node-tier.ns.svc", 7100)
    assert parse_address("[::1]:7100") == ("::1", 7100)
    for bad in ("nohost", ":7100", "h:0", "h:x"):
        with pytest.raises(ValueError):
            parse_address(bad)


@pytest.fixture()
def node_tier(tmp_path):
    nt = NodeTier(tmp_path).start()
    nt.wait_ready()
    yield nt
    nt.stop()


def test_client_round_trip_and_a_dead_tier_is_a_quick_miss(node_tier):
    c = NodeTierClient(node_tier.address, timeout_s=2.0)
    c.put_async([{"kind": "kv", "key": b"h%d" % i, "layout": "L", "data": bytes([i]) * 64} for i in range(3)])
    assert c.flush()
    assert c.get("kv", [b"h0", b"h1", b"missing", b"h2"], "L") == [bytes([0]) * 64, bytes([1]) * 64]
    node_tier.kill()
    t0 = time.monotonic()
    assert c.get("kv", [b"h0"], "L") == []
    assert c.get("kv", [b"h0"], "L") == []  # the breaker is open: not even tried
    assert time.monotonic() - t0 < 2.0 and c.counters.failures == 1
    c.put_async([{"kind": "kv", "key": b"h9", "layout": "L", "data": b"x"}])
    assert c.counters.put_dropped == 1
    c.close()


def test_a_replica_releases_what_the_tier_holds_and_its_copies_go_first(tmp_path):
    nt = NodeTier(tmp_path, capacity_bytes=3 * (64 + ENTRY_OVERHEAD)).start()
    nt.wait_ready()
    a, b = NodeTierClient(nt.address, timeout_s=2.0), NodeTierClient(nt.address, timeout_s=2.0)
    try:
        kv = lambda k, held: {"kind": "kv", "key": k, "layout": "L", "data": k * 32, "held": held}  # noqa: E731
        a.put_async([kv(b"k1", True), kv(b"k2", True)])  # written through: a still holds both
        assert a.flush()
        a.put_async([kv(b"k1", False)])  # a evicts k1: the tier has it, so no bytes go
        assert a.flush() and a.counters.put_released == 1
        b.put_async([kv(b"k3", False), kv(b"k4", False)])  # full: k2, a copy a still holds, goes before k1
        assert b.flush()
        assert b.get("kv", [b"k1"], "L") == [b"k1" * 32] and b.get("kv", [b"k2"], "L") == []
        stats = a._get_conn.call({"op": "stats"})
        assert stats["released"] == 1 and stats["holders"] == 2 and stats["used_bytes"] <= stats["capacity_bytes"]
        b.close()  # b's connections close: its claims end (the server sees the close when its loop gets to it)
        end = time.monotonic() + 10
        while a._get_conn.call({"op": "stats"})["holders"] != 1 and time.monotonic() < end:
            time.sleep(0.02)
        assert a._get_conn.call({"op": "stats"})["holders"] == 1
    finally:
        a.close()
        nt.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=16, enable_prefix_caching=False, num_gpu_blocks=64)
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_a_prefix_computed_by_one_engine_is_served_to_another_from_the_node_tier(tiny_model_dir, node_tier, reference):
    a = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64, node_tier=node_tier.address)
    a.generate([PROMPT], GREEDY)
    assert a.engine.node.flush()
    b = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64, node_tier=node_tier.address)
    out = b.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == reference
    s = b.stats()
    assert s.prefix_hits_tokens_node == 64 and s.node_in_blocks == 4 and s.cpu_blocks_total == 0
    # another tenant's salt roots another chain: nothing of tenant A's entries is served to it
    c = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64, node_tier=node_tier.address)
    other = c.generate([PROMPT], GREEDY, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == reference
    assert c.engine.node.flush()
    again = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64, node_tier=node_tier.address)
    assert again.generate([PROMPT], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 64  # its own entries


def test_evicted_blocks_go_to_the_node_tier_and_a_dead_tier_costs_a_recompute(tiny_model_dir, node_tier, reference):
    a = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=12, node_tier=node_tier.address, max_num_seqs=1,
            swap_space=1.0)
    a.generate([PROMPT], GREEDY)
    a.generate([[5] * 191], SamplingParams(max_tokens=1, ignore_eos=True))  # every block: PROMPT's are evicted
    assert a.engine.node.flush()
    out = a.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == reference
    node_tier.kill()
    a.generate([[6] * 191], SamplingParams(max_tokens=1, ignore_eos=True))
    out = a.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    assert a.stats().node_failures >= 1


def test_an_image_encoded_by_one_engine_is_not_encoded_again_by_another(tiny_vl_dir, node_tier):
    from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes

    def conv(text):
        return [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": data_uri(image_bytes(112, 168, seed=5))}},
                                             {"type": "text", "text": "What is it?"}]}]

    cold = LLM(str(tiny_vl_dir), block_size=16, num_gpu_blocks=256, enable_prefix_caching=False, max_encoder_cache=0)
    ref = cold.chat(conv("Another tenant's words come first. "), GREEDY)[0].outputs[0].token_ids
    a = LLM(str(tiny_vl_dir), block_size=16, num_gpu_blocks=256, node_tier=node_tier.address)
    a.chat(conv("Describe the picture below. "), GREEDY)
    assert a.engine.node.flush()
    b = LLM(str(tiny_vl_dir), block_size=16, num_gpu_blocks=256, node_tier=node_tier.address)
    out = b.chat(conv("Another tenant's words come first. "), GREEDY)[0]  # no KV in common before the image
    assert out.outputs[0].token_ids == ref
    assert b.stats().node_encoder_hits == 1


@pytest.mark.parametrize("args, needle", [
    (["node-tier", "--capacity-bytes", "0", "--node-name", "n"], "--capacity-bytes"),
    (["node-tier", "--capacity-bytes", "10", "--node-name", "a b"], "--node-name"),
    (["serve", "--model", "/nonexistent", "--node-tier", "nohost"], "--node-tier"),
    (["route", "--model", "/nonexistent", "--replica", "http://127.0.0.1:1", "--node-tier-events", "x"],
     "--node-tier-events"),
])
def test_bad_node_tier_flags_exit_2_with_one_line(args, needle, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-P", "-m", "warmfleet.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_long_answer_is_cut_at_the_frame_limit_and_says_so(monkeypatch):
    from warmfleet.server.nodetier import server

    node = NodeServer(NodeStore(1 << 20), None)
    node.handle({"op": "put", "entries": [{"kind": "kv", "key": b"k%d" % i, "layout": "L", "data": bytes(100),
                                           "sum": checksum(bytes(100))} for i in range(5)]})
    monkeypatch.setattr(server, "MAX_ANSWER_BYTES", 350)
    r = node.handle({"op": "get", "kind": "kv", "keys": [b"k%d" % i for i in range(5)], "layout": "L"})
    assert len(r["entries"]) == 2 and r["cut"] is True
    r = node.handle({"op": "get", "kind": "kv", "keys": [b"k3", b"k4", b"nope"], "layout": "L"})
    assert len(r["entries"]) == 2 and r["cut"] is False
