"""Request → prompt token ids and image placeholders, rendered exactly as a replica renders them; no paddle.

Chat requests go through the checkpoint's chat template (`warmfleet.server.tokenizer`), then
`encode(add_special_tokens=False)`, as the replica does. Requests with images need the
placeholder offsets the replica will compute; that is one function of the multimodal module,
`warmfleet.server.multimodal.prompt.render(tokenizer, messages, **kw) -> (token_ids, placeholders)`,
which hashes data: URIs and cuts before images it cannot resolve without fetching.
Without it, an image request is hashed only up to its first image (blocks wholly before
the first placeholder are the same whatever the image expands to), which is exact, just shorter.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..hashing import MMPlaceholder, block_hashes

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


def _has_images(messages: list) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") not in (None, "text") for p in m["content"])
               for m in messages)


def _as_replica_sees(message: Any) -> Any:
    """The replica validates messages with pydantic and dumps them without None fields; do the same."""
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p
                          for p in out["content"]]
    return out


class PromptRenderer:
    """Owns the tokenizer; `chat(body)` / `completion(body)` raise ValueError for what they cannot render.

    Mirrors the replica's API (server/api/serving.py): the chat template gets the messages and
    `add_generation_prompt` only, and is encoded without special tokens; a completion's text
    prompt is encoded with them.
    """

    def __init__(self, model_dir: str, tokenizer: Any = None, hash_algo: str = "blake3"):
        if tokenizer is None:
            from ..tokenizer import Tokenizer

            tokenizer = Tokenizer(model_dir)
        self.tokenizer = tokenizer
        self.hash_algo = hash_algo
        self._mm_render = _mm_render()
        self._processor_cfg: Any = None
        self._image_pad_ids = {i for i in (tokenizer.token_to_id(t) for t in IMAGE_PAD_TOKENS) if i is not None}

    def chat(self, body: dict) -> Prompt:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        messages = [_as_replica_sees(m) for m in messages]
        add_gen = bool(body.get("add_generation_prompt", True))
        if _has_images(messages):
            return self._chat_with_images(messages, add_gen)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Prompt(ids, [], len(ids))

    def _chat_with_images(self, messages: list, add_gen: bool) -> Prompt:
        if self._mm_render is not None and self._image_pad_ids:
            if self._processor_cfg is None:
                from ..multimodal.processor import ImageProcessorConfig

                self._processor_cfg = ImageProcessorConfig.from_model_dir(self.tokenizer.model_dir)
            ids, items = self._mm_render(self.tokenizer, messages, processor_cfg=self._processor_cfg,
                                         hash_algo=self.hash_algo, add_generation_prompt=add_gen)
            return Prompt(list(ids), list(items), len(ids))
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        cut = next((i for i, t in enumerate(ids) if t in self._image_pad_ids), len(ids))
        return Prompt(ids[:cut], [], len(ids))

    def completion(self, body: dict) -> Prompt:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch goes where its first prompt is warm
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
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


def prompt_block_hashes(prompt: Prompt, cache_salt: Optional[str], cfg: HashConfig) -> list[bytes]:
    """Contract-1 chain over the prompt's full blocks."""
    return block_hashes(prompt.token_ids, prompt.mm_items, cfg.block_size, cfg.model_fingerprint,
                        cache_salt=cache_salt, algo=cfg.algo)
