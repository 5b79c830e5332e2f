"""Qwen2-VL / Qwen2.5-VL in Paddle against transformers goldens (tests/golden_vl, made by scripts/make_golden_vl.py)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from PIL import Image

from warmfleet.server.attention.cpu import CpuPagedAttention
from warmfleet.server.engine.encoder_cache import image_slices
from warmfleet.server.engine.model_runner import kv_layout
from warmfleet.server.models import qwen2_vl
from warmfleet.server.models.loader import load_model
from warmfleet.server.multimodal.mrope import mrope_positions, positions_for_span
from warmfleet.server.multimodal.processor import ImageProcessor
from warmfleet.server.multimodal.prompt import ImageInfo, expand
from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model
from warmfleet.server.tokenizer import Tokenizer
from warmfleet.server.hashing import mm_hash

GOLDEN = Path(__file__).parent / "golden_vl"
ARCHS = ["qwen2_vl", "qwen2_5_vl"]
BLOCK = 16


@pytest.fixture(scope="module", params=ARCHS)
def vl(request, tmp_path_factory):
    arch = request.param
    meta = json.loads((GOLDEN / arch / "meta.json").read_text())
    ckpt = make_tiny_vl_model(tmp_path_factory.mktemp(arch), arch=arch, size="tiny", seed=0)
    assert hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest() == meta["weights_sha256"]
    model, _ = load_model(ckpt, CpuPagedAttention())
    return arch, meta, model, Tokenizer(ckpt), ImageProcessor.from_model_dir(ckpt)


def _inputs(vl, name):
    arch, meta, model, tok, proc = vl
    g = np.load(GOLDEN / arch / f"{name}.npz", allow_pickle=False)
    n_img = len(meta["prompts"][name]["images"])
    raws = [g[f"image{i}_bytes"].tobytes() for i in range(n_img)]
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
             for b in raws]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": meta["prompts"][name]["text"]}]}]
    imgs = [proc(Image.open(io.BytesIO(b))) for b in raws]
    infos = [ImageInfo(mm_hash(b, params=proc.hash_params()), im.grid_thw) for b, im in zip(raws, imgs)]
    prompt = expand(tok, messages, infos, proc.cfg.merge_size, add_generation_prompt=True)
    return g, prompt, imgs


class Seq:
    """Just enough of an engine to run one sequence through the paged cache."""

    def __init__(self, model, num_tokens_max):
        self.backend = model.model.layers[0].self_attn.backend
        nblocks = num_tokens_max // BLOCK + 2
        self.caches = self.backend.allocate(kv_layout(model, BLOCK, "float32"), nblocks)
        self.blocks = list(range(nblocks))
        self.model = model

    def step(self, ids, start, positions, pieces=()):
        meta = self.backend.build_metadata(BLOCK, [(self.blocks, start, len(ids))])
        emb = self.model.embed_with_images(paddle.to_tensor(np.asarray(ids, dtype=np.int64)), list(pieces))
        hidden = self.model(None, paddle.to_tensor(positions), self.caches, meta, inputs_embeds=emb)
        return self.model.compute_logits(hidden).numpy()


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_prompt_ids_and_mrope_positions_match_hf(vl, name):
    g, prompt, imgs = _inputs(vl, name)
    assert prompt.prompt_token_ids == g["input_ids"].tolist()
    assert [list(i.grid_thw) for i in imgs] == g["image_grid_thw"].tolist()
    pos, delta = mrope_positions(len(prompt.prompt_token_ids), prompt.mm_placeholders,
                                 [i.grid_thw for i in imgs], vl[4].cfg.merge_size)
    np.testing.assert_array_equal(pos, g["mrope_positions"])
    assert delta == int(g["mrope_positions"].max()) + 1 - len(prompt.prompt_token_ids)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_vision_embeddings_logits_and_greedy_match_hf(vl, name):
    _, _, model, _, proc = vl
    g, prompt, imgs = _inputs(vl, name)
    embeds = model.encode_images([i.pixel_values for i in imgs], [i.grid_thw for i in imgs])
    for k, e in enumerate(embeds):
        np.testing.assert_allclose(e.numpy(), g[f"image{k}_embeds"], rtol=1e-4, atol=1e-4)

    ids = prompt.prompt_token_ids
    n = len(ids)
    pos, delta = mrope_positions(n, prompt.mm_placeholders, [i.grid_thw for i in imgs], proc.cfg.merge_size)
    seq = Seq(model, n + 16)
    pieces = [(ph.offset, e) for ph, e in zip(prompt.mm_placeholders, embeds)]
    logits = seq.step(ids, 0, pos, pieces)
    rows = g["logit_rows"]
    np.testing.assert_allclose(logits[rows], g["logits"], rtol=1e-3, atol=1e-3)

    out = [int(logits[-1].argmax())]
    for _ in range(len(g["greedy"]) - 1):
        p = len(ids) + len(out) - 1
        step_logits = seq.step([out[-1]], p, positions_for_span(pos, delta, p, p + 1))
        out.append(int(step_logits[-1].argmax()))
    assert out == g["greedy"].tolist()


def test_prefill_split_inside_an_image_gets_exact_rows(vl):
    """A prefix-cache hit (or chunk) ending mid-image: the rest of the image needs only its remaining rows."""
    _, _, model, _, proc = vl
    g, prompt, imgs = _inputs(vl, "two_images")
    embeds = model.encode_images([i.pixel_values for i in imgs], [i.grid_thw for i in imgs])
    ids = prompt.prompt_token_ids
    n = len(ids)
    pos, _ = mrope_positions(n, prompt.mm_placeholders, [i.grid_thw for i in imgs], proc.cfg.merge_size)
    ph0 = prompt.mm_placeholders[0]
    split = ph0.offset + ph0.length // 2 + 1  # inside the first image
    seq = Seq(model, n + 16)
    for start, end in ((0, split), (split, n)):
        pieces = [(s.dst[0], embeds[s.index][s.rows[0]:s.rows[1]])
                  for s in image_slices(prompt.mm_placeholders, start, end)]
        logits = seq.step(ids[start:end], start, pos[:, start:end], pieces)
    np.testing.assert_allclose(logits[-1], g["logits"][-1], rtol=1e-3, atol=1e-3)


def test_wrong_mrope_section_rejected(vl):
    _, _, model, _, _ = vl
    cfg = dict(model.full_config, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 1]})
    with pytest.raises(ValueError, match="mrope_section"):
        qwen2_vl.MRotaryEmbedding(qwen2_vl.text_config(cfg), model.head_dim)
