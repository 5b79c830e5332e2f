"""Leader election's arithmetic on a coordination.k8s.io/v1 Lease: who holds it, when it lapses, the next body; pure (no kopf, no HTTP, no kubernetes client).

The rules are client-go's (k8s.io/client-go/tools/leaderelection):

    holder A renews every RETRY_PERIOD_S ──────────┐ renewTime moves
    standby B sees the same record for LEASE_DURATION_S of its own clock → takes over (a PUT with
    the resourceVersion it read: of two standbys, the API server lets one win, the other gets 409)
    A cannot renew for RENEW_DEADLINE_S (< LEASE_DURATION_S) → A stops reconciling before B may start

Expiry is measured on the observer's monotonic clock from when it first saw the current record, never by
comparing its clock with the holder's `renewTime`, so clock skew between nodes cannot make two leaders.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Literal, Mapping

LEASE_API_VERSION = "coordination.k8s.io/v1"
LEASE_DURATION_S = 15  # a standby waits this long on a record that does not change before taking over
RENEW_DEADLINE_S = 10  # a leader that could not renew for this long stops (before any standby may start)
RETRY_PERIOD_S = 2  # how often the leader renews and a standby looks

Action = Literal["create", "take", "renew", "wait"]


@dataclass(frozen=True)
class Observed:
    """One reading of the Lease: its record and when (the reader's monotonic seconds) that record was first seen."""

    holder: str  # spec.holderIdentity; "" when released
    record: tuple[Any, ...]  # what changes on every write: (resourceVersion, holder, renewTime, transitions, duration)
    duration_s: float  # spec.leaseDurationSeconds
    transitions: int  # spec.leaseTransitions
    first_seen_s: float  # monotonic seconds when this very record was first read


def observe(lease: Mapping[str, Any] | None, previous: Observed | None, now_s: float) -> Observed | None:
    """The Lease read at `now_s`, keeping `previous.first_seen_s` while its record is unchanged."""
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    duration = float(spec.get("leaseDurationSeconds") or LEASE_DURATION_S)
    transitions = int(spec.get("leaseTransitions") or 0)
    version = (lease.get("metadata") or {}).get("resourceVersion")
    record = (version, holder, spec.get("renewTime"), transitions, duration)
    first_seen = previous.first_seen_s if previous is not None and previous.record == record else now_s
    return Observed(holder=holder, record=record, duration_s=duration, transitions=transitions, first_seen_s=first_seen)


def decide(observed: Observed | None, identity: str, now_s: float) -> Action:
    """What `identity` does next: create a missing Lease, renew its own, take a released or lapsed one, or wait."""
    if observed is None:
        return "create"
    if observed.holder == identity:
        return "renew"
    if not observed.holder or now_s - observed.first_seen_s >= observed.duration_s:
        return "take"
    return "wait"


def micro_time(now: datetime.datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(name: str, namespace: str, identity: str, now: datetime.datetime, *, live: Mapping[str, Any] | None,
               action: Action, duration_s: int = LEASE_DURATION_S) -> dict[str, Any]:
    """The Lease to write for `action` (create, take, renew), carrying the live resourceVersion (optimistic lock)."""
    spec = dict((live or {}).get("spec") or {})
    stamp = micro_time(now)
    if action in ("create", "take"):
        changed_hands = action == "take" and (spec.get("holderIdentity") or "") != identity
        spec.update(holderIdentity=identity, acquireTime=stamp,
                    leaseTransitions=int(spec.get("leaseTransitions") or 0) + (1 if changed_hands else 0))
    spec.update(renewTime=stamp, leaseDurationSeconds=duration_s)
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    version = ((live or {}).get("metadata") or {}).get("resourceVersion")
    if version:
        meta["resourceVersion"] = version
    return {"apiVersion": LEASE_API_VERSION, "kind": "Lease", "metadata": meta, "spec": spec}


def released(live: Mapping[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """The Lease given up on a clean shutdown: no holder, so a standby takes it at its next look (not after expiry)."""
    meta = live.get("metadata") or {}
    spec = {**(live.get("spec") or {}), "holderIdentity": "", "renewTime": micro_time(now), "leaseDurationSeconds": 1}
    return {"apiVersion": LEASE_API_VERSION, "kind": "Lease",
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                         "resourceVersion": meta.get("resourceVersion")}, "spec": spec}
