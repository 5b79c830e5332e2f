"""EngineClient: what the HTTP API and the offline LLM need from an engine; no paddle.

The real implementation is `warmfleet.server.engine.async_engine.AsyncEngine` (engine core in
its own process behind ZMQ + msgpack). Tests may substitute a `Fake*` that follows this shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional, Protocol

from .. import rendering
from ..config import EngineConfig
from ..hashing import MMPlaceholder, model_fingerprint
from .request import RequestOutput
from .sampling_params import SamplingParams


@dataclass
class ModelInfo:
    served_model_name: str
    model_dir: str
    max_model_len: int  # tokens of prompt + output
    model_fingerprint: str  # contract-1 root input
    block_size: int
    architecture: str  # e.g. "Qwen2ForCausalLM"
    is_multimodal: bool = False


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    gpu_blocks_total: int = 0
    gpu_blocks_free: int = 0
    cpu_blocks_total: int = 0
    cpu_blocks_free: int = 0
    # cumulative counters since start
    prefix_queries_tokens: int = 0
    prefix_hits_tokens_gpu: int = 0
    prefix_hits_tokens_cpu: int = 0
    prefix_hits_tokens_node: int = 0  # served from the node tier (server/nodetier)
    node_in_blocks: int = 0  # blocks loaded from the node tier
    node_out_blocks: int = 0  # blocks handed to the node tier (computed, or evicted)
    node_failures: int = 0  # node-tier calls that failed (each a miss, recomputed)
    node_encoder_hits: int = 0  # images whose encoder output the node tier served (the vision encoder did not run)
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    preemptions: int = 0
    encoder_cache_hits: int = 0  # lookups (per image per step) served without running the vision encoder
    encoder_cache_misses: int = 0
    encoder_cache_evictions: int = 0
    encoder_cache_usage_tokens: int = 0
    encoder_cache_budget_tokens: int = 0
    max_loras: int = 0  # device adapter slots (0: LoRA not enabled)
    running_lora_adapters: list = field(default_factory=list)  # adapters resident in a device slot, ready to serve
    waiting_lora_adapters: list = field(default_factory=list)  # adapters of waiting requests not resident yet
    lora_digests: dict = field(default_factory=dict)  # adapter name -> hashing.adapter_digest (its chain root's key)
    lora_device_loads: int = 0  # adapters copied into a device slot since start (a miss of the resident set)
    lora_disk_loads: int = 0  # adapters read from disk since start (registration included)
    kv_events_dropped: int = 0  # times a KV-event subscriber's queue was full, so it missed batches (events.py)
    extra: dict = field(default_factory=dict)


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: Optional[str] = None
    mm_placeholders: list[MMPlaceholder] = field(default_factory=list)
    mm_inputs: list = field(default_factory=list)  # preprocessed media, same order as placeholders
    lora_name: Optional[str] = None  # served name of the LoRA adapter to run with; None: the base model


def read_model_info(cfg: EngineConfig) -> ModelInfo:
    """Model facts the API needs, read from config.json without loading weights."""
    d = Path(cfg.model.model)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d} has no config.json; pass a Hugging Face checkpoint directory to --model "
                                "(or create one with `warmfleet make-tiny-model DIR`)")
    hf = json.loads((d / "config.json").read_text())
    text_cfg = hf.get("text_config", hf)
    max_len = cfg.model.max_model_len or int(text_cfg.get("max_position_embeddings", 4096))
    arch = (hf.get("architectures") or ["unknown"])[0]
    return ModelInfo(
        served_model_name=cfg.model.served_model_name or d.resolve().name,
        model_dir=str(d), max_model_len=max_len, model_fingerprint=model_fingerprint(d),
        block_size=cfg.cache.block_size, architecture=arch, is_multimodal=rendering.is_multimodal(hf),
    )


class EngineClient(Protocol):
    model_info: ModelInfo

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream incremental outputs; the last one has finished=True. Cancelling the iterator aborts."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def snapshot(self) -> dict:
        """Cache state for router resync, as `events.Snapshot.to_json()`."""
        ...

    async def check_health(self) -> bool: ...
