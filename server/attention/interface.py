"""The attention-backend interface: what the model runner and the models see of a backend; no paddle import.

A backend owns everything that depends on how K/V sit in memory:

    model runner                                      backend
    sizes both pools (KVLayout.bytes_per_block)
    allocates the primary pool and the swap tier  ->  allocate(layout, n), allocate_swap(layout, n)
    executes the step's SwapPlan                  ->  copy_blocks(src, src_ids, dst, dst_ids, block_size)
    moves blocks to and from the node tier        ->  read_blocks(caches, ids, bs), write_blocks(caches, ids, data, bs)
    describes the step's sequences (SeqSpan)      ->  build_metadata(block_size, spans, samples)
    runs the whole step inside                    ->  step(): process-wide settings the backend needs
    model (each decoder layer)                    ->  forward(q, k, v, cache, meta, scale)

Models import only this module. They pass `LayerCache` objects and the metadata through without
looking inside, except `meta.sampled` (see `AttentionMetadata`). Backends are chosen by name in
`registry`; adding one touches neither the scheduler nor the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, NamedTuple, Optional, Protocol, Sequence

from ..config import DTYPE_BYTES

if TYPE_CHECKING:
    import paddle


@dataclass
class KVLayout:
    """Shape of the KV cache every backend allocates: per layer, K and V of `block_size` tokens per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: str  # a --dtype name

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers; pool sizing divides by it, so allocations must match it."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


def wire_dtype(layout: KVLayout) -> str:
    """dtype of node-tier block bytes: the cache's own, bfloat16 widened to float32 (exact; numpy has no bfloat16)."""
    return "float32" if layout.dtype == "bfloat16" else layout.dtype


def wire_layout(layout: KVLayout) -> str:
    """Names the shape of node-tier block bytes; an entry stored under another name is never read as this one."""
    return (f"kv1:{wire_dtype(layout)}:{layout.num_layers}x2x{layout.num_kv_heads}x{layout.block_size}"
            f"x{layout.head_dim}")


@dataclass
class LayerCache:
    """One layer's K and V; their shape and device are the backend's own (see its module docstring)."""

    key: Any
    value: Any


class SeqSpan(NamedTuple):
    """One sequence of a step: where its KV lives and which of its tokens are computed now."""

    block_table: Sequence[int]  # block ids in token order
    num_computed: int  # tokens that already have KV in the cache
    num_new: int  # tokens computed this step (their KV is written by forward)


class AttentionMetadata(Protocol):
    """A step's metadata, built once per step by the backend that reads it; opaque to the model except:

    `sampled`: the last layer's view when only the sampling rows continue past its K/V write
    (model.forward(sample_rows=...)): the same K/V writes, queries only for those rows.
    Built when `build_metadata` gets `samples`; None otherwise.
    """

    sampled: Optional["AttentionMetadata"]


class AttentionBackend(Protocol):
    name: str  # the registry name (--attention-backend)

    def allocate(self, layout: KVLayout, num_blocks: int) -> list[LayerCache]:
        """The primary pool on the model's device: one LayerCache per layer, `num_blocks` blocks each."""
        ...

    def allocate_swap(self, layout: KVLayout, num_blocks: int) -> list[LayerCache]:
        """The swap tier in host memory, in the layout `copy_blocks` moves blocks between."""
        ...

    def copy_blocks(self, src: list[LayerCache], src_ids: Sequence[int], dst: list[LayerCache],
                    dst_ids: Sequence[int], block_size: int) -> None:
        """Copy block src_ids[i] of every layer of `src` into block dst_ids[i] of `dst` (either tier to either)."""
        ...

    def read_blocks(self, caches: list[LayerCache], ids: Sequence[int], block_size: int) -> list[bytes]:
        """The node tier's bytes of each block in `ids`: every layer's K then V, [layers, 2, kv_heads, block_size,
        head_dim] in C order, in `wire_dtype(layout)` (backend-independent, so any replica of the model reads them)."""
        ...

    def write_blocks(self, caches: list[LayerCache], ids: Sequence[int], data: Sequence[bytes],
                     block_size: int) -> None:
        """Write `read_blocks`' bytes of one block each into blocks `ids` of `caches`."""
        ...

    def build_metadata(self, block_size: int, spans: Sequence[SeqSpan],
                       samples: Optional[Sequence[bool]] = None) -> AttentionMetadata:
        """The step's metadata; the step's query rows are the spans' new tokens, in order.

        `samples` (per span: does its last new row sample?) also builds `sampled`.
        """
        ...

    def step(self) -> ContextManager[None]:
        """Context the runner runs a whole step in (swaps and forward), for settings the backend's ops need."""
        ...

    def forward(self, q: "paddle.Tensor", k: "paddle.Tensor", v: "paddle.Tensor", cache: LayerCache,
                meta: AttentionMetadata, scale: float) -> "paddle.Tensor":
        """Write k, v [T, Hkv, D] of the new tokens into `cache`, then attend: q [T or N, Hq, D] -> same shape."""
        ...
