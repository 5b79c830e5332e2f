"""`warmfleet serve`: one replica — HTTP API (uvicorn) up at once, engine loaded behind it, graceful drain on SIGTERM.

The port answers /health from the first second so a slow model load is not mistaken for a
dead pod; /ready turns 200 once the engine is up and 503 again while draining. On SIGTERM
uvicorn stops accepting, in-flight requests get up to --drain-timeout-s to finish, then the
engine process is shut down.

A multimodal model gets the pod's processor cache (`--max-processor-cache` GiB > 0): one
`ProcessorCacheProcess` on a private IPC socket in a fresh temp directory, started before
/ready turns 200 and stopped at shutdown. The frontend talks to it through one reused
`ProcessorCacheClient`; if the process dies, requests are preprocessed locally until it has
been restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import prometheus_client
import uvicorn

from .. import otel
from ..attention import registry as attention_backends
from ..config import EngineConfig, add_arguments as add_config_arguments, from_namespace
from ..logging_setup import setup_logging
from .app import attach_engine, build_app
from .deadlines import deadline_protocol
from .spans import RequestSpans

log = logging.getLogger("warmfleet.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    group = parser.add_argument_group("serve")
    group.add_argument("--drain-timeout-s", dest="serve.drain_timeout_s", type=float, default=30.0,
                       help="On SIGTERM, seconds in-flight requests get to finish before they are cancelled "
                            "(keep below the pod's terminationGracePeriodSeconds). (default: 30.0)")
    group.add_argument("--log-format", dest="serve.log_format", choices=("json", "text"), default=None,
                       help="json: one JSON object per line; text: key=value lines. (default: json)")


def run(args: argparse.Namespace) -> int:
    cfg = from_namespace(args)
    attention_backends.check(cfg.model.attention_backend)
    if not cfg.model.model:
        raise ValueError("--model is required (a Hugging Face checkpoint directory)")
    if not Path(cfg.model.model).is_dir():
        raise FileNotFoundError(f"--model {cfg.model.model}: no such directory")
    drain_timeout_s = getattr(args, "serve.drain_timeout_s", 30.0)
    if drain_timeout_s < 0:
        raise ValueError(f"--drain-timeout-s must be >= 0, got {drain_timeout_s}")
    spans = otel.start("warmfleet-server", cfg.server.otlp_traces_endpoint)  # TracingUnavailable: one line, exit 2
    setup_logging(cfg.server.log_level, getattr(args, "serve.log_format", None))
    try:
        return asyncio.run(serve(cfg, drain_timeout_s, spans))
    finally:
        if spans is not None:
            spans.shutdown()  # the last batch of spans leaves before the process does


async def serve(cfg: EngineConfig, drain_timeout_s: float = 30.0, spans: Optional[otel.Spans] = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (1 if the engine could not start). `spans`: a span per
    API request (otel.py), None: none."""
    # NOTE: importing the engine client pulls in paddle, which installs its own SIGTERM handler; import it
    # before uvicorn installs the graceful-shutdown handler, so uvicorn's wins.
    from ..engine.async_engine import AsyncEngine  # noqa: F401

    prometheus_client.disable_created_metrics()
    app = build_app(None, None, cfg)
    if spans is not None:  # outermost: the span sees the request id and status the replica answers with
        app.add_middleware(RequestSpans, spans=spans, replica_id=app.state.wf.replica_id)
    server = _Server(uvicorn_config(app, cfg, drain_timeout_s), app)
    log.info("starting replica", extra={"fields": {"replica_id": app.state.wf.replica_id, "host": cfg.server.host,
                                                     "port": cfg.server.port, "model": cfg.model.model}})
    loader = asyncio.create_task(server.load_engine(cfg))
    try:
        await server.serve()
    finally:
        if not loader.done():
            loader.cancel()
        await asyncio.gather(loader, return_exceptions=True)
        await server.stop_engine()
    return 1 if server.failed else 0


def uvicorn_config(app: Any, cfg: EngineConfig, drain_timeout_s: float = 30.0) -> uvicorn.Config:
    """How a replica's HTTP server runs: its address, drain time and read deadlines (api/deadlines.py)."""
    http = deadline_protocol(cfg.server.request_header_timeout_s, cfg.server.request_body_timeout_s)
    return uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, http=http, log_config=None,
                          lifespan="off", timeout_graceful_shutdown=drain_timeout_s, log_level=cfg.server.log_level)


class _Server(uvicorn.Server):
    """uvicorn.Server plus the engine's lifecycle around it."""

    def __init__(self, config: uvicorn.Config, app: Any):
        super().__init__(config)
        self.app = app
        self.engine: Any = None
        self.failed = False
        self.processor_cache: Any = None  # ProcessorCacheProcess, multimodal models only
        self._processor_cache_dir: Optional[str] = None

    async def load_engine(self, cfg: EngineConfig) -> None:
        """Load tokenizer and engine, then attach them (/ready → 200); on failure stop the server."""
        from ..engine.async_engine import AsyncEngine
        from ..tokenizer import Tokenizer

        t0 = time.perf_counter()
        try:
            tokenizer = await asyncio.to_thread(Tokenizer, cfg.model.model)
            self.engine = await AsyncEngine.start(cfg)
        except Exception as exc:
            log.error("engine failed to start: %s", exc, exc_info=True)
            self.failed = True
            self.should_exit = True
            return
        info = self.engine.model_info
        if getattr(info, "is_multimodal", False) and cfg.cache.max_processor_cache > 0:
            try:
                await self.start_processor_cache(cfg.cache.max_processor_cache)
            except Exception as exc:  # images still work, each frontend preprocesses them itself
                log.error("processor cache failed to start: %s", exc, exc_info=True)
        attach_engine(self.app, self.engine, tokenizer)
        log.info("ready", extra={"fields": {"model": info.served_model_name, "max_model_len": info.max_model_len,
                                            "load_s": round(time.perf_counter() - t0, 3)}})

    async def start_processor_cache(self, gib: float) -> None:
        """Start the pod's processor-cache process on a private IPC socket and connect the frontend to it."""
        from ..multimodal.processor_cache import ProcessorCacheProcess

        self._processor_cache_dir = tempfile.mkdtemp(prefix="warmfleet-pc-")
        address = f"ipc://{self._processor_cache_dir}/cache.sock"
        self.processor_cache = ProcessorCacheProcess.from_gib(address, gib)
        await asyncio.to_thread(self.processor_cache.start)
        state = self.app.state.wf
        state.connect_processor_cache(address)
        state.processor_cache_process = self.processor_cache
        up = False
        for _ in range(30):  # the spawned process imports numpy, zmq, Pillow; short pings keep shutdown prompt
            up = await asyncio.to_thread(state.processor_cache.ping, 1.0)
            if up:
                break
        fields = {"address": address, "pid": self.processor_cache.process.pid, "capacity_gib": gib, "up": up}
        if up:
            log.info("processor cache started", extra={"fields": fields})
        else:
            log.warning("processor cache not answering yet; preprocessing locally until it does", extra={"fields": fields})

    async def stop_processor_cache(self) -> None:
        proc, self.processor_cache = self.processor_cache, None
        self.app.state.wf.close()
        if proc is not None:
            await asyncio.to_thread(proc.stop)
            log.info("processor cache stopped")
        path, self._processor_cache_dir = self._processor_cache_dir, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        self.app.state.wf.draining = True
        log.info("draining", extra={"fields": {"timeout_s": self.config.timeout_graceful_shutdown}})
        await super().shutdown(sockets)
        await self.stop_engine()  # before uvicorn re-raises the captured signal

    async def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.shutdown()
            log.info("engine stopped")
        await self.stop_processor_cache()
