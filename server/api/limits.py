"""Fan-out limits of one API request, checked right after parsing and before any tokenizing or engine work; no engine import.

A `/v1/completions` body may list many prompts and ask `n` samples of each; every (prompt, sample) becomes one
engine request with its own task, detokenizer and queue in this process. The product is bounded by
`--max-choices-per-request` (default 4 x `--max-num-seqs`), so a small body cannot allocate without bound.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request


def num_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds (a string, a list of strings, token ids, lists of ids)."""
    if isinstance(prompt, str):
        return 1
    if prompt and all(isinstance(x, int) for x in prompt):
        return 1
    return len(prompt)


def check_fanout(num_prompts: int, n: int, limit: int) -> None:
    """400 when `num_prompts` x `n` engine requests exceed `limit` (n's own range is checked with the sampling fields)."""
    if num_prompts * n > limit:
        what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise bad_request(
            f"this request asks for {num_prompts * n} completions ({what}), more than this server's limit of {limit} "
            "per request (--max-choices-per-request); split it into several requests",
            param="n" if num_prompts == 1 else "prompt", code="too_many_choices",
        )
