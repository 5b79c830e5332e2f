"""The replicas' per-request limits (prompts x n, media items) as the router and the picker must apply them, read from the arguments the pools run with; pure.

The router and the endpoint picker refuse a request over the replicas' limits before routing (issue 40). Without
flags they apply the defaults of the engine they front (server/engine_kinds.py REQUEST_LIMITS); when the pools run
with `--max-num-seqs`, `--max-choices-per-request` or `--limit-mm-per-prompt` of their own (spec.server.extraArgs,
spec.engine.extraArgs), the front doors get the matching flags, the most permissive over the pools, since a request
may go to any of them.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Sequence

from warmfleet.server import engine_kinds

SEQS, CHOICES, MM = "--max-num-seqs", "--max-choices-per-request", "--limit-mm-per-prompt"


def flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The value of `flag` in `args` (`--flag V` or `--flag=V`; the last one wins, as argparse reads it), else None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a[len(flag) + 1:]
    return found


def _int(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:  # the replica refuses it and never serves: nothing to follow
        return None


def _choices(args: Sequence[str], limits: engine_kinds.RequestLimits) -> Optional[int]:
    """One pool's prompts x n cap (None: none)."""
    given = _int(flag_value(args, CHOICES))
    return given if given is not None else limits.max_choices(_int(flag_value(args, SEQS)))


def _mm(args: Sequence[str]) -> dict[str, int]:
    text = flag_value(args, MM)
    try:
        return engine_kinds.parse_mm_limits(text) if text is not None else {}
    except ValueError:
        return {}


def front_door_limits(pool_args: Iterable[Sequence[str]], kind: str) -> dict[str, Any]:
    """RouterSettings fields (max_choices_per_request, limit_mm_per_prompt) for front doors over pools running with
    these engine arguments: each only where some pool sets it, as the most permissive pool's value; {} leaves the
    engine's defaults to the router."""
    pools, limits, out = [list(a) for a in pool_args], engine_kinds.REQUEST_LIMITS[kind], {}
    if any(flag_value(a, SEQS) is not None or flag_value(a, CHOICES) is not None for a in pools):
        caps = [_choices(a, limits) for a in pools]
        if caps and None not in caps:  # a pool without a cap: the router has none either (its engine default)
            out["max_choices_per_request"] = max(caps)
    given = [_mm(a) for a in pools]
    modalities = sorted({m for g in given for m in g})
    mm = {m: [limits.mm_limit(g, m) for g in given] for m in modalities}
    mm = {m: max(v) for m, v in mm.items() if None not in v}  # unlimited in one pool: the engine default (none)
    if mm:
        out["limit_mm_per_prompt"] = json.dumps(mm, sort_keys=True)
    return out
