"""EndpointSlice discovery against a Fake list/watch stream: ready endpoints only, full re-list after a break."""

from __future__ import annotations

import asyncio
import queue
import time

import pytest
from kubernetes.client import (
    DiscoveryV1EndpointPort, V1Endpoint, V1EndpointConditions, V1EndpointSlice, V1EndpointSliceList, V1ListMeta,
    V1ObjectMeta,
)

from warmfleet.server.router.discovery import EndpointSliceDiscovery, replicas_from_slices
from warmfleet.server.router.registry import ReplicaSpec, parse_replica


def eps(name: str, *endpoints: tuple[str, bool | None], events_port: bool = True) -> V1EndpointSlice:
    ports = [DiscoveryV1EndpointPort(name="http", port=8000)]
    if events_port:
        ports.append(DiscoveryV1EndpointPort(name="kv-events", port=5557))
    return V1EndpointSlice(
        address_type="IPv4", metadata=V1ObjectMeta(name=name, labels={"kubernetes.io/service-name": "llm"}),
        ports=ports,
        endpoints=[V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready)) for ip, ready in endpoints],
    )


class FakeDiscoveryApi:
    """list_namespaced_endpoint_slice answers from `self.slices`; records the selectors it was asked for."""

    def __init__(self, slices: list):
        self.slices = slices
        self.calls: list[tuple] = []

    def list_namespaced_endpoint_slice(self, namespace, label_selector=None, **kw):
        self.calls.append((namespace, label_selector))
        return V1EndpointSliceList(items=list(self.slices), metadata=V1ListMeta(resource_version=str(len(self.calls))))


class FakeWatch:
    """Yields events put on a shared queue; an Exception item ends the stream with that error."""

    def __init__(self, events: "queue.Queue"):
        self.events = events
        self.stopped = False

    def stream(self, func, namespace, **kw):
        while not self.stopped:
            try:
                ev = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(ev, Exception):
                raise ev
            yield ev

    def stop(self):
        self.stopped = True


class FakeFleet:
    def __init__(self):
        self.history: list[list[str]] = []

    async def set_members(self, specs):
        self.history.append([s.url for s in specs])


async def until(pred, what: str, timeout_s: float = 5.0) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def test_only_ready_endpoints_and_named_ports():
    slices = [eps("a", ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)),
              eps("b", ("10.0.0.4", True), events_port=False)]
    got = replicas_from_slices(slices, "http", "kv-events", default_events_port=None)
    assert got == [ReplicaSpec("http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),
                   ReplicaSpec("http://10.0.0.3:8000", "tcp://10.0.0.3:5557"),
                   ReplicaSpec("http://10.0.0.4:8000", None)]
    assert replicas_from_slices(slices[1:], "http", "kv-events", 6000)[0].events == "tcp://10.0.0.4:6000"


async def test_watch_updates_and_relist_after_break():
    api = FakeDiscoveryApi([eps("a", ("10.0.0.1", True), ("10.0.0.2", False))])
    events: queue.Queue = queue.Queue()
    disc = EndpointSliceDiscovery("prod", "llm", api=api, watch_factory=lambda: FakeWatch(events), retry_delay_s=0.01)
    fleet = FakeFleet()
    task = asyncio.create_task(disc.run(fleet))
    try:
        await until(lambda: fleet.history, "first list")
        assert fleet.history[-1] == ["http://10.0.0.1:8000"]
        assert api.calls[0] == ("prod", "kubernetes.io/service-name=llm")
        events.put({"type": "MODIFIED", "object": eps("a", ("10.0.0.1", True), ("10.0.0.2", True))})
        await until(lambda: fleet.history[-1] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "ready endpoint")
        events.put({"type": "ADDED", "object": eps("b", ("10.0.0.9", True))})
        await until(lambda: "http://10.0.0.9:8000" in fleet.history[-1], "new slice")
        events.put({"type": "DELETED", "object": eps("b")})
        await until(lambda: "http://10.0.0.9:8000" not in fleet.history[-1], "deleted slice")
        # the connection drops; meanwhile 10.0.0.1 went away without the watch telling us
        api.slices = [eps("a", ("10.0.0.2", True))]
        events.put(ConnectionError("watch connection reset"))
        await until(lambda: disc.relists == 2, "re-list after the break")
        await until(lambda: fleet.history[-1] == ["http://10.0.0.2:8000"], "membership from the re-list")
        # a 410 Gone arrives as an ERROR event: re-list again
        events.put({"type": "ERROR", "object": {"code": 410}})
        await until(lambda: disc.relists == 3, "re-list after ERROR")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_flag_parsing():
    with pytest.raises(ValueError):
        EndpointSliceDiscovery.from_flag("just-a-name", "http", "kv-events", None)
    d = EndpointSliceDiscovery.from_flag("ns/svc", "http", "kv-events", None)
    assert (d.namespace, d.service) == ("ns", "svc")
    assert parse_replica("http://h:8000,events=tcp://h:9") == ReplicaSpec("http://h:8000", "tcp://h:9")
    assert parse_replica("http://h:8000/", 5557) == ReplicaSpec("http://h:8000", "tcp://h:5557")
    assert parse_replica("http://h:8000") == ReplicaSpec("http://h:8000", None)
    with pytest.raises(ValueError):
        parse_replica("h:8000")
    with pytest.raises(ValueError):
        parse_replica("http://h:8000,event=tcp://x:1")
