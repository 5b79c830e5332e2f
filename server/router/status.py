"""The status and admin HTTP routes both front doors serve (health, readiness, metrics, replicas view, drain); FastAPI.

Shared by `warmfleet route` (http/) and the EPP's side port (epp/); imports the core only, never a front door.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from typing import Optional

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from .core.errors import Refusal
from .core.fleet import Fleet
from .core.metrics import RouterMetrics
from .core.runtime import RouterRuntime


def error_response(status: int, message: str, type_: str) -> JSONResponse:
    return refusal_response(Refusal(status, message, type_))


def refusal_response(refusal: Refusal) -> JSONResponse:
    """A core refusal as the OpenAI-shaped JSON answer."""
    return JSONResponse(refusal.payload(), status_code=refusal.status)


def add_status_routes(app: FastAPI, rt: RouterRuntime, state: dict, metrics: RouterMetrics) -> None:
    """Liveness, readiness, Prometheus metrics and the replicas view (full with the admin key: `admin_denied`)."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        fleet: Fleet = state["fleet"]
        n = len(fleet.routable())
        return JSONResponse({"ready": n > 0, "routable_replicas": n, "replicas": len(fleet.registry.replicas)},
                            status_code=200 if n else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        fleet: Fleet = state["fleet"]
        for rid in fleet.registry.replicas:
            metrics.replica_engine_queue.labels(rid).set(fleet.engine_load(rid))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/router/replicas")
    async def replicas(request: Request) -> Response:
        """Debug view: members, health, load and how much of each one's cache the index knows. Members are named by
        their URLs (pod IPs), so the full view is an admin route; anyone else gets `public_view`."""
        fleet: Fleet = state["fleet"]
        if admin_denied(request, rt, keyless_ok=True) is not None:  # keyless: full on the router's own host
            return JSONResponse(public_view(fleet))
        router = state.get("router")
        ttft = router.ttft if router is not None else None
        out = []
        for r in fleet.registry.replicas.values():
            st = fleet.index.replicas.get(r.id)
            out.append({"id": r.id, "state": phase(r), "events": r.spec.events, "healthy": r.healthy,
                        "in_flight": r.in_flight, "last_warmup": r.last_warmup, "draining": r.draining,
                        "drain_trigger": r.drain_trigger, "last_handoff": r.last_handoff,
                        "engine_requests": fleet.engine_load(r.id), "synced": bool(st and st.synced),
                        "gpu_blocks": len(st.gpu) if st else 0, "cpu_blocks": len(st.cpu) if st else 0,
                        "adapters": fleet.adapters.describe(r.id), "encoder_entries": len(st.encoder) if st else 0,
                        "ttft_model": ttft.describe(r.id) if ttft is not None else None,
                        "node": st.node_name if st else None, "last_error": r.last_error})
        return JSONResponse({"replicas": out, "index_blocks": fleet.index.num_blocks(),
                             "index_evicted_blocks": fleet.index.evicted, "engine": fleet.dialect.kind,
                             "contract": fleet.dialect.contract, "hash_check": fleet.dialect.hash_check(),
                             "media_urls": _num_urls(state),
                             "node_tiers": fleet.node_tiers.view() if fleet.node_tiers is not None else [],
                             "node_tier_pricing": (router.pricing.current(time.monotonic()).view()
                                                   if router is not None else None)})


def public_view(fleet: Fleet) -> dict:
    """The replicas view without the admin key: how many members are in each state and what the index holds, no
    member's URL, address, event endpoint, adapter or error."""
    states: dict[str, int] = {}
    for r in fleet.registry.replicas.values():
        st = phase(r)
        states[st] = states.get(st, 0) + 1
    return {"redacted": True, "states": states, "replicas": [], "index_blocks": fleet.index.num_blocks(),
            "engine": fleet.dialect.kind, "contract": fleet.dialect.contract}


def _num_urls(state: dict) -> Optional[int]:
    """How many image URLs the router has learned (url_memo.UrlHashMemo); None without a renderer."""
    urls = getattr(getattr(state.get("router"), "renderer", None), "urls", None)
    return None if urls is None else len(urls)


def phase(r) -> str:
    """A replica's state in the replicas view: draining (requests still in flight), drained, warming, ready, down."""
    if r.draining:
        return "draining" if r.in_flight else "drained"
    return "warming" if r.warming else "ready" if r.healthy else "down"


def is_local(request: Request) -> bool:
    """Whether `request` came from this host's loopback and was not forwarded for another client (no
    X-Forwarded-For or Forwarded: a local proxy speaks for someone else)."""
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
    return loopback and "x-forwarded-for" not in request.headers and "forwarded" not in request.headers


def admin_denied(request: Request, rt: RouterRuntime, keyless_ok: bool = False) -> Optional[Response]:
    """None if `request` may use an admin route; else the 401/403 answer.

    With `--admin-key` every admin route needs `Authorization: Bearer KEY` (a client's API key is refused). Without
    one they answer only requests from this host's loopback (`is_local`: kubectl port-forward or exec, a local
    script), as Redis's protected mode does, and none while the router checks API keys, unless `keyless_ok` (peer
    load: routers on one host). Anyone else gets a 403 naming the flag."""
    admin_key = rt.settings.admin_key
    if admin_key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin_key.encode()):
            return error_response(401, "admin routes need `Authorization: Bearer <admin key>`",
                                  "authentication_error")
    elif not is_local(request):
        return error_response(403, "this router has no admin key: its admin routes answer only on its own host; "
                              "start it with --admin-key (or WARMFLEET_ADMIN_KEY) to use them from elsewhere",
                              "permission_error")
    elif rt.tenants.enabled and not keyless_ok:
        return error_response(403, "this router checks API keys: start it with --admin-key (or "
                              "WARMFLEET_ADMIN_KEY) to use its admin routes", "permission_error")
    return None


def add_admin_routes(app: FastAPI, rt: RouterRuntime, state: dict) -> None:
    """Drain for static fleets and scripted rolling updates: POST starts it, DELETE ends it.

    The replica id is its base URL as `/v1/router/replicas` lists it (percent-encode it:
    `/v1/router/replicas/http%3A%2F%2F10.0.0.7%3A8000/drain`). With `--admin-key` the call needs
    `Authorization: Bearer KEY`; without one it is answered only on the router's own host (`admin_denied`).
    """

    async def drain_call(request: Request, rid: str, start: bool) -> Response:
        refused = admin_denied(request, rt)
        if refused is not None:
            return refused
        fleet: Fleet = state["fleet"]
        rid = rid.rstrip("/")
        if not (fleet.drain(rid, "admin") if start else fleet.undrain(rid)):
            known = ", ".join(sorted(fleet.registry.replicas)) or "none"
            return error_response(404, f"no replica {rid!r} in this router (members: {known})",
                                  "invalid_request_error")
        r = fleet.registry.replicas[rid]
        return JSONResponse({"id": rid, "state": phase(r), "draining": r.draining, "in_flight": r.in_flight})

    @app.post("/v1/router/replicas/{rid:path}/drain")
    async def drain(request: Request, rid: str) -> Response:
        return await drain_call(request, rid, True)

    @app.delete("/v1/router/replicas/{rid:path}/drain")
    async def undrain(request: Request, rid: str) -> Response:
        return await drain_call(request, rid, False)
