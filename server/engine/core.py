"""EngineCore: loads the model and wires scheduler, KV cache manager and runner into `step()`.

Runs in-process for the offline `LLM` and inside the engine-core process behind the HTTP API.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import paddle

from ..attention import registry as attention_backends
from ..config import EngineConfig, replica_id
from ..events import EventPublisher, Load, Snapshot
from ..multimodal.mrope import mrope_positions
from ..multimodal.wire import from_msgpack
from .block_pool import BlockPool
from ..cpu_math.process_setup import configure as configure_cpu
from .encoder_cache import EncoderCache
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner, kv_layout, log_sizes, num_blocks_for
from .protocol import EngineStats, GenerateRequest, read_model_info
from .request import Request, RequestOutput
from .sampler import sample_step
from .scheduler import Scheduler

log = logging.getLogger("warmfleet.engine")


class EngineCore:
    def __init__(self, cfg: EngineConfig, publisher: Optional[EventPublisher] = None):
        from ..models.loader import load_model
        from ..tokenizer import Tokenizer

        self.cfg = cfg
        self.info = read_model_info(cfg)
        self.publisher = publisher
        self.replica_id = publisher.replica_id if publisher else replica_id(cfg.server)
        configure_cpu(cfg.model.engine_threads)  # before the first matmul
        paddle.seed(cfg.model.seed)
        t0 = time.monotonic()
        backend = attention_backends.create(cfg.model.attention_backend)
        self.model, self.hf_config = load_model(cfg.model.model, backend, cfg.model.dtype)
        self.eos_token_ids = tuple(Tokenizer(cfg.model.model).eos_token_ids)
        on_gpu = paddle.device.get_device().startswith("gpu")
        layout = kv_layout(self.model, cfg.cache.block_size, cfg.model.dtype)
        gpu, cpu = num_blocks_for(cfg.cache, layout, on_gpu)
        log_sizes(layout, gpu, cpu, on_gpu)
        self.runner = ModelRunner(self.model, backend, layout, gpu, cpu, cfg.model.seed)
        self.node = self._start_node_tier(cfg, layout)
        self.pool = BlockPool(gpu, cpu, cfg.cache.enable_prefix_caching, cfg.cache.block_size,
                              node_tier=self.node is not None)
        self.kv = KVCacheManager(self.pool, cfg.cache.block_size, self.info.model_fingerprint, cfg.cache.prefix_hash_algo,
                                 self.node, self.runner.node_layout)
        self.lora_state, self.adapters = self._start_lora(cfg)
        self.runner.lora = self.lora_state
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.info.max_model_len, self.adapters)
        self.is_multimodal = self.info.is_multimodal  # rendering.is_multimodal: the config has a vision tower
        self.encoder_cache = EncoderCache(cfg.cache.max_encoder_cache) if self.is_multimodal else None
        self.num_steps = 0
        log.info("engine ready: model=%s arch=%s load_s=%.1f", self.info.served_model_name,
                 self.info.architecture, time.monotonic() - t0)

    def _start_node_tier(self, cfg: EngineConfig, layout):
        """The node-tier client (--node-tier), wired into the runner; None when off."""
        if cfg.cache.node_tier is None or not cfg.cache.enable_prefix_caching:
            return None
        import os

        from ..attention.interface import wire_layout
        from ..nodetier.client import NodeTierClient
        from ..nodetier.server import TOKEN_ENV

        node = NodeTierClient(cfg.cache.node_tier, cfg.cache.node_tier_timeout_ms / 1000.0,
                              os.environ.get(TOKEN_ENV) or None)
        self.runner.node, self.runner.node_layout = node, wire_layout(layout)
        log.info("node tier %s: evicted blocks go there, local misses look there (no swap tier)", cfg.cache.node_tier)
        return node

    def _start_lora(self, cfg: EngineConfig):
        """(LoraState, AdapterManager) with --lora-modules registered, or (None, None) without --enable-lora."""
        if not cfg.lora.enabled:
            return None, None
        from ..models.lora import LoraState, load_adapter
        from .adapters import AdapterManager

        state = LoraState(self.model, cfg.lora.max_loras)

        def load(name: str, path: str):
            weights = load_adapter(name, path, cfg.lora.max_lora_rank)
            state.check(weights)
            return weights

        adapters = AdapterManager(cfg.lora.max_loras, cfg.lora.num_cpu_loras, load, state.put, state.drop)
        for name, path in cfg.lora.modules().items():
            if name == self.info.served_model_name:
                raise ValueError(f"--lora-modules {name}=... uses the base model's served name")
            adapters.register(name, path)
            log.info("LoRA adapter %s from %s (%s)", name, path, adapters.adapters[name].id.digest)
        return state, adapters

    # ---- adapters -------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> dict:
        """Serve a PEFT adapter as `name` from now on; ValueError if LoRA is off, the name is taken or the files are bad."""
        if self.adapters is None:
            raise ValueError("this server was started without --enable-lora")
        if name == self.info.served_model_name:
            raise ValueError(f"{name!r} is the base model's name")
        a = self.adapters.register(name, path)
        return {"name": a.name, "path": a.path, "digest": a.id.digest}

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (running requests finish with it); KeyError if it is not loaded."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unregister(name)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, g: GenerateRequest) -> None:
        g.sampling_params.validate()
        if g.mm_placeholders and not self.is_multimodal:
            raise ValueError(f"{self.info.architecture} does not accept images")
        if len(g.mm_inputs) != len(g.mm_placeholders):
            raise ValueError(f"{len(g.mm_placeholders)} image placeholders but {len(g.mm_inputs)} images")
        images = [from_msgpack(m) if isinstance(m, dict) else m for m in g.mm_inputs]
        req = Request(g.request_id, list(g.prompt_token_ids), g.sampling_params, self.eos_token_ids,
                      g.cache_salt, list(g.mm_placeholders), images, time.time())
        if g.lora_name is not None:
            if self.adapters is None:
                raise ValueError(f"unknown model {g.lora_name!r}: this server serves no LoRA adapters")
            req.adapter = self.adapters.identity(g.lora_name)
        if self.is_multimodal:
            req.mrope = mrope_positions(req.num_prompt_tokens, req.mm_placeholders, [im.grid_thw for im in images],
                                        self.model.merge_size)
        if g.sampling_params.seed is not None:
            req.generator = np.random.default_rng(g.sampling_params.seed)
        self.scheduler.add_request(req)

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort(request_ids)

    @property
    def has_work(self) -> bool:
        """Requests to run, or blocks still to hand to the node tier (one more step reads them out)."""
        return self.scheduler.has_work or bool(self.pool.plan.node_out)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        try:
            step = self.runner.execute(out, self.encoder_cache)
        except Exception as exc:  # a model failure fails this step's requests, not the engine
            log.exception("step failed; aborting its %d requests", len(out.scheduled))
            ids = [s.request.request_id for s in out.scheduled]
            self.scheduler.abort(ids)
            results = self.scheduler.update(out, {})
            for r in results:
                if r.request_id in ids:
                    r.error = f"engine step failed: {exc}"
            self._release_finished(results)
            self._publish()
            return results
        sampled, lps = {}, {}
        if step.requests:
            tokens, logprobs = sample_step(step.logits, [r.sampling_params for r in step.requests],
                                           [r.generator or self.runner.rng for r in step.requests])
            for r, tok, lp in zip(step.requests, tokens, logprobs):
                sampled[r.request_id] = tok
                lps[r.request_id] = lp
        results = self.scheduler.update(out, sampled, lps)
        self._release_finished(results)
        self.num_steps += 1
        self._publish()
        return results

    def _release_finished(self, results: list[RequestOutput]) -> None:
        """Unpin the encoder-cache entries of requests that ended."""
        if self.encoder_cache is not None:
            for r in results:
                if r.finished:
                    self.encoder_cache.release(r.request_id)

    def _publish(self) -> None:
        events = self.pool.take_events()
        if self.encoder_cache is not None:
            events += self.encoder_cache.take_events()
        if self.publisher is not None and events:
            self.publisher.publish(events)

    # ---- introspection --------------------------------------------------------------------
    def load(self) -> Load:
        """The figures Load events carry, with the measured cost of one node-tier load once there was one."""
        s = self.scheduler
        return Load(len(s.running), len(s.waiting), self.pool.num_free_blocks, self.pool.num_gpu_blocks,
                    node_copy_cost(self.node))

    def publish_load(self) -> None:
        if self.publisher is not None:
            self.publisher.publish([self.load()])

    def stats(self) -> EngineStats:
        p, kv = self.pool, self.kv
        cpu_total = p.cpu.num_blocks if p.cpu else 0
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            gpu_blocks_total=p.num_gpu_blocks, gpu_blocks_free=p.num_free_blocks,
            cpu_blocks_total=cpu_total, cpu_blocks_free=cpu_total - (p.cpu.num_used if p.cpu else 0),
            prefix_queries_tokens=kv.num_query_tokens, prefix_hits_tokens_gpu=kv.num_hit_tokens_gpu,
            prefix_hits_tokens_cpu=kv.num_hit_tokens_cpu, prefix_hits_tokens_node=kv.num_hit_tokens_node,
            node_in_blocks=p.counters.node_in_blocks, node_out_blocks=p.counters.node_out_blocks,
            node_failures=self.node.counters.failures if self.node is not None else 0,
            node_encoder_hits=self.runner.node_encoder_hits,
            swap_in_blocks=p.counters.swap_in_blocks,
            swap_out_blocks=p.counters.swap_out_blocks, preemptions=self.scheduler.num_preemptions,
            kv_events_dropped=self.publisher.num_dropped if self.publisher is not None else 0,
            **self._encoder_stats(), **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        a = self.adapters
        if a is None:
            return {}
        waiting = {r.adapter.name: None for r in self.scheduler.waiting if r.adapter is not None}
        resident = a.resident_names
        return {"max_loras": a.max_loras, "running_lora_adapters": resident,
                "waiting_lora_adapters": [n for n in waiting if n not in resident],
                "lora_digests": {n: ad.id.digest for n, ad in a.adapters.items()},
                "lora_device_loads": a.num_device_loads, "lora_disk_loads": a.num_disk_loads}

    def _encoder_stats(self) -> dict:
        if self.encoder_cache is None:
            return {}
        st = self.encoder_cache.stats
        return {"encoder_cache_hits": st.num_hits, "encoder_cache_misses": st.num_misses,
                "encoder_cache_evictions": st.num_evictions, "encoder_cache_usage_tokens": st.usage_tokens,
                "encoder_cache_budget_tokens": st.budget_tokens}

    def snapshot(self) -> Snapshot:
        """Cache state for router resync. Events produced so far are published first, so `seq` covers them."""
        self._publish()
        gpu, cpu = self.pool.snapshot()
        seq = self.publisher.seq if self.publisher else 0
        return Snapshot(self.replica_id, seq, self.cfg.cache.block_size, self.info.model_fingerprint,
                        gpu, cpu, self.encoder_cache.mm_hashes() if self.encoder_cache else [], self.load(),
                        dict(self.pool.lora_of), self.cfg.server.node_name)


def node_copy_cost(node) -> Optional[float]:
    """Seconds one entry took to load from the node tier, on average since start (its client's gets that served
    entries; server/nodetier/client.py); None without a node tier or before the first entry it served."""
    c = node.counters if node is not None else None
    return c.get_seconds / c.get_entries if c is not None and c.get_entries else None
