"""The decision every front door asks for (`Router.route`: render, hash, match, score); no HTTP.

    front door (HTTP proxy, Endpoint Picker)
      │ route(kind, body)   → a Booking (booking.py): the decision's replica order and block names; the door
      │                       books the request's load with it and reports what happened (enter … leave)
      ▼
    decide: match (the prompt's blocks per replica) → candidates (cache, load, adapter per replica)
            → choose (policy.choose, fixed weights or the TTFT models, node-tier blocks at the price in effect:
            pricing.py) → after the decision (index LRU, hot prefixes for warm-ups, metrics)
    fleet (membership, health, KV index, warm-up) · policy.choose · peers (other routers' load)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import random
import time
from typing import Callable, Optional

from ... import rendering
from ...multimodal.url_hashes import parse_header
from .booking import Booking
from .fleet import Fleet
from .metrics import RouterMetrics
from .policy import Candidate, Decision, PolicyConfig, choose
from .pricing import NodeTierPricing
from .prompt import HashConfig, Prompt, PromptRenderer
from .registry import Replica
from .ttft import TtftModels

log = logging.getLogger(__name__)

OFF_LOOP_CHARS = 16_384  # a prompt with more characters is rendered on a worker thread (~4k tokens, ~1 ms)


def prompt_chars(kind: str, body: dict) -> int:
    """Characters of text a request's prompt holds (its messages' text, or its completion prompts), cheaply."""
    if kind != "chat":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0
    n = 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def has_images(body: dict) -> bool:
    """Whether a chat body holds an image part (cheap: no decoding)."""
    messages = body.get("messages")
    return isinstance(messages, list) and rendering.has_images(messages)


def adapter_key(name: str) -> bytes:
    """The rendezvous key of a LoRA adapter: its name (the same on every router process and replica)."""
    return b"lora\0" + name.encode()


class Router:
    """One router's decisions over its fleet, and the load they put on it; shared by every front door."""

    peers = None  # peers.PeerLoad when other routers share the fleet: their load is added to this router's

    def __init__(self, fleet: Fleet, renderer: Optional[PromptRenderer], hash_cfg: HashConfig,
                 metrics: RouterMetrics, policy: PolicyConfig = PolicyConfig(), cold_key_blocks: int = 1):
        self.fleet, self.renderer, self.hash_cfg = fleet, renderer, hash_cfg
        self.metrics, self.policy, self.cold_key_blocks = metrics, policy, cold_key_blocks
        self._media_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # render_off_loop's thread
        self._text_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # long text prompts' thread
        # fitted per replica from streamed first tokens when the policy scores by predicted TTFT
        self.ttft = TtftModels(policy.ttft_model_samples) if policy.ttft_model_samples else None
        # what learns from streamed first tokens: those models, or, following node tiers without
        # --prefill-s-per-token, a fit whose prefill slope only prices node-tier blocks (it scores nothing)
        pricing_fit = fleet.node_tiers is not None and not policy.prefill_s_per_token
        self.ttft_fit = self.ttft or (TtftModels() if pricing_fit else None)
        self.pricing = NodeTierPricing(policy, hash_cfg.block_size, self._pricing_inputs)
        metrics.node_tier_weight.set_function(self.node_tier_weight)

    def _pricing_inputs(self) -> tuple[list[float], Optional[float]]:
        """The member replicas' measured node-tier copy costs and the fitted prefill seconds per token (pricing.py)."""
        return (self.fleet.node_copy_costs(),
                self.ttft_fit.prefill_s_per_token() if self.ttft_fit is not None else None)

    def node_tier_weight(self) -> float:
        """A node-tier block's worth in effect now (the Prometheus gauge's reading)."""
        return self.pricing.weight(time.monotonic())

    # --- decision ---------------------------------------------------------------------------
    async def route(self, kind: str, body: dict,
                    eligible: Optional[Callable[[Replica], bool]] = None) -> Optional[Booking]:
        """Decide where `body` (a `kind` = "chat" | "completion" request) goes: the booking a front door holds for
        it (nothing booked yet); None if no replica is routable (among those `eligible` allows: a gateway's subset
        hint).

        A chat request with images, or a prompt of over OFF_LOOP_CHARS characters, is rendered off the event loop
        first (a multi-MB prompt without whitespace takes seconds to tokenize: other requests must not wait for it);
        the dialect may then rewrite `body` in place so the engine names its blocks as predicted."""
        rendered = None
        if self.renderer is not None:
            if kind == "chat" and has_images(body):
                rendered = (await self.render_off_loop(kind, body),)
            elif prompt_chars(kind, body) > OFF_LOOP_CHARS:
                rendered = (await self.render_text_off_loop(kind, body),)
        replicas = self.fleet.routable()  # after the render: the fleet may change while it runs
        if eligible is not None:
            replicas = [r for r in replicas if eligible(r)]
        if not replicas:
            return None
        decision, prompt, hashes = self.decide(kind, body, replicas, rendered)
        changed = prompt is not None and self.fleet.dialect.prepare_body(body, prompt)
        return Booking(self, decision, hashes, body, changed)

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

    async def render_text_off_loop(self, kind: str, body: dict) -> Optional[Prompt]:
        """`render` for a long text prompt on one worker thread of its own: long prompts queue behind each other
        (one tokenization's memory at a time), never in front of short ones, which stay on the loop (no thread hop)."""
        if self._text_pool is None:
            self._text_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="router-text")
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, self.render, kind, body)

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
        """Stop the render threads (a render under way finishes; nothing waits for it)."""
        for pool in (self._media_pool, self._text_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

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
        adapter, replicas = self.adapter_of(body, replicas)
        hashes, names, matches = self._match(prompt, body, adapter, replicas)
        now = time.monotonic()
        node = self._node_blocks(hashes, names, matches) if self.fleet.node_tiers is not None else None
        cands, warm_images = self._candidates(replicas, matches, prompt, adapter, now, node)
        cold_key = hashes[min(len(hashes), self.cold_key_blocks) - 1] if hashes else None
        decision = self._choose(cands, prompt, cold_key, adapter, self.pricing.weight(now) if node else None)
        target = decision.order[0] if decision.order else None
        if names is not None and target is not None:  # an adapter's: the block names the target hashes them with
            hashes = names.get(target, hashes)
        self._after_decision(decision, prompt, body, hashes, matches.get(target), cold_key, now)
        if warm_images.get(target):
            self.metrics.predicted_encoder_hits.inc(warm_images[target])
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        return decision, prompt, hashes

    def _match(self, prompt: Optional[Prompt], body: dict, adapter: Optional[str],
               replicas: list[Replica]) -> tuple[list[bytes], Optional[dict], dict]:
        """The prompt's block names, per replica for an adapter (None for the base model: one list for all), and
        each replica's cached prefix of them (index.match)."""
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None  # not a string: the replica answers the 400, not a crash here
        if adapter is None:
            hashes = self.fleet.dialect.block_hashes(prompt, salt, self.hash_cfg) if prompt else []
            return hashes, None, self.fleet.index.match(hashes, [r.id for r in replicas])
        names, matches = (self.adapter_hashes(prompt, salt, adapter, replicas) if prompt
                          else ({}, self.fleet.index.match([], [r.id for r in replicas])))
        return next(iter(names.values()), []), names, matches

    def _node_blocks(self, hashes: list[bytes], names: Optional[dict], matches: dict) -> dict[str, int]:
        """replica -> blocks of the prompt right after its own prefix that its node's tier holds without a gap (what
        the engine loads from there once its local tiers miss); replicas of one node with the same own prefix get
        the same figure, so a prefix only the node holds ties none of them."""
        tiers, index, out = self.fleet.node_tiers, self.fleet.index, {}
        memo: dict[tuple, int] = {}
        for rid, m in matches.items():
            key = tiers.key_of(rid)
            if key is None:
                continue
            h = names.get(rid, hashes) if names is not None else hashes
            mk = (key, id(h), m.blocks)
            if mk not in memo:
                memo[mk] = index.node_run(h, m.blocks, key)
            out[rid] = memo[mk]
        return out

    def _candidates(self, replicas: list[Replica], matches: dict, prompt: Optional[Prompt], adapter: Optional[str],
                    now: float, node: Optional[dict] = None) -> tuple[list[Candidate], dict[str, int]]:
        """Each replica as the policy sees it, and replica -> images not wholly inside its cached KV prefix whose
        encoder output it holds (the engine needs rows of each, and the vision encoder runs on a whole image or not
        at all). With peers, the load is every router's: ours exact, the peers' as of their report."""
        peers, view, bs = self.peers, self.fleet.adapters, self.hash_cfg.block_size
        engine_load = self.fleet.engine_load
        if peers is not None:
            combined = {r.id: peers.combined(r.id, r.in_flight, r.queued_tokens, r.sent) for r in replicas}
            mine = peers.preferred(combined)
        images = prompt.mm_items if prompt else None
        cands, warm_images = [], {}
        for r in replicas:
            m = matches[r.id]
            node_blocks = node.get(r.id, 0) if node else 0
            warm = 0
            if images:
                warm, n = self._encodes_saved(r.id, prompt, (m.blocks + node_blocks) * bs)
                if n:
                    warm_images[r.id] = n
            resident, slot = (view.resident(r.id, adapter), view.has_slot(r.id, adapter)) if adapter else (False, True)
            if peers is None:
                in_flight, queued, sent, tie, unseen = r.in_flight, r.queued_tokens, r.sent, 0.0, 0
            else:
                in_flight, queued, sent = combined[r.id]
                if mine is not None and r.id not in mine:
                    queued += peers.partition_tokens
                tie, unseen = random.random() * peers.jitter, peers.fresh
            cands.append(Candidate(r.id, m.gpu_blocks, m.cpu_blocks, warm,  # positional: a keyword call costs more
                                   max(in_flight, engine_load(r.id, now=now)), queued, sent, tie, unseen, resident,
                                   slot, node_blocks))
        return cands, warm_images

    def _choose(self, cands: list[Candidate], prompt: Optional[Prompt], cold_key: Optional[bytes],
                adapter: Optional[str], node_weight: Optional[float] = None) -> Decision:
        """policy.choose, scoring by the TTFT models once they are fitted (ttft.TtftModels.fitted), else by the
        fixed weights, and node-tier blocks at `node_weight` (the price in effect); the decision names the
        request's adapter."""
        ttft = self.ttft.fitted([c.replica for c in cands]) if self.ttft is not None else None
        num_tokens = prompt.num_tokens if prompt else 0
        decision = choose(cands, block_size=self.hash_cfg.block_size, num_prompt_tokens=num_tokens, cold_key=cold_key,
                          cfg=self.policy, adapter_key=adapter_key(adapter) if adapter else None, ttft=ttft,
                          node_weight=node_weight)
        return dataclasses.replace(decision, adapter=adapter) if adapter is not None else decision

    def _after_decision(self, decision: Decision, prompt: Optional[Prompt], body: dict, hashes: list[bytes],
                        used, cold_key: Optional[bytes], now: float) -> None:
        """What a decision leaves behind: the target's prefix touched in a capped index (LRU by use; `used` is its
        match), a text prompt remembered for warming replicas that join later, the decision counted."""
        if self.fleet.index.max_blocks_per_replica is not None and used is not None and used.blocks:
            self.fleet.index.touch(decision.order[0], hashes[:used.blocks])
        if prompt is not None and not prompt.mm_items:
            # placed as the policy places it cold: an adapter's prefixes by the adapter's rendezvous
            place = adapter_key(decision.adapter) if decision.adapter is not None else cold_key
            self.fleet.warmer.hot.observe(prompt.token_ids, hashes, self.hash_cfg.block_size, body.get("cache_salt"),
                                          body.get("model"), place, now)
        self.metrics.decisions.labels(decision.reason).inc()
        if self.fleet.dialect.contract == "predicted":
            self.metrics.predicted_decisions.labels(decision.reason).inc()
        self.metrics.prompt_tokens.inc(prompt.num_tokens if prompt else 0)

    def _encodes_saved(self, rid: str, prompt: Prompt, cached_tokens: int) -> tuple[int, int]:
        """Image tokens whose encoding replica `rid` saves this request, and how many of those images its encoder
        cache serves.

        An image wholly inside the cached prefix needs no encoding (its KV is there); one the prefix does not wholly
        hold is encoded whole unless the encoder cache has it (its own, or its node tier's). Both save the encode, so both count: an image in a
        conversation's own prefix must not weigh less than the same image merely encoder-cached elsewhere.
        """
        in_prefix = [i for i in prompt.mm_items if i.offset + i.length <= cached_tokens]
        rest = [i for i in prompt.mm_items if i.offset + i.length > cached_tokens]
        hits = self.fleet.index.encoder_hits(rid, [i.mm_hash for i in rest]) if rest else set()
        node = self.fleet.node_tiers.key_of(rid) if rest and self.fleet.node_tiers is not None else None
        if node is not None:  # its node's tier holds encoder outputs it loads instead of encoding
            hits |= self.fleet.index.encoder_hits(node, [i.mm_hash for i in rest])
        served = [i for i in rest if i.mm_hash in hits]
        return sum(i.length for i in in_prefix) + sum(i.length for i in served), len(served)
