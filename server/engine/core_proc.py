"""Engine-core process: runs EngineCore's step loop behind two ZMQ IPC sockets (msgpack, no pickle).

    API process  --PUSH "in"-->   engine core   ("add", req) ("abort", [ids]) ("call", [id, method])
    API process  <--PUSH "out"--  engine core   ("outputs", [...]) ("reply", [id, result]) ("ready", info)
                                                ("fatal", message)
The step loop never waits on HTTP; it blocks on the input socket only when it has no work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time

LOAD_PUBLISH_INTERVAL_S = 0.25


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict):
    from ..config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

    return EngineConfig(ModelConfig(**d["model"]), CacheConfig(**d["cache"]), SchedulerConfig(**d["scheduler"]),
                        ServerConfig(**d["server"]))


def run_engine_core(cfg_dict: dict, in_addr: str, out_addr: str) -> None:
    """Process entry point: `python -P -m warmfleet.server.engine.core_proc CONFIG_JSON IN_ADDR OUT_ADDR`."""
    import zmq

    from ..config import replica_id
    from ..events import EventPublisher
    from . import serde
    from .core import EngineCore

    from ..logging_setup import setup_logging

    # Paddle's own handler turns SIGTERM into a C++ "FatalError" dump. A signal sent to the whole
    # process group (Ctrl-C, `timeout`, a closing terminal) should instead leave shutdown to the API
    # process, which stops this one; the orphan check below covers an API process that died.
    import paddle

    paddle.disable_signal_handler()
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    cfg = config_from_dict(cfg_dict)
    setup_logging(cfg.server.log_level)
    log = logging.getLogger("warmfleet.engine")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(out_addr)

    def send(kind: str, payload) -> None:
        out.send(serde.packb([kind, payload]))

    try:
        publisher = None
        if cfg.server.kv_events_port is not None:
            publisher = EventPublisher(replica_id(cfg.server), f"tcp://{cfg.server.kv_events_host}:{cfg.server.kv_events_port}")
        core = EngineCore(cfg, publisher)
    except Exception as exc:  # report why, then exit: the API process turns it into one log line
        log.exception("engine failed to start")
        send("fatal", f"{type(exc).__name__}: {exc}")
        out.close()
        sys.exit(1)
    send("ready", {"pid": os.getpid()})

    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    last_load = 0.0
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the API process is gone: never linger as an orphan holding memory
            log.warning("API process exited; engine core stopping")
            return
        timeout_ms = 0 if core.has_work else 100
        while poller.poll(timeout_ms):
            timeout_ms = 0
            try:
                kind, payload = serde.unpackb(inp.recv())
            except Exception as exc:  # one bad message never stops the engine
                log.warning("dropping malformed engine message: %s", exc)
                continue
            if kind == "add":
                req = serde.request_from_wire(payload)
                try:
                    core.add_request(req)
                except ValueError as exc:
                    send("outputs", [serde.output_to_wire(_failed(req.request_id, str(exc)))])
            elif kind == "abort":
                core.abort(payload)
            elif kind == "call":
                call_id, method = payload
                send("reply", [call_id, _call(core, method)])
            elif kind == "shutdown":
                return
        if core.has_work:
            outputs = core.step()
            if outputs:
                send("outputs", [serde.output_to_wire(o) for o in outputs])
        now = time.monotonic()
        if now - last_load > LOAD_PUBLISH_INTERVAL_S:
            core.publish_load()
            last_load = now


def _failed(request_id: str, message: str):
    from .request import RequestOutput

    return RequestOutput(request_id, [], True, "abort", error=message)


def _call(core, method: str):
    if method == "stats":
        return dataclasses.asdict(core.stats())
    if method == "snapshot":
        return core.snapshot().to_json()
    return {"error": f"unknown method {method}"}


if __name__ == "__main__":
    import json

    run_engine_core(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
