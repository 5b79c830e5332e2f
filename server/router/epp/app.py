"""The EPP's side HTTP port (FastAPI): /health, /ready, /metrics, /v1/router/replicas and the admin drain routes,
built by the routes both front doors share (router/status.py)."""

from __future__ import annotations

from fastapi import FastAPI

from ..core.metrics import RouterMetrics
from ..core.runtime import RouterRuntime
from ..status import add_admin_routes, add_status_routes


def build_side_app(rt: RouterRuntime, state: dict, metrics: RouterMetrics) -> FastAPI:
    """The side port's app; `state["fleet"]` is set by the server once the core runs."""
    app = FastAPI(title="warmfleet endpoint picker")
    app.state.metrics = metrics
    add_status_routes(app, rt, state, metrics)
    add_admin_routes(app, rt, state)
    return app
