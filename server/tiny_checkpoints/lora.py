"""Random PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) for a tiny checkpoint; no torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def make_tiny_adapter(model: str | Path, out: str | Path, rank: int = 8, seed: int = 0,
                      scale: float = 0.2) -> Path:
    """A LoRA on q/v of `model`'s language model (Qwen2 / Llama, or Qwen2-VL's), random A and B drawn from `seed`,
    with the tensor names `peft` saves for that architecture; written to `out` (created)."""
    from safetensors.numpy import save_file

    model, out = Path(model), Path(out)
    cfg = json.loads((model / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    prefix = "base_model.model.model.language_model" if "vision_config" in cfg else "base_model.model.model"
    h, heads = text["hidden_size"], text["num_attention_heads"]
    kv, hd = text.get("num_key_value_heads", heads), text.get("head_dim") or h // heads
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(text["num_hidden_layers"]):
        for proj, out_dim in (("q_proj", heads * hd), ("v_proj", kv * hd)):
            key = f"{prefix}.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, scale, (rank, h)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, scale, (out_dim, rank)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "modules_to_save": None}))
    return out
