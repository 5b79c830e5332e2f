"""One simulated replica: the engine's scheduler, KV cache manager and block pool (or its node tier's pool),
the model runner replaced by a time model; its KV events, load and snapshot. No HTTP."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from warmfleet.server.config import SchedulerConfig
from warmfleet.server.engine.block_pool import BlockPool
from warmfleet.server.engine.kv_cache_manager import KVCacheManager
from warmfleet.server.engine.request import Request
from warmfleet.server.engine.sampling_params import SamplingParams
from warmfleet.server.engine.scheduler import Scheduler, SchedulerOutput
from warmfleet.server.events import EventPublisher, Load, Snapshot

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

simfleet_node = harness.sibling("simfleet_node")


LAG_TOLERANCE_S = 0.05  # a step loop woken later than this restarts the model clock at "now"


class StepTimes(Protocol):
    """What a replica needs of a time model (simfleet.TimeModel)."""

    max_num_batched_tokens: int
    max_num_seqs: int

    def step_seconds(self, out: SchedulerOutput) -> float: ...


# --- one replica ------------------------------------------------------------------------------
@dataclass
class SimRequest:
    request_id: str
    tag: str  # the client's `user` field or x-request-id, for the bench's log
    arrival: float
    first: asyncio.Future
    done: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    first_time: Optional[float] = None
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_cpu: int = 0


class SimReplica:
    """The engine core of one replica with the model runner replaced by a time model."""

    def __init__(self, rid: str, fingerprint: str, block_size: int, gpu_blocks: int, cpu_blocks: int,
                 tm: StepTimes, vocab: int, events_endpoint: Optional[str] = None, max_model_len: int = 1 << 20,
                 hash_algo: str = "blake3", node: Any = None):
        self.rid, self.fingerprint, self.block_size, self.tm, self.vocab = rid, fingerprint, block_size, tm, vocab
        self.node = node  # its node's simfleet_node.NodeTier (then it has no swap tier of its own), or None
        if node is not None and cpu_blocks:
            raise ValueError("the node tier takes the place of the per-replica swap tier: cpu_blocks must be 0")
        self.pool = (simfleet_node.NodePool(rid, gpu_blocks, node, block_size) if node is not None
                     else BlockPool(gpu_blocks, cpu_blocks, True, block_size))
        self.kv = KVCacheManager(self.pool, block_size, fingerprint, hash_algo)
        self.sched = Scheduler(SchedulerConfig(tm.max_num_batched_tokens, tm.max_num_seqs), self.kv, max_model_len)
        self.publisher = EventPublisher(rid, events_endpoint) if events_endpoint else None
        self.events_endpoint = events_endpoint
        self.live: dict[str, SimRequest] = {}
        self.log: list[dict] = []
        self.wake = asyncio.Event()
        self.task: Optional[asyncio.Task] = None
        self.steps = 0
        self.terminating = False  # SIGTERM-like drain: no new requests, in-flight ones finish
        self.generation = 0  # how many times its slot was started before this replica (restarts, rolling updates)
        self.busy_s = 0.0
        self.max_lag_s = 0.0
        self.lag_restarts = 0
        self._last_load: Optional[tuple] = None
        self._last_load_t = 0.0

    # --- intake -----------------------------------------------------------------------------
    def submit(self, tokens: list[int], max_tokens: int, cache_salt: Optional[str], tag: str) -> SimRequest:
        """Queue a request; raises ValueError for what the engine would refuse (too long for the pool)."""
        loop = asyncio.get_running_loop()
        rid = uuid.uuid4().hex
        sp = SamplingParams(max_tokens=max(1, max_tokens), temperature=0.0, ignore_eos=True)
        req = Request(rid, list(tokens), sp, (), cache_salt, arrival_time=time.monotonic())
        self.sched.add_request(req)  # validates length against the pool and context, hashes the blocks
        h = SimRequest(rid, tag, req.arrival_time, loop.create_future(), loop.create_future(),
                       prompt_tokens=len(tokens))
        self.live[rid] = h
        self.wake.set()
        return h

    def abort(self, h: SimRequest) -> None:
        if h.request_id in self.live:
            self.sched.abort([h.request_id])
            self.sched.update(SchedulerOutput(), {})  # drain the abort's output
            self.live.pop(h.request_id, None)
            self._publish()

    # --- the engine loop --------------------------------------------------------------------
    async def run(self) -> None:
        prev_end: Optional[float] = None
        while True:
            if not self.sched.has_work:
                self.wake.clear()
                await self.wake.wait()
                prev_end = None
            now = time.monotonic()
            if prev_end is None:
                start = now
            else:
                lag = now - prev_end
                self.max_lag_s = max(self.max_lag_s, lag)
                start = prev_end if lag <= LAG_TOLERANCE_S else now
                self.lag_restarts += lag > LAG_TOLERANCE_S
            out = self.sched.schedule()
            dt = self.tm.step_seconds(out)
            end = start + dt
            if dt > 0:
                await asyncio.sleep(max(0.0, end - time.monotonic()))
            else:
                await asyncio.sleep(0)  # zero time model: still let the loop breathe between steps
            self.busy_s += dt
            self.steps += 1
            sampled = {s.request.request_id: self._token(s.request) for s in out.scheduled
                       if s.num_computed_before + s.num_tokens == s.request.num_tokens}
            results = self.sched.update(out, sampled)
            self._publish()
            for r in results:
                h = self.live.get(r.request_id)
                if h is None:
                    continue
                h.tokens.extend(r.new_token_ids)
                if h.first_time is None and (r.new_token_ids or r.finished):
                    h.first_time = end
                    h.prompt_tokens = r.num_prompt_tokens or h.prompt_tokens
                    h.cached_tokens, h.cached_tokens_cpu = r.num_cached_tokens, r.num_cached_tokens_cpu
                    if not h.first.done():
                        h.first.set_result(end)
                if r.finished:
                    h.finish_reason = r.finish_reason or "length"
                    self.live.pop(r.request_id, None)
                    self.log.append({"tag": h.tag, "replica": self.rid, "gen": self.generation,
                                     "arrival": round(h.arrival, 6),
                                     "ttft_model_s": round(max(end if h.first_time is None else h.first_time,
                                                               h.arrival) - h.arrival, 6),
                                     "e2e_model_s": round(end - h.arrival, 6), "prompt": h.prompt_tokens,
                                     "cached": h.cached_tokens, **self._host_hits(h), "output": len(h.tokens)})
                    if not h.first.done():
                        h.first.set_result(end)
                    if not h.done.done():
                        h.done.set_result(end)
            prev_end = end if self.sched.has_work else None

    def _host_hits(self, h: SimRequest) -> dict:
        """Cached tokens copied from host memory: the replica's swap tier, or its node tier when it has one."""
        if self.node is None:
            return {"cached_cpu": h.cached_tokens_cpu}
        return {"cached_cpu": 0, "cached_node": h.cached_tokens_cpu}

    def _token(self, req: Request) -> int:
        """A deterministic pseudo-random output token (never special: ids 10 .. vocab-10)."""
        x = (int(req.request_id[:12], 16) * 2654435761 + req.num_tokens * 40503) & 0xFFFFFFFF
        return 10 + x % (self.vocab - 20)

    # --- events, load, snapshot -------------------------------------------------------------
    def load(self) -> Load:
        s = self.sched
        return Load(len(s.running), len(s.waiting), self.pool.num_free_blocks, self.pool.num_gpu_blocks)

    def _publish(self) -> None:
        events = self.pool.take_events()
        if self.publisher is not None and events:
            self.publisher.publish(events)
        if self.node is not None:
            self.node.publish()

    def publish_load(self, now: float) -> None:
        if self.publisher is None:
            return
        load = self.load()
        key = (load.num_running, load.num_waiting, load.free_gpu_blocks)
        if key != self._last_load or now - self._last_load_t >= 1.0:
            self.publisher.publish([load])
            self._last_load, self._last_load_t = key, now

    def snapshot(self) -> Snapshot:
        self._publish()
        gpu, cpu = self.pool.snapshot()
        return Snapshot(self.rid, self.publisher.seq if self.publisher else 0, self.block_size, self.fingerprint,
                        gpu, cpu, [], self.load(), node=self.node.node_id if self.node is not None else None)

    def stats(self) -> dict:
        c = self.pool.counters
        return {"id": self.rid, "requests": len(self.log), "prompt_tokens": sum(r["prompt"] for r in self.log),
                "cached_tokens": sum(r["cached"] for r in self.log),
                "cached_tokens_cpu": sum(r["cached_cpu"] for r in self.log), "steps": self.steps,
                "busy_model_s": round(self.busy_s, 3), "preemptions": self.sched.num_preemptions,
                "evicted_gpu_blocks": c.evicted_gpu_blocks, "evicted_cpu_blocks": c.evicted_cpu_blocks,
                "swap_in_blocks": c.swap_in_blocks, "swap_out_blocks": c.swap_out_blocks,
                "gpu_cached_blocks": len(self.pool.cached),
                "cpu_cached_blocks": self.pool.cpu.num_used if self.pool.cpu else 0,
                "max_loop_lag_s": round(self.max_lag_s, 4), "lag_restarts": self.lag_restarts,
                "events_seq": self.publisher.seq if self.publisher else 0, **self._node_stats()}

    def _node_stats(self) -> dict:
        if self.node is None:
            return {}
        return {"node": self.node.node_id, "node_hit_blocks": self.pool.node_hit_blocks,
                "node_hit_tokens": self.pool.node_hit_blocks * self.block_size,
                "cached_tokens_node": sum(r.get("cached_node", 0) for r in self.log),
                "node_stored_blocks": self.pool.node_stored_blocks}
