"""A router in front of fake replicas, all in-process on loopback: the fake replica (scripted answers, real
KV events over ZeroMQ), Served (an ASGI app on a real port), Fleet2 (two fakes behind a router) and chat bodies.
Shared by the router's proxy, peers and fast-path tests."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Optional

import httpx
import uvicorn
import zmq
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from waiting import until
from warmfleet.server.events import BlockStored, EventBatch, Snapshot, encode
from warmfleet.server.hashing import block_hashes, model_fingerprint
from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
from warmfleet.server.router.core.registry import ReplicaSpec
from warmfleet.server.router.core.runtime import RouterRuntime
from warmfleet.server.router.core.settings import RouterSettings
from warmfleet.server.router.core.tenants import Tenants
from warmfleet.server.router.http.app import build_app
from warmfleet.server.router.http.hotpath import hot_protocol
from warmfleet.server.tokenizer import Tokenizer

BLOCK = 16
SYSTEM = "You are a meticulous assistant for the warmfleet project. " * 8


class Served:
    """A uvicorn server for an app on a free loopback port, in the test's event loop."""

    def __init__(self, app, http: object = "auto"):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # no log_config or log_level: uvicorn would detach its loggers from the root (or set their level) for the rest
        # of the session
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_config=None, http=http))
        self.task: Optional[asyncio.Task] = None

    async def start(self) -> "Served":
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await until(lambda: self.server.started, "server start")
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True
        await self.task


class FakeSharedFailures:
    """How many more requests, across all replicas sharing it, should fail (and how)."""

    def __init__(self, n: int = 0, mode: str = "ok"):
        self.n, self.mode = n, mode

    def take(self) -> str:
        if self.n > 0:
            self.n -= 1
            return self.mode
        return "ok"


class FakeReplica:
    """Replica double: tokenizes like a replica, keeps a block set, publishes real KV events (events.encode).

    Failure modes per request: "503", "400", "wait" (holds until `release`, counting a client that leaves),
    "reset" (headers, then the connection drops before any byte),
    "break" (two SSE events, then the connection drops), "hold" (waits for `release`), "prefill" (waits
    for `release` before its first byte, as a replica computing the prompt).
    """

    def __init__(self, name: str, tokenizer: Tokenizer, fingerprint: str, failures: FakeSharedFailures):
        self.name, self.tok, self.fp, self.failures = name, tokenizer, fingerprint, failures
        self.gpu: list[bytes] = []
        self.seq = 0
        self.received: list[dict] = []
        self.client_left = 0  # requests in mode "wait" whose client (the router) went away before the answer
        self.headers_seen: list[dict] = []  # the headers of each generate request (trace context, request id)
        self.running = self.waiting = 0  # load figures its /metrics reports
        self.gate: Optional[asyncio.Event] = None  # when set, every request waits for it
        self.health_script: list[str] = []  # answers for the next health checks: "slow" (past the timeout) or "503"
        self.ready = True  # False: listening but still loading its model (/health 200, /ready 503), as after a restart
        self.release = asyncio.Event()
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        eport = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.events = f"tcp://127.0.0.1:{eport}"
        self.app = self._build()

    def publish(self, events: list, seq: Optional[int] = None) -> None:
        self.seq = self.seq + 1 if seq is None else seq
        self.pub.send_multipart(encode(EventBatch(self.name, self.seq, events)))

    def _prompt_ids(self, body: dict) -> list[int]:
        if "messages" in body:
            text = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True)
            return self.tok.encode(text, add_special_tokens=False)
        if isinstance(body["prompt"], list):
            return list(body["prompt"])
        return self.tok.encode(body["prompt"], add_special_tokens=True)

    def _serve(self, body: dict) -> int:
        """Prefix-cache bookkeeping of one request; returns cached tokens."""
        ids = self._prompt_ids(body)
        hashes = block_hashes(ids, [], BLOCK, self.fp, body.get("cache_salt"))
        hit = 0
        for h in hashes:
            if h not in self.gpu:
                break
            hit += 1
        cached = min(hit * BLOCK, (len(ids) - 1) // BLOCK * BLOCK)
        new = [h for h in hashes if h not in self.gpu]
        if new:
            self.gpu.extend(new)
            self.publish([BlockStored(new, None, [], BLOCK)])
        return cached

    def _build(self) -> FastAPI:
        app = FastAPI()
        headers = {"x-warmfleet-replica": self.name}

        @app.get("/health")
        async def health():
            mode = self.health_script.pop(0) if self.health_script else "ok"
            if mode == "slow":
                await asyncio.sleep(1.0)  # past the router's 0.5 s health timeout
            return Response(status_code=503 if mode == "503" else 200)

        @app.get("/ready")
        async def ready():
            if not self.ready:
                return JSONResponse({"status": "loading"}, status_code=503)
            return await health()

        @app.get("/metrics")
        async def metrics():  # FastDeploy's load gauges (read by the router only for --engine fastdeploy)
            text = (f"# TYPE fastdeploy:num_requests_running gauge\nfastdeploy:num_requests_running {self.running}\n"
                    f"# TYPE fastdeploy:num_requests_waiting gauge\nfastdeploy:num_requests_waiting {self.waiting}\n")
            return Response(text, media_type="text/plain")

        @app.get("/v1/kv/snapshot")
        async def snapshot():
            return JSONResponse(Snapshot(self.name, self.seq, BLOCK, self.fp, list(self.gpu), [], []).to_json())

        async def generate(request: Request):
            body = await request.json()
            self.received.append(body)
            self.headers_seen.append(dict(request.headers))
            if self.gate is not None:
                await self.gate.wait()
            mode = self.failures.take()
            if mode == "wait":  # a long generation: answers only when `release` is set; notes a client leaving
                left = asyncio.ensure_future(request.receive())  # the body is read: the next message is a disconnect
                await asyncio.wait({left, asyncio.ensure_future(self.release.wait())},
                                   return_when=asyncio.FIRST_COMPLETED)
                if left.done() and left.result()["type"] == "http.disconnect":
                    self.client_left += 1
                    return Response(status_code=499)
                left.cancel()
            if mode in ("503", "400"):
                return JSONResponse({"error": {"message": "busy" if mode == "503" else "bad"}}, status_code=int(mode),
                                    headers=headers)
            cached = self._serve(body)
            usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            if mode == "reset":  # status line and headers go out, then the connection drops
                async def reset():
                    raise ConnectionResetError("fake reset before the first byte")
                    yield b""

                return StreamingResponse(reset(), media_type="application/json", headers=headers)
            if not body.get("stream"):
                return JSONResponse({"id": "x", "choices": [{"index": 0, "text": "hi"}], "usage": usage},
                                    headers=headers)

            async def events():
                if mode == "prefill":
                    await self.release.wait()
                for word in ("hello", "world"):
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': word}]})}\n\n".encode()
                if mode == "break":
                    raise ConnectionResetError("fake break mid-stream")
                if mode == "hold":
                    await self.release.wait()
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

        @app.post("/tokenize")
        async def tokenize(request: Request):
            self.headers_seen.append(dict(request.headers))
            return JSONResponse({"tokens": [1]}, headers={**headers, "x-request-id": request.headers.get("x-request-id",
                                                                                                        "")})

        app.post("/v1/chat/completions")(generate)
        app.post("/v1/completions")(generate)
        return app

    def close(self) -> None:
        self.pub.close(0)


class Fleet2:
    """Two fake replicas behind a router, all on loopback; the router served as `warmfleet route` serves it
    (`protocol="hot"`: http/hotpath.py) or by uvicorn's own protocol ("asgi": every route through the ASGI app)."""

    def __init__(self, model_dir, *, failures: Optional[FakeSharedFailures] = None, tenants: Optional[Tenants] = None,
                 health_interval_s: float = 0.1, max_concurrent_per_client: int = 0, engine: str = "warmfleet",
                 predicted_capacity_blocks: int = 16_384, protocol: str = "hot", num_replicas: int = 2,
                 events: bool = True, **settings):
        self.protocol, self.settings = protocol, settings  # settings: more RouterSettings fields
        self.tok = Tokenizer(model_dir)
        self.fp = model_fingerprint(model_dir)
        self.failures = failures or FakeSharedFailures()
        self.replicas = [FakeReplica(f"r{i}", self.tok, self.fp, self.failures) for i in range(num_replicas)]
        self.model_dir = model_dir
        self.tenants = tenants or Tenants({})
        self.health_interval_s = health_interval_s
        self.max_concurrent_per_client = max_concurrent_per_client
        self.engine, self.predicted_capacity_blocks = engine, predicted_capacity_blocks
        self.events = events and engine != "fastdeploy"  # False: replicas without a KV-event socket (health only)

    async def __aenter__(self) -> "Fleet2":
        self.served = [await Served(r.app).start() for r in self.replicas]
        self.by_url = {s.url: r for s, r in zip(self.served, self.replicas)}
        runtime = RouterRuntime(
            hash_cfg=HashConfig(BLOCK, self.fp),
            replicas=[ReplicaSpec(s.url, r.events) if self.events else
                      ReplicaSpec(s.url, metrics=s.url if self.engine == "fastdeploy" else None)
                      for s, r in zip(self.served, self.replicas)],
            renderer=PromptRenderer(str(self.model_dir), tokenizer=self.tok),
            tenants=self.tenants,
            settings=RouterSettings(health_interval_s=self.health_interval_s, health_timeout_s=0.5,
                                    max_concurrent_per_client=self.max_concurrent_per_client, engine=self.engine,
                                    predicted_capacity_blocks=self.predicted_capacity_blocks, **self.settings),
        )
        self.app = build_app(runtime)
        s = self.app.state.settings
        http = (hot_protocol(self.app.frontend, s.request_header_timeout_s, s.request_body_timeout_s)
                if self.protocol == "hot" else "auto")
        self.router = await Served(self.app, http).start()
        self.fleet = self.app.state.fleet
        if not self.events:  # no events: nothing to sync
            await until(lambda: all(r.healthy for r in self.fleet.registry.replicas.values()), "health checks")
        else:
            await until(lambda: synced(self.fleet.index, [s.url for s in self.served]), "initial resync")
        self.client = httpx.AsyncClient(base_url=self.router.url, timeout=10)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self.router.stop()
        for s in self.served:
            if not s.task.done():
                await s.stop()
        for r in self.replicas:
            r.close()

    def url_of(self, name: str) -> str:
        return next(u for u, r in self.by_url.items() if r.name == name)

    def metric(self, name: str, **labels) -> float:
        v = self.app.state.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v


def synced(index, urls) -> bool:
    """Whether the router's KV index has a snapshot of every replica at `urls` (its initial resync is done)."""
    return all(index.replicas.get(u) is not None and index.replicas[u].synced for u in urls)


def chat(question: str, tenant: Optional[int] = None, **extra) -> dict:
    system = SYSTEM if tenant is None else f"Tenant {tenant}. " + SYSTEM
    return {"model": "tiny", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": question}], **extra}


def static_router(model_dir, urls: list[str], block_size: int = BLOCK, policy=None):
    """A Router over healthy static members at `urls` (no sockets, no events, no adapter scrapes): decide() only."""
    from warmfleet.server.router.core.fleet import Fleet
    from warmfleet.server.router.core.metrics import RouterMetrics
    from warmfleet.server.router.core.router import Router

    fleet = Fleet(httpx.AsyncClient(), RouterMetrics(), adapter_poll_s=None)
    fleet.registry.set_members([ReplicaSpec(u) for u in urls])
    for r in fleet.registry.replicas.values():
        r.healthy = True
    extra = {"policy": policy} if policy is not None else {}
    return Router(fleet, PromptRenderer(str(model_dir)), HashConfig(block_size, "fp"), RouterMetrics(), **extra)
