"""Qwen2 / Qwen2.5 / Llama decoder in Paddle over the paged KV cache; attribute names mirror HF tensor names.

Parameters are keyed exactly like the safetensors files (linear weights kept as [in, out], the
transpose of the checkpoint's [out, in], see `Linear`), so loading is `param.set_value(tensor)`
per name. The model never sees block tables: the attention backend owns the cache and its
metadata; the model imports only the backend interface (server/attention/interface.py).

q/k/v and gate/up stay separate matmuls: merged ([512, 1024] instead of 512 + 256 + 256) they
ran 1.4-1.5x slower on MKL for 16-64 rows on the bench checkpoint (docs/performance.md).

    forward(input_ids [T], positions [T], caches, meta, sample_rows=None)
        -> hidden [T, H] after the final norm, or [N, H] for the N rows of `sample_rows`
    compute_logits(hidden [N, H]) -> logits [N, vocab] float32
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F
from paddle import nn

from ..config import DTYPES
from ..attention.interface import AttentionBackend, AttentionMetadata, LayerCache
from ..cpu_math import cpu_features, layout, onednn

log = logging.getLogger("warmfleet.engine")
FUSED_RMS_NORM_ON_CPU = cpu_features.runs("avx512f")  # Paddle's CPU fused_rms_norm is AVX-512 code (cpu_features.py)


def _param(layer: nn.Layer, shape: list[int], dtype: str) -> paddle.Tensor:
    p = layer.create_parameter(shape, dtype=dtype, default_initializer=nn.initializer.Constant(0.0))
    p.stop_gradient = True
    return p


class Linear(nn.Layer):
    """y = x @ W + b with W kept as [out, in] (the checkpoint's) or [in, out] (transposed once at load).

    `out_major` None: the checkpoint's layout where oneDNN will pack the weight after load
    (onednn.py), else whichever layout is faster here for this shape (layout.py times both once), the
    loader transposing when [in, out] wins (the parameter is marked `checkpoint_transposed`).
    """

    lora = None  # models/lora.py LoraLinear when the engine serves adapters on this projection

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, out_major: Optional[bool] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if out_major is None:
            out_major = onednn.available(dtype) or layout.out_major_is_faster(in_features, out_features, dtype)
        self.out_major = out_major
        self.weight = _param(self, [out_features, in_features] if out_major else [in_features, out_features], dtype)
        self.weight.checkpoint_transposed = not out_major
        self.bias = _param(self, [out_features], dtype) if bias else None
        self.packed: Optional[onednn.PackedWeight] = None
        self.epilogue: Optional[str] = None  # what the packed matmul applies to its output (onednn.EPILOGUES)

    def pack_onednn(self) -> int:
        """Move the loaded weight into oneDNN's layout (its plain copy is freed); bytes packed."""
        self.packed = onednn.PackedWeight(self.weight, self.out_major, self.bias, self.epilogue)
        self.weight._clear_data()
        return self.packed.nbytes

    def forward(self, x: paddle.Tensor, other: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        if self.lora is not None and self.lora.state.step is not None and self.lora.applies():
            return self.lora.forward(self, x, other)
        if self.packed is not None:
            return self.packed(x, other)
        y = layout.project(x, self.weight, self.out_major)
        return y + self.bias if self.bias is not None else y

    def project(self, x: paddle.Tensor) -> paddle.Tensor:
        """x @ W (+ b) without the packed epilogue (the LoRA path adds its deltas before it)."""
        if self.packed is not None:
            return self.packed.without_epilogue()(x)
        y = layout.project(x, self.weight, self.out_major)
        return y + self.bias if self.bias is not None else y


class Embedding(nn.Layer):
    """Token embeddings. `hidden_major` stores the table as [dim, vocab] (loaded transposed): the layout a
    tied output projection multiplies faster on some CPUs (layout.py); lookups then gather columns."""

    def __init__(self, num_embeddings: int, dim: int, dtype: str, hidden_major: bool = False):
        super().__init__()
        self.hidden_major = hidden_major
        self.weight = _param(self, [dim, num_embeddings] if hidden_major else [num_embeddings, dim], dtype)
        self.weight.checkpoint_transposed = hidden_major

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.hidden_major:
            return paddle.gather(self.weight, ids, axis=1).T.contiguous()  # [T, dim]: 43 ms of an 18 s 0.5B prefill
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Layer):
    """HF's Qwen2/Llama RMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype: str):
        super().__init__()
        self.weight = _param(self, [dim], dtype)
        self.eps = eps

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x32 = x.astype("float32")
        x32 = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=-1, keepdim=True) + self.eps)
        return self.weight * x32.astype(x.dtype)


class ResidualRMSNorm(RMSNorm):
    """The decoder's pre-norms: residual += x, then RMSNorm(residual); one fused op in float32.

    forward(x, residual) -> (normed, new residual); a None residual starts the stream at x.
    The fused kernel is used for float32 only, where it equals HF's (fp32 throughout); other
    dtypes keep HF's cast order. Paddle's CPU kernel of it is AVX-512 code: a CPU without AVX-512 takes
    the unfused ops, in the same float32 order (cpu_features.py).
    """

    def forward(self, x: paddle.Tensor, residual: Optional[paddle.Tensor] = None):
        if x.dtype == paddle.float32 and (FUSED_RMS_NORM_ON_CPU or not x.place.is_cpu_place()):
            if residual is None:
                return IF.fused_rms_norm(x, self.weight, None, self.eps, 1)[0], x
            return IF.fused_rms_norm(x, self.weight, None, self.eps, 1, residual=residual)
        residual = x if residual is None else residual + x
        return super().forward(residual), residual


def rope_inv_freq(config: dict[str, Any], head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim/2] float32 for rope types default, linear and llama3."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})  # transformers v5 layout
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    inv = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32)
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return (inv / np.float32(params["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = np.float32(params["factor"])
        low, high = np.float32(params["low_freq_factor"]), np.float32(params["high_freq_factor"])
        old_ctx = np.float32(params["original_max_position_embeddings"])
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Layer):
    """Non-interleaved ("rotate half") RoPE; cos/sin computed once per step in fp32.

    A multimodal subclass (M-RoPE) overrides `cos_sin` to accept positions [3, T].
    """

    def __init__(self, config: dict[str, Any], head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", paddle.to_tensor(rope_inv_freq(config, head_dim)), persistable=False)

    def cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """positions int64 [T] -> cos, sin float32 [T, 1, head_dim/2]."""
        angles = positions.astype("float32").unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        return paddle.cos(angles).unsqueeze(1), paddle.sin(angles).unsqueeze(1)

    def tables(self, positions: paddle.Tensor) -> "RopeTables":
        """The step's rotation, shared by every layer (see `RopeTables`)."""
        cos, sin = self.cos_sin(positions)
        return RopeTables(paddle.concat([cos, cos], axis=-1), paddle.concat([-sin, sin], axis=-1))

    @staticmethod
    def apply(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """x [T, H, D] -> rotated x, computed in fp32 and cast back."""
        x32 = x.astype("float32")
        x1, x2 = paddle.chunk(x32, 2, axis=-1)
        return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RopeTables:
    """Full-width rotation tables: rotate-half RoPE as x * cos + roll(x, D/2) * sin_signed.

        cos        [T, 1, D] = [cos | cos]
        sin_signed [T, 1, D] = [-sin | sin]
        roll(x, D/2) = [x2 | x1], so the halves are x1*cos - x2*sin and x2*cos + x1*sin,
        bit for bit what `RotaryEmbedding.apply` computes, in 4 ops instead of 10.

    NOTE: the tables are expanded to [T, H, D] once per step and head count: Paddle's CPU
    multiply is ~10x slower when it broadcasts (4 ns vs 0.4 ns per element).
    """

    def __init__(self, cos: paddle.Tensor, sin_signed: paddle.Tensor):
        self.cos, self.sin_signed = cos, sin_signed
        self._by_heads: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = {}

    def apply(self, x: paddle.Tensor) -> paddle.Tensor:
        """x [T, H, D] -> rotated x, in fp32 and cast back."""
        heads = x.shape[1]
        if heads not in self._by_heads:
            shape = [x.shape[0], heads, x.shape[2]]
            self._by_heads[heads] = paddle.expand(self.cos, shape), paddle.expand(self.sin_signed, shape)
        cos, sin = self._by_heads[heads]
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        out = x32 * cos + paddle.roll(x32, x.shape[-1] // 2, axis=-1) * sin
        return out if x.dtype == paddle.float32 else out.astype(x.dtype)


class Qwen2Attention(nn.Layer):
    def __init__(self, config: dict[str, Any], backend: AttentionBackend, dtype: str, biases: tuple[bool, bool]):
        super().__init__()
        h = config["hidden_size"]
        qkv_bias, o_bias = biases
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or h // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        self.scale = self.head_dim ** -0.5
        self.backend = backend
        self.q_proj = Linear(h, self.num_heads * self.head_dim, qkv_bias, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, qkv_bias, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, qkv_bias, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, o_bias, dtype)

    def forward(self, x, rope: RopeTables, cache: LayerCache, meta: AttentionMetadata,
                sample_rows: Optional[paddle.Tensor] = None):
        """x [T, H] -> [T, H]; with `sample_rows` (the last layer) K/V of all T rows are written
        but only those rows attend (`meta.sampled`), -> [N, H]."""
        t = x.shape[0]
        q = rope.apply(self.q_proj(x).reshape([t, self.num_heads, self.head_dim]))
        k = rope.apply(self.k_proj(x).reshape([t, self.num_kv_heads, self.head_dim]))
        v = self.v_proj(x).reshape([t, self.num_kv_heads, self.head_dim])
        if sample_rows is not None:
            q, meta = paddle.gather(q, sample_rows), meta.sampled
        out = self.backend.forward(q, k, v, cache, meta, self.scale)  # [T or N, Hq, D]
        return self.o_proj(out.reshape([out.shape[0], self.num_heads * self.head_dim]))


class Qwen2MLP(nn.Layer):
    def __init__(self, config: dict[str, Any], dtype: str):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        h, inter = config["hidden_size"], config["intermediate_size"]
        bias = bool(config.get("mlp_bias", False))
        self.gate_proj = Linear(h, inter, bias, dtype)
        self.up_proj = Linear(h, inter, bias, dtype)
        self.down_proj = Linear(inter, h, bias, dtype)
        # packed for oneDNN, the gate's matmul applies silu and the up's multiplies by it: no pass of their own
        self.gate_proj.epilogue, self.up_proj.epilogue = "silu", "mul"

    def forward(self, x):
        if self.up_proj.packed is not None:
            return self.down_proj(self.up_proj(x, self.gate_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Layer):
    def __init__(self, config: dict[str, Any], backend: AttentionBackend, dtype: str, biases: tuple[bool, bool]):
        super().__init__()
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.input_layernorm = ResidualRMSNorm(config["hidden_size"], eps, dtype)
        self.self_attn = Qwen2Attention(config, backend, dtype, biases)
        self.post_attention_layernorm = ResidualRMSNorm(config["hidden_size"], eps, dtype)
        self.mlp = Qwen2MLP(config, dtype)

    def forward(self, x, residual, rope, cache, meta, sample_rows=None):
        """(x, residual) -> (mlp output, residual): the residual add is left to the next norm.

        With `sample_rows`, only those rows continue after attention (their K/V and everyone's
        are still written), so both outputs have N rows.
        """
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, cache, meta, sample_rows)
        if sample_rows is not None:
            residual = paddle.gather(residual, sample_rows)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen2Model(nn.Layer):
    def __init__(self, config: dict[str, Any], backend: AttentionBackend, dtype: str, biases: tuple[bool, bool],
                 embed_hidden_major: bool = False):
        super().__init__()
        self.embed_tokens = Embedding(config["vocab_size"], config["hidden_size"], dtype, embed_hidden_major)
        self.layers = nn.LayerList(
            [Qwen2DecoderLayer(config, backend, dtype, biases) for _ in range(config["num_hidden_layers"])]
        )
        self.norm = ResidualRMSNorm(config["hidden_size"], float(config.get("rms_norm_eps", 1e-6)), dtype)


class Qwen2ForCausalLM(nn.Layer):
    """Qwen2/Qwen2.5 causal LM (q/k/v biases). `LlamaForCausalLM` is the same without them."""

    def __init__(self, config: dict[str, Any], backend: AttentionBackend, dtype: str = "float32"):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose from {DTYPES}")
        if dtype != "float32" and paddle.device.get_device().startswith("cpu"):
            # NOTE: Paddle 3.3's CPU matmul has no bfloat16/float16 kernel; fail here, not mid-request.
            raise ValueError(f"dtype {dtype} needs a GPU; Paddle's CPU kernels run float32 only (use --dtype float32)")
        self.config = config
        self.dtype_name = dtype
        self.hidden_size = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or self.hidden_size // self.num_heads
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        vocab_major = (onednn.available(dtype) or layout.out_major_is_faster(self.hidden_size, self.vocab_size, dtype)
                       or not paddle.device.get_device().startswith("cpu"))  # elsewhere: the checkpoint's layout
        self.model = Qwen2Model(config, backend, dtype, self.attention_biases(config),
                                embed_hidden_major=self.tie_word_embeddings and not vocab_major)
        self.rotary = RotaryEmbedding(config, self.head_dim)
        self.lm_head = (None if self.tie_word_embeddings
                        else Linear(self.hidden_size, self.vocab_size, False, dtype, out_major=vocab_major))
        self.tied_packed: Optional[onednn.PackedWeight] = None

    def pack_onednn(self) -> int:
        """Tied embeddings: a packed copy of the table for the output projection (lookups keep the plain one)."""
        if self.lm_head is not None:
            return 0
        table = self.model.embed_tokens
        self.tied_packed = onednn.PackedWeight(table.weight, out_major=not table.hidden_major)
        log.info("tied embeddings: the output projection uses a packed copy of the table (+%.0f MiB)",
                 self.tied_packed.nbytes / 2**20)
        return self.tied_packed.nbytes

    @staticmethod
    def attention_biases(config: dict[str, Any]) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): Qwen2 always biases q/k/v and never o_proj."""
        return True, False

    def embed(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        """Token embeddings [T, hidden]; the VL model splices image embeddings into these."""
        return self.model.embed_tokens(input_ids)

    @paddle.no_grad()
    def forward(self, input_ids: Optional[paddle.Tensor], positions: paddle.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata, inputs_embeds: Optional[paddle.Tensor] = None,
                sample_rows: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        """Hidden states [T, hidden] after the final norm; `inputs_embeds` overrides `input_ids`.

        `sample_rows` (int64 [N], with `meta` built with the same rows): only those rows are
        computed past the last layer's K/V write and returned, [N, hidden]; the logits of the
        other rows are never needed when they do not sample.
        """
        if len(caches) != self.num_layers:
            raise ValueError(f"got {len(caches)} layer caches for {self.num_layers} layers")
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        rope = self.rotary.tables(positions)
        residual = None
        last = len(caches) - 1
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches)):
            x, residual = layer(x, residual, rope, cache, meta, sample_rows if i == last else None)
        return self.model.norm(x, residual)[0]

    @paddle.no_grad()
    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        if self.tied_packed is not None:
            logits = self.tied_packed(hidden)
        elif self.lm_head is None:  # tied: the embedding table is the output projection
            table = self.model.embed_tokens
            logits = layout.project(hidden, table.weight, out_major=not table.hidden_major)
        else:
            logits = self.lm_head(hidden)
        return logits if logits.dtype == paddle.float32 else logits.astype("float32")

    def checkpoint_parameters(self) -> dict[str, paddle.Tensor]:
        """Checkpoint tensor name -> parameter to fill (names already match HF's)."""
        return dict(self.named_parameters())

    def ignored_checkpoint_key(self, name: str) -> bool:
        """Tensors a checkpoint may carry that this model does not need."""
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")


class LlamaForCausalLM(Qwen2ForCausalLM):
    """Llama 2/3/3.1: Qwen2's layout without q/k/v biases (unless `attention_bias`)."""

    @staticmethod
    def attention_biases(config: dict[str, Any]) -> tuple[bool, bool]:
        bias = bool(config.get("attention_bias", False))
        return bias, bias
