"""Frontend path for one chat request with images: load, hash, preprocess (or hit the processor cache), expand; no paddle.

    part ──uuid?──► processor cache GET "uuid:<id>" ──hit──► pixels (no download at all)
      │                                              └─miss, no URL──► UnknownMediaError (400)
      └─► raw bytes (data:/http/file) ─► mm_hash(bytes, params) ─► cache GET ─hit─► pixels
                                                                  └─miss─► decode + preprocess ─► cache PUT

A dead or slow processor cache only costs its timeout: the frontend preprocesses locally. The API's path
(`prepare_async`) refuses more images than --limit-mm-per-prompt before loading any, looks up uuids, then
downloads every http(s) image the request still needs concurrently under one deadline (cancelled with the
request), and does the rest on a worker thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..hashing import mm_hash
from ..request_limits import images_exceeded
from .media import MediaError, MediaLoader, decode_image
from .processor import ImageProcessor, ProcessedImage
from .processor_cache import ProcessorCacheClient
from .prompt import ExpandedPrompt, ImageInfo, ImagePart, UnknownMediaError, expand, image_parts
from .url_hashes import is_fetched_url


@dataclass
class PreparedPrompt:
    """Everything the engine needs for one multimodal request, plus figures for metrics and usage."""

    prompt: ExpandedPrompt  # token ids + placeholders (contract 1 inputs)
    images: list[ProcessedImage] = field(default_factory=list)  # same order as prompt.mm_placeholders
    hash_time_s: float = 0.0  # time spent computing mm_hash
    num_processor_cache_hits: int = 0
    num_processor_cache_misses: int = 0
    fetched: list[tuple[str, ImageInfo]] = field(default_factory=list)  # (http(s) URL, what it hashed to): url_hashes.py

    @property
    def num_image_tokens(self) -> int:
        return self.prompt.num_image_tokens


class ImageInputPreparer:
    """Owned by one API frontend; thread-safe (the cache client locks its socket)."""

    def __init__(self, tokenizer, processor: ImageProcessor, loader: MediaLoader,
                 cache: Optional[ProcessorCacheClient] = None, hash_algo: str = "blake3",
                 max_image_tokens: Optional[int] = None):
        self.tokenizer = tokenizer
        # the context length: images past it are refused before they are decoded (5000 tiny images in one
        # request took 4.5 s and ~900 MiB to be refused for length after all were preprocessed)
        self.max_image_tokens = max_image_tokens
        self.processor = processor
        self.loader = loader
        self.cache = cache
        self.hash_algo = hash_algo

    def _from_cache(self, h: str, out: PreparedPrompt) -> Optional[ProcessedImage]:
        if self.cache is None:
            return None
        img = self.cache.get(h)
        if img is None:
            out.num_processor_cache_misses += 1
        else:
            out.num_processor_cache_hits += 1
        return img

    def check_count(self, parts: list[ImagePart]) -> None:
        """400 for more images than --limit-mm-per-prompt allows, before any is loaded."""
        limit = self.loader.cfg.max_images_per_prompt
        refused = images_exceeded([p.where for p in parts], limit)  # the router judges the same (request_limits.py)
        if refused is not None:
            raise MediaError(parts[limit].where, refused.message.partition(": ")[2])

    def lookup_uuids(self, parts: list[ImagePart], out: PreparedPrompt,
                     cache_salt: Optional[str]) -> dict[int, ProcessedImage]:
        """Blocking: the processor-cache entries of the parts that carry a uuid, by part index."""
        known = {}
        for i, part in enumerate(parts):
            if part.uuid is not None:
                img = self._from_cache(mm_hash(uuid=part.uuid, algo=self.hash_algo, namespace=cache_salt), out)
                if img is not None:
                    known[i] = img
        return known

    def prepare_image(self, part: ImagePart, out: PreparedPrompt, cache_salt: Optional[str],
                      known: Optional[ProcessedImage], fetched: dict[str, bytes]) -> tuple[ImageInfo, ProcessedImage]:
        """One image: `known` is its uuid's cache entry, `fetched` the bytes downloaded ahead (else loaded here)."""
        if part.uuid is not None:
            h = mm_hash(uuid=part.uuid, algo=self.hash_algo, namespace=cache_salt)
            if known is not None:
                return ImageInfo(h, known.grid_thw), known
            if part.url is None:
                raise UnknownMediaError(part.where, f"unknown image uuid {part.uuid!r}: this server holds no image "
                                                    "with it; send the image together with its uuid first")
        data = fetched[part.url] if part.url in fetched else self.loader.load_bytes(part.url, part.where)[0]
        t0 = time.perf_counter()
        h = mm_hash(data, uuid=part.uuid, params=self.processor.hash_params(), algo=self.hash_algo,
                    namespace=cache_salt)
        out.hash_time_s += time.perf_counter() - t0
        img = self._from_cache(h, out) if part.uuid is None else None
        if img is None:
            picture = decode_image(data, part.where, self.loader.cfg.max_image_pixels)
            try:
                img = self.processor(picture)
            except ValueError as exc:
                raise MediaError(part.where, str(exc)) from None
            if self.cache is not None:
                self.cache.put(h, img)
        info = ImageInfo(h, img.grid_thw)
        if part.uuid is None and is_fetched_url(part.url):
            out.fetched.append((part.url, info))
        return info, img

    def prepare(self, messages: Sequence[dict], cache_salt: Optional[str] = None, **template_kwargs) -> PreparedPrompt:
        """Blocking, downloads one after another (the offline LLM). `cache_salt` scopes client uuids per tenant."""
        parts = image_parts(messages)
        self.check_count(parts)
        out = PreparedPrompt(ExpandedPrompt([]))
        known = self.lookup_uuids(parts, out, cache_salt)
        return self._finish(messages, parts, out, cache_salt, known, {}, template_kwargs)

    async def prepare_async(self, messages: Sequence[dict], cache_salt: Optional[str] = None,
                            **template_kwargs) -> PreparedPrompt:
        """The API's path: downloads run concurrently under --media-request-timeout-s; cancelling stops them."""
        parts = image_parts(messages)
        self.check_count(parts)
        out = PreparedPrompt(ExpandedPrompt([]))
        known = await asyncio.to_thread(self.lookup_uuids, parts, out, cache_salt)
        wanted = [(p.url, p.where) for i, p in enumerate(parts) if i not in known and p.url and is_fetched_url(p.url)]
        fetched = await self.loader.fetch_all(wanted)
        return await asyncio.to_thread(self._finish, messages, parts, out, cache_salt, known, fetched, template_kwargs)

    def _finish(self, messages: Sequence[dict], parts: list[ImagePart], out: PreparedPrompt, cache_salt: Optional[str],
                known: dict[int, ProcessedImage], fetched: dict[str, bytes], template_kwargs: dict) -> PreparedPrompt:
        infos = []
        num_tokens, merge = 0, self.processor.cfg.merge_size
        for i, part in enumerate(parts):
            info, img = self.prepare_image(part, out, cache_salt, known.get(i), fetched)
            num_tokens += info.num_tokens(merge)
            if self.max_image_tokens is not None and num_tokens > self.max_image_tokens:
                raise MediaError(part.where, f"the images up to this one need {num_tokens} tokens, more than the "
                                             f"model's context of {self.max_image_tokens}; send fewer or smaller images")
            infos.append(info)
            out.images.append(img)
        out.prompt = expand(self.tokenizer, messages, infos, self.processor.cfg.merge_size, **template_kwargs)
        return out
