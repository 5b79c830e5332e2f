"""Router against Fake replica apps on loopback: affinity from real KV events, retries, stream breaks, health, auth."""

from __future__ import annotations

import asyncio
import json
import struct
import threading

import httpx
import msgpack
import pytest

from router_fakes import BLOCK, SYSTEM, Served, FakeSharedFailures, FakeReplica, Fleet2, chat, synced
from waiting import until
from warmfleet.server.events import BlockStored
from warmfleet.server.hashing import block_hashes
from warmfleet.server.router.core.prompt import HashConfig
from warmfleet.server.router.core.registry import ReplicaSpec
from warmfleet.server.router.core.runtime import RouterRuntime
from warmfleet.server.router.core.settings import RouterSettings
from warmfleet.server.router.core.tenants import Tenants, derive_salt
from warmfleet.server.router.http.app import build_app


async def test_shared_prefix_lands_where_it_is_cached(tiny_model_dir):
    async with Fleet2(tiny_model_dir) as f:
        r1 = await f.client.post("/v1/chat/completions", json=chat("What is a KV cache?"))
        assert r1.status_code == 200 and r1.headers["x-warmfleet-route"].startswith("cold_hash")
        first = r1.headers["x-warmfleet-replica"]
        url = f.url_of(first)
        await until(lambda: f.fleet.index.state(url).gpu, "KV events from the first request")
        r2 = await f.client.post("/v1/chat/completions", json=chat("And what is a block?"))
        assert r2.headers["x-warmfleet-replica"] == first
        assert r2.headers["x-warmfleet-route"].startswith("prefix_hit")
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 4 * BLOCK
        # prediction equals what the replica reported, for both requests
        assert f.metric("warmfleet_router_predicted_cached_tokens_total") == \
            f.metric("warmfleet_router_actual_cached_tokens_total") == cached
        # a streamed request is relayed whole and its usage observed
        r3 = await f.client.post("/v1/chat/completions", json=chat("Stream it", stream=True))
        assert r3.text.endswith("data: [DONE]\n\n") and r3.headers["x-warmfleet-replica"] == first
        assert f.metric("warmfleet_router_actual_cached_tokens_total") > cached


def chats(replica: FakeReplica) -> list[dict]:
    """The chat requests a replica received (warm-up replays are prompt-id completions)."""
    return [b for b in replica.received if "messages" in b]


@pytest.mark.parametrize("mode", ["503", "reset"])
@pytest.mark.parametrize("stream", [False, True])
async def test_retry_on_next_replica_before_first_byte(tiny_model_dir, mode, stream):
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, mode)) as f:
        r = await f.client.post("/v1/chat/completions", json=chat("retry me", stream=stream))
        assert r.status_code == 200, r.text
        # failed once, then answered elsewhere (a replica marked down by a reset is warmed when it is back:
        # those replays are /v1/completions, not this chat request)
        assert sum(len(chats(x)) for x in f.replicas) == 2
        failed = next(x for x in f.replicas if chats(x) and x.name != r.headers["x-warmfleet-replica"])
        assert chats(failed) and f.metric("warmfleet_router_retries_total") == 1
        # the booking moved with the retry and left with the last byte: nothing stays on either replica
        assert all((x.in_flight, x.queued_tokens) == (0, 0) for x in f.fleet.registry.replicas.values())
        if stream:
            assert r.text.startswith("data: ") and r.text.endswith("data: [DONE]\n\n")


class FakeSlowImageRenderer:
    """The real renderer, except that a chat with images waits for `release` (a huge image request being hashed)."""

    def __init__(self, real):
        self.real, self.release, self.started = real, threading.Event(), threading.Event()

    def chat(self, body):
        if any(isinstance(p, dict) and p.get("type") == "image_url"
               for m in body["messages"] for p in (m["content"] if isinstance(m["content"], list) else [])):
            self.started.set()
            assert self.release.wait(30), "never released"
        return self.real.chat(body)

    def completion(self, body):
        return self.real.completion(body)


async def test_an_image_request_being_hashed_does_not_hold_text_requests(tiny_model_dir):
    async with Fleet2(tiny_model_dir) as f:
        router = f.app.state.router
        router.renderer = slow = FakeSlowImageRenderer(router.renderer)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        body = {"model": "tiny", "max_tokens": 1,
                "messages": [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]}
        held = asyncio.create_task(f.client.post("/v1/chat/completions", json=body))
        await until(slow.started.is_set, "the image request's render")
        r = await f.client.post("/v1/chat/completions", json=chat("a text question meanwhile"))
        assert r.status_code == 200 and not held.done()  # answered while the image render still waits
        slow.release.set()
        await held  # this text-only fake replica cannot read the image; what matters is that it was forwarded
        assert [b for x in f.replicas for b in chats(x) if b["messages"] == body["messages"]]


async def test_prompt_counts_as_queued_work_until_its_first_token(tiny_model_dir):
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, "prefill")) as f:
        task = asyncio.create_task(f.client.post("/v1/chat/completions", json=chat("a cold prompt", stream=True)))
        reps = f.fleet.registry.replicas
        await until(lambda: any(r.received for r in f.replicas), "the request reaching a replica")
        held = next(r for r in f.replicas if r.received)
        rep = reps[f.url_of(held.name)]
        num_tokens = len(held._prompt_ids(held.received[0]))
        assert rep.in_flight == 1 and rep.queued_tokens == num_tokens  # nothing cached anywhere yet
        assert f.metric("warmfleet_router_replica_queued_tokens", replica=rep.id) == num_tokens
        held.release.set()
        r = await task
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert rep.queued_tokens == 0 and rep.in_flight == 0
        assert f.metric("warmfleet_router_replica_queued_tokens", replica=rep.id) == 0
        assert all(x.queued_tokens == 0 for x in reps.values())


async def test_refused_connection_marks_replica_down_and_retries(tiny_model_dir):
    async with Fleet2(tiny_model_dir, health_interval_s=60) as f:  # only passive detection can notice
        await f.served[0].stop()
        dead = f.served[0].url
        answered = set()
        # distinct cold prefixes place by rendezvous hashing; keep going until one was placed on the dead replica
        for i in range(32):
            body = {"model": "tiny", "messages": [{"role": "system", "content": f"Tenant {i}: " + SYSTEM},
                                                  {"role": "user", "content": "question"}]}
            r = await f.client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            answered.add(r.headers["x-warmfleet-replica"])
            if not f.fleet.registry.get(dead).healthy:
                break
        assert answered == {"r1"}
        assert not f.fleet.registry.get(dead).healthy
        assert not synced(f.fleet.index, [dead])  # purged


async def test_mid_stream_break_ends_with_sse_error(tiny_model_dir):
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, "break")) as f:
        async with f.client.stream("POST", "/v1/chat/completions", json=chat("break", stream=True)) as r:
            assert r.status_code == 200
            body = b"".join([c async for c in r.aiter_raw()]).decode()
        events = [e for e in body.split("\n\n") if e]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["hello", "world"]
        assert "error" in json.loads(events[2][6:]) and events[3] == "data: [DONE]"
        assert sum(len(chats(x)) for x in f.replicas) == 1  # bytes had reached the client: no retry
        assert f.metric("warmfleet_router_stream_breaks_total") == 1


async def test_dead_replica_stops_receiving_by_its_next_health_checks(tiny_model_dir):
    async with Fleet2(tiny_model_dir, health_interval_s=0.2) as f:
        victim = f.served[0]
        checks: list[str] = []  # health checks applied after the stop, by replica: rounds, not seconds
        apply_check = f.fleet._apply_check

        async def counted(rep, result):
            checks.append(rep.spec.url)
            await apply_check(rep, result)

        f.fleet._apply_check = counted
        await victim.stop()
        await until(lambda: not f.fleet.registry.get(victim.url).healthy, "health check to notice", timeout_s=10.0)
        # out within the checks its rule allows (a refused connection: the first), however slow the host
        assert checks.count(victim.url) <= f.fleet.health_failures, checks
        for i in range(6):
            r = await f.client.post("/v1/chat/completions", json=chat(f"after {i}"))
            assert r.headers["x-warmfleet-replica"] == "r1"
        assert f.metric("warmfleet_router_retries_total") == 0
        assert (await f.client.get("/ready")).json()["routable_replicas"] == 1


async def test_a_replica_still_loading_its_model_is_not_routed_to(tiny_model_dir):
    """A restarted replica answers /health as soon as it listens, /ready only once its model is loaded.

    Before the router asked /ready, a replica restarted under load was back in rotation ~3 s before
    it could serve (tests/reliability/test_replica_kill.py): every request sent there got a 503 and a retry.
    """
    async with Fleet2(tiny_model_dir, health_interval_s=0.05) as f:
        rep, url = f.replicas[0], f.served[0].url
        rep.ready = False
        await until(lambda: not f.fleet.registry.get(url).healthy, "the loading replica out of rotation")
        for i in range(8):  # distinct tenants: cold prefixes spread over both replicas by rendezvous hashing
            r = await f.client.post("/v1/chat/completions", json=chat("while it loads", tenant=i))
            assert r.status_code == 200 and r.headers["x-warmfleet-replica"] == "r1"
        assert not rep.received and f.metric("warmfleet_router_retries_total") == 0
        rep.ready = True
        await until(lambda: f.fleet.registry.get(url).healthy and synced(f.fleet.index, [url]),
                    "back in rotation and resynced once ready")


@pytest.mark.parametrize("mode", ["slow", "503"])
async def test_one_failed_health_check_keeps_a_replica_and_its_index(tiny_model_dir, mode):
    async with Fleet2(tiny_model_dir, health_interval_s=0.05) as f:
        rep, url = f.replicas[0], f.served[0].url
        rep.gpu.append(b"\x01" * 32)
        rep.publish([BlockStored([b"\x01" * 32], None, [], BLOCK)])
        await until(lambda: f.fleet.index.state(url).gpu, "the block in the index")
        ups = f.metric("warmfleet_router_resyncs_total", replica=url, cause="recovered")  # 1: it came up at start
        rep.health_script = [mode]
        await until(lambda: not rep.health_script, "the failing check")
        await until(lambda: f.fleet.registry.get(url).failed_checks == 0, "a passing check after it", timeout_s=3.0)
        assert f.fleet.registry.get(url).down_since is None and f.fleet.index.state(url).gpu == {b"\x01" * 32}
        assert f.metric("warmfleet_router_resyncs_total", replica=url, cause="recovered") == ups
        rep.health_script = [mode, mode]  # two in a row: out of rotation (index purged), then back by a resync
        await until(lambda: f.metric("warmfleet_router_resyncs_total", replica=url, cause="recovered") == ups + 1,
                    "two failed checks to take it out and a passing one to bring it back", timeout_s=5.0)
        await until(lambda: f.fleet.index.state(url).gpu == {b"\x01" * 32}, "the index rebuilt from a snapshot")


async def test_a_joining_replica_is_warmed_with_hot_prefixes_before_it_takes_traffic(tiny_model_dir):
    tenants = Tenants({"key-a": None, "key-b": None})
    async with Fleet2(tiny_model_dir, tenants=tenants) as f:
        keys = {"key-a": {"authorization": "Bearer key-a"}, "key-b": {"authorization": "Bearer key-b"}}
        for i in range(8):  # hot prefixes, two tenants
            for key, h in keys.items():
                r = await f.client.post("/v1/chat/completions", json=chat(f"question {i}", tenant=i), headers=h)
                assert r.status_code == 200
        new = FakeReplica("r2", f.tok, f.fp, f.failures)
        new.gate = asyncio.Event()  # hold its warm-up requests to watch the warming state
        f.replicas.append(new)
        served = await Served(new.app).start()
        f.served.append(served)
        f.by_url[served.url] = new
        join = asyncio.create_task(f.fleet.set_members(
            [ReplicaSpec(s.url, r.events) for s, r in zip(f.served, f.replicas)]))
        await until(lambda: new.received, "the first warm-up request")
        view = {x["id"]: x for x in (await f.client.get("/v1/router/replicas")).json()["replicas"]}
        assert view[served.url]["state"] == "warming"
        for i in range(6):  # meanwhile traffic goes to the warm replicas only
            r = await f.client.post("/v1/chat/completions", json=chat(f"during {i}", tenant=50 + i), headers=keys["key-a"])
            assert r.headers["x-warmfleet-replica"] != "r2"
        new.gate.set()
        await join
        await until(lambda: not f.fleet.registry.get(served.url).warming, "the warm-up to end")
        replayed = [b for b in new.received if b.get("max_tokens") == 1]
        assert replayed and all(isinstance(b["prompt"], list) and b["model"] == "tiny" for b in replayed)
        # replayed under the salt of the tenant each prefix came from, never another's
        salts = {derive_salt(k) for k in keys}
        assert {b["cache_salt"] for b in replayed} <= salts and len({b["cache_salt"] for b in replayed}) == 2
        view = {x["id"]: x for x in (await f.client.get("/v1/router/replicas")).json()["replicas"]}
        warm = view[served.url]
        assert warm["state"] == "ready" and warm["last_warmup"]["prefixes"] == len(replayed)
        assert warm["last_warmup"]["tokens"] == sum(len(b["prompt"]) for b in replayed)
        assert f.metric("warmfleet_router_warmup_tokens_total", replica=served.url) == warm["last_warmup"]["tokens"]
        # and its cache now holds what it was warmed with: the index says so from its own events
        await until(lambda: len(f.fleet.index.state(served.url).gpu) > 0, "the new replica's KV events")


async def test_api_key_injects_per_tenant_salt(tiny_model_dir):
    tenants = Tenants({"key-one": None, "key-two": "salt-two"})
    async with Fleet2(tiny_model_dir, tenants=tenants) as f:
        assert (await f.client.post("/v1/chat/completions", json=chat("hi"))).status_code == 401
        bad = {"authorization": "Bearer nope"}
        assert (await f.client.post("/v1/chat/completions", json=chat("hi"), headers=bad)).status_code == 401
        one, two = {"authorization": "Bearer key-one"}, {"authorization": "Bearer key-two"}
        r = await f.client.post("/v1/chat/completions", json=chat("tenant one", cache_salt="evil"), headers=one)
        assert r.status_code == 200
        got = f.by_url[f.url_of(r.headers["x-warmfleet-replica"])].received[-1]
        assert got["cache_salt"] == derive_salt("key-one") + "/evil"
        assert "authorization" not in {k.lower() for k in got}  # the tenant's key is not forwarded
        url = f.url_of(r.headers["x-warmfleet-replica"])
        await until(lambda: f.fleet.index.state(url).gpu, "tenant one's blocks")
        # same text, other tenant: the router must not predict a hit across tenants
        r2 = await f.client.post("/v1/chat/completions", json=chat("tenant one", cache_salt="evil"), headers=two)
        assert not r2.headers["x-warmfleet-route"].startswith("prefix_hit")
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        got2 = f.by_url[f.url_of(r2.headers["x-warmfleet-replica"])].received[-1]
        assert got2["cache_salt"] == "salt-two/evil"


async def test_per_client_concurrency_limit(tiny_model_dir):
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, "hold"), max_concurrent_per_client=1) as f:
        async with f.client.stream("POST", "/v1/chat/completions", json=chat("long", stream=True)) as held:
            assert held.status_code == 200
            r = await f.client.post("/v1/chat/completions", json=chat("second"))
            assert r.status_code == 429
            for x in f.replicas:
                x.release.set()
            await held.aread()
        await until(lambda: not f.app.state.limiter.open, "the held request's slot to be released")
        assert (await f.client.post("/v1/chat/completions", json=chat("third"))).status_code == 200


async def test_bad_messages_and_gap_trigger_snapshot_resync(tiny_model_dir):
    # no periodic health checks: on a loaded host a slow /health would purge the replica, and its
    # resync would then be counted as "recovered" instead of "gap"
    async with Fleet2(tiny_model_dir, health_interval_s=60) as f:
        rep, url = f.replicas[0], f.served[0].url
        rep.pub.send_multipart([b"garbage"])
        rep.pub.send_multipart([b"r0", b"\x00" * 8, b"\xc1not msgpack"])
        await until(lambda: f.metric("warmfleet_router_bad_event_messages_total", replica=url) == 2, "bad messages")
        # blocks the router never heard of, then a batch that skips a sequence number
        rep.gpu.extend([b"\x01" * 32, b"\x02" * 32])
        rep.seq += 1
        rep.publish([BlockStored([b"\x03" * 32], None, [], BLOCK)])
        rep.gpu.append(b"\x03" * 32)
        await until(lambda: f.metric("warmfleet_router_resyncs_total", replica=url, cause="gap") >= 1, "gap resync")
        await until(lambda: f.fleet.index.state(url).gpu == set(rep.gpu), "index equals the snapshot")
        # and the feed goes on in order after the resync
        rep.publish([BlockStored([b"\x04" * 32], None, [], BLOCK)])
        await until(lambda: b"\x04" * 32 in f.fleet.index.state(url).gpu, "in-order event after resync")


async def test_router_keeps_following_caches_through_junk_event_frames(tiny_model_dir):
    """Junk interleaved into every replica's real event stream: garbage, vLLM-dialect maps, wild seqs."""
    async with Fleet2(tiny_model_dir, health_interval_s=60) as f:
        vllm_map = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [2**63], "parent_block_hash": None,
                                         "token_ids": [], "block_size": BLOCK, "medium": "GPU"}], 0])
        junk = [
            [b"garbage"],
            [b"r", struct.pack(">q", 5), vllm_map],
            [b"r", b"\x00" * 8, b"\xc1"],
            [b"r", struct.pack(">q", 2**62), msgpack.packb([1.0, [["BlockStored", [b"\x09" * 32], None, [], BLOCK,
                                                                    None, "GPU"]], 0])],
            [b"r", struct.pack(">q", 1), msgpack.packb([1.0, [["AllBlocksCleared"]], 0])],
        ]

        async def inject():
            while True:
                for frame in junk:
                    for rep in f.replicas:
                        rep.pub.send_multipart(frame)
                    await asyncio.sleep(0.01)

        task = asyncio.create_task(inject())
        try:
            homes = {}
            for i in range(8):
                r = await f.client.post("/v1/chat/completions", json=chat(f"first question {i}", tenant=i))
                homes[i] = r.headers["x-warmfleet-replica"]
            found = 0
            for i in range(8):
                r = await f.client.post("/v1/chat/completions", json=chat(f"second question {i}", tenant=i))
                found += r.headers["x-warmfleet-replica"] == homes[i] and \
                    r.headers["x-warmfleet-route"].startswith("prefix_hit")
        finally:
            task.cancel()
        assert found == 8
        assert all(f.metric("warmfleet_router_bad_event_messages_total", replica=s.url) > 0 for s in f.served)
        assert all(not t.done() for t in f.fleet._subscribers.values())  # no subscription died


async def test_fastdeploy_replicas_are_routed_on_a_predicted_index(tiny_model_dir):
    """No KV events: what the router sent a replica is what it predicts the replica holds, within a capacity."""
    async with Fleet2(tiny_model_dir, engine="fastdeploy", predicted_capacity_blocks=24) as f:
        r1 = await f.client.post("/v1/chat/completions", json=chat("What is a KV cache?"))
        home = r1.headers["x-warmfleet-replica"]
        assert r1.headers["x-warmfleet-route"].startswith("cold_hash")
        for q in ("And a block?", "And eviction?"):
            r = await f.client.post("/v1/chat/completions", json=chat(q))
            assert r.headers["x-warmfleet-replica"] == home and r.headers["x-warmfleet-route"].startswith("prefix_hit")
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the fake really held it
        assert f.metric("warmfleet_router_predicted_decisions_total", reason="prefix_hit") == 2
        assert (await f.client.get("/v1/router/replicas")).json()["contract"] == "predicted"
        # other prefixes (~14 blocks each) push the first one out of the 24-block predicted cache of its replica:
        # two landing there are enough (bounded load sends them to the other replica first, then alternates)
        fillers_home = 0
        for i in range(12):
            r = await f.client.post("/v1/chat/completions", json=chat("filler", tenant=100 + i))
            fillers_home += r.headers["x-warmfleet-replica"] == home
        assert fillers_home >= 2 and len(f.fleet.index.state(f.url_of(home)).gpu) <= 24
        r = await f.client.post("/v1/chat/completions", json=chat("And after eviction?"))
        # home no longer counts as warm for it (on a loaded host a flapping health check may have sent a
        # filler-time request elsewhere, which then is predicted warm: that is right too)
        assert r.headers["x-warmfleet-replica"] != home or not r.headers["x-warmfleet-route"].startswith("prefix_hit")
        # load comes from FastDeploy's own gauges on its metrics port
        f.by_url[f.url_of(home)].running, f.by_url[f.url_of(home)].waiting = 3, 4
        await until(lambda: f.fleet.engine_load(f.url_of(home)) == 7, "load from the replica's /metrics")
        assert f.metric("warmfleet_router_replica_engine_requests", replica=f.url_of(home)) == 7


async def test_oversized_body_is_413_before_routing():
    from warmfleet.server.router.core.prompt import HashConfig
    from warmfleet.server.router.core.runtime import RouterRuntime
    from warmfleet.server.router.http.app import build_app

    app = build_app(RouterRuntime(hash_cfg=HashConfig(16, "fp"), settings=RouterSettings(max_request_bytes=1000)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
        for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            r = await c.post(path, content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"})
            assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"], (path, r.text)


@pytest.mark.parametrize("status", [200, 204, 304, 400, 429])
def test_relayed_answers_carry_the_headers_starlette_would_send(status):
    from starlette.responses import Response

    from warmfleet.server.router.http.proxy import RelayedResponse

    headers = {"content-type": "application/json", "x-warmfleet-replica": "http://a:1",
               "x-warmfleet-route": "prefix_hit; predicted_cached_tokens=48"}
    body = b"" if status in (204, 304) else b'{"id": "x"}'
    ours, theirs = RelayedResponse(body, status, headers), Response(body, status, headers)
    assert (ours.status_code, ours.body, ours.raw_headers) == (theirs.status_code, theirs.body, theirs.raw_headers)
