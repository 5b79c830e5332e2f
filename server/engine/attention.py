"""Attention over the paged KV cache: per-step metadata and the CPU backend (gather + SDPA).

The model calls `backend.forward(q, k, v, layer_cache, meta)` and never sees block tables.
A GPU backend (Paddle's fused block attention) implements the same two methods.

Cache layout per layer: `key`, `value` of shape [num_blocks * block_size, num_kv_heads, head_dim]
("slots"); slot = block_id * block_size + offset_in_block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import paddle
import paddle.nn.functional as F


@dataclass
class LayerCache:
    key: paddle.Tensor  # [num_slots, num_kv_heads, head_dim]
    value: paddle.Tensor  # [num_slots, num_kv_heads, head_dim]


QUERY_CHUNK = 256  # queries per attention tile on CPU: skips masked-out keys and bounds memory


@dataclass
class QueryTile:
    """Queries [start, end) of a sequence (relative to its first new token) attend to keys [0, key_end)."""

    start: int
    end: int
    key_end: int
    mask: paddle.Tensor | None  # additive [end-start, key_end] causal mask; None when nothing is masked


@dataclass
class SeqAttention:
    """One sequence's slice of a flattened step batch."""

    query_start: int  # first row of this sequence in the flattened [T, ...] step tensors
    query_len: int  # new tokens computed this step
    context_len: int  # tokens with KV after this step (cached + new)
    context_slots: paddle.Tensor  # int64 [context_len]: slot of every context token, in order
    tiles: list[QueryTile]


@dataclass
class AttentionMetadata:
    slot_mapping: paddle.Tensor  # int64 [T]: where each new token's K/V is written
    seqs: list[SeqAttention] = field(default_factory=list)

    @classmethod
    def build(cls, block_size: int, batch: list[tuple[list[int], int, int]]) -> "AttentionMetadata":
        """batch: per sequence (block table, num tokens already with KV, num new tokens)."""
        slots_all: list[np.ndarray] = []
        seqs: list[SeqAttention] = []
        start = 0
        for block_table, num_computed, num_new in batch:
            ctx = num_computed + num_new
            bt = np.asarray(block_table, dtype=np.int64)
            pos = np.arange(ctx, dtype=np.int64)
            slots = bt[pos // block_size] * block_size + pos % block_size
            slots_all.append(slots[num_computed:])
            tiles = []
            for t0 in range(0, num_new, QUERY_CHUNK):
                t1 = min(num_new, t0 + QUERY_CHUNK)
                key_end = num_computed + t1  # causal: the tile's last query sees keys up to itself
                mask = None
                if t1 - t0 > 1:
                    q_pos = np.arange(num_computed + t0, key_end)[:, None]
                    m = np.where(pos[None, :key_end] <= q_pos, 0.0, -np.inf).astype(np.float32)
                    mask = paddle.to_tensor(m)
                tiles.append(QueryTile(t0, t1, key_end, mask))
            seqs.append(SeqAttention(start, num_new, ctx, paddle.to_tensor(slots), tiles))
            start += num_new
        return cls(paddle.to_tensor(np.concatenate(slots_all)), seqs)


class AttentionBackend(Protocol):
    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> LayerCache: ...

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, cache: LayerCache,
                meta: AttentionMetadata, scale: float) -> paddle.Tensor: ...


class CpuPagedAttention:
    """Writes new K/V into their slots, then per sequence gathers its context and runs SDPA."""

    def allocate(self, num_blocks, block_size, num_kv_heads, head_dim, dtype):
        shape = [num_blocks * block_size, num_kv_heads, head_dim]
        return LayerCache(paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype))

    def forward(self, q, k, v, cache, meta, scale):
        """q: [T, Hq, D]; k, v: [T, Hkv, D] → [T, Hq, D]."""
        cache.key.scatter_(meta.slot_mapping, k, overwrite=True)
        cache.value.scatter_(meta.slot_mapping, v, overwrite=True)
        num_heads, num_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
        rep = num_heads // num_kv  # query head h reads kv head h // rep (grouped-query attention)
        outs = []
        for s in meta.seqs:
            qs = q[s.query_start: s.query_start + s.query_len]  # [L, Hq, D]
            # [Hkv, rep, L, D]: each kv head serves its group of query heads without copying K/V
            qg = qs.reshape([s.query_len, num_kv, rep, head_dim]).transpose([1, 2, 0, 3])
            kh = paddle.gather(cache.key, s.context_slots).transpose([1, 0, 2]).unsqueeze(1)  # [Hkv, 1, C, D]
            vh = paddle.gather(cache.value, s.context_slots).transpose([1, 0, 2]).unsqueeze(1)
            for t in s.tiles:
                scores = paddle.matmul(qg[:, :, t.start:t.end], kh[:, :, :t.key_end], transpose_y=True) * scale
                if t.mask is not None:
                    scores = scores + t.mask
                probs = F.softmax(scores.astype("float32"), axis=-1).astype(qg.dtype)
                o = paddle.matmul(probs, vh[:, :, :t.key_end])  # [Hkv, rep, tile, D]
                outs.append(o.transpose([2, 0, 1, 3]).reshape([t.end - t.start, num_heads, head_dim]))
        return paddle.concat(outs, axis=0)
