"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (config, safetensors, tokenizer, preprocessor config); no paddle, no torch.

Reuses `text` for the tokenizer (which reserves the vision tokens) and the text weights,
and adds a vision tower with HF's released tensor names (`visual.*`, `model.*`, `lm_head`).
Deterministic for a given (arch, size, seed), like the text checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..multimodal.processor import ImageProcessorConfig
from . import text

VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")

# Per size: mrope_section (sums to head_dim / 2), vision tower, and the image budget.
VL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(mrope_section=[2, 3, 3], vision_dim=32, vision_depth=2, vision_heads=2, vision_inter=64,
                 window_depth=4, fullatt=[1, 3], max_pixels=256 * 784),
    "bench": dict(mrope_section=[8, 12, 12], vision_dim=128, vision_depth=4, vision_heads=4, vision_inter=256,
                  window_depth=4, fullatt=[1, 3], max_pixels=1280 * 784),
}


def vl_config(arch: str, size: str, vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json in the flat layout the released Qwen2-VL / Qwen2.5-VL checkpoints use."""
    s, vs = text.SIZES[size], VL_SIZES[size]
    cfg = text._arch_config("qwen2", size, vocab, ids)
    cfg.update(
        rope_scaling={"type": "mrope", "mrope_section": list(vs["mrope_section"])},
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|vision_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
    )
    common = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3, in_channels=3,
                  initializer_range=s["initializer_range"])
    if arch == "qwen2_vl":
        cfg.update(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl")
        cfg["vision_config"] = dict(common, depth=vs["vision_depth"], embed_dim=vs["vision_dim"],
                                    num_heads=vs["vision_heads"], mlp_ratio=vs["vision_inter"] // vs["vision_dim"],
                                    hidden_size=s["hidden_size"], hidden_act="quick_gelu", model_type="qwen2_vl")
    elif arch == "qwen2_5_vl":
        cfg.update(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl")
        cfg["vision_config"] = dict(common, depth=vs["window_depth"], hidden_size=vs["vision_dim"],
                                    intermediate_size=vs["vision_inter"], num_heads=vs["vision_heads"],
                                    out_hidden_size=s["hidden_size"], hidden_act="silu", window_size=56,
                                    fullatt_block_indexes=list(vs["fullatt"]), tokens_per_second=2,
                                    model_type="qwen2_5_vl")
    else:
        raise ValueError(f"unknown VL arch {arch!r}; choose from {VL_ARCHS}")
    return cfg


def vision_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of the vision tower (`visual.*`) for either architecture."""
    v = config["vision_config"]
    v25 = config["model_type"] == "qwen2_5_vl"
    dim = v["hidden_size"] if v25 else v["embed_dim"]
    out_dim = v["out_hidden_size"] if v25 else v["hidden_size"]
    inter = v["intermediate_size"] if v25 else int(dim * v["mlp_ratio"])
    m2 = v["spatial_merge_size"] ** 2
    p = v["patch_size"]
    shapes: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": (dim, 3, v["temporal_patch_size"], p, p)}
    for i in range(v["depth"]):
        b = f"visual.blocks.{i}."
        for n in ("norm1", "norm2"):
            shapes[b + n + ".weight"] = (dim,)
            if not v25:
                shapes[b + n + ".bias"] = (dim,)
        shapes[b + "attn.qkv.weight"], shapes[b + "attn.qkv.bias"] = (3 * dim, dim), (3 * dim,)
        shapes[b + "attn.proj.weight"], shapes[b + "attn.proj.bias"] = (dim, dim), (dim,)
        if v25:
            for n in ("gate_proj", "up_proj"):
                shapes[b + f"mlp.{n}.weight"], shapes[b + f"mlp.{n}.bias"] = (inter, dim), (inter,)
            shapes[b + "mlp.down_proj.weight"], shapes[b + "mlp.down_proj.bias"] = (dim, inter), (dim,)
        else:
            shapes[b + "mlp.fc1.weight"], shapes[b + "mlp.fc1.bias"] = (inter, dim), (inter,)
            shapes[b + "mlp.fc2.weight"], shapes[b + "mlp.fc2.bias"] = (dim, inter), (dim,)
    shapes["visual.merger.ln_q.weight"] = (dim,)
    if not v25:
        shapes["visual.merger.ln_q.bias"] = (dim,)
    shapes["visual.merger.mlp.0.weight"], shapes["visual.merger.mlp.0.bias"] = (dim * m2, dim * m2), (dim * m2,)
    shapes["visual.merger.mlp.2.weight"], shapes["visual.merger.mlp.2.bias"] = (out_dim, dim * m2), (out_dim,)
    return shapes


def random_vision_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 init: norm scales near 1, everything else normal(0, initializer_range)."""
    rng = np.random.default_rng([seed, 1])
    std = float(config["vision_config"]["initializer_range"])
    out = {}
    for name, shape in sorted(vision_weight_shapes(config).items()):
        is_norm = ".norm" in name or ".ln_q." in name
        if is_norm and name.endswith(".weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif is_norm:
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = std * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def make_tiny_vl_model(out: str | Path, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0,
                       overrides: Optional[dict[str, Any]] = None) -> Path:
    """Write a random VL checkpoint to `out` and return its path (what `make-tiny-model --arch qwen2_vl` calls)."""
    out, vocab, tok, ids = text.start_checkpoint(out, arch, VL_ARCHS, size, VL_SIZES, what="VL arch")
    config = vl_config(arch, size, vocab, ids)
    config.update(overrides or {})
    weights = text.random_weights({**config, "model_type": "qwen2"}, seed)
    weights.update(random_vision_weights(config, seed))
    proc = ImageProcessorConfig(max_pixels=VL_SIZES[size]["max_pixels"]).to_hf_dict()
    if arch == "qwen2_5_vl":
        proc["processor_class"] = "Qwen2_5_VLProcessor"
    template = text.QWEN2_VL_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    return text.write_checkpoint(out, config, weights, tok, ids, template, extra={
        "preprocessor_config.json": proc, "chat_template.json": {"chat_template": template}})
