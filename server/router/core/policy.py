"""Replica choice: cached prefix (GPU full weight, swap tier partly) minus load, with bounded load; pure.

For each replica r the score, in prompt tokens saved, is

    score(r) = block_size * (gpu_blocks(r) + cpu_weight * cpu_blocks(r) + node_weight * node_blocks(r))
             + encoder_weight * warm_image_tokens(r)      images r need not encode: wholly inside that
                                                            prefix, or in its encoder cache
             - queue_weight * queued_tokens(r)
             - load_weight * load(r)

`node_blocks(r)` are the prompt's blocks past r's own prefix that r's node tier holds (server/nodetier): every
replica on that node can load them, so they count as held (in `hits`) for all of them alike, and a prefix only the
node tier holds ties the request to none of them: load decides among the node's replicas. `node_weight` (fixed,
below `cpu_weight`) orders local primary > local swap > node tier > cold. Priced instead (the copy of a block and
the prefill per token known: `priced_copy_weight`; the router measures both, core/pricing.py, unless flags give
them), a node-tier block is worth what its copy saves, 1 - copy / recompute (H200, Qwen2.5-7B: 17 us against 16 x 25.8 us, 0.96): a replica that holds a prefix
in its primary pool is then barely ahead of its neighbours that would load it from the node tier (the engine writes
computed blocks through), so the request is no longer tied to it and load spreads over the node's replicas. The
priced weight may exceed the fixed swap-tier weight: a replica with a node tier has no swap tier of its own.

`queued_tokens` is the prompt work the routers sent the replica that it has not finished: the
uncached prompt tokens of requests still waiting for their first token. The new request waits
behind that prefill, so a token of it costs about as much as a token the request must compute
itself: for this request's TTFT alone, `queue_weight` 1 is exact. But moving a request away from
its prefix also makes the fleet compute that prefix again (work every later request queues behind)
and leaves two copies of it in the fleet's caches; so when the prompt's cache is at stake (some
replica holds at least `warm_min_tokens` more of it than another) queued tokens weigh
`queue_weight`, and only when it is not (a new conversation, or a prefix every replica holds) do
they weigh `cold_queue_weight`, where moving costs nothing (measured on the Mooncake trace: docs/scale.md).

Bounded load (consistent hashing with bounded loads): with n replicas and total load L, a
replica may take the request only if load(r) + 1 <= ceil((1 + epsilon) * (L + 1) / n). The
least-loaded replica always qualifies, so the rule never leaves a request without a target.

Bounded load must not throw away a long warm prefix for a one-request imbalance: when the best
replica is over a cap (in flight or share, below) but holds at least `warm_min_tokens` more of
the prompt than the best replica under them, it may still take the request up to `warm_slack`
requests above each cap, and `warm_inflight_slack` more above the in-flight bound only (long
conversations spill on the in-flight bound; the share cap is what keeps the spread). With peer
routers, the in-flight figure of a replica is uncertain by about one request per peer (what it
sent or saw finish since its last report), so that slack grows by `unseen` requests: a bound
enforced more tightly than its own figures can tell threw away long warm prefixes for phantom
load (docs/scale.md, active-active).
The share cap's slack grows with what is at stake: one more request per `share_slack_tokens` of
that advantage, at most `max_share_slack` more (the in-flight bound does not grow with it), so a
conversation's long history stays home instead of being thrown away for a one-request imbalance.
Requests that are warm everywhere (a hot system prompt) then do the balancing, at no cost.

The prefix that more than half of the replicas hold scores nothing (`common_prefix_free`), up to the
longest whole-block prefix under `warm_min_tokens`: it is not worth keeping a request off a replica that
lacks it. Without that, a first block every request shares (every Mooncake request does) made each
replica that had not yet served a request lose every new conversation to an idle one holding that
block: 11 of 64 replicas never got work, and spread over the fleet was 1.24-1.26 (docs/scale.md, "The
routing defaults"; the runs: docs/history/scale-rounds.md, "Fifth round"). What a replica holds beyond
the common prefix (a conversation's history) counts in full.
Equal choices go to the replica this router sent the fewest requests, so they even out.

Predicted TTFT (`ttft_model_samples` > 0, once the models are fitted: core/ttft.py). The fixed weights price
every replica alike; a fleet over two node pools (an H200 beside an L4) is not alike. Each replica's fitted
fixed cost, seconds per prefill token and per request of load then replace `load_weight` and the token-for-token
queue price: score(r) = -(TTFT predicted on r) / (the fleet's median seconds per token), with the queued tokens
still at the queue weight the cache's stake gives, the common prefix counted as held, and the encoder and adapter
credits as above. And the caps follow capacity: a replica's load and share caps are the fleet's times its fitted
prefill speed over the mean (within 0.25-4x; a factor, or a weight, within 25 % of 1 counts as 1), since an even
share of requests overloads the slower pool. Slack, rendezvous and reasons are unchanged.

Share cap: the in-flight bound alone cannot keep request counts even when requests are short
(in flight is mostly 0 or 1) and it is what `warm_slack` loosens, so a replica may also take a
request only while its recent count (`sent`, decayed by the caller) stays within
(1 + share_epsilon) x the mean + 1 (+ warm_slack, above). This is what keeps the spread bounded; a hot prefix
that outgrows one replica's share spills, and its new home then holds it too.

A prefix nobody holds goes by rendezvous hashing of its first blocks' chain hash, so a burst
of requests sharing a new prefix converges on one replica before any KV event arrives, and
every router process computes the same answer.

LoRA adapters (`adapter_key` given: the request names one). A replica with the adapter resident scores
`adapter_weight` more (it loads nothing into a slot) and counts as warm; one nobody has resident, for a
prompt nobody holds, goes by rendezvous of the adapter's key, so each replica holds a stable subset of the
cold adapters. Equal scores go by that rendezvous too, so a hot adapter that outgrows its replicas' caps
(the same bounded-load rule) spills to the same next home each time and is resident on more replicas as its
load grows. A replica with the adapter resident that is over the share cap keeps the request up to
`adapter_share_slack` more requests when no replica under the caps has the adapter resident: a spill would load
it there and evict an adapter that replica's own requests come back for (bench/adapters.py: most of the loads
warmfleet made were those). Last, `adapter_slot_first`: replicas that could take the adapter only by evicting
one in use go after every replica that has it resident or a free slot (they stay as retry fallbacks).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from .settings import PolicyConfig
from .ttft import ALIKE

# decision reasons (metric label values)
PREFIX_HIT = "prefix_hit"
COLD_HASH = "cold_hash"
LOAD_SPILL = "load_spill"
LEAST_LOAD = "least_load"
ADAPTER_HIT = "adapter_hit"  # no cached prefix, but the request's LoRA adapter is resident on the target
RETRY = "retry"


@dataclass(slots=True, eq=False)  # not frozen: a frozen init costs 3x
class Candidate:
    """One routable replica as the policy sees it (made per replica per request; treat as read-only).

    Equal and hashed by identity: the policy keys its per-request dicts by the candidates themselves."""

    replica: str
    gpu_blocks: int = 0  # leading blocks of the prompt cached in the primary pool
    cpu_blocks: int = 0  # further leading blocks cached only in the swap tier
    warm_image_tokens: int = 0  # placeholder tokens of images it need not encode (wholly in its prefix, or encoder-cached)
    load: float = 0.0  # requests in flight or queued on the replica
    queued_tokens: int = 0  # uncached prompt tokens this router sent it that still await their first token
    sent: float = 0.0  # requests this router sent it recently (decayed count): share cap and last tie-break
    tie: float = 0.0  # added to `sent` in the tie-break only: routers sharing one stale view draw it at random
    unseen: int = 0  # requests on it that peer routers may have sent or finished since their last report
    #                  (one per fresh peer): widens the in-flight bound for keeping a warm prefix, nothing else
    adapter_resident: bool = False  # the request's LoRA adapter is resident there (adapters.AdapterView.resident)
    adapter_slot: bool = True  # it can take the adapter without evicting one in use (AdapterView.has_slot)
    node_blocks: int = 0  # further leading blocks its node's tier holds (loaded from there on a local miss)


@dataclass(slots=True)  # not frozen (made once a request; treat as read-only)
class Decision:
    order: list[str]  # replicas best first: order[0] is the target, the rest are retry fallbacks
    reason: str  # PREFIX_HIT | COLD_HASH | LOAD_SPILL | LEAST_LOAD
    predicted_cached_tokens: int  # tokens the target should serve from its cache
    hits: dict = field(default_factory=dict)  # replica -> tokens it should serve from cache (for retries)
    num_prompt_tokens: int = 0
    adapter: Optional[str] = None  # the LoRA adapter the request names (its in-flight count per replica), None: base

    def uncached_for(self, replica: str) -> int:
        """Prompt tokens `replica` must compute if it serves the request."""
        return max(0, self.num_prompt_tokens - self.predicted_for(replica))

    def predicted_for(self, replica: str) -> int:
        """Predicted cached tokens if `replica` serves the request (the target's, or a fallback's after a retry)."""
        if replica == (self.order[0] if self.order else None):
            return self.predicted_cached_tokens
        return self.hits.get(replica, 0)


def rendezvous_weight(key: bytes, replica: str) -> int:
    """Highest-random-weight hash of (key, replica); the same on every router process."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + replica.encode(), digest_size=8).digest(), "big")


def share_cap(sent: Sequence[float], epsilon: float) -> float:
    """Largest recent request count a replica may reach by taking one more request."""
    # fsum: exact, so the cap (and a replica right at it) does not depend on the order replicas come in
    return (1.0 + epsilon) * (math.fsum(sent) + 1) / len(sent) + 1.0


def load_cap(loads: Sequence[float], epsilon: float) -> float:
    """Largest load a replica may reach by taking one more request."""
    return math.ceil((1.0 + epsilon) * (math.fsum(loads) + 1) / len(loads))


def cacheable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine can serve from cache: whole blocks short of the last prompt token.

    The last prompt token is always recomputed (its logits are needed to sample), so a fully
    cached prompt of 4 blocks yields 3 blocks of hits when its length is a multiple of the block size:

        tokens  |b0      |b1      |b2      |b3     x|   x = last token, recomputed
        cached  |========|========|========|        |
    """
    return max(0, (num_prompt_tokens - 1) // block_size * block_size)


def prefix_at_stake(hits: Iterable[int], warm_min_tokens: int) -> bool:
    """Whether some replica holds at least `warm_min_tokens` more of the prompt than another."""
    return max(hits) - min(hits) >= warm_min_tokens


def queue_weight_for(at_stake: bool, cfg: PolicyConfig) -> float:
    """What one queued prompt token costs: `queue_weight` when the cache is at stake, else `cold_queue_weight`."""
    if cfg.cold_queue_weight is not None and not at_stake:  # nothing at stake: moving costs nothing
        return cfg.cold_queue_weight
    return cfg.queue_weight


def priced_copy_weight(copy_s_per_block: float, prefill_s_per_token: float, block_size: int) -> float:
    """Worth of a block loaded by copy relative to one already in the primary pool: 1 - copy / recompute, in [0, 1]."""
    recompute = prefill_s_per_token * block_size
    return min(1.0, max(0.0, 1.0 - copy_s_per_block / recompute)) if recompute > 0 else 0.0


def node_tier_weight(cfg: PolicyConfig, block_size: int) -> float:
    """The node-tier block weight from the flags alone: priced when both the copy and the prefill are given, else the
    fixed one (the router's measured price: core/pricing.py)."""
    if cfg.node_copy_s_per_block > 0 and cfg.prefill_s_per_token > 0:
        return priced_copy_weight(cfg.node_copy_s_per_block, cfg.prefill_s_per_token, block_size)
    return cfg.node_weight


def prefix_value(c: Candidate, block_size: int, limit: int, cpu_weight: float) -> float:
    """Worth of the prompt prefix `c` caches, in tokens: GPU blocks in full, swap-tier blocks at `cpu_weight`."""
    gpu = min(c.gpu_blocks * block_size, limit)
    cpu = min(c.cpu_blocks * block_size, limit - gpu)
    return gpu + cpu_weight * cpu


def common_prefix_level(values: Iterable[float], num_replicas: int, block_size: int, warm_min_tokens: int) -> float:
    """The prefix worth more than half of the replicas hold, capped at the longest whole block not at stake."""
    # holding it or less scores the same, 0, so ranking changes only among the replicas at or below it. Capped
    # below warm_min_tokens: a long prefix (a history held twice after a spill) is never given away for this.
    short = (warm_min_tokens - 1) // block_size * block_size  # the longest whole-block prefix not at stake
    return min(sorted(values, reverse=True)[num_replicas // 2], short)


def capacity_caps(cands: Sequence[Candidate], ttft: dict, epsilon: float, scap: float,
                  bounds: tuple[float, float] = (0.25, 4.0)) -> Optional[dict]:
    """candidate -> its (load cap, share cap) scaled to its prefill speed over the candidates' mean (fitted:
    1 / seconds per token, within `bounds`); None when all are alike (ttft.py reads a factor near 1 as 1): the
    fleet's caps then hold for all."""
    speed = {c: 1.0 / ttft[c.replica].per_token_s for c in cands}
    if max(speed.values()) == min(speed.values()):
        return None
    mean = math.fsum(speed.values()) / len(speed)
    lo, hi = bounds
    load = (1.0 + epsilon) * (math.fsum(c.load for c in cands) + 1) / len(cands)  # load_cap before its ceil
    out = {}
    for c in cands:
        w = min(hi, max(lo, speed[c] / mean))
        if abs(w - 1.0) <= ALIKE:  # one fast outlier must not put every other replica a hair under the caps
            w = 1.0
        out[c] = (math.ceil(load * w), (scap - 1.0) * w + 1.0)
    return out


def under_caps(cands: Sequence[Candidate], cap: float, scap: float, caps: Optional[dict] = None) -> list[Candidate]:
    """The replicas under the load cap among those under the share cap (all of them if none is); `caps`: per
    replica ones (capacity_caps) instead of the fleet's."""
    if caps is not None:
        in_share = [c for c in cands if c.sent + 1 <= caps[c][1]] or cands
        return [c for c in in_share if c.load + 1 <= caps[c][0]]
    in_share = [c for c in cands if c.sent + 1 <= scap] or cands
    return [c for c in in_share if c.load + 1 <= cap]


def warm_share_slack(advantage: int, cfg: PolicyConfig) -> int:
    """Requests above the share cap a replica holding `advantage` more tokens than the best under the caps may take."""
    if cfg.share_slack_tokens > 0 and advantage > 0:
        return cfg.warm_slack + min(cfg.max_share_slack, advantage // cfg.share_slack_tokens)
    return cfg.warm_slack


def keeps_warm(best: Candidate, advantage: int, cap: float, scap: float, cfg: PolicyConfig,
               adapter_home: bool = False) -> bool:
    """Whether `best`, over a cap, keeps the request for the `advantage` tokens it holds over the best under them;
    `adapter_home`: it has the request's adapter resident and no replica under the caps has (a spill would load it
    and evict another adapter there), worth `adapter_share_slack` more requests of share."""
    adapter_slack = cfg.adapter_share_slack if adapter_home else 0
    return ((advantage >= cfg.warm_min_tokens or adapter_slack > 0)
            and best.load + 1 <= cap + cfg.warm_slack + cfg.warm_inflight_slack + best.unseen
            and best.sent + 1 <= scap + warm_share_slack(advantage, cfg) + adapter_slack)


def warm_order(cands: Sequence[Candidate], fits: list[Candidate], fit_ids: set, hits: dict[str, int], scores: dict,
               cap: float, scap: float, cfg: PolicyConfig, home: Optional[dict] = None,
               caps: Optional[dict] = None) -> tuple[list[Candidate], str]:
    """Best score first under the caps, then the rest, unless the best over them keeps the request warm; and why.

    `home`: replica -> rendezvous weight of the request's adapter, deciding equal scores (None: no adapter);
    `caps`: per replica caps (capacity_caps), None: the fleet's."""
    home = home or {}
    keys = {c: (-scores[c], -home.get(c.replica, 0), c.load, c.sent + c.tie, c.replica) for c in cands}  # rank

    rank = keys.__getitem__
    ranked = sorted(fits, key=rank) + sorted([c for c in cands if c not in fit_ids], key=rank)
    best = min(cands, key=rank)  # replica names are unique: the same as sorted(cands, key=rank)[0]
    best_is_over = best not in fit_ids
    advantage = hits[best.replica] - max((hits[c.replica] for c in fits), default=0)
    if caps is not None:
        cap, scap = caps[best]
    adapter_home = bool(home) and best.adapter_resident and not any(c.adapter_resident for c in fits)
    kept_warm = best_is_over and keeps_warm(best, advantage, cap, scap, cfg, adapter_home)
    if kept_warm:
        ranked = [best] + [c for c in ranked if c is not best]
    target = ranked[0]
    if scores[best] > scores[target] and best_is_over and not kept_warm:
        return ranked, LOAD_SPILL
    if hits[target.replica] > 0 or (target.warm_image_tokens > 0 and cfg.encoder_weight > 0):
        return ranked, PREFIX_HIT
    if home and target.adapter_resident:
        return ranked, ADAPTER_HIT
    return ranked, LEAST_LOAD  # the warm replicas are too busy to be worth it


def cold_order(cands: Sequence[Candidate], fits: list[Candidate], fit_ids: set, scores: dict,
               cold_key: bytes) -> tuple[list[Candidate], str]:
    """A prefix nobody holds: rendezvous order of `cold_key` under the caps, then the rest by score; and why."""
    weight = {c.replica: rendezvous_weight(cold_key, c.replica) for c in cands}
    over = [c for c in cands if c not in fit_ids]
    ranked = (sorted(fits, key=lambda c: -weight[c.replica])
              + sorted(over, key=lambda c: (-scores[c], c.load, c.sent + c.tie, c.replica)))
    top_any = max(cands, key=lambda c: weight[c.replica])
    return ranked, COLD_HASH if ranked[0] is top_any else LOAD_SPILL


def adapter_slot_first(ranked: list[Candidate]) -> list[Candidate]:
    """`ranked` with the replicas lacking a slot for the adapter moved behind the rest (order kept in each part)."""
    return [c for c in ranked if c.adapter_slot] + [c for c in ranked if not c.adapter_slot]


def least_loaded(replicas: Iterable, limit: int) -> list:
    """A request without cache affinity (models, tokenize): the replicas (registry.Replica) with the fewest requests
    in flight first, then by name; at most `limit`."""
    return sorted(replicas, key=_in_flight_then_id)[:limit]


def _in_flight_then_id(rep) -> tuple:
    return rep.in_flight, rep.id


def spread_order(cands: Sequence[Candidate]) -> list[Candidate]:
    """A prompt shorter than one block (nothing to cache): least load first, then fewest sent."""
    return sorted(cands, key=lambda c: (c.load, c.sent + c.tie, c.replica))


def fixed_scores(cands: Sequence[Candidate], values: dict, common: float, queue_weight: float,
                 adapter_weight: float, cfg: PolicyConfig) -> dict:
    """The fixed weights' score of each replica (the formula at the top), in prompt tokens saved."""
    encoder_weight, load_weight = cfg.encoder_weight, cfg.load_weight
    scores = {}
    for c in cands:
        held = values[c] - common
        scores[c] = ((held if held > 0.0 else 0.0) + encoder_weight * c.warm_image_tokens
                     + adapter_weight * c.adapter_resident - queue_weight * c.queued_tokens
                     - load_weight * c.load)
    return scores


def ttft_scores(cands: Sequence[Candidate], ttft: dict, values: dict, common: float, limit: int,
                queue_weight: float, adapter_weight: float, cfg: PolicyConfig) -> dict:
    """Each replica's predicted TTFT for this request, negated and in tokens of the fleet's median prefill speed
    (so the warm-prefix rules keep their token thresholds): its fixed cost, the prefill it waits for (queued
    tokens at `queue_weight`, then the prompt past what it holds) at its own speed, its load at its own cost; the
    encoder and adapter credits as in fixed_scores."""
    speeds = sorted(ttft[c.replica].per_token_s for c in cands)
    ref = speeds[len(speeds) // 2]
    out = {}
    for c in cands:
        k = ttft[c.replica]
        own = limit - max(0.0, values[c] - common)  # the common prefix counts as held, as in the fixed score
        predicted = -(k.fixed_s + k.per_token_s * (queue_weight * c.queued_tokens + own)
                      + k.per_load_s * c.load) / ref
        out[c] = predicted + (cfg.encoder_weight * c.warm_image_tokens + adapter_weight * c.adapter_resident)
    return out


def choose(cands: Sequence[Candidate], *, block_size: int, num_prompt_tokens: int,
           cold_key: Optional[bytes], cfg: PolicyConfig = PolicyConfig(),
           adapter_key: Optional[bytes] = None, ttft: Optional[dict] = None,
           node_weight: Optional[float] = None) -> Decision:
    """Order replicas for one request (`adapter_key`: its LoRA adapter's, None for the base model; `ttft`: replica
    -> ttft.Coefficients for every candidate, scoring by predicted TTFT instead of the fixed weights; `node_weight`:
    a node-tier block's worth in effect, pricing.NodeTierPricing's, None: `node_tier_weight` of the flags); raises
    ValueError if there are none."""
    if not cands:
        raise ValueError("no routable replicas")
    limit = cacheable_tokens(num_prompt_tokens, block_size)
    # tokens each replica should serve from cache (the Decision's `hits`, and whether the prompt is warm anywhere)
    # and what they are worth (prefix_value), in one pass: this runs per replica per request
    if node_weight is None:
        node_weight = node_tier_weight(cfg, block_size)
    hits, values, cpu_weight = {}, {}, cfg.cpu_weight
    for c in cands:
        gpu, cpu, node = c.gpu_blocks * block_size, c.cpu_blocks * block_size, c.node_blocks * block_size
        hits[c.replica] = min(gpu + cpu + node, limit)
        gpu = min(gpu, limit)
        cpu = min(cpu, limit - gpu)
        values[c] = gpu + cpu_weight * cpu + (node_weight * min(node, limit - gpu - cpu) if node else 0.0)
    queue_weight = queue_weight_for(prefix_at_stake(hits.values(), cfg.warm_min_tokens), cfg)
    common = 0.0
    if cfg.common_prefix_free:
        common = common_prefix_level(values.values(), len(cands), block_size, cfg.warm_min_tokens)
    # Linear in the number of replicas: membership by identity, each score and rendezvous weight
    # computed once (list membership compared dataclasses field by field: 1.2 ms a request at 64
    # replicas, 4.4 ms at 128; docs/scale.md).
    adapter_weight = cfg.adapter_weight if adapter_key is not None else 0.0  # adapter fields count for adapters only
    scores = (fixed_scores(cands, values, common, queue_weight, adapter_weight, cfg) if ttft is None
              else ttft_scores(cands, ttft, values, common, limit, queue_weight, adapter_weight, cfg))
    cap = load_cap([c.load for c in cands], cfg.epsilon)
    scap = share_cap([c.sent for c in cands], cfg.share_epsilon)
    # with fitted TTFT models, a replica's caps follow its capacity: an even share would overload a slow pool
    caps = capacity_caps(cands, ttft, cfg.epsilon, scap) if ttft is not None else None
    fits = under_caps(cands, cap, scap, caps)
    fit_ids = set(fits)
    home = {c.replica: rendezvous_weight(adapter_key, c.replica) for c in cands} if adapter_key is not None else None
    encoder_warm = cfg.encoder_weight > 0 and any(c.warm_image_tokens > 0 for c in cands)  # weight 0: ignored
    if encoder_warm or any(hits[c.replica] > 0 or (home and c.adapter_resident) for c in cands):
        ranked, reason = warm_order(cands, fits, fit_ids, hits, scores, cap, scap, cfg, home, caps)
    elif adapter_key is not None or cold_key is not None:  # a cold adapter goes by its own key: a stable subset
        ranked, reason = cold_order(cands, fits, fit_ids, scores, adapter_key if adapter_key is not None else cold_key)
    else:
        ranked, reason = spread_order(cands), LEAST_LOAD
    if adapter_key is not None:
        first, ranked = ranked[0], adapter_slot_first(ranked)
        if ranked[0] is not first:  # the best had no slot for the adapter: moved off it, as a spill
            reason = LOAD_SPILL
    return Decision([c.replica for c in ranked], reason, hits[ranked[0].replica], hits, num_prompt_tokens)
