"""One EPP process, started: the router core, the gRPC server (ext_proc + health; TLS unless told otherwise) and the
side HTTP port; stopped by draining (no new streams, in-flight ones finish within the grace period)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
from . import tls
from .app import build_side_app
from .service import EppDoor, ExternalProcessor

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class EppServer:
    """`async with EppServer(rt) as epp:` runs the EPP on rt.settings' ports (or the given ones; 0 = any free port).

    Readiness (and the ext_proc service's health) is SERVING while at least one replica is routable: the HTTP
    door's /ready, the same test. Leaving the block drains: every health service turns NOT_SERVING, new streams are
    refused, in-flight ones get `drain_grace_s` (--drain-grace-s) to end, then the core stops."""

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
        self.draining = False
        self._grpc: Optional[grpc.aio.Server] = None
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
        self.grpc_port = self._bind(server)
        await server.start()
        self._grpc = server
        self._stack.push_async_callback(server.stop, 0)  # after _drain (__aexit__): nothing left; on a failed start: all
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

    def _bind(self, server: grpc.aio.Server) -> int:
        s = self.rt.settings
        address = f"{self.host}:{self.grpc_port}"
        if not getattr(s, "secure_serving", False):
            return server.add_insecure_port(address)
        creds = tls.server_credentials(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file,
                                       hosts=(self.host,) if self.host not in ("0.0.0.0", "::") else ())
        return server.add_secure_port(address, creds)

    async def _drain(self, server: grpc.aio.Server) -> None:
        """SIGTERM's path: NOT_SERVING everywhere (the gateway's health checks stop sending streams here), new
        streams refused, the open ones finished (or cancelled when the grace period ends)."""
        grace = getattr(self.rt.settings, "drain_grace_s", 1.0)
        self.draining = True
        for service in ("", READINESS, EXT_PROC_SERVICE):  # liveness stays: the process is well
            await self.health.set(service, NOT_SERVING)
        log.info("draining: %d ext_proc streams open, up to %.0f s for them to finish", self.processor.open_streams,
                 grace)
        t0 = time.monotonic()
        await server.stop(grace)  # returns once every stream ended (Envoy cancels each as its request completes)
        log.info("drained in %.1f s", time.monotonic() - t0)

    async def _stop_http(self, task: asyncio.Task) -> None:
        self.http.should_exit = True
        await asyncio.gather(task, return_exceptions=True)

    async def _update_readiness(self) -> None:
        if self.draining:
            return
        status = SERVING if self.state["fleet"].routable() else NOT_SERVING
        await self.health.set(READINESS, status)
        await self.health.set(EXT_PROC_SERVICE, status)

    async def _readiness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.rt.settings.health_interval_s)
            await self._update_readiness()

    async def __aexit__(self, *exc) -> None:
        server, self._grpc = self._grpc, None  # once, however often the block is left
        try:
            if server is not None:
                await self._drain(server)  # first: the side port (/metrics) and the core serve until drained
        finally:
            await self._stack.aclose()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
