"""Hot-prefix memory for warm-up: conversations fold into one entry, hits decay, bounds hold, selection owns first."""

import json

import httpx
from fastapi import FastAPI

from warmfleet.server.router.core.fleet import Fleet
from warmfleet.server.router.core.metrics import RouterMetrics
from warmfleet.server.router.core.policy import rendezvous_weight
from warmfleet.server.router.core.registry import ReplicaSpec
from warmfleet.server.router.core.warmup import HotPrefixes, WarmupConfig

from router_fakes import Served

BS = 4


def H(*ids) -> list[bytes]:
    """Fake chain hashes: block i's name is the tuple of every token up to its end (a real chain would be too)."""
    return [bytes(str(ids[: (i + 1) * BS]), "ascii") for i in range(len(ids) // BS)]


def observe(hot, ids, now, salt=None, cold=b"k"):
    hot.observe(ids, H(*ids), BS, salt, "tiny", cold, now)


def test_a_conversation_is_one_entry_that_grows_and_keeps_its_hits():
    hot = HotPrefixes(WarmupConfig(half_life_s=1e9))
    turn1 = list(range(10))  # two full blocks
    observe(hot, turn1, 0.0)
    observe(hot, turn1 + [50, 51, 52, 53, 54], 1.0)  # next turn extends it
    assert len(hot.entries) == 1
    (e,) = hot.entries.values()
    assert e.token_ids == turn1[:8] + [8, 9, 50, 51] and abs(e.hits - 2.0) < 1e-6  # full blocks only
    observe(hot, [7] * 9, 2.0)  # another prefix
    assert len(hot.entries) == 2 and hot.num_tokens == 12 + 8


def test_hits_decay_with_the_half_life_and_bounds_evict_the_coldest():
    hot = HotPrefixes(WarmupConfig(half_life_s=10.0, capacity=3, max_tokens=10_000))
    for rep in range(4):  # prefix A: four hits long ago
        observe(hot, [1] * 8, 0.0)
    assert next(iter(hot.entries.values())).score(10.0, 10.0) == 2.0  # halved once
    observe(hot, [2] * 8, 100.0)
    observe(hot, [3] * 8, 100.0)
    observe(hot, [4] * 8, 100.0)  # over capacity: A (score ~0.004) goes first
    assert all(e.token_ids[0] != 1 for e in hot.entries.values()) and len(hot.entries) <= 3
    tight = HotPrefixes(WarmupConfig(capacity=100, max_tokens=20))
    for k in range(5):
        observe(tight, [10 + k] * 8, float(k))
    assert tight.num_tokens <= 20 and tight.num_tokens == sum(len(e.token_ids) for e in tight.entries.values())


def test_selection_puts_owned_prefixes_first_and_keeps_the_budget_and_salts():
    hot = HotPrefixes(WarmupConfig(half_life_s=1e9))
    members = ["http://a", "http://b", "http://new"]
    for k in range(40):
        cold = bytes([k]) * 8
        for _ in range(k % 3 + 1):
            observe(hot, [100 + k] * 8, 0.0, salt=f"tenant-{k % 2}", cold=cold)
    owner = {e.key: max(members, key=lambda m: rendezvous_weight(e.cold_key, m)) for e in hot.entries.values()}
    chosen = hot.select("http://new", members, budget_tokens=8 * 10, now=1.0)
    assert len(chosen) == 10  # 80 tokens of 8-token prefixes
    owned = [e for e in chosen if owner[e.key] == "http://new"]
    assert chosen[:len(owned)] == owned and len(owned) >= 5  # ~1/3 of 40 are owned: all fit, hottest first
    assert [e.score(1.0, 1e9) for e in owned] == sorted((e.score(1.0, 1e9) for e in owned), reverse=True)
    assert {e.salt for e in chosen} <= {"tenant-0", "tenant-1"}
    assert hot.select("http://new", members, budget_tokens=7, now=1.0) == []


def test_handoff_moves_the_leaving_replicas_prefixes_to_their_new_owners_within_the_budget():
    hot = HotPrefixes(WarmupConfig(half_life_s=1e9))
    members = ["http://a", "http://b", "http://c"]
    for k in range(30):
        observe(hot, [200 + k] * 8, 0.0, cold=bytes([k]) * 8)
    entries = list(hot.entries.values())
    owner_all = {e.key: max(members, key=lambda m: rendezvous_weight(e.cold_key, m)) for e in entries}
    held = {e.key: {owner_all[e.key]} for e in entries}  # each prefix sits where rendezvous placed it
    extra = next(e for e in entries if owner_all[e.key] == "http://c")
    held[extra.key] = {"http://c", "http://a"}  # one of c's prefixes is also warm on a: nothing to move
    staying = ["http://a", "http://b"]
    moves = hot.select_handoff("http://c", staying, lambda k: held[k], budget_tokens=10_000, now=1.0)
    mine = {e.key for e in entries if owner_all[e.key] == "http://c"} - {extra.key}
    assert {e.key for e, _ in moves} == mine and mine
    for e, to in moves:  # each goes to its rendezvous owner among those that stay
        assert to == max(staying, key=lambda m: rendezvous_weight(e.cold_key, m))
    assert len(hot.select_handoff("http://c", staying, lambda k: held[k], budget_tokens=16, now=1.0)) == 2
    assert hot.select_handoff("http://c", ["http://c"], lambda k: held[k], 10_000, 1.0) == []  # nobody stays


def test_a_prefix_under_an_adapter_is_replayed_only_where_that_adapter_is_served():
    hot = HotPrefixes(WarmupConfig(half_life_s=1e9))
    hot.observe([1] * 8, H(*[1] * 8), BS, None, "sql", b"k1", 0.0)  # asked under adapter "sql"
    hot.observe([2] * 8, H(*[2] * 8), BS, None, "tiny", b"k2", 0.0)  # the base model
    serves = lambda rid, model: model != "sql"  # noqa: E731 - the joiner does not list "sql"
    assert [e.model for e in hot.select("http://new", ["http://new"], 10_000, 1.0, serves)] == ["tiny"]
    assert {e.model for e in hot.select("http://new", ["http://new"], 10_000, 1.0)} == {"sql", "tiny"}
    moves = hot.select_handoff("http://c", ["http://a"], lambda k: {"http://c"}, 10_000, 1.0, serves)
    assert [e.model for e, _ in moves] == ["tiny"]


async def test_warm_up_reads_the_joiners_adapters_before_replaying_an_adapters_prefix():
    replayed: list[str] = []
    listing = FastAPI()  # the joiner's /v1/models, read over loopback (the scrape's aiohttp session)

    @listing.get("/v1/models")
    async def models():  # the joiner lists "chat" but not "sql"
        cards = [{"id": "tiny"}, {"id": "chat", "parent": "tiny", "lora_digest": "d"}]
        return {"object": "list", "data": cards}

    def replica(req: httpx.Request) -> httpx.Response:  # the replays (the warmer's httpx client)
        if req.url.path == "/v1/completions":
            replayed.append(json.loads(req.content)["model"])
            return httpx.Response(200, json={})
        return httpx.Response(404)

    served = await Served(listing).start()
    async with httpx.AsyncClient(transport=httpx.MockTransport(replica)) as http:
        fleet = Fleet(http, RouterMetrics(), adapter_poll_s=None)
        fleet.warmer.http = http
        await fleet.set_members([ReplicaSpec("http://old"), ReplicaSpec(served.url)])  # probes fail or are not made
        for rid in ("http://old", served.url):
            fleet.registry.mark_up(rid)
        fleet.adapters.learn_served("http://old", {"sql": "s", "chat": "c"})  # another replica serves both
        for ids, model in (([1] * 8, "sql"), ([2] * 8, "chat"), ([3] * 8, "tiny")):
            fleet.warmer.hot.observe(ids, H(*ids), BS, None, model, b"k" + bytes(ids[:1]), 0.0)
        joiner = fleet.registry.get(served.url)
        joiner.warming, fleet.registry.get("http://old").sent = True, 50.0
        try:
            await fleet.warmer._run(fleet, joiner)
        finally:
            await fleet.stop()
            await served.stop()
    assert sorted(replayed) == ["chat", "tiny"]  # "sql" would have been a 404
    assert joiner.last_warmup["prefixes"] == 2
    assert joiner.sent == 50.0 and not joiner.warming  # routable at the others' mean share (Fleet.even_share)
