"""The router's HTTP surface (FastAPI): OpenAI endpoints, health, readiness, metrics, auth and client limits."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response

from ... import otel, tracing
from ...bodies import BodyTooLarge, read_capped
from ..core.admission import request_limits
from ..core.errors import Refusal
from ..core.errors import parse_json_object as parse_body
from ..core.metrics import RouterMetrics
from ..core.peers import PEER_LOAD_PATH, PeerLoad
from ..core.runtime import RouterRuntime, running, upstream_headers
from ..core.tenants import ConcurrencyLimiter, admit_client
from ..status import add_admin_routes, add_status_routes, admin_denied, error_response, refusal_response
from .proxy import Proxy, upstream_session


log = logging.getLogger(__name__)


def parse_json_object(raw: bytes) -> dict | Response:
    """The request's JSON object, or the 400 to answer."""
    body = parse_body(raw)
    return refusal_response(body) if isinstance(body, Refusal) else body


async def receive_capped(receive, declared: Optional[bytes], limit: int) -> Optional[bytes]:
    """`bodies.read_capped` on raw ASGI: the body, None if the client disconnected, BodyTooLarge past `limit`."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


TRACE_HEADERS = frozenset(h.encode() for h in tracing.HEADERS)


def with_request_id(resp: Response, rid: str) -> Response:
    """`resp` carrying `x-request-id` (the replica's echo if it sent one, else `rid`)."""
    if not any(k == b"x-request-id" for k, _ in resp.raw_headers):
        resp.raw_headers.append((b"x-request-id", rid.encode()))
    return resp


async def until_disconnect(receive, work: Awaitable):
    """`work`'s result, or None when the ASGI client disconnects first (then `work` is cancelled and awaited)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(receive())  # the body is read: the next message can only be http.disconnect
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


class Frontend:
    """What every OpenAI route does before the proxy: body cap and JSON, API key and tenant salt, per-client limit."""

    def __init__(self, rt: RouterRuntime, limiter: ConcurrencyLimiter, state: dict):
        self.tenants, self.max_request_bytes = rt.tenants, rt.settings.max_request_bytes
        self.limiter, self.state = limiter, state
        self.spans = rt.spans  # otel.Spans, None: no spans (one test per request)

    def client_headers(self, request: Request) -> dict:
        """Headers passed upstream: the client's auth only when the router itself checks none."""
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth and not self.tenants.enabled else {}

    def enter(self, host: str, auth: Optional[str], body: Optional[dict]) -> str | Response:
        """Authenticate (and salt `body` for the tenant) and take a per-client slot: the client's key, or the 4xx.

        The caller releases the slot (`limiter.release(key)`) when the last byte has been sent."""
        client = admit_client(self.tenants, self.limiter, host, auth, body)
        return refusal_response(client) if isinstance(client, Refusal) else client

    async def admit(self, request: Request, call: Callable[[], Awaitable[Response]]) -> Response:
        """`enter` (no body to salt), then the answer of `call`, holding the client's slot until its last byte is
        sent."""
        client = self.enter(request.client.host if request.client else "unknown",
                            request.headers.get("authorization"), None)
        if isinstance(client, Response):
            return client
        limiter = self.limiter
        try:
            resp = await call()
        except BaseException:
            limiter.release(client)
            raise
        if resp.background is None:  # release when the last byte has gone (streams run after return)
            async def release() -> None:  # async: a sync background task would hop to a worker thread
                limiter.release(client)

            resp.background = BackgroundTask(release)
        else:
            limiter.release(client)
        return resp

    async def serve(self, scope: dict, receive, send, kind: str) -> None:
        """A cache-routed POST in raw ASGI: `respond` holding the client's slot (as `admit` does) until the response
        has been sent, streams included, without Starlette's Request object or a background task."""
        auth = declared = None
        trace: dict = {}
        for name, value in scope["headers"]:  # ASGI header names are lower-case
            if name == b"authorization":
                auth = auth if auth is not None else value.decode("latin-1")
            elif name == b"content-length":
                declared = declared if declared is not None else value
            elif name in TRACE_HEADERS:
                trace.setdefault(name.decode(), value.decode("latin-1"))
        try:
            raw = await receive_capped(receive, declared, self.max_request_bytes)
        except BodyTooLarge as exc:
            return await error_response(413, str(exc), "invalid_request_error")(scope, receive, send)
        if raw is None:  # the client left before its body arrived: nobody to answer
            return None
        peer = scope.get("client")
        answer = await until_disconnect(receive, self.respond(scope["path"], kind, raw, auth,
                                                              peer[0] if peer else "unknown", trace))
        if answer is None:  # the client left first: its request was cancelled (the replica sees its connection close)
            return None
        resp, slot = answer
        try:
            await resp(scope, receive, send)
        finally:
            if slot is not None:
                self.limiter.release(slot)

    async def respond(self, path: str, kind: str, raw: bytes, auth: Optional[str], host: str,
                      trace: Optional[dict] = None) -> tuple[Response, Optional[str]]:
        """The answer to a cache-routed POST whose body has been read, and the client slot it holds (None: none
        taken); the caller releases the slot once the answer's last byte is sent (`limiter.release`). `trace`: the
        request's trace headers (tracing.HEADERS), passed upstream; the answer carries its `x-request-id`."""
        forward = tracing.forwarded(trace or {})
        if self.spans is not None:
            return await self._respond_traced(path, kind, raw, auth, host, forward)
        resp, slot = await self._respond(path, kind, raw, auth, host, forward)
        return with_request_id(resp, forward[tracing.REQUEST_ID]), slot

    async def _respond_traced(self, path: str, kind: str, raw: bytes, auth: Optional[str], host: str,
                              forward: dict) -> tuple[Response, Optional[str]]:
        """`respond` inside a routing-decision span (otel.py): the child of the client's traceparent, its own sent
        upstream, the decision: the replica that answered (the router's id of it, as in its metrics) and the reason
        and predicted cached tokens the answer's `x-warmfleet-route` tells the client."""
        spans, rid = self.spans, forward[tracing.REQUEST_ID]
        span = spans.start("warmfleet.route", forward, {otel.REQUEST_ID: rid, "url.path": path})
        try:
            spans.hand_on(span, forward)
            resp, slot = await self._respond(path, kind, raw, auth, host, forward)
            route = next((v for k, v in resp.raw_headers if k == b"x-warmfleet-route"), b"")
            replica = getattr(resp, "replica_id", None)  # set by Proxy.forward on an answer from a replica
            span.set_attributes(otel.route_header_attributes(replica, route.decode("latin-1")))
            spans.error(span, resp.status_code)
        finally:
            span.end()
        return with_request_id(resp, rid), slot

    async def _respond(self, path: str, kind: str, raw: bytes, auth: Optional[str], host: str,
                       forward: dict) -> tuple[Response, Optional[str]]:
        parsed = parse_json_object(raw)
        if isinstance(parsed, Response):
            return parsed, None
        proxy = self.state.get("proxy")
        if proxy is None:  # the app's lifespan has not started the core: nothing to route with
            return error_response(503, "the router has not started", "service_unavailable"), None
        client = self.enter(host, auth, parsed)
        if isinstance(client, Response):
            return client, None
        try:
            tenants = self.tenants.enabled
            # the client's bytes go upstream as they came unless the router rewrote the body (tenant salt)
            if auth and not tenants:
                forward["authorization"] = auth
            resp = await proxy.forward(path, kind, parsed, forward, None if tenants else raw)
        except BaseException:
            self.limiter.release(client)
            raise
        return resp, client

    async def plain(self, request: Request, method: str, path: str) -> Response:
        """Forward a request the router does not route by cache (models, tokenize) to any healthy replica."""
        raw = b""
        if method == "POST":
            try:
                raw = await read_capped(request, self.max_request_bytes)
            except BodyTooLarge as exc:
                return error_response(413, str(exc), "invalid_request_error")
        forward = tracing.forwarded({k: request.headers[k] for k in tracing.HEADERS if k in request.headers})
        resp = await self.admit(request, lambda: self.state["proxy"].forward_plain(
            method, path, raw, {**self.client_headers(request), **forward}))
        return with_request_id(resp, forward[tracing.REQUEST_ID])


# route name → (method, path, request kind): chat and completions are routed by cache (FastPath serves them
# first), the others go to any healthy replica (kind None)
OPENAI_ROUTES = {
    "chat": ("POST", "/v1/chat/completions", "chat"),
    "completions": ("POST", "/v1/completions", "completion"),
    "models": ("GET", "/v1/models", None),
    "tokenize": ("POST", "/tokenize", None),
    "detokenize": ("POST", "/detokenize", None),
}
FAST_PATHS = {path: kind for _, path, kind in OPENAI_ROUTES.values() if kind}


class FastPath:
    """Pure ASGI for the two hot POST routes, wrapped around the whole FastAPI app (outermost).

    It skips FastAPI's routing and per-endpoint machinery and also its middleware stack (error,
    exception-telemetry and body-limit layers, which read the environment on every request):
    about 5% of the router's CPU per request under load (docs/scale.md), and Starlette's Request
    object (`Frontend.serve` reads the body and two headers straight from ASGI). Everything else, the
    lifespan included, goes to the FastAPI app, whose attributes (`state`, ...) it forwards.
    Under `warmfleet route` most hot requests never reach it: hotpath.py serves them from the HTTP
    protocol; those it leaves to ASGI (chunked bodies, `Expect`, a forwarded client) come here.
    """

    def __init__(self, inner, frontend: Frontend):
        self.inner, self.frontend = inner, frontend

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def __call__(self, scope, receive, send):
        kind = FAST_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope.get("method") != "POST" or "proxy" not in self.frontend.state:
            return await self.inner(scope, receive, send)
        await self.frontend.serve(scope, receive, send, kind)


def _add_openai_routes(app: FastAPI, front: Frontend) -> None:
    """The OpenAI routes of OPENAI_ROUTES, each handed to the frontend."""
    for name, (method, path, kind) in OPENAI_ROUTES.items():
        app.add_api_route(path, _openai_endpoint(front, method, path, kind), methods=[method], name=name)


class _ServedByFrontend(Response):
    """A cache-routed request FastPath left to the app (the proxy not started yet): the whole exchange goes to
    `Frontend.serve`, the one implementation, which reads the body itself (the endpoint declares none)."""

    def __init__(self, front: Frontend, kind: str):
        self.front, self.kind, self.background = front, kind, None

    async def __call__(self, scope, receive, send) -> None:
        await self.front.serve(scope, receive, send, self.kind)


def _openai_endpoint(front: Frontend, method: str, path: str,
                     kind: Optional[str]) -> Callable[[Request], Awaitable[Response]]:
    if kind is not None:
        async def routed(request: Request) -> Response:
            return _ServedByFrontend(front, kind)

        return routed

    async def plain(request: Request) -> Response:
        return await front.plain(request, method, path)

    return plain


def _lifespan(rt: RouterRuntime, metrics: RouterMetrics, state: dict, peers: Optional[PeerLoad] = None):
    """Start the core (fleet, discovery, peer polling: core/runtime.py) and the proxy with the app; stop all with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        session = upstream_session(rt.settings.proxy)
        try:
            async with running(rt, metrics, peers) as router:
                state["fleet"] = app.state.fleet = router.fleet
                state["router"] = app.state.router = router
                state["proxy"] = app.state.proxy = Proxy(router, rt.settings.proxy, upstream_headers(rt.settings),
                                                         session, request_limits(rt.settings))
                yield
        finally:
            await session.close()

    return lifespan


def _add_peer_route(app: FastAPI, rt: RouterRuntime, state: dict, open_by_client: Callable[[], dict],
                    peers: Optional[PeerLoad]) -> None:
    """`GET /v1/router/peer-load`: this router's own figures (served even without --peers, so others can poll it).
    An admin route (per-client open counts and replica loads by URL are no one else's business): with
    `--admin-key` it needs that key, which peers send; without one it answers only on this host (status.py)."""
    local = peers or PeerLoad([])

    @app.get(PEER_LOAD_PATH, response_model=None)  # no schema from the return annotation
    async def peer_load(request: Request) -> Response:
        refused = admin_denied(request, rt, keyless_ok=True)
        if refused is not None:
            return refused
        fleet = state.get("fleet")
        reps = fleet.registry.replicas.values() if fleet is not None else []
        out = local.local_report(reps, open_by_client())
        out["peers"] = local.view()
        return JSONResponse(out)


def build_app(rt: RouterRuntime) -> FastAPI:
    metrics = RouterMetrics()
    settings = rt.settings
    peers = (PeerLoad(rt.peers, interval_s=settings.peer_interval_s, jitter=settings.peer_jitter,
                      partition_tokens=settings.peer_partition_tokens,
                      headers={"authorization": f"Bearer {settings.admin_key}"} if settings.admin_key else None,
                      digest_key=(settings.admin_key or "").encode())
             if rt.peers else None)
    if peers is not None and not settings.admin_key:
        log.warning("--peers without --admin-key: peer load is an admin route, answered only on this host; routers "
                    "on other hosts need one --admin-key (WARMFLEET_ADMIN_KEY) to share load and client limits")
    limiter = ConcurrencyLimiter(settings.max_concurrent_per_client, remote=peers.client_open if peers else None)
    state: dict = {}  # "fleet" and "proxy", set by the lifespan
    front = Frontend(rt, limiter, state)
    app = FastAPI(title="warmfleet router", lifespan=_lifespan(rt, metrics, state, peers))
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.limiter = limiter
    app.state.peers = peers
    _add_openai_routes(app, front)
    add_status_routes(app, rt, state, metrics)
    add_admin_routes(app, rt, state)
    _add_peer_route(app, rt, state, lambda: limiter.open, peers)
    return FastPath(app, front)  # type: ignore[return-value]  # an ASGI app that forwards attributes to `app`
