"""The router and node tiers: NODE entries in the index, self-syncing state batches, tier order and load spread (pure)."""

from collections import Counter

from warmfleet.server.events import (
    GPU, NODE, AllBlocksCleared, BlockRemoved, BlockStored, EncoderStored, EventBatch, Snapshot,
)
from warmfleet.server.router.core.index import Applied, KVIndex, PrefixMatch
from warmfleet.server.router.core.node_tiers import NodeFeed, node_key
from warmfleet.server.router.core.policy import (
    PREFIX_HIT, Candidate, Decision, PolicyConfig, choose, node_tier_weight, priced_copy_weight,
)
from warmfleet.server.router.core.settings import RouterSettings, parse_node_tier_events

import pytest

B = 16
H = [bytes([i]) * 32 for i in range(8)]
NODE_A = node_key("node-a")


def stored(hashes, medium=NODE):
    return BlockStored(list(hashes), None, [], B, medium)


def test_a_node_tier_syncs_from_a_batch_led_by_all_blocks_cleared_and_skips_gaps_until_the_next_one():
    idx = KVIndex()
    assert idx.apply_batch(NODE_A, EventBatch(NODE_A, 7, [stored(H[:2])]), self_syncing=True) is Applied.BUFFERED
    state = EventBatch(NODE_A, 8, [AllBlocksCleared(), stored(H[:3]), EncoderStored(["img"])])
    assert idx.apply_batch(NODE_A, state, self_syncing=True) is Applied.OK
    assert idx.match(H[:4], [NODE_A])[NODE_A] == PrefixMatch(0, 0, 3)
    assert idx.apply_batch(NODE_A, EventBatch(NODE_A, 9, [BlockRemoved([H[2]], NODE)]), self_syncing=True) is Applied.OK
    assert idx.apply_batch(NODE_A, EventBatch(NODE_A, 11, [stored(H[5:6])]), self_syncing=True) is Applied.NEED_RESYNC
    # it restarted: seq 1, empty; that replaces what the index knew, encoder outputs included
    assert idx.apply_batch(NODE_A, EventBatch(NODE_A, 1, [AllBlocksCleared()]), self_syncing=True) is Applied.OK
    assert idx.match(H[:2], [NODE_A])[NODE_A] == PrefixMatch(0, 0, 0) and not idx.encoder_hits(NODE_A, ["img"])
    # a replica's own batches never self-sync: it has an HTTP snapshot
    assert idx.apply_batch("r", EventBatch("r", 4, [AllBlocksCleared()])) is Applied.BUFFERED


def test_a_replica_snapshot_names_its_node_and_a_feed_purges_on_disconnect():
    idx = KVIndex()
    snap = Snapshot("r0", 3, B, "fp", [H[0]], [], [], node="node-a")
    assert Snapshot.from_json(snap.to_json()).node == "node-a"
    idx.apply_snapshot("r0", snap)
    assert idx.replicas["r0"].node_name == "node-a"
    feed = NodeFeed("tcp://127.0.0.1:1", idx)
    from warmfleet.server.events import encode

    feed.on_frames(encode(EventBatch(NODE_A, 1, [AllBlocksCleared(), stored(H[:2])])))
    feed.on_frames([b"junk"])
    feed.on_frames(encode(EventBatch("r9", 1, [stored(H[:1], GPU)])))  # not a node tier's topic
    assert feed.keys == {NODE_A} and feed.bad_batches == 2
    assert idx.match(H[:2], [NODE_A])[NODE_A].node_blocks == 2
    feed.on_disconnect()
    assert idx.match(H[:2], [NODE_A])[NODE_A].blocks == 0


def test_tiers_order_local_primary_then_swap_then_node_then_cold():
    cands = [Candidate("cold"), Candidate("node", node_blocks=6), Candidate("cpu", cpu_blocks=6),
             Candidate("gpu", gpu_blocks=6)]
    d = choose(cands, block_size=B, num_prompt_tokens=8 * B, cold_key=b"k", cfg=PolicyConfig(common_prefix_free=False))
    assert d.order == ["gpu", "cpu", "node", "cold"] and d.reason == PREFIX_HIT
    assert d.hits["node"] == 6 * B


def test_a_prefix_only_the_node_tier_holds_spreads_over_the_nodes_replicas():
    """Four replicas of one node, every one able to load the 32-block prefix from the node tier: load decides."""
    loads = Counter()
    for i in range(200):
        cands = [Candidate(f"r{j}", node_blocks=32, load=loads[f"r{j}"]) for j in range(4)]
        d = choose(cands, block_size=B, num_prompt_tokens=33 * B, cold_key=b"k")
        loads[d.order[0]] += 1
        assert d.predicted_cached_tokens == 32 * B
    assert max(loads.values()) - min(loads.values()) <= 1
    # the same prefix in one replica's primary pool alone ties requests to it (within the warm slack)
    first = Counter(choose([Candidate("warm", gpu_blocks=32)] + [Candidate(f"c{j}") for j in range(3)],
                           block_size=B, num_prompt_tokens=33 * B, cold_key=b"k").order[0] for _ in range(5))
    assert first == {"warm": 5}


def test_a_priced_node_tier_unties_a_prefix_hot_on_one_replica_from_it():
    """One replica holds the prefix in its primary pool, its node's tier holds it too (written through): priced from
    the copy (H200: 17 us a block against 16 x 25.8 us of prefill), the neighbours are nearly as warm and load
    spreads at once; at the fixed 0.4 the holder keeps requests until bounded load forces a spill."""
    def targets(cfg):
        loads, seq = Counter(), []
        for _ in range(4):
            cands = ([Candidate("warm", gpu_blocks=32, load=loads["warm"], sent=loads["warm"])]
                     + [Candidate(f"n{j}", node_blocks=32, load=loads[f"n{j}"], sent=loads[f"n{j}"]) for j in range(3)]
                     + [Candidate(f"o{j}", load=1, sent=1) for j in range(12)])  # another node, busy and cold
            d = choose(cands, block_size=B, num_prompt_tokens=33 * B, cold_key=b"k", cfg=cfg)
            assert d.predicted_cached_tokens == 32 * B
            loads[d.order[0]] += 1
            seq.append(d.order[0])
        return seq

    priced = PolicyConfig(node_copy_s_per_block=1.7e-05, prefill_s_per_token=2.58e-05)
    assert node_tier_weight(priced, B) == pytest.approx(1 - 1.7e-05 / (16 * 2.58e-05))
    assert sorted(targets(priced)) == ["n0", "n1", "n2", "warm"]
    assert targets(PolicyConfig())[:2] == ["warm", "warm"]


def test_the_priced_node_tier_weight():
    assert priced_copy_weight(0.5, 0.25, 4) == 0.5 and priced_copy_weight(2.0, 0.1, 4) == 0.0  # a copy dearer: 0
    assert priced_copy_weight(0.0, 0.1, 4) == 1.0 and priced_copy_weight(1.0, 0.0, 4) == 0.0
    assert node_tier_weight(PolicyConfig(node_weight=0.3, node_copy_s_per_block=1e-3), B) == 0.3  # one figure: fixed
    with pytest.raises(ValueError, match="--node-tier-copy-s-per-block"):
        PolicyConfig(prefill_s_per_token=-1.0)


def test_node_tier_flags():
    assert parse_node_tier_events("node-tier.ns.svc:5560") == ("node-tier.ns.svc", 5560)
    with pytest.raises(ValueError, match="--node-tier-events"):
        RouterSettings(model="/m", node_tier_events=["nohost"])
    with pytest.raises(ValueError, match="--node-tier-weight"):
        from warmfleet.server.router.core.settings import PolicyConfig as P

        P(node_weight=2.0)


async def test_a_feed_follows_a_simulated_node_tier_over_zmq_and_forgets_it_when_it_goes():
    """The simulator's node tier publishes as `warmfleet node-tier` does; the router's feed syncs from its state."""
    import asyncio

    from bench_scripts import load_bench
    from warmfleet.localprocs import free_port

    node = load_bench("simfleet_node.py").NodeTier("n0", 4)
    node.publish_to(f"tcp://127.0.0.1:{free_port()}", B)
    for h in H[:3]:
        node.put(h, "s0", held=False)  # before anyone listens: the state batch a new subscription gets carries them
    idx = KVIndex()
    feed = NodeFeed(node.events_endpoint, idx)
    task = asyncio.create_task(feed.run())
    try:
        for _ in range(200):
            node.publish()
            await asyncio.sleep(0.01)
            if idx.match(H, [node_key("n0")])[node_key("n0")].node_blocks == 3:
                break
        assert idx.match(H, [node_key("n0")])[node_key("n0")].node_blocks == 3
        for h in H[3:6]:  # capacity 4: H[0] and H[1] are evicted
            node.put(h, "s0", held=False)
        for _ in range(200):
            node.publish()
            await asyncio.sleep(0.01)
            if idx.replicas[node_key("n0")].node == set(H[2:6]):
                break
        assert idx.replicas[node_key("n0")].node == set(H[2:6])
        node.publisher.close()
        for _ in range(300):
            await asyncio.sleep(0.01)
            if not idx.replicas[node_key("n0")].node:
                break
        assert not idx.replicas[node_key("n0")].node  # its connection dropped: what it published is forgotten
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_node_run_starts_where_the_replicas_own_prefix_ends():
    """A replica holding a conversation's head in its primary pool and the node tier holding the tail (evicted
    there): the engine loads the tail after its own head, so the router counts it too."""
    idx = KVIndex()
    idx.add_blocks("r0", H[:3], GPU)
    idx.add_blocks(NODE_A, H[3:6], NODE)
    assert idx.node_run(H, 3, NODE_A) == 3 and idx.node_run(H, 0, NODE_A) == 0 and idx.node_run(H, 4, NODE_A) == 2


def test_an_image_whose_encoder_output_a_node_tier_holds_goes_to_a_replica_of_that_node(tiny_vl_dir):
    from warmfleet.server.hashing import model_fingerprint
    from warmfleet.server.router.core.fleet import Fleet
    from warmfleet.server.router.core.metrics import RouterMetrics
    from warmfleet.server.router.core.node_tiers import NodeTiers
    from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
    from warmfleet.server.router.core.registry import ReplicaSpec
    from warmfleet.server.router.core.router import Router
    from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes

    metrics = RouterMetrics()
    fleet = Fleet(None, metrics, block_size=16)
    urls = [f"http://r{i}" for i in range(6)]
    fleet.registry.set_members([ReplicaSpec(u) for u in urls])
    for i, r in enumerate(fleet.registry.replicas.values()):
        r.healthy = True
        fleet.index.apply_snapshot(r.id, Snapshot(r.id, 0, 16, "fp", [], [], [], node="n0" if i < 2 else "n1"))
    fleet.node_tiers = NodeTiers([], fleet.index)
    router = Router(fleet, PromptRenderer(str(tiny_vl_dir)), HashConfig(16, model_fingerprint(tiny_vl_dir)), metrics)
    part = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(112, 168, seed=11))}}
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]}
    h = router.render("chat", body).mm_items[0].mm_hash
    n0 = node_key("n0")
    fleet.index.apply_batch(n0, EventBatch(n0, 1, [AllBlocksCleared(), EncoderStored([h])]), self_syncing=True)
    for _ in range(4):  # whichever of node n0's replicas, never one of n1's
        d = router.decide("chat", body, fleet.routable())[0]
        assert d.order[0] in urls[:2] and d.reason == PREFIX_HIT


# --- the node-tier weight, priced from what the router measures (core/pricing.py) ---------------------------------

COPY, PREFILL = 1.7e-05, 2.58e-05  # H200, Qwen2.5-7B: a block's copy from pinned memory, a token's prefill
PRICED = 1 - COPY / (B * PREFILL)


def test_load_events_carry_a_replicas_measured_node_copy_cost_and_snapshots_keep_the_four_figures():
    from warmfleet.server.events import Load, decode, encode
    from warmfleet.server.events import _event_to_wire as to_wire

    assert to_wire(Load(1, 2, 3, 4)) == ["Load", 1, 2, 3, 4]  # no node tier: the event is what it was
    batch = decode(encode(EventBatch("r", 1, [Load(1, 2, 3, 4, COPY), Load(1, 2, 3, 4)])))
    assert batch.events == [Load(1, 2, 3, 4, COPY), Load(1, 2, 3, 4, None)]
    for bad in ("fast", -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="node copy cost"):
            decode(encode(EventBatch("r", 1, [Load(1, 2, 3, 4, bad)])))
    snap = Snapshot("r", 3, B, "fp", [], [], [], Load(1, 2, 3, 4, COPY))
    assert snap.to_json()["load"] == {"num_running": 1, "num_waiting": 2, "free_gpu_blocks": 3, "total_gpu_blocks": 4}
    assert Snapshot.from_json(snap.to_json()).load == Load(1, 2, 3, 4)


def test_the_engine_reports_its_node_tier_clients_get_time_per_entry():
    from warmfleet.server.engine.core import node_copy_cost
    from warmfleet.server.nodetier.client import ClientCounters

    class FakeNodeClient:
        def __init__(self, **counts):
            self.counters = ClientCounters(**counts)

    assert node_copy_cost(FakeNodeClient(get_entries=4, get_seconds=0.002)) == pytest.approx(5e-4)
    assert node_copy_cost(FakeNodeClient(get_calls=3)) is None  # asked, never served: nothing measured
    assert node_copy_cost(None) is None


def test_an_engine_that_loaded_blocks_from_its_node_tier_reports_their_cost_in_its_load_events(tiny_model_dir,
                                                                                                 tmp_path):
    from warmfleet import LLM, SamplingParams
    from warmfleet.livefleet import NodeTier

    prompt, greedy = [(i * 7) % 300 + 20 for i in range(70)], SamplingParams(max_tokens=2, temperature=0.0)
    tier = NodeTier(tmp_path).start()
    tier.wait_ready()
    try:
        a = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64, node_tier=tier.address)
        a.generate([prompt], greedy)
        assert a.engine.node.flush()
        assert a.engine.load().node_copy_s_per_block is None  # it computed the prefix: nothing loaded, nothing sent
        b = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64, node_tier=tier.address)
        assert b.generate([prompt], greedy)[0].num_cached_tokens == 64
        counters, load = b.engine.node.counters, b.engine.load()
        assert counters.get_entries == 4 and load.node_copy_s_per_block == counters.get_seconds / 4 > 0
    finally:
        tier.stop()


def test_the_price_comes_from_the_flags_else_the_measurements_else_the_fixed_weight():
    from warmfleet.server.router.core.pricing import price

    measured = price(PolicyConfig(), B, [1.5e-05, COPY, 1e-03], PREFILL)  # the median copy: one slow replica
    assert measured.weight == pytest.approx(PRICED) and measured.source == "measured"
    assert (measured.copy_from, measured.prefill_from, measured.replicas_reporting) == ("replicas", "ttft", 3)
    for copies, fitted in (([], None), ([COPY], None), ([], PREFILL)):  # a figure missing: the fixed weight
        p = price(PolicyConfig(node_weight=0.3), B, copies, fitted)
        assert (p.weight, p.source) == (0.3, "fixed")
    flags = PolicyConfig(node_copy_s_per_block=1e-04, prefill_s_per_token=1e-04)
    p = price(flags, B, [COPY], PREFILL)
    assert p.weight == pytest.approx(1 - 1 / B) and p.source == "flags"  # given explicitly, the flags win
    p = price(PolicyConfig(prefill_s_per_token=1e-04), B, [COPY], PREFILL)  # one flag, one measurement
    assert p.weight == pytest.approx(1 - COPY / (B * 1e-04)) and (p.copy_from, p.prefill_from) == ("replicas", "flag")
    assert price(PolicyConfig(), B, [1.0], PREFILL).weight == 0.0  # a copy dearer than recomputing: worth nothing
    assert measured.view()["copy_us_per_block"] == 17.0 and measured.view()["source"] == "measured"


def node_router(model_dir, policy):
    """A Router over 4 replicas of node n0 ("warm" and n0-1..3) and 12 of node n1, busy (one request each), with
    the nodes' tiers followed; no sockets."""
    import time

    from warmfleet.server.hashing import model_fingerprint
    from warmfleet.server.router.core.fleet import Fleet
    from warmfleet.server.router.core.metrics import RouterMetrics
    from warmfleet.server.router.core.node_tiers import NodeTiers
    from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
    from warmfleet.server.router.core.registry import ReplicaSpec
    from warmfleet.server.router.core.router import Router

    metrics = RouterMetrics()
    fleet = Fleet(None, metrics, block_size=B)
    urls = ["http://warm"] + [f"http://n0-{i}" for i in range(1, 4)] + [f"http://n1-{i}" for i in range(12)]
    fleet.registry.set_members([ReplicaSpec(u) for u in urls])
    for r in fleet.registry.replicas.values():
        r.healthy = True
        fleet.index.apply_snapshot(r.id, Snapshot(r.id, 0, B, "fp", [], [], [], node=r.id[7:9]))
        if r.id.startswith("http://n1"):
            r.in_flight, r.sent = 1, 1.0
    fleet.node_tiers = NodeTiers([], fleet.index)
    router = Router(fleet, PromptRenderer(str(model_dir)), HashConfig(B, model_fingerprint(model_dir)), metrics, policy)
    body = {"model": "m", "prompt": "hello " * 170, "max_tokens": 1}  # ~510 tokens, 31 blocks
    hashes = router.decide("completion", body, fleet.routable())[2]
    fleet.index.add_blocks("http://warm", hashes, GPU)  # it computed the prefix and wrote it through
    n0 = node_key("n0")
    fleet.index.apply_batch(n0, EventBatch(n0, 1, [AllBlocksCleared(), stored(hashes)]), self_syncing=True)
    router.pricing.current(time.monotonic())  # read once before anything is measured (as a decision would)
    return router, body


def measure(router, copies=(1.5e-05, COPY, 1.9e-05, None)):
    """The n0 replicas' Load events carry their measured copy costs (over the wire); 80 streamed first tokens as the
    proxy books them, each PREFILL a prefill token after a 4 ms fixed cost."""
    from warmfleet.server.events import Load, decode, encode
    from warmfleet.server.router.core.booking import Booking

    n0 = [r for r in router.fleet.registry.replicas.values() if not r.id.startswith("http://n1")]
    for r, copy in zip(n0, copies):
        batch = decode(encode(EventBatch(r.id, 1, [Load(0, 0, 64, 64, copy)])))
        assert router.fleet.index.apply_batch(r.id, batch) is Applied.OK
    for i in range(80 if router.ttft_fit is not None else 0):
        rep = n0[i % len(n0)]
        booking = Booking(router, Decision([rep.id], "cold_hash", 0, num_prompt_tokens=100 + 40 * i))
        booking.enter(rep)
        t_sent, prefill, load = booking.sample
        booking.sample = (t_sent - (0.004 + PREFILL * prefill), prefill, load)
        booking.first_token()
        booking.leave()
    for r in router.fleet.registry.replicas.values():  # those bookings' recent shares forgotten: the scene as it was
        r.sent = float(r.in_flight)


def spread(router, body):
    """Where four requests for the node-held prefix go, each booked on its target."""
    seq = []
    for _ in range(4):
        d = router.decide("completion", body, router.fleet.routable())[0]
        rep = router.fleet.registry.get(d.order[0])
        rep.in_flight += 1
        rep.sent += 1.0
        seq.append(rep.id)
    return seq


def test_a_router_prices_node_tier_blocks_from_its_replicas_copies_and_its_first_tokens(tiny_model_dir):
    """No flags: the n0 replicas report their copy cost in Load events and the router fits the prefill slope from
    first tokens, so a node-tier block is worth 1 - copy / recompute and the prefix hot on "warm" no longer ties
    requests to it; unmeasured, the fixed weight ties the first two to it."""
    import time

    from warmfleet.server.router.core.pricing import REFRESH_S

    router, body = node_router(tiny_model_dir, PolicyConfig())
    assert router.ttft is None and router.ttft_fit is not None  # fitted for the price only: it scores nothing
    measure(router)
    now = time.monotonic()
    assert router.pricing.current(now).source == "fixed"  # read at most every REFRESH_S, not per request
    p = router.pricing.current(now + REFRESH_S)
    assert p.source == "measured" and p.copy_s_per_block == COPY and p.replicas_reporting == 3
    assert p.prefill_s_per_token == pytest.approx(PREFILL, rel=0.02)
    assert p.weight == pytest.approx(PRICED, abs=0.002)
    assert router.metrics.registry.get_sample_value("warmfleet_router_node_tier_weight") == p.weight
    assert sorted(spread(router, body)) == ["http://n0-1", "http://n0-2", "http://n0-3", "http://warm"]

    fixed, body = node_router(tiny_model_dir, PolicyConfig())
    assert fixed.pricing.current(time.monotonic() + REFRESH_S).source == "fixed"
    assert spread(fixed, body)[:2] == ["http://warm", "http://warm"]


def test_explicit_flags_win_over_the_measurements_and_a_router_without_node_tiers_fits_nothing(tiny_model_dir):
    import time

    from router_fakes import static_router
    from warmfleet.server.router.core.pricing import REFRESH_S

    router, body = node_router(tiny_model_dir, PolicyConfig(node_copy_s_per_block=1e-04, prefill_s_per_token=1e-04))
    assert router.ttft_fit is None  # the prefill is given: nothing to fit
    measure(router)
    p = router.pricing.current(time.monotonic() + REFRESH_S)
    assert (p.source, p.copy_from, p.prefill_from) == ("flags", "flag", "flag")
    assert p.weight == pytest.approx(1 - 1 / B) and p.replicas_reporting == 3
    assert static_router(tiny_model_dir, ["http://a:1"]).ttft_fit is None


async def test_the_endpoint_picker_shows_the_price_its_replicas_measured(tiny_model_dir):
    """The gateway's picker shares the core: its replicas' Load events (real ZMQ) carry their copy cost, and its
    replicas view and /metrics show the price in effect and where it came from."""
    import asyncio

    import httpx
    from epp_fakes import EppFleet
    from warmfleet.server.events import Load

    settings = {"node_tier_events": ["127.0.0.1:9"], "policy": PolicyConfig(prefill_s_per_token=PREFILL)}
    async with EppFleet(tiny_model_dir, settings=settings) as f:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{f.epp.http_port}") as c:
            view = (await c.get("/v1/router/replicas")).json()["node_tier_pricing"]
            assert view["source"] == "fixed" and view["weight"] == 0.4 and view["prefill_from"] == "flag"
            for r, copy in zip(f.replicas, (COPY, 3 * COPY)):
                r.publish([Load(0, 0, 64, 64, copy)])
            for _ in range(500):  # read again at most every second; a hang fails here, not forever
                view = (await c.get("/v1/router/replicas")).json()["node_tier_pricing"]
                if view["source"] == "measured" and view["replicas_reporting"] == 2:
                    break
                await asyncio.sleep(0.02)
            assert view["source"] == "measured" and view["copy_from"] == "replicas"
            assert view["copy_us_per_block"] == pytest.approx(34.0)  # the median of the two: 2 x COPY
            assert view["weight"] == pytest.approx(1 - 2 * COPY / (B * PREFILL), abs=1e-4)
            text = (await c.get("/metrics")).text
            gauge = next(line for line in text.splitlines() if line.startswith("warmfleet_router_node_tier_weight "))
            assert float(gauge.split()[1]) == pytest.approx(view["weight"], abs=1e-4)
