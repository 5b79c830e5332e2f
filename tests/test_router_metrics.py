"""The router's lock-free request-path metrics expose what prometheus_client's own Counter and Histogram would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from warmfleet.server.router.core.metrics import LoopCounter, LoopHistogram, RouterMetrics

BUCKETS = (-64, -1, 0, 0.5, 64)


def samples(registry: CollectorRegistry) -> dict:
    """(name, labels) -> value of every sample except prometheus_client's `_created` series."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


def test_loop_metrics_scrape_as_prometheus_clients_own_would():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1, c2 = LoopCounter("x_total", "doc", registry=ours), Counter("x_total", "doc", registry=theirs)
    l1 = LoopCounter("y_total", "doc", ["reason"], registry=ours)
    l2 = Counter("y_total", "doc", ["reason"], registry=theirs)
    h1, h2 = LoopHistogram("z", "doc", BUCKETS, registry=ours), Histogram("z", "doc", buckets=BUCKETS, registry=theirs)
    for v in (-100, -64, -1, -0.5, 0, 0, 0.5, 3, 64, 65, 1e9):  # each bound itself falls in its own bucket (le)
        h1.observe(v)
        h2.observe(v)
    for amount in (1, 2.5, 7):
        c1.inc(amount)
        c2.inc(amount)
    for reason in ("a", "b", "a"):
        l1.labels(reason).inc()
        l2.labels(reason).inc()
    assert samples(ours) == samples(theirs)
    text = generate_latest(ours).decode()
    assert 'z_bucket{le="0.5"} 7.0' in text and 'z_bucket{le="+Inf"} 11.0' in text
    assert "# TYPE x_total counter" in text or "# TYPE x counter" in text


def test_loop_counter_children_are_keyed_as_strings_and_checked():
    c = LoopCounter("s_total", "doc", ["status"])
    c.labels(2).inc()
    c.labels("2").inc()
    assert c.labels("2").value == 2
    with pytest.raises(ValueError):
        c.labels("a", "b")


def test_router_metrics_register_each_family_once():
    text = RouterMetrics().render().decode()
    for name in ("warmfleet_router_decisions_total", "warmfleet_router_route_seconds_bucket",
                 "warmfleet_router_prompt_tokens_total"):
        assert name in text


async def test_index_gauges_read_the_index_when_scraped_and_leave_with_the_replica():
    import httpx

    from warmfleet.server.events import BlockStored, EventBatch, Snapshot
    from warmfleet.server.router.core.fleet import Fleet
    from warmfleet.server.router.core.registry import ReplicaSpec

    metrics = RouterMetrics()
    async with httpx.AsyncClient() as http:
        fleet = Fleet(http, metrics, adapter_poll_s=None)
        await fleet.set_members([ReplicaSpec("http://a:1"), ReplicaSpec("http://b:1")])
        blocks = [bytes([k]) * 32 for k in range(5)]
        for rid in ("http://a:1", "http://b:1"):
            fleet.index.apply_snapshot(rid, Snapshot(rid, 0, 16, "fp", [], [], []))
        fleet._on_batch("http://a:1", EventBatch("http://a:1", 1, [BlockStored(blocks, None, [], 16)]))
        fleet._on_batch("http://b:1", EventBatch("http://b:1", 1, [BlockStored(blocks[:2], None, [], 16)]))

        def value(name: str, **labels) -> float:
            return metrics.registry.get_sample_value(name, labels)

        assert value("warmfleet_router_replica_index_blocks", replica="http://a:1", tier="gpu") == 5
        assert value("warmfleet_router_replica_index_blocks", replica="http://b:1", tier="gpu") == 2
        assert value("warmfleet_router_index_blocks") == 5  # distinct blocks: b's two are a's too
        assert value("warmfleet_router_event_lag_seconds_count") == 2
        metrics.replica_engine_queue.labels("http://a:1").set(3)
        await fleet.set_members([ReplicaSpec("http://b:1")])
        assert value("warmfleet_router_replica_index_blocks", replica="http://a:1", tier="gpu") is None
        assert value("warmfleet_router_replica_engine_requests", replica="http://a:1") is None
        assert value("warmfleet_router_index_blocks") == 2
        await fleet.stop()
