"""A fleet of simulated replicas in one process, for benchmarks and tests (not a serving mode).

    python -P bench/simfleet.py --model DIR --replicas 64 [--block-size 16] [--gpu-blocks 1024]
                                [--cpu-blocks 0] [--time-model calibrated|h200|zero|FILE.json] [--ready-file PATH]
                                [--spares 0] [--replicas-per-node 8 --node-tier-blocks M]

Each simulated replica speaks the HTTP surface of `warmfleet serve` that a router uses
(POST /v1/completions and /v1/chat/completions, with SSE streaming and
`usage.prompt_tokens_details.cached_tokens`; GET /health, /ready, /v1/models, /v1/kv/snapshot;
POST /tokenize in vLLM's shape) and publishes the same KV events on its own ZMQ PUB socket
(`server/events.EventPublisher`). So the router under test is the real `warmfleet route`,
unchanged, and peer routers see an ordinary OpenAI backend.

What is real and what is modelled:

* real: the engine's own scheduler, KV cache manager and block pool (`server/engine/scheduler.py`,
  `kv_cache_manager.py`, `block_pool.py`): contract-1 block hashes (`server/hashing.block_hashes`),
  prefix lookup capped at the last prompt token, paged LRU eviction of free hashed blocks, the
  CPU swap tier with its own LRU, chunked prefill under `max_num_batched_tokens`, preemption,
  and the events those produce, byte for byte the engine's. Only the model runner is replaced.
* modelled: the time a step takes (`TimeModel`): a fixed cost per step, a cost per prefilled
  (uncached) token, a cost per decoding sequence (batch-dependent decode), a cost per block copied
  between tiers. Queueing is the scheduler's own (waiting queue, token budget, max_num_seqs).
  Constants come from the real engine (`calibrate`, from bench/prefix_cache.py's figures);
  `--time-model zero` answers as fast as the process can (router throughput tests).
* sampled tokens are deterministic pseudo-random ids; text is one word per token.
* the node tier (`--node-tier-blocks M`, bench/simfleet_node.py): one host-memory LRU of M blocks per node of
  `--replicas-per-node` replicas, taking the place of the per-replica swap tier; its hits and copies are priced
  like swaps. Time models: `calibrated` (this machine's CPU engine), `h200` (bench/sim_h200.json).

One asyncio (uvloop) process serves every replica: one listening socket per replica on a small
HTTP/1.1 server over httptools (keep-alive, chunked SSE, headers sent with the first token as
`warmfleet serve` does), and a control port (`GET /sim/stats`, `GET /sim/log`) for the bench.
A replica's step loop runs only while it has work, so 64 idle replicas cost nothing.

Membership changes at runtime, for scale-out / scale-in / rolling-update benches (control port,
POST with a JSON body `{"replica": "s3"}`): `--spares K` adds K standby slots whose ports and event
endpoints are reserved but refuse connections (a pod not yet started); `/sim/start` starts a
standby or stopped slot as a fresh, cold replica (a new pod on that address); `/sim/terminate` does
what `warmfleet serve` does on SIGTERM: the listening socket closes (new connections are refused),
/ready and new requests on open connections answer 503 with `connection: close`, idle connections
close, requests in flight (streams included) finish, then the replica stops. Each slot's state
(standby, serving, terminating, stopped) is in `/sim/stats`.
Streaming answers carry the first token as soon as the model produces it and the rest of the
tokens in one chunk when the request finishes (per-token chunks would only add relay load).

This file holds the time model, the fleet and the command line; one replica is simfleet_replica.py, the node
tier simfleet_node.py, the HTTP/1.1 server simfleet_http.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from warmfleet.server import rendering
from warmfleet.server.config import SchedulerConfig
from warmfleet.server.engine.scheduler import SchedulerOutput
from warmfleet.server.hashing import model_fingerprint

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

simfleet_http = harness.sibling("simfleet_http")
simfleet_node = harness.sibling("simfleet_node")
simfleet_replica = harness.sibling("simfleet_replica")

HERE = Path(__file__).resolve().parent
CALIBRATION = HERE / "sim_calibration.json"
TIME_MODELS = {"calibrated": CALIBRATION, "h200": HERE / "sim_h200.json"}  # named time models (files in bench/)
MODEL_NAME = "bench"
LOAD_PUBLISH_INTERVAL_S = 0.25  # as server/engine/core_proc.py; unchanged load is re-sent every 1 s


# --- time model -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeModel:
    """Seconds one engine step takes: step_s + prefill tokens, decoding sequences and tier copies."""

    step_s: float = 0.0  # fixed cost of any step (kernel launches, sampling, bookkeeping)
    prefill_s_per_token: float = 0.0  # per uncached prompt token computed in the step
    decode_s_per_seq: float = 0.0  # per sequence decoding one token in the step
    swap_s_per_block: float = 0.0  # per block copied between the GPU pool and the CPU tier
    max_num_batched_tokens: int = 2048  # the engine's defaults (server/config.SchedulerConfig)
    max_num_seqs: int = 64
    source: str = "zero"

    @property
    def zero(self) -> bool:
        return not (self.step_s or self.prefill_s_per_token or self.decode_s_per_seq or self.swap_s_per_block)

    def step_seconds(self, out: SchedulerOutput) -> float:
        if self.zero:
            return 0.0
        prefill = decode = 0
        for s in out.scheduled:
            if s.num_computed_before >= s.request.num_prompt_tokens:
                decode += 1
            else:
                prefill += s.num_tokens
        copies = len(out.swap.swap_in) + len(out.swap.swap_out)
        return (self.step_s + prefill * self.prefill_s_per_token + decode * self.decode_s_per_seq
                + copies * self.swap_s_per_block)

    def scaled(self, speedup: float) -> "TimeModel":
        """The same engine `speedup` times faster (every time constant divided by it)."""
        if speedup == 1.0:
            return self
        k = 1.0 / speedup
        return TimeModel(self.step_s * k, self.prefill_s_per_token * k, self.decode_s_per_seq * k,
                         self.swap_s_per_block * k, self.max_num_batched_tokens, self.max_num_seqs,
                         f"{self.source}, / {speedup:g}")

    @classmethod
    def load(cls, spec: str) -> "TimeModel":
        """'zero', 'calibrated' (bench/sim_calibration.json: this machine's CPU engine), 'h200' (bench/sim_h200.json:
        Qwen2.5-7B shapes on one H200) or a JSON file with a 'time_model' object."""
        if spec == "zero":
            return cls()
        path = TIME_MODELS.get(spec) or Path(spec)
        d = json.loads(path.read_text())
        d = d.get("time_model", d)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def fit_time_model(pc: dict, block_size: int) -> dict:
    """Time-model constants from bench/prefix_cache.py's JSON (the engine's own figures, no HTTP).

    prefix_cache runs P = prefix_tokens + Q = question_tokens prompts: a cold miss (P + Q prefilled),
    a GPU hit (Q prefilled over P cached) and a swap hit (P/64 blocks copied back, then Q), and decode
    tok/s at batch 1 and 16. So: prefill per token = (miss - hit) / P; step = hit - Q x that;
    swap per block (of `block_size` tokens) = (swap_hit - hit) / P x block_size; decode step at
    batch b = b / tok_s(b), linear in b.
    """
    p_tokens = pc["prefix_tokens"]
    per_token = (pc["ttft_miss_s"] - pc["ttft_hit_s"]) / p_tokens
    d1 = 1.0 / pc["decode_tok_s_batch1"]
    d16 = 16.0 / pc["decode_tok_s_batch16"]
    per_seq = max(0.0, (d16 - d1) / 15)
    step = max(0.0, d1 - per_seq)
    swap = max(0.0, (pc["ttft_swap_hit_s"] - pc["ttft_hit_s"]) / p_tokens * block_size)
    return {"step_s": round(step, 6), "prefill_s_per_token": round(per_token, 7),
            "decode_s_per_seq": round(per_seq, 6), "swap_s_per_block": round(swap, 7),
            "max_num_batched_tokens": SchedulerConfig().max_num_batched_tokens,
            "max_num_seqs": SchedulerConfig().max_num_seqs,
            "source": "bench/prefix_cache.py --quick --json on the bench checkpoint (fit_time_model)"}


# --- the fleet --------------------------------------------------------------------------------
class SimFleet:
    """N replicas, one tokenizer, one listening socket per replica plus a control socket."""

    def __init__(self, model: str, n: int, *, block_size: int = 16, gpu_blocks: int = 1024, cpu_blocks: int = 0,
                 tm: TimeModel = TimeModel(), host: str = "127.0.0.1", events: bool = True,
                 max_model_len: int = 1 << 20, calibration: Optional[dict] = None, spares: int = 0,
                 slow: tuple[int, float] = (0, 1.0), replicas_per_node: int = 8, node_tier_blocks: int = 0,
                 node_tier_lru: bool = False):
        from warmfleet.server.tokenizer import Tokenizer

        self.model, self.n, self.host = model, n, host
        self.slow = slow  # (K, F): the last K of the n replicas are F times slower (a second, slower node pool)
        self.block_size, self.gpu_blocks, self.cpu_blocks, self.tm = block_size, gpu_blocks, cpu_blocks, tm
        self.events, self.max_model_len, self.calibration = events, max_model_len, calibration
        self.tokenizer = Tokenizer(model)
        self.vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        self.fingerprint = model_fingerprint(model)
        self.replicas_per_node, self.node_tier_blocks = replicas_per_node, node_tier_blocks
        self.nodes = simfleet_node.nodes_for(n + spares, replicas_per_node, node_tier_blocks,  # slot i: i // K
                                             node_tier_lru)
        self.replicas: list[simfleet_replica.SimReplica] = []
        self.urls: list[str] = []
        self.servers: list[asyncio.AbstractServer] = []  # the control port's
        self.spares = spares
        self.state: dict[str, str] = {}  # rid -> standby | serving | terminating | stopped
        self.conns: dict[str, set] = {}  # rid -> open HttpConn
        self._listeners: dict[str, asyncio.AbstractServer] = {}  # rid -> its listening server while it serves
        self._held: dict[str, socket.socket] = {}  # rid -> bound, not listening socket (refuses) while not serving
        self._tasks: set = set()
        self.retired_log: list[dict] = []  # request log of replicas replaced by a restart of their slot
        self.control_url = ""
        self._load_task: Optional[asyncio.Task] = None
        self.started = time.time()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.events:
            for t in self.nodes:  # each node tier's own KV events (a router follows them with --node-tier-events)
                t.publish_to(f"tcp://{self.host}:{simfleet_http._free_port(self.host)}", self.block_size)
        for i in range(self.n + self.spares):
            sock = simfleet_http._bound(self.host)
            port = sock.getsockname()[1]
            ev = f"tcp://{self.host}:{simfleet_http._free_port(self.host)}" if self.events else None
            rid = f"s{i}"
            self.urls.append(f"http://{self.host}:{port}")
            self._held[rid] = sock
            if i < self.n:
                self.replicas.append(None)  # type: ignore[arg-type]  # set by start_replica
                await self.start_replica(i, ev)
            else:  # standby: the address exists, nothing listens
                self.replicas.append(self._replica(rid, None))
                self.replicas[i].events_endpoint = ev
                self.state[rid] = "standby"
        sock = simfleet_http._listen(self.host)
        self.control_url = f"http://{self.host}:{sock.getsockname()[1]}"
        self.servers.append(await loop.create_server(lambda: simfleet_http.HttpConn(self, None), sock=sock))
        self._load_task = asyncio.create_task(self._load_loop())

    def slowdown(self, rid: str) -> float:
        """How many times slower than the time model replica `rid` runs (1, or F in the slow pool)."""
        k, factor = self.slow
        return factor if k and self.n - k <= int(rid[1:]) < self.n else 1.0

    def time_model(self, rid: str) -> TimeModel:
        f = self.slowdown(rid)
        return self.tm if f == 1.0 else self.tm.scaled(1.0 / f)

    def _replica(self, rid: str, events: Optional[str]) -> simfleet_replica.SimReplica:
        node = self.nodes[int(rid[1:]) // self.replicas_per_node] if self.nodes else None
        return simfleet_replica.SimReplica(rid, self.fingerprint, self.block_size, self.gpu_blocks, self.cpu_blocks,
                          self.time_model(rid), self.vocab, events, self.max_model_len, node=node)

    async def start_replica(self, i: int, events: Optional[str] = None) -> None:
        """Start slot i as a fresh, cold replica on its address (a new pod there); it must not be serving."""
        loop = asyncio.get_running_loop()
        rid = f"s{i}"
        if self.state.get(rid) in ("serving", "terminating"):
            raise ValueError(f"replica {rid} is {self.state[rid]}")
        old = self.replicas[i]
        events = events or (old.events_endpoint if old is not None else None)
        for attempt in range(50):  # the previous publisher's port may take a moment to be released
            try:
                rep = self._replica(rid, events)
                break
            except Exception:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.05)
        rep.task = asyncio.create_task(rep.run())
        if old is not None:
            self.retired_log.extend(old.log)
            rep.generation = old.generation + (self.state.get(rid) != "standby")
        self.replicas[i] = rep
        sock = self._held.pop(rid, None)
        if sock is None:
            port = int(self.urls[i].rsplit(":", 1)[1])
            sock = simfleet_http._bound(self.host, port)
        sock.listen(1024)
        self._listeners[rid] = await loop.create_server(lambda r=rep: simfleet_http.HttpConn(self, r), sock=sock, backlog=1024)
        self.state[rid] = "serving"

    async def terminate_replica(self, i: int) -> None:
        """SIGTERM-like: refuse new connections and requests, let in-flight ones finish, then stop."""
        rid = f"s{i}"
        if self.state.get(rid) != "serving":
            raise ValueError(f"replica {rid} is {self.state.get(rid)}, not serving")
        rep = self.replicas[i]
        rep.terminating = True
        self.state[rid] = "terminating"
        self._listeners.pop(rid).close()
        for c in list(self.conns.get(rid, ())):
            if not c.busy and c.transport is not None:
                c.transport.close()
        while rep.live:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last answers' bytes leave
        rep.task.cancel()
        await asyncio.gather(rep.task, return_exceptions=True)
        if rep.publisher is not None:
            rep.publisher.close()
            rep.publisher = None
        self.state[rid] = "stopped"

    def slot(self, name: str) -> int:
        if not (isinstance(name, str) and name[:1] == "s" and name[1:].isdigit() and int(name[1:]) < len(self.urls)):
            raise ValueError(f"no replica {name!r}: s0 .. s{len(self.urls) - 1}")
        return int(name[1:])

    async def stop(self) -> None:
        for s in [*self.servers, *self._listeners.values()]:
            s.close()
        for sock in self._held.values():
            sock.close()
        tasks = [r.task for r in self.replicas if r.task] + ([self._load_task] if self._load_task else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in self.replicas:
            if r.publisher is not None:
                r.publisher.close()
        for t in self.nodes:
            if t.publisher is not None:
                t.publisher.close()

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(LOAD_PUBLISH_INTERVAL_S)
            now = time.monotonic()
            for r in self.replicas:
                r.publish_load(now)
            for t in self.nodes:  # new subscriptions get the state even while no replica steps
                t.publish()

    def describe(self) -> dict:
        return {"replicas": [{"id": r.rid, "url": u, "events": r.events_endpoint, "state": self.state.get(r.rid),
                              "slowdown": self.slowdown(r.rid)}
                             for r, u in zip(self.replicas, self.urls)],
                "control": self.control_url, "model": self.model, "model_fingerprint": self.fingerprint,
                "block_size": self.block_size, "gpu_blocks": self.gpu_blocks, "cpu_blocks": self.cpu_blocks,
                "replicas_per_node": self.replicas_per_node, "node_tier_blocks": self.node_tier_blocks,
                "node_tiers": [{"id": t.node_id, "events": t.events_endpoint} for t in self.nodes],
                "time_model": asdict(self.tm), "pid": os.getpid()}

    def stats(self) -> dict:
        return {**self.describe(), "per_replica": [r.stats() for r in self.replicas], "per_node": self.node_stats(),
                "calibration": self.calibration, "cpu_s": round(sum(os.times()[:2]), 3)}

    def node_stats(self) -> list[dict]:
        """Each node tier's size, use and hits (blocks and tokens served from it), with the replicas it serves."""
        k = self.replicas_per_node
        return [t.stats(self.block_size, [r.rid for r in self.replicas[j * k:(j + 1) * k]])
                for j, t in enumerate(self.nodes)]

    # --- HTTP ----------------------------------------------------------------------------------
    async def handle(self, rep: Optional[simfleet_replica.SimReplica], method: str, path: str, body: bytes, headers: dict,
                     reply: simfleet_http.HttpReply, conn: simfleet_http.HttpConn) -> None:
        if rep is None:  # control port
            if path == "/sim/stats":
                return reply.send(200, json.dumps(self.stats()).encode())
            if path == "/sim/log":
                return reply.send(200, json.dumps(self.retired_log + [x for r in self.replicas for x in r.log]).encode())
            if method == "POST" and path in ("/sim/start", "/sim/terminate"):
                try:
                    i = self.slot((json.loads(body or b"{}") or {}).get("replica"))
                    if path == "/sim/start":
                        await self.start_replica(i)
                    else:
                        if self.state.get(f"s{i}") != "serving":
                            raise ValueError(f"replica s{i} is {self.state.get(f's{i}')}, not serving")
                        task = asyncio.ensure_future(self.terminate_replica(i))  # answers at once, drains behind
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                except (ValueError, AttributeError) as exc:
                    return reply.send(400, simfleet_http.error(str(exc)))
                return reply.send(200, json.dumps({"replica": f"s{i}", "state": self.state[f"s{i}"],
                                                   "url": self.urls[i]}).encode())
            return reply.send(404, simfleet_http.error("not found", 404))
        hdr = [("x-warmfleet-replica", rep.rid)]
        if rep.terminating and path != "/health":  # as warmfleet serve while it drains: go elsewhere
            reply.keep_alive = False
            return reply.send(503, simfleet_http.error("replica is shutting down; retry on another", 503), hdr)
        if method == "GET":
            if path in ("/health", "/ready"):
                return reply.send(200, b'{"status":"ok"}', hdr)
            if path == "/v1/models":
                return reply.send(200, json.dumps({"object": "list", "data": [
                    {"id": MODEL_NAME, "object": "model", "owned_by": "warmfleet-sim",
                     "max_model_len": self.max_model_len}]}).encode(), hdr)
            if path == "/v1/kv/snapshot":
                return reply.send(200, json.dumps(rep.snapshot().to_json()).encode(), hdr)
            return reply.send(404, simfleet_http.error("not found", 404), hdr)
        if method != "POST":
            return reply.send(405, simfleet_http.error("method not allowed", 405), hdr)
        try:
            req = json.loads(body) if body else {}
            if not isinstance(req, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            return reply.send(400, simfleet_http.error(f"bad JSON: {exc}"), hdr)
        if path == "/tokenize":
            try:
                ids = self._prompt_ids(req, "messages" in req)
            except ValueError as exc:
                return reply.send(400, simfleet_http.error(str(exc)), hdr)
            return reply.send(200, json.dumps({"count": len(ids), "max_model_len": self.max_model_len,
                                               "tokens": ids}).encode(), hdr)
        if path in ("/v1/completions", "/v1/chat/completions"):
            return await self._generate(rep, req, path == "/v1/chat/completions", headers, reply, conn, hdr)
        return reply.send(404, simfleet_http.error("not found", 404), hdr)

    def _prompt_ids(self, req: dict, chat: bool) -> list[int]:
        if chat:
            msgs = req.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ValueError("messages must be a non-empty list")
            return rendering.chat_ids(self.tokenizer, msgs, bool(req.get("add_generation_prompt", True)))
        p = req.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (list, str)):
            p = p[0]
        if isinstance(p, str):
            ids = rendering.completion_ids(self.tokenizer, p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            if any(t < 0 or t >= self.vocab for t in p):
                raise ValueError(f"token ids must be in [0, {self.vocab})")
            ids = list(p)
        else:
            raise ValueError("prompt must be a string, or a list of token ids (one prompt)")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    async def _generate(self, rep: simfleet_replica.SimReplica, req: dict, chat: bool, headers: dict, reply: simfleet_http.HttpReply,
                        conn: simfleet_http.HttpConn, hdr: list) -> None:
        if req.get("n", 1) != 1:
            return reply.send(400, simfleet_http.error("n must be 1 in the simulator"), hdr)
        try:
            ids = self._prompt_ids(req, chat)
            max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or 16
            tag = str(req.get("user") or headers.get(b"x-request-id", b"").decode() or "")
            h = rep.submit(ids, int(max_tokens), req.get("cache_salt"), tag)
        except (ValueError, TypeError) as exc:
            return reply.send(400, simfleet_http.error(str(exc)), hdr)
        stream = bool(req.get("stream"))
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + h.request_id
        meta = {"id": rid, "created": int(time.time()), "model": req.get("model") or MODEL_NAME}
        try:
            if not stream:
                await h.done
                if conn.closed:
                    return
                text = self._text(h.tokens)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": h.finish_reason}
                          if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": h.finish_reason})
                obj = {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                       "usage": self._usage(h)}
                return reply.send(200, json.dumps(obj).encode(), hdr + self._sim_headers(h))
            await h.first
            if conn.closed:
                return rep.abort(h)
            obj = "chat.completion.chunk" if chat else "text_completion"
            extra = {"usage": None} if include_usage else {}

            def chunk(text: str, finish: Optional[str] = None, role: bool = False) -> bytes:
                if chat:
                    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                else:
                    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                return simfleet_http.sse({**meta, "object": obj, "choices": [c], **extra})

            first_tok = h.tokens[:1]
            done_now = h.done.done()
            head = (chunk("", role=True) if chat else b"") + chunk(self._text(first_tok),
                                                                   h.finish_reason if done_now and len(h.tokens) <= 1 else None)
            reply.stream_start(200, hdr + self._sim_headers(h), head)
            await h.done
            if conn.closed:
                return
            tail = b""
            rest = h.tokens[1:]
            if rest or not (done_now and len(h.tokens) <= 1):
                tail += chunk(self._text(rest), h.finish_reason)
            if include_usage:
                tail += simfleet_http.sse({**meta, "object": obj, "choices": [], "usage": self._usage(h)})
            reply.stream_end(tail + b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            rep.abort(h)
            raise

    def _text(self, tokens: list[int]) -> str:
        return "".join(f" t{t}" for t in tokens)

    def _usage(self, h: simfleet_replica.SimRequest) -> dict:
        return {"prompt_tokens": h.prompt_tokens, "completion_tokens": len(h.tokens),
                "total_tokens": h.prompt_tokens + len(h.tokens),
                "prompt_tokens_details": {"cached_tokens": h.cached_tokens}}

    def _sim_headers(self, h: simfleet_replica.SimRequest) -> list:
        return [("x-sim-ttft-ms", f"{((h.first_time or h.arrival) - h.arrival) * 1e3:.3f}")]


# --- calibration ------------------------------------------------------------------------------
def calibrate(block_size: int, out: Path, prefix_cache_json: Optional[Path] = None) -> dict:
    """Run bench/prefix_cache.py --quick --json (or read its saved output) and fit the time model."""
    import subprocess

    if prefix_cache_json is not None:
        raw = prefix_cache_json.read_text()
    else:
        r = subprocess.run([sys.executable, "-P", str(HERE / "prefix_cache.py"), "--quick", "--json"],
                           capture_output=True, text=True, check=True)
        raw = r.stdout
    pc = json.loads(raw.strip().splitlines()[-1])
    res = {"time_model": fit_time_model(pc, block_size), "block_size": block_size,
           "prefix_cache": {k: pc[k] for k in ("ttft_miss_s", "ttft_hit_s", "ttft_swap_hit_s", "prefix_tokens",
                                                "question_tokens", "decode_tok_s_batch1", "decode_tok_s_batch16",
                                                "model") if k in pc},
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_1m": os.getloadavg()[0]}
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


# --- CLI ---------------------------------------------------------------------------------------
def parse_slow(spec: Optional[str], n: int) -> tuple[int, float]:
    """--slow-replicas K:F → (K, F); exits with one line on a bad value."""
    if not spec:
        return 0, 1.0
    try:
        k, f = spec.split(":")
        out = int(k), float(f)
    except ValueError:
        raise SystemExit(f"simfleet: --slow-replicas wants K:F (e.g. 8:2), got {spec!r}")
    if not 0 <= out[0] <= n or out[1] <= 0:
        raise SystemExit(f"simfleet: --slow-replicas {spec}: K must be in 0..{n} and F > 0")
    return out


async def serve(args) -> None:
    tm = TimeModel.load(args.time_model).scaled(args.engine_speedup)
    cal = json.loads(CALIBRATION.read_text()) if CALIBRATION.exists() and args.time_model == "calibrated" else None
    fleet = SimFleet(args.model, args.replicas, block_size=args.block_size, gpu_blocks=args.gpu_blocks,
                     cpu_blocks=args.cpu_blocks, tm=tm, events=not args.no_events, calibration=cal, spares=args.spares,
                     slow=parse_slow(args.slow_replicas, args.replicas), replicas_per_node=args.replicas_per_node,
                     node_tier_blocks=args.node_tier_blocks, node_tier_lru=args.node_tier_lru)
    await fleet.start()
    desc = json.dumps(fleet.describe())
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(desc)
        tmp.rename(args.ready_file)
    print(desc, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fleet.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    cal = sub.add_parser("calibrate", help="Fit the time model from bench/prefix_cache.py and write it.")
    cal.add_argument("--block-size", type=int, default=16)
    cal.add_argument("--prefix-cache-json", default=None, help="Saved output of bench/prefix_cache.py --json.")
    cal.add_argument("--out", default=str(CALIBRATION))
    ap.add_argument("--model", help="Checkpoint directory (tokenizer, vocab, fingerprint; no weights are read).")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=1024, help="Primary KV pool per replica, in blocks.")
    ap.add_argument("--cpu-blocks", type=int, default=0, help="CPU swap tier per replica, in blocks.")
    ap.add_argument("--time-model", default="calibrated",
                    help="'calibrated' (this machine's CPU engine), 'h200' (Qwen2.5-7B on one H200), 'zero' or a JSON file.")
    ap.add_argument("--replicas-per-node", type=int, default=8, help="Replicas per node (slot i on node i // K).")
    ap.add_argument("--node-tier-lru", action="store_true",
                    help="The node tier as a plain LRU (replicas name no holder), not the product's victims-first "
                    "eviction: to compare.")
    ap.add_argument("--node-tier-blocks", type=int, default=0,
                    help="One shared host-memory KV tier of this many blocks per node (0: none); needs --cpu-blocks 0.")
    ap.add_argument("--slow-replicas", default=None, metavar="K:F",
                    help="The last K replicas are F times slower (a fleet over two node pools).")
    ap.add_argument("--engine-speedup", type=float, default=1.0,
                    help="Divide every time constant by this (an engine this many times faster than the calibration).")
    ap.add_argument("--no-events", action="store_true", help="Publish no KV events.")
    ap.add_argument("--spares", type=int, default=0,
                    help="Standby slots: addresses reserved, refusing connections until POST /sim/start.")
    ap.add_argument("--ready-file", default=None, help="Write the fleet's description (JSON) here when it listens.")
    args = ap.parse_args()
    if args.cmd == "calibrate":
        res = calibrate(args.block_size, Path(args.out), Path(args.prefix_cache_json) if args.prefix_cache_json else None)
        print(json.dumps(res))
        return 0
    if not args.model:
        ap.error("--model is required")
    if args.replicas_per_node < 1:
        ap.error("--replicas-per-node must be at least 1")
    if args.node_tier_blocks < 0 or (args.node_tier_blocks and args.cpu_blocks):
        ap.error("--node-tier-blocks takes the place of the per-replica swap tier: give it with --cpu-blocks 0")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    random.seed(0)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
