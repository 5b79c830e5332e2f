"""Prefix-cache benchmark: TTFT of a cold prefix vs a GPU-tier hit vs a swap-tier hit, and decode throughput.

    python bench/prefix_cache.py [--quick] [--json] [--model DIR]

Runs the engine in-process (offline `LLM`) on the `bench` checkpoint (made on first run) so the
figures are the engine's own, without HTTP. Progress goes to stderr; the last stdout line is
one JSON object. Ratios are measured side by side in one run; quote those, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

PREFIX_TOKENS = 2048
QUESTION_TOKENS = 64
BLOCK_SIZE = 64


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from warmfleet.server.models.tiny import make_tiny_model

    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / "bench-qwen2"
    if not (out / "config.json").exists():
        progress(f"writing the bench checkpoint to {out}")
        make_tiny_model(out, arch="qwen2", size="bench", seed=0)
    return out


def tokens(rng, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, vocab - 10, size=n)]


def ttft(llm, prompt: list[int], salt: str) -> tuple[float, int, int]:
    from warmfleet import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=salt)[0]
    return time.perf_counter() - t0, out.num_cached_tokens, out.num_cached_tokens_cpu


def decode_throughput(llm, vocab: int, batch: int, new_tokens: int, rng) -> float:
    from warmfleet import SamplingParams

    prompts = [tokens(rng, vocab, 32) for _ in range(batch)]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, cache_salt=f"decode-{rng.integers(1 << 30)}")
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


_HF_SCRIPT = """
import json, sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM
model_dir, batch, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ids = torch.tensor(np.random.default_rng(0).integers(10, model.config.vocab_size - 10, (batch, 32)))
gen = lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)
with torch.no_grad():
    gen(2)  # warm-up
    t0 = time.perf_counter()
    out = gen(new_tokens)
print(json.dumps((out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - t0)))
"""


def transformers_throughput(model_dir: Path, batch: int, new_tokens: int) -> float | None:
    """transformers.generate decode tok/s in its own process (so the two runtimes never share threads)."""
    import subprocess

    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return None
    r = subprocess.run([sys.executable, "-P", "-c", _HF_SCRIPT, str(model_dir), str(batch), str(new_tokens)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        progress(f"transformers baseline failed: {r.stderr.strip().splitlines()[-1:]}")
        return None
    return float(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and decode tokens")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary on stdout")
    ap.add_argument("--model", help="checkpoint directory (default: the bench checkpoint, made on first run)")
    ap.add_argument("--runs", type=int, default=None, help="repetitions per measurement (default 5, quick 3)")
    args = ap.parse_args()
    runs = args.runs or (3 if args.quick else 5)

    import numpy as np

    from warmfleet import LLM

    model_dir = bench_model_dir(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    total = PREFIX_TOKENS + QUESTION_TOKENS
    # Primary pool holds just over one prompt, so one filler request pushes the prefix into the swap tier.
    num_gpu_blocks = (total + 2 * BLOCK_SIZE) // BLOCK_SIZE + 2
    progress(f"loading {model_dir} (primary pool {num_gpu_blocks} blocks, swap 1 GiB)")
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, swap_space=1.0,
              max_num_batched_tokens=4096, max_num_seqs=16)
    rng = np.random.default_rng(0)
    filler_len = num_gpu_blocks * BLOCK_SIZE - 1

    progress("warm-up")
    ttft(llm, tokens(rng, vocab, total), "warmup")
    miss, hit, swap_hit = [], [], []
    cached_hit, cached_swap = [], []
    for r in range(runs):
        salt = f"run-{r}"
        prefix = tokens(rng, vocab, PREFIX_TOKENS)
        t, c, _ = ttft(llm, prefix + tokens(rng, vocab, QUESTION_TOKENS), salt)
        assert c == 0, "a cold prompt must not hit"
        miss.append(t)
        t, c, _ = ttft(llm, prefix + tokens(rng, vocab, QUESTION_TOKENS), salt)
        hit.append(t)
        cached_hit.append(c)
        ttft(llm, tokens(rng, vocab, filler_len), f"filler-{r}")  # evicts the prefix into the swap tier
        t, c, c_cpu = ttft(llm, prefix + tokens(rng, vocab, QUESTION_TOKENS), salt)
        swap_hit.append(t)
        cached_swap.append(c_cpu)
        progress(f"run {r + 1}/{runs}: miss {miss[-1]:.3f}s hit {hit[-1]:.3f}s swap-hit {swap_hit[-1]:.3f}s "
                 f"(cached {cached_hit[-1]} / from cpu {cached_swap[-1]})")

    new_tokens = 16 if args.quick else 64
    progress(f"decode throughput, {new_tokens} new tokens at batch 1 and 16")
    dec1 = decode_throughput(llm, vocab, 1, new_tokens, rng)
    dec16 = decode_throughput(llm, vocab, 16, new_tokens, rng)
    progress("transformers.generate baseline (only where torch is installed)")
    hf1 = transformers_throughput(model_dir, 1, new_tokens)
    hf16 = transformers_throughput(model_dir, 16, new_tokens) if hf1 is not None else None

    m_miss, m_hit, m_swap = (statistics.median(x) for x in (miss, hit, swap_hit))
    result = {
        "benchmark": "prefix_cache",
        "model": str(model_dir),
        "runs": runs,
        "prefix_tokens": PREFIX_TOKENS,
        "question_tokens": QUESTION_TOKENS,
        "ttft_miss_s": round(m_miss, 4),
        "ttft_hit_s": round(m_hit, 4),
        "ttft_swap_hit_s": round(m_swap, 4),
        "hit_over_miss": round(m_hit / m_miss, 4),
        "swap_hit_over_miss": round(m_swap / m_miss, 4),
        "ideal_ratio": round(QUESTION_TOKENS / total, 4),
        "cached_tokens_hit": int(statistics.median(cached_hit)),
        "cached_tokens_swap_hit_cpu": int(statistics.median(cached_swap)),
        "decode_tok_s_batch1": round(dec1, 1),
        "decode_tok_s_batch16": round(dec16, 1),
        "transformers_decode_tok_s_batch1": None if hf1 is None else round(hf1, 1),
        "transformers_decode_tok_s_batch16": None if hf16 is None else round(hf16, 1),
        "targets": {"hit_over_miss": 0.10, "swap_hit_over_miss": 0.25},
    }
    if not args.json:
        for k, v in result.items():
            print(f"{k:36s} {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
