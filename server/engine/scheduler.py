"""Scheduler: waiting/running queues, the per-step token budget, chunked prefill and preemption.

One step mixes decodes and prefill chunks under `max_num_batched_tokens`. Running requests go
first (oldest first); when blocks run out the newest running request is preempted: its blocks
are freed (their hashed blocks stay findable in the cache) and it rejoins the front of the
waiting queue to be recomputed later, so nothing it generated is lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

from ..config import SchedulerConfig
from .block_pool import SwapPlan
from .encoder_cache import chunk_end
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestOutput, RequestStatus

if TYPE_CHECKING:
    from .adapters import AdapterManager


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step, starting at request.num_computed_tokens
    num_computed_before: int  # request.num_computed_tokens when scheduled

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.num_computed_before + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap: SwapPlan = field(default_factory=SwapPlan)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 adapters: Optional["AdapterManager"] = None):
        self.config = config
        self.adapters = adapters  # LoRA residency; None: the engine serves no adapters
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished: list[RequestOutput] = []  # aborted requests to report

    # ---- intake ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens + 1 > self.max_model_len:
            raise ValueError(f"prompt has {req.num_prompt_tokens} tokens; the context holds {self.max_model_len}")
        capacity = self.kv.pool.num_gpu_blocks * self.kv.block_size
        if req.num_prompt_tokens + 1 > capacity:
            raise ValueError(f"prompt has {req.num_prompt_tokens} tokens; the whole KV pool holds {capacity}")
        self.kv.update_block_hashes(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self._finished.append(RequestOutput(rid, [], True, "abort", req.num_prompt_tokens, req.num_cached_tokens,
                                                req.num_cached_tokens_cpu))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._fit_chunk(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget),
                                budget)
            if n <= 0:
                i += 1
                continue
            if self.kv.blocks_for(req.num_computed_tokens + n) > self.kv.pool.num_gpu_blocks:
                # it has outgrown the whole pool: end it rather than preempt it forever
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                self._finished.append(RequestOutput(req.request_id, [], True, "length", req.num_prompt_tokens,
                                                    req.num_cached_tokens, req.num_cached_tokens_cpu))
                continue
            while not self.kv.allocate(req, n):
                victim = self.running[-1]  # newest; never one already in this step's batch
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n
                i += 1

        if out.num_preempted == 0:
            held: list[Request] = []  # waiting for a LoRA slot: every slot is pinned by other adapters' requests
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if req.adapter is not None and not self.adapters.serves(req.adapter):
                    self.waiting.popleft()  # unloaded (or replaced) since it was added: it cannot run as asked
                    self._finish(req, RequestStatus.FINISHED_ABORTED)
                    self._finished.append(RequestOutput(
                        req.request_id, [], True, "abort", req.num_prompt_tokens, req.num_cached_tokens,
                        req.num_cached_tokens_cpu, error=f"the LoRA adapter {req.adapter.name!r} was unloaded",
                        error_status=404))
                    continue
                if req.adapter is not None and not self.adapters.can_acquire(req.adapter):
                    held.append(self.waiting.popleft())
                    continue
                hit = self.kv.find_prefix(req)
                cached = hit.num_blocks * self.kv.block_size
                start = req.num_computed_tokens + cached
                n = self._fit_chunk(req, start, min(req.num_tokens - start, budget), budget)
                if n <= 0 or not self.kv.allocate(req, n, hit):
                    break
                self.waiting.popleft()
                if req.num_preemptions == 0:
                    self.kv.record_admission(req, hit)
                if req.adapter is not None:
                    req.lora_slot = self.adapters.acquire(req.adapter)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n
            self.waiting.extendleft(reversed(held))
        out.swap = self.kv.pool.take_plan()
        return out

    def _fit_chunk(self, req: Request, start: int, n: int, budget: int) -> int:
        """Shrink a chunk so it never ends inside an image (the encoder runs on whole images).

        An image larger than what is left of the budget waits for the next step, unless it could
        never fit a step at all; then it runs alone, over budget, rather than never.
        """
        if not req.mm_placeholders or n <= 0:
            return n
        end = chunk_end(req.mm_placeholders, start, start + n)
        if end > start + n:  # the span starts at an image that does not fit in n tokens
            return end - start if budget == self.config.max_num_batched_tokens else 0
        return end - start

    def _release_adapter(self, req: Request) -> None:
        if req.lora_slot is not None:
            self.adapters.release(req.adapter)
            req.lora_slot = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self._release_adapter(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- results --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               logprobs: Optional[dict[str, tuple]] = None) -> list[RequestOutput]:
        """Advance every scheduled request; append sampled tokens; finish those that stop."""
        results, self._finished = self._finished, []
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = s.num_computed_before + s.num_tokens
            self.kv.cache_computed_blocks(req)
            if not s.samples:
                continue
            tok = sampled[req.request_id]
            req.output_token_ids.append(tok)
            lp = logprobs.get(req.request_id) if logprobs else None
            status = self._check_stop(req, tok)
            if status is not None:
                self._finish(req, status)
                self.running.remove(req)
            results.append(RequestOutput(
                req.request_id, [tok], status is not None, status.value if status else None,
                req.num_prompt_tokens, req.num_cached_tokens, req.num_cached_tokens_cpu,
                [lp] if lp is not None else None))
        return results

    def _check_stop(self, req: Request, tok: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        if not sp.ignore_eos and tok in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if tok in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self._release_adapter(req)
        self.requests.pop(req.request_id, None)
