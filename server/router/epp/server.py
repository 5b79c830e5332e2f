"""One EPP process, started: the router core, the gRPC server (ext_proc + health) and the side HTTP port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import Gauge

from ..core.metrics import RouterMetrics
from ..core.runtime import RouterRuntime, running
from ..core.tenants import ConcurrencyLimiter
from .app import build_side_app
from .service import EppDoor, ExternalProcessor

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class EppServer:
    """`async with EppServer(rt) as epp:` runs the EPP on rt.settings' ports (or the given ones; 0 = any free port).

    Readiness (and the ext_proc service's health) is SERVING while at least one replica is routable: the HTTP
    door's /ready, the same test."""

    def __init__(self, rt: RouterRuntime, grpc_port: Optional[int] = None, http_port: Optional[int] = None):
        self.rt = rt
        s = rt.settings
        self.host = s.host
        self.grpc_port = s.port if grpc_port is None else grpc_port
        self.http_port = getattr(s, "http_port", 0) if http_port is None else http_port
        self.metrics = RouterMetrics()
        self.limiter = ConcurrencyLimiter(s.max_concurrent_per_client)
        self.state: dict = {}
        self.door: Optional[EppDoor] = None
        self.processor: Optional[ExternalProcessor] = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "EppServer":
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _start(self) -> None:
        router = await self._stack.enter_async_context(running(self.rt, self.metrics))
        self.state["fleet"], self.state["router"] = router.fleet, router
        self.door = EppDoor(self.rt, router, self.limiter)
        self.processor = ExternalProcessor(self.door)
        streams = Gauge("warmfleet_epp_open_streams", "ext_proc streams open (one per HTTP request in the gateway).",
                        registry=self.metrics.registry)
        streams.set_function(lambda: self.processor.open_streams)
        # a BUFFERED body (and its mutation) is one message: room for the largest body the router accepts
        limit = self.rt.settings.max_request_bytes + (1 << 20)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                          ("grpc.max_send_message_length", limit)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.grpc_port = server.add_insecure_port(f"{self.host}:{self.grpc_port}")
        await server.start()
        self._stack.push_async_callback(server.stop, 1.0)
        await self.health.set("", SERVING)
        await self.health.set(LIVENESS, SERVING)
        await self._update_readiness()
        ready_task = asyncio.create_task(self._readiness_loop())
        self._stack.push_async_callback(_cancel, ready_task)
        if self.http_port is not None:
            app = build_side_app(self.rt, self.state, self.metrics)
            # log_config=None: setup_logging (the command's) owns logging, as for `warmfleet serve`; uvicorn's own
            # config (or access_log=False) would detach its loggers from the root handler for the whole process;
            # successful probes and scrapes stay out of info-level logs (logging_setup)
            cfg = uvicorn.Config(app, host=self.host, port=self.http_port, log_config=None,
                                 lifespan="off")
            self.http = uvicorn.Server(cfg)
            self.http.install_signal_handlers = lambda: None  # the command owns the signals
            http_task = asyncio.create_task(self.http.serve())
            while not self.http.started:
                if http_task.done():
                    http_task.result()  # raises why it could not start (port taken)
                    raise RuntimeError(f"the HTTP side port {self.http_port} did not start")
                await asyncio.sleep(0.02)
            self.http_port = self.http.servers[0].sockets[0].getsockname()[1]
            self._stack.push_async_callback(self._stop_http, http_task)

    async def _stop_http(self, task: asyncio.Task) -> None:
        self.http.should_exit = True
        await asyncio.gather(task, return_exceptions=True)

    async def _update_readiness(self) -> None:
        status = SERVING if self.state["fleet"].routable() else NOT_SERVING
        await self.health.set(READINESS, status)
        await self.health.set(EXT_PROC_SERVICE, status)

    async def _readiness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.rt.settings.health_interval_s)
            await self._update_readiness()

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
