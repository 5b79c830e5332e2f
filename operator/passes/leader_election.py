"""Lease-based leader election (coordination.k8s.io/v1, client-go's rules in planning/lease.py): acquire, renew, release, and the loop that runs the reconciler only while leader; no kopf.

    standby ──(Lease missing, released, or unchanged for its duration)──▶ leader: start(stop_flag)
    leader  ──(renewed every RETRY_PERIOD_S)──▶ leader
    leader  ──(no renewal for RENEW_DEADLINE_S, or a 409: another holder)──▶ stop_flag set, exit code 1
    leader  ──(shutdown: SIGTERM, the reconciler returned)──▶ Lease released (holder ""), exit code 0
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from warmfleet.kube import Kube, KubeError
from warmfleet.operator.planning import lease as rules

log = logging.getLogger("warmfleet.operator.leader")

LEASE_RESOURCES = {"Lease": (rules.LEASE_API_VERSION, "leases")}
STOP_GRACE_S = 3.0  # a lost leader's reconciler must stop in this (< LEASE_DURATION_S - RENEW_DEADLINE_S)


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass
class LeaderElector:
    """One candidate for the Lease `namespace/name` under `identity` (the pod's name)."""

    kube: Kube
    name: str
    namespace: str
    identity: str
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime.datetime] = utcnow
    duration_s: int = rules.LEASE_DURATION_S
    renew_deadline_s: float = rules.RENEW_DEADLINE_S
    retry_s: float = rules.RETRY_PERIOD_S
    observed: rules.Observed | None = field(default=None, init=False)
    renewed_at_s: float | None = field(default=None, init=False)  # monotonic time of our last acquire or renewal

    def is_leader(self) -> bool:
        """Whether we hold the Lease: renewed (or acquired) less than the renew deadline ago."""
        return self.renewed_at_s is not None and self.clock() - self.renewed_at_s < self.renew_deadline_s

    def holder(self) -> str:
        """The holder of the Lease as last read ("" when none or released)."""
        return self.observed.holder if self.observed is not None else ""

    async def try_acquire_or_renew(self) -> bool:
        """One look at the Lease: create it, renew ours, take a released or lapsed one; → whether we lead now."""
        started = self.clock()
        try:
            live = await self.kube.get("Lease", self.namespace, self.name)
        except KubeError as exc:
            log.warning("reading Lease %s/%s failed: %s", self.namespace, self.name, exc)
            return self.is_leader()
        self.observed = rules.observe(live, self.observed, started)
        action = rules.decide(self.observed, self.identity, started)
        if action == "wait":
            self.renewed_at_s = None
            return False
        body = rules.lease_body(self.name, self.namespace, self.identity, self.wall(), live=live, action=action,
                                duration_s=self.duration_s)
        try:
            written = await (self.kube.create(body) if action == "create" else self.kube.replace(body))
        except KubeError as exc:
            if exc.status == 409:  # another candidate wrote first: it holds the Lease now
                self.renewed_at_s = None
                return False
            log.warning("writing Lease %s/%s failed: %s", self.namespace, self.name, exc)
            return self.is_leader()
        if action != "renew":
            log.info("acquired Lease %s/%s as %s (%s)", self.namespace, self.name, self.identity,
                     "created" if action == "create" else f"from {self.holder() or 'nobody'}")
        self.observed = rules.observe(written, self.observed, started)
        self.renewed_at_s = started  # measured from before the request: the API server may have kept it a while
        return True

    async def release(self) -> None:
        """Give the Lease up (holder ""), if we still hold it: a standby takes over at its next look."""
        if not self.is_leader():
            return
        self.renewed_at_s = None
        try:
            live = await self.kube.get("Lease", self.namespace, self.name)
            if live is not None and (live.get("spec") or {}).get("holderIdentity") == self.identity:
                await self.kube.replace(rules.released(live, self.wall()))
                log.info("released Lease %s/%s", self.namespace, self.name)
        except KubeError as exc:  # it lapses on its own after its duration
            log.warning("releasing Lease %s/%s failed: %s", self.namespace, self.name, exc)

    async def look(self) -> bool:
        """try_acquire_or_renew bounded by one retry period (a hung request must not outlive the renew deadline)."""
        try:
            return await asyncio.wait_for(self.try_acquire_or_renew(), timeout=self.retry_s)
        except asyncio.TimeoutError:
            log.warning("Lease %s/%s: no answer in %.0f s", self.namespace, self.name, self.retry_s)
            return self.is_leader()


Leading = Callable[[asyncio.Event], Awaitable[Any]]  # runs the reconciler until the event is set


async def _sleep_unless(stop: asyncio.Event, seconds: float, *also: asyncio.Future[Any]) -> None:
    waiters = [asyncio.ensure_future(stop.wait()), *also]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiters[0].cancel()


async def run_elected(elector: LeaderElector, leading: Leading, stop: asyncio.Event,
                      on_change: Callable[[bool], None] = lambda _: None) -> int:
    """Wait as standby until leader (or `stop`), run `leading` while leader; → 0 after a clean stop, 1 when leadership
    was lost (the process exits and comes back as a standby: a reconciler is never restarted in place)."""
    while not stop.is_set():
        if await elector.look():
            break
        await _sleep_unless(stop, elector.retry_s)
    else:
        return 0
    on_change(True)
    stop_leading = asyncio.Event()
    task = asyncio.ensure_future(leading(stop_leading))
    lost = False
    try:
        while not stop.is_set() and not task.done():
            await _sleep_unless(stop, elector.retry_s, task)
            if stop.is_set() or task.done():
                break
            if not await elector.look() or not elector.is_leader():
                lost = True
                log.error("lost Lease %s/%s (held by %r now): stopping the reconciler", elector.namespace,
                          elector.name, elector.holder())
                break
    finally:
        stop_leading.set()
        on_change(False)
        done, _ = await asyncio.wait([task], timeout=STOP_GRACE_S if lost else None)
        if not lost:
            await elector.release()
    if lost and not done:
        raise LeadershipLost(f"the reconciler did not stop within {STOP_GRACE_S} s of losing the Lease")
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
    return 1 if lost else 0


class LeadershipLost(RuntimeError):
    """The Lease was lost and the reconciler did not stop in time: the caller ends the process at once."""
