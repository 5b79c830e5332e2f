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
