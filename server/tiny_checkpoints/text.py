"""Small random Hugging Face checkpoints (config, weights, tokenizer) for tests and demos; no paddle, no torch.

The checkpoint is byte-for-byte deterministic for a given (arch, size, seed, overrides), so the
golden logits in tests/golden/ (made once with `transformers`) can be checked in CI by rebuilding
the checkpoint instead of committing it. The tokenizer is a byte-level BPE trained on
`corpus.txt` with Qwen2's pre-tokenizer, special tokens and ChatML chat template; it reserves
Qwen2-VL's vision tokens so a VL variant can reuse it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

_HERE = Path(__file__).parent
CORPUS_PATH = _HERE / "corpus.txt"
QWEN2_CHAT_TEMPLATE_PATH = _HERE / "qwen2_chat_template.jinja"  # Qwen2.5-Instruct (ChatML + tools)
QWEN2_VL_CHAT_TEMPLATE_PATH = _HERE / "qwen2_vl_chat_template.jinja"  # Qwen2-VL-Instruct (list content, images)

# Qwen2's pre-tokenizer split (digits one by one, contractions, letters with one leading non-letter).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Added after the BPE vocabulary, in Qwen2/Qwen2.5's order; (content, special).
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
]

SIZES: dict[str, dict[str, Any]] = {
    # initializer_range 0.1 (not HF's 0.02) keeps attention and logits far from uniform at
    # hidden 64, so golden parity notices a wrong RoPE or mask instead of drowning it in noise.
    "tiny": dict(vocab=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1),
    "bench": dict(vocab=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, initializer_range=0.02),
    # Qwen2.5-0.5B's shape and vocabulary size (its tokenizer trains in ~45 s; weights ~2.5 GB in fp32).
    "qwen2.5-0.5b": dict(vocab=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, initializer_range=0.02),
}
ARCHS = ("qwen2", "llama")
MAX_POSITION_EMBEDDINGS = 4096


def _training_text(vocab: int) -> list[str]:
    """The corpus, plus (for vocabularies the corpus cannot fill) seeded pseudo-words."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    if vocab <= 1024:
        return [text]
    rng = np.random.default_rng(20251129)  # fixed: the tokenizer must not depend on the weight seed
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]
    words = []
    for _ in range(vocab * 3):
        n = int(rng.integers(1, 4))
        words.append("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                             + codas[rng.integers(len(codas))] for _ in range(n)))
    return [text, " ".join(words)]


def build_tokenizer(vocab: int):
    """Train Qwen2's byte-level BPE layout to exactly `vocab` ids (BPE part + ADDED_TOKENS)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    bpe_size = vocab - len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=0, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_training_text(vocab), trainer)
    if tok.get_vocab_size() != bpe_size:
        raise ValueError(f"corpus yields {tok.get_vocab_size()} BPE tokens, wanted {bpe_size}")
    for content, special in ADDED_TOKENS:
        t = AddedToken(content, special=special, normalized=not special, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    return tok


def _arch_config(arch: str, size: str, vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    s = SIZES[size]
    common = dict(
        attention_dropout=0.0, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        hidden_act="silu", hidden_size=s["hidden_size"], initializer_range=s["initializer_range"],
        intermediate_size=s["intermediate_size"], max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        num_attention_heads=s["num_attention_heads"], num_hidden_layers=s["num_hidden_layers"],
        num_key_value_heads=s["num_key_value_heads"], torch_dtype="float32", transformers_version="4.45.0",
        use_cache=True, vocab_size=vocab,
    )
    if arch == "qwen2":
        return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **common,
                    max_window_layers=s["num_hidden_layers"], rms_norm_eps=1e-6, rope_scaling=None,
                    rope_theta=1000000.0, sliding_window=MAX_POSITION_EMBEDDINGS, tie_word_embeddings=False,
                    use_sliding_window=False)
    if arch == "llama":
        # Llama 3.1 style: llama3 RoPE scaling from a short original context so the scaling matters.
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", **common, attention_bias=False,
                    head_dim=s["hidden_size"] // s["num_attention_heads"], mlp_bias=False, pretraining_tp=1,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                    rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 512, "rope_type": "llama3"})
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Qwen2/Llama config (lm_head absent when embeddings are tied)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nh
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    o_bias = config["model_type"] != "qwen2" and bool(config.get("attention_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * d)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * d,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * d,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * d,)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 init: normal(0, initializer_range) matrices and biases, norms near 1."""
    rng = np.random.default_rng(seed)
    std = float(config["initializer_range"])
    out = {}
    for name, shape in sorted(weight_shapes(config).items()):  # sorted: order fixes the random stream
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = std * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def _tokenizer_config(chat_template: str, ids: dict[str, int]) -> dict[str, Any]:
    """tokenizer_config.json as Qwen2.5-Instruct ships it (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    return {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[c]): {"content": c, "lstrip": False, "normalized": not s, "rstrip": False,
                          "single_word": False, "special": s}
            for c, s in ADDED_TOKENS
        },
        "additional_special_tokens": [c for c, s in ADDED_TOKENS if s and c != "<|endoftext|>"],
        "bos_token": None, "chat_template": chat_template, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def make_tiny_model(out: str | Path, arch: str = "qwen2", size: str = "tiny", seed: int = 0,
                    overrides: Optional[dict[str, Any]] = None) -> Path:
    """Write a random checkpoint to `out` (created if missing) and return its path.

    `overrides` replaces config.json fields before the weights are drawn (e.g.
    {"tie_word_embeddings": True} or {"head_dim": 32}); weights follow the final config.
    """
    out, vocab, tok, ids = start_checkpoint(out, arch, ARCHS, size, SIZES)
    config = _arch_config(arch, size, vocab, ids)
    config.update(overrides or {})
    weights = random_weights(config, seed)
    template = QWEN2_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    return write_checkpoint(out, config, weights, tok, ids, template)


def start_checkpoint(out: str | Path, arch: str, archs: tuple[str, ...], size: str, sizes: dict,
                     what: str = "arch") -> tuple[Path, int, Any, dict[str, int]]:
    """Check `arch` and `size` against the caller's tables and create `out`; then the tokenizer every tiny
    checkpoint shares: (out, vocab size, tokenizer, special token → id)."""
    if arch not in archs:
        raise ValueError(f"unknown {what} {arch!r}; choose from {archs}")
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; choose from {tuple(sizes)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = SIZES[size]["vocab"]
    tok = build_tokenizer(vocab)
    return out, vocab, tok, {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}


def write_checkpoint(out: Path, config: dict, weights: dict, tok: Any, ids: dict, template: str,
                     extra: Optional[dict[str, Any]] = None) -> Path:
    """Weights, config, generation config, tokenizer files and chat template in HF's layout (+ `extra` JSON files)."""
    from safetensors.numpy import save_file

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "transformers_version": config["transformers_version"],
    })
    for name, obj in (extra or {}).items():
        _write_json(out / name, obj)
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json + merges.txt, as Qwen ships them
    _write_json(out / "tokenizer_config.json", _tokenizer_config(template, ids))
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
