"""Leader election on a Lease (passes/leader_election.py, planning/lease.py) against kmock with the API server's
optimistic concurrency: acquire, renew, a standby takes over only after the Lease lapsed on its own clock, a
released Lease is taken at once, never two leaders; the loop runs the reconciler only while leading."""

from __future__ import annotations

import asyncio
import datetime
import random

import kopf
import pytest

from operator_fixtures.kmock_lease import FakeLeaseEmulator
from warmfleet.kube import Kube
from warmfleet.operator.passes.leader_election import LEASE_RESOURCES, LeaderElector, run_elected
from warmfleet.operator.planning import lease as rules

pytestmark = pytest.mark.kmock(cls=FakeLeaseEmulator)
NS, NAME = "warmfleet-system", "warmfleet-operator"
LEASE_PATH = ("coordination.k8s.io", "v1", "leases")


class FakeClock:
    """A monotonic clock the test moves by hand (each candidate may have its own: clocks of different nodes)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wall() -> datetime.datetime:
    return datetime.datetime(2026, 12, 5, 7, 0, tzinfo=datetime.timezone.utc)


@pytest.fixture
async def candidates(kmock):
    """A factory of electors, each with its own client and clock; all clients closed at the end."""
    made: list[LeaderElector] = []

    def make(identity: str, clock: FakeClock | None = None) -> LeaderElector:
        kube = Kube.from_connection(kopf.ConnectionInfo(server=str(kmock.url)), LEASE_RESOURCES, field_manager="test")
        e = LeaderElector(kube, NAME, NS, identity, clock=clock or FakeClock(), wall=wall)
        made.append(e)
        return e

    yield make
    for e in made:
        await e.kube.close()


def lease(kmock) -> dict:
    return dict(kmock.objects[LEASE_PATH, NS, NAME].raw)


async def test_the_first_candidate_creates_the_lease_and_renews_it(kmock, candidates):
    a = candidates("op-a")
    assert await a.try_acquire_or_renew() and a.is_leader()
    first = lease(kmock)
    assert first["spec"]["holderIdentity"] == "op-a" and first["spec"]["leaseTransitions"] == 0
    assert first["spec"]["leaseDurationSeconds"] == rules.LEASE_DURATION_S
    a.clock.now += rules.RETRY_PERIOD_S
    assert await a.try_acquire_or_renew() and a.is_leader()
    renewed = lease(kmock)
    assert renewed["spec"]["holderIdentity"] == "op-a"
    assert int(renewed["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    assert kmock.holders == ["op-a", "op-a"]


async def test_a_leader_that_cannot_renew_stops_leading_after_the_renew_deadline(candidates):
    a = candidates("op-a")
    assert await a.try_acquire_or_renew()
    a.clock.now += rules.RENEW_DEADLINE_S - 0.5
    assert a.is_leader()
    a.clock.now += 1
    assert not a.is_leader()


async def test_a_standby_waits_while_the_leader_renews_and_takes_over_after_the_lease_lapsed(kmock, candidates):
    a, b = candidates("op-a"), candidates("op-b")
    assert await a.try_acquire_or_renew()
    for _ in range(10):  # 20 s of renewals: the standby sees a new record each time and never takes over
        assert not await b.try_acquire_or_renew() and not b.is_leader()
        a.clock.now += rules.RETRY_PERIOD_S
        b.clock.now += rules.RETRY_PERIOD_S
        assert await a.try_acquire_or_renew()
    # the leader dies: the same record for less than the Lease's duration is not enough
    assert not await b.try_acquire_or_renew()
    b.clock.now += rules.LEASE_DURATION_S - 1
    assert not await b.try_acquire_or_renew()
    b.clock.now += 1
    assert await b.try_acquire_or_renew() and b.is_leader()
    spec = lease(kmock)["spec"]
    assert spec["holderIdentity"] == "op-b" and spec["leaseTransitions"] == 1
    # the old leader, back from a pause, finds another holder and does not lead
    assert not await a.try_acquire_or_renew() and not a.is_leader()


async def test_expiry_is_read_on_the_standbys_own_clock_not_from_the_holders_timestamps(kmock, candidates):
    """A standby whose clock is hours ahead of the leader's still waits a whole Lease duration of its own."""
    a, b = candidates("op-a"), candidates("op-b", FakeClock(now=1e6))
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    b.clock.now += rules.LEASE_DURATION_S / 2
    assert not await b.try_acquire_or_renew()
    assert lease(kmock)["spec"]["holderIdentity"] == "op-a"


async def test_a_released_lease_is_taken_at_the_next_look(kmock, candidates):
    a, b = candidates("op-a"), candidates("op-b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert not a.is_leader() and lease(kmock)["spec"]["holderIdentity"] == ""
    assert await b.try_acquire_or_renew()  # no waiting for the Lease's duration
    assert lease(kmock)["spec"]["holderIdentity"] == "op-b"


async def test_of_two_standbys_racing_for_a_lapsed_lease_exactly_one_wins(kmock, candidates):
    a, b, c = candidates("op-a"), candidates("op-b"), candidates("op-c")
    assert await a.try_acquire_or_renew()
    for e in (b, c):
        assert not await e.try_acquire_or_renew()
        e.clock.now += rules.LEASE_DURATION_S
    won = await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())
    assert sorted(won) == [False, True]
    assert kmock.refused >= 1 or kmock.holders[-1] in ("op-b", "op-c")
    assert lease(kmock)["spec"]["holderIdentity"] == ("op-b" if won[0] else "op-c")


@pytest.mark.parametrize("seed", range(3))
async def test_never_two_leaders_under_any_interleaving_of_looks_pauses_and_deaths(kmock, candidates, seed):
    """Three candidates on one clock; at each step some look (concurrently), some are paused, time moves on by a
    random amount; at no step do two candidates believe they lead."""
    rnd = random.Random(seed)
    clock = FakeClock()
    electors = [candidates(f"op-{i}", clock) for i in range(3)]
    leaders_seen, paused_until = set(), [0] * 3
    for step in range(100):
        for i in range(3):  # now and then a candidate stops looking for a while (a pause, a dead process)
            if paused_until[i] <= step and rnd.random() < 0.1:
                paused_until[i] = step + rnd.randint(2, 12)
        looking = [e for i, e in enumerate(electors) if paused_until[i] <= step and rnd.random() < 0.8]
        await asyncio.gather(*(e.try_acquire_or_renew() for e in looking))
        leading = [e.identity for e in electors if e.is_leader()]
        assert len(leading) <= 1, leading
        leaders_seen.update(leading)
        clock.now += rnd.choice((0.5, 1, 2, 2, 3, 6, 11))
    assert len(leaders_seen) >= 2  # leadership did move: the check above was exercised


async def test_the_reconciler_runs_only_while_leading_and_the_lease_is_released_on_a_clean_stop(kmock, candidates):
    a = candidates("op-a")
    a.retry_s = 0.01
    started, roles = asyncio.Event(), []

    async def reconciler(flag: asyncio.Event) -> None:
        assert a.is_leader()
        started.set()
        await flag.wait()

    stop = asyncio.Event()
    run = asyncio.ensure_future(run_elected(a, reconciler, stop, on_change=roles.append))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    assert await asyncio.wait_for(run, 10) == 0
    assert roles == [True, False]
    assert lease(kmock)["spec"]["holderIdentity"] == ""


async def test_a_leader_whose_lease_was_taken_stops_its_reconciler_and_exits_1(kmock, candidates):
    a, thief = candidates("op-a"), candidates("op-b")
    a.retry_s = 0.01
    started, stopped = asyncio.Event(), asyncio.Event()

    async def reconciler(flag: asyncio.Event) -> None:
        started.set()
        await flag.wait()
        stopped.set()

    a.clock.now = 0  # frozen: the Lease is renewed on time, until another holder wrote it
    run = asyncio.ensure_future(run_elected(a, reconciler, asyncio.Event()))
    await asyncio.wait_for(started.wait(), 10)
    live = lease(kmock)
    await thief.kube.replace({**live, "spec": {**live["spec"], "holderIdentity": "op-b"}})
    assert await asyncio.wait_for(run, 10) == 1
    assert stopped.is_set() and not a.is_leader()
    assert lease(kmock)["spec"]["holderIdentity"] == "op-b"  # not released by the one that lost it


def test_lease_bodies_carry_the_resource_version_and_count_transitions():
    live = {"metadata": {"name": NAME, "namespace": NS, "resourceVersion": "7"},
            "spec": {"holderIdentity": "op-a", "leaseTransitions": 3, "renewTime": "x", "leaseDurationSeconds": 15}}
    took = rules.lease_body(NAME, NS, "op-b", wall(), live=live, action="take")
    assert took["metadata"]["resourceVersion"] == "7" and took["spec"]["leaseTransitions"] == 4
    assert took["spec"]["holderIdentity"] == "op-b" and took["spec"]["renewTime"] == "2026-12-05T07:00:00.000000Z"
    renewed = rules.lease_body(NAME, NS, "op-a", wall(), live=live, action="renew")
    assert renewed["spec"]["leaseTransitions"] == 3 and renewed["spec"]["holderIdentity"] == "op-a"
    assert rules.released(live, wall())["spec"]["holderIdentity"] == ""
    assert rules.decide(None, "op-a", 0) == "create"



async def test_the_operator_serves_health_and_its_own_metrics():
    """/healthz says the role (503 once unhealthy), /metrics has reconciles by outcome, their duration, pools sized,
    children applied and the leader state (passes/operator_metrics.py)."""
    import httpx

    from warmfleet.operator.passes.operator_metrics import OperatorMetrics, serve
    from warmfleet.operator.passes.reconcile import Outcome

    m = OperatorMetrics()
    m.set_leader(True)
    m.observe("ns", "svc", Outcome(actions={"Deployment/svc-l4": "created", "Service/svc": "unchanged"}, pools=2), 0.2)
    m.observe("ns", "svc", Outcome(actions={"Deployment/svc-l4": "unchanged"}, pools=2), 0.01)
    m.observe("ns", "bad", Outcome(invalid="spec.replicas: must be >= 0"), 0.01)
    m.observe("ns", "svc", None, 0.5, error=RuntimeError("API down"))
    health = {"status": "ok", "role": "leader"}
    runner = await serve(m, "127.0.0.1", 0, lambda: health)
    try:
        host, port = runner.addresses[0][:2]
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
            assert (await http.get("/healthz")).json()["role"] == "leader"
            assert (await http.get("/readyz")).status_code == 200
            text = (await http.get("/metrics")).text
            health = None
            assert (await http.get("/healthz")).status_code == 503
            assert (await http.get("/readyz")).status_code == 503
    finally:
        await runner.cleanup()
    for line in ('warmfleet_operator_reconciles_total{outcome="changed"} 1.0',
                 'warmfleet_operator_reconciles_total{outcome="unchanged"} 1.0',
                 'warmfleet_operator_reconciles_total{outcome="invalid"} 1.0',
                 'warmfleet_operator_reconciles_total{outcome="error"} 1.0',
                 "warmfleet_operator_reconcile_duration_seconds_count 4.0",
                 'warmfleet_operator_pools_sized{inferenceservice="svc",namespace="ns"} 2.0',
                 'warmfleet_operator_children_applied_total{action="created",kind="Deployment"} 1.0',
                 "warmfleet_operator_leader 1.0"):
        assert line in text, line
    assert 'kind="Service"' not in text  # unchanged children are not counted
    m.set_leader(False)
    m.forget("ns", "svc")
    text = m.exposition().decode()
    assert "warmfleet_operator_leader 0.0" in text and 'inferenceservice="svc"' not in text
