"""Writes tests/golden_vl/* from Hugging Face transformers (+ torch): the reference warmfleet's VL code is checked against.

Run where torch and transformers are installed (CI never needs them):

    python scripts/make_golden_vl.py processor        # tests/golden_vl/processor.npz
    python scripts/make_golden_vl.py model --arch qwen2_vl   # tests/golden_vl/qwen2_vl/*
    python scripts/make_golden_vl.py model --arch qwen2_5_vl

Files are .npz (numpy, loaded with allow_pickle=False) plus JSON; inputs (image bytes,
token ids) are stored beside the outputs so the tests need no generator of their own.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden_vl"
SAMPLED_ROWS = 8


def synthetic_photo(w: int, h: int, seed: int) -> np.ndarray:
    """A 'real-looking' uint8 RGB picture: smooth gradients, discs, edges and sensor noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([xx / w * 200 + 30, yy / h * 180 + 40, (np.sin(xx / 17) + np.cos(yy / 23)) * 50 + 120], -1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(5, max(w, h) / 4)
        mask = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
        img[mask] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 8, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(arr: np.ndarray, fmt: str, mode: str = "RGB") -> bytes:
    im = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def processor_cases() -> list[tuple[bytes, dict]]:
    """(image bytes, preprocessor_config dict) pairs covering resize up/down, odd sizes and modes."""
    small = {"min_pixels": 4 * 784, "max_pixels": 256 * 784}
    return [
        (encode(synthetic_photo(640, 480, 1), "JPEG"), {"min_pixels": 3136, "max_pixels": 1280 * 784}),
        (encode(synthetic_photo(1000, 750, 2), "JPEG"), small),  # shrinks
        (encode(synthetic_photo(40, 30, 3), "PNG"), small),  # grows to min_pixels
        (encode(synthetic_photo(300, 200, 4), "PNG", "RGBA"), small),
        (encode(synthetic_photo(123, 457, 5), "PNG", "L"), small),  # odd sides
        (encode(synthetic_photo(200, 150, 6), "GIF", "P"), small),
        (encode(synthetic_photo(333, 222, 7), "JPEG"),
         {**small, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}),
    ]


def make_processor_goldens() -> None:
    import transformers
    try:  # transformers >= 5 names the PIL backend explicitly; 4.x's slow processor is the PIL one
        from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor

    out: dict[str, np.ndarray] = {}
    cases = processor_cases()
    for i, (data, cfg) in enumerate(cases):
        proc = Qwen2VLImageProcessor(**cfg)
        res = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        pv = np.asarray(res["pixel_values"], dtype=np.float32)
        grid = np.asarray(res["image_grid_thw"])[0]
        rows = np.unique(np.linspace(0, pv.shape[0] - 1, SAMPLED_ROWS).round().astype(np.int64))
        out[f"case{i}_bytes"] = np.frombuffer(data, dtype=np.uint8)
        out[f"case{i}_cfg"] = np.frombuffer(json.dumps(cfg).encode(), dtype=np.uint8)
        out[f"case{i}_grid"] = grid.astype(np.int64)
        out[f"case{i}_shape"] = np.asarray(pv.shape, dtype=np.int64)
        out[f"case{i}_rows_idx"] = rows
        out[f"case{i}_rows"] = pv[rows]
        out[f"case{i}_sum"] = np.float64(pv.astype(np.float64).sum())
        out[f"case{i}_abssum"] = np.float64(np.abs(pv.astype(np.float64)).sum())
    out["num_cases"] = np.int64(len(cases))
    out["versions"] = np.frombuffer(json.dumps({"transformers": transformers.__version__,
                                                "pillow": Image.__version__}).encode(), dtype=np.uint8)
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "processor.npz", **out)
    print(f"wrote {OUT / 'processor.npz'} ({len(cases)} cases)")


MODEL_PROMPTS = {
    # name -> list of (image seed, width, height) and the text around them
    "one_image": ([(11, 90, 60)], "Describe this picture in one sentence."),
    "two_images": ([(12, 60, 84), (13, 112, 56)], "What differs between these two pictures?"),
}
NUM_GREEDY = 8
LOGIT_ROWS = 12


def model_messages(images: list[tuple[int, int, int]], text: str) -> tuple[list[dict], list[bytes]]:
    """Chat messages with PNG data URIs (the same structure the tests rebuild from the stored bytes)."""
    import base64

    raw = [encode(synthetic_photo(w, h, seed), "PNG") for seed, w, h in images]
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
             for b in raw]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], raw


def make_model_goldens(arch: str) -> None:
    import hashlib
    import tempfile

    import torch
    import transformers
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProc
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProc

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    out_dir = OUT / arch
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_vl_model(Path(tmp) / arch, arch=arch, size="tiny", seed=0)
        weights_sha = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
        tok = AutoTokenizer.from_pretrained(ckpt)
        proc_cfg = json.loads((ckpt / "preprocessor_config.json").read_text())
        image_proc = ImageProc(**{k: v for k, v in proc_cfg.items() if k in (
            "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")})
        model = AutoModelForImageTextToText.from_pretrained(ckpt, torch_dtype=torch.float32,
                                                            attn_implementation="eager").eval()
        cfg = json.loads((ckpt / "config.json").read_text())
        pad_id = cfg["image_token_id"]
        merge = proc_cfg["merge_size"]
        meta = {"arch": arch, "weights_sha256": weights_sha, "transformers": transformers.__version__,
                "torch": torch.__version__, "prompts": {}}
        for name, (images, text) in MODEL_PROMPTS.items():
            messages, raw = model_messages(images, text)
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            pil = [Image.open(io.BytesIO(b)) for b in raw]
            px = image_proc(images=pil, return_tensors="pt")
            grids = px["image_grid_thw"]
            counts = [int(g.prod()) // merge ** 2 for g in grids]
            pieces = prompt.split("<|image_pad|>")
            assert len(pieces) == len(counts) + 1, "template must emit one pad per image"
            expanded = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
            ids = torch.tensor([tok(expanded, add_special_tokens=False)["input_ids"]])
            mm_kw = {}
            if "mm_token_type_ids" in __import__("inspect").signature(model.model.get_rope_index).parameters:
                mm_kw["mm_token_type_ids"] = (ids == pad_id).int()  # transformers >= 5 wants the modality map
            with torch.no_grad():
                feats = model.get_image_features(pixel_values=px["pixel_values"], image_grid_thw=grids)
                feats = getattr(feats, "pooler_output", feats)
                if isinstance(feats, torch.Tensor):
                    feats = torch.split(feats, counts)
                res = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px["pixel_values"],
                            image_grid_thw=grids, **mm_kw)
                logits = res.logits[0].float().numpy()
                pos = model.model.get_rope_index(ids, image_grid_thw=grids, attention_mask=torch.ones_like(ids),
                                                 **mm_kw)[0]
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     pixel_values=px["pixel_values"], image_grid_thw=grids,
                                     max_new_tokens=NUM_GREEDY, do_sample=False, eos_token_id=None, pad_token_id=0,
                                     **mm_kw)
            n = ids.shape[1]
            rows = np.unique(np.concatenate([np.linspace(0, n - 1, LOGIT_ROWS).round().astype(np.int64), [n - 1]]))
            arrays = {
                "input_ids": ids[0].numpy().astype(np.int64),
                "image_grid_thw": grids.numpy().astype(np.int64),
                "mrope_positions": pos[:, 0].numpy().astype(np.int64),
                "logit_rows": rows,
                "logits": logits[rows],
                "greedy": gen[0, n:].numpy().astype(np.int64),
            }
            for i, (b, f) in enumerate(zip(raw, feats)):
                arrays[f"image{i}_bytes"] = np.frombuffer(b, dtype=np.uint8)
                arrays[f"image{i}_embeds"] = f.float().numpy()
            np.savez_compressed(out_dir / f"{name}.npz", **arrays)
            meta["prompts"][name] = {"text": text, "images": images, "num_tokens": int(n), "image_pad_id": pad_id}
        (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out_dir}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("processor", help="image preprocessing goldens")
    m = sub.add_parser("model", help="vision embeddings, logits and greedy tokens on a tiny random checkpoint")
    m.add_argument("--arch", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl")
    args = ap.parse_args(argv)
    if args.what == "processor":
        make_processor_goldens()
    else:
        make_model_goldens(args.arch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
