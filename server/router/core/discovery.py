"""Replica discovery from a Service's EndpointSlices (discovery.k8s.io/v1): list, watch, full re-list after any break.

Membership is always recomputed from the whole set of slices, so a watch that missed
events (expired resourceVersion, dropped connection) cannot leave a stale replica behind:
the re-list replaces everything. Endpoints whose `ready` condition is true (or unset,
which Kubernetes defines as ready) are members; a `terminating` one (its pod is being deleted:
scale-in, rolling update) stays a member marked draining, so the router stops sending it new
requests while the pod's preStop hook holds it up and hands its hot prefixes over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Optional

from .registry import ReplicaSpec

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
ENDPOINT_SLICES = {"EndpointSlice": ("discovery.k8s.io/v1", "endpointslices")}  # the one kind discovery reads
FIELD_MANAGER = "warmfleet-router"  # it writes nothing; the client asks for one
WATCH_TIMEOUT_S = 300  # server-side watch timeout; the watch is simply re-established (after a re-list)


def _port(slice_: Any, name: str) -> Optional[int]:
    for p in slice_.ports or []:
        if p.name == name and p.port:
            return int(p.port)
    return None


REPLAY_PORT_NAME = "kv-replay"  # vLLM's event replay socket, when the Service names one
METRICS_PORT_NAME = "metrics"  # FastDeploy's Prometheus port (its load figures), when the Service names one


def replicas_from_slices(slices: Iterable[Any], port_name: str, events_port_name: str,
                         default_events_port: Optional[int], scheme: str = "http",
                         default_replay_port: Optional[int] = None,
                         default_metrics_port: Optional[int] = None) -> list[ReplicaSpec]:
    """Ready and terminating endpoints of all slices as replica specs, the terminating ones `draining`.

    Pure; slices are kubernetes V1EndpointSlice objects. A terminating endpoint counts whether or
    not it is still `serving` (it may already fail readiness while requests finish on it); one
    that is neither ready nor terminating (still starting) is left out.
    """
    out: dict[str, ReplicaSpec] = {}
    for s in slices:
        port = _port(s, port_name)
        if port is None:
            continue
        eport = _port(s, events_port_name) or default_events_port
        rport = _port(s, REPLAY_PORT_NAME) or default_replay_port
        mport = _port(s, METRICS_PORT_NAME) or default_metrics_port
        for ep in s.endpoints or []:
            cond = ep.conditions
            terminating = cond is not None and cond.terminating is True
            if cond is not None and cond.ready is False and not terminating:
                continue
            for addr in (ep.addresses or [])[:1]:  # all addresses of one endpoint are the same pod
                host = f"[{addr}]" if ":" in addr else addr
                spec = ReplicaSpec(f"{scheme}://{host}:{port}", f"tcp://{host}:{eport}" if eport else None,
                                   f"tcp://{host}:{rport}" if rport else None,
                                   f"{scheme}://{host}:{mport}" if mport else None, draining=terminating)
                if spec.id not in out or out[spec.id].draining:  # one live copy wins over a terminating one
                    out[spec.id] = spec
    return sorted(out.values(), key=lambda s: s.id)


class EndpointSliceDiscovery:
    """Feeds `fleet.set_members` from one Service's EndpointSlices until cancelled.

    List and watch go through the shared client (warmfleet.kube, the official client's asyncio
    API, on the router's loop); `kube` replaces it in tests.
    """

    def __init__(self, namespace: str, service: str, port_name: str = "http", events_port_name: str = "kv-events",
                 default_events_port: Optional[int] = None, default_replay_port: Optional[int] = None,
                 default_metrics_port: Optional[int] = None, kube: Any = None, retry_delay_s: float = 1.0):
        self.namespace, self.service = namespace, service
        self.port_name, self.events_port_name = port_name, events_port_name
        self.default_events_port, self.default_replay_port = default_events_port, default_replay_port
        self.default_metrics_port = default_metrics_port
        self._kube = kube
        self.retry_delay_s = retry_delay_s
        self.relists = 0  # completed full lists (the first one included)

    @classmethod
    def from_flag(cls, value: str, port_name: str, events_port_name: str,
                  default_events_port: Optional[int],
                  default_replay_port: Optional[int] = None,
                  default_metrics_port: Optional[int] = None) -> "EndpointSliceDiscovery":
        ns, sep, name = value.partition("/")
        if not sep or not ns or not name:
            raise ValueError(f"--discover-service must be NAMESPACE/NAME, got {value!r}")
        return cls(ns, name, port_name, events_port_name, default_events_port, default_replay_port,
                   default_metrics_port)

    async def _clients(self) -> tuple[Any, bool]:
        """(client, whether this discovery made it and closes it)."""
        if self._kube is not None:
            return self._kube, False
        from warmfleet.kube import Kube

        return await Kube.from_environment(ENDPOINT_SLICES, field_manager=FIELD_MANAGER), True

    async def run(self, fleet: Any) -> None:
        kube, owned = await self._clients()
        selector = {SERVICE_LABEL: self.service}
        try:
            while True:
                try:
                    listed = await kube.list_object("EndpointSlice", self.namespace, selector)
                    slices = {s.metadata.name: s for s in map(_typed, listed.get("items") or [])}
                    self.relists += 1
                    await fleet.set_members(self._specs(slices))
                    await self._watch(kube, fleet, slices, selector, (listed.get("metadata") or {}).get("resourceVersion"))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("EndpointSlice discovery of %s/%s: %s; re-listing", self.namespace, self.service, exc)
                    await asyncio.sleep(self.retry_delay_s)
        finally:
            if owned:
                await kube.close()

    def _specs(self, slices: dict) -> list[ReplicaSpec]:
        return replicas_from_slices(slices.values(), self.port_name, self.events_port_name, self.default_events_port,
                                    default_replay_port=self.default_replay_port,
                                    default_metrics_port=self.default_metrics_port)

    async def _watch(self, kube: Any, fleet: Any, slices: dict, selector: dict, resource_version: Optional[str]) -> None:
        """Apply watch events until the stream ends or errors (the caller then re-lists)."""
        async for kind, raw in kube.watch("EndpointSlice", self.namespace, selector, resource_version, WATCH_TIMEOUT_S):
            if kind == "ERROR" or not isinstance(raw, dict) or "metadata" not in raw:
                return  # e.g. 410 Gone: resourceVersion too old
            obj = _typed(raw)
            if kind == "DELETED":
                slices.pop(obj.metadata.name, None)
            elif kind in ("ADDED", "MODIFIED"):
                slices[obj.metadata.name] = obj
            else:
                continue  # BOOKMARK
            await fleet.set_members(self._specs(slices))


def _typed(raw: dict) -> Any:
    """A V1EndpointSlice from the API's JSON (what replicas_from_slices reads)."""
    from kubernetes.client import V1EndpointSlice

    return V1EndpointSlice.from_dict(raw)
