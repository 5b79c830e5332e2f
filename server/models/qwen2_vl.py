"""Qwen2-VL and Qwen2.5-VL in Paddle: vision transformer + M-RoPE Qwen2 decoder; attribute names mirror HF tensor names.

    pixel_values [N, C*T*P*P], grids ─► visual ─► image embeddings [N / merge², hidden]
    input_ids ─► embed ─► rows of image pads replaced by image embeddings ─► decoder(positions [3, T])

Vision tower (HF `visual.*`): patch embedding (a Conv3d whose stride equals its kernel, i.e.
a matmul), 2-D rotary embeddings (row and column of each patch), pre-norm blocks attending
within one image (Qwen2.5-VL: within windows except `fullatt_block_indexes`), and the 2×2
patch merger. The decoder is `Qwen2ForCausalLM` with multimodal rotary positions: head-dim
frequencies are split into `mrope_section` = [t, h, w] parts, each rotated by its own axis.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..attention.interface import AttentionBackend
from .qwen2 import Linear, Qwen2ForCausalLM, RMSNorm, RotaryEmbedding, _param


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Flat decoder config: released checkpoints are flat, transformers v5 nests `text_config`."""
    flat = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    flat.update(config.get("text_config") or {})
    return flat


def mrope_section(config: dict[str, Any]) -> list[int]:
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    section = params.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError("a Qwen2-VL config needs rope_scaling.mrope_section with three entries")
    return [int(s) for s in section]


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over positions [3, T]: frequency j uses the t, h or w axis by `mrope_section`."""

    def __init__(self, config: dict[str, Any], head_dim: int):
        plain = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
        params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        if "rope_theta" in params:
            plain["rope_theta"] = params["rope_theta"]
        super().__init__(plain, head_dim)
        self.section = mrope_section(config)
        if sum(self.section) != head_dim // 2:
            raise ValueError(f"mrope_section {self.section} must sum to head_dim/2 = {head_dim // 2}")

    def cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """positions int64 [3, T] (or [T] for text-only steps) -> cos, sin float32 [T, 1, head_dim/2]."""
        if positions.ndim == 1:
            return super().cos_sin(positions)
        angles = positions.astype("float32").unsqueeze(-1) * self.inv_freq.reshape([1, 1, -1])  # [3, T, D/2]
        s0, s1, _ = self.section
        a = paddle.concat([angles[0, :, :s0], angles[1, :, s0:s0 + s1], angles[2, :, s0 + s1:]], axis=-1)
        return paddle.cos(a).unsqueeze(1), paddle.sin(a).unsqueeze(1)


class LayerNorm(nn.Layer):
    def __init__(self, dim: int, eps: float, dtype: str):
        super().__init__()
        self.weight = _param(self, [dim], dtype)
        self.bias = _param(self, [dim], dtype)
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class PatchEmbed(nn.Layer):
    """Conv3d with stride == kernel over [C, T, P, P] patches, computed as one matmul."""

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, dim: int, dtype: str):
        super().__init__()
        self.proj = nn.Layer()
        self.proj.weight = _param(self.proj, [dim, in_channels, temporal_patch_size, patch_size, patch_size], dtype)
        self.dim = dim

    def forward(self, x):
        return paddle.matmul(x.astype(self.proj.weight.dtype), self.proj.weight.reshape([self.dim, -1]), transpose_y=True)


class VisionAttention(nn.Layer):
    def __init__(self, dim: int, num_heads: int, dtype: str):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = Linear(dim, 3 * dim, True, dtype)
        self.proj = Linear(dim, dim, True, dtype)

    def forward(self, x, cos, sin, cu_seqlens: Sequence[int]):
        n = x.shape[0]
        qkv = self.qkv(x).reshape([n, 3, self.num_heads, self.head_dim])
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        scale = self.head_dim ** -0.5
        outs = []
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if e <= s:
                continue
            qh, kh, vh = (t[s:e].transpose([1, 0, 2]) for t in (q, k, v))  # [H, L, D]
            scores = paddle.matmul(qh, kh, transpose_y=True) * scale
            probs = F.softmax(scores.astype("float32"), axis=-1).astype(qh.dtype)
            outs.append(paddle.matmul(probs, vh).transpose([1, 0, 2]))
        return self.proj(paddle.concat(outs, axis=0).reshape([n, -1]))


class VisionMlp(nn.Layer):
    """Qwen2-VL: fc1 → quick_gelu (or another activation) → fc2."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: str):
        super().__init__()
        self.fc1 = Linear(dim, hidden, True, dtype)
        self.fc2 = Linear(hidden, dim, True, dtype)
        self.act = act

    def forward(self, x):
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionGatedMlp(nn.Layer):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), all with biases."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: str):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, True, dtype)
        self.up_proj = Linear(dim, hidden, True, dtype)
        self.down_proj = Linear(hidden, dim, True, dtype)
        self.act = act

    def forward(self, x):
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))


def activation(name: str, x):
    if name == "quick_gelu":
        return x * F.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    if name in ("gelu", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate=name != "gelu")
    raise ValueError(f"unsupported vision activation {name!r}")


class VisionBlock(nn.Layer):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, v25: bool, dtype: str):
        super().__init__()
        self.norm1 = RMSNorm(dim, 1e-6, dtype) if v25 else LayerNorm(dim, 1e-6, dtype)
        self.norm2 = RMSNorm(dim, 1e-6, dtype) if v25 else LayerNorm(dim, 1e-6, dtype)
        self.attn = VisionAttention(dim, num_heads, dtype)
        self.mlp = VisionGatedMlp(dim, mlp_hidden, act, dtype) if v25 else VisionMlp(dim, mlp_hidden, act, dtype)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Layer):
    """Norm, then each 2×2 group of consecutive patch rows → one LLM token: Linear, GELU, Linear."""

    def __init__(self, out_dim: int, context_dim: int, merge_size: int, v25: bool, dtype: str):
        super().__init__()
        self.hidden = context_dim * merge_size ** 2
        self.ln_q = RMSNorm(context_dim, 1e-6, dtype) if v25 else LayerNorm(context_dim, 1e-6, dtype)
        self.mlp = nn.LayerList([Linear(self.hidden, self.hidden, True, dtype), nn.GELU(),
                                 Linear(self.hidden, out_dim, True, dtype)])

    def forward(self, x):
        x = self.ln_q(x).reshape([-1, self.hidden])
        return self.mlp[2](F.gelu(self.mlp[0](x), approximate=False))


def vision_rotary_positions(grids: Sequence[Sequence[int]], merge_size: int) -> np.ndarray:
    """(row, col) of every patch row of pixel_values, in the processor's merge-window order: int64 [N, 2]."""
    out = []
    for t, h, w in grids:
        hpos = np.broadcast_to(np.arange(h)[:, None], (h, w))
        wpos = np.broadcast_to(np.arange(w)[None, :], (h, w))
        order = lambda a: a.reshape(h // merge_size, merge_size, w // merge_size, merge_size).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        out.append(np.tile(np.stack([order(hpos), order(wpos)], axis=-1), (t, 1)))
    return np.concatenate(out, axis=0)


def window_index(grids: Sequence[Sequence[int]], merge_size: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL: permutation of merged tokens grouping each window, and window boundaries in patch rows.

    `window` is in merged tokens per side (window_size // merge_size // patch_size).
    """
    index, cu = [], [0]
    base = 0
    unit = merge_size * merge_size
    for t, h, w in grids:
        gh, gw = h // merge_size, w // merge_size
        ids = np.arange(t * gh * gw).reshape(t, gh, gw)
        for ti in range(t):
            for wy in range(0, gh, window):
                for wx in range(0, gw, window):
                    block = ids[ti, wy:wy + window, wx:wx + window].reshape(-1)
                    index.append(block + base)
                    cu.append(cu[-1] + block.size * unit)
        base += t * gh * gw
    return np.concatenate(index), cu


class VisionTransformer(nn.Layer):
    """`visual.*` of Qwen2-VL (v25=False) or Qwen2.5-VL (v25=True)."""

    def __init__(self, vcfg: dict[str, Any], v25: bool, dtype: str):
        super().__init__()
        self.v25 = v25
        dim = int(vcfg["hidden_size"] if v25 else vcfg["embed_dim"])
        out_dim = int(vcfg["out_hidden_size"] if v25 else vcfg["hidden_size"])
        mlp_hidden = int(vcfg["intermediate_size"]) if v25 else int(dim * float(vcfg.get("mlp_ratio", 4)))
        num_heads = int(vcfg["num_heads"])
        self.merge_size = int(vcfg.get("spatial_merge_size", 2))
        self.patch_size = int(vcfg.get("patch_size", 14))
        self.out_dim = out_dim
        in_ch = int(vcfg.get("in_channels", vcfg.get("in_chans", 3)))
        self.patch_embed = PatchEmbed(in_ch, int(vcfg.get("temporal_patch_size", 2)), self.patch_size, dim, dtype)
        act = vcfg.get("hidden_act", "silu" if v25 else "quick_gelu")
        self.blocks = nn.LayerList([VisionBlock(dim, num_heads, mlp_hidden, act, v25, dtype)
                                    for _ in range(int(vcfg["depth"]))])
        self.merger = PatchMerger(out_dim, dim, self.merge_size, v25, dtype)
        head_dim = dim // num_heads
        rot_dim = head_dim // 2
        self.inv_freq = (1.0 / 10000.0 ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim)).astype(np.float32)
        self.window = int(vcfg.get("window_size", 112)) // self.merge_size // self.patch_size if v25 else 0
        self.fullatt = set(int(i) for i in vcfg.get("fullatt_block_indexes", [])) if v25 else set()

    def rotary(self, grids) -> tuple[paddle.Tensor, paddle.Tensor]:
        pos = vision_rotary_positions(grids, self.merge_size).astype(np.float32)  # [N, 2]
        freqs = (pos[:, :, None] * self.inv_freq[None, None, :]).reshape(pos.shape[0], -1)  # [N, head_dim/2]
        return paddle.to_tensor(np.cos(freqs)[:, None, :]), paddle.to_tensor(np.sin(freqs)[:, None, :])

    @paddle.no_grad()
    def forward(self, pixel_values: paddle.Tensor, grids: Sequence[Sequence[int]]) -> paddle.Tensor:
        """pixel_values [N, C*T*P*P] of all images in order → embeddings [N / merge², out_dim]."""
        grids = [tuple(int(v) for v in g) for g in grids]
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grids)
        cu_full = np.concatenate([[0], np.cumsum([h * w for t, h, w in grids for _ in range(t)])]).tolist()
        if not self.v25:
            for blk in self.blocks:
                x = blk(x, cos, sin, cu_full)
            return self.merger(x)
        unit = self.merge_size ** 2
        order, cu_win = window_index(grids, self.merge_size, self.window)
        rows = paddle.to_tensor((order[:, None] * unit + np.arange(unit)[None, :]).reshape(-1))
        x, cos, sin = paddle.gather(x, rows), paddle.gather(cos, rows), paddle.gather(sin, rows)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, cu_full if i in self.fullatt else cu_win)
        merged = self.merger(x)
        return paddle.gather(merged, paddle.to_tensor(np.argsort(order)))


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL: `Qwen2ForCausalLM` (model.*, lm_head) with M-RoPE plus the vision tower (visual.*).

    forward(input_ids, positions [3, T] or [T], caches, meta, inputs_embeds=None) -> hidden [T, H]
    encode_images(pixel_values list, grids) -> list of [tokens_i, H] embeddings
    embed_with_images(input_ids [T], pieces [(row, embeddings [n, H])]) -> inputs_embeds [T, H]
    """

    is_v25 = False

    def __init__(self, config: dict[str, Any], backend: AttentionBackend, dtype: str = "float32"):
        tcfg = text_config(config)
        # the parent's 1-D rotary does not know "mrope"; MRotaryEmbedding replaces it below
        super().__init__({k: v for k, v in tcfg.items() if k not in ("rope_scaling", "rope_parameters")},
                         backend, dtype)
        self.full_config = config
        self.rotary = MRotaryEmbedding(tcfg, self.head_dim)
        vcfg = config["vision_config"]
        self.visual = VisionTransformer(vcfg, self.is_v25, dtype)
        self.merge_size = self.visual.merge_size
        self.image_token_id = int(config.get("image_token_id", tcfg.get("image_token_id", -1)))
        if self.visual.out_dim != self.hidden_size:
            raise ValueError(f"vision output {self.visual.out_dim} != decoder hidden size {self.hidden_size}")

    @paddle.no_grad()
    def encode_images(self, pixel_values: Sequence[np.ndarray | paddle.Tensor],
                      grids: Sequence[Sequence[int]]) -> list[paddle.Tensor]:
        """Vision embeddings per image (one batched encoder pass)."""
        if not pixel_values:
            return []
        pv = paddle.concat([paddle.to_tensor(np.asarray(p)) if not isinstance(p, paddle.Tensor) else p
                            for p in pixel_values], axis=0)
        out = self.visual(pv, grids)
        sizes = [int(t * h * w) // self.merge_size ** 2 for t, h, w in grids]
        return list(paddle.split(out, sizes, axis=0))

    def embed_with_images(self, input_ids: paddle.Tensor,
                          pieces: Sequence[tuple[int, paddle.Tensor]]) -> paddle.Tensor:
        """Token embeddings with rows [row, row + n) replaced by each piece's image embeddings."""
        x = self.embed(input_ids)
        if not pieces:
            return x
        idx = np.concatenate([np.arange(r, r + int(e.shape[0])) for r, e in pieces])
        vals = paddle.concat([e.astype(x.dtype) for _, e in pieces], axis=0)
        return paddle.scatter(x, paddle.to_tensor(idx), vals, overwrite=True)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: windowed attention, RMSNorm and gated MLP in the vision tower; same decoder."""

    is_v25 = True

