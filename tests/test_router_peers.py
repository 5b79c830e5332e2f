"""Active-active routers: two real router apps on loopback share in-flight load and per-client limits (peers.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Optional

import httpx
import pytest
import uvicorn

from router_fakes import BLOCK, FakeReplica, FakeSharedFailures, Served, static_router, synced
from waiting import until
from warmfleet.server.hashing import model_fingerprint
from warmfleet.server.router.core.peers import PeerLoad, balanced_owners, client_digest, parse_peers
from warmfleet.server.router.core.policy import rendezvous_weight
from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
from warmfleet.server.router.core.registry import Replica, ReplicaSpec
from warmfleet.server.router.core.runtime import RouterRuntime
from warmfleet.server.router.core.settings import RouterSettings
from warmfleet.server.router.core.tenants import ConcurrencyLimiter, Tenants
from warmfleet.server.router.http.app import build_app
from warmfleet.server.tokenizer import Tokenizer

SHORT = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": True}  # shorter than a block: routed by load


def live_peers(peers: PeerLoad) -> int:
    """Peers (not this router) whose last report is fresh."""
    now = time.monotonic()
    return sum(1 for p in peers.peers.values() if not p.is_self and p.seen and now - p.seen <= peers.stale_s)


class Bound:
    """A uvicorn server on a socket bound before its app exists (routers must know each other's URL first)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.task: Optional[asyncio.Task] = None

    async def start(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await until(lambda: self.server.started, "router start")

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.server.should_exit = self.server.force_exit = True
            await self.task


class TwoRouters:
    """Two fake replicas and two routers in front of them, each router given both routers' URLs."""

    def __init__(self, model_dir, *, peers: bool = True, max_concurrent_per_client: int = 0,
                 failures: Optional[FakeSharedFailures] = None, admin_key: Optional[str] = None,
                 api_keys: Optional[dict] = None):
        self.tok = Tokenizer(model_dir)
        self.fp = model_fingerprint(model_dir)
        self.failures = failures or FakeSharedFailures()
        self.replicas = [FakeReplica(f"r{i}", self.tok, self.fp, self.failures) for i in range(2)]
        self.model_dir, self.peers, self.limit = model_dir, peers, max_concurrent_per_client
        self.admin_key, self.api_keys = admin_key, api_keys or {}

    async def __aenter__(self) -> "TwoRouters":
        self.served = [await Served(r.app).start() for r in self.replicas]
        self.bound = [Bound(), Bound()]
        urls = [b.url for b in self.bound]
        self.apps = []
        for b in self.bound:
            runtime = RouterRuntime(
                hash_cfg=HashConfig(BLOCK, self.fp),
                replicas=[ReplicaSpec(s.url, r.events) for s, r in zip(self.served, self.replicas)],
                renderer=PromptRenderer(str(self.model_dir), tokenizer=self.tok), peers=urls if self.peers else [],
                tenants=Tenants(self.api_keys),
                settings=RouterSettings(health_interval_s=0.1, max_concurrent_per_client=self.limit, peer_interval_s=0.05,
                                        peer_jitter=0.0, admin_key=self.admin_key))  # deterministic tie-breaks: the tests know which replica a router picks
            app = build_app(runtime)
            await b.start(app)
            self.apps.append(app)
        for app in self.apps:
            await until(lambda: synced(app.state.fleet.index, [s.url for s in self.served]), "initial resync")
        self.clients = [httpx.AsyncClient(base_url=b.url, timeout=10) for b in self.bound]
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.aclose()
        for b in self.bound:
            await b.stop()
        for s in self.served:
            await s.stop()
        for r in self.replicas:
            r.close()

    def release(self) -> None:
        for r in self.replicas:
            r.release.set()


async def held_on_router_a(t: TwoRouters):
    """Open a stream on router A that its replica holds; returns (task, replica id it went to)."""
    task = asyncio.create_task(t.clients[0].post("/v1/completions", json=SHORT))
    await until(lambda: any(r.received for r in t.replicas), "the held request reaching a replica")
    held = next(s.url for s, r in zip(t.served, t.replicas) if r.received)
    return task, held


async def test_a_peer_routers_in_flight_request_steers_this_routers_choice(tiny_model_dir):
    async with TwoRouters(tiny_model_dir, failures=FakeSharedFailures(1, "hold")) as t:
        task, held = await held_on_router_a(t)
        # by load alone both replicas tie on router B; the tie-break (replica id) is what router A just used,
        # so without router A's figures router B would pick the same, busy replica
        assert held == min(s.url for s in t.served)
        peers_b = t.apps[1].state.peers
        await until(lambda: peers_b.replica_load(held)[0] == 1, "router B to see router A's open request")
        r = await t.clients[1].post("/v1/completions", json={**SHORT, "stream": False})
        assert r.status_code == 200
        other = next(s.url for s in t.served if s.url != held)
        assert t.replicas[[s.url for s in t.served].index(other)].received  # went to the idle replica
        t.release()
        assert (await task).status_code == 200
        await until(lambda: peers_b.replica_load(held)[:2] == (0, 0), "router A's request gone from router B's view")


async def test_each_router_finds_itself_in_the_shared_peer_list(tiny_model_dir):
    async with TwoRouters(tiny_model_dir) as t:
        for i, app in enumerate(t.apps):
            peers: PeerLoad = app.state.peers
            await until(lambda: live_peers(peers) == 1, "the other router answering")
            assert peers.peers[t.bound[i].url].is_self and not peers.peers[t.bound[1 - i].url].is_self
        view = (await t.clients[0].get("/v1/router/peer-load")).json()
        assert view["router"] == t.apps[0].state.peers.router_id
        assert set(view["replicas"]) == {s.url for s in t.served}


async def test_per_client_limit_holds_across_routers(tiny_model_dir):
    async with TwoRouters(tiny_model_dir, max_concurrent_per_client=1, failures=FakeSharedFailures(1, "hold")) as t:
        task, _ = await held_on_router_a(t)
        peers_b = t.apps[1].state.peers
        await until(lambda: peers_b.client_open("127.0.0.1") == 1, "router B to see the client's open request")
        r = await t.clients[1].post("/v1/completions", json={**SHORT, "stream": False})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        t.release()
        assert (await task).status_code == 200
        await until(lambda: peers_b.client_open("127.0.0.1") == 0, "the slot freed on router A, seen by B")
        assert (await t.clients[1].post("/v1/completions", json={**SHORT, "stream": False})).status_code == 200


async def test_without_peers_each_router_limits_only_its_own_requests(tiny_model_dir):
    """The control for the test above: the same scene with no --peers admits the second request."""
    async with TwoRouters(tiny_model_dir, peers=False, max_concurrent_per_client=1,
                          failures=FakeSharedFailures(1, "hold")) as t:
        task, _ = await held_on_router_a(t)
        assert t.apps[1].state.peers is None
        assert (await t.clients[1].post("/v1/completions", json={**SHORT, "stream": False})).status_code == 200
        t.release()
        await task


async def test_a_stopped_peer_is_left_out_of_the_sums(tiny_model_dir):
    async with TwoRouters(tiny_model_dir, failures=FakeSharedFailures(1, "hold")) as t:
        task, held = await held_on_router_a(t)
        peers_b = t.apps[1].state.peers
        await until(lambda: peers_b.replica_load(held)[0] == 1, "router B to see router A's open request")
        t.release()
        await task
        await t.bound[0].stop()  # router A is gone
        await until(lambda: live_peers(peers_b) == 0, "router A to go stale on router B", timeout_s=10)
        # the sums are recomputed after the next polling round: nothing of router A's counts any more
        await until(lambda: peers_b.replica_load(held) == (0, 0, 0.0), "router A's figures dropped")
        assert peers_b.peers[t.bound[0].url].last_error


# --- PeerLoad and the limiter without sockets ------------------------------------------------------
def test_sums_cover_fresh_peers_only_and_skip_itself():
    pl = PeerLoad(["http://a", "http://b", "http://me"], stale_s=1.0, router_id="me-id")
    pl.apply(pl.peers["http://a"], {"router": "A", "replicas": {"r0": [2, 100, 3.5]}, "clients": {"d": 1}}, now=10.0)
    pl.apply(pl.peers["http://b"], {"router": "B", "replicas": {"r0": [1, 0, 1.0], "r1": [4, 8, 2.0]},
                                    "clients": {"d": 2}}, now=9.5)
    pl.apply(pl.peers["http://me"], {"router": "me-id", "replicas": {"r0": [9, 9, 9]}, "clients": {}}, now=10.0)
    assert pl.peers["http://me"].is_self
    pl.recompute(now=10.2)
    assert pl.replica_load("r0") == (3, 100, 4.5) and pl.replica_load("r1") == (4, 8, 2.0)
    assert pl.replica_load("r9") == (0, 0, 0.0)
    assert pl._clients == {"d": 3}
    # with this router's own figures: load and queued work summed, recent share averaged over the 3 routers
    assert pl.combined("r0", 1, 5, 1.5) == (4, 105, 2.0)
    pl.recompute(now=10.7)  # B last heard at 9.5: stale
    assert pl.replica_load("r0") == (2, 100, 3.5) and pl.replica_load("r1") == (0, 0, 0.0)


def test_fresh_routers_partition_the_replicas_the_same_way_and_a_stale_one_gives_its_share_back():
    reps = [f"http://r{i}" for i in range(30)]
    views = {}
    for me in ("A", "B", "C"):
        pl = PeerLoad(["http://a", "http://b", "http://c"], router_id=me)
        for url, rid in (("http://a", "A"), ("http://b", "B"), ("http://c", "C")):
            pl.apply(pl.peers[url], {"router": rid, "replicas": {}, "clients": {}}, now=10.0)
        pl.recompute(now=10.1)
        views[me] = pl
    owners = [[me for me, pl in views.items() if r in pl.owned(reps)] for r in reps]
    assert all(len(o) == 1 for o in owners)  # every replica has exactly one owner, the same in every router's view
    assert {o[0] for o in owners} == {"A", "B", "C"}  # and each router owns some
    a = views["A"]
    a.apply(a.peers["http://b"], {"router": "B", "replicas": {}, "clients": {}}, now=12.0)
    a.recompute(now=12.1)  # C is stale now: A and B split C's replicas, A keeps (nearly all) its own
    own = [r for r, o in zip(reps, owners) if o == ["A"]]
    assert sum(r in a.owned(reps) for r in own) >= len(own) - 2
    assert any(r in a.owned(reps) for r, o in zip(reps, owners) if o == ["C"])
    assert len(a.owned(reps)) == len(reps) // 2


@pytest.mark.parametrize("n", [16, 17, 64])
def test_every_router_owns_an_equal_part_where_plain_rendezvous_would_not(n):
    uneven = 0
    for seed in range(40):
        reps = [f"http://127.0.0.1:{20000 + 97 * seed + i}" for i in range(n)]
        routers = sorted(f"http://10.0.{seed}.{j}:8080" for j in range(3))
        owners = balanced_owners(reps, routers)
        assert set(owners) == set(reps)
        sizes = sorted(list(owners.values()).count(r) for r in routers)
        assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == n
        assert balanced_owners(list(reversed(reps)), list(reversed(routers))) == owners  # the same from any order
        plain = [max(routers, key=lambda r: rendezvous_weight(x.encode(), r)) for x in reps]
        uneven += max(plain.count(r) for r in routers) - min(plain.count(r) for r in routers) > 1
        # most replicas keep their plain rendezvous owner: few move when a router comes or goes
        assert sum(owners[x] == p for x, p in zip(reps, plain)) >= n // 2
    assert uneven > 20  # the control: plain rendezvous is usually off by more than one


@pytest.mark.parametrize("report", [
    {"router": 1, "replicas": {}, "clients": {}},
    {"router": "A", "replicas": {"r0": [1, 2]}, "clients": {}},
    {"router": "A", "replicas": {"r0": [-1, 0, 0]}, "clients": {}},
    {"router": "A", "replicas": {}, "clients": {"d": "x"}},
    {"router": "A", "replicas": []},
])
def test_a_malformed_peer_report_is_rejected(report):
    pl = PeerLoad(["http://a"])
    with pytest.raises(ValueError):
        pl.apply(pl.peers["http://a"], report, now=1.0)
    assert pl.peers["http://a"].seen == 0.0


def test_local_report_names_clients_by_digest_only():
    pl = PeerLoad([])
    rep = Replica(ReplicaSpec("http://r0"), in_flight=2, queued_tokens=30, sent=1.23456)
    out = pl.local_report([rep], {"key:secret-api-key": 2, "gone": 0})
    assert out["replicas"] == {"http://r0": [2, 30, 1.235]}
    assert out["clients"] == {client_digest("key:secret-api-key"): 2}
    assert "secret-api-key" not in str(out)


def test_limiter_counts_peers_open_requests():
    remote = {"c": 2}
    lim = ConcurrencyLimiter(3, remote=lambda c: remote.get(c, 0))
    assert lim.try_acquire("c") and not lim.try_acquire("c")  # 1 here + 2 elsewhere = 3
    assert lim.try_acquire("other") and lim.try_acquire("other")
    remote["c"] = 0
    assert lim.try_acquire("c") and lim.try_acquire("c") and not lim.try_acquire("c")


def test_parse_peers():
    assert parse_peers("http://a:1, http://b:2/,") == ["http://a:1", "http://b:2"]
    assert parse_peers(None) == []
    with pytest.raises(ValueError):
        parse_peers("a:1")


async def test_a_peer_name_stands_for_every_address_it_resolves_to():
    """A headless Service of the routers is one name with an address per router pod."""
    load = PeerLoad(["http://localhost:18080", "http://10.1.2.3:8080", "http://no-such-router.invalid:8080"])
    await load.resolve()
    assert "http://127.0.0.1:18080" in load.peers and "http://localhost:18080" not in load.peers
    assert "http://10.1.2.3:8080" in load.peers  # an address is polled as given
    assert "http://no-such-router.invalid:8080" in load.peers  # a failed lookup keeps what it had (here: the name)
    load.peers["http://127.0.0.1:18080"].seen = 1.0
    await load.resolve()  # looked up again: a known peer keeps its state
    assert load.peers["http://127.0.0.1:18080"].seen == 1.0


async def test_peer_load_is_an_admin_route_and_peers_send_the_admin_key(tiny_model_dir):
    async with TwoRouters(tiny_model_dir, admin_key="adm", api_keys={"client-key": None}) as t:
        for app in t.apps:  # the routers found each other: their polls carry the admin key
            await until(lambda: live_peers(app.state.peers) == 1, "the other router answering an authorized poll")
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer client-key"}):
            r = await t.clients[0].get("/v1/router/peer-load", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await t.clients[0].get("/v1/router/peer-load", headers={"authorization": "Bearer adm"})
        assert r.status_code == 200 and set(r.json()["replicas"]) == {s.url for s in t.served}


async def test_without_an_admin_key_peer_load_answers_routers_on_the_same_host(tiny_model_dir):
    async with TwoRouters(tiny_model_dir, api_keys={"client-key": None}) as t:
        for app in t.apps:
            await until(lambda: live_peers(app.state.peers) == 1, "the other router answering")
        assert (await t.clients[0].get("/v1/router/peer-load")).status_code == 200
        drain = await t.clients[0].post(f"/v1/router/replicas/{t.served[0].url}/drain")
        assert drain.status_code == 403  # the other admin routes stay closed to key-checking routers


def test_with_partition_tokens_a_cold_request_prefers_this_routers_own_replicas(tiny_model_dir):
    urls = [f"http://10.0.0.{i}:8000" for i in range(6)]
    router = static_router(tiny_model_dir, urls)
    fleet = router.fleet
    for me in ("A", "C", "D", "E", "F"):  # a router that does not own the replica plain ties go to (the first)
        pl = PeerLoad(["http://b"], router_id=me, jitter=0.0, partition_tokens=10_000)
        pl.apply(pl.peers["http://b"], {"router": "B", "replicas": {}, "clients": {}}, now=10.0)
        pl.recompute(now=10.1)
        if urls[0] not in pl.owned(urls):
            break
    router.peers = pl
    mine = [u for u in urls if u in pl.owned(urls)]
    assert mine and urls[0] not in mine
    req = {"model": "tiny", "prompt": "a new question about caches " * 20}
    _, _, hashes = router.decide("completions", req, fleet.routable())
    for u in (urls[0], mine[0]):  # the same first block on a replica of each kind: equal scores but the partition
        fleet.index.add_blocks(u, hashes[:1])
    assert router.decide("completions", req, fleet.routable())[0].order[0] == mine[0]
    for rep in fleet.routable():  # everyone has a recent share, the owned one a little more than the mean
        rep.sent = 1.5 if rep.id == mine[0] else 1.0
    assert pl.preferred({u: (0, 0, fleet.registry.get(u).sent) for u in urls}) == set(mine) - {mine[0]}
    # under the share cap still, but no longer preferred: another preferred one, or the tie by the lower share
    assert router.decide("completions", req, fleet.routable())[0].order[0] in (set(mine[1:]) or {urls[0]})
    fleet.registry.get(mine[0]).sent = 1.0
    assert router.decide("completions", req, fleet.routable())[0].order[0] == mine[0]
    pl.partition_tokens = 0
    assert router.decide("completions", req, fleet.routable())[0].order[0] == urls[0]  # the tie goes by name
