"""FastDeploy replicas (no KV events): a predicted index fed by the router's own decisions, with a capacity and age model.

FastDeploy publishes no KV-cache events, so the router cannot know what a replica holds; it
can know what it sent there. Every prompt a replica accepted (answered 200) is recorded as
cached on it, under contract-1 names (any consistent naming works: the router is both the
writer and the reader of these entries). Each replica's predicted cache is an LRU of at most
`capacity_blocks` blocks, and an entry older than `ttl_s` is dropped, because the real cache
evicts under load the router does not see. Decisions made on these entries are counted as
predicted in the metrics (`warmfleet_router_predicted_decisions_total`, contract "predicted" in
/v1/router/replicas). Load (running + waiting requests) comes from FastDeploy's own Prometheus
gauges on its metrics port.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from ....events import GPU, EventBatch, Load, Snapshot
from ..prompt import HashConfig, HashMemo, Prompt, prompt_block_hashes

RUNNING, WAITING = "fastdeploy:num_requests_running", "fastdeploy:num_requests_waiting"  # gauges, per its metrics docs


def parse_load(text: str) -> Optional[Load]:
    """Running and waiting requests from FastDeploy's Prometheus text; None if it has neither gauge."""
    found: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in (RUNNING, WAITING):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    if not found:
        return None
    return Load(int(found.get(RUNNING, 0)), int(found.get(WAITING, 0)), 0, 0)


class PredictedDialect:
    kind = "fastdeploy"
    contract = "predicted"
    lora_running_busy = False  # no LoRA
    # the operator's readiness probe for FastDeploy (operator/planning/engine_descriptions.py)
    ready_path = "/health"

    def __init__(self, capacity_blocks: int, ttl_s: float, memo_capacity: int = 200_000):
        if capacity_blocks < 1 or ttl_s <= 0:
            raise ValueError("the predicted cache needs capacity_blocks >= 1 and ttl_s > 0")
        self.capacity_blocks, self.ttl_s = capacity_blocks, ttl_s  # blocks per replica; age before one is forgotten
        self.memo = HashMemo(memo_capacity)
        self.lru: dict[str, OrderedDict] = {}  # replica -> block hash -> last time the router sent it there

    @classmethod
    def from_settings(cls, settings) -> "PredictedDialect":
        """--predicted-capacity-blocks (set it to the replicas' KV pool) and --predicted-ttl-s."""
        return cls(settings.predicted_capacity_blocks, settings.predicted_ttl_s)

    def block_hashes(self, prompt: Prompt, cache_salt: Optional[str], cfg: HashConfig, adapter=None) -> list[bytes]:
        return prompt_block_hashes(prompt, cache_salt, cfg, self.memo)  # no LoRA (the operator refuses it)

    def adapter_identity(self, card: dict) -> None:
        """None: FastDeploy serves no LoRA adapters here."""
        return None

    def prepare_body(self, body: dict, prompt: Prompt) -> bool:
        """The request goes as the client sent it (the replica computes the same names itself)."""
        return False

    def hash_check(self) -> dict:
        return {}

    def decode(self, frames: list[bytes]) -> EventBatch:
        raise ValueError("FastDeploy publishes no KV events; the replica should have no events endpoint")

    async def fetch_state(self, rep, http, headers: dict) -> Optional[Snapshot]:
        return Snapshot(rep.id, 0, 0, "", [], [], [])  # nothing to fetch: the prediction is the state

    async def poll_load(self, rep, http) -> Optional[Load]:
        """The replica's load from its metrics port (`metrics=` / `--replica-metrics-port` / the `metrics` port)."""
        if not rep.spec.metrics:
            return None
        try:
            resp = await http.get(rep.spec.metrics.rstrip("/") + "/metrics", timeout=1.0)
            return parse_load(resp.text) if resp.status_code == 200 else None
        except Exception:  # httpx errors, or text that is not Prometheus exposition format
            return None

    def served(self, index, rid: str, hashes: Sequence[bytes], now: Optional[float] = None) -> None:
        """Record that `rid` accepted a prompt with these blocks; evict by age and capacity."""
        now = time.monotonic() if now is None else now
        lru = self.lru.setdefault(rid, OrderedDict())
        for h in hashes:
            lru[h] = now
            lru.move_to_end(h)
        index.add_blocks(rid, hashes, GPU)
        gone = []
        while lru and (len(lru) > self.capacity_blocks or now - next(iter(lru.values())) > self.ttl_s):
            gone.append(lru.popitem(last=False)[0])
        if gone:
            index.remove_blocks(rid, gone, GPU)

    def forget(self, rid: str) -> None:
        """The replica went down or left: its cache is gone."""
        self.lru.pop(rid, None)
