"""Chat messages with images → prompt token ids + image placeholders, shared by frontends and the router; no paddle.

The chat template emits `<|vision_start|><|image_pad|><|vision_end|>` per image part; each
single `<|image_pad|>` becomes as many pads as the image has LLM tokens
(grid_t * grid_h * grid_w / merge_size**2), exactly as HF's Qwen2VLProcessor expands it:

    rendered:  ... <vs> <pad> <ve> text <vs> <pad> <ve> ...
    expanded:  ... <vs> <pad>*n0 <ve> text <vs> <pad>*n1 <ve> ...
                        ^ MMPlaceholder(offset, n0, mm_hash)

Grid sizes come from the image's width and height only, so the router (raw bytes, header
read) and a replica (decoded pixels) compute the same ids and placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from .. import rendering
from ..hashing import MMPlaceholder, digest_fn, mm_hash
from ..config import DEFAULT_MAX_IMAGE_PIXELS
from .media import MediaError, decode_data_uri, image_size
from .processor import ImageProcessorConfig

IMAGE_PAD = "<|image_pad|>"


class UnknownMediaError(MediaError):
    """A uuid-only image part whose uuid is not cached here (HTTP 400: send the image with it once)."""


@dataclass(frozen=True)
class ImagePart:
    """One image content part as the client sent it."""

    where: str  # "messages[i].content[j]", used in error messages
    url: Optional[str]  # data:, http(s): or file: URL; None for a uuid-only reference
    uuid: Optional[str]  # client-chosen identity (FastDeploy's convention), becomes the mm_hash


@dataclass(frozen=True)
class ImageInfo:
    """What prompt expansion needs of an image: its identity and its patch grid."""

    mm_hash: str
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


@dataclass
class ExpandedPrompt:
    """A rendered multimodal prompt."""

    prompt_token_ids: list[int]
    mm_placeholders: list[MMPlaceholder] = field(default_factory=list)  # one per image, in prompt order

    @property
    def num_image_tokens(self) -> int:
        return sum(m.length for m in self.mm_placeholders)




def _part_uuid(part: dict) -> Optional[str]:
    img = part.get("image_url")
    uuid = part.get("uuid")
    if uuid is None and isinstance(img, dict):
        uuid = img.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not uuid):
        raise ValueError("uuid must be a non-empty string")
    return uuid


def image_parts(messages: Sequence[dict]) -> list[ImagePart]:
    """Image content parts in the order the chat template renders them; ValueError for video or malformed parts."""
    out: list[ImagePart] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise MediaError(where, "content part must be an object")
            ptype = part.get("type")
            if ptype in ("video", "video_url") or "video" in part or "video_url" in part:
                raise MediaError(where, "video input is not supported")
            if not rendering.is_image_part(part):
                continue
            img = part.get("image_url", part.get("image"))
            url = img.get("url") if isinstance(img, dict) else img
            if url is not None and not isinstance(url, str):
                raise MediaError(where, "image_url.url must be a string")
            try:
                uuid = _part_uuid(part)
            except ValueError as exc:
                raise MediaError(where, str(exc)) from None
            if not url and uuid is None:
                raise MediaError(where, "image part needs image_url.url or a uuid")
            out.append(ImagePart(where, url or None, uuid))
    return out


def describe_image_bytes(data: bytes, part: ImagePart, cfg: ImageProcessorConfig, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                         hash_algo: str = "blake3", cache_salt: Optional[str] = None) -> ImageInfo:
    """mm_hash and grid of an image from its raw bytes, reading only the header (the router's path)."""
    w, h = image_size(data, part.where, max_pixels)
    try:
        grid = cfg.grid_thw(w, h)
    except ValueError as exc:
        raise MediaError(part.where, str(exc)) from None
    return ImageInfo(mm_hash(data, uuid=part.uuid, params=cfg.hash_params(), algo=hash_algo, namespace=cache_salt),
                     grid)


def _template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages with image URLs blanked: templates only test for the part, and a data: URI can be megabytes."""
    out = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and rendering.is_image_part(part):
                    part = {"type": "image_url", "image_url": {"url": ""}}
                elif isinstance(part, dict):  # a pydantic dump may carry image_url=None on text parts
                    part = {k: v for k, v in part.items() if v is not None}
                parts.append(part)
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def expand_image_tokens(token_ids: Sequence[int], images: Sequence[ImageInfo], image_pad_id: int,
                        merge_size: int) -> ExpandedPrompt:
    """Replace the k-th `<|image_pad|>` by images[k]'s token count; ValueError if counts disagree."""
    num_pads = sum(1 for t in token_ids if t == image_pad_id)
    if num_pads != len(images):
        raise ValueError(f"prompt has {num_pads} image placeholders but the request carries {len(images)} images "
                         f"(is {IMAGE_PAD} written in the text?)")
    out: list[int] = []
    placeholders: list[MMPlaceholder] = []
    k = 0
    for t in token_ids:
        if t != image_pad_id:
            out.append(t)
            continue
        n = images[k].num_tokens(merge_size)
        placeholders.append(MMPlaceholder(images[k].mm_hash, len(out), n))
        out.extend([image_pad_id] * n)
        k += 1
    return ExpandedPrompt(out, placeholders)


def render_tokens(tokenizer, messages: Sequence[dict], **template_kwargs) -> tuple[list[int], int]:
    """Chat template → token ids with one pad per image, and the pad id."""
    pad_id = tokenizer.token_to_id(IMAGE_PAD)
    if pad_id is None:
        raise ValueError(f"this model's tokenizer has no {IMAGE_PAD} token; it does not accept images")
    return rendering.chat_ids(tokenizer, _template_messages(messages), **template_kwargs), pad_id


def expand(tokenizer, messages: Sequence[dict], images: Sequence[ImageInfo], merge_size: int,
           **template_kwargs) -> ExpandedPrompt:
    """Frontend path: images already resolved (loaded or found in the processor cache), strictly expanded."""
    ids, pad_id = render_tokens(tokenizer, messages, **template_kwargs)
    return expand_image_tokens(ids, images, pad_id, merge_size)


class InfoMemo(Protocol):
    def get(self, key: Any) -> Any: ...

    def put(self, key: Any, value: Any) -> None: ...


def render(tokenizer, messages: Sequence[dict], *, processor_cfg: Optional[ImageProcessorConfig] = None,
           grid_lookup: Optional[Callable[[str], Optional[tuple[int, int, int]]]] = None,
           hash_algo: str = "blake3", max_pixels: int = 64 << 20, max_bytes: int = 20 << 20,
           cache_salt: Optional[str] = None, memo: Optional[InfoMemo] = None,
           url_lookup: Optional[Callable[[str], Optional[tuple[str, tuple[int, int, int]]]]] = None,
           **template_kwargs) -> tuple[list[int], list[MMPlaceholder]]:
    """Router path: ids and placeholders from the request alone (data: URIs hashed and header-read).

    An image the router cannot resolve without fetching (http(s)/file URLs, a uuid that
    `grid_lookup(mm_hash)` does not know) cuts the result just before that image's pads: the
    blocks before it hash the same whatever it expands to, so the prefix stays exact.
    `url_lookup(url)` may name an http(s) image without fetching it: the (mm_hash, grid) a replica
    reported for it (router/core/url_memo.py); a stale answer only costs a miss on that replica.
    `memo` remembers a data: URI's ImageInfo by a digest of the URI text, the uuid and the salt,
    so a conversation resending its image skips base64 decoding; one memo per (processor config,
    limits, hash algo), as a router's renderer holds.
    """
    cfg = processor_cfg or ImageProcessorConfig.from_model_dir(tokenizer.model_dir)
    infos: list[Optional[ImageInfo]] = []
    for part in image_parts(messages):
        key = None
        if memo is not None and part.url and part.url.startswith("data:"):
            key = (digest_fn(hash_algo)(part.url.encode()), part.uuid, cache_salt)
            info = memo.get(key)
            if info is not None:
                infos.append(info)
                continue
        info = _resolve_for_router(part, cfg, grid_lookup, hash_algo, max_pixels, max_bytes, cache_salt)
        if info is None and url_lookup is not None and part.uuid is None and part.url:
            known_url = url_lookup(part.url)
            info = None if known_url is None else ImageInfo(known_url[0], tuple(known_url[1]))
        if key is not None:
            memo.put(key, info)
        infos.append(info)
    ids, pad_id = render_tokens(tokenizer, messages, **template_kwargs)
    known = list(_until_none(infos))
    if len(known) == len(infos):
        res = expand_image_tokens(ids, known, pad_id, cfg.merge_size)
        return res.prompt_token_ids, res.mm_placeholders
    pad_positions = [i for i, t in enumerate(ids) if t == pad_id]
    if len(pad_positions) != len(infos):
        raise ValueError(f"prompt has {len(pad_positions)} image placeholders but {len(infos)} images")
    cut = pad_positions[len(known)]
    res = expand_image_tokens(ids[:cut], known, pad_id, cfg.merge_size)
    return res.prompt_token_ids, res.mm_placeholders


def _until_none(items: Iterable[Optional[ImageInfo]]) -> Iterable[ImageInfo]:
    for it in items:
        if it is None:
            return
        yield it


def _resolve_for_router(part: ImagePart, cfg: ImageProcessorConfig, grid_lookup, hash_algo: str,
                        max_pixels: int, max_bytes: int, cache_salt: Optional[str]) -> Optional[ImageInfo]:
    if part.url and part.url.startswith("data:"):
        data = decode_data_uri(part.url, part.where, max_bytes)
        return describe_image_bytes(data, part, cfg, max_pixels=max_pixels, hash_algo=hash_algo, cache_salt=cache_salt)
    if part.uuid is not None and grid_lookup is not None:
        h = mm_hash(uuid=part.uuid, algo=hash_algo, namespace=cache_salt)
        grid = grid_lookup(h)
        if grid is not None:
            return ImageInfo(h, tuple(grid))
    return None
