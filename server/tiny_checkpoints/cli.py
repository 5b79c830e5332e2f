"""`warmfleet make-tiny-model`: writes a tiny random text (text.py) or VL (vl.py) checkpoint."""

from __future__ import annotations

import argparse
import time

from .text import ARCHS, SIZES, make_tiny_model
from .vl import VL_ARCHS, make_tiny_vl_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="Output directory (created if missing).")
    parser.add_argument("--arch", choices=ARCHS + VL_ARCHS, default="qwen2", help="Model architecture.")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny",
                        help="tiny: 2 layers, hidden 64 (tests); bench: 4 layers, hidden 512 (CPU benchmarks); "
                             "qwen2.5-0.5b: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads, "
                             "MLP 4864, vocab 151,936; Qwen ties its embeddings: add --tie-word-embeddings).")
    parser.add_argument("--seed", type=int, default=0, help="Weight seed; same seed, same bytes.")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="Share embed_tokens with lm_head.")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    overrides = {"tie_word_embeddings": True} if args.tie_word_embeddings else None
    if args.arch in VL_ARCHS:
        out = make_tiny_vl_model(args.out, arch=args.arch, size=args.size, seed=args.seed, overrides=overrides)
    else:
        out = make_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed, overrides=overrides)
    print(f"wrote {args.arch}/{args.size} checkpoint (seed {args.seed}) to {out} in {time.perf_counter() - t0:.2f} s")
    return 0
