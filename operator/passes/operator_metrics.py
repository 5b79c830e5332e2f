"""The operator's own Prometheus metrics (reconciles by outcome and their duration, pools sized, children applied, leader state) and the /healthz + /metrics HTTP endpoint that serves them; no kopf."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

RECONCILE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def outcome_of(outcome: Any, error: BaseException | None = None) -> str:
    """`error` (an exception escaped), `invalid` (InvalidSpec), `changed` (a child or the status written), `unchanged`."""
    if error is not None:
        return "error"
    if outcome is None:
        return "skipped"
    if getattr(outcome, "invalid", None):
        return "invalid"
    changed = any(a != "unchanged" for a in (getattr(outcome, "actions", None) or {}).values())
    return "changed" if changed or getattr(outcome, "status_written", False) else "unchanged"


@dataclass
class OperatorMetrics:
    """Every series of the operator, in a registry of its own (made at startup, never at import)."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter("warmfleet_operator_reconciles", "Reconciles of an InferenceService, by outcome "
                                  "(changed, unchanged, invalid, error).", ["outcome"], registry=r)
        self.duration = Histogram("warmfleet_operator_reconcile_duration_seconds", "Seconds one reconcile took.",
                                  buckets=RECONCILE_BUCKETS_S, registry=r)
        self.pools = Gauge("warmfleet_operator_pools_sized", "Node pools the last plan of a service sized.",
                           ["namespace", "inferenceservice"], registry=r)
        self.children = Counter("warmfleet_operator_children_applied", "Children written (created, patched, "
                                "deleted), by kind.", ["kind", "action"], registry=r)
        self.leader = Gauge("warmfleet_operator_leader", "1 while this operator process holds the leader Lease "
                            "(and reconciles), 0 on standby.", registry=r)
        self.leader_transitions = Counter("warmfleet_operator_leader_acquired", "Times this process became leader.",
                                          registry=r)

    def observe(self, namespace: str, name: str, outcome: Any, seconds: float, error: BaseException | None = None) -> None:
        """One reconcile of service `namespace/name`: its outcome, its duration, its pools and what it wrote."""
        self.reconciles.labels(outcome_of(outcome, error)).inc()
        self.duration.observe(seconds)
        if outcome is None:
            return
        if getattr(outcome, "pools", None) is not None:
            self.pools.labels(namespace, name).set(outcome.pools)
        for key, action in (getattr(outcome, "actions", None) or {}).items():
            if action != "unchanged":
                self.children.labels(key.split("/", 1)[0], action).inc()

    def forget(self, namespace: str, name: str) -> None:
        """A deleted service: its pools series goes."""
        try:
            self.pools.remove(namespace, name)
        except KeyError:
            pass

    def set_leader(self, leading: bool) -> None:
        if leading:
            self.leader_transitions.inc()
        self.leader.set(1 if leading else 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def serve(metrics: OperatorMetrics, host: str, port: int, healthy: Callable[[], Mapping[str, Any] | None]) -> Any:
    """Serve GET /healthz and /readyz (200 while `healthy()` returns a body, else 503) and GET /metrics; → the runner.

    Readiness is health: a standby that follows the Lease is as ready as the leader (it takes over within the
    lease), and a rolling update may remove the old pod once the new one answers."""
    from aiohttp import web

    async def healthz(_: web.Request) -> web.Response:
        body = healthy()
        return web.json_response(dict(body) if body is not None else {"status": "unhealthy"},
                                 status=200 if body is not None else 503)

    async def exposition(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    app.router.add_get("/metrics", exposition)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
