"""Engine-core process: runs EngineCore's step loop behind two ZMQ IPC sockets (msgpack, no pickle).

    API process  --PUSH "in"-->   engine core   ("adds", [req, ...]) ("abort", [ids]) ("call", [id, method])
    API process  <--PUSH "out"--  engine core   ("outputs", [...]) ("reply", [id, result]) ("ready", info)
                                                ("fatal", message)
One "adds" message carries the requests the API process added in one event-loop tick (a
multi-prompt request's choices start together); one "outputs" message every request's output of one step. The step loop never waits on
HTTP; it blocks on the input socket only when it has no work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time

LOAD_PUBLISH_INTERVAL_S = 0.25
IDLE_POLL_MS = 100  # how long an idle engine waits for input before checking on its parent again

log = logging.getLogger("warmfleet.engine")


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict):
    from ..config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig, ServerConfig

    return EngineConfig(ModelConfig(**d["model"]), CacheConfig(**d["cache"]), SchedulerConfig(**d["scheduler"]),
                        ServerConfig(**d["server"]), LoraConfig(**d.get("lora", {})))


def run_engine_core(cfg_dict: dict, in_addr: str, out_addr: str) -> None:
    """Process entry point: `python -P -m warmfleet.server.engine.core_proc CONFIG_JSON IN_ADDR OUT_ADDR`."""
    from ..logging_setup import setup_logging

    parent = os.getppid()  # before the model loads: an API process that dies meanwhile must still be noticed
    cfg = config_from_dict(cfg_dict)
    setup_logging(cfg.server.log_level)
    link = Link(in_addr, out_addr)
    try:
        cpus = pin_engine_cpus(cfg.model.engine_cpus)
        leave_signals_to_api_process()
        core = start_core(cfg)
    except Exception as exc:  # report why, then exit: the API process turns it into one log line
        log.exception("engine failed to start")
        link.send("fatal", f"{type(exc).__name__}: {exc}")
        link.close()
        sys.exit(1)
    link.send("ready", {"pid": os.getpid(), "cpus": cpus})
    step_loop(core, link, parent)


class Link:
    """The engine core's two sockets to the API process: PULL for requests, PUSH for outputs and replies."""

    def __init__(self, in_addr: str, out_addr: str):
        import zmq

        from . import serde

        self._serde = serde
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._in.connect(in_addr)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 2000)
        self._out.connect(out_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._in, zmq.POLLIN)

    def send(self, kind: str, payload) -> None:
        self._out.send(self._serde.packb([kind, payload]))

    def send_outputs(self, outputs: list) -> None:
        """One message for a whole step's outputs."""
        self.send("outputs", [self._serde.output_to_wire(o) for o in outputs])

    def receive(self, timeout_ms: int):
        """Each (kind, payload) waiting, the first after up to `timeout_ms`; malformed messages are dropped."""
        while self._poller.poll(timeout_ms):
            timeout_ms = 0
            try:
                kind, payload = self._serde.unpackb(self._in.recv())
            except Exception as exc:  # one bad message never stops the engine
                log.warning("dropping malformed engine message: %s", exc)
                continue
            yield kind, payload

    def close(self) -> None:
        self._in.close(0)
        self._out.close()


def pin_engine_cpus(spec) -> list[int] | None:
    """Run every thread of this process (and the ones it starts later) on --engine-cpus; None: not pinned.

    Called before Paddle starts its threads; the ZMQ I/O thread, already running, is moved too.
    """
    if spec is None:
        return None
    from ..config import parse_cpu_list

    cpus = parse_cpu_list(spec)
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
    except OSError as exc:
        raise ValueError(f"--engine-cpus {spec}: cannot run on those CPUs ({exc}); this process may use "
                         f"{sorted(os.sched_getaffinity(0))}") from None
    log.info("engine core pinned to CPUs %s", sorted(cpus))
    return sorted(cpus)


def leave_signals_to_api_process() -> None:
    """Paddle's own handler turns SIGTERM into a C++ "FatalError" dump. A signal sent to the whole process
    group (Ctrl-C, `timeout`, a closing terminal) should instead leave shutdown to the API process, which
    stops this one; the orphan check in `step_loop` covers an API process that died."""
    import paddle

    paddle.disable_signal_handler()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_core(cfg):
    """EngineCore with its KV-event publisher (when --kv-events-port is set)."""
    from ..config import replica_id
    from ..events import EventPublisher
    from .core import EngineCore

    publisher = None
    if cfg.server.kv_events_port is not None:
        publisher = EventPublisher(replica_id(cfg.server), f"tcp://{cfg.server.kv_events_host}:{cfg.server.kv_events_port}",
                                   token_ids=cfg.server.kv_events_token_ids,
                                   curve_secret_key_file=cfg.server.kv_events_curve_secret_key,
                                   curve_clients_dir=cfg.server.kv_events_curve_clients)
    return EngineCore(cfg, publisher)


def step_loop(core, link: Link, parent: int | None = None) -> None:
    """Take what the API process sent, run one step, send its outputs; until shutdown or the parent is gone.

    `parent`: the API process's pid as seen when this process started (default: now); an API process
    killed while the model loaded has already been replaced by init here, and would never be missed.
    """
    last_load = 0.0
    parent = os.getppid() if parent is None else parent
    while True:
        if os.getppid() != parent:  # the API process is gone: never linger as an orphan holding memory
            log.warning("API process exited; engine core stopping")
            return
        for kind, payload in link.receive(0 if core.has_work else IDLE_POLL_MS):
            if kind == "shutdown":
                return
            try:
                handle(core, link, kind, payload)
            except Exception as exc:  # a message that does not decode as its kind never stops the engine
                log.warning("dropping engine message %r: %s: %s", kind, type(exc).__name__, exc)
        if core.has_work:
            outputs = core.step()
            if outputs:
                link.send_outputs(outputs)
        now = time.monotonic()
        if now - last_load > LOAD_PUBLISH_INTERVAL_S:
            core.publish_load()
            last_load = now


def handle(core, link: Link, kind: str, payload) -> None:
    """One message from the API process: add a request, abort some, or answer a call."""
    from . import serde

    if kind == "adds":
        for wire in payload:
            try:
                req = serde.request_from_wire(wire)
            except Exception as exc:  # one malformed request does not drop the others of its message
                log.warning("dropping malformed engine request: %s: %s", type(exc).__name__, exc)
                continue
            try:
                core.add_request(req)
            except ValueError as exc:
                link.send_outputs([_failed(req.request_id, str(exc))])
            except Exception as exc:  # the request fails, not the engine
                log.exception("request %s could not be added", req.request_id)
                link.send_outputs([_failed(req.request_id, f"{type(exc).__name__}: {exc}")])
    elif kind == "abort":
        core.abort(payload)
    elif kind == "call":
        call_id, method, *args = payload
        link.send("reply", [call_id, _call(core, method, args[0] if args else [])])
    else:
        log.warning("dropping engine message of unknown kind %r", kind)


def _failed(request_id: str, message: str):
    from .request import RequestOutput

    return RequestOutput(request_id, [], True, "abort", error=message)


def _call(core, method: str, args: list):
    if method == "stats":
        return dataclasses.asdict(core.stats())
    if method == "snapshot":
        return core.snapshot().to_json()
    if method == "load_lora":
        try:
            return core.load_adapter(str(args[0]), str(args[1]))
        except (ValueError, OSError) as exc:
            return {"error": str(exc), "status": 400}
        except Exception as exc:  # e.g. a safetensors file that does not parse: the adapter is refused, not the call
            return {"error": f"cannot read the LoRA adapter at {args[1]}: {type(exc).__name__}: {exc}", "status": 400}
    if method == "unload_lora":
        try:
            core.unload_adapter(str(args[0]))
        except KeyError:
            return {"error": f"The lora adapter '{args[0]}' cannot be found.", "status": 404}
        return {}
    return {"error": f"unknown method {method}"}


if __name__ == "__main__":
    import json

    run_engine_core(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
