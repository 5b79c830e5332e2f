"""ModelRunner: owns every device tensor (weights, both KV tiers); runs one scheduled step.

The attention backend (server/attention) decides how the KV tiers are laid out, allocates them,
copies swapped blocks and builds each step's metadata; the runner decides what and when.
Sizing is exact: bytes_per_block = 2 (K and V) × layers × block_size × kv_heads × head_dim × dtype
bytes; primary blocks = budget ÷ bytes_per_block, swap blocks = swap_space GiB ÷ bytes_per_block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import paddle

from ..attention.interface import AttentionBackend, KVLayout, LayerCache, SeqSpan
from ..config import GiB, CacheConfig
from ..multimodal.mrope import positions_for_span
from .block_pool import SwapPlan
from .encoder_cache import EncoderCache, image_slices
from .request import Request
from .scheduler import SchedulerOutput

log = logging.getLogger("warmfleet.engine")

DEFAULT_CPU_KV_GIB = 1.0


@dataclass
class StepLogits:
    """What a step hands the sampler: one logits row per sampling request, still a device tensor."""

    requests: list[Request]  # the requests that sample this step, in row order
    logits: Optional[paddle.Tensor]  # float32 [len(requests), vocab]; None when nobody samples


def num_blocks_for(cfg: CacheConfig, layout: KVLayout, on_gpu: bool) -> tuple[int, int]:
    """(primary blocks, swap blocks) from the flags."""
    bpb = layout.bytes_per_block
    if cfg.num_gpu_blocks is not None:
        gpu = cfg.num_gpu_blocks
    elif on_gpu:
        total = paddle.device.cuda.get_device_properties().total_memory
        used = paddle.device.cuda.memory_allocated()
        gpu = int((total * cfg.gpu_memory_utilization - used) // bpb)
    else:
        gpu = int((cfg.kv_cache_memory if cfg.kv_cache_memory is not None else DEFAULT_CPU_KV_GIB) * GiB // bpb)
    if gpu < 2:
        raise ValueError(f"the KV budget holds {gpu} blocks of {bpb} bytes; raise --kv-cache-memory or --num-gpu-blocks")
    # the node tier takes the swap tier's place
    cpu = int(cfg.swap_space * GiB // bpb) if cfg.enable_prefix_caching and cfg.node_tier is None else 0
    return gpu, cpu


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, layout: KVLayout, num_gpu_blocks: int,
                 num_cpu_blocks: int, seed: int = 0):
        self.model = model
        self.layout = layout
        self.backend = backend
        self.caches: list[LayerCache] = backend.allocate(layout, num_gpu_blocks)
        self.cpu_caches: list[LayerCache] = backend.allocate_swap(layout, num_cpu_blocks) if num_cpu_blocks else []
        self.rng = np.random.default_rng(seed)
        self.lora = None  # models/lora.py LoraState when the engine serves adapters
        self.node = None  # nodetier.client.NodeTierClient when the node tier is on: evicted blocks go there
        self.node_layout = ""  # attention.interface.wire_layout of the blocks it reads out
        self.node_encoder_hits = 0  # images whose encoder output the node tier served

    # ---- swap tier ------------------------------------------------------------------------
    def apply_swaps(self, plan: SwapPlan) -> None:
        """Swap-outs and node-tier reads first (their source blocks may be reused by swap-ins of this same step),
        then swap-ins and node-tier writes. Node-tier puts leave on the client's thread; this step does not wait."""
        bs = self.layout.block_size
        if plan.node_out and self.node is not None and self.node.breaker.allows():  # a tier that failed: no read-out
            data = self.backend.read_blocks(self.caches, [bid for bid, *_ in plan.node_out], bs)
            self.node.put_async([{"kind": "kv", "key": h, "layout": self.node_layout, "data": d, "lora": lora,
                                  "block_size": bs, "held": held} for (_, h, lora, held), d in zip(plan.node_out, data)])
        if plan.swap_out:
            g, c = zip(*plan.swap_out)
            self.backend.copy_blocks(self.caches, g, self.cpu_caches, c, bs)
        if plan.swap_in:
            c, g = zip(*plan.swap_in)
            self.backend.copy_blocks(self.cpu_caches, c, self.caches, g, bs)
        if plan.node_in:
            g, data = zip(*plan.node_in)
            self.backend.write_blocks(self.caches, g, data, bs)

    # ---- node tier: encoder outputs -------------------------------------------------------
    def _node_embedding(self, mm_hash: str, num_rows: int) -> Optional[paddle.Tensor]:
        """The node tier's encoder output of `mm_hash` ([num_rows, hidden] in the model's dtype), or None (a miss,
        a failure, or bytes of another shape: the encoder runs)."""
        hidden = int(self.model.hidden_size)
        wire = "float32" if self.layout.dtype == "bfloat16" else self.layout.dtype
        got = self.node.get("enc", [mm_hash], _enc_layout(wire, hidden))
        if not got or len(got[0]) != num_rows * hidden * np.dtype(wire).itemsize:
            return None
        self.node_encoder_hits += 1
        emb = paddle.to_tensor(np.frombuffer(got[0], dtype=wire).reshape(num_rows, hidden))
        return emb.astype(self.layout.dtype) if wire != self.layout.dtype else emb

    def _put_embedding(self, mm_hash: str, emb: paddle.Tensor) -> None:
        wire = "float32" if self.layout.dtype == "bfloat16" else self.layout.dtype
        rows = emb.astype(wire).numpy() if wire != self.layout.dtype else emb.numpy()
        self.node.put_async([{"kind": "enc", "key": mm_hash, "layout": _enc_layout(wire, int(rows.shape[-1])),
                              "data": rows.tobytes()}])

    # ---- forward --------------------------------------------------------------------------
    @paddle.no_grad()
    def execute(self, out: SchedulerOutput, encoder_cache: Optional[EncoderCache] = None) -> StepLogits:
        """Run the step; returns the float32 logits of the last position of every request that samples."""
        lora_step = None
        if self.lora is not None:
            from ..models.lora import LoraStep

            lora_step = LoraStep.build([(s.request.lora_slot, s.num_tokens, s.samples) for s in out.scheduled])
        with self.backend.step():
            if lora_step is None:
                return self._execute(out, encoder_cache)
            with self.lora.stepping(lora_step):
                return self._execute(out, encoder_cache)

    def _execute(self, out: SchedulerOutput, encoder_cache: Optional[EncoderCache]) -> StepLogits:
        self.apply_swaps(out.swap)
        if not out.scheduled:
            return StepLogits([], None)
        vl = hasattr(self.model, "encode_images")
        ids, pos, spans, last_rows, sampling = [], [], [], [], []
        pieces: list[tuple[int, Any]] = []
        row = 0
        for s in out.scheduled:
            r = s.request
            start, n = s.num_computed_before, s.num_tokens
            ids.extend(r.token_ids(start, start + n))
            if vl:
                pos.append(positions_for_span(r.mrope[0], r.mrope[1], start, start + n))
                pieces += self._image_pieces(r, start, n, row, encoder_cache)
            else:
                pos.extend(range(start, start + n))
            spans.append(SeqSpan(r.block_ids, start, n))
            row += n
            if s.samples:
                last_rows.append(row - 1)
                sampling.append(r)
        # Only the sampling rows continue past the last layer's K/V write (the metadata's `sampled`).
        meta = self.backend.build_metadata(self.layout.block_size, spans, [s.samples for s in out.scheduled])
        sample_rows = paddle.to_tensor(np.asarray(last_rows, dtype=np.int64))
        input_ids = paddle.to_tensor(np.asarray(ids, dtype=np.int64))
        if vl:
            positions = paddle.to_tensor(np.concatenate(pos, axis=1))
            embeds = self.model.embed_with_images(input_ids, pieces)
            hidden = self.model(None, positions, self.caches, meta, inputs_embeds=embeds, sample_rows=sample_rows)
        else:
            hidden = self.model(input_ids, paddle.to_tensor(np.asarray(pos, dtype=np.int64)), self.caches, meta,
                                sample_rows=sample_rows)
        if not sampling:
            return StepLogits([], None)
        return StepLogits(sampling, self.model.compute_logits(hidden))

    def _image_pieces(self, r: Request, start: int, n: int, row: int,
                      cache: Optional[EncoderCache]) -> list[tuple[int, Any]]:
        """(step row, embedding rows) for every image overlapping tokens [start, start+n) of `r`.

        Only the rows the span needs are used, so an image that is partly prefix-cached gets
        exactly its uncached rows. Encoder-cache hits skip the vision encoder entirely.
        """
        slices = image_slices(r.mm_placeholders, start, start + n)
        if not slices:
            return []
        embs: dict[int, Any] = {}
        misses = []
        for sl in slices:
            hit = cache.lookup(sl.mm_hash) if cache is not None else None
            if hit is None and self.node is not None:
                hit = self._node_embedding(sl.mm_hash, r.mm_placeholders[sl.index].length)
                if hit is not None and cache is not None:
                    cache.store(sl.mm_hash, hit, int(hit.shape[0]))
            if hit is not None:
                embs[sl.index] = hit
            else:
                misses.append(sl.index)
        if misses:
            imgs = [r.mm_inputs[i] for i in misses]
            for i, emb in zip(misses, self.model.encode_images([im.pixel_values for im in imgs],
                                                               [im.grid_thw for im in imgs])):
                embs[i] = emb
                if cache is not None:
                    cache.store(r.mm_placeholders[i].mm_hash, emb, int(emb.shape[0]))
                if self.node is not None:
                    self._put_embedding(r.mm_placeholders[i].mm_hash, emb)
        if cache is not None:
            for sl in slices:
                cache.pin(r.request_id, sl.mm_hash)
        return [(row + sl.dst[0], embs[sl.index][sl.rows[0]:sl.rows[1]]) for sl in slices]


def _enc_layout(emb_dtype: str, hidden: int) -> str:
    """Names the bytes of one image's encoder output in the node tier: [rows, hidden] of `emb_dtype`."""
    return f"enc1:{emb_dtype}:{hidden}"


def kv_layout(model, block_size: int, dtype: str) -> KVLayout:
    return KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, block_size, dtype)


def log_sizes(layout: KVLayout, gpu: int, cpu: int, on_gpu: bool) -> None:
    log.info(
        "kv cache sized: primary=%d blocks (%s, %.2f GiB) swap=%d blocks (%.2f GiB) block_size=%d bytes_per_block=%d",
        gpu, "gpu" if on_gpu else "cpu", gpu * layout.bytes_per_block / GiB, cpu, cpu * layout.bytes_per_block / GiB,
        layout.block_size, layout.bytes_per_block)
