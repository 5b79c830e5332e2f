"""Checkpoint loading: config.json -> model class (registry), safetensors shards -> parameters.

A model class exposes `checkpoint_parameters()` (checkpoint name -> parameter) and
`ignored_checkpoint_key(name)`; everything else is generic. MODEL_REGISTRY lists every
architecture (the VL ones included) as "module:Class", imported on first use; `register_model`
adds one at run time (a model defined outside this package).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

from ..attention.interface import AttentionBackend
from ..cpu_math import onednn

logger = logging.getLogger("warmfleet.models")

# architectures[i] in config.json -> "module:Class" (imported on first use) or a class
MODEL_REGISTRY: dict[str, Any] = {
    "Qwen2ForCausalLM": "warmfleet.server.models.qwen2:Qwen2ForCausalLM",
    "LlamaForCausalLM": "warmfleet.server.models.qwen2:LlamaForCausalLM",
    "Qwen2VLForConditionalGeneration": "warmfleet.server.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "warmfleet.server.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
}


def register_model(architecture: str, cls: Any) -> None:
    """Make `load_model` build `cls` for checkpoints whose config.json names `architecture`."""
    MODEL_REGISTRY[architecture] = cls


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is {model_dir} a Hugging Face checkpoint directory?")
    return json.loads(path.read_text(encoding="utf-8"))


def resolve_architecture(config: dict[str, Any]) -> tuple[str, type]:
    """(architecture name, model class) for the first supported entry of config["architectures"]."""
    import importlib

    archs = config.get("architectures") or []
    for arch in archs:
        target = MODEL_REGISTRY.get(arch)
        if target is None:
            continue
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return arch, target
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """Shards named by model.safetensors.index.json, else every *.safetensors in the directory."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def load_weights(model: Any, files: list[Path], progress: Callable[[str], None] = logger.info) -> None:
    """Copy every checkpoint tensor into its parameter; raise on missing, unexpected or misshapen tensors."""
    from safetensors import safe_open
    import paddle

    params = model.checkpoint_parameters()
    loaded: set[str] = set()
    unexpected: list[str] = []
    total_bytes = sum(f.stat().st_size for f in files) or 1
    done_bytes = 0
    t0 = time.perf_counter()
    for i, path in enumerate(files, 1):
        # framework="paddle": bf16 checkpoints load without numpy (which has no bfloat16)
        with safe_open(str(path), framework="paddle") as f:
            for name in f.keys():
                param = params.get(name)
                if param is None:
                    if not model.ignored_checkpoint_key(name):
                        unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                transposed = getattr(param, "checkpoint_transposed", False)  # kept as [in, out] for speed
                expected = list(param.shape)[::-1] if transposed else list(param.shape)
                if list(tensor.shape) != expected:
                    raise ValueError(f"{path.name}: {name} has shape {list(tensor.shape)}, "
                                     f"the model expects {expected}; does config.json match the weights?")
                if transposed:
                    tensor = paddle.transpose(tensor, [1, 0]).contiguous()
                if tensor.dtype != param.dtype:
                    tensor = tensor.astype(param.dtype)
                param.set_value(tensor)
                loaded.add(name)
        done_bytes += path.stat().st_size
        progress(f"loaded shard {i}/{len(files)} {path.name} ({100 * done_bytes / total_bytes:.0f}%, "
                 f"{time.perf_counter() - t0:.1f} s)")
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {', '.join(sorted(unexpected)[:8])}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError(f"checkpoint does not match {type(model).__name__}: " + "; ".join(parts))


def load_model(model_dir: str | Path, backend: AttentionBackend, dtype: str = "float32") -> tuple[Any, dict[str, Any]]:
    """Build the model named by config.json and fill it from the directory's safetensors; (model, config)."""
    config = read_config(model_dir)
    arch, cls = resolve_architecture(config)
    files = safetensors_files(model_dir)
    t0 = time.perf_counter()
    model = cls(config, backend, dtype)
    model.eval()
    load_weights(model, files)
    if onednn.available(dtype):
        t1 = time.perf_counter()
        packed = onednn.pack_model(model)
        logger.info("weights packed for oneDNN's matmul: %.0f MiB in %.1f s", packed / 2**20, time.perf_counter() - t1)
    logger.info("%s from %s ready in %.1f s (%s)", arch, model_dir, time.perf_counter() - t0, dtype)
    return model, config
