"""Shared test doubles (`Fake*`): an EngineClient that answers from a script instead of a model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Optional

from warmfleet.server.engine.protocol import EngineStats, GenerateRequest, ModelInfo
from warmfleet.server.engine.request import RequestOutput
from warmfleet.server.events import Snapshot


ENCODER_CACHE_STATS = {"encoder_cache_hits": 5, "encoder_cache_misses": 3, "encoder_cache_evictions": 1,
                       "encoder_cache_usage_tokens": 120, "encoder_cache_budget_tokens": 4096}


class FakeEngine:
    """EngineClient double: replies with the tokens of `reply` (one per step), then EOS.

    Deterministic: a seeded request appends " #<seed>" to the reply, so n>1 choices differ.
    Prefix caching is imitated: a prompt's cached tokens are the full blocks it shares with
    an earlier prompt (same cache_salt), as a real replica would report.
    Set `raises` to make generate/snapshot raise it (a dead engine process).
    Set `hang_after` to stop producing after that many tokens until the request is aborted or
    cancelled (`hanging` is set then), and `error` to fail every request with that message.
    `multimodal=True` makes it a Qwen2-VL-like model (ModelInfo.is_multimodal) whose stats carry
    encoder-cache figures; requests keep their mm_placeholders / mm_inputs for inspection.
    """

    def __init__(self, tokenizer, model_dir: str | Path, *, reply: str = "Hello there, how are you?",
                 served_model_name: str = "tiny", max_model_len: int = 512, block_size: int = 16,
                 gpu_blocks: int = 1024, replies: Optional[list[list[int]]] = None, multimodal: bool = False):
        self.tokenizer = tokenizer
        self.reply = reply
        self.replies = replies  # explicit token ids per request, in arrival order (overrides `reply`)
        self.model_info = ModelInfo(
            served_model_name=served_model_name, model_dir=str(model_dir), max_model_len=max_model_len,
            model_fingerprint="fake", block_size=block_size,
            architecture="Qwen2VLForConditionalGeneration" if multimodal else "Qwen2ForCausalLM",
            is_multimodal=multimodal,
        )
        self.gpu_blocks = gpu_blocks
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []  # requests whose generator ran to its end
        self.closed: list[str] = []  # requests whose generator was closed or cancelled early
        self.hang_after: Optional[int] = None
        self.hanging = asyncio.Event()
        self.error: Optional[str] = None
        self.raises: Optional[Exception] = None  # raised from generate/snapshot, like a dead engine process
        self.healthy = True
        self._seen: list[tuple[Optional[str], list[int]]] = []

    def _reply_ids(self, req: GenerateRequest, index: int) -> list[int]:
        if self.replies is not None:
            return list(self.replies[index % len(self.replies)])
        text = self.reply if req.sampling_params.seed is None else f"{self.reply} #{req.sampling_params.seed}"
        return self.tokenizer.encode(text)

    def _cached_tokens(self, req: GenerateRequest) -> int:
        best = 0
        for salt, prev in self._seen:
            if salt != req.cache_salt:
                continue
            n = 0
            for a, b in zip(prev, req.prompt_token_ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        limit = len(req.prompt_token_ids) - 1  # the last prompt token is always recomputed
        bs = self.model_info.block_size
        return (min(best, limit) // bs) * bs

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        index = len(self.requests)
        self.requests.append(req)
        sp = req.sampling_params
        cached = self._cached_tokens(req)
        self._seen.append((req.cache_salt, list(req.prompt_token_ids)))
        common = {"num_prompt_tokens": len(req.prompt_token_ids), "num_cached_tokens": cached}
        done = False
        try:
            if self.raises is not None:
                raise self.raises
            if self.error is not None:
                done = True
                yield RequestOutput(req.request_id, [], True, "abort", error=self.error, **common)
                return
            tokens = self._reply_ids(req, index)
            if not sp.ignore_eos:
                tokens = tokens + [self.tokenizer.eos_token_ids[0]]
            for i in range(sp.max_tokens):
                if self.hang_after is not None and i >= self.hang_after:
                    self.hanging.set()
                    await asyncio.Event().wait()  # until cancelled
                tok = tokens[i % len(tokens)]
                stop = (tok in self.tokenizer.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids
                last = stop or i == sp.max_tokens - 1
                lp = None
                if sp.logprobs is not None:
                    top = [(tok, -0.25), ((tok + 1) % 1000, -1.5), ((tok + 2) % 1000, -2.5)][: sp.logprobs]
                    lp = [(-0.25, top)]
                await asyncio.sleep(0)  # one engine step: let other requests interleave
                done = last
                yield RequestOutput(req.request_id, [tok], last, ("stop" if stop else "length") if last else None,
                                    new_logprobs=lp, **common)
                if last:
                    return
        finally:
            (self.finished if done else self.closed).append(req.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def stats(self) -> EngineStats:
        stats = EngineStats(
            num_running=1, num_waiting=2, gpu_blocks_total=self.gpu_blocks, gpu_blocks_free=self.gpu_blocks // 4,
            cpu_blocks_total=100, cpu_blocks_free=90, prefix_queries_tokens=1000, prefix_hits_tokens_gpu=600,
            prefix_hits_tokens_cpu=100, swap_in_blocks=3, swap_out_blocks=7, preemptions=2,
        )
        if self.model_info.is_multimodal:  # set as attributes: works before and after EngineStats declares them
            for name, value in ENCODER_CACHE_STATS.items():
                setattr(stats, name, value)
        return stats

    async def snapshot(self) -> dict:
        if self.raises is not None:
            raise self.raises
        return Snapshot("fake-replica", 5, self.model_info.block_size, "fake", [b"\x01" * 32], [b"\x02" * 32], []).to_json()

    async def check_health(self) -> bool:
        return self.healthy
