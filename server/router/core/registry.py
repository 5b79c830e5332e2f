"""Replica registry: the fleet's members, their health, drain state and the load this router put on them; no I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional
from urllib.parse import urlsplit


@dataclass(frozen=True)
class ReplicaSpec:
    """Where to reach one replica."""

    url: str  # base URL of the HTTP API, e.g. http://10.0.0.7:8000 (no trailing slash)
    events: Optional[str] = None  # ZMQ endpoint of its KV events, e.g. tcp://10.0.0.7:5557; None = no events
    replay: Optional[str] = None  # ZMQ endpoint of its event replay socket (vLLM), e.g. tcp://10.0.0.7:5558
    metrics: Optional[str] = None  # base URL of its Prometheus endpoint when load comes from there (FastDeploy)
    draining: bool = False  # going away (its EndpointSlice endpoint is terminating): no new requests

    @property
    def id(self) -> str:
        """Stable name used in the index, metrics and rendezvous hashing: the base URL."""
        return self.url

    def same_place(self, other: "ReplicaSpec") -> bool:
        """The same endpoints (a change of `draining` alone is not a new member)."""
        return replace(self, draining=False) == replace(other, draining=False)


def parse_replica(text: str, default_events_port: Optional[int] = None,
                  default_replay_port: Optional[int] = None, default_metrics_port: Optional[int] = None) -> ReplicaSpec:
    """Parse `http://host:port[,events=tcp://host:eport][,replay=tcp://host:rport][,metrics=http://host:mport]`.

    Without `events=`, a router-wide `--kv-events-port` gives tcp://<host of the URL>:<port>
    (and `--kv-replay-port` the replay endpoint of a vLLM replica); without either the replica
    is routed by load and cold hashing only.
    """
    url, *opts = [p.strip() for p in text.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--replica needs an http(s)://host:port URL, got {text!r}")
    found: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        schemes = ("http://", "https://") if key == "metrics" else ("tcp://", "ipc://")
        if key not in ("events", "replay", "metrics") or not sep or not value.startswith(schemes):
            raise ValueError("--replica options are events=tcp://host:port, replay=tcp://host:port and "
                             f"metrics=http://host:port, got {opt!r}")
        found[key] = value
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if "events" not in found and default_events_port is not None:
        found["events"] = f"tcp://{host}:{default_events_port}"
    if "replay" not in found and default_replay_port is not None:
        found["replay"] = f"tcp://{host}:{default_replay_port}"
    if "metrics" not in found and default_metrics_port is not None:
        found["metrics"] = f"{parts.scheme}://{host}:{default_metrics_port}"
    return ReplicaSpec(url.rstrip("/"), found.get("events"), found.get("replay"), found.get("metrics"))


@dataclass
class Replica:
    """Mutable state of one fleet member."""

    spec: ReplicaSpec
    healthy: bool = False  # passed the last health check and no request failed to connect since
    kv_tracked: bool = True  # False once the replica proved it serves no snapshot: route without its index
    in_flight: int = 0  # requests this router has open on it
    queued_tokens: int = 0  # uncached prompt tokens of those requests that have not had their first token yet
    replay_tokens: int = 0  # of queued_tokens, those of warm-up/hand-off replays (not client work: not in metrics)
    sent: float = 0.0  # requests this router sent it recently (decayed; policy share cap and tie-break)
    failed_checks: int = 0  # active health checks failed in a row (timeouts, non-200)
    answered_at: float = 0.0  # monotonic time it last answered a routed request 200 (passive health)
    probed_at: float = 0.0  # monotonic time of its last active health check
    warming: bool = False  # joined or restarted: hot prefixes are being replayed into it; not routed meanwhile
    last_warmup: Optional[dict] = None  # figures of its last warm-up (prefixes, tokens, seconds, budgets)
    draining: bool = False  # going away: takes no new requests, the ones in flight finish
    drain_trigger: Optional[str] = None  # "terminating" (EndpointSlice) | "admin" (POST .../drain)
    drain_since: Optional[float] = None  # monotonic time the drain began
    last_handoff: Optional[dict] = None  # figures of the hand-off of its hot prefixes when it began draining
    down_since: Optional[float] = None  # monotonic time it was marked down
    last_error: str = ""
    id: str = field(init=False)  # spec.id, read many times a request (a property cost ~1% of the router's CPU)

    def __post_init__(self) -> None:
        self.id = self.spec.id


class Registry:
    """Members by id; calls `on_down(id)` / `on_up(id)` when health flips (index purge / resync)."""

    def __init__(self, on_down: Callable[[str], None] = lambda r: None,
                 on_up: Callable[[str], None] = lambda r: None) -> None:
        self.replicas: dict[str, Replica] = {}
        self._on_down, self._on_up = on_down, on_up

    def set_members(self, specs: Iterable[ReplicaSpec]) -> tuple[list[ReplicaSpec], list[str]]:
        """Make the membership exactly `specs`; returns (added specs, removed ids).

        A spec that differs from the member's only in `draining` updates the member in place
        (the caller starts or ends its drain): it is the same pod, terminating.
        """
        wanted = {s.id: s for s in specs}
        removed = [rid for rid in self.replicas if rid not in wanted]
        for rid in removed:
            del self.replicas[rid]
        added = []
        for rid, spec in wanted.items():
            cur = self.replicas.get(rid)
            if cur is not None and cur.spec.same_place(spec):
                cur.spec = spec
            else:
                if cur is not None:
                    removed.append(rid)
                self.replicas[rid] = Replica(spec)
                added.append(spec)
        return added, removed

    def get(self, rid: str) -> Optional[Replica]:
        return self.replicas.get(rid)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def serving(self) -> list[Replica]:
        """Healthy and not draining: the members that will own traffic from now on."""
        return [r for r in self.replicas.values() if r.healthy and not r.draining]

    def begin_drain(self, rid: str, trigger: str) -> bool:
        """Mark `rid` draining; True if it was not already (the caller hands its prefixes over)."""
        r = self.replicas.get(rid)
        if r is None or r.draining:
            return False
        r.draining, r.drain_trigger, r.drain_since = True, trigger, time.monotonic()
        return True

    def end_drain(self, rid: str) -> bool:
        """Make `rid` routable again (a static replica back after its update); True if it was draining."""
        r = self.replicas.get(rid)
        if r is None or not r.draining:
            return False
        r.draining, r.drain_trigger, r.drain_since = False, None, None
        return True

    def mark_down(self, rid: str, error: str) -> None:
        r = self.replicas.get(rid)
        if r is None:
            return
        r.last_error = error
        if r.healthy or r.down_since is None:
            r.healthy, r.down_since = False, time.monotonic()
            self._on_down(rid)

    def mark_up(self, rid: str) -> None:
        r = self.replicas.get(rid)
        if r is None or r.healthy:
            return
        r.healthy, r.down_since, r.last_error = True, None, ""
        self._on_up(rid)
