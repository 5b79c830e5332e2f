"""Engine dialects the router speaks: one per engine kind, chosen by `warmfleet route --engine`.

A dialect says how a replica of that engine names its KV blocks (so the router can predict
hits), how its KV-event frames decode, and how the router rebuilds a replica's cache state
after a gap, a restart or its own start. Adding an engine is adding one module here and naming
it in server/engine_kinds.py.

| kind       | contract        | block names                       | events      | resync             |
| ---------- | --------------- | --------------------------------- | ----------- | ------------------ |
| warmfleet  | exact, ours     | contract-1 chain (hashing.py)     | tagged arrays | GET /v1/kv/snapshot |
| vllm       | exact, vLLM's   | vLLM's sha256_cbor chain, low 64 bits | msgpack maps | replay socket (ROUTER) |
| fastdeploy | predicted       | contract-1 chain, router-side only | none       | none: LRU + age model of what the router sent |
"""

from __future__ import annotations

from typing import Optional, Protocol

from ....engine_kinds import dialect_class


class Dialect(Protocol):
    """What the router's fleet, index and proxy ask of an engine kind (tests/test_router_engines.py checks each)."""

    kind: str  # its name in engine_kinds.DIALECTS
    contract: str  # "exact" (events tell what the replica holds) | "predicted" (the router's own decisions)
    lora_running_busy: bool  # vllm:lora_requests_info's running label names adapters with requests (not idle slots)
    ready_path: str  # GET path whose 200 means "takes requests now"; the router's active health check asks it

    @classmethod
    def from_settings(cls, settings) -> "Dialect":
        """The dialect a router with these RouterSettings speaks (its knobs: --vllm-hash-seed, --predicted-*)."""

    def block_hashes(self, prompt, cache_salt: Optional[str], cfg, adapter=None) -> list[bytes]:
        """The index keys of the prompt's full blocks, as this engine names them (for LoRA `adapter`, an
        `adapter_identity`)."""

    def adapter_identity(self, card: dict):
        """A /v1/models entry with `parent` (a LoRA adapter) as this engine keys its blocks; None: not known yet."""

    def prepare_body(self, body: dict, prompt) -> bool:
        """Rewrite the request so the engine names its blocks as predicted; True if the body changed."""

    def decode(self, frames: list[bytes]):
        """One KV-event message as an EventBatch; ValueError if malformed."""

    async def fetch_state(self, rep, http, headers: dict):
        """The replica's full cache state as a Snapshot (after a gap, a restart, a connect); None: try later."""

    def served(self, index, rid: str, hashes) -> None:
        """The replica accepted a prompt with these blocks (the predicted index learns from it)."""

    def forget(self, rid: str) -> None:
        """The replica is down or gone."""

    async def poll_load(self, rep, http):
        """The replica's Load from a source other than KV events, or None."""

    def hash_check(self) -> dict:
        """Self-check figures of the hash reproduction, if any (shown in /v1/router/replicas)."""


def dialect_for(settings) -> Dialect:
    """The dialect of `settings.engine` (a RouterSettings), looked up in engine_kinds; ValueError for an unknown kind."""
    return dialect_class(settings.engine).from_settings(settings)
