"""The router's LoRA adapter affinity: adapter-aware block names (ours and vLLM's), what it learns of each replica's
adapters, and the policy's adapter parts (resident first, hot spread, max_loras, cold rendezvous)."""

from __future__ import annotations

import random

import pytest

from router_fakes import static_router
from warmfleet.server import hashing
from warmfleet.server.hashing import AdapterId
from warmfleet.server.router.core import lora
from warmfleet.server.router.core.booking import Booking
from warmfleet.server.router.core.engines.vllm import VllmDialect, none_hash, sha256_cbor, vllm_block_digests
from warmfleet.server.router.core.engines.warmfleet import WarmfleetDialect
from warmfleet.server.router.core.policy import (
    ADAPTER_HIT, COLD_HASH, LOAD_SPILL, Candidate, PolicyConfig, adapter_slot_first, choose, rendezvous_weight,
    share_cap,
)
from warmfleet.server.router.core.prompt import HashConfig, Prompt
from warmfleet.server.router.core.router import adapter_key

B = 16
CFG = HashConfig(block_size=B, model_fingerprint="fp")


# --- block names ---------------------------------------------------------------------------------
def test_our_adapter_chain_is_the_engines_and_differs_per_adapter_and_salt():
    prompt = Prompt(list(range(70)), [], 70)
    d = WarmfleetDialect()
    sql, chat = AdapterId("sql", "d1"), AdapterId("chat", "d2")
    got = d.block_hashes(prompt, None, CFG, sql)
    assert got == hashing.block_hashes(prompt.token_ids, [], B, "fp", adapter=sql)  # the replica's own recipe
    assert d.block_hashes(prompt, None, CFG, sql) == got  # memoised: the same again
    others = [d.block_hashes(prompt, None, CFG), d.block_hashes(prompt, None, CFG, chat),
              d.block_hashes(prompt, None, CFG, AdapterId("sql", "d3")), d.block_hashes(prompt, "tenant", CFG, sql)]
    for other in others:  # base, another adapter, the same name on other files, another tenant: no block shared
        assert not set(other) & set(got)
    assert d.block_hashes(prompt, "tenant", CFG, sql) == hashing.block_hashes(
        prompt.token_ids, [], B, "fp", cache_salt="tenant", adapter=sql)


def test_vllm_lora_key_leads_every_blocks_extra_keys_as_vllm_032_builds_them():
    tokens = list(range(64))
    key = ("lora", "sql", "/adapters/sql-1")
    got = vllm_block_digests(tokens, [], 32, "salt", "0", lora=key)
    b0 = sha256_cbor((none_hash("0"), tuple(tokens[:32]), (key, ("cache_salt", "salt"))))
    b1 = sha256_cbor((b0, tuple(tokens[32:]), (key,)))
    assert got == [b0, b1]
    assert vllm_block_digests(tokens, [], 32, "salt", "0")[0] != b0


def test_adapter_identity_per_dialect_from_a_models_entry():
    card = {"id": "sql", "parent": "tiny", "root": "/adapters/sql-1", "lora_digest": "ab12"}
    assert WarmfleetDialect().adapter_identity(card) == AdapterId("sql", "ab12")
    assert WarmfleetDialect().adapter_identity({**card, "lora_digest": None}) is None  # cannot key it: left out
    assert VllmDialect("0").adapter_identity(card) == ("lora", "sql", "/adapters/sql-1")
    models = {"data": [{"id": "tiny", "root": "/m"}, card, {"id": "chat", "parent": "tiny"}]}
    assert lora.served_adapters(models, WarmfleetDialect()) == {"sql": AdapterId("sql", "ab12")}
    assert lora.served_adapters({"error": "x"}, WarmfleetDialect()) == {}


# --- what the router learns ----------------------------------------------------------------------
def test_lora_info_takes_the_newest_series():
    page = "\n".join([
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 100.0',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,c",waiting_lora_adapters="d"} 200.0',
        'vllm:num_requests_running{model_name="x"} 1.0'])
    assert lora.parse_lora_info(page) == lora.LoraInfo(2, frozenset({"b", "c"}), frozenset({"d"}))
    assert lora.parse_lora_info("vllm:num_requests_running 1.0") is None


def test_view_resident_from_the_metric_and_this_routers_sends_bounded_by_max_loras():
    v = lora.AdapterView()
    v.learn_served("r", {"a": 1, "b": 2, "c": 3})
    v.learn_info("r", lora.LoraInfo(2, frozenset({"a"}), frozenset()))
    assert v.is_adapter("a") and not v.is_adapter("tiny") and not v.is_adapter(None)
    assert v.resident("r", "a") and not v.resident("r", "b")
    v.sent("r", "b")
    v.sent("r", "c")
    assert v.resident("r", "b") and v.resident("r", "c")
    v.done("r", "b")
    v.done("r", "c")
    v.sent("r", "a")  # the router's model of the slots: the last max_loras adapters it sent
    assert not v.resident("r", "b") and v.resident("r", "c") and v.resident("r", "a")
    v.forget("r")
    assert not v.resident("r", "a") and not v.is_adapter("a")


def test_a_slot_is_free_unless_max_loras_other_adapters_are_busy():
    v = lora.AdapterView()
    v.learn_served("r", {n: n for n in "abcd"})
    v.learn_info("r", lora.LoraInfo(2, frozenset(), frozenset({"d"})))  # d waits on the replica
    assert v.has_slot("r", "a")
    v.sent("r", "b")  # b in flight + d waiting = 2 busy
    assert not v.has_slot("r", "a") and v.has_slot("r", "b")  # b is resident: always placeable there
    v.done("r", "b")
    assert v.has_slot("r", "a")
    assert v.has_slot("unknown", "a")  # nothing known: no reason to refuse it
    # our running label is the resident slots, idle ones included: not busy; vLLM's names adapters with requests
    v.learn_info("r", lora.LoraInfo(2, frozenset({"b", "c"}), frozenset()), running_busy=False)
    assert v.has_slot("r", "a")
    v.learn_info("r", lora.LoraInfo(2, frozenset({"b", "c"}), frozenset()), running_busy=True)
    assert not v.has_slot("r", "a") and v.has_slot("r", "b")
    assert VllmDialect("0").lora_running_busy and not WarmfleetDialect().lora_running_busy


# --- policy ----------------------------------------------------------------------------------------
def cands(n: int, **per) -> list[Candidate]:
    return [Candidate(f"r{i}", **{k: v[i] for k, v in per.items()}) for i in range(n)]


def test_the_replica_with_the_adapter_resident_wins_at_equal_load():
    cs = cands(3, adapter_resident=[False, True, False])
    d = choose(cs, block_size=B, num_prompt_tokens=40, cold_key=b"k", adapter_key=adapter_key("sql"))
    assert d.order[0] == "r1" and d.reason == ADAPTER_HIT
    # no weight for residency: the same request is placed by the adapter's rendezvous (cold)
    d0 = choose(cs, block_size=B, num_prompt_tokens=40, cold_key=b"k", adapter_key=adapter_key("sql"),
                cfg=PolicyConfig(adapter_weight=0))
    assert d0.order[0] in ("r0", "r1", "r2")


def test_cold_adapters_go_by_their_own_rendezvous_so_each_replica_holds_a_stable_subset():
    names = [f"ad{i}" for i in range(40)]
    homes = {}
    for name in names:
        cs = cands(4)
        random.Random(name).shuffle(cs)
        d = choose(cs, block_size=B, num_prompt_tokens=40, cold_key=b"prompt-" + name.encode(),
                   adapter_key=adapter_key(name))
        assert d.reason == COLD_HASH
        homes[name] = d.order[0]
        assert d.order[0] == max(("r0", "r1", "r2", "r3"), key=lambda r: rendezvous_weight(adapter_key(name), r))
    assert len(set(homes.values())) == 4  # spread over the fleet, not all on one replica
    # a replica leaving moves only its own adapters
    for name, home in homes.items():
        cs = [c for c in cands(4) if c.replica != "r3"]
        d = choose(cs, block_size=B, num_prompt_tokens=40, cold_key=b"x", adapter_key=adapter_key(name))
        assert home == "r3" or d.order[0] == home


def test_a_hot_adapter_spills_over_the_caps_to_the_same_next_home_and_then_stays_resident_there():
    key = adapter_key("hot")
    # r0 has it resident but is far over the load cap: the next home is the top rendezvous replica among the rest
    cs = cands(4, adapter_resident=[True, False, False, False], load=[6, 0, 0, 0], sent=[6.0, 0.0, 0.0, 0.0])
    d = choose(cs, block_size=B, num_prompt_tokens=40, cold_key=b"k", adapter_key=key)
    next_home = max(("r1", "r2", "r3"), key=lambda r: rendezvous_weight(key, r))
    assert d.order[0] == next_home
    for k in range(3):  # the same next home whatever the other loads' order and tie noise
        shuffled = list(cs)
        random.Random(k).shuffle(shuffled)
        assert choose(shuffled, block_size=B, num_prompt_tokens=40, cold_key=b"k", adapter_key=key).order[0] == next_home
    # once resident there too, requests share the two homes by load
    resident = [c.replica in ("r0", next_home) for c in cs]
    cs2 = cands(4, adapter_resident=resident, load=[1, 0, 0, 0])
    cs2 = [Candidate(c.replica, adapter_resident=c.adapter_resident, load=1 if c.replica == next_home else 0)
           for c in cs2]
    assert choose(cs2, block_size=B, num_prompt_tokens=40, cold_key=b"k", adapter_key=key).order[0] == "r0"


def test_a_resident_adapter_stays_home_a_few_requests_over_the_share_cap_rather_than_load_elsewhere():
    key, cfg = adapter_key("hot"), PolicyConfig(adapter_share_slack=2)
    scap = share_cap([12.0, 6.0, 6.0], cfg.share_epsilon)  # r0 is over it, the others under

    def target(resident, sent0=12.0, cfg=cfg):
        cs = cands(3, adapter_resident=resident, sent=[sent0, 6.0, 6.0])
        return choose(cs, block_size=B, num_prompt_tokens=40, cold_key=b"k", adapter_key=key, cfg=cfg).order[0]

    assert scap < 12 + 1 <= scap + cfg.warm_slack + cfg.adapter_share_slack  # over the cap, within the slack
    assert target([True, False, False]) == "r0"  # moving would load the adapter on r1 or r2 and evict another
    assert target([True, True, False]) == "r1"  # another home under the caps has it: that one, no load anywhere
    assert target([True, False, False], sent0=14.0) != "r0"  # beyond the slack the share cap holds
    assert target([True, False, False], cfg=PolicyConfig(adapter_share_slack=0)) != "r0"  # slack off: spills
    assert target([False, False, False]) != "r0"  # nothing resident: nothing to keep


def test_never_over_max_loras_while_another_replica_has_a_slot():
    # r0 holds the longest prefix but every slot there is busy with other adapters: r1 has a free slot
    cs = cands(3, gpu_blocks=[3, 0, 0], adapter_slot=[False, True, False])
    d = choose(cs, block_size=B, num_prompt_tokens=80, cold_key=b"k", adapter_key=adapter_key("a"))
    assert d.order[0] == "r1" and d.order[-2:] == ["r0", "r2"]  # the full ones stay as retry fallbacks, last
    assert d.reason == LOAD_SPILL and d.predicted_cached_tokens == 0  # moved off the warm replica: said so
    # nobody has a slot: the policy's own order (the replica queues the request, it never refuses it)
    full = cands(3, gpu_blocks=[3, 0, 0], adapter_slot=[False, False, False])
    assert choose(full, block_size=B, num_prompt_tokens=80, cold_key=b"k", adapter_key=adapter_key("a")).order[0] == "r0"
    assert [c.replica for c in adapter_slot_first(cs)] == ["r1", "r0", "r2"]


def test_base_model_requests_ignore_the_adapter_fields():
    cs = cands(3, gpu_blocks=[0, 2, 0], adapter_resident=[True, False, False], adapter_slot=[True, False, True])
    d = choose(cs, block_size=B, num_prompt_tokens=80, cold_key=b"k")
    plain = choose(cands(3, gpu_blocks=[0, 2, 0]), block_size=B, num_prompt_tokens=80, cold_key=b"k")
    assert d.order == plain.order and d.reason == plain.reason and d.adapter is None


# --- the router: one decision over a fleet serving adapters -------------------------------------------
@pytest.fixture()
def router(tiny_model_dir):
    urls = [f"http://10.0.0.{i}:8000" for i in range(3)]
    router = static_router(tiny_model_dir, urls, B)
    fleet = router.fleet
    sql = AdapterId("sql", "d-sql")
    for u in urls[:2]:  # the third does not serve sql
        fleet.adapters.learn_served(u, {"sql": sql})
        fleet.adapters.learn_info(u, lora.LoraInfo(2, frozenset(), frozenset()))
    return router, urls, sql


def body(model: str, salt=None) -> dict:
    b = {"model": model, "messages": [{"role": "system", "content": "Shared system prompt. " * 12},
                                      {"role": "user", "content": "hello"}]}
    if salt:
        b["cache_salt"] = salt
    return b


def test_router_predicts_an_adapters_own_blocks_only_among_replicas_serving_it(router):
    rt, urls, sql = router
    fleet = rt.fleet
    prompt = rt.render("chat", body("sql"))
    names = fleet.dialect.block_hashes(prompt, None, rt.hash_cfg, sql)
    base = fleet.dialect.block_hashes(prompt, None, rt.hash_cfg)
    fleet.index.add_blocks(urls[1], names[:3])  # sql's blocks on replica 1
    fleet.index.add_blocks(urls[0], base)  # the base model's blocks of the same text on replica 0
    decision, _, hashes = rt.decide("chat", body("sql"), fleet.routable())
    assert decision.order[0] == urls[1] and decision.predicted_cached_tokens == 3 * B
    assert urls[2] not in decision.order and decision.adapter == "sql" and hashes == names
    assert decision.hits[urls[0]] == 0  # the base model's blocks never serve the adapter
    tenant, _, _ = rt.decide("chat", body("sql", salt="other-tenant"), fleet.routable())
    assert tenant.predicted_cached_tokens == 0  # another tenant's salt: other names
    plain, _, _ = rt.decide("chat", body("tiny"), fleet.routable())
    assert plain.adapter is None and plain.order[0] == urls[0] and plain.hits[urls[0]] > 0
    # warm-up and hand-off replay the adapter's prefix as the adapter, homed where the policy homes the adapter
    hot = fleet.warmer.hot.entries[names[-1]]
    assert hot.model == "sql" and hot.cold_key == adapter_key("sql")
    assert fleet.warmer.hot.entries[base[-1]].cold_key == base[0]  # the base model's: its first block, as before


def test_router_books_adapter_load_per_replica_and_keeps_a_burst_together(router):
    rt, urls, _ = router
    fleet = rt.fleet
    first, _, _ = rt.decide("chat", body("sql"), fleet.routable())
    rep = fleet.registry.get(first.order[0])
    booking = Booking(rt, first)
    booking.enter(rep)
    assert fleet.adapters.replicas[rep.id].in_flight == {"sql": 1} and fleet.adapters.resident(rep.id, "sql")
    second, _, _ = rt.decide("chat", body("sql"), fleet.routable())
    assert second.order[0] == rep.id  # resident there now: before any scrape says so
    booking.leave()
    assert fleet.adapters.replicas[rep.id].in_flight == {}
