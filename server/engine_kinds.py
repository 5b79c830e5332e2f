"""Engine kinds by name: the one list the router's dialects, the operator's engine descriptions and the CRD enum key by.

Stdlib only (the operator imports it): a kind's router dialect is named here as "module:class"
and imported only when a router picks that kind. Adding an engine is one entry here, one dialect
module (server/router/core/engines/) and one description (operator/planning/engine_descriptions.py); tests
check that the three agree.
"""

from __future__ import annotations

import importlib

# kind -> the router's dialect for it (server/router/core/engines/__init__.py: the Dialect protocol it follows)
DIALECTS: dict[str, str] = {
    "warmfleet": "warmfleet.server.router.core.engines.warmfleet:WarmfleetDialect",
    "vllm": "warmfleet.server.router.core.engines.vllm:VllmDialect",
    "fastdeploy": "warmfleet.server.router.core.engines.fastdeploy:PredictedDialect",
}
KINDS: tuple[str, ...] = tuple(DIALECTS)  # in this order in the CRD enum and in `warmfleet route --engine`


def check(kind: str) -> None:
    """Raise ValueError (one line naming the kinds) for a kind nothing is registered under."""
    if kind not in DIALECTS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {', '.join(KINDS)}")


def dialect_class(kind: str) -> type:
    """The router's dialect class for a kind (imports its module); ValueError for an unknown kind."""
    check(kind)
    module, _, name = DIALECTS[kind].partition(":")
    return getattr(importlib.import_module(module), name)
