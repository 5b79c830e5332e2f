"""AsyncEngine: the API process's handle on the engine-core process (EngineClient over ZMQ IPC)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import json
import shutil
import subprocess
import sys
import tempfile
from typing import AsyncIterator, Optional

import zmq
import zmq.asyncio

from ..config import EngineConfig
from . import serde
from .core_proc import config_to_dict
from .protocol import EngineStats, GenerateRequest, ModelInfo, read_model_info
from .request import RequestOutput

log = logging.getLogger("warmfleet.engine")

CALL_TIMEOUT_S = 10.0
SHUTDOWN_SEND_TIMEOUT_S = 1.0


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, model_info: ModelInfo):
        self.cfg = cfg
        self.model_info = model_info
        self._dir = tempfile.mkdtemp(prefix="warmfleet-engine-")
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(f"ipc://{self._dir}/in")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._dir}/out")
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[asyncio.Task] = None
        self._watchdog: Optional[asyncio.Task] = None
        self._ready = asyncio.get_running_loop().create_future()
        self.dead: Optional[str] = None
        self._closing = False
        self._adds: list = []  # this event-loop tick's new requests, sent as one "adds" message (`_add`)
        self._adds_sent: Optional[asyncio.Future] = None
        self._flushes: set[asyncio.Task] = set()

    @classmethod
    async def start(cls, cfg: EngineConfig, ready_timeout_s: float = 600.0) -> "AsyncEngine":
        """Spawn the engine-core process and wait until its model is loaded."""
        self = cls(cfg, read_model_info(cfg))
        # A fresh interpreter with -P (no cwd on sys.path: the repo's operator/ would shadow the stdlib).
        self._proc = subprocess.Popen([
            sys.executable, "-P", "-m", "warmfleet.server.engine.core_proc",
            json.dumps(config_to_dict(cfg)), f"ipc://{self._dir}/in", f"ipc://{self._dir}/out",
        ])
        self._reader = asyncio.create_task(self._read_loop())
        self._watchdog = asyncio.create_task(self._watch_process())
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), ready_timeout_s)
        except asyncio.TimeoutError:
            await self.shutdown()
            raise RuntimeError(f"engine did not become ready within {ready_timeout_s:.0f}s") from None
        except Exception:
            await self.shutdown()
            raise
        return self

    # ---- plumbing -------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            try:
                kind, payload = serde.unpackb(await self._out.recv())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("dropping malformed engine output: %s", exc)
                continue
            if kind == "outputs":
                for w in payload:
                    o = serde.output_from_wire(w)
                    q = self._queues.get(o.request_id)
                    if q is not None:
                        q.put_nowait(o)
            elif kind == "reply":
                fut = self._calls.pop(payload[0], None)
                if fut is not None and not fut.done():
                    fut.set_result(payload[1])
            elif kind == "ready":
                if not self._ready.done():
                    self._ready.set_result(True)
            elif kind == "fatal":
                self._fail(f"engine failed to start: {payload}")

    async def _watch_process(self) -> None:
        while self._proc is not None and self._proc.poll() is None:
            await asyncio.sleep(0.2)
        if self._proc is not None and not self._closing:
            self._fail(f"engine process exited with code {self._proc.returncode}")

    def _fail(self, message: str) -> None:
        if self.dead is None:
            self.dead = message
            log.error("%s; the replica is unhealthy and should be restarted", message)
        if not self._ready.done():
            self._ready.set_exception(EngineDeadError(message))
        for rid, q in self._queues.items():
            q.put_nowait(RequestOutput(rid, [], True, "abort", error=message))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))

    async def _send(self, kind: str, payload) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        await self._in.send(serde.packb([kind, payload]))

    async def _add(self, wire) -> None:
        """Send a new request together with every other one added in this event-loop tick.

        The choices of a multi-prompt request start as separate tasks; sent one message each, the engine
        core began stepping on the first few and split the batch over extra steps (docs/performance.md).
        """
        if self.dead:
            raise EngineDeadError(self.dead)
        if not self._adds:
            loop = asyncio.get_running_loop()
            self._adds_sent = loop.create_future()
            loop.call_soon(self._flush_adds)
        self._adds.append(wire)
        await asyncio.shield(self._adds_sent)  # one waiter cancelled must not cancel its batch-mates' send

    def _flush_adds(self) -> None:
        batch, sent = self._adds, self._adds_sent
        self._adds = []

        async def send() -> None:
            try:
                await self._send("adds", batch)
            except BaseException as exc:
                sent.set_exception(exc)
                sent.exception()  # retrieved here: every waiter may have gone
            else:
                sent.set_result(None)

        task = asyncio.ensure_future(send())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _call(self, method: str, args: Optional[list] = None):
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        await self._send("call", [call_id, method] + ([args] if args is not None else []))
        try:
            return await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    # ---- EngineClient -----------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        if req.request_id in self._queues:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self._queues[req.request_id] = q
        finished = False
        wire = serde.request_to_wire(req)
        try:
            await self._add(wire)
            while True:
                out: RequestOutput = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if any(w is wire for w in self._adds):  # cancelled before its batch left: it never reaches the engine
                self._adds = [w for w in self._adds if w is not wire]
            elif not finished and not self.dead:  # client went away or the consumer stopped early
                try:
                    await self._send("abort", [req.request_id])
                except Exception:
                    pass

    async def abort(self, request_id: str) -> None:
        await self._send("abort", [request_id])

    async def stats(self) -> EngineStats:
        return EngineStats(**await self._call("stats"))

    async def snapshot(self) -> dict:
        return await self._call("snapshot")

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """{"name", "path", "digest"}, or {"error", "status"} when the engine refuses the adapter."""
        return await self._call("load_lora", [name, path])

    async def unload_lora_adapter(self, name: str) -> dict:
        """{} or {"error", "status"}."""
        return await self._call("unload_lora", [name])


    async def check_health(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.poll() is None

    async def shutdown(self) -> None:
        self._closing = True
        if self._proc is not None and self._proc.poll() is None:
            try:  # a PUSH send waits while no reader is connected: an engine exiting on its own has none
                await asyncio.wait_for(self._in.send(serde.packb(["shutdown", None])), SHUTDOWN_SEND_TIMEOUT_S)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 5)
            except Exception:
                self._proc.kill()
        for t in (self._reader, self._watchdog):
            if t is not None:
                t.cancel()
        self._in.close(0)
        self._out.close(0)
        shutil.rmtree(self._dir, ignore_errors=True)
