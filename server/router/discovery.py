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
import threading
from typing import Any, Callable, Iterable, Optional

from .registry import ReplicaSpec

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
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
    """Feeds `fleet.set_members` from one Service's EndpointSlices until cancelled."""

    def __init__(self, namespace: str, service: str, port_name: str = "http", events_port_name: str = "kv-events",
                 default_events_port: Optional[int] = None, default_replay_port: Optional[int] = None,
                 default_metrics_port: Optional[int] = None, api: Any = None,
                 watch_factory: Optional[Callable[[], Any]] = None, retry_delay_s: float = 1.0):
        self.namespace, self.service = namespace, service
        self.port_name, self.events_port_name = port_name, events_port_name
        self.default_events_port, self.default_replay_port = default_events_port, default_replay_port
        self.default_metrics_port = default_metrics_port
        self._api, self._watch_factory = api, watch_factory
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

    def _clients(self) -> tuple[Any, Callable[[], Any]]:
        if self._api is None:
            from kubernetes import client, config, watch

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
            self._watch_factory = watch.Watch
        return self._api, self._watch_factory  # type: ignore[return-value]

    async def run(self, fleet: Any) -> None:
        api, _ = self._clients()
        selector = f"{SERVICE_LABEL}={self.service}"
        while True:
            try:
                listed = await asyncio.to_thread(api.list_namespaced_endpoint_slice, self.namespace,
                                                 label_selector=selector)
                slices = {s.metadata.name: s for s in listed.items}
                self.relists += 1
                await fleet.set_members(self._specs(slices))
                await self._watch(fleet, slices, selector, listed.metadata.resource_version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("EndpointSlice discovery of %s/%s: %s; re-listing", self.namespace, self.service, exc)
                await asyncio.sleep(self.retry_delay_s)

    def _specs(self, slices: dict) -> list[ReplicaSpec]:
        return replicas_from_slices(slices.values(), self.port_name, self.events_port_name, self.default_events_port,
                                    default_replay_port=self.default_replay_port,
                                    default_metrics_port=self.default_metrics_port)

    async def _watch(self, fleet: Any, slices: dict, selector: str, resource_version: str) -> None:
        """Apply watch events until the stream ends or errors (the caller then re-lists)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        w = self._watch_factory()  # type: ignore[misc]
        done = object()

        def hand_over(item: object) -> bool:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the loop is gone: the router is shutting down
                return False

        def pump() -> None:
            try:
                for ev in w.stream(self._api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                   resource_version=resource_version, timeout_seconds=WATCH_TIMEOUT_S):
                    if not hand_over(ev):
                        return
            except Exception as exc:  # handed to the loop, which re-lists
                hand_over(exc)
            hand_over(done)

        threading.Thread(target=pump, name="endpointslice-watch", daemon=True).start()
        try:
            while True:
                ev = await queue.get()
                if ev is done:
                    return
                if isinstance(ev, Exception):
                    raise ev
                kind, obj = ev.get("type"), ev.get("object")
                if kind == "ERROR" or obj is None or not hasattr(obj, "metadata"):
                    return  # e.g. 410 Gone: resourceVersion too old
                if kind == "DELETED":
                    slices.pop(obj.metadata.name, None)
                else:
                    slices[obj.metadata.name] = obj
                await fleet.set_members(self._specs(slices))
        finally:
            w.stop()
