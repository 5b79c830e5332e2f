"""Engine dialects the router speaks: one per engine kind, chosen by `warmfleet route --engine`.

A dialect says how a replica of that engine names its KV blocks (so the router can predict
hits), how its KV-event frames decode, and how the router rebuilds a replica's cache state
after a gap, a restart or its own start. Adding an engine is adding one module here.

| kind       | contract        | block names                       | events      | resync             |
| ---------- | --------------- | --------------------------------- | ----------- | ------------------ |
| warmfleet  | exact, ours     | contract-1 chain (hashing.py)     | tagged arrays | GET /v1/kv/snapshot |
| vllm       | exact, vLLM's   | vLLM's sha256_cbor chain, low 64 bits | msgpack maps | replay socket (ROUTER) |
| fastdeploy | predicted       | contract-1 chain, router-side only | none       | none: LRU + age model of what the router sent |
"""

from __future__ import annotations

from typing import Optional, Protocol

KINDS = ("warmfleet", "vllm", "fastdeploy")


class Dialect(Protocol):
    kind: str
    contract: str  # "exact" (events tell what the replica holds) | "predicted" (the router's own decisions)


def dialect_for(kind: str, vllm_hash_seed: Optional[str] = "0", predicted_capacity_blocks: int = 16_384,
                predicted_ttl_s: float = 600.0):
    """The dialect object for an engine kind; raises ValueError for an unknown one."""
    if kind == "warmfleet":
        from .warmfleet import WarmfleetDialect

        return WarmfleetDialect()
    if kind == "vllm":
        from .vllm import VllmDialect

        return VllmDialect(seed=vllm_hash_seed)
    if kind == "fastdeploy":
        from .fastdeploy import PredictedDialect

        return PredictedDialect(predicted_capacity_blocks, predicted_ttl_s)
    raise ValueError(f"unknown engine kind {kind!r}; choose one of {', '.join(KINDS)}")
