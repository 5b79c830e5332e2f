"""Warm-up of joining replicas: the router remembers its hottest prefixes (token ids, not only hashes)
and replays them, prefill-only, into a replica that joins or restarts before it takes traffic.

What is remembered: for each routed text prompt, the token ids of its full blocks, its salt
and model, keyed by the chain hash of its last full block. A later prompt that extends a
remembered one (a conversation's next turn) replaces it and inherits its hits, so one entry
stands for one conversation or one shared prefix. Hits decay with a half-life, so "hot" means
frequent and recent. Memory is bounded by `capacity` entries and `max_tokens` token ids; the
coldest entries go first. Image prompts are not remembered (their pixels are not kept).

What is replayed into a joining replica, within a budget of tokens and seconds: first the
prefixes whose cold key the replica would own by rendezvous hashing over the new membership
(the ones the policy would now place there), hottest first; then the fleet's hottest others.
Each goes as `POST /v1/completions {"prompt": [ids], "max_tokens": 1, "cache_salt": salt}`, so
the salt of the tenant it came from is kept and nothing crosses tenants.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .policy import rendezvous_weight

log = logging.getLogger(__name__)


@dataclass
class HotPrefix:
    key: bytes  # chain hash of its last full block: identity under model and salt
    token_ids: list[int]  # the full blocks' token ids
    salt: Optional[str]
    model: Optional[str]  # the `model` the client asked for (replayed as is)
    cold_key: bytes  # where the policy places it cold (rendezvous key)
    hits: float  # decayed count at `last`
    last: float  # time of the last hit

    def score(self, now: float, half_life_s: float) -> float:
        return self.hits * math.pow(0.5, max(0.0, now - self.last) / half_life_s)


@dataclass(frozen=True)
class WarmupConfig:
    enabled: bool = True
    budget_tokens: int = 65_536  # prompt tokens replayed into one joining replica, at most
    budget_s: float = 30.0  # seconds one warm-up may take before the replica takes traffic anyway
    capacity: int = 1024  # prefixes remembered
    max_tokens: int = 4_000_000  # token ids remembered, in all
    half_life_s: float = 300.0  # hits halve every this many seconds
    concurrency: int = 2  # replay requests in flight per warming replica


class HotPrefixes:
    """Bounded, decaying memory of the prefixes this router routed (pure; the caller passes `now`)."""

    def __init__(self, cfg: WarmupConfig = WarmupConfig()):
        self.cfg = cfg
        self.entries: dict[bytes, HotPrefix] = {}
        self.num_tokens = 0

    def observe(self, token_ids: Sequence[int], hashes: Sequence[bytes], block_size: int, salt: Optional[str],
                model: Optional[str], cold_key: Optional[bytes], now: float) -> None:
        if not hashes or cold_key is None:
            return
        key = hashes[-1]
        old = self.entries.get(key)
        if old is None:  # a conversation's next turn replaces the entry of the turn before (a prefix of it)
            prior = next((hashes[i] for i in range(len(hashes) - 2, -1, -1) if hashes[i] in self.entries), None)
            old = self._drop(prior) if prior is not None else None
        hits = (old.score(now, self.cfg.half_life_s) if old else 0.0) + 1.0
        if key in self.entries:
            self._drop(key)
        entry = HotPrefix(key, list(token_ids[:len(hashes) * block_size]), salt, model, cold_key, hits, now)
        self.entries[key] = entry
        self.num_tokens += len(entry.token_ids)
        self._evict(now)

    def select(self, replica: str, members: Iterable[str], budget_tokens: int, now: float) -> list[HotPrefix]:
        """Prefixes to replay into `replica`: those it owns by rendezvous over `members` first, hottest first."""
        members = list(members)

        def owned(e: HotPrefix) -> bool:
            return max(members, key=lambda m: rendezvous_weight(e.cold_key, m)) == replica

        ranked = sorted(self.entries.values(), key=lambda e: (not owned(e), -e.score(now, self.cfg.half_life_s)))
        out, used = [], 0
        for e in ranked:
            if used + len(e.token_ids) > budget_tokens:
                continue
            out.append(e)
            used += len(e.token_ids)
        return out

    def _drop(self, key: bytes) -> Optional[HotPrefix]:
        e = self.entries.pop(key, None)
        if e is not None:
            self.num_tokens -= len(e.token_ids)
        return e

    def _evict(self, now: float) -> None:
        """Over a bound, drop the coldest down to 90% of it (in one sort, not one per request)."""
        if len(self.entries) <= self.cfg.capacity and self.num_tokens <= self.cfg.max_tokens:
            return
        keep_entries, keep_tokens = int(self.cfg.capacity * 0.9), int(self.cfg.max_tokens * 0.9)
        for e in sorted(self.entries.values(), key=lambda e: e.score(now, self.cfg.half_life_s)):
            if len(self.entries) <= keep_entries and self.num_tokens <= keep_tokens:
                break
            self._drop(e.key)


class Warmer:
    """Runs the warm-up of each joining replica; the fleet keeps it out of routing meanwhile."""

    def __init__(self, cfg: WarmupConfig, http, metrics, headers: dict):
        self.cfg, self.http, self.metrics, self.headers = cfg, http, metrics, headers
        self.hot = HotPrefixes(cfg)
        self.tasks: dict[str, "asyncio.Task"] = {}

    def begin(self, fleet, rep) -> None:
        """Warm `rep` if there is anything to replay and another replica can serve meanwhile."""
        others = [r for r in fleet.registry.healthy() if r.id != rep.id and not r.warming]
        if not self.cfg.enabled or not self.hot.entries or not others or rep.id in self.tasks:
            return
        rep.warming = True
        self.metrics.replica_warming.labels(rep.id).set(1)
        self.tasks[rep.id] = asyncio.create_task(self._run(fleet, rep))

    def cancel(self, rid: str) -> None:
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        for rid in list(self.tasks):
            task = self.tasks.pop(rid)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self, fleet, rep) -> None:
        t0 = time.monotonic()
        members = [r.id for r in fleet.registry.healthy()]
        chosen = self.hot.select(rep.id, members, self.cfg.budget_tokens, time.monotonic())
        sem = asyncio.Semaphore(self.cfg.concurrency)
        done = {"prefixes": 0, "tokens": 0}

        async def replay(e: HotPrefix) -> None:
            async with sem:
                left = self.cfg.budget_s - (time.monotonic() - t0)
                if left <= 0:
                    return
                body = {"prompt": e.token_ids, "max_tokens": 1}
                if e.model is not None:
                    body["model"] = e.model
                if e.salt is not None:
                    body["cache_salt"] = e.salt
                try:
                    resp = await self.http.post(rep.spec.url + "/v1/completions", json=body, timeout=left,
                                                headers=self.headers)
                except Exception as exc:  # timeouts, a replica gone again: the warm-up ends, routing resumes
                    log.info("warm-up request to %s failed: %s", rep.id, type(exc).__name__)
                    return
                if resp.status_code == 200:
                    done["prefixes"] += 1
                    done["tokens"] += len(e.token_ids)

        try:
            await asyncio.gather(*(replay(e) for e in chosen))
        finally:
            took = time.monotonic() - t0
            rep.warming = False
            self.tasks.pop(rep.id, None)
            m = self.metrics
            m.replica_warming.labels(rep.id).set(0)
            m.warmup_seconds.observe(took)
            m.warmup_prefixes.labels(rep.id).inc(done["prefixes"])
            m.warmup_tokens.labels(rep.id).inc(done["tokens"])
            rep.last_warmup = {"prefixes": done["prefixes"], "tokens": done["tokens"], "seconds": round(took, 3),
                               "budget_tokens": self.cfg.budget_tokens, "budget_s": self.cfg.budget_s}
            log.info("replica %s warmed: %d prefixes, %d tokens in %.2f s", rep.id, done["prefixes"],
                     done["tokens"], took)
