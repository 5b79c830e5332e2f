"""SamplingParams: how one request turns logits into tokens and when it stops; validated, no paddle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    max_tokens: int = 16  # most tokens to generate
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: Optional[int] = None  # per-request RNG seed; None uses the engine's generator
    stop: list[str] = field(default_factory=list)  # strings that end generation (not included in output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: Optional[int] = None  # number of top logprobs per generated token; None = none

    def validate(self) -> None:
        """Raise ValueError (which the API turns into a 400) for values no request may carry."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 1 <= self.n <= 16:
            raise ValueError(f"n must be in [1, 16], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if len(self.stop) > 8:
            raise ValueError("at most 8 stop sequences are supported")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
