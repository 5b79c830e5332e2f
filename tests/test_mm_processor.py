"""Qwen2-VL image preprocessing: smart_resize, patch order, config parsing, and parity with HF goldens."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from warmfleet.server.multimodal.processor import (
    ImageProcessor,
    ImageProcessorConfig,
    normalize,
    preprocess_image,
    resize_rgb,
    smart_resize,
)

GOLDEN = Path(__file__).parent / "golden_vl" / "processor.npz"


@pytest.mark.parametrize("hw,expected", [
    ((480, 640), (476, 644)),  # rounds to multiples of 28
    ((3000, 4000), (840, 1148)),  # shrinks under max_pixels, keeps aspect
    ((20, 20), (56, 56)),  # grows to min_pixels
    ((10, 1999), (28, 812)),
])
def test_smart_resize_values(hw, expected):
    assert smart_resize(*hw) == expected


@pytest.mark.parametrize("h,w", [(1, 1), (17, 3000), (999, 1001), (4000, 28), (2000, 2000), (57, 29)])
def test_smart_resize_invariants(h, w):
    cfg = ImageProcessorConfig(min_pixels=4 * 784, max_pixels=64 * 784)
    rh, rw = smart_resize(h, w, 28, cfg.min_pixels, cfg.max_pixels)
    assert rh % 28 == 0 and rw % 28 == 0
    assert rh * rw <= cfg.max_pixels or (rh == 28 or rw == 28)
    assert rh * rw >= cfg.min_pixels


def test_extreme_aspect_ratio_rejected():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500)


def _photo(w, h, seed=0, mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], -1)
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr).convert(mode)


def test_patch_order_roundtrip():
    """Undo the patchify and compare with the resized, normalized image (catches any axis mix-up)."""
    cfg = ImageProcessorConfig(min_pixels=784, max_pixels=100 * 784)
    img = _photo(150, 90)
    out = preprocess_image(img, cfg)
    t, gh, gw = out.grid_thw
    rh, rw = cfg.resized_size(150, 90)
    assert (gh, gw) == (rh // 14, rw // 14) and t == 1
    assert out.pixel_values.shape == (gh * gw, 3 * 2 * 14 * 14) and out.pixel_values.dtype == np.float32
    expect = normalize(resize_rgb(np.asarray(img), rh, rw, 3), cfg).transpose(2, 0, 1)  # [C, H, W]
    x = out.pixel_values.reshape(gh // 2, gw // 2, 2, 2, 3, 2, 14, 14)  # wh, ww, mh, mw, c, t, p, p
    x = x.transpose(5, 4, 0, 2, 6, 1, 3, 7).reshape(2, 3, rh, rw)
    np.testing.assert_array_equal(x[0], expect)
    np.testing.assert_array_equal(x[1], expect)  # a still image fills both temporal slots
    assert out.num_tokens == gh * gw // 4 == cfg.num_image_tokens(150, 90)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_other_modes_convert_to_rgb(mode):
    out = ImageProcessor()( _photo(64, 48, mode=mode))
    assert out.pixel_values.shape[1] == 1176 and np.isfinite(out.pixel_values).all()


def test_config_from_hf_dict_precedence():
    d = {"min_pixels": 100, "max_pixels": 5000, "size": {"shortest_edge": 1, "longest_edge": 2}, "patch_size": 14,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    cfg = ImageProcessorConfig.from_dict(d)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (100, 5000, (0.5, 0.5, 0.5))
    cfg2 = ImageProcessorConfig.from_dict({"size": {"shortest_edge": 3136, "longest_edge": 9999}})
    assert (cfg2.min_pixels, cfg2.max_pixels) == (3136, 9999)
    assert ImageProcessorConfig.from_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError):
        ImageProcessorConfig.from_dict({"min_pixels": 10, "max_pixels": 5})


def test_hash_params_change_with_pixels_affecting_settings():
    a = ImageProcessorConfig().hash_params()
    b = ImageProcessorConfig(max_pixels=1000 * 784).hash_params()
    assert a != b and json.dumps(a, sort_keys=True)


def test_matches_hf_qwen2vl_image_processor():
    g = np.load(GOLDEN, allow_pickle=False)
    n = int(g["num_cases"])
    assert n >= 4
    for i in range(n):
        data = g[f"case{i}_bytes"].tobytes()
        cfg = ImageProcessorConfig.from_dict(json.loads(g[f"case{i}_cfg"].tobytes()))
        out = preprocess_image(Image.open(io.BytesIO(data)), cfg)
        assert tuple(out.grid_thw) == tuple(g[f"case{i}_grid"]), f"case {i}"
        assert out.pixel_values.shape == tuple(g[f"case{i}_shape"]), f"case {i}"
        rows = g[f"case{i}_rows_idx"]
        np.testing.assert_allclose(out.pixel_values[rows], g[f"case{i}_rows"], rtol=0, atol=1e-6, err_msg=f"case {i}")
        np.testing.assert_allclose(out.pixel_values.astype(np.float64).sum(), float(g[f"case{i}_sum"]), rtol=1e-9)
        np.testing.assert_allclose(np.abs(out.pixel_values.astype(np.float64)).sum(), float(g[f"case{i}_abssum"]), rtol=1e-9)
