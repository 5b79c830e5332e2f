"""The fleet's health rule: a round in which every replica times out is a stall, not N failures; refusals still count."""

from __future__ import annotations

import asyncio

import httpx
from aiohttp import web

from warmfleet.server.router.core.fleet import Fleet
from warmfleet.server.router.core.metrics import RouterMetrics
from warmfleet.server.router.core.registry import ReplicaSpec

BLOCK = b"\x01" * 32


class FakeReplica:
    """A replica's /ready on loopback: answers 200 at once, or stalls (answers nothing) while `stalled` is set."""

    def __init__(self) -> None:
        self.stalled = False
        self.checks = 0
        self._release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def ready(self, request: web.Request) -> web.Response:
        self.checks += 1
        if self.stalled:
            await self._release.wait()  # never within the check's timeout
        return web.Response(text="ok")

    async def start(self) -> "FakeReplica":
        app = web.Application()
        app.router.add_get("/ready", self.ready)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        self._release.set()
        await self.runner.cleanup()


async def fleet_of(n: int, **kw) -> tuple[Fleet, list[FakeReplica], httpx.AsyncClient]:
    reps = [await FakeReplica().start() for _ in range(n)]
    http = httpx.AsyncClient()
    fleet = Fleet(http, RouterMetrics(), health_timeout_s=0.2, health_failures=1, **kw)
    await fleet.set_members([ReplicaSpec(r.url) for r in reps])  # no events: nothing to subscribe to
    for r in reps:
        fleet.index.add_blocks(r.url, [BLOCK])
    return fleet, reps, http


async def close(fleet: Fleet, reps: list[FakeReplica], http: httpx.AsyncClient) -> None:
    await fleet.stop()
    for r in reps:
        await r.stop()
    await http.aclose()


def healthy(fleet: Fleet) -> list[str]:
    return sorted(r.id for r in fleet.registry.healthy())


def holders(fleet: Fleet) -> list[str]:
    matches = fleet.index.match([BLOCK], list(fleet.registry.replicas))
    return sorted(rid for rid, m in matches.items() if m.blocks)


async def test_every_replica_timing_out_in_one_round_keeps_them_routable():
    fleet, reps, http = await fleet_of(3)
    try:
        everyone = sorted(r.url for r in reps)
        assert healthy(fleet) == everyone and holders(fleet) == everyone
        for r in reps:
            r.stalled = True
        await fleet.check_health()  # one failure takes a replica out (health_failures=1), yet none leaves
        assert all(r.checks >= 2 for r in reps)  # the round did reach every replica
        assert healthy(fleet) == everyone
        assert holders(fleet) == everyone  # index not purged
        assert fleet.health_stall_rounds == 1
        assert all(r.failed_checks == 0 for r in fleet.registry.replicas.values())
        for r in reps:
            r.stalled = False
            r._release.set()
        await fleet.check_health()
        assert healthy(fleet) == everyone and fleet.health_stall_rounds == 1
    finally:
        await close(fleet, reps, http)


async def test_one_replica_timing_out_while_others_answer_still_counts():
    fleet, reps, http = await fleet_of(3)
    try:
        reps[0].stalled = True
        await fleet.check_health()
        assert healthy(fleet) == sorted(r.url for r in reps[1:])
        assert holders(fleet) == sorted(r.url for r in reps[1:])  # its index entries were purged
        assert fleet.health_stall_rounds == 0
    finally:
        await close(fleet, reps, http)


async def test_a_refused_replica_leaves_at_once_even_while_the_rest_time_out():
    fleet, reps, http = await fleet_of(3)
    try:
        await reps[0].stop()  # nothing listens: connection refused
        for r in reps[1:]:
            r.stalled = True
        await fleet.check_health()
        # not every check timed out (one was refused), so the round counts as usual for all of them
        assert healthy(fleet) == [] and fleet.health_stall_rounds == 0
    finally:
        await close(fleet, reps[1:], http)


async def test_all_timeouts_count_again_after_the_grace():
    fleet, reps, http = await fleet_of(2, stall_grace_s=0.0)  # no grace: a long partition, not a stall
    try:
        for r in reps:
            r.stalled = True
        await fleet.check_health()
        assert healthy(fleet) == [] and holders(fleet) == []
    finally:
        await close(fleet, reps, http)


async def test_a_single_replica_timing_out_is_no_evidence_of_a_stall():
    fleet, reps, http = await fleet_of(1)
    try:
        reps[0].stalled = True
        await fleet.check_health()
        assert healthy(fleet) == [] and fleet.health_stall_rounds == 0
    finally:
        await close(fleet, reps, http)


async def test_a_requests_connect_timeout_counts_as_one_failed_check_not_death():
    fleet, reps, http = await fleet_of(2)
    fleet.health_failures = 2
    try:
        for r in reps:
            fleet.registry.mark_up(r.url)
        a = reps[0].url
        fleet.report_timeout(a, "ConnectTimeout")
        assert fleet.registry.get(a).healthy  # one stall: still routed
        assert fleet.index.replicas[a].gpu  # and its index kept
        fleet.report_timeout(a, "ConnectTimeout")
        assert not fleet.registry.get(a).healthy  # health_failures in a row: out
        b = reps[1].url
        fleet.report_failure(b, "ClientConnectorError")  # refused: out at once
        assert not fleet.registry.get(b).healthy
    finally:
        await close(fleet, reps, http)


async def test_a_replica_that_just_answered_skips_the_probe_but_not_for_long():
    fleet, reps, http = await fleet_of(2, health_interval_s=10.0, health_passive_max_s=5.0)
    try:
        await fleet.check_health()  # joining probed both, and so does a round before any answer
        assert [r.checks for r in reps] == [2, 2] and healthy(fleet) == sorted(r.url for r in reps)
        fleet.record_served(reps[0].url, [])  # a routed request answered 200
        await fleet.check_health()
        assert [r.checks for r in reps] == [2, 3]  # the one that answered was not probed
        assert fleet.metrics.health_probes_skipped._value.get() == 1
        fleet.registry.get(reps[0].url).probed_at -= 6.0  # its last probe is older than health_passive_max_s: it is
        # probed even though it keeps answering (aged by hand: no sleep a busy machine could stretch)
        fleet.record_served(reps[0].url, [])
        await fleet.check_health()
        assert [r.checks for r in reps] == [3, 4]
    finally:
        await close(fleet, reps, http)


async def test_passive_health_never_keeps_a_replica_that_is_down():
    fleet, reps, http = await fleet_of(1, health_interval_s=10.0)
    try:
        await fleet.check_health()
        fleet.report_failure(reps[0].url, "ClientConnectorError")  # a request found it gone
        fleet.record_served(reps[0].url, [])  # a late 200 from before does not vouch for it
        reps[0].stalled = True
        await fleet.check_health()  # so it is probed (and stays out while it does not answer)
        assert reps[0].checks == 3 and healthy(fleet) == []
    finally:
        await close(fleet, reps, http)


async def test_passive_health_off_probes_every_round():
    fleet, reps, http = await fleet_of(1, health_interval_s=10.0, health_passive_max_s=0.0)
    try:
        await fleet.check_health()
        fleet.record_served(reps[0].url, [])
        await fleet.check_health()
        assert reps[0].checks == 3
    finally:
        await close(fleet, reps, http)


async def test_a_replica_that_becomes_routable_starts_at_the_others_mean_share():
    fleet, reps, http = await fleet_of(3)
    try:
        a, b, c = (r.url for r in reps)
        fleet.report_failure(c, "ClientConnectorError")  # joining the fleet below: not healthy yet
        fleet.registry.get(a).sent, fleet.registry.get(b).sent = 100.0, 140.0
        fleet.registry.mark_up(c)  # joins (or comes back) with no share of its own
        assert fleet.registry.get(c).sent == 120.0
        fleet.drain(c, "admin")
        fleet.registry.get(c).sent = 3.0  # decayed while it took nothing
        fleet.undrain(c)
        assert fleet.registry.get(c).sent == 120.0
    finally:
        await close(fleet, reps, http)


def test_a_joiner_at_zero_share_spills_every_warm_request_and_one_at_the_mean_does_not():
    from warmfleet.server.router.core.policy import LOAD_SPILL, PREFIX_HIT, Candidate, choose

    def decide(joiner_sent: float):  # four replicas of a steady fleet (~512 recent requests), r0 holds the prompt
        cands = [Candidate("r0", gpu_blocks=16, sent=128.0, load=2)]
        cands += [Candidate(f"r{i}", sent=128.0, load=2) for i in (1, 2, 3)] + [Candidate("new", sent=joiner_sent)]
        return choose(cands, block_size=16, num_prompt_tokens=300, cold_key=b"k")

    spilled, kept = decide(0.0), decide(128.0)
    assert spilled.reason == LOAD_SPILL and spilled.order[0] != "r0"
    assert kept.reason == PREFIX_HIT and kept.order[0] == "r0"
