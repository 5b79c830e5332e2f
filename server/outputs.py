"""Engine outputs → client text: incremental detokenization, stop strings, logprobs, finish reasons; no FastAPI.

Shared by the HTTP API and the offline `LLM`. One `OutputStream` follows one choice (one engine
request), built on `tokenizer.IncrementalDetokenizer` (UTF-8 safe deltas) and
`tokenizer.StopStringMatcher`. Stop strings are matched on text, so they can straddle tokens:

    text so far:   "... the answer is 42.<|"        stop = ["<|end|>"]
                                          ^^ held back: a prefix of a stop string, not shown yet
    next token:    "end|>"  → stop found → output ends before "<|end|>", finish_reason "stop",
                              the caller aborts the engine request (the engine does not know about it)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from .engine.request import RequestOutput
from .tokenizer import StopStringMatcher

# engine finish reason → OpenAI finish reason ("abort" stays: the request was cancelled, not completed)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class EngineError(RuntimeError):
    """The engine reported a failure for a request (RequestOutput.error; `status`: what it means to a client)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top alternatives the engine reported."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class Delta:
    """What one engine output adds to one choice."""

    text: str  # new text that is safe to show (stop-string prefixes held back)
    token_ids: list[int]  # new generated token ids, as the engine produced them
    logprobs: list[TokenLogprob]  # one per new token when logprobs were requested, else empty
    finish_reason: Optional[str] = None  # set on the choice's last delta


class OutputStream:
    """Follows one engine request: turns its RequestOutputs into Deltas and decides when it ends."""

    def __init__(self, detokenizer: Detokenizer, stop: Sequence[str] = ()):
        self._detok = detokenizer
        self._stop = StopStringMatcher(stop)
        self.text = ""  # text handed out so far
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_cached_tokens_cpu = 0
        self.finish_reason: Optional[str] = None
        self.engine_finished = False  # the engine ended the request itself (no abort needed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, out: RequestOutput) -> Delta:
        """Consume one engine output; raises EngineError if the engine failed the request."""
        if out.error:
            self.engine_finished = out.finished
            raise EngineError(out.error, out.error_status)
        if self.finished:
            return Delta("", [], [])
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.num_cached_tokens_cpu = max(self.num_cached_tokens_cpu, out.num_cached_tokens_cpu)
        self.num_generated_tokens += len(out.new_token_ids)
        self.engine_finished = out.finished
        new = self._detok.push(list(out.new_token_ids)) if out.new_token_ids else ""
        if out.finished:
            new += self._detok.flush()
        text, stopped = self._stop.push(new)
        if stopped:
            self.finish_reason = "stop"
        elif out.finished:
            text += self._stop.flush()
            self.finish_reason = FINISH_REASONS.get(out.finish_reason or "stop", "stop")
        self.text += text
        return Delta(text, list(out.new_token_ids), _logprob_entries(out), self.finish_reason)


def _logprob_entries(out: RequestOutput) -> list[TokenLogprob]:
    if not out.new_logprobs:
        return []
    entries = []
    for tok, lp in zip(out.new_token_ids, out.new_logprobs):
        logprob, top = (lp[0], lp[1]) if isinstance(lp, (tuple, list)) else (lp, [])
        entries.append(TokenLogprob(int(tok), float(logprob), [(int(t), float(v)) for t, v in (top or [])]))
    return entries


def _token_str(tokenizer: TokenDecoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _clean(logprob: float) -> float:
    """JSON has no -inf; OpenAI clients expect a finite number."""
    return max(logprob, -9999.0)


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: TokenDecoder, top_logprobs: int) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    content = []
    for e in entries:
        tok = _token_str(tokenizer, e.token_id)
        top = [
            {"token": (s := _token_str(tokenizer, t)), "logprob": _clean(v), "bytes": list(s.encode())}
            for t, v in e.top[:top_logprobs]
        ]
        content.append({"token": tok, "logprob": _clean(e.logprob), "bytes": list(tok.encode()), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    entries: Sequence[TokenLogprob], tokenizer: TokenDecoder, num_top: int, text_offset: int = 0
) -> dict[str, Any]:
    """OpenAI completions shape: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tok = _token_str(tokenizer, e.token_id)
        tokens.append(tok)
        token_logprobs.append(_clean(e.logprob))
        top: dict[str, float] = {}
        for t, v in e.top[:num_top]:
            top.setdefault(_token_str(tokenizer, t), _clean(v))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
