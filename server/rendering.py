"""The one path from a request to prompt token ids (chat template, special tokens, image parts); no paddle.

API serving, `/tokenize`, the offline `LLM`, the router and the multimodal renderer all call
these, so a prompt has the same token ids wherever it is rendered (tests/test_rendering.py):

    chat        template(messages, add_generation_prompt) → encode WITHOUT the tokenizer's special
                tokens: the template writes BOS and role markers itself, adding them twice would
                put a second BOS in front of a Llama-style prompt
    completion  encode(text) WITH the tokenizer's special tokens (BOS where the checkpoint has one),
                as Hugging Face and vLLM do for a plain prompt

An image part is a content part of type `image_url` or `image`, or one carrying either field
(clients differ in which they send); a model is multimodal when its config has a vision tower.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

IMAGE_PART_TYPES = ("image_url", "image")


def chat_text(tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)


def chat_ids(tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool = True,
             encode: Optional[Callable[[str], list[int]]] = None) -> list[int]:
    """Token ids of a chat prompt; `encode` may be a cache of `tokenizer.encode(text, add_special_tokens=False)`."""
    text = chat_text(tokenizer, messages, add_generation_prompt)
    return encode(text) if encode is not None else tokenizer.encode(text, add_special_tokens=False)


def completion_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt (completions, offline generate)."""
    return tokenizer.encode(text, add_special_tokens=True)


def _field(part: Any, name: str) -> Any:
    return part.get(name) if isinstance(part, dict) else getattr(part, name, None)


def is_image_part(part: Any) -> bool:
    """The rule for dict parts (router, offline) and parsed pydantic parts (API) alike."""
    if part is None or isinstance(part, str):
        return False
    return (_field(part, "type") in IMAGE_PART_TYPES or _field(part, "image_url") is not None
            or _field(part, "image") is not None)


def image_part_positions(messages: Sequence[Any]) -> list[tuple[int, int]]:
    """(message index, part index) of every image part, in prompt order."""
    out = []
    for i, m in enumerate(messages):
        content = _field(m, "content")
        if isinstance(content, list):
            out += [(i, j) for j, p in enumerate(content) if is_image_part(p)]
    return out


def has_images(messages: Sequence[Any]) -> bool:
    return bool(image_part_positions(messages))


def is_multimodal(hf_config: dict) -> bool:
    """A checkpoint accepts images when its config.json has a vision tower (Qwen2-VL, Qwen2.5-VL, ...)."""
    return isinstance(hf_config.get("vision_config"), dict)
