"""The decision every front door asks for (`Router.route`: render, hash, match, score) and the load it books; no HTTP.

    front door (HTTP proxy, Endpoint Picker)
      │ route(kind, body)          → Routed: the decision's replica order, prompt, block names
      │ retry_order(decision, n)   → the replicas to try, healthy when their turn comes
      │ enter / prefilled / leave  → in flight and queued prefill per replica (what the policy weighs)
      │ record_actual              → actual vs predicted cached tokens (the replica's usage)
      ▼
    fleet (membership, health, KV index, warm-up) · policy.choose · peers (other routers' load)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional

from ... import rendering
from ...multimodal.url_hashes import parse_header
from .fleet import Fleet
from .metrics import RouterMetrics
from .policy import RETRY, Candidate, Decision, PolicyConfig, choose
from .prompt import HashConfig, Prompt, PromptRenderer
from .registry import Replica
from .ttft import TtftModels

log = logging.getLogger(__name__)

SHARE_WINDOW = 512  # requests over which the policy's share cap evens out request counts
SHARE_DECAY = 1.0 - 1.0 / SHARE_WINDOW


def has_images(body: dict) -> bool:
    """Whether a chat body holds an image part (cheap: no decoding)."""
    messages = body.get("messages")
    return isinstance(messages, list) and rendering.has_images(messages)


def adapter_key(name: str) -> bytes:
    """The rendezvous key of a LoRA adapter: its name (the same on every router process and replica)."""
    return b"lora\0" + name.encode()


def cached_tokens_of(body: dict) -> Optional[int]:
    """`usage.prompt_tokens_details.cached_tokens` of an OpenAI answer (or stream event), None if it has none."""
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


@dataclass(frozen=True)
class Routed:
    """One request's routing outcome: what a front door needs to send it."""

    decision: Decision  # replicas in the order to try them, the reason, predicted hits per replica
    prompt: Optional[Prompt]  # None: the router cannot render the request (the replica will judge it)
    hashes: list[bytes]  # the prompt's block names as the fleet's engine names them
    body_changed: bool  # the dialect rewrote the body (e.g. vLLM: image uuids): the client's bytes no longer do


class TtftSample(NamedTuple):
    """What a TTFT model learns from one request: when it was sent, the prefill it waited for, the load then."""

    t_sent: float
    prefill_tokens: int
    load: float


class Router:
    """One router's decisions over its fleet, and the load they put on it; shared by every front door."""

    peers = None  # peers.PeerLoad when other routers share the fleet: their load is added to this router's

    def __init__(self, fleet: Fleet, renderer: Optional[PromptRenderer], hash_cfg: HashConfig,
                 metrics: RouterMetrics, policy: PolicyConfig = PolicyConfig(), cold_key_blocks: int = 1):
        self.fleet, self.renderer, self.hash_cfg = fleet, renderer, hash_cfg
        self.metrics, self.policy, self.cold_key_blocks = metrics, policy, cold_key_blocks
        self._media_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # render_off_loop's thread
        # fitted per replica from streamed first tokens when the policy scores by predicted TTFT
        self.ttft = TtftModels(policy.ttft_model_samples) if policy.ttft_model_samples else None

    # --- decision ---------------------------------------------------------------------------
    async def route(self, kind: str, body: dict,
                    eligible: Optional[Callable[[Replica], bool]] = None) -> Optional[Routed]:
        """Decide where `body` (a `kind` = "chat" | "completion" request) goes; None if no replica is routable
        (among those `eligible` allows: a gateway's subset hint).

        A chat request with images is rendered off the event loop first; the dialect may then rewrite
        `body` in place so the engine names its blocks as predicted."""
        rendered = None
        if kind == "chat" and self.renderer is not None and has_images(body):
            rendered = (await self.render_off_loop(kind, body),)
        replicas = self.fleet.routable()  # after the render: the fleet may change while it runs
        if eligible is not None:
            replicas = [r for r in replicas if eligible(r)]
        if not replicas:
            return None
        decision, prompt, hashes = self.decide(kind, body, replicas, rendered)
        changed = prompt is not None and self.fleet.dialect.prepare_body(body, prompt)
        return Routed(decision, prompt, hashes, changed)

    def render(self, kind: str, body: dict) -> Optional[Prompt]:
        if self.renderer is None:
            return None
        try:
            return self.renderer.chat(body) if kind == "chat" else self.renderer.completion(body)
        except Exception as exc:  # the replica will judge the request; the router only loses its prediction
            log.debug("cannot render %s request: %s", kind, exc)
            return None

    async def render_off_loop(self, kind: str, body: dict) -> Optional[Prompt]:
        """`render` for a request with images (decoding and hashing them is CPU work: 5,000 parts held the loop
        ~3.5 s) on one worker thread, so text requests keep flowing; one thread keeps the image memo single-writer."""
        if self._media_pool is None:
            self._media_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="router-media")
        return await asyncio.get_running_loop().run_in_executor(self._media_pool, self.render, kind, body)

    def learn_media(self, body: dict, header: Optional[str]) -> None:
        """Remember what a replica's answer to `body` says its http(s) images hashed to (url_hashes.py), under the
        body's salt (the tenant's); a no-op without the header."""
        if not header or self.renderer is None:
            return
        rows = parse_header(header)
        salt = body.get("cache_salt")
        if rows and (salt is None or isinstance(salt, str)):
            self.renderer.urls.learn(salt, rows)
            self.metrics.media_urls_learned.inc(len(rows))

    def close(self) -> None:
        """Stop render_off_loop's thread (a render under way finishes; nothing waits for it)."""
        if self._media_pool is not None:
            self._media_pool.shutdown(wait=False, cancel_futures=True)

    def adapter_of(self, body: dict, replicas: list[Replica]) -> tuple[Optional[str], list[Replica]]:
        """The LoRA adapter `body` names (None: the base model or unknown) and the replicas to route it among: those
        that serve it, when any does (the others would answer 404)."""
        model = body.get("model")
        view = self.fleet.adapters
        if not isinstance(model, str) or not view.is_adapter(model):
            return None, replicas
        serving = [r for r in replicas if view.identity(r.id, model) is not None]
        return model, serving or replicas

    def adapter_hashes(self, prompt: Prompt, salt: Optional[str], adapter: str,
                       replicas: list[Replica]) -> tuple[dict, dict]:
        """Block names and prefix matches per replica for an adapter request: hashed once per distinct identity
        the replicas serve the adapter under (the same files everywhere: once)."""
        view, groups = self.fleet.adapters, {}
        for r in replicas:
            groups.setdefault(view.identity(r.id, adapter), []).append(r.id)
        names, matches = {}, {}
        for ident, rids in groups.items():
            h = self.fleet.dialect.block_hashes(prompt, salt, self.hash_cfg, ident) if ident is not None else []
            matches.update(self.fleet.index.match(h, rids))
            names.update((rid, h) for rid in rids)
        return names, matches

    def decide(self, kind: str, body: dict, replicas: list[Replica],
               rendered: Optional[tuple[Optional[Prompt]]] = None) -> tuple[Decision, Optional[Prompt], list[bytes]]:
        """The routing decision, the rendered prompt (None if the router cannot render it) and its block names.

        `rendered` is `(prompt,)` when the caller rendered it already (off the loop); else it is rendered here."""
        t0 = time.perf_counter()
        prompt = rendered[0] if rendered is not None else self.render(kind, body)
        bs = self.hash_cfg.block_size
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None  # not a string: the replica answers the 400, not a crash here
        adapter, replicas = self.adapter_of(body, replicas)
        if adapter is None:
            hashes = self.fleet.dialect.block_hashes(prompt, salt, self.hash_cfg) if prompt else []
            matches = self.fleet.index.match(hashes, [r.id for r in replicas])
            names = None
        else:
            names, matches = (self.adapter_hashes(prompt, salt, adapter, replicas) if prompt
                              else ({}, self.fleet.index.match([], [r.id for r in replicas])))
            hashes = next(iter(names.values()), [])
        view = self.fleet.adapters
        cands = []
        combined = None
        now = time.monotonic()
        if self.peers is not None:  # every router's load on each replica: ours exact, the peers' as of their report
            combined = {r.id: self.peers.combined(r.id, r.in_flight, r.queued_tokens, r.sent) for r in replicas}
            mine = self.peers.preferred(combined)
        # replica -> images not wholly inside its cached KV prefix whose encoder output it holds: the engine needs rows
        # of each (all of it, or the tail past the prefix), and the vision encoder runs on a whole image or not at all
        warm_images: dict[str, int] = {}
        for r in replicas:
            m = matches[r.id]
            warm = 0
            if prompt and prompt.mm_items:
                warm, n = self._encodes_saved(r.id, prompt, m.blocks * bs)
                if n:
                    warm_images[r.id] = n
            resident, slot = (view.resident(r.id, adapter), view.has_slot(r.id, adapter)) if adapter else (False, True)
            if combined is None:
                cands.append(Candidate(r.id, m.gpu_blocks, m.cpu_blocks, warm,  # positional: a keyword call costs more
                                       max(r.in_flight, self.fleet.engine_load(r.id, now=now)), r.queued_tokens,
                                       r.sent, 0.0, 0, resident, slot))
            else:
                in_flight, queued, sent = combined[r.id]
                if mine is not None and r.id not in mine:
                    queued += self.peers.partition_tokens
                cands.append(Candidate(r.id, m.gpu_blocks, m.cpu_blocks, warm,
                                       load=max(in_flight, self.fleet.engine_load(r.id, now=now)),
                                       queued_tokens=queued, sent=sent, tie=random.random() * self.peers.jitter,
                                       unseen=self.peers.fresh, adapter_resident=resident, adapter_slot=slot))
        cold_key = hashes[min(len(hashes), self.cold_key_blocks) - 1] if hashes else None
        num_tokens = prompt.num_tokens if prompt else 0
        ttft = None
        if self.ttft is not None:
            ttft = {c.replica: self.ttft.coefficients(c.replica) for c in cands}
            if None in ttft.values():  # not fitted yet: the fixed weights
                ttft = None
        decision = choose(cands, block_size=bs, num_prompt_tokens=num_tokens, cold_key=cold_key, cfg=self.policy,
                          adapter_key=adapter_key(adapter) if adapter else None, ttft=ttft)
        if adapter is not None:
            decision = dataclasses.replace(decision, adapter=adapter)
            hashes = names.get(decision.order[0], hashes) if decision.order else hashes
        if self.fleet.index.max_blocks_per_replica is not None and decision.order:  # capped index: LRU by use
            used = matches.get(decision.order[0])
            if used is not None and used.blocks:
                self.fleet.index.touch(decision.order[0], hashes[:used.blocks])
        if prompt is not None and not prompt.mm_items:  # remembered for warming replicas that join later
            # placed as the policy places it cold: an adapter's prefixes by the adapter's rendezvous
            place = adapter_key(adapter) if adapter is not None else cold_key
            self.fleet.warmer.hot.observe(prompt.token_ids, hashes, bs, body.get("cache_salt"), body.get("model"),
                                          place, now)
        if warm_images and decision.order and warm_images.get(decision.order[0]):
            self.metrics.predicted_encoder_hits.inc(warm_images[decision.order[0]])
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        self.metrics.decisions.labels(decision.reason).inc()
        if self.fleet.dialect.contract == "predicted":
            self.metrics.predicted_decisions.labels(decision.reason).inc()
        self.metrics.prompt_tokens.inc(num_tokens)
        return decision, prompt, hashes

    def _encodes_saved(self, rid: str, prompt: Prompt, cached_tokens: int) -> tuple[int, int]:
        """Image tokens whose encoding replica `rid` saves this request, and how many of those images its encoder
        cache serves.

        An image wholly inside the cached prefix needs no encoding (its KV is there); one the prefix does not wholly
        hold is encoded whole unless the encoder cache has it. Both save the encode, so both count: an image in a
        conversation's own prefix must not weigh less than the same image merely encoder-cached elsewhere.
        """
        in_prefix = [i for i in prompt.mm_items if i.offset + i.length <= cached_tokens]
        rest = [i for i in prompt.mm_items if i.offset + i.length > cached_tokens]
        hits = self.fleet.index.encoder_hits(rid, [i.mm_hash for i in rest]) if rest else set()
        served = [i for i in rest if i.mm_hash in hits]
        return sum(i.length for i in in_prefix) + sum(i.length for i in served), len(served)

    def retry_order(self, decision: Decision, max_attempts: int) -> Iterator[Replica]:
        """The decision's replicas still healthy when their turn comes, at most `max_attempts`; each after the first
        counts as a retry."""
        tried = 0
        for rid in decision.order:
            rep = self.fleet.registry.get(rid)
            if rep is None or not rep.healthy:
                continue
            if tried == max_attempts:
                return
            if tried:
                self.metrics.retries.inc()
                self.metrics.decisions.labels(RETRY).inc()
            tried += 1
            yield rep

    # --- load this router put on the replicas ---------------------------------------------------
    def enter(self, rep: Replica, queued_tokens: int = 0, adapter: Optional[str] = None) -> Optional[TtftSample]:
        """A request goes to `rep`: one more in flight, its uncached prompt queued until its first token; one more
        on its LoRA `adapter` there (Decision.adapter). With TTFT models, the sample `first_token` completes."""
        sample = None
        if self.ttft is not None:
            sample = TtftSample(time.perf_counter(), rep.queued_tokens + queued_tokens,
                                max(rep.in_flight, self.fleet.engine_load(rep.id)))
        rep.in_flight += 1
        if adapter is not None:
            self.fleet.adapters.sent(rep.id, adapter)
        rep.queued_tokens += queued_tokens
        for r in self.fleet.registry.replicas.values():  # recent share: counts decay over ~SHARE_WINDOW requests
            r.sent *= SHARE_DECAY
        rep.sent += 1
        return sample

    def first_token(self, rep: Replica, sample: Optional[TtftSample]) -> None:
        """A streamed answer's first bytes from `rep` (its first token): the sample of its TTFT model."""
        if sample is not None and self.ttft is not None:
            self.ttft.observe(rep.id, sample.prefill_tokens, sample.load, time.perf_counter() - sample.t_sent)

    def prefilled(self, rep: Replica, queued_tokens: int) -> None:
        """The request's prompt is no longer work queued ahead of others (first token, answer or failure)."""
        rep.queued_tokens -= queued_tokens

    def leave(self, rep: Replica, adapter: Optional[str] = None) -> None:
        """The request's last byte has gone (or it failed): one fewer in flight on `rep` (and on its `adapter`)."""
        rep.in_flight -= 1
        if adapter is not None:
            self.fleet.adapters.done(rep.id, adapter)

    def record_actual(self, decision: Decision, rid: str, actual: Optional[int]) -> None:
        """Actual vs predicted for the replica that answered (after a retry: that replica's own prediction)."""
        if actual is None:
            return
        predicted = decision.predicted_for(rid)
        self.metrics.actual_cached_tokens.inc(actual)
        self.metrics.usage_prompt_tokens.inc(decision.num_prompt_tokens)
        self.metrics.predicted_cached_tokens.inc(predicted)
        self.metrics.prediction_error.observe(actual - predicted)
