"""ModelRunner: owns every device tensor (weights, both KV tiers); runs one scheduled step.

Sizing is exact: bytes_per_block = 2 (K and V) × layers × block_size × kv_heads × head_dim × dtype
bytes; primary blocks = budget ÷ bytes_per_block, swap blocks = swap_space GiB ÷ bytes_per_block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import paddle

from ..config import DTYPE_BYTES, GiB, CacheConfig
from ..multimodal.mrope import positions_for_span
from .attention import AttentionBackend, AttentionMetadata, LayerCache, dense_transposes
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


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


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
    cpu = int(cfg.swap_space * GiB // bpb) if cfg.enable_prefix_caching else 0
    return gpu, cpu


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, layout: KVLayout, num_gpu_blocks: int,
                 num_cpu_blocks: int, seed: int = 0):
        self.model = model
        self.layout = layout
        self.backend = backend
        self.caches: list[LayerCache] = [
            self.backend.allocate(num_gpu_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim, layout.dtype)
            for _ in range(layout.num_layers)
        ]
        shape = [num_cpu_blocks * layout.block_size, layout.num_kv_heads, layout.head_dim]
        self.cpu_caches = [LayerCache(_host_zeros(shape, layout.dtype), _host_zeros(shape, layout.dtype))
                           for _ in range(layout.num_layers if num_cpu_blocks else 0)]
        self.rng = np.random.default_rng(seed)

    # ---- swap tier ------------------------------------------------------------------------
    def _slots(self, block_ids: list[int]) -> paddle.Tensor:
        bs = self.layout.block_size
        ids = np.asarray(block_ids, dtype=np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)[None, :]
        return paddle.to_tensor(ids.reshape(-1))

    def _copy(self, src: list[LayerCache], src_ids: list[int], dst: list[LayerCache], dst_ids: list[int]) -> None:
        s, d = self._slots(src_ids), self._slots(dst_ids)
        for a, b in zip(src, dst):
            b.key.scatter_(d, paddle.gather(a.key, s).to(b.key.place), overwrite=True)
            b.value.scatter_(d, paddle.gather(a.value, s).to(b.value.place), overwrite=True)

    def apply_swaps(self, plan: SwapPlan) -> None:
        """Swap-outs first (their source blocks may be reused by swap-ins of this same step)."""
        if plan.swap_out:
            g, c = zip(*plan.swap_out)
            self._copy(self.caches, list(g), self.cpu_caches, list(c))
        if plan.swap_in:
            c, g = zip(*plan.swap_in)
            self._copy(self.cpu_caches, list(c), self.caches, list(g))

    # ---- forward --------------------------------------------------------------------------
    @paddle.no_grad()
    def execute(self, out: SchedulerOutput, encoder_cache: Optional[EncoderCache] = None) -> StepLogits:
        """Run the step; returns the float32 logits of the last position of every request that samples."""
        with dense_transposes():
            return self._execute(out, encoder_cache)

    def _execute(self, out: SchedulerOutput, encoder_cache: Optional[EncoderCache]) -> StepLogits:
        self.apply_swaps(out.swap)
        if not out.scheduled:
            return StepLogits([], None)
        vl = hasattr(self.model, "encode_images")
        ids, pos, batch, last_rows, sampling = [], [], [], [], []
        pieces: list[tuple[int, Any]] = []
        row = 0
        for s in out.scheduled:
            r = s.request
            start, n = s.num_computed_before, s.num_tokens
            ids.extend(r.all_token_ids[start:start + n])
            if vl:
                pos.append(positions_for_span(r.mrope[0], r.mrope[1], start, start + n))
                pieces += self._image_pieces(r, start, n, row, encoder_cache)
            else:
                pos.extend(range(start, start + n))
            batch.append((r.block_ids, start, n))
            row += n
            if s.samples:
                last_rows.append(row - 1)
                sampling.append(r)
        # Only the sampling rows continue past the last layer's K/V write (AttentionMetadata.sampled).
        meta = AttentionMetadata.build(self.layout.block_size, batch, [s.samples for s in out.scheduled])
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
        if cache is not None:
            for sl in slices:
                cache.pin(r.request_id, sl.mm_hash)
        return [(row + sl.dst[0], embs[sl.index][sl.rows[0]:sl.rows[1]]) for sl in slices]


def _host_zeros(shape: list[int], dtype: str) -> paddle.Tensor:
    """Host memory for the swap tier: pinned when a GPU is present so copies can be asynchronous."""
    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return paddle.zeros(shape, dtype=dtype).pin_memory()
    return paddle.zeros(shape, dtype=dtype)


def kv_layout(model, block_size: int, dtype: str) -> KVLayout:
    return KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, block_size, dtype)


def log_sizes(layout: KVLayout, gpu: int, cpu: int, on_gpu: bool) -> None:
    log.info(
        "kv cache sized: primary=%d blocks (%s, %.2f GiB) swap=%d blocks (%.2f GiB) block_size=%d bytes_per_block=%d",
        gpu, "gpu" if on_gpu else "cpu", gpu * layout.bytes_per_block / GiB, cpu, cpu * layout.bytes_per_block / GiB,
        layout.block_size, layout.bytes_per_block)
