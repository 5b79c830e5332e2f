"""What a front door refuses before routing, as a replica would (prompts x n, image parts: request_limits.py); no HTTP.

The replicas refuse such requests too; refusing them here first means an oversized request is never forwarded,
so it never costs a replica anything and is never retried onto another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...rendering import image_part_positions
from ...request_limits import LimitExceeded, fanout_exceeded, images_exceeded, num_prompts
from .errors import Refusal


@dataclass(frozen=True)
class RequestLimits:
    """The replicas' per-request limits as the router applies them (`warmfleet route` flags of the same names)."""

    max_choices: Optional[int]  # --max-choices-per-request; None: no cap
    max_images: Optional[int] = None  # --limit-mm-per-prompt's "image"; None: no limit

    def refusal(self, kind: str, body: dict) -> Optional[Refusal]:
        """The 400 for `body` (a `kind` = "chat" | "completion" request) over a limit, else None. Fields of the
        wrong type are left to the replica, which names them in its own 400."""
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            n = 1
        over: Optional[LimitExceeded] = None
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, (str, list)) and self.max_choices is not None:
                over = fanout_exceeded(num_prompts(prompt), n, self.max_choices)
        else:
            over = None if self.max_choices is None else fanout_exceeded(1, n, self.max_choices)
            messages = body.get("messages")
            if over is None and self.max_images is not None and isinstance(messages, list):
                where = [f"messages[{i}].content[{j}]" for i, j in image_part_positions(messages)]
                over = images_exceeded(where, self.max_images)
        return None if over is None else Refusal(400, over.message, "invalid_request_error", over.param, over.code)


def request_limits(settings) -> RequestLimits:
    """The limits of a router's settings (core/settings.RouterSettings: --max-choices-per-request,
    --limit-mm-per-prompt, else the defaults of the engine it fronts: engine_kinds.REQUEST_LIMITS)."""
    return RequestLimits(settings.choice_limit, settings.image_limit)
