"""Request → prompt token ids and image placeholders, rendered exactly as a replica renders them; no paddle.

Chat requests go through the checkpoint's chat template (`warmfleet.server.tokenizer`; rendered by
minijinja where it was shown to agree, core/template.py), then `encode(add_special_tokens=False)`, as
the replica does. Requests with images need the placeholder offsets the replica will compute; that is
one function of the multimodal module,
`warmfleet.server.multimodal.prompt.render(tokenizer, messages, **kw) -> (token_ids, placeholders)`,
which hashes data: URIs and cuts before images it cannot resolve without fetching.
Without it, an image request is hashed only up to its first image (blocks wholly before
the first placeholder are the same whatever the image expands to), which is exact, just shorter.
"""

from __future__ import annotations

import functools
import importlib
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ... import rendering
from ...hashing import AdapterId, MMPlaceholder, block_extra_keys, block_hashes, hash_block, root_hash
from . import bpe
from .template import FastChatTemplate
from .url_memo import UrlHashMemo

IMAGE_PAD_TOKENS = ("<|image_pad|>", "<image>")  # placeholder tokens a template emits per image, by model family


@dataclass
class Prompt:
    """What the router knows of one request's prompt."""

    token_ids: list[int]  # prompt tokens (for an image request without mm rendering: tokens up to the first image)
    mm_items: list[MMPlaceholder] = field(default_factory=list)  # images, with offsets in token_ids
    num_tokens: int = 0  # prompt length for load and hit-cap arithmetic (>= len(token_ids))


def _mm_render() -> Optional[Callable[..., Any]]:
    try:
        return importlib.import_module("warmfleet.server.multimodal.prompt").render
    except (ImportError, AttributeError):
        return None


def _as_replica_sees(message: Any) -> Any:
    """The replica validates messages with pydantic and dumps them without None fields; do the same."""
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p
                          for p in out["content"]]
    return out


@functools.lru_cache(maxsize=8)  # one per tokenizer object: the segment encoder and the renderer share it
def ids_encoder(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """`encode(text, add_special_tokens)` of the tokenizer: without special tokens through tiktoken where it was shown
    to give the same ids (bpe.py, ~7x faster), else and with them through HF tokenizers' `encode_batch_fast`.

    The fast path computes no character offsets: ~25% less CPU per request on 2,000-character
    prompts (0.65 -> 0.50 ms; docs/scale.md). The ids are the same by construction; a probe checks it
    and any surprise falls back to the plain encoder.
    """
    hf = _hf_ids_encoder(tokenizer)
    tk = bpe.tiktoken_encoder(tokenizer)
    if tk is None:
        return hf

    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return hf(text, True) if add_special_tokens else tk(text)
    return encode


def _hf_ids_encoder(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    plain = tokenizer.encode
    raw = getattr(tokenizer, "_tok", None)
    batch_fast = getattr(raw, "encode_batch_fast", None)
    if batch_fast is None:
        return plain

    def fast(text: str, add_special_tokens: bool = False) -> list[int]:
        return batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    probe = "Hello  world,\n\tthe  KV cache: 12345 ü ☃ " * 3
    try:
        same = all(fast(probe, a) == plain(probe, add_special_tokens=a) for a in (False, True))
    except Exception:  # an unexpected tokenizer object: keep the plain path
        same = False
    return fast if same else plain


class BoundedMemo:
    """A dict that forgets its oldest entries beyond `capacity` entries, or beyond `budget` of `size(key)` summed
    (FIFO; hot entries come straight back); a key over the budget by itself is not kept."""

    def __init__(self, capacity: int, budget: Optional[int] = None, size: Callable[[Any], int] = len):
        self.capacity = capacity
        self.budget = budget
        self.size = size
        self.used = 0  # sum of size(key) over the keys held (with a budget)
        self.data: dict = {}
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        v = self.data.get(key)
        if v is None:
            self.misses += 1
        else:
            self.hits += 1
        return v

    def put(self, key: Any, value: Any) -> None:
        with self._lock:  # long prompts are rendered on a worker thread (router.py) while the loop renders others
            self._put(key, value)

    def _put(self, key: Any, value: Any) -> None:
        if self.budget is None:
            if len(self.data) >= self.capacity:
                del self.data[next(iter(self.data))]
            self.data[key] = value
            return
        w = self.size(key)
        if w > self.budget:
            return
        while self.data and (len(self.data) >= self.capacity or self.used + w > self.budget):
            old = next(iter(self.data))
            self.used -= self.size(old)
            del self.data[old]
        self.data[key] = value
        self.used += w


class SegmentEncoder:
    """Exact `encode(text, add_special_tokens=False)` that reuses the ids of text between special tokens.

    HF tokenizers cut the input at added special tokens (here: not stripping, not normalized) before
    normalizing and pre-tokenizing, so the ids of a text are the ids of its pieces between special
    tokens, concatenated. A chat prompt is such pieces, one or two per message: a conversation's
    earlier turns and a tenant's system prompt are encoded once, and only the new message is
    tokenized. `for_tokenizer` returns None when the tokenizer's special tokens do not allow this,
    and the constructor checks itself against the plain encoder before it is used.
    """

    def __init__(self, tokenizer: Any, specials: dict[str, int], capacity: int = 50_000,
                 budget_chars: int = 32 << 20):
        self.tokenizer = tokenizer
        self._encode = ids_encoder(tokenizer)
        self.specials = specials
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        self.memo = BoundedMemo(capacity, budget_chars)  # pieces are whole messages and prompts: bounded in chars

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Optional["SegmentEncoder"]:
        hf = getattr(tokenizer, "_tok", None)
        try:
            added = hf.get_added_tokens_decoder()  # type: ignore[union-attr]
        except AttributeError:
            return None
        specials = {}
        for tid, tok in added.items():
            if tok.special:
                if tok.lstrip or tok.rstrip or tok.normalized or tok.single_word:
                    return None
                specials[tok.content] = int(tid)
        if not specials:
            return None
        enc = cls(tokenizer, specials)
        probe = "".join(f"{t}a b\n  {t}{t} ü x" for t in list(specials)[:8]) + " tail"
        if enc.encode(probe) != tokenizer.encode(probe, add_special_tokens=False):
            return None
        enc.memo = BoundedMemo(enc.memo.capacity, enc.memo.budget)
        return enc

    def completion_wrap(self) -> Optional[tuple[list[int], list[int]]]:
        """(before, after): the ids `encode(text, add_special_tokens=True)` puts around `encode(text)` (BOS, EOS),
        the same for every probe; None when the tokenizer's post-processor does anything else."""
        wrap = None
        for probe in ("a", "Hello  world, 12345 ü\n", "x" + next(iter(self.specials)) + " y"):
            full, bare = self.tokenizer.encode(probe, add_special_tokens=True), self.encode(probe)
            at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
            if at is None:
                return None
            got = (full[:at], full[at + len(bare):])
            if wrap is not None and got != wrap:
                return None
            wrap = got
        return wrap

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            sid = self.specials.get(piece)
            if sid is not None:
                out.append(sid)
                continue
            ids = self.memo.get(piece)
            if ids is None:
                ids = tuple(self._encode(piece, False))
                self.memo.put(piece, ids)
            out.extend(ids)
        return out


class PromptRenderer:
    """Owns the tokenizer; `chat(body)` / `completion(body)` raise ValueError for what they cannot render.

    Mirrors the replica's API (server/api/completions.py): the chat template gets the messages and
    `add_generation_prompt` only, and is encoded without special tokens; a completion's text
    prompt is encoded with them.
    """

    def __init__(self, model_dir: str, tokenizer: Any = None, hash_algo: str = "blake3",
                 urls: Optional[UrlHashMemo] = None):
        if tokenizer is None:
            from ...tokenizer import Tokenizer

            tokenizer = Tokenizer(model_dir)
        self.tokenizer = tokenizer
        self.hash_algo = hash_algo
        self._mm_render = _mm_render()
        self._processor_cfg: Any = None
        self._image_pad_ids = {i for i in (tokenizer.token_to_id(t) for t in IMAGE_PAD_TOKENS) if i is not None}
        self.segments = SegmentEncoder.for_tokenizer(tokenizer)
        self.template = FastChatTemplate.for_tokenizer(tokenizer)  # None: every chat renders with Jinja2
        self._encode = ids_encoder(tokenizer)
        # a completion's text through the same segment memo (a repeated prompt, or one that embeds special tokens,
        # is not tokenized again), wrapped in what the tokenizer's post-processor adds
        self._completion_wrap = self.segments.completion_wrap() if self.segments is not None else None
        self.images = BoundedMemo(4096)  # data: URI -> ImageInfo (multimodal.prompt.render's memo)
        self.urls = urls or UrlHashMemo()  # http(s) image URL -> what a replica said it hashed to, per salt (url_memo.py)

    def _encode_chat(self, text: str) -> list[int]:
        if self.segments is not None:
            return self.segments.encode(text)
        return self._encode(text, False)

    def chat(self, body: dict) -> Prompt:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        messages = [_as_replica_sees(m) for m in messages]
        add_gen = bool(body.get("add_generation_prompt", True))
        if rendering.has_images(messages):
            return self._chat_with_images(messages, add_gen, body.get("cache_salt"))
        text = self.template.render(messages, add_gen) if self.template is not None else None
        if text is not None:
            ids = self._encode_chat(text)
        else:
            ids = rendering.chat_ids(self.tokenizer, messages, add_gen, encode=self._encode_chat)
        return Prompt(ids, [], len(ids))

    def _chat_with_images(self, messages: list, add_gen: bool, cache_salt: Optional[str] = None) -> Prompt:
        if self._mm_render is not None and self._image_pad_ids:
            if self._processor_cfg is None:
                from ...multimodal.processor import ImageProcessorConfig

                self._processor_cfg = ImageProcessorConfig.from_model_dir(self.tokenizer.model_dir)
            ids, items = self._mm_render(self.tokenizer, messages, processor_cfg=self._processor_cfg,
                                         hash_algo=self.hash_algo, cache_salt=cache_salt, memo=self.images,
                                         url_lookup=functools.partial(self.urls.get, cache_salt),
                                         add_generation_prompt=add_gen)
            return Prompt(list(ids), list(items), len(ids))
        ids = rendering.chat_ids(self.tokenizer, messages, add_gen)
        cut = next((i for i, t in enumerate(ids) if t in self._image_pad_ids), len(ids))
        return Prompt(ids[:cut], [], len(ids))

    def completion(self, body: dict) -> Prompt:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch goes where its first prompt is warm
        if isinstance(prompt, str):
            if self._completion_wrap is not None:  # = rendering.completion_ids (encode with special tokens)
                before, after = self._completion_wrap
                ids = before + self.segments.encode(prompt) + after  # type: ignore[union-attr]
            else:
                ids = self._encode(prompt, True)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        return Prompt(ids, [], len(ids))


@dataclass(frozen=True)
class HashConfig:
    """Must equal the replicas' settings, or predictions are all misses."""

    block_size: int  # --block-size of the replicas
    model_fingerprint: str  # hashing.model_fingerprint(model_dir)
    algo: str = "blake3"  # --prefix-hash-algo of the replicas


def prompt_block_hashes(prompt: Prompt, cache_salt: Optional[str], cfg: HashConfig,
                        memo: Optional["HashMemo"] = None, adapter: Optional[AdapterId] = None) -> list[bytes]:
    """Contract-1 chain over the prompt's full blocks (memoised per block when `memo` is given); `adapter`: the
    LoRA adapter the request names, whose identity is in the chain's root as the replica puts it there."""
    if memo is not None:
        return memo.block_hashes(prompt.token_ids, prompt.mm_items, cfg, cache_salt, adapter)
    return block_hashes(prompt.token_ids, prompt.mm_items, cfg.block_size, cfg.model_fingerprint,
                        cache_salt=cache_salt, algo=cfg.algo, adapter=adapter)


class HashMemo:
    """hashing.block_hashes with each block's hash remembered by (parent hash, tokens, image keys).

    A conversation's next turn, or another request on a known system prompt, re-hashes only its
    new blocks. The key holds the parent hash, so the chain (model, salt, everything before) is
    part of it and the result is the very hash `hashing.hash_block` returns.
    """

    def __init__(self, capacity: int = 200_000):
        self.memo = BoundedMemo(capacity)
        self._roots: dict = {}

    def block_hashes(self, token_ids: Sequence[int], mm_items: Sequence[MMPlaceholder], cfg: HashConfig,
                     cache_salt: Optional[str], adapter: Optional[AdapterId] = None) -> list[bytes]:
        root_key = (cfg.model_fingerprint, cache_salt or "", cfg.algo, adapter)
        prev = self._roots.get(root_key)
        if prev is None:
            if len(self._roots) > 10_000:
                self._roots.clear()
            prev = self._roots[root_key] = root_hash(cfg.model_fingerprint, cache_salt, cfg.algo, adapter)
        items = sorted(mm_items, key=lambda m: m.offset) if mm_items else ()
        bs, memo = cfg.block_size, self.memo
        known = memo.data.get  # per block: one lookup (BoundedMemo.get's counting is done once, below)
        out: list[bytes] = []
        misses = 0
        for s in range(0, len(token_ids) // bs * bs, bs):
            block = tuple(token_ids[s:s + bs])
            extra = tuple(block_extra_keys(s, s + bs, items)) if items else ()
            key = (prev, block, extra)
            h = known(key)
            if h is None:
                misses += 1
                h = hash_block(prev, block, extra, cfg.algo)
                memo.put(key, h)
            out.append(h)
            prev = h
        memo.hits += len(out) - misses
        memo.misses += misses
        return out
