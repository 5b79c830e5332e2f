"""Engine kinds by name: the one list the router's dialects, the operator's engine descriptions and the CRD enum key by.

Stdlib only (the operator imports it): a kind's router dialect is named here as "module:class"
and imported only when a router picks that kind; its replicas' default per-request limits (REQUEST_LIMITS) are
data here, read by the router's doors and the operator alike. Adding an engine is one entry in each here, one dialect
module (server/router/core/engines/) and one description (operator/planning/engine_descriptions.py); tests
check that the three agree.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Mapping, Optional

# kind -> the router's dialect for it (server/router/core/engines/__init__.py: the Dialect protocol it follows)
DIALECTS: dict[str, str] = {
    "warmfleet": "warmfleet.server.router.core.engines.warmfleet:WarmfleetDialect",
    "vllm": "warmfleet.server.router.core.engines.vllm:VllmDialect",
    "fastdeploy": "warmfleet.server.router.core.engines.fastdeploy:PredictedDialect",
}
KINDS: tuple[str, ...] = tuple(DIALECTS)  # in this order in the CRD enum and in `warmfleet route --engine`


@dataclass(frozen=True)
class RequestLimits:
    """What one API request may ask of a replica of a kind when its flags do not say otherwise: the router's and the
    picker's defaults for --max-choices-per-request and --limit-mm-per-prompt, so they refuse only what the replicas
    would (server/request_limits.py)."""

    choices_per_seq: Optional[int]  # prompts x n cap = this x the replicas' --max-num-seqs; None: the engine has none
    max_num_seqs: Optional[int]  # the engine's default --max-num-seqs (None: not used, no cap)
    mm_per_prompt: Mapping[str, int] = field(default_factory=dict)  # --limit-mm-per-prompt's defaults per modality
    mm_unlisted: Optional[int] = None  # count for a modality neither the defaults nor the flag name; None: no limit

    def max_choices(self, max_num_seqs: Optional[int] = None) -> Optional[int]:
        """The replicas' prompts x n cap for this --max-num-seqs (None: the default), None where the engine has none."""
        if self.choices_per_seq is None:
            return None
        return self.choices_per_seq * (max_num_seqs if max_num_seqs is not None else self.max_num_seqs)

    def mm_limit(self, given: Mapping[str, int], modality: str) -> Optional[int]:
        """Most items of `modality` per request given the replicas' parsed --limit-mm-per-prompt (None: no limit)."""
        return given.get(modality, self.mm_per_prompt.get(modality, self.mm_unlisted))


# kind -> its replicas' per-request limits by default. warmfleet: server/config.py's defaults (tests check they agree);
# vLLM 0.32: no prompts x n cap, 999 items per modality (vllm/config/multimodal.py, get_limit_per_prompt);
# FastDeploy: not checked against its source, so nothing is refused in its name
REQUEST_LIMITS: dict[str, RequestLimits] = {
    "warmfleet": RequestLimits(choices_per_seq=4, max_num_seqs=64, mm_per_prompt={"image": 16}),
    "vllm": RequestLimits(choices_per_seq=None, max_num_seqs=None, mm_unlisted=999),
    "fastdeploy": RequestLimits(choices_per_seq=None, max_num_seqs=None),
}


def parse_mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt as modality -> count: vLLM's forms ({"image": 4}, {"image": {"count": 4, ...}});
    ValueError with one readable line."""
    try:
        raw = json.loads(text)
    except (TypeError, ValueError):
        raw = None
    out: dict[str, int] = {}
    for k, v in (raw.items() if isinstance(raw, dict) else [(None, None)]):
        count = v.get("count") if isinstance(v, dict) else v
        if not isinstance(k, str) or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt takes a JSON object of counts >= 0 per modality, e.g. "
                             f"'{{\"image\": 4}}', got {text!r}")
        out[k] = count
    return out


def check(kind: str) -> None:
    """Raise ValueError (one line naming the kinds) for a kind nothing is registered under."""
    if kind not in DIALECTS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {', '.join(KINDS)}")


def dialect_class(kind: str) -> type:
    """The router's dialect class for a kind (imports its module); ValueError for an unknown kind."""
    check(kind)
    module, _, name = DIALECTS[kind].partition(":")
    return getattr(importlib.import_module(module), name)
