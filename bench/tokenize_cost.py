"""Router tokenizing cost: CPU per completion prompt through `encode` and through the offset-free `encode_batch_fast`.

    python -P bench/tokenize_cost.py [--requests 300] [--rounds 4] [--json]

Prompts are bench/trace_replay.py's (the committed Mooncake excerpt, tiny checkpoint, ~2,200 characters
each). CPU is process time (not wall clock), interleaved rounds, medians reported; the ids of both
paths are compared for every prompt. With --json the last stdout line is one JSON object whose
`targets` say whether the fast path is cheaper and gives the same ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402
replay_workload = harness.sibling("replay_workload")

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from warmfleet.server.router.core.prompt import ids_encoder
    from warmfleet.server.tokenizer import Tokenizer

    tok = Tokenizer(str(replay_workload.tiny_model()))
    reqs = replay_workload.build_requests(replay_workload.read_trace(replay_workload.EXCERPT, args.requests), replay_workload.Words(tok, 16), 16, None)
    texts = [r["text"] for r in reqs]
    fast = ids_encoder(tok)
    paths = {"encode": lambda t: tok.encode(t, add_special_tokens=True), "encode_batch_fast": lambda t: fast(t, True)}
    ms: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.rounds):
        for name, f in paths.items():
            t0 = time.process_time()
            for t in texts:
                f(t)
            ms[name].append((time.process_time() - t0) / len(texts) * 1e3)
    same = all(paths["encode"](t) == paths["encode_batch_fast"](t) for t in texts)
    med = {k: round(statistics.median(v), 4) for k, v in ms.items()}
    out = {"prompts": len(texts), "mean_chars": round(statistics.mean(map(len, texts))), "cpu_ms_per_prompt": med,
           "rounds": ms, "ratio_fast_over_plain": round(med["encode_batch_fast"] / med["encode"], 3),
           "targets": {"fast_path_cheaper": med["encode_batch_fast"] < med["encode"], "same_ids": same}}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
