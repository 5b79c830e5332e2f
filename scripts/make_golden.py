"""Golden logits, greedy tokens and tokenizer outputs from Hugging Face `transformers` for tiny checkpoints.

Needs torch + transformers (not needed in CI). For each entry of CONFIGS it rebuilds the
checkpoint with `make_tiny_model` (deterministic, so only its arguments are recorded), runs
the reference model in fp32 with eager attention and writes tests/golden/<name>.npz; the
tokenizer reference (encodings, decodings, rendered chat templates) and every argument go to
tests/golden/manifest.json. Run: /work/venv/bin/python scripts/make_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden"
NUM_GREEDY = 16

# name -> make_tiny_model arguments
CONFIGS = {
    "qwen2_tiny": dict(arch="qwen2", size="tiny", seed=0, overrides={}),
    "qwen2_tiny_tied": dict(arch="qwen2", size="tiny", seed=1, overrides={"tie_word_embeddings": True}),
    "llama_tiny": dict(arch="llama", size="tiny", seed=2, overrides={}),  # llama3 rope scaling
    "llama_tiny_headdim32": dict(arch="llama", size="tiny", seed=3,
                                 overrides={"head_dim": 32, "rope_scaling": None, "rope_theta": 10000.0}),
}

PROMPTS = [
    "The harbor town woke before the sun.",
    "Question: What is the capital of France?\nAnswer:",
    "def fibonacci(n):\n    a, b = 0, 1",
    "Kubernetes schedules pods onto nodes. A deployment keeps a number of identical pods running, "
    "a service gives them a stable address, and a config map carries settings that the pods read at start. "
    "When a node fails, the controller starts new pods elsewhere. " * 3,
]
FULL_LOGITS_PROMPT = 1  # index into PROMPTS whose logits are saved at every position

ENCODE_TEXTS = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "Numbers 12345 and 3.14159, dates 2025-11-29.",
    "A café in Zürich: crème brûlée. 你好，世界。🙂👍",
    "line one\nline two\r\n\ttabbed",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "don't won't it's I'LL",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CHATS = [
    dict(messages=[{"role": "user", "content": "Hello!"}], tools=None, add_generation_prompt=True),
    dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
         tools=None, add_generation_prompt=True),
    dict(messages=[{"role": "user", "content": "Weather in Berlin?"}], tools=TOOLS, add_generation_prompt=True),
    dict(messages=[{"role": "user", "content": "Weather in Berlin?"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Berlin"}}}]},
                   {"role": "tool", "content": "{\"temp\": 12}"}],
         tools=TOOLS, add_generation_prompt=True),
    dict(messages=[{"role": "user", "content": "no generation prompt"}], tools=None, add_generation_prompt=False),
]


def _reference(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return tok, model


def _golden_for(name: str, args: dict, tmp: Path) -> dict:
    import torch

    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    model_dir = make_tiny_model(tmp / name, **args)
    tok, model = _reference(model_dir)
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    out: dict[str, np.ndarray] = {}
    last, margins = [], []
    with torch.no_grad():
        for i, ids in enumerate(prompt_ids):
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
            out[f"prompt_{i}"] = np.asarray(ids, dtype=np.int64)
            last.append(logits[-1])
            if i == FULL_LOGITS_PROMPT:
                out["full_logits"] = logits
        ids = list(prompt_ids[0])
        for _ in range(NUM_GREEDY):  # plain greedy without KV cache or EOS stop: the simplest reference
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            ids.append(int(np.argmax(logits)))
    out["last_logits"] = np.stack(last).astype(np.float32)
    out["full_logits"] = out["full_logits"].astype(np.float32)
    out["greedy"] = np.asarray(ids[len(prompt_ids[0]):], dtype=np.int64)
    np.savez_compressed(GOLDEN_DIR / f"{name}.npz", **out)
    return {"make_tiny_model": args, "full_logits_prompt": FULL_LOGITS_PROMPT, "greedy_prompt": 0,
            "greedy_min_top2_margin": min(margins)}


def _tokenizer_golden(tmp: Path) -> dict:
    from transformers import AutoTokenizer

    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    model_dir = make_tiny_model(tmp / "tokenizer_ref", arch="qwen2", size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    encode = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in ENCODE_TEXTS]
    decode = [{"ids": e["ids"], "skip_special_tokens": skip, "text": tok.decode(e["ids"], skip_special_tokens=skip)}
              for e in encode for skip in (True, False)]
    chats = [{**c, "rendered": tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False,
                                                         add_generation_prompt=c["add_generation_prompt"])}
             for c in CHATS]
    return {"make_tiny_model": dict(arch="qwen2", size="tiny", seed=0, overrides={}),
            "encode": encode, "decode": decode, "chat": chats}


def main() -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    manifest = {"generated_by": "scripts/make_golden.py", "torch": torch.__version__,
                "transformers": transformers.__version__, "prompts": PROMPTS, "num_greedy": NUM_GREEDY,
                "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in CONFIGS.items():
            manifest["models"][name] = _golden_for(name, args, Path(tmp))
            print(f"{name}: {manifest['models'][name]}", file=sys.stderr)
        manifest["tokenizer"] = _tokenizer_golden(Path(tmp))
    (GOLDEN_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    total = sum(f.stat().st_size for f in GOLDEN_DIR.iterdir())
    print(f"wrote {GOLDEN_DIR} ({total / 1024:.0f} KiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
