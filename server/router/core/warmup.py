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
the salt of the tenant it came from is kept and nothing crosses tenants. A prefix asked under a
LoRA adapter is replayed as that adapter, and only into a replica that lists it (the joiner's
/v1/models is read first): one that does not would answer 404, and the replay's budget is better
spent on prefixes it can hold.

Hand-off of a replica that begins draining (scale-in, rolling update): its hot prefixes (those
the index says it holds, or that it owned by rendezvous) are replayed into the replicas that
own them by rendezvous over the members that stay, within the same budgets, hottest first;
a prefix another staying replica already holds in full is skipped (the policy will go there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from . import lora
from .policy import rendezvous_weight
from .settings import WarmupConfig

log = logging.getLogger(__name__)


def serves_of(fleet) -> Callable[[str, Optional[str]], bool]:
    """`serves(replica, model)` for the selections: the base model always, an adapter where the replica lists it."""
    view = fleet.adapters
    return lambda rid, model: not view.is_adapter(model) or view.identity(rid, model) is not None


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
        if old is not None:  # the same prefix again (its chain hash names its tokens and salt): counted in place
            old.hits = old.score(now, self.cfg.half_life_s) + 1.0
            old.last, old.salt, old.model, old.cold_key = now, salt, model, cold_key
            return
        # a conversation's next turn replaces the entry of the turn before (a prefix of it)
        prior = next((hashes[i] for i in range(len(hashes) - 2, -1, -1) if hashes[i] in self.entries), None)
        old = self._drop(prior) if prior is not None else None
        hits = (old.score(now, self.cfg.half_life_s) if old else 0.0) + 1.0
        entry = HotPrefix(key, list(token_ids[:len(hashes) * block_size]), salt, model, cold_key, hits, now)
        self.entries[key] = entry
        self.num_tokens += len(entry.token_ids)
        self._evict(now)

    def select(self, replica: str, members: Iterable[str], budget_tokens: int, now: float,
               serves: Callable[[str, Optional[str]], bool] = lambda rid, model: True) -> list[HotPrefix]:
        """Prefixes to replay into `replica`: those it owns by rendezvous over `members` first, hottest first;
        `serves(replica, model)`: whether it can serve a prefix's model (an adapter it lists)."""
        members = list(members)

        def owned(e: HotPrefix) -> bool:
            return max(members, key=lambda m: rendezvous_weight(e.cold_key, m)) == replica

        ranked = sorted(self.entries.values(), key=lambda e: (not owned(e), -e.score(now, self.cfg.half_life_s)))
        out, used = [], 0
        for e in ranked:
            if used + len(e.token_ids) > budget_tokens or not serves(replica, e.model):
                continue
            out.append(e)
            used += len(e.token_ids)
        return out

    def select_handoff(self, leaving: str, staying: Sequence[str], held_by, budget_tokens: int, now: float,
                       serves: Callable[[str, Optional[str]], bool] = lambda rid, model: True
                       ) -> list[tuple[HotPrefix, str]]:
        """(prefix, new owner) pairs to replay when `leaving` drains, hottest first, within the budget.

        `held_by(key)` is the set of replicas whose cache holds the prefix's last block. A prefix
        is the leaving replica's if it holds it or owned it by rendezvous over `staying` + it; its
        new owner is the rendezvous winner over `staying`; one that a staying replica holds is skipped.
        """
        staying = [m for m in staying if m != leaving]
        if not staying:
            return []
        ranked = sorted(self.entries.values(), key=lambda e: -e.score(now, self.cfg.half_life_s))
        out, used = [], 0
        for e in ranked:
            holders = held_by(e.key)
            owner = max(staying, key=lambda m: rendezvous_weight(e.cold_key, m))
            was_owner = rendezvous_weight(e.cold_key, leaving) > rendezvous_weight(e.cold_key, owner)
            if leaving not in holders and not was_owner:
                continue
            if (any(m in holders for m in staying) or used + len(e.token_ids) > budget_tokens
                    or not serves(owner, e.model)):
                continue
            out.append((e, owner))
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
        self.tasks: dict[str, "asyncio.Task"] = {}  # warm-ups, by joining replica
        self.handoffs: dict[str, "asyncio.Task"] = {}  # hand-offs, by draining replica

    def begin(self, fleet, rep) -> None:
        """Warm `rep` if there is anything to replay and another replica can serve meanwhile."""
        others = [r for r in fleet.registry.serving() if r.id != rep.id and not r.warming]
        if (not self.cfg.enabled or not self.hot.entries or not others or rep.id in self.tasks
                or rep.draining):
            return
        rep.warming = True
        self.metrics.replica_warming.labels(rep.id).set(1)
        self.tasks[rep.id] = asyncio.create_task(self._run(fleet, rep))

    def handoff(self, fleet, rep) -> None:
        """`rep` began draining: replay its hot prefixes into their new owners (in the background)."""
        if not self.cfg.enabled or not self.hot.entries or rep.id in self.handoffs:
            return
        self.handoffs[rep.id] = asyncio.create_task(self._handoff(fleet, rep))

    def cancel(self, rid: str) -> None:
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        for tasks in (self.tasks, self.handoffs):
            for rid in list(tasks):
                task = tasks.pop(rid)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _replay(self, target, e: HotPrefix, deadline: float, sem: asyncio.Semaphore) -> bool:
        """One prefill-only request of `e` to replica `target` before `deadline` (monotonic); True if served.

        Its prompt counts as queued work on the target meanwhile (`queued_tokens`, which the policy
        weighs), so live traffic steers around a serving replica busy with hand-off replays; the
        queued-tokens metric leaves it out (`replay_tokens`): the autoscaler reads client work, and
        a scale-in's own hand-off must not read as load that scales straight back out.
        """
        async with sem:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            url = target.spec.url
            body = {"prompt": e.token_ids, "max_tokens": 1}
            if e.model is not None:
                body["model"] = e.model
            if e.salt is not None:
                body["cache_salt"] = e.salt
            target.queued_tokens += len(e.token_ids)
            target.replay_tokens += len(e.token_ids)
            try:
                resp = await self.http.post(url + "/v1/completions", json=body, timeout=left, headers=self.headers)
            except Exception as exc:  # timeouts, a replica gone: this replay is lost, the rest go on
                log.info("replay request to %s failed: %s", url, type(exc).__name__)
                return False
            finally:
                target.queued_tokens -= len(e.token_ids)
                target.replay_tokens -= len(e.token_ids)
            return resp.status_code == 200

    async def _handoff(self, fleet, rep) -> None:
        t0 = time.monotonic()
        staying = [r for r in fleet.registry.serving() if r.id != rep.id]
        reps = {r.id: r for r in staying}

        def held_by(key: bytes) -> set:
            return {rid for rid, st in fleet.index.replicas.items() if key in st.gpu or key in st.cpu}

        chosen = self.hot.select_handoff(rep.id, list(reps), held_by, self.cfg.budget_tokens, t0,
                                         serves_of(fleet))
        sem = asyncio.Semaphore(self.cfg.concurrency)  # as a warm-up: the targets serve live traffic meanwhile
        deadline = t0 + self.cfg.budget_s
        done = {"prefixes": 0, "tokens": 0}

        async def one(e: HotPrefix, owner: str) -> None:
            if await self._replay(reps[owner], e, deadline, sem):
                done["prefixes"] += 1
                done["tokens"] += len(e.token_ids)

        try:
            await asyncio.gather(*(one(e, owner) for e, owner in chosen))
        finally:
            took = time.monotonic() - t0
            self.handoffs.pop(rep.id, None)
            self.metrics.handoff_prefixes.inc(done["prefixes"])
            self.metrics.handoff_tokens.inc(done["tokens"])
            rep.last_handoff = {"prefixes": done["prefixes"], "tokens": done["tokens"], "seconds": round(took, 3),
                                "planned": len(chosen), "to": sorted({o for _, o in chosen})}
            log.info("replica %s draining: handed %d hot prefixes (%d tokens) to %d replicas in %.2f s", rep.id,
                     done["prefixes"], done["tokens"], len({o for _, o in chosen}), took)

    async def _run(self, fleet, rep) -> None:
        t0 = time.monotonic()
        members = [r.id for r in fleet.registry.serving()]  # the membership that owns traffic from now on
        sem = asyncio.Semaphore(self.cfg.concurrency)
        done = {"prefixes": 0, "tokens": 0}

        async def replay(e: HotPrefix) -> None:
            if await self._replay(rep, e, t0 + self.cfg.budget_s, sem):
                done["prefixes"] += 1
                done["tokens"] += len(e.token_ids)

        try:
            if any(fleet.adapters.is_adapter(e.model) for e in self.hot.entries.values()):  # what the joiner lists
                await lora.scrape(fleet.adapters, rep.id, rep.spec.url, fleet.probe_session(), self.headers,
                                  fleet.dialect, models=True)
            chosen = self.hot.select(rep.id, members, self.cfg.budget_tokens, time.monotonic(), serves_of(fleet))
            await asyncio.gather(*(replay(e) for e in chosen))
        finally:
            took = time.monotonic() - t0
            rep.warming = False
            fleet.even_share(rep)  # routable from now on: see Fleet.even_share
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
