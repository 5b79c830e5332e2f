"""vLLM's own step times on the CPU build, in-process, for the sections `profile_engine.py` measures for ours.

    <vllm python> -P bench/vllm_steps.py --model DIR [--runs 3] [--batches 1,16,64] [--new-tokens 16]

Run it with the vLLM CPU environment's python (scripts/vllm-env.sh prints it), with
VLLM_CPU_OMP_THREADS_BIND=0 for one math thread on core 0 as in bench/prefix_cache.py. For each
batch of 32-token random prompts: the time of a 1-token generation (the batch's prefill, its
`prefill<B>x32`) and of a `--new-tokens` generation; their difference over the extra tokens is one
decode step at that batch (`decode<B>`). Prefix caching off, fp32, block size 64, 4,096-token
steps, 64 sequences: the side-by-side settings. Progress on stderr; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

PROMPT_TOKENS = 32


progress = harness.reporter("vllm-steps")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    progress(f"loading {args.model}")
    llm = LLM(model=args.model, dtype="float32", block_size=64, max_num_batched_tokens=4096, max_num_seqs=64,
              enable_prefix_caching=False, max_model_len=4096)
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(0)

    def generate(batch: int, tokens: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(10, vocab - 10, PROMPT_TOKENS).tolist())
                   for _ in range(batch)]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    generate(64, 2)  # warm-up
    sections = {}
    for b in map(int, args.batches.split(",")):
        prefill = statistics.median(generate(b, 1) for _ in range(args.runs))
        whole = statistics.median(generate(b, args.new_tokens) for _ in range(args.runs))
        sections[f"prefill{b}x{PROMPT_TOKENS}"] = {"step_ms": round(prefill * 1e3, 1)}
        sections[f"decode{b}"] = {"step_ms": round((whole - prefill) / (args.new_tokens - 1) * 1e3, 1)}
        progress(f"batch {b}: prefill {prefill * 1e3:.0f} ms, decode step {sections[f'decode{b}']['step_ms']} ms")
    print(json.dumps({"benchmark": "vllm_steps", "model": args.model, "runs": args.runs,
                      "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "sections": sections}))
    return 0


if __name__ == "__main__":
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        sys.exit("set VLLM_CPU_OMP_THREADS_BIND (e.g. 0: one math thread on core 0, as bench/prefix_cache.py)")
    sys.exit(main())
