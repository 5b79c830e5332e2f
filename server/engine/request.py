"""Request (one sequence's progress through the engine) and RequestOutput (what a step reports)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from ..hashing import AdapterId, BlockHash, MMPlaceholder
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One sequence. Owns its token ids, progress counters and block table; nothing else holds request state.

        prompt_token_ids          output_token_ids
        |<-------- num_prompt ------->|<---- generated ---->|
        |<-- num_computed_tokens -->|                           KV exists for these
        |<-cached->|                                            served from prefix cache at admission
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: Optional[str] = None
    mm_placeholders: list[MMPlaceholder] = field(default_factory=list)
    mm_inputs: list[Any] = field(default_factory=list)  # ProcessedImage per placeholder, same order
    mrope: Optional[tuple[Any, int]] = None  # VL models: (int64 [3, num_prompt] positions, delta after the prompt)
    arrival_time: float = 0.0
    adapter: Optional[AdapterId] = None  # the LoRA adapter it runs with (root of its hash chain); None: base model

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens served from the prefix cache at first admission
    num_cached_tokens_cpu: int = 0  # of which came from the swap tier
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)  # block table: physical GPU block ids
    block_hashes: list[BlockHash] = field(default_factory=list)  # hashes of full blocks, in order
    num_registered_blocks: int = 0  # leading block_ids already offered to the prefix cache (reset on free)
    node_prefetch: Optional[tuple[int, list]] = None  # (first block, bytes) the node tier served, until admitted
    generator: Any = None  # numpy Generator when the request carries a seed
    lora_slot: Optional[int] = None  # device slot of its adapter while it runs (pinned; adapters.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list (per-step hot path)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclass
class RequestOutput:
    """What one engine step reports for one request (incremental: only the new tokens)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_cached_tokens_cpu: int = 0
    new_logprobs: Optional[list] = None  # per new token: (logprob, [(token_id, logprob), ...])
    error: Optional[str] = None  # set when the request failed inside the engine
    error_status: int = 500  # the HTTP status that failure means to a client (404: its LoRA adapter is gone)
