"""OpenAI-compatible request and response models (pydantic), with vLLM's extensions where we share them."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # range checked here; vocabulary size checked by the app


class _Request(BaseModel):
    # Unknown fields are ignored, like OpenAI and vLLM do; known-but-unsupported values are rejected.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        """JSON may escape a lone UTF-16 surrogate ("\\ud800"); such a string is no text, and the tokenizer fails on it."""
        bad = find_unencodable(data)
        if bad is not None:
            where = bad.encode("utf-8", "backslashreplace").decode() or "body"  # the path may hold the surrogate itself
            raise ValueError(f"{where} is not valid Unicode text (a lone surrogate escape such as \\ud800)")
        return data


def find_unencodable(data: Any) -> Optional[str]:
    """Path ("messages.0.content") of the first string (value or key) with no UTF-8 encoding, else None. Iterative."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(item, dict):
            for k, v in item.items():
                todo.append((f"{path}.{k}" if path else str(k), k))
                todo.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(item, list):
            todo.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(item))
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by chat and completions requests."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = Field(default=None, ge=-1, lt=2**31)  # extension; -1 or 0 disables
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[TokenId]] = None  # extension
    ignore_eos: bool = False  # extension
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = Field(default=None, min_length=1)  # isolates a tenant's prefix-cache entries

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. a `uuid` inside image_url

    url: Optional[str] = None  # may be left out when the part carries a `uuid` of an image sent before
    detail: Optional[str] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None
    image_url: Optional[Union[ImageURL, str]] = None
    uuid: Optional[str] = None  # FastDeploy's convention: the image's identity; later requests may send only it


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True  # extension

    def requested_max_tokens(self) -> Optional[int]:
        """`max_completion_tokens` is the current name; `max_tokens` the deprecated alias."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for legacy completions
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None



class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "warmfleet"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model (vLLM's field); None for the base model
    lora_digest: Optional[str] = None  # warmfleet's: an adapter's hashing.adapter_digest, in its block-hash chain root
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class LoadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's; ignored


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    cache_salt: Optional[str] = Field(default=None, min_length=1)  # images are prepared under it, as a chat's are



class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[TokenId]
