"""Offline inference: `LLM` runs the same EngineCore in-process, without HTTP or a second process."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from . import rendering
from .attention import registry as attention_backends
from .config import GiB, CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig, ServerConfig
from .engine.core import EngineCore
from .engine.protocol import GenerateRequest
from .engine.sampling_params import SamplingParams
from .outputs import OutputStream
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("warmfleet.offline")

Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: list[float] = field(default_factory=list)  # of each generated token, when sampling asked for logprobs


@dataclass
class LLMOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served from the prefix cache (both tiers)
    num_cached_tokens_cpu: int  # of which came from the CPU swap tier
    ttft_s: float  # seconds from submission to the first token of the first choice
    metrics: dict = field(default_factory=dict)


class LLM:
    """`LLM(model=DIR, enable_prefix_caching=True, swap_space=4)`; keyword names follow `warmfleet serve` flags."""

    def __init__(self, model: str, **kwargs):
        groups = {"model": ModelConfig(model=model), "cache": CacheConfig(), "scheduler": SchedulerConfig(),
                  "server": ServerConfig(), "lora": LoraConfig()}
        for k, v in kwargs.items():
            for g in groups.values():
                if hasattr(g, k):
                    setattr(g, k, v)
                    break
            else:
                raise TypeError(f"LLM() got an unknown option {k!r}")
        self.config = EngineConfig(**groups)
        self.config.validate()
        attention_backends.check(self.config.model.attention_backend)  # before any model is loaded
        self.engine = EngineCore(self.config)
        self.tokenizer = Tokenizer(model)
        self._ids = itertools.count()
        self._images = None  # ImageInputPreparer, made on the first chat with images

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Optional[SamplingParams] = None, cache_salt: Optional[str] = None,
                 lora_name: Union[None, str, Sequence[Optional[str]]] = None) -> list[LLMOutput]:
        """Complete each prompt (text or token ids); returns outputs in input order.

        `lora_name`: the adapter (a --lora-modules name) for every prompt, or one per prompt (None: base model).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [rendering.completion_ids(self.tokenizer, p) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
                       for p in prompts]
        return self._run(token_lists, sampling_params or SamplingParams(), cache_salt, loras=lora_name)

    def load_lora(self, name: str, path: str) -> dict:
        """Serve the PEFT adapter at `path` as `name` (needs enable_lora); its name, path and digest."""
        return self.engine.load_adapter(name, path)

    def chat(self, messages: Union[list[dict], list[list[dict]]], sampling_params: Optional[SamplingParams] = None,
             cache_salt: Optional[str] = None, lora_name: Union[None, str, Sequence[Optional[str]]] = None
             ) -> list[LLMOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate.

        Content parts may be OpenAI `image_url` parts (data: URIs, http(s), file:// under
        `allowed_local_media_path`) with an optional `uuid`, as over HTTP.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists, mm = [], []
        for conv in convs:
            if self.engine.is_multimodal:
                prepared = self._image_preparer().prepare(conv, cache_salt)  # type: ignore[arg-type]
                token_lists.append(prepared.prompt.prompt_token_ids)
                mm.append((prepared.prompt.mm_placeholders, prepared.images))
            else:
                token_lists.append(rendering.chat_ids(self.tokenizer, conv))  # type: ignore[arg-type]
                mm.append(([], []))
        return self._run(token_lists, sampling_params or SamplingParams(), cache_salt, mm, lora_name)

    def _image_preparer(self):
        if self._images is None:
            from .multimodal.inputs import ImageInputPreparer
            from .multimodal.media import MediaConfig, MediaLoader
            from .multimodal.processor import ImageProcessor
            from .multimodal.processor_cache import LocalProcessorCache

            budget = int(self.config.cache.max_processor_cache * GiB)
            self._images = ImageInputPreparer(
                self.tokenizer, ImageProcessor.from_model_dir(self.config.model.model),
                MediaLoader(MediaConfig.from_server_config(self.config.server)),
                LocalProcessorCache(budget) if budget > 0 else None, hash_algo=self.config.cache.prefix_hash_algo)
        return self._images

    def _run(self, token_lists: list[list[int]], sp: SamplingParams, salt: Optional[str],
             mm: Optional[list[tuple[list, list]]] = None,
             loras: Union[None, str, Sequence[Optional[str]]] = None) -> list[LLMOutput]:
        sp.validate()
        if loras is None or isinstance(loras, str):
            loras = [loras] * len(token_lists)
        if len(loras) != len(token_lists):
            raise ValueError(f"{len(loras)} lora names for {len(token_lists)} prompts")
        limit = self.engine.info.max_model_len
        streams: dict[str, tuple[int, int, OutputStream]] = {}
        results: list[LLMOutput] = []
        t0 = time.monotonic()
        for i, ids in enumerate(token_lists):
            if len(ids) + 1 > limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the context holds {limit}")
            rid = f"offline-{next(self._ids)}"
            results.append(LLMOutput(rid, ids, [], 0, 0, 0.0))
            for c in range(sp.n):
                sub = SamplingParams(**{**vars(sp), "n": 1, "seed": None if sp.seed is None else sp.seed + c})
                placeholders, images = mm[i] if mm else ([], [])
                self.engine.add_request(GenerateRequest(f"{rid}-{c}", ids, sub, salt, placeholders, images, loras[i]))
                streams[f"{rid}-{c}"] = (i, c, OutputStream(IncrementalDetokenizer(self.tokenizer), sp.stop))
        for r in results:
            r.outputs = [CompletionOutput(c, "", [], None) for c in range(sp.n)]
        while self.engine.has_work:
            for out in self.engine.step():
                i, c, stream = streams[out.request_id]
                delta = stream.push(out)
                res = results[i]
                comp = res.outputs[c]
                if not comp.token_ids and out.new_token_ids and c == 0:
                    res.ttft_s = time.monotonic() - t0
                comp.text += delta.text
                comp.token_ids += delta.token_ids
                comp.logprobs += [e.logprob for e in delta.logprobs]
                res.num_cached_tokens = stream.num_cached_tokens
                res.num_cached_tokens_cpu = stream.num_cached_tokens_cpu
                if stream.finished and comp.finish_reason is None:
                    comp.finish_reason = stream.finish_reason
                    if not out.finished:  # a stop string ended it; the engine must let go
                        self.engine.abort([out.request_id])
        return results

    def stats(self):
        return self.engine.stats()
