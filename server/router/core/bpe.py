"""The router's prompt tokenizing through tiktoken, for byte-level BPE checkpoints whose ids it reproduces exactly.

On a stream of new prompts, tokenizing was the largest part of the router's CPU per request (a quarter to
a third, docs/router.md), and most of it is the pre-tokenizer's regex inside Hugging Face tokenizers.
tiktoken (OpenAI's Rust BPE) runs the same regex and merges about 7x faster: 17 us against 121 us for a
500-character prompt. Qwen2, Qwen2.5 and Llama 3 tokenizers are tiktoken vocabularies converted to
tokenizer.json, so their ids are merge ranks; other byte-level BPE vocabularies may be too.

It is used only where it was shown to give the Hugging Face tokenizer's ids:

- tokenizer.json must be a byte-level BPE (no dropout, no byte fallback, no unknown token) behind
  nothing but an NFC normalizer and one Split(regex, Isolated) + ByteLevel(use_regex=false) pre-tokenizer
  or a ByteLevel(use_regex=true) one, with added tokens that strip nothing;
- at start-up both encode probe texts (random vocabulary words, every added token embedded, digits,
  contractions, whitespace runs, tabs and newlines, accents, CJK, emoji); one difference and the router
  keeps Hugging Face's encoder.

A difference that still slipped through would cost cache hits (other block hashes than the replica's),
never a wrong answer: the replica tokenizes its prompt itself.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import unicodedata
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

# GPT-2's ByteLevel pre-tokenizer regex (ByteLevel with use_regex=true)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PROBE_SEED, PROBE_TEXTS = 7, 64


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: the character ByteLevel writes for each byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _pattern(spec: dict) -> Optional[str]:
    """The split regex of a byte-level pre-tokenizer, None for any other shape."""
    if spec.get("type") == "ByteLevel":
        return GPT2_PATTERN if spec.get("use_regex", True) and not spec.get("add_prefix_space") else None
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or regex is None or split.get("behavior") != "Isolated" or split.get("invert")
            or level.get("type") != "ByteLevel" or level.get("use_regex", True) or level.get("add_prefix_space")):
        return None
    return regex


def _encoding(spec: dict):
    """A tiktoken Encoding equivalent by construction to tokenizer.json `spec`, or None for any other shape."""
    model, norm = spec.get("model") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback") or model.get("unk_token"):
        return None
    if norm is not None and norm.get("type") != "NFC":
        return None
    pattern = _pattern(spec.get("pre_tokenizer") or {})
    if pattern is None:
        return None
    special = {}
    for tok in spec.get("added_tokens") or []:
        content = tok["content"]
        if (tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word")
                or unicodedata.normalize("NFC", content) != content):
            return None
        special[content] = tok["id"]
    to_byte = _unicode_to_byte()
    try:
        ranks = {bytes(to_byte[ch] for ch in token): rank for token, rank in model["vocab"].items()
                 if token not in special}
    except KeyError:  # a vocabulary entry that is not ByteLevel text
        return None
    import tiktoken

    return tiktoken.Encoding("warmfleet-router", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)


def _probes(spec: dict) -> list[str]:
    words = [w for w in spec["model"]["vocab"] if w[:1] == "Ġ" and w[1:].isalpha()][:4000] or ["Ġa"]
    rng = random.Random(PROBE_SEED)
    added = [t["content"] for t in spec.get("added_tokens") or []][:32]
    edge = ("Hello  world,\n\tthe  KV cache: 12345 ü ☃ don't I'll you'RE  \r\n\n  x\t\t"
            "日本語のテキスト、そして English 😀👍🏽 ñ é ⁂ 1,000.5 $% ~` ")
    texts = [edge, edge * 3, "", " ", "\n\n\n", "a", "  leading", "trailing  "]
    texts += ["".join(" " + w[1:] for w in rng.choices(words, k=rng.randrange(1, 120))) for _ in range(PROBE_TEXTS)]
    # words the vocabulary does not hold whole (two or three glued, or random letters), so the merges run: tiktoken
    # takes a piece that is one token as it is, where BPE could have merged it otherwise
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    texts += [" ".join("".join(w[1:] for w in rng.choices(words, k=rng.randrange(2, 4)))
                       + "".join(rng.choices(letters, k=rng.randrange(0, 6))) for _ in range(rng.randrange(1, 40)))
              for _ in range(PROBE_TEXTS)]
    texts += [f"{edge[:40]}{t}{edge[40:90]}{t}{t} tail" for t in added]
    return texts


def tiktoken_encoder(tokenizer: Any) -> Optional[Callable[[str], list[int]]]:
    """`encode(text)` equal to the tokenizer's `encode(text, add_special_tokens=False)`, through tiktoken; None where
    tiktoken is missing, the tokenizer is not one it reproduces by construction, or a probe differs."""
    raw = getattr(tokenizer, "_tok", None)
    if raw is None or not hasattr(raw, "to_str"):
        return None
    try:
        import tiktoken  # noqa: F401 - optional: without it the router tokenizes with Hugging Face's encoder
    except ImportError:
        return None
    try:
        spec = json.loads(raw.to_str())
        enc = _encoding(spec)
    except Exception as exc:  # noqa: BLE001 - an unexpected tokenizer.json keeps the Hugging Face encoder
        log.info("tiktoken cannot reproduce this tokenizer (%s); tokenizing with Hugging Face's", exc)
        return None
    if enc is None:
        return None
    nfc = spec.get("normalizer") is not None

    def encode(text: str) -> list[int]:
        if nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        return enc.encode(text, allowed_special="all", disallowed_special=())

    for text in _probes(spec):
        if encode(text) != tokenizer.encode(text, add_special_tokens=False):
            log.info("tiktoken's ids differ from this tokenizer's on a probe; tokenizing with Hugging Face's")
            return None
    return encode
