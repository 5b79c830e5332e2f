"""Index at scale: memory per million cached blocks and lookup time of the router's KVIndex (micro-benchmark).

    python -P bench/index_scale.py [--entries 1000000] [--replicas 16,64,128] [--json] [--out DIR]

Fills `server/router/core/index.KVIndex` through its public path (`apply_snapshot` / `apply_batch` with
BlockStored events of 32-byte contract-1 digests, as KV events deliver them) and measures:

* memory: tracemalloc bytes after / before, per (block, replica) entry and per distinct block, for
  a fleet where each block is held by one replica (the warmfleet router's goal: no prefix held
  twice) and one where a hot quarter of the blocks is held by every replica;
* `match(hashes, replicas)` time, the router's per-request lookup: a 24-block prompt (the
  Mooncake conversation trace's mean, scaled one block per 512 tokens) and a 256-block one,
  fully cached on one replica, against all replicas;
* event apply rate: blocks per second through `apply_batch` (16-block BlockStored batches);
* with --index-max-blocks, the same with a per-replica cap (least recently used entries go first);
* --index-module PATH measures another version of server/router/core/index.py (e.g. `git show
  HEAD:server/router/core/index.py > /tmp/index_head.py`) side by side with the current one.

With a hot quarter, the looked-up prompt starts with hot blocks (held by every replica), then the
replica's own ones: the lookup's worst case, every replica alive for the first blocks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path


def digests(n: int, salt: int) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(salt.to_bytes(4, "big") + i.to_bytes(8, "big"), digest_size=32).digest() for i in range(n)]


def fill(index, replicas: list[str], per_replica: list[list[bytes]]) -> None:
    from warmfleet.server.events import BlockStored, EventBatch, Snapshot

    for r in replicas:
        index.apply_snapshot(r, Snapshot(r, 0, 16, "fp", [], [], []))
    for r, blocks in zip(replicas, per_replica):
        seq = 0
        for k in range(0, len(blocks), 16):
            seq += 1
            index.apply_batch(r, EventBatch(r, seq, [BlockStored(blocks[k:k + 16], None, [], 16)]))


def index_class(module_path: str | None):
    """KVIndex of the current tree, or of another index.py loaded as a module of the same package."""
    if not module_path:
        from warmfleet.server.router.core.index import KVIndex

        return KVIndex
    import importlib.util

    spec = importlib.util.spec_from_file_location("warmfleet.server.router._index_under_test", module_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.KVIndex


def memory_case(n_entries: int, n_rep: int, hot_share: float, max_blocks: int | None,
                module_path: str | None = None) -> dict:
    KVIndex = index_class(module_path)

    replicas = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n_rep)]
    # hot blocks on every replica, the rest spread one replica each, n_entries (block, replica) pairs in all
    hot_entries = int(n_entries * hot_share)
    n_hot = hot_entries // n_rep
    n_cold = n_entries - n_hot * n_rep
    hot = digests(n_hot, 1)
    cold = digests(n_cold, 2)
    per = [list(hot) + cold[i::n_rep] for i in range(n_rep)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KVIndex(max_blocks_per_replica=max_blocks) if max_blocks else KVIndex()
    t0 = time.perf_counter()
    fill(index, replicas, per)
    fill_s = time.perf_counter() - t0
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = sum(len(index.state(r).gpu) for r in replicas)
    distinct = index.num_blocks()
    # lookups: a prompt cached on replica 0 (its hot prefix + own blocks), against every replica
    own = per[0][n_hot:] if len(per[0]) > n_hot else per[0]
    res = {"index": module_path or "server/router/core/index.py", "replicas": n_rep, "hot_share": hot_share,
           "max_blocks_per_replica": max_blocks,
           "entries": entries, "distinct_blocks": distinct,
           "bytes_per_entry": round(used / max(1, entries), 1),
           "bytes_per_distinct_block": round(used / max(1, distinct), 1),
           "mib_per_million_entries": round(used / max(1, entries) * 1e6 / 2**20, 1),
           "apply_blocks_per_s": round(n_entries / fill_s)}
    for length in (24, 256):
        chain = (hot[:length // 2] + own)[:length]  # hot blocks first (if any), then replica 0's own
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(200):
                index.match(chain, replicas)
            times.append((time.perf_counter() - t0) / 200)
        miss = digests(length, 9)
        t0 = time.perf_counter()
        for _ in range(200):
            index.match(miss, replicas)
        res[f"match_{length}_blocks_us"] = round(statistics.median(times) * 1e6, 1)
        res[f"match_{length}_blocks_cold_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    del index
    gc.collect()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000, help="(block, replica) entries per case.")
    ap.add_argument("--replicas", default="16,64,128")
    ap.add_argument("--index-max-blocks", type=int, default=None,
                    help="Also measure with this per-replica cap (needs the capped KVIndex).")
    ap.add_argument("--index-module", default=None, help="Also measure this index.py (e.g. the previous version).")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    cases = []
    for n in [int(x) for x in args.replicas.split(",")]:
        for hot in (0.0, 0.25):
            for module in ([args.index_module] if args.index_module else []) + [None]:
                c = memory_case(args.entries, n, hot, None, module)
                print(f"[index] {c}", file=sys.stderr, flush=True)
                cases.append(c)
    if args.index_max_blocks:
        n = int(args.replicas.split(",")[-1])
        c = memory_case(args.entries, n, 0.0, args.index_max_blocks)
        print(f"[index] capped: {c}", file=sys.stderr, flush=True)
        cases.append(c)
    res = {"benchmark": "index_scale", "entries_per_case": args.entries, "python": sys.version.split()[0],
           "cases": cases, "loadavg": os.getloadavg()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index_scale.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res) if args.json else "\n".join(json.dumps(c) for c in cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
