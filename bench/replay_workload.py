"""bench/trace_replay.py's requests: a Mooncake trace read and turned into prompts of the tiny checkpoint's words, and the oracle, fleet-sized LRU and pure-affinity bounds over them."""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402


HERE = Path(__file__).resolve().parent
EXCERPT = HERE / "traces" / "mooncake_conversation_head600.jsonl"
TRACE_BLOCK = 512  # tokens per Mooncake hash id


progress = harness.reporter("trace")


def tiny_model() -> Path:
    return harness.model_dir(None, "tiny", "qwen2", say=progress)


# --- requests from the trace ----------------------------------------------------------------
def read_trace(path: Path, limit: int | None = None) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit and len(out) >= limit:
                    break
    return out


class Words:
    """Single-token words (with their leading space) of a tokenizer, and the run of B of them per hash id."""

    def __init__(self, tokenizer, block: int, seed: int = 0):
        import re

        vocab = tokenizer._tok.get_vocab()
        cands = sorted(k for k in vocab if re.fullmatch("\u0120[a-z]{2,12}", k))
        words = []
        for k in cands:
            w = " " + k[1:]
            if tokenizer.encode(w, add_special_tokens=False) == [vocab[k]]:
                words.append((w, vocab[k]))
        if len(words) < 32:
            raise RuntimeError(f"only {len(words)} single-token words in this vocabulary")
        self.words, self.block, self.seed = words, block, seed
        self._runs: dict[int, list[int]] = {}

    def run(self, hash_id: int) -> list[int]:
        """Indices into self.words of hash id's run: the same id always gives the same run."""
        r = self._runs.get(hash_id)
        if r is None:
            rng = random.Random(hash_id * 1_000_003 + self.seed)
            r = self._runs[hash_id] = [rng.randrange(len(self.words)) for _ in range(self.block)]
        return r

    def prompt(self, hash_ids: list[int], n_tokens: int) -> tuple[list[int], str]:
        idx = [i for h in hash_ids for i in self.run(h)][:n_tokens]
        return [self.words[i][1] for i in idx], "".join(self.words[i][0] for i in idx)


def scaled(n: int, block: int, scale: float | None = None) -> int:
    return max(1, math.ceil(n * (scale if scale is not None else block / TRACE_BLOCK)))


def build_requests(trace: list[dict], words: Words, block: int, output_scale: float | None) -> list[dict]:
    reqs = []
    for i, r in enumerate(trace):
        n = min(scaled(r["input_length"], block), len(r["hash_ids"]) * block)
        ids, text = words.prompt(r["hash_ids"], n)
        reqs.append({"i": i, "t": r["timestamp"] / 1000.0, "ids": ids, "text": text,
                     "max_tokens": scaled(r["output_length"], block, output_scale)})
    return reqs


def spread_arrivals(reqs: list[dict]) -> None:
    """Requests that share a timestamp spread evenly up to the next timestamp (the last group over the median gap),
    order kept: Mooncake's conversation trace rounds its timestamps to 3 s, so 4-16 requests arrive in one instant."""
    times = sorted({r["t"] for r in reqs})
    gaps = [b - a for a, b in zip(times, times[1:])]
    nxt = dict(zip(times, gaps + [statistics.median(gaps) if gaps else 0.0]))
    groups: dict[float, list[dict]] = {}
    for r in reqs:
        groups.setdefault(r["t"], []).append(r)
    for t, group in groups.items():
        for k, r in enumerate(group):
            r["t"] = t + nxt[t] * k / len(group)


def check_tokenization(tokenizer, reqs: list[dict], k: int = 20) -> None:
    """The text of a prompt must tokenize (as a replica does for a completion) to exactly its planned ids."""
    from warmfleet.server import rendering

    for r in reqs[:k]:
        got = rendering.completion_ids(tokenizer, r["text"])
        if got != r["ids"]:
            raise RuntimeError(f"request {r['i']}: text does not tokenize to the planned ids")


def bound_hits(reqs: list[dict], block: int, fingerprint: str, capacity: int | None = None,
               hashes: list | None = None) -> list[tuple[int, int]]:
    """bench/routing.py's oracle_hits on token ids: per request (cached, prompt) for one cache of `capacity` blocks
    (None: unbounded) that saw every earlier request; hit = leading blocks present, capped at the last token."""
    from warmfleet.server.hashing import block_hashes
    from warmfleet.server.router.core.policy import cacheable_tokens

    seen: OrderedDict = OrderedDict()
    out = []
    for k, r in enumerate(reqs):
        hs = hashes[k] if hashes is not None else block_hashes(r["ids"], [], block, fingerprint)
        hit = harness.lru_prefix(seen, hs, capacity)
        out.append((min(hit * block, cacheable_tokens(len(r["ids"]), block)), len(r["ids"])))
    return out


def affinity_hits(reqs: list[dict], block: int, n: int, capacity: int, hashes: list,
                  cold_tokens: int = 64) -> tuple[list, float]:
    """Per-replica caches with pure affinity and no load balancing: each request goes to the replica holding the
    longest prefix of it (ties: fewest requests so far; a prefix under `cold_tokens`, such as the first block
    every Mooncake request shares, counts as none: the request goes to the replica with the fewest requests),
    each replica one LRU of `capacity` blocks (its GPU and CPU tiers as one). What a router that never moves a
    prefix for load gets from per-replica caches; returns per request (cached, prompt) and the spread (max /
    mean requests per replica) it costs."""
    from warmfleet.server.router.core.policy import cacheable_tokens

    caches = [OrderedDict() for _ in range(n)]
    counts = [0] * n
    out = []
    for k, r in enumerate(reqs):
        hs = hashes[k]
        best, best_hit = 0, -1
        for i, c in enumerate(caches):
            hit = 0
            for h in hs:
                if h not in c:
                    break
                hit += 1
            if hit > best_hit or (hit == best_hit and counts[i] < counts[best]):
                best, best_hit = i, hit
        if best_hit * block < cold_tokens:
            best = min(range(n), key=counts.__getitem__)
            best_hit = next((j for j, h in enumerate(hs) if h not in caches[best]), len(hs))
        cache = caches[best]
        counts[best] += 1
        out.append((min(best_hit * block, cacheable_tokens(len(r["ids"]), block)), len(r["ids"])))
        harness.lru_prefix(cache, hs, capacity)
    return out, harness.spread(counts, n)


def ratio(hits: list[tuple[int, int]]) -> float:
    return round(sum(c for c, _ in hits) / max(1, sum(t for _, t in hits)), 4)
