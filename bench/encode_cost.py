"""Vision-encoder cost per image token over prefill cost per token on one real replica: `warmfleet route --encoder-weight`.

    python -P bench/encode_cost.py [--quick] [--model DIR] [--images N] [--json]

One `warmfleet serve` (processor cache off, so only the encoder cache differs) answers, per image:

    cold   new system prompt + image k (never seen)         latency = fixed + prefill(all) + encode(k)
    warm   another new system prompt + image k (same size)  latency = fixed + prefill(all)              (encoder hit)

and text-only prompts of two lengths with no cached prefix give prefill seconds per token (the slope,
so the fixed part cancels). encoder_weight = median(cold - warm) / (image tokens x prefill s per token):
the prefill tokens an encoder-cache hit saves per image token, what the router's score weighs an
encoder-warm image by. The images are routing.py's image workload's (224 x 224 PNGs). Prints one JSON
object (last line with --json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

from warmfleet.livefleet import MODEL_NAME, Replica  # noqa: E402

progress = harness.reporter("encode_cost")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def latency(url: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds for a one-token answer (prefill and one step) and its usage."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=300,
                   json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]


def image_messages(system: str, uri: str) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": "Describe it."}]}]


def measure(url: str, images: int, seed: int = 0) -> dict:
    """The figures on a running replica (`url`); images come from routing.py's workload."""
    photo_uri = harness.sibling("routing").photo_uri
    rng = random.Random(seed)
    latency(url, image_messages(text(rng, 12), photo_uri(10_000 + seed)))  # first-image set-up, not measured
    encode, image_tokens, prompt_tokens = [], 0, 0
    for k in range(images):
        uri = photo_uri(20_000 + 100 * seed + k)
        cold, usage = latency(url, image_messages(text(rng, 12), uri))
        warm, usage_warm = latency(url, image_messages(text(rng, 12), uri))
        assert usage_warm["prompt_tokens_details"]["cached_tokens"] == 0, "the warm run must not hit the KV cache"
        encode.append(cold - warm)
        image_tokens = usage["prompt_tokens_details"].get("image_tokens") or image_tokens
        prompt_tokens = usage["prompt_tokens"]
    short, long_ = [], []
    n_short, n_long = 8, 400  # words: the long prompt some ten times the image ones, so the slope stands out of the noise
    for _ in range(2 * images):
        for n, out in ((n_short, short), (n_long, long_)):
            t, usage = latency(url, [{"role": "user", "content": text(rng, n)}])
            out.append((t, usage["prompt_tokens"]))
    t_s, n_s = statistics.median(t for t, _ in short), statistics.median(n for _, n in short)
    t_l, n_l = statistics.median(t for t, _ in long_), statistics.median(n for _, n in long_)
    per_token = max((t_l - t_s) / max(1, n_l - n_s), 1e-9)
    encode_s = statistics.median(encode)
    return {"images": images, "image_tokens": image_tokens, "image_prompt_tokens": prompt_tokens,
            "encode_s_per_image": round(encode_s, 5), "encode_s_runs": [round(x, 5) for x in encode],
            "prefill_s_per_token": round(per_token, 7), "text_prompt_tokens": [n_s, n_l],
            "encoder_weight": round(max(0.0, encode_s) / (image_tokens * per_token), 3) if image_tokens else None}


def run(model: Path, images: int, cwd: Path) -> dict:
    """Start one replica on `model`, measure, stop it."""
    rep = Replica("encode-cost", model, cwd, ("--max-processor-cache", "0", "--max-encoder-cache", "65536"))
    rep.start()
    try:
        rep.wait_ready()
        return {"model": str(model), **measure(rep.url, images)}
    finally:
        rep.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="The tiny VL checkpoint (default: the bench VL one).")
    ap.add_argument("--model", default=None)
    ap.add_argument("--images", type=int, default=None, help="Images measured (default 12; quick 8).")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = harness.model_dir(args.model, "tiny" if args.quick else "bench", "qwen2_vl", say=progress)
    with tempfile.TemporaryDirectory(prefix="wf-encode-cost-") as cwd:
        res = run(model, args.images or (8 if args.quick else 12), Path(cwd))
    harness.print_results(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
