"""What one API request may ask for (prompts x n, images), judged the same way by the replica's API and the router's doors; no I/O, no engine import.

A `/v1/completions` body may list many prompts and ask `n` samples of each: every (prompt, sample) is one
engine request. A chat body may carry many image parts, each one download and decode. Both are bounded per
request (`--max-choices-per-request`, `--limit-mm-per-prompt`); the replica refuses before any work, and a
router in front refuses with the same 400 before forwarding, so one request cannot reach (and retry over)
several replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

CHOICES_PER_SEQ = 4  # --max-choices-per-request's default: this many x --max-num-seqs


@dataclass(frozen=True)
class LimitExceeded:
    """A request over a limit: the 400's message, the field it names (`param`) and its `code`."""

    message: str
    param: Optional[str]
    code: str


def num_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds (a string, a list of strings, token ids, lists of ids)."""
    if isinstance(prompt, str):
        return 1
    if prompt and all(isinstance(x, int) for x in prompt):
        return 1
    return len(prompt)


def fanout_exceeded(num_prompts: int, n: int, limit: int) -> Optional[LimitExceeded]:
    """The refusal when `num_prompts` x `n` engine requests exceed `limit`, else None."""
    if num_prompts * n <= limit:
        return None
    what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
    return LimitExceeded(
        f"this request asks for {num_prompts * n} completions ({what}), more than this server's limit of {limit} "
        "per request (--max-choices-per-request); split it into several requests",
        "n" if num_prompts == 1 else "prompt", "too_many_choices")


def images_exceeded(where: list[str], limit: Optional[int]) -> Optional[LimitExceeded]:
    """The refusal when the image parts at `where` ("messages[i].content[j]", in prompt order) are more than
    `limit` (None: no limit), else None; it names the first part over the limit."""
    if limit is None or len(where) <= limit:
        return None
    return LimitExceeded(f"{where[limit]}: this request has {len(where)} images, more than the limit of {limit} per "
                         "prompt (--limit-mm-per-prompt)", where[limit].replace("[", ".").replace("]", ""),
                         "invalid_image")
