"""Replica choice: cached prefix (GPU full weight, swap tier partly) minus load, with bounded load; pure.

For each replica r the score, in prompt tokens saved, is

    score(r) = block_size * (gpu_blocks(r) + cpu_weight * cpu_blocks(r))
             + encoder_weight * warm_image_tokens(r)
             - load_weight * load(r)

Bounded load (consistent hashing with bounded loads): with n replicas and total load L, a
replica may take the request only if load(r) + 1 <= ceil((1 + epsilon) * (L + 1) / n). The
least-loaded replica always qualifies, so the rule never leaves a request without a target.

A prefix nobody holds goes by rendezvous hashing of its first blocks' chain hash, so a burst
of requests sharing a new prefix converges on one replica before any KV event arrives, and
every router process computes the same answer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

# decision reasons (metric label values)
PREFIX_HIT = "prefix_hit"
COLD_HASH = "cold_hash"
LOAD_SPILL = "load_spill"
LEAST_LOAD = "least_load"
RETRY = "retry"


@dataclass(frozen=True)
class PolicyConfig:
    cpu_weight: float = 0.5  # a swap-tier block is worth this fraction of a GPU block (it must be copied back)
    encoder_weight: float = 0.5  # an image whose encoder output is warm saves this fraction of its tokens
    load_weight: float = 32.0  # prompt tokens of cached prefix that one request of load outweighs
    epsilon: float = 0.25  # bounded load: no replica above (1 + epsilon) x mean load while another fits


@dataclass(frozen=True)
class Candidate:
    """One routable replica as the policy sees it."""

    replica: str
    gpu_blocks: int = 0  # leading blocks of the prompt cached in the primary pool
    cpu_blocks: int = 0  # further leading blocks cached only in the swap tier
    warm_image_tokens: int = 0  # placeholder tokens of images outside the prefix whose encoder output is cached
    load: float = 0.0  # requests in flight or queued on the replica


@dataclass(frozen=True)
class Decision:
    order: list[str]  # replicas best first: order[0] is the target, the rest are retry fallbacks
    reason: str  # PREFIX_HIT | COLD_HASH | LOAD_SPILL | LEAST_LOAD
    predicted_cached_tokens: int  # tokens the target should serve from its cache


def rendezvous_weight(key: bytes, replica: str) -> int:
    """Highest-random-weight hash of (key, replica); the same on every router process."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + replica.encode(), digest_size=8).digest(), "big")


def load_cap(loads: Sequence[float], epsilon: float) -> float:
    """Largest load a replica may reach by taking one more request."""
    return math.ceil((1.0 + epsilon) * (sum(loads) + 1) / len(loads))


def cacheable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine can serve from cache: whole blocks short of the last prompt token.

    The last prompt token is always recomputed (its logits are needed to sample), so a fully
    cached prompt of 4 blocks yields 3 blocks of hits when its length is a multiple of the block size:

        tokens  |b0      |b1      |b2      |b3     x|   x = last token, recomputed
        cached  |========|========|========|        |
    """
    return max(0, (num_prompt_tokens - 1) // block_size * block_size)


def choose(cands: Sequence[Candidate], *, block_size: int, num_prompt_tokens: int,
           cold_key: Optional[bytes], cfg: PolicyConfig = PolicyConfig()) -> Decision:
    """Order replicas for one request; raises ValueError if there are none."""
    if not cands:
        raise ValueError("no routable replicas")
    cap = load_cap([c.load for c in cands], cfg.epsilon)
    limit = cacheable_tokens(num_prompt_tokens, block_size)

    def hit_tokens(c: Candidate) -> int:
        return min(c.gpu_blocks * block_size + c.cpu_blocks * block_size, limit)

    def score(c: Candidate) -> float:
        gpu = min(c.gpu_blocks * block_size, limit)
        cpu = min(c.cpu_blocks * block_size, limit - gpu)
        return gpu + cfg.cpu_weight * cpu + cfg.encoder_weight * c.warm_image_tokens - cfg.load_weight * c.load

    fits = [c for c in cands if c.load + 1 <= cap]
    over = [c for c in cands if c.load + 1 > cap]
    warm = any(hit_tokens(c) > 0 or c.warm_image_tokens > 0 for c in cands)

    def by_score(cs: list[Candidate]) -> list[Candidate]:
        return sorted(cs, key=lambda c: (-score(c), c.load, c.replica))

    if warm:
        ranked = by_score(fits) + by_score(over)
        target = ranked[0]
        best_anywhere = by_score(list(cands))[0]
        if score(best_anywhere) > score(target) and best_anywhere in over:
            reason = LOAD_SPILL
        elif hit_tokens(target) > 0 or target.warm_image_tokens > 0:
            reason = PREFIX_HIT
        else:
            reason = LEAST_LOAD  # the warm replicas are too busy to be worth it
    elif cold_key is not None:
        ranked = sorted(fits, key=lambda c: -rendezvous_weight(cold_key, c.replica)) + by_score(over)
        top_any = max(cands, key=lambda c: rendezvous_weight(cold_key, c.replica))
        reason = COLD_HASH if ranked[0] is top_any else LOAD_SPILL
    else:  # shorter than one block: nothing to cache, spread by load
        ranked = sorted(cands, key=lambda c: (c.load, c.replica))
        reason = LEAST_LOAD
    return Decision([c.replica for c in ranked], reason, hit_tokens(ranked[0]))
