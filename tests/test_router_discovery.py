"""EndpointSlice discovery against a Fake shared client (list, watch stream): ready endpoints only, full re-list after a break."""

from __future__ import annotations

import asyncio

import kmock as kmock_lib
import pytest
from kubernetes.client import (
    DiscoveryV1EndpointPort, V1Endpoint, V1EndpointConditions, V1EndpointSlice, V1ObjectMeta,
)

from waiting import until
from warmfleet.server.router.core.discovery import EndpointSliceDiscovery, replicas_from_slices
from warmfleet.server.router.core.registry import ReplicaSpec, parse_replica


def eps(name: str, *endpoints: tuple[str, bool | None], events_port: bool = True) -> V1EndpointSlice:
    ports = [DiscoveryV1EndpointPort(name="http", port=8000)]
    if events_port:
        ports.append(DiscoveryV1EndpointPort(name="kv-events", port=5557))
    return V1EndpointSlice(
        address_type="IPv4", metadata=V1ObjectMeta(name=name, labels={"kubernetes.io/service-name": "llm"}),
        ports=ports,
        endpoints=[V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready)) for ip, ready in endpoints],
    )


def raw(slice_: V1EndpointSlice) -> dict:
    """The slice as the API server sends it (JSON field names)."""
    return slice_.to_dict(serialize=True)


class FakeKube:
    """The shared client's list_object/watch: lists `self.slices`, streams what is put on `self.events`.

    An Exception put on the queue ends the watch with that error (a dropped connection).
    """

    def __init__(self, slices: list):
        self.slices = slices
        self.events: asyncio.Queue = asyncio.Queue()
        self.calls: list[tuple] = []

    async def list_object(self, kind, namespace, selector):
        self.calls.append((kind, namespace, dict(selector)))
        return {"items": [raw(s) for s in self.slices], "metadata": {"resourceVersion": str(len(self.calls))}}

    async def watch(self, kind, namespace, selector, resource_version, timeout_s):
        while True:
            ev = await self.events.get()
            if isinstance(ev, Exception):
                raise ev
            yield ev["type"], raw(ev["object"]) if isinstance(ev["object"], V1EndpointSlice) else ev["object"]


class FakeFleet:
    def __init__(self):
        self.history: list[list[str]] = []

    async def set_members(self, specs):
        self.history.append([s.url for s in specs])


def test_only_ready_endpoints_and_named_ports():
    slices = [eps("a", ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)),
              eps("b", ("10.0.0.4", True), events_port=False)]
    got = replicas_from_slices(slices, "http", "kv-events", default_events_port=None)
    assert got == [ReplicaSpec("http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),
                   ReplicaSpec("http://10.0.0.3:8000", "tcp://10.0.0.3:5557"),
                   ReplicaSpec("http://10.0.0.4:8000", None)]
    assert replicas_from_slices(slices[1:], "http", "kv-events", 6000)[0].events == "tcp://10.0.0.4:6000"


async def test_watch_updates_and_relist_after_break():
    kube = FakeKube([eps("a", ("10.0.0.1", True), ("10.0.0.2", False))])
    events = kube.events
    disc = EndpointSliceDiscovery("prod", "llm", kube=kube, retry_delay_s=0.01)
    fleet = FakeFleet()
    task = asyncio.create_task(disc.run(fleet))
    try:
        await until(lambda: fleet.history, "first list")
        assert fleet.history[-1] == ["http://10.0.0.1:8000"]
        assert kube.calls[0] == ("EndpointSlice", "prod", {"kubernetes.io/service-name": "llm"})
        events.put_nowait({"type": "MODIFIED", "object": eps("a", ("10.0.0.1", True), ("10.0.0.2", True))})
        await until(lambda: fleet.history[-1] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "ready endpoint")
        events.put_nowait({"type": "ADDED", "object": eps("b", ("10.0.0.9", True))})
        await until(lambda: "http://10.0.0.9:8000" in fleet.history[-1], "new slice")
        events.put_nowait({"type": "DELETED", "object": eps("b")})
        await until(lambda: "http://10.0.0.9:8000" not in fleet.history[-1], "deleted slice")
        # the connection drops; meanwhile 10.0.0.1 went away without the watch telling us
        kube.slices = [eps("a", ("10.0.0.2", True))]
        events.put_nowait(ConnectionError("watch connection reset"))
        await until(lambda: disc.relists == 2, "re-list after the break")
        await until(lambda: fleet.history[-1] == ["http://10.0.0.2:8000"], "membership from the re-list")
        # a 410 Gone arrives as an ERROR event: re-list again
        events.put_nowait({"type": "ERROR", "object": {"code": 410}})
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


async def test_discovery_lists_and_watches_through_the_shared_client(kmock):
    """The real client (warmfleet.kube) against kmock: the list, then watch events, become members."""
    from kubernetes.aio.client import Configuration

    from warmfleet.kube import Kube
    from warmfleet.server.router.core.discovery import ENDPOINT_SLICES

    res = "discovery.k8s.io/v1/endpointslices"
    kmock.resources[res] = kmock_lib.ResourceInfo(kind="EndpointSlice", namespaced=True, verbs={"list", "watch", "get"})

    def in_prod(s: V1EndpointSlice) -> dict:
        body = raw(s)
        body["metadata"] = {"name": s.metadata.name, "namespace": "prod", "labels": s.metadata.labels,
                            "resourceVersion": "1"}
        return body

    kmock.objects[res, "prod", "a"] = in_prod(eps("a", ("10.0.0.1", True), ("10.0.0.2", False)))
    kube = Kube(Configuration(host=str(kmock.url)), ENDPOINT_SLICES, field_manager="test")
    disc = EndpointSliceDiscovery("prod", "llm", kube=kube, retry_delay_s=0.01)
    fleet = FakeFleet()
    task = asyncio.create_task(disc.run(fleet))
    try:
        await until(lambda: fleet.history and fleet.history[-1] == ["http://10.0.0.1:8000"], "the listed slice")
        await kmock.post("/apis/discovery.k8s.io/v1/namespaces/prod/endpointslices", json=in_prod(eps("b", ("10.0.0.9", True))))
        await until(lambda: fleet.history[-1] == ["http://10.0.0.1:8000", "http://10.0.0.9:8000"], "a watched slice")
        await kmock.patch("/apis/discovery.k8s.io/v1/namespaces/prod/endpointslices/a",
                          json={"endpoints": raw(eps("a", ("10.0.0.2", True)))["endpoints"]})
        await until(lambda: fleet.history[-1] == ["http://10.0.0.2:8000", "http://10.0.0.9:8000"], "a modified slice")
        assert disc.relists == 1  # all through one watch
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()
