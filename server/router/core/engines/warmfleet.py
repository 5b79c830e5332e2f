"""warmfleet replicas: contract-1 block hashes, our KV-event frames, resync from GET /v1/kv/snapshot."""

from __future__ import annotations

import logging
from typing import Optional

import httpx

from ....events import EventBatch, Snapshot, decode
from ....hashing import AdapterId
from ..prompt import HashConfig, HashMemo, Prompt, prompt_block_hashes

log = logging.getLogger(__name__)


class WarmfleetDialect:
    kind = "warmfleet"
    contract = "exact"
    lora_running_busy = False  # our running label names resident slots, busy or idle
    # NOTE: not /health, which is liveness: 200 from the moment the HTTP server listens, while the model
    # still loads and every request would get a 503.
    ready_path = "/ready"

    def __init__(self, memo_capacity: int = 200_000):
        self.memo = HashMemo(memo_capacity)

    @classmethod
    def from_settings(cls, settings) -> "WarmfleetDialect":
        return cls()

    def block_hashes(self, prompt: Prompt, cache_salt: Optional[str], cfg: HashConfig,
                     adapter: Optional[AdapterId] = None) -> list[bytes]:
        return prompt_block_hashes(prompt, cache_salt, cfg, self.memo, adapter)

    def adapter_identity(self, card: dict) -> Optional[AdapterId]:
        """A /v1/models adapter entry's identity in our chain root: its name and the engine's digest of its files."""
        digest = card.get("lora_digest")
        return AdapterId(card["id"], digest) if isinstance(digest, str) and digest else None

    def served(self, index, rid: str, hashes) -> None:
        """Nothing to predict: the replica's own events say what it stored."""

    def forget(self, rid: str) -> None:
        """Nothing kept per replica outside the index."""

    def prepare_body(self, body: dict, prompt: Prompt) -> bool:
        """The request goes as the client sent it (the replica computes the same names itself)."""
        return False

    async def poll_load(self, rep, http):
        """None: load figures ride on the KV events (warmfleet) or are this router's in-flight counts (vLLM)."""
        return None

    def hash_check(self) -> dict:
        return {}  # our own recipe: the snapshot's model fingerprint and block size are checked instead

    def decode(self, frames: list[bytes]) -> EventBatch:
        return decode(frames)

    async def fetch_state(self, rep, http: httpx.AsyncClient, headers: dict) -> Optional[Snapshot]:
        """The replica's snapshot; None when it cannot be had now (marks the replica untracked if it has none)."""
        try:
            resp = await http.get(rep.spec.url + "/v1/kv/snapshot", timeout=10.0, headers=headers)
        except httpx.HTTPError as exc:
            log.info("snapshot from %s failed: %s", rep.id, type(exc).__name__)
            return None
        if resp.status_code in (404, 405, 501):
            log.warning("replica %s serves no KV snapshot; routing it without its cache index", rep.id)
            rep.kv_tracked = False
            return None
        if resp.status_code != 200:
            return None
        try:
            return Snapshot.from_json(resp.json())
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad snapshot from %s: %s", rep.id, exc)
            return None
