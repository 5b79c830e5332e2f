"""Vision-encoder cost per image token over prefill cost per token, engine in-process: `warmfleet route --encoder-weight`.

    python -P bench/encode_cost.py [--quick] [--model DIR] [--images N] [--json]

The engine (`warmfleet.LLM`, prefix caching off so every prompt is prefilled whole, processor cache
off) times from submission to first token (`ttft_s`, no HTTP, no image decoding), per image:

    miss   image k, never seen          ttft = fixed + prefill(all tokens) + encode(k)
    hit    image k again, another text  ttft = fixed + prefill(all tokens)                (encoder-cache hit)

and text prompts of two lengths give prefill seconds per token (the slope, so the fixed part
cancels). encoder_weight = median(miss - hit) / (image tokens x prefill s per token): the prefill
tokens an encoder-cache hit saves per image token, what the router's score weighs an
encoder-warm image by. The images are routing.py's image workloads' (224 x 224 PNGs). Prints one
JSON object (the last line with --json). Over HTTP the same pairs were lost in the noise of a
shared machine (differences of +-20 ms around an 8 ms encode).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

progress = harness.reporter("encode_cost")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def image_messages(question: str, uri: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": question}]}]


def run(model: Path, images: int, seed: int = 0) -> dict:
    """The figures for the checkpoint at `model`."""
    from warmfleet import LLM, SamplingParams

    photo_uri = harness.sibling("routing_workload").photo_uri
    rng = random.Random(seed)
    llm = LLM(str(model), enable_prefix_caching=False, max_encoder_cache=1 << 20, max_processor_cache=0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(msgs=None, prompt=None):
        out = (llm.chat(msgs, sp) if msgs is not None else llm.generate(prompt, sp))[0]
        return out.ttft_s, out

    ttft(image_messages(text(rng, 6), photo_uri(10_000 + seed)))  # first-image set-up, not measured
    encode, image_tokens, prompt_tokens = [], 0, 0
    for k in range(images):
        uri = photo_uri(20_000 + 100 * seed + k)
        miss, out = ttft(image_messages(text(rng, 6), uri))
        hit, _ = ttft(image_messages(text(rng, 6), uri))
        encode.append(miss - hit)
        prompt_tokens = len(out.prompt_token_ids)
    image_tokens = llm.chat(image_messages("x", photo_uri(1)), sp)[0].prompt_token_ids.count(
        llm.tokenizer.token_to_id("<|image_pad|>"))
    short, long_ = [], []
    for _ in range(2 * images):
        for n, out_list in ((8, short), (400, long_)):  # words: the long prompt ~10x the image ones
            t, out = ttft(prompt=text(rng, n))
            out_list.append((t, len(out.prompt_token_ids)))
    t_s, n_s = statistics.median(t for t, _ in short), statistics.median(n for _, n in short)
    t_l, n_l = statistics.median(t for t, _ in long_), statistics.median(n for _, n in long_)
    per_token = max((t_l - t_s) / max(1, n_l - n_s), 1e-9)
    encode_s = statistics.median(encode)
    stats = llm.engine.stats()
    return {"model": str(model), "images": images, "image_tokens": image_tokens, "image_prompt_tokens": prompt_tokens,
            "encode_s_per_image": round(encode_s, 5), "encode_s_runs": [round(x, 5) for x in encode],
            "prefill_s_per_token": round(per_token, 8), "text_prompt_tokens": [n_s, n_l],
            "encoder_cache_hits": stats.encoder_cache_hits,
            "encoder_weight": round(max(0.0, encode_s) / (image_tokens * per_token), 3) if image_tokens else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="The tiny VL checkpoint (default: the bench VL one).")
    ap.add_argument("--model", default=None)
    ap.add_argument("--images", type=int, default=None, help="Images measured (default 12; quick 8).")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = harness.model_dir(args.model, "tiny" if args.quick else "bench", "qwen2_vl", say=progress)
    res = run(model, args.images or (8 if args.quick else 12))
    harness.print_results(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
