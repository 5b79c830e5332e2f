"""Qwen2-VL image preprocessing, numerically identical to HF's slow `Qwen2VLImageProcessor`; numpy + Pillow, no paddle.

    raw bytes ─► decode ─► RGB ─► smart_resize (multiples of patch*merge, min/max pixels)
              ─► PIL bicubic resize (uint8) ─► ×1/255 (float64 → float32) ─► (x - mean) / std
              ─► repeat frame to temporal_patch_size ─► patchify

`pixel_values` rows are patches in merge order: for each 2×2 merge window (row-major over
windows), its four patches row-major; each row is [C, T, P, P] flattened. Grid sizes depend
only on the image's width and height, so the router counts image tokens from the header alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Parameters of preprocessor_config.json that change the pixels or the token count."""

    min_pixels: int = 56 * 56  # lower bound on resized height*width
    max_pixels: int = 28 * 28 * 1280  # upper bound on resized height*width
    patch_size: int = 14  # spatial patch edge, pixels
    temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill it)
    merge_size: int = 2  # merge window edge, patches; one LLM token per merge_size**2 patches
    image_mean: tuple = OPENAI_CLIP_MEAN
    image_std: tuple = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL resampling filter (3 = BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessorConfig":
        """Read HF's preprocessor_config.json keys; `min_pixels`/`max_pixels` win over `size` as in HF."""
        size = d.get("size") or {}
        min_px = size.get("shortest_edge", size.get("min_pixels", cls.min_pixels))
        max_px = size.get("longest_edge", size.get("max_pixels", cls.max_pixels))
        if d.get("min_pixels") is not None:
            min_px = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_px = d["max_pixels"]
        cfg = cls(
            min_pixels=int(min_px),
            max_pixels=int(max_px),
            patch_size=int(d.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(d.get("merge_size", cls.merge_size)),
            image_mean=tuple(float(x) for x in d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in d.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            resample=int(d.get("resample", 3)),
            do_resize=bool(d.get("do_resize", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
        )
        if cfg.min_pixels < 1 or cfg.max_pixels < cfg.min_pixels:
            raise ValueError(f"preprocessor config needs 1 <= min_pixels <= max_pixels, got {cfg.min_pixels}, {cfg.max_pixels}")
        return cfg

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ImageProcessorConfig":
        p = Path(model_dir) / "preprocessor_config.json"
        return cls.from_dict(json.loads(p.read_text())) if p.exists() else cls()

    def to_hf_dict(self) -> dict:
        """preprocessor_config.json content HF's Qwen2VLImageProcessor reads back to the same settings."""
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        d["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        d["image_processor_type"] = "Qwen2VLImageProcessor"
        d["processor_class"] = "Qwen2VLProcessor"
        return d

    def hash_params(self) -> dict:
        """Everything that changes the pixels the model sees; enters `hashing.mm_hash(params=...)`."""
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        d["kind"] = "qwen2_vl_image"
        return d

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after smart_resize; ValueError for an extreme aspect ratio."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ValueError(f"with do_resize off, image sides must be multiples of {self.factor}")
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for a still image of the given size."""
        rh, rw = self.resized_size(width, height)
        return 1, rh // self.patch_size, rw // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        """LLM placeholder tokens for an image: t*h*w / merge_size**2."""
        t, h, w = self.grid_thw(width, height)
        return t * h * w // (self.merge_size ** 2)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """HF's smart_resize: sides multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if min(height, width) < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class ProcessedImage:
    """Model inputs of one image, as the vision encoder consumes them."""

    pixel_values: np.ndarray  # float32 [grid_t*grid_h*grid_w, C*T*P*P]
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size ** 2)

    @property
    def nbytes(self) -> int:
        return int(self.pixel_values.nbytes)


def to_rgb_array(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """uint8 [H, W, 3] as HF sees the image (`convert("RGB")` for any other mode)."""
    if cfg.do_convert_rgb and image.mode != "RGB":
        image = image.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected an RGB image, got array shape {arr.shape}")
    return arr


def resize_rgb(arr: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """PIL resize of a uint8 RGB array, exactly as transformers' `image_transforms.resize` does it."""
    if arr.shape[:2] == (height, width):
        return arr
    return np.asarray(Image.fromarray(arr).resize((width, height), resample=resample, reducing_gap=None))


def normalize(arr: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """uint8 [H, W, C] → float32, with HF's order and dtypes (rescale in float64, normalize in float32)."""
    x = arr
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.asarray(cfg.image_mean, dtype=x.dtype)
        std = np.asarray(cfg.image_std, dtype=x.dtype)
        x = (x - mean) / std
    return x.astype(np.float32, copy=False)


def patchify(frames: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames float32 [F, C, H, W] → ([t*h*w, C*T*P*P], (t, h, w)); pads F by repeating the last frame."""
    tps, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if frames.shape[0] % tps:
        pad = np.repeat(frames[-1:], tps - frames.shape[0] % tps, axis=0)
        frames = np.concatenate([frames, pad], axis=0)
    f, c, h, w = frames.shape
    gt, gh, gw = f // tps, h // p, w // p
    x = frames.reshape(gt, tps, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tps * p * p), (gt, gh, gw)


def preprocess_image(image: Image.Image, cfg: ImageProcessorConfig) -> ProcessedImage:
    """Pixel values and grid of one still image; ValueError for an image that cannot be resized."""
    arr = to_rgb_array(image, cfg)
    h, w = arr.shape[:2]
    rh, rw = cfg.resized_size(w, h)
    arr = resize_rgb(arr, rh, rw, cfg.resample) if cfg.do_resize else arr
    x = normalize(arr, cfg).transpose(2, 0, 1)[None]  # [1, C, H, W]
    pv, grid = patchify(x, cfg)
    return ProcessedImage(pv, grid, cfg.merge_size)


@dataclass
class ImageProcessor:
    """Preprocessing bound to one checkpoint's config; what frontends and the processor cache call."""

    cfg: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ImageProcessor":
        return cls(ImageProcessorConfig.from_model_dir(model_dir))

    def __call__(self, image: Image.Image) -> ProcessedImage:
        return preprocess_image(image, self.cfg)

    def hash_params(self) -> dict:
        return self.cfg.hash_params()

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.cfg.num_image_tokens(width, height)

