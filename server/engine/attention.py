"""Attention over the paged KV cache: per-step metadata and the CPU backend (gather + SDPA).

The model calls `backend.forward(q, k, v, layer_cache, meta)` and never sees block tables.
`AttentionBackend` is the protocol (`allocate`, `forward`); the CPU backend below is its only
implementation today (a GPU one, e.g. Paddle's fused block attention, would implement the same).

Cache layout per layer: `key`, `value` of shape [num_blocks * block_size, num_kv_heads, head_dim]
("slots"); slot = block_id * block_size + offset_in_block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Protocol

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
class DecodeBatch:
    """All single-token sequences of a step, attended in one padded batch instead of one by one."""

    rows: paddle.Tensor  # int64 [B]: their rows in the flattened step tensors
    slots: paddle.Tensor  # int64 [B * max_context]: context slots, padded with slot 0
    mask: paddle.Tensor  # additive float32 [B, 1, 1, max_context]: -inf on padding
    max_context: int


@dataclass
class AttentionMetadata:
    slot_mapping: paddle.Tensor  # int64 [T]: where each new token's K/V is written
    seqs: list[SeqAttention] = field(default_factory=list)  # sequences with several new tokens (prefill)
    decode: Optional[DecodeBatch] = None  # sequences with one new token
    num_tokens: int = 0

    @classmethod
    def build(cls, block_size: int, batch: list[tuple[list[int], int, int]]) -> "AttentionMetadata":
        """batch: per sequence (block table, num tokens already with KV, num new tokens)."""
        slots_all: list[np.ndarray] = []
        seqs: list[SeqAttention] = []
        decode_rows: list[int] = []
        decode_slots: list[np.ndarray] = []
        start = 0
        for block_table, num_computed, num_new in batch:
            ctx = num_computed + num_new
            bt = np.asarray(block_table, dtype=np.int64)
            pos = np.arange(ctx, dtype=np.int64)
            slots = bt[pos // block_size] * block_size + pos % block_size
            slots_all.append(slots[num_computed:])
            if num_new == 1:
                decode_rows.append(start)
                decode_slots.append(slots)
                start += 1
                continue
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
        decode = None
        if decode_rows:
            width = max(len(x) for x in decode_slots)
            padded = np.zeros((len(decode_rows), width), dtype=np.int64)
            mask = np.full((len(decode_rows), width), -np.inf, dtype=np.float32)
            for i, x in enumerate(decode_slots):
                padded[i, :len(x)] = x
                mask[i, :len(x)] = 0.0
            decode = DecodeBatch(paddle.to_tensor(np.asarray(decode_rows, dtype=np.int64)),
                                 paddle.to_tensor(padded.reshape(-1)), paddle.to_tensor(mask[:, None, None, :]),
                                 width)
        return cls(paddle.to_tensor(np.concatenate(slots_all)), seqs, decode, start)


@contextlib.contextmanager
def dense_transposes():
    """Run Paddle ops without stride kernels, then restore them.

    NOTE: with stride kernels a transpose is a view, and Paddle's CPU matmul on such views takes a
    slow path (decode attention ~10x slower); real transposes are cheap. The flag is restored
    because other code (safetensors loading) needs stride kernels.
    """
    paddle.set_flags({"FLAGS_use_stride_kernel": False})
    try:
        yield
    finally:
        paddle.set_flags({"FLAGS_use_stride_kernel": True})


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
        with dense_transposes():
            return self._forward(q, k, v, cache, meta, scale)

    def _forward(self, q, k, v, cache, meta, scale):
        cache.key.scatter_(meta.slot_mapping, k, overwrite=True)
        cache.value.scatter_(meta.slot_mapping, v, overwrite=True)
        num_heads, num_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
        rep = num_heads // num_kv  # query head h reads kv head h // rep (grouped-query attention)
        rows, outs = [], []
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
            rows.append(np.arange(s.query_start, s.query_start + s.query_len))
        d = meta.decode
        if d is not None:
            b = int(d.rows.shape[0])
            # a group's query heads are the rows of one matmul against its kv head: no broadcasting
            qd = paddle.gather(q, d.rows).reshape([b, num_kv, rep, head_dim])
            kd = paddle.gather(cache.key, d.slots).reshape([b, d.max_context, num_kv, head_dim])
            vd = paddle.gather(cache.value, d.slots).reshape([b, d.max_context, num_kv, head_dim])
            kd = kd.transpose([0, 2, 1, 3])  # [B, Hkv, C, D]
            vd = vd.transpose([0, 2, 1, 3])
            scores = paddle.matmul(qd, kd, transpose_y=True) * scale + d.mask  # [B, Hkv, rep, C]
            probs = F.softmax(scores.astype("float32"), axis=-1).astype(qd.dtype)
            outs.append(paddle.matmul(probs, vd).reshape([b, num_heads, head_dim]))
            if not meta.seqs:
                return outs[0] if b == meta.num_tokens else _place(outs[0], d.rows, meta.num_tokens)
            rows.append(d.rows.numpy())
        if d is None and len(meta.seqs) == 1:
            return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        order = paddle.to_tensor(np.concatenate(rows))
        return _place(paddle.concat(outs, axis=0), order, meta.num_tokens)


def _place(values: paddle.Tensor, rows: paddle.Tensor, num_rows: int) -> paddle.Tensor:
    """Rows `rows` of a new [num_rows, ...] tensor set to `values` (every row is covered by the caller)."""
    out = paddle.zeros([num_rows, *values.shape[1:]], dtype=values.dtype)
    return paddle.scatter(out, rows, values, overwrite=True)
