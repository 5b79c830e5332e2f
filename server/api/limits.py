"""Fan-out limits of one API request, checked right after parsing and before any tokenizing or engine work; no engine import.

A `/v1/completions` body may list many prompts and ask `n` samples of each; every (prompt, sample) becomes one
engine request with its own task, detokenizer and queue in this process. The product is bounded by
`--max-choices-per-request` (default 4 x `--max-num-seqs`), so a small body cannot allocate without bound. The
rule and its message live in server/request_limits.py, which the router applies too.
"""

from __future__ import annotations

from ..request_limits import fanout_exceeded, num_prompts  # noqa: F401  (num_prompts: re-exported)
from .errors import bad_request


def check_fanout(num_prompts: int, n: int, limit: int) -> None:
    """400 when `num_prompts` x `n` engine requests exceed `limit` (n's own range is checked with the sampling fields)."""
    refused = fanout_exceeded(num_prompts, n, limit)
    if refused is not None:
        raise bad_request(refused.message, param=refused.param, code=refused.code)
