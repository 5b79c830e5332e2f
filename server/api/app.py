"""`build_app`: the FastAPI application of one replica (OpenAI routes, tokenize, probes, metrics, KV snapshot)."""

from __future__ import annotations

import logging
import secrets
from typing import Any, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..config import EngineConfig
from ..engine.protocol import EngineClient
from ..tokenizer import ChatTemplateError
from .. import rendering
from .. import tracing
from ..tenant_keys import bearer_key
from . import errors
from .errors import APIError, bad_request
from .metrics import CONTENT_TYPE
from .protocol import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from .completions import (
    chat_completions,
    check_token_ids,
    completions,
    message_dict,
    parse_body,
    prepare_images,
)
from .state import ServerState

log = logging.getLogger("warmfleet.api")

REPLICA_HEADER = "x-warmfleet-replica"
_PROBES = frozenset({"/health", "/ready", "/metrics"})  # their 503s are states, not request errors


def build_app(engine: Optional[EngineClient], tokenizer: Any, cfg: EngineConfig) -> FastAPI:
    """The API of one replica. `engine` may be None while the model loads (attach it with `attach_engine`)."""
    state = ServerState(cfg, engine, tokenizer)
    app = FastAPI(title="warmfleet", docs_url=None, redoc_url=None)
    app.state.wf = state
    errors.install(app)
    app.add_middleware(ResponseObserver, replica_id=state.replica_id, state=state)
    app.include_router(_api_routes())
    app.include_router(_admin_routes())
    _add_probe_routes(app)
    return app


def get_state(request: Request) -> ServerState:
    return request.app.state.wf


def require_key(request: Request) -> None:
    """The API key check of every API route (none when the server has no key). `--api-key` is the fleet key (routers,
    pickers): its requests' cache_salt is trusted. A client key of `--api-keys-file` runs under its tenant's salt
    (request.state.tenant_salt, enforced by parse_body), whatever salt the body names."""
    s = get_state(request)
    if not s.api_key and not s.client_salts:
        return
    auth = request.headers.get("authorization", "")
    if s.api_key and bearer_key((s.api_key,), auth) is not None:
        return
    client = bearer_key(s.client_salts, auth) if s.client_salts else None
    if client is None:
        raise APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY`)", code="invalid_api_key")
    request.state.tenant_salt = s.client_salts[client]


def require_fleet_key(request: Request) -> None:
    """Routes for routers only (the KV snapshot: every tenant's cached blocks): a client key of --api-keys-file is
    refused."""
    if getattr(request.state, "tenant_salt", None) is not None:
        raise APIError(403, "this route takes the fleet key (--api-key), not a client key", code="fleet_key_required")


def _api_routes() -> APIRouter:
    """The routes behind the API key: OpenAI generation and models, tokenize/detokenize, the KV snapshot."""
    api = APIRouter(dependencies=[Depends(require_key)])

    @api.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await chat_completions(request, get_state(request))

    @api.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        return await completions(request, get_state(request))

    async def lora_digests(s) -> dict:
        """Adapter name -> its content digest, from the engine (empty when it serves none or cannot answer)."""
        if not s.loras or s.engine is None:
            return {}
        try:
            return (await s.engine.stats()).lora_digests
        except Exception as exc:  # the listing stays up; the router only lacks the digest until the next poll
            log.warning("no LoRA digests from the engine: %s", exc)
            return {}

    @api.get("/v1/models")
    async def _models(request: Request) -> ModelList:
        s = get_state(request)
        info = s.engine.model_info if s.engine is not None else None
        max_len = info.max_model_len if info else None
        card = ModelCard(id=s.model_name, root=info.model_dir if info else s.cfg.model.model, max_model_len=max_len)
        digests = await lora_digests(s)
        adapters = [ModelCard(id=name, root=path, parent=s.model_name, max_model_len=max_len,
                              lora_digest=digests.get(name)) for name, path in s.loras.items()]
        return ModelList(data=[card, *adapters])

    @api.post("/tokenize")
    async def _tokenize(request: Request) -> JSONResponse:
        s = get_state(request)
        body = await parse_body(request, TokenizeRequest, s)
        s.check_model(body.model)
        engine = s.require_engine()
        tokens = await _tokenize_ids(s, body)
        return JSONResponse({"count": len(tokens), "max_model_len": engine.model_info.max_model_len, "tokens": tokens})

    @api.post("/detokenize")
    async def _detokenize(request: Request) -> JSONResponse:
        s = get_state(request)
        body = await parse_body(request, DetokenizeRequest, s)
        s.check_model(body.model)
        s.require_engine()
        check_token_ids(s, body.tokens, "tokens")
        return JSONResponse({"prompt": await s.run_sync(s.tokenizer.decode, body.tokens)})

    @api.get("/v1/kv/snapshot", dependencies=[Depends(require_fleet_key)])
    async def _snapshot(request: Request) -> JSONResponse:
        s = get_state(request)
        engine = s.require_engine()
        try:
            return JSONResponse(await s.snapshots.get(engine))
        except Exception as exc:  # engine busy or gone: the router retries the resync later
            log.warning("snapshot failed: %s", exc)
            raise APIError(503, f"engine snapshot unavailable: {exc}", code="engine_unavailable") from None

    return api


def require_admin(request: Request) -> None:
    """The admin routes' check, as the router's: `--admin-key` as Bearer; without one, open only while no API key is set."""
    s = get_state(request)
    if s.admin_key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), s.admin_key.encode()):
            raise APIError(401, "admin routes need `Authorization: Bearer <admin key>`", code="invalid_api_key")
    elif s.api_key or s.client_salts:
        raise APIError(403, "this server checks API keys: start it with --admin-key (or WARMFLEET_ADMIN_KEY) "
                       "to use its admin routes", code="admin_key_required")


def _admin_routes() -> APIRouter:
    """vLLM's runtime LoRA routes, behind the admin key (they change what every client is served)."""
    admin = APIRouter(dependencies=[Depends(require_admin)])

    async def engine_call(s: ServerState, method: str, *args: str) -> dict:
        engine = s.require_engine()
        if not s.lora_enabled or not hasattr(engine, method):
            raise bad_request("this server was started without --enable-lora", code="lora_not_enabled")
        reply = await getattr(engine, method)(*args)
        if reply.get("error"):
            raise APIError(int(reply.get("status", 400)), reply["error"], param="lora_name",
                           code="lora_not_found" if reply.get("status") == 404 else "invalid_lora_adapter")
        return reply

    @admin.post("/v1/load_lora_adapter")
    async def _load(request: Request) -> Response:
        s = get_state(request)
        body = await parse_body(request, LoadLoraAdapterRequest, s)
        if body.lora_name == s.model_name or body.lora_name in s.loras:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name",
                              code="invalid_lora_adapter")
        await engine_call(s, "load_lora_adapter", body.lora_name, body.lora_path)
        s.loras[body.lora_name] = body.lora_path
        log.info("LoRA adapter %s loaded from %s", body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @admin.post("/v1/unload_lora_adapter")
    async def _unload(request: Request) -> Response:
        s = get_state(request)
        body = await parse_body(request, UnloadLoraAdapterRequest, s)
        await engine_call(s, "unload_lora_adapter", body.lora_name)
        s.loras.pop(body.lora_name, None)
        log.info("LoRA adapter %s unloaded", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    return admin


async def _tokenize_ids(s: ServerState, body: TokenizeRequest) -> list[int]:
    """/tokenize: the prompt's ids, or the chat's as a chat request would send them (image pads expanded)."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of `prompt` or `messages`", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must not be empty", param="messages", code="invalid_value")
        messages = [message_dict(m, i) for i, m in enumerate(body.messages)]
        if rendering.has_images(body.messages):  # pads expanded exactly as a chat request would send them
            images = await prepare_images(s, body.messages, messages, body.add_generation_prompt, body.cache_salt)
            return images.prompt_token_ids
        try:
            return await s.run_sync(rendering.chat_ids, s.tokenizer, messages, body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages", code="invalid_messages") from None
    if body.add_special_tokens:
        return await s.run_sync(rendering.completion_ids, s.tokenizer, body.prompt)
    # vLLM's /tokenize flag: the raw text's ids, no special tokens added
    return await s.run_sync(s.tokenizer.encode, body.prompt, False)


def _add_probe_routes(app: FastAPI) -> None:
    """Liveness, readiness and Prometheus metrics: open, outside the API key."""

    @app.get("/health")
    async def _health(request: Request) -> Response:
        s = get_state(request)
        if s.engine is not None and not await _healthy(s.engine):
            return JSONResponse({"status": "engine unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def _ready(request: Request) -> Response:
        s = get_state(request)
        if s.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if s.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not await _healthy(s.engine):
            return JSONResponse({"status": "engine unhealthy"}, status_code=503)
        return JSONResponse({"status": "ready", "model": s.model_name})

    @app.get("/metrics")
    async def _metrics(request: Request) -> Response:
        s = get_state(request)
        stats = None
        if s.engine is not None:
            try:
                stats = await s.engine.stats()
            except Exception:  # scrape still answers with the API's own series
                log.warning("engine stats unavailable", exc_info=True)
        pc_view = await s.run_sync(s.processor_cache_view) if s.processor_cache is not None else None
        return Response(s.metrics.render(stats, pc_view), media_type=CONTENT_TYPE)


def attach_engine(app: FastAPI, engine: EngineClient, tokenizer: Any) -> None:
    """Point a running app at its engine once the model has loaded (/ready turns 200)."""
    app.state.wf.attach(engine, tokenizer)


async def _healthy(engine: EngineClient) -> bool:
    try:
        return bool(await engine.check_health())
    except Exception:
        return False


class ResponseObserver:
    """ASGI middleware: stamps every response with the replica id and its request id (the client's `x-request-id`,
    or one made here), binds that id and the `traceparent`'s trace id to the request's log records (tracing.py),
    and counts error statuses."""

    def __init__(self, app: Any, replica_id: str, state: ServerState):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        count = scope.get("path") not in _PROBES
        given = parent = None
        for name, value in scope["headers"]:
            if name == b"x-request-id" and given is None:
                given = value.decode("latin-1")
            elif name == b"traceparent" and parent is None:
                parent = value.decode("latin-1")
        rid = tracing.request_id(given)
        tracing.bind(rid, parent)
        stamp = (self.header, (b"x-request-id", rid.encode()))

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *stamp]}
                if count and message["status"] >= 400:
                    self.state.metrics.error(message["status"])
            await send(message)

        await self.app(scope, receive, send_with_header)
