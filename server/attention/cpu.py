"""The `cpu` attention backend: paged KV cache in Paddle ops, per-step metadata, swap copies, gather + tiled attention.

Cache layout per layer: `key`, `value` of shape [num_kv_heads, num_blocks * block_size, head_dim],
head-major over "slots"; slot = block_id * block_size + offset_in_block. A gather of a context's
slots along axis 1 is already the [heads, context, head_dim] operand of the attention matmuls, so
no step transposes cached K/V (docs/performance.md). Writes and swap copies go through the
[num_kv_heads * slots, head_dim] view, row = head * slots + slot. The swap tier has the same layout
in host memory (pinned when a GPU is present); a swap copies a block's slots in every head.

Prefill tiles mask and take the softmax of their scores in numpy, in place on the same memory
(DLPack, no copy): on these [heads, queries, keys] blocks Paddle's CPU broadcast add and
softmax run 2-4x slower than numpy's vectorised loops (docs/performance.md), and the mask
only touches a tile's own keys. Decode rows (one query each) go through a compiled kernel that
reads their context in place (native.py, kernels/paged_decode.c) when it builds and the tensors are
float32 on the host; otherwise, and on a device, one padded batch of Paddle ops.

Everything but the numpy softmax and the decode kernel is plain Paddle ops with a device path, but
this backend has never run on a GPU; a GPU kernel belongs in a backend of its own name (registry.py).
Steps run without Paddle's stride kernels (`step()`, see `dense_transposes`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from .interface import KVLayout, LayerCache, SeqSpan

QUERY_CHUNK = 128  # queries per attention tile on CPU: skips masked-out keys, keeps the scores block small


@dataclass
class QueryTile:
    """Queries [start, end) of a sequence (relative to its first new token) attend to keys [0, key_end).

    Causality: the tile's last (end - start) keys are its own tokens (a lower triangle is visible);
    every key before them is visible to all of its queries.
    """

    start: int
    end: int
    key_end: int


@dataclass
class SeqAttention:
    """One sequence's slice of a flattened step batch.

        keys:    |<------------- context_len ------------->|
                 |<-- cached (num_computed) -->|<-- new -->|
        queries:                               |<-- new -->|   query_len rows from query_start
    """

    query_start: int  # first row of this sequence in the flattened [T, ...] step tensors
    query_len: int  # new tokens computed this step
    context_len: int  # tokens with KV after this step (cached + new)
    context_slots: Optional[paddle.Tensor]  # int64 [context_len]: slot of every context token; None: the new tokens
    tiles: list[QueryTile]


@dataclass
class ColdBatch:
    """Consecutive cold sequences of one equal length (<= QUERY_CHUNK), attended as one batch.

    Rows [start, start + num_seqs * length) of the step; each sequence's keys are exactly its own
    new tokens, so all share one causal triangle and no cache read.
    """

    start: int
    num_seqs: int
    length: int

    @classmethod
    def of(cls, seqs: Sequence["SeqAttention"]) -> Optional["ColdBatch"]:
        """The batch these prefill sequences form, or None when one of them does not fit it."""
        if len(seqs) < 2:
            return None
        n, first = seqs[0].query_len, seqs[0].query_start
        for i, s in enumerate(seqs):
            if s.context_slots is not None or s.query_len != n or n > QUERY_CHUNK or s.query_start != first + i * n:
                return None
        return cls(first, len(seqs), n)


@dataclass
class DecodeBatch:
    """Sequences with one query row each, attended in one padded batch instead of one by one."""

    rows: Optional[paddle.Tensor]  # int64 [B]: their rows in the step tensors; None when they are rows 0..B-1 of B
    row_ids: np.ndarray  # int64 [B]: the same rows on the host
    slots_host: np.ndarray  # int64 [B, max_context]: each row's context slots, padded with slot 0
    lens: np.ndarray  # int64 [B]: each row's context length
    max_context: int
    num_seqs: int

    @classmethod
    def build(cls, rows: list[int], slots: list[np.ndarray], num_tokens: int) -> "DecodeBatch":
        width = max(len(x) for x in slots)
        padded = np.zeros((len(rows), width), dtype=np.int64)
        for i, x in enumerate(slots):
            padded[i, :len(x)] = x
        row_ids = np.asarray(rows, dtype=np.int64)
        in_order = len(rows) == num_tokens  # then rows are 0..B-1: nothing to gather
        return cls(None if in_order else paddle.to_tensor(row_ids), row_ids, padded,
                   np.asarray([len(x) for x in slots], dtype=np.int64), width, len(rows))

    @functools.cached_property
    def slots(self) -> paddle.Tensor:
        """int64 [B * max_context]: `slots_host` flattened, for the Paddle-ops path (built on its first layer)."""
        return paddle.to_tensor(self.slots_host.reshape(-1))

    @functools.cached_property
    def mask(self) -> Optional[paddle.Tensor]:
        """Additive float32 [1, B, 1, max_context]: -inf on padding; None if no row is padded."""
        if (self.lens == self.max_context).all():
            return None
        pad = np.arange(self.max_context)[None, :] >= self.lens[:, None]
        return paddle.to_tensor(np.where(pad, -np.inf, 0.0).astype(np.float32)[None, :, None, :])


@dataclass
class CpuAttentionMetadata:
    slot_mapping: paddle.Tensor  # int64 [T]: where each new token's K/V is written
    slot_mapping_host: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the same on the host
    seqs: list[SeqAttention] = field(default_factory=list)  # sequences with several new tokens (prefill)
    decode: Optional[DecodeBatch] = None  # sequences with one new token
    cold: Optional[ColdBatch] = None  # replaces `seqs` when they are all cold, short, of one length, back to back
    num_tokens: int = 0  # query rows: T, or N for `sampled`
    # The last layer's view when only sampling rows continue (model.forward(sample_rows=...)):
    # the same K/V writes, then the N sampling rows (each sequence's last) as one decode batch.
    sampled: Optional["CpuAttentionMetadata"] = None
    # rows of the [heads * slots, D] cache view the new K/V go to, per (heads, slots): built once per step
    write_rows: dict = field(default_factory=dict)

    def rows_for(self, num_kv: int, num_slots: int) -> paddle.Tensor:
        """int64 [num_kv * T]: head h's K/V of new token t go to row h * num_slots + slot_mapping[t]."""
        key = (num_kv, num_slots)
        rows = self.write_rows.get(key)
        if rows is None:
            rows = self.write_rows[key] = paddle.to_tensor(_head_rows(self.slot_mapping_host, num_kv, num_slots))
        return rows

    @classmethod
    def build(cls, block_size: int, batch: Sequence[SeqSpan],
              samples: Optional[Sequence[bool]] = None) -> "CpuAttentionMetadata":
        """batch: per sequence (block table, num tokens already with KV, num new tokens).

        `samples` (per sequence: does its last new row sample?) also builds `sampled`.
        """
        slots_all: list[np.ndarray] = []
        seqs: list[SeqAttention] = []
        decode_rows: list[int] = []
        decode_slots: list[np.ndarray] = []
        sample_slots: list[np.ndarray] = []
        start = 0
        for i, (block_table, num_computed, num_new) in enumerate(batch):
            ctx = num_computed + num_new
            bt = np.asarray(block_table, dtype=np.int64)
            pos = np.arange(ctx, dtype=np.int64)
            slots = bt[pos // block_size] * block_size + pos % block_size
            slots_all.append(slots[num_computed:])
            if samples is not None and samples[i]:
                sample_slots.append(slots)
            if num_new == 1:
                decode_rows.append(start)
                decode_slots.append(slots)
                start += 1
                continue
            tiles = [QueryTile(t0, min(num_new, t0 + QUERY_CHUNK), num_computed + min(num_new, t0 + QUERY_CHUNK))
                     for t0 in range(0, num_new, QUERY_CHUNK)]
            # a cold sequence's context is exactly its new K/V: no gather from the cache
            seqs.append(SeqAttention(start, num_new, ctx, paddle.to_tensor(slots) if num_computed else None, tiles))
            start += num_new
        host = np.concatenate(slots_all)
        slot_mapping = paddle.to_tensor(host)
        cold = ColdBatch.of(seqs)
        meta = cls(slot_mapping, host, [] if cold else seqs,
                   DecodeBatch.build(decode_rows, decode_slots, start) if decode_rows else None, cold, start)
        if samples is not None:
            n = len(sample_slots)
            meta.sampled = cls(slot_mapping, host, [], DecodeBatch.build(list(range(n)), sample_slots, n) if n else None,
                               None, n, write_rows=meta.write_rows)  # the same K/V writes: share the rows
        return meta


STRIDE_KERNEL_FLAG = "FLAGS_use_stride_kernel"


@contextlib.contextmanager
def dense_transposes() -> Iterator[None]:
    """Run Paddle ops without stride kernels, then restore the flag's previous value.

    NOTE: with stride kernels a transpose is a view, and Paddle's CPU matmul on such views takes a
    slow path (decode attention ~10x slower); real transposes are cheap. The flag is restored
    because other code (safetensors loading) needs stride kernels.
    """
    before = paddle.get_flags([STRIDE_KERNEL_FLAG])[STRIDE_KERNEL_FLAG]
    paddle.set_flags({STRIDE_KERNEL_FLAG: False})
    try:
        yield
    finally:
        paddle.set_flags({STRIDE_KERNEL_FLAG: before})


class CpuPagedAttention:
    """Writes new K/V into their slots; each prefill sequence attends tile by tile, all decodes in one batch."""

    name = "cpu"

    def __init__(self, native: bool = True):
        """native: decode rows through the compiled kernel (native.py) when it builds; else Paddle ops."""
        self.name = "cpu" if native else "cpu-paddle"
        self._kernel = None
        if native:
            from .native import paged_decode_f32

            self._kernel = paged_decode_f32()

    def allocate(self, layout: KVLayout, num_blocks: int) -> list[LayerCache]:
        shape = [layout.num_kv_heads, num_blocks * layout.block_size, layout.head_dim]
        return [LayerCache(paddle.zeros(shape, dtype=layout.dtype), paddle.zeros(shape, dtype=layout.dtype))
                for _ in range(layout.num_layers)]

    def allocate_swap(self, layout: KVLayout, num_blocks: int) -> list[LayerCache]:
        shape = [layout.num_kv_heads, num_blocks * layout.block_size, layout.head_dim]
        return [LayerCache(_host_zeros(shape, layout.dtype), _host_zeros(shape, layout.dtype))
                for _ in range(layout.num_layers)]

    def copy_blocks(self, src: list[LayerCache], src_ids: Sequence[int], dst: list[LayerCache],
                    dst_ids: Sequence[int], block_size: int) -> None:
        if not src:
            return
        num_kv, head_dim = src[0].key.shape[0], src[0].key.shape[2]
        s = paddle.to_tensor(_head_rows(_block_slots(src_ids, block_size), num_kv, src[0].key.shape[1]))
        d = paddle.to_tensor(_head_rows(_block_slots(dst_ids, block_size), num_kv, dst[0].key.shape[1]))
        for a, b in zip(src, dst):
            for x, y in ((a.key, b.key), (a.value, b.value)):
                y.reshape([-1, head_dim]).scatter_(d, paddle.gather(x.reshape([-1, head_dim]), s).to(y.place),
                                                   overwrite=True)

    def read_blocks(self, caches: list[LayerCache], ids: Sequence[int], block_size: int) -> list[bytes]:
        if not ids:
            return []
        num_kv, slots, head_dim = caches[0].key.shape
        views = [_host_view(t) for c in caches for t in (c.key, c.value)]
        if all(v is not None for v in views):  # host float32: numpy slices of the cache's own memory
            idx = np.asarray(ids, dtype=np.int64)
            blocks = np.empty((len(ids), len(views), num_kv, block_size, head_dim), dtype=np.float32)
            for j, v in enumerate(views):  # one gather per layer's K or V, straight into the blocks' order
                blocks[:, j] = v.reshape(num_kv, slots // block_size, block_size, head_dim)[:, idx].transpose(1, 0, 2, 3)
            return [b.tobytes() for b in blocks]
        rows = paddle.to_tensor(_head_rows(_block_slots(ids, block_size), num_kv, slots))
        wire = "float32" if caches[0].key.dtype == paddle.bfloat16 else None
        per_layer = []
        for c in caches:
            for t in (c.key, c.value):
                x = paddle.gather(t.reshape([-1, head_dim]), rows)
                per_layer.append((x.astype(wire) if wire else x).numpy().reshape(num_kv, len(ids), block_size, head_dim))
        # [layers * 2, kv, n, bs, hd] -> [n, layers * 2, kv, bs, hd]: one contiguous run per block
        blocks = np.ascontiguousarray(np.stack(per_layer).transpose(2, 0, 1, 3, 4))
        return [b.tobytes() for b in blocks]

    def write_blocks(self, caches: list[LayerCache], ids: Sequence[int], data: Sequence[bytes],
                     block_size: int) -> None:
        if not ids:
            return
        num_kv, slots, head_dim = caches[0].key.shape
        dtype = caches[0].key.dtype
        wire = np.float32 if dtype == paddle.bfloat16 else np.dtype(str(dtype).replace("paddle.", ""))
        n = len(ids)
        arr = np.frombuffer(b"".join(data), dtype=wire).reshape(n, len(caches) * 2, num_kv, block_size, head_dim)
        views = [_host_view(t) for c in caches for t in (c.key, c.value)]
        if all(v is not None for v in views):  # host float32: written in place through numpy views
            idx = np.asarray(ids, dtype=np.int64)
            for j, v in enumerate(views):
                v.reshape(num_kv, slots // block_size, block_size, head_dim)[:, idx] = arr[:, j].transpose(1, 0, 2, 3)
            return
        rows = paddle.to_tensor(_head_rows(_block_slots(ids, block_size), num_kv, slots))
        for i, c in enumerate(caches):
            for j, t in enumerate((c.key, c.value)):
                vals = np.ascontiguousarray(arr[:, 2 * i + j].transpose(1, 0, 2, 3)).reshape(-1, head_dim)
                src = paddle.to_tensor(vals)
                t.reshape([-1, head_dim]).scatter_(rows, src.astype(dtype) if src.dtype != dtype else src, overwrite=True)

    def build_metadata(self, block_size: int, spans: Sequence[SeqSpan],
                       samples: Optional[Sequence[bool]] = None) -> CpuAttentionMetadata:
        return CpuAttentionMetadata.build(block_size, spans, samples)

    def step(self):
        return dense_transposes()

    def forward(self, q, k, v, cache, meta, scale):
        """q: [T, Hq, D]; k, v: [T, Hkv, D] → [T, Hq, D]. Fast only inside `step()` (stride kernels off)."""
        num_heads, num_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
        kt, vt = k.transpose([1, 0, 2]), v.transpose([1, 0, 2])  # [Hkv, T, D], the cache's order
        wr = meta.rows_for(num_kv, cache.key.shape[1])
        # the [Hkv * slots, D] views share the cache's memory: the writes land in the cache
        cache.key.reshape([-1, head_dim]).scatter_(wr, kt.reshape([-1, head_dim]), overwrite=True)
        cache.value.reshape([-1, head_dim]).scatter_(wr, vt.reshape([-1, head_dim]), overwrite=True)
        if meta.num_tokens == 0:  # only K/V to write (a prefill chunk that does not sample)
            return q
        rep = num_heads // num_kv  # query head h reads kv head h // rep (grouped-query attention)
        q = q * scale  # cheaper on the queries than on the [.., queries, keys] scores
        rows, outs = [], []
        for s in meta.seqs:
            qs = q[s.query_start: s.query_start + s.query_len]  # [L, Hq, D]
            # [Hkv, rep, L, D]: each kv head serves its group of query heads without copying K/V
            qg = qs.reshape([s.query_len, num_kv, rep, head_dim]).transpose([1, 2, 0, 3])
            if s.context_slots is None:  # [Hkv, C, D]
                kh, vh = (x[:, s.query_start: s.query_start + s.query_len] for x in (kt, vt))
            else:
                kh, vh = (paddle.gather(x, s.context_slots, axis=1) for x in (cache.key, cache.value))
            for t in s.tiles:
                n = t.end - t.start
                # a group's queries as the rows of one [rep * n, D] matrix per kv head (no broadcast matmul)
                qt = qg[:, :, t.start:t.end].reshape([num_kv, rep * n, head_dim])
                scores = paddle.matmul(qt, kh[:, :t.key_end], transpose_y=True)  # [Hkv, rep * n, keys]
                o = paddle.matmul(_causal_softmax_(scores, n), vh[:, :t.key_end])  # [Hkv, rep * n, D]
                outs.append(o.reshape([num_kv, rep, n, head_dim]).transpose([2, 0, 1, 3]).reshape([n, num_heads, head_dim]))
            rows.append(np.arange(s.query_start, s.query_start + s.query_len))
        c = meta.cold
        if c is not None:  # as the tiles above, with the sequences as a batch dimension
            b, n, end = c.num_seqs, c.length, c.start + c.num_seqs * c.length
            qc = q[c.start:end].reshape([b, n, num_kv, rep, head_dim]).transpose([0, 2, 3, 1, 4])
            kc, vc = (x[c.start:end].reshape([b, n, num_kv, head_dim]).transpose([0, 2, 1, 3]) for x in (k, v))
            scores = paddle.matmul(qc.reshape([b, num_kv, rep * n, head_dim]), kc, transpose_y=True)  # [B, Hkv, rep*n, n]
            o = paddle.matmul(_causal_softmax_(scores, n), vc)  # [B, Hkv, rep * n, D]
            outs.append(o.reshape([b, num_kv, rep, n, head_dim]).transpose([0, 3, 1, 2, 4])
                        .reshape([b * n, num_heads, head_dim]))
            rows.append(np.arange(c.start, end))
        d = meta.decode
        if d is not None:
            qd = q if d.rows is None else paddle.gather(q, d.rows)  # [B, Hq, D]
            if self._native_fits(qd):
                o = self._decode_native(qd, cache, d)
            else:
                o = _decode_ops(qd, cache, d, num_kv)
            if not meta.seqs and c is None:
                return o if d.rows is None else _place(o, d.rows, meta.num_tokens)
            outs.append(o)
            rows.append(d.row_ids)
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        order = np.concatenate(rows)
        if len(order) == meta.num_tokens and (order == np.arange(meta.num_tokens)).all():
            return out  # already in step order
        return _place(out, paddle.to_tensor(order), meta.num_tokens)

    def _native_fits(self, q: paddle.Tensor) -> bool:
        """The kernel takes float32 host tensors with head_dim a multiple of 8 up to 128."""
        head_dim = q.shape[-1]
        return (self._kernel is not None and q.dtype == paddle.float32 and q.place.is_cpu_place()
                and head_dim % 8 == 0 and head_dim <= 128)

    def _decode_native(self, q: paddle.Tensor, cache, d: DecodeBatch) -> paddle.Tensor:
        """The compiled kernel reads each row's context in place: no gathered K/V, no padded scores."""
        num_kv, num_slots, head_dim = cache.key.shape
        q = q if q.is_contiguous() else q.contiguous()
        out = paddle.empty(q.shape, dtype=q.dtype)
        rc = self._kernel(q.data_ptr(), cache.key.data_ptr(), cache.value.data_ptr(), d.slots_host.ctypes.data,
                          d.lens.ctypes.data, d.num_seqs, q.shape[1], num_kv, head_dim, num_slots, d.max_context,
                          out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decode attention failed ({rc}: -1 out of memory, -2 head_dim {head_dim} not "
                               "supported); run with --attention-backend cpu-paddle")
        return out


def _decode_ops(q: paddle.Tensor, cache, d: DecodeBatch, num_kv: int) -> paddle.Tensor:
    """Decode rows in Paddle ops: gather each row's padded context, one batched matmul per operand."""
    b, num_heads, head_dim = q.shape
    rep = num_heads // num_kv
    # a group's query heads are the rows of one matmul against its kv head: no broadcasting
    qd = q.reshape([b, num_kv, rep, head_dim]).transpose([1, 0, 2, 3])  # [Hkv, B, rep, D]: the small operand moves
    # a decode batch's scores are small: numpy's fixed cost per call would dominate
    kd, vd = (paddle.gather(x, d.slots, axis=1).reshape([num_kv, b, d.max_context, head_dim])
              for x in (cache.key, cache.value))  # [Hkv, B, C, D]
    scores = paddle.matmul(qd, kd, transpose_y=True)  # [Hkv, B, rep, C]
    probs = _softmax_fp32(scores if d.mask is None else scores + d.mask)
    return paddle.matmul(probs, vd).transpose([1, 0, 2, 3]).reshape([b, num_heads, head_dim])


def _block_slots(block_ids: Sequence[int], block_size: int) -> np.ndarray:
    """int64 [len(block_ids) * block_size]: every slot of the blocks, block by block."""
    ids = np.asarray(block_ids, dtype=np.int64)[:, None] * block_size + np.arange(block_size, dtype=np.int64)[None, :]
    return ids.reshape(-1)


def _head_rows(slots: np.ndarray, num_kv: int, num_slots: int) -> np.ndarray:
    """int64 [num_kv * len(slots)]: rows of `slots` in every head of a [num_kv * num_slots, D] cache view."""
    return (np.arange(num_kv, dtype=np.int64)[:, None] * num_slots + slots[None, :]).reshape(-1)


def _host_zeros(shape: list[int], dtype: str) -> paddle.Tensor:
    """Host memory for the swap tier: pinned when a GPU is present so copies can be asynchronous."""
    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return paddle.zeros(shape, dtype=dtype).pin_memory()
    return paddle.zeros(shape, dtype=dtype)


def _host_view(t: paddle.Tensor) -> Optional[np.ndarray]:
    """Writable numpy view of a host float32 tensor's memory (DLPack, no copy); None for anything else."""
    if t.dtype != paddle.float32 or not t.place.is_cpu_place():
        return None
    view = np.from_dlpack(t)
    return view if view.flags.writeable else None


@functools.lru_cache(maxsize=64)
def _upper_triangle(n: int) -> np.ndarray:
    """Additive causal mask of a tile's own keys: -inf above the diagonal."""
    return np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)


def _causal_softmax_(scores: paddle.Tensor, n: int) -> paddle.Tensor:
    """Softmax over keys of [.., n queries (fastest-varying rows), keys] scores whose last n keys
    are the queries' own tokens; in place on the host."""
    keys = scores.shape[-1]
    host = _host_view(scores)
    if host is not None:
        rows = host.reshape(-1, n, keys)
        rows[..., keys - n:] += _upper_triangle(n)
        _softmax_inplace(rows)
        return scores
    mask = np.concatenate([np.zeros((n, keys - n), np.float32), _upper_triangle(n)], axis=1)
    return _softmax_fp32(scores.reshape([-1, n, keys]) + paddle.to_tensor(mask)).reshape(scores.shape)


def _softmax_inplace(a: np.ndarray) -> None:
    np.subtract(a, a.max(axis=-1, keepdims=True), out=a)
    np.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)


def _softmax_fp32(scores: paddle.Tensor) -> paddle.Tensor:
    """Softmax over keys in float32 (no casts when the scores already are)."""
    if scores.dtype == paddle.float32:
        return F.softmax(scores, axis=-1)
    return F.softmax(scores.astype("float32"), axis=-1).astype(scores.dtype)


def _place(values: paddle.Tensor, rows: paddle.Tensor, num_rows: int) -> paddle.Tensor:
    """Rows `rows` of a new [num_rows, ...] tensor set to `values` (every row is covered by the caller)."""
    out = paddle.zeros([num_rows, *values.shape[1:]], dtype=values.dtype)
    return paddle.scatter(out, rows, values, overwrite=True)
