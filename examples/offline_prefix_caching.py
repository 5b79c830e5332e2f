"""Offline prefix caching: many questions over one long document, the document's KV computed once.

    python examples/offline_prefix_caching.py [--model DIR]
"""

import argparse
import time

from warmfleet import LLM, SamplingParams
from warmfleet.demo import default_model

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo's tiny Qwen2)")
args = ap.parse_args()

document = " ".join(f"Paragraph {i}: the fleet keeps warm caches so repeated prefixes cost nothing." for i in range(60))
questions = ["What does the fleet keep?", "Why are repeated prefixes cheap?", "How many paragraphs are there?"]
sp = SamplingParams(max_tokens=16, temperature=0.0)

for caching in (False, True):
    llm = LLM(args.model or str(default_model()), enable_prefix_caching=caching, block_size=16)
    llm.chat([{"role": "system", "content": document}, {"role": "user", "content": "warm-up"}], sp)
    t0 = time.perf_counter()
    outs = [llm.chat([{"role": "system", "content": document}, {"role": "user", "content": q}], sp)[0]
            for q in questions]
    elapsed = time.perf_counter() - t0
    cached = sum(o.num_cached_tokens for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    print(f"prefix caching {'on ' if caching else 'off'}: {elapsed:.2f}s for {len(questions)} questions, "
          f"{cached}/{prompt} prompt tokens from cache")
