"""Drain before termination: a draining replica gets no new requests while its in-flight stream completes,
its hot prefixes go to their new owners, terminating EndpointSlice endpoints drain, admin routes are guarded.

The replicas are bench/simfleet.py's simulated ones (the engine's own scheduler and KV manager, real
HTTP and KV events) behind the real router app in-process.
"""

from __future__ import annotations

import asyncio
from typing import Optional
from urllib.parse import quote

import httpx
import pytest
from kubernetes.client import (
    DiscoveryV1EndpointPort, V1Endpoint, V1EndpointConditions, V1EndpointSlice, V1ObjectMeta,
)

from bench_scripts import load_bench
import waiting
from warmfleet.localprocs import free_port
from router_fakes import synced
from warmfleet.server.hashing import model_fingerprint
from warmfleet.server.router.core.booking import Booking
from warmfleet.server.router.core.discovery import replicas_from_slices
from warmfleet.server.router.core.fleet import Fleet
from warmfleet.server.router.core.metrics import RouterMetrics
from warmfleet.server.router.core.policy import Decision
from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
from warmfleet.server.router.core.registry import ReplicaSpec
from warmfleet.server.router.core.runtime import RouterRuntime
from warmfleet.server.router.core.settings import RouterSettings
from warmfleet.server.router.core.tenants import Tenants
from warmfleet.server.router.http.app import build_app

BLOCK = 16


sim = load_bench("simfleet.py")


def ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 1014) for _ in range(n)]


async def until(cond, what: str) -> None:
    await waiting.until(cond, what, timeout_s=15.0, interval_s=0.02)


class RouterOnSim:
    """A simulated fleet of `n` replicas (each step 20 ms) and the real router app in-process on loopback."""

    def __init__(self, model_dir, n: int = 3, tenants: Optional[Tenants] = None, **settings):
        self.model_dir, self.n, self.settings = str(model_dir), n, settings
        self.tenants = tenants or Tenants({})

    async def __aenter__(self) -> "RouterOnSim":
        import uvicorn

        self.sim = sim.SimFleet(self.model_dir, self.n, block_size=BLOCK, gpu_blocks=256,
                                tm=sim.TimeModel(step_s=0.02))
        await self.sim.start()
        self.url_of = {r.rid: u for r, u in zip(self.sim.replicas, self.sim.urls)}
        specs = [ReplicaSpec(u, r.events_endpoint) for u, r in zip(self.sim.urls, self.sim.replicas)]
        runtime = RouterRuntime(hash_cfg=HashConfig(BLOCK, model_fingerprint(self.model_dir)), replicas=specs,
                                renderer=PromptRenderer(self.model_dir), tenants=self.tenants,
                                settings=RouterSettings(health_interval_s=0.1, **self.settings))
        self.app = build_app(runtime)
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.task = asyncio.create_task(self.server.serve())
        await until(lambda: self.server.started, "router start")
        self.fleet: Fleet = self.app.state.fleet
        await until(lambda: synced(self.fleet.index, self.sim.urls), "initial resync")
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        await self.task
        await self.sim.stop()

    async def complete(self, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
        r = await self.client.post("/v1/completions", json={"model": "bench", "prompt": prompt, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        return r

    async def view(self) -> dict:
        return {x["id"]: x for x in (await self.client.get("/v1/router/replicas")).json()["replicas"]}

    def metric(self, name: str, **labels) -> float:
        v = self.app.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v


async def test_a_draining_replica_gets_no_new_requests_while_its_stream_completes(tiny_model_dir):
    async with RouterOnSim(tiny_model_dir) as f:
        for k in range(12):  # hot prefixes spread over the fleet by rendezvous
            await f.complete(ids(100 + k, 64) + ids(900 + k, 5))
        # a long stream is running on one replica
        body = {"model": "bench", "prompt": ids(7, 40), "max_tokens": 60, "stream": True,
                "stream_options": {"include_usage": True}}
        async with f.client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            victim = f.url_of[stream.headers["x-warmfleet-replica"]]
            held = {e.key for e in f.fleet.warmer.hot.entries.values()
                    if e.key in f.fleet.index.state(victim).gpu}
            r = await f.client.post(f"/v1/router/replicas/{quote(victim, safe='')}/drain")
            assert r.status_code == 200 and r.json()["draining"] and r.json()["state"] == "draining", r.text
            assert (await f.view())[victim]["state"] == "draining"
            assert f.metric("warmfleet_router_replica_draining", replica=victim) == 1
            assert f.metric("warmfleet_router_drains_total", trigger="admin") == 1
            for k in range(12):  # new requests, its own hot prefixes included, go elsewhere
                r = await f.complete(ids(100 + k, 64) + ids(700 + k, 5))
                assert f.url_of[r.headers["x-warmfleet-replica"]] != victim
            text = (await stream.aread()).decode()
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text and '"finish_reason":"length"' in text
        await until(lambda: f.fleet.registry.get(victim).in_flight == 0, "the stream to leave the books")
        view = await f.view()
        assert view[victim]["state"] == "drained" and view[victim]["drain_trigger"] == "admin"
        # its hot prefixes were handed to the replicas that own them now
        await until(lambda: f.fleet.registry.get(victim).last_handoff is not None, "the hand-off")
        handoff = f.fleet.registry.get(victim).last_handoff
        assert held and handoff["prefixes"] >= len(held) and victim not in handoff["to"]
        await until(lambda: all(any(k in f.fleet.index.state(u).gpu for u in f.sim.urls if u != victim)
                                for k in held), "the new owners' KV events")
        assert f.metric("warmfleet_router_handoff_prefixes_total") == handoff["prefixes"]
        # a static replica back from its update: the drain ends and it is routed again
        r = await f.client.delete(f"/v1/router/replicas/{quote(victim, safe='')}/drain")
        assert r.status_code == 200 and not r.json()["draining"]
        await until(lambda: f.fleet.registry.get(victim) in f.fleet.routable(), "routable again")
        assert f.metric("warmfleet_router_replica_draining", replica=victim) == 0


async def test_admin_routes_answer_unknown_ids_and_need_the_admin_key_when_keys_are_checked(tiny_model_dir):
    async with RouterOnSim(tiny_model_dir, n=2, tenants=Tenants({"tenant-key": None}), admin_key="adm") as f:
        target = quote(f.sim.urls[0], safe="")
        assert (await f.client.post(f"/v1/router/replicas/{target}/drain")).status_code == 401
        r = await f.client.post(f"/v1/router/replicas/{target}/drain", headers={"authorization": "Bearer tenant-key"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert not f.fleet.registry.get(f.sim.urls[0]).draining
        r = await f.client.post("/v1/router/replicas/http%3A%2F%2Fnowhere%3A1/drain", headers={"authorization": "Bearer adm"})
        assert r.status_code == 404 and f.sim.urls[0] in r.json()["error"]["message"]
        r = await f.client.post(f"/v1/router/replicas/{target}/drain", headers={"authorization": "Bearer adm"})
        assert r.status_code == 200 and f.fleet.registry.get(f.sim.urls[0]).draining
        # the router keeps serving through the other replica
        r = await f.client.post("/v1/completions", json={"model": "bench", "prompt": ids(1, 40), "max_tokens": 1},
                                headers={"authorization": "Bearer tenant-key"})
        assert r.status_code == 200 and f.url_of[r.headers["x-warmfleet-replica"]] == f.sim.urls[1]


def test_admin_routes_are_refused_when_tenant_keys_are_checked_but_no_admin_key_is_set():
    from fastapi.testclient import TestClient

    app = build_app(RouterRuntime(hash_cfg=HashConfig(BLOCK, "fp"), tenants=Tenants({"k": None})))
    with TestClient(app) as c:
        r = c.post("/v1/router/replicas/http%3A%2F%2Fa%3A1/drain", headers={"authorization": "Bearer k"})
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


# --- discovery: terminating endpoints drain ----------------------------------------------------------
def slice_of(*endpoints: tuple[str, V1EndpointConditions]) -> V1EndpointSlice:
    return V1EndpointSlice(
        address_type="IPv4", metadata=V1ObjectMeta(name="s", labels={"kubernetes.io/service-name": "llm"}),
        ports=[DiscoveryV1EndpointPort(name="http", port=8000), DiscoveryV1EndpointPort(name="kv-events", port=5557)],
        endpoints=[V1Endpoint(addresses=[ip], conditions=c) for ip, c in endpoints])


def test_terminating_endpoints_are_members_marked_draining():
    s = slice_of(("10.0.0.1", V1EndpointConditions(ready=True)),
                 ("10.0.0.2", V1EndpointConditions(ready=False, serving=True, terminating=True)),
                 ("10.0.0.3", V1EndpointConditions(ready=False, serving=False, terminating=True)),
                 ("10.0.0.4", V1EndpointConditions(ready=False, serving=False, terminating=False)))  # starting
    got = {r.url: r.draining for r in replicas_from_slices([s], "http", "kv-events", None)}
    assert got == {"http://10.0.0.1:8000": False, "http://10.0.0.2:8000": True, "http://10.0.0.3:8000": True}


async def test_a_member_turning_terminating_drains_in_place_and_keeps_its_index():
    ports = [free_port() for _ in range(2)]  # nothing listens: health checks fail, membership is what matters
    async with httpx.AsyncClient() as http:
        fleet = Fleet(http, RouterMetrics())
        specs = [ReplicaSpec(f"http://127.0.0.1:{p}") for p in ports]
        await fleet.set_members(specs)
        a = fleet.registry.get(specs[0].id)
        fleet.index.add_blocks(a.id, [b"block"])
        await fleet.set_members([ReplicaSpec(specs[0].url, draining=True), specs[1]])
        same = fleet.registry.get(specs[0].id)
        assert same is a and a.draining and a.drain_trigger == "terminating"
        assert b"block" in fleet.index.state(a.id).gpu  # the same member: its index stays for the hand-off
        a.healthy = fleet.registry.get(specs[1].id).healthy = True
        assert fleet.routable() == [fleet.registry.get(specs[1].id)]
        await fleet.set_members([specs[1]])  # the pod is gone
        assert fleet.registry.get(specs[0].id) is None
        await fleet.stop()


async def test_only_draining_replicas_left_still_serve():
    """As Kubernetes routes to terminating-but-serving endpoints when no other is ready."""
    async with httpx.AsyncClient() as http:
        fleet = Fleet(http, RouterMetrics())
        spec = ReplicaSpec(f"http://127.0.0.1:{free_port()}")
        await fleet.set_members([spec])
        rep = fleet.registry.get(spec.id)
        rep.healthy = True
        assert fleet.drain(spec.id, "admin") and fleet.routable() == [rep]
        await fleet.stop()


def test_the_server_pods_grace_period_covers_the_engines_own_sigterm_drain():
    """terminationGracePeriodSeconds = preStop + ENGINE_SIGTERM_DRAIN_S + margin: that constant must cover
    what `warmfleet serve` gives in-flight requests after SIGTERM by default, or the kubelet kills it mid-drain."""
    import argparse

    from warmfleet.operator.planning import server_pool
    from warmfleet.server.api.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    default_drain_s = getattr(p.parse_args(["--model", "m"]), "serve.drain_timeout_s")
    assert server_pool.ENGINE_SIGTERM_DRAIN_S >= default_drain_s > 0


def test_replays_are_queued_work_for_routing_but_not_in_the_queued_tokens_metric():
    """The autoscaler reads the metric: a scale-in's own hand-off replays must not read as client load."""
    from warmfleet.server.router.core.registry import Replica
    from warmfleet.server.router.core.router import Router

    class FakeFleet:
        node_tiers = None  # follows no node tier

        def __init__(self, rep):
            self.registry = type("R", (), {"replicas": {rep.id: rep}})()

    metrics = RouterMetrics()
    rep = Replica(ReplicaSpec("http://10.0.0.1:8000"))
    rep.queued_tokens = rep.replay_tokens = 300  # a hand-off replay under way on it
    metrics.follow_replica(rep)  # as Fleet.set_members does when the replica joins
    router = Router(FakeFleet(rep), None, HashConfig(16, "fp"), metrics)
    booking = Booking(router, Decision([rep.id], "cold_hash", 0, num_prompt_tokens=40))
    booking.enter(rep)
    gauge = metrics.registry.get_sample_value("warmfleet_router_replica_queued_tokens", {"replica": rep.id})
    assert rep.queued_tokens == 340 and gauge == 40
    booking.prefilled()
    assert metrics.registry.get_sample_value("warmfleet_router_replica_queued_tokens", {"replica": rep.id}) == 0
