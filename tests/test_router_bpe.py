"""tiktoken in the router's tokenizing (core/bpe.py): the Hugging Face ids or nothing."""

from __future__ import annotations

import json
import random
import shutil
import sys

import pytest

from warmfleet.server.router.core import bpe, prompt
from warmfleet.server.tokenizer import Tokenizer


def texts(tok: Tokenizer, n: int = 300, seed: int = 1) -> list[str]:
    vocab = tok._tok.get_vocab()
    words = [w[1:] for w in vocab if w[:1] == "Ġ" and w[1:].isalpha()]
    specials = [t.content for t in tok._tok.get_added_tokens_decoder().values()]
    rng = random.Random(seed)
    pieces = words + specials + ["  ", "\n", "\t", "123", "4,5", "'s", "ü", "é", "日本", "😀", "\r\n", "!?",
                                 "  \n "]
    return ["".join(rng.choice([" ", "", "\n"]) + rng.choice(pieces) for _ in range(rng.randrange(1, 80)))
            for _ in range(n)]


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_vl_dir", "bos_model_dir"])
def test_tiktoken_gives_the_checkpoints_ids(which, request):
    tok = Tokenizer(str(request.getfixturevalue(which)))
    enc = bpe.tiktoken_encoder(tok)
    assert enc is not None
    for text in texts(tok):
        assert enc(text) == tok.encode(text, add_special_tokens=False), text
    ids = prompt.ids_encoder(tok)  # the router's encoder: tiktoken without special tokens, HF with them
    assert ids("a b <|im_end|>", True) == tok.encode("a b <|im_end|>", add_special_tokens=True)


def _variant(src, tmp_path, edit) -> Tokenizer:
    out = tmp_path / "tok"
    shutil.copytree(src, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    edit(spec)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return Tokenizer(str(out))


def _swap_merge_ranks(spec):
    """The earliest two merges that compete for a symbol ("x y" and "y z") trade their tokens' ids: Hugging Face
    still merges by the merges list, a tiktoken built from the ids would merge "y z" first on "xyz"."""
    vocab = spec["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    for i, (x, y) in enumerate(merges):
        later = next((m for m in merges[i + 1:] if m[0] == y and x + y + m[1] not in vocab), None)
        if later is not None:
            a, b = x + y, later[0] + later[1]
            vocab[a], vocab[b] = vocab[b], vocab[a]
            return
    raise AssertionError("no competing merges in this vocabulary")


@pytest.mark.parametrize("edit", [
    lambda s: s.update(normalizer={"type": "Lowercase"}),
    lambda s: s["model"].update(byte_fallback=True),
    lambda s: s["added_tokens"][0].update(lstrip=True),
    lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
    _swap_merge_ranks,  # not excluded by construction: the probes must catch it
], ids=["normalizer", "byte-fallback", "lstrip", "pre-tokenizer", "ranks-not-merge-order"])
def test_a_tokenizer_tiktoken_does_not_reproduce_keeps_hugging_face(tiny_model_dir, tmp_path, edit):
    tok = _variant(tiny_model_dir, tmp_path, edit)
    assert bpe.tiktoken_encoder(tok) is None
    enc = prompt.ids_encoder(tok)
    for text in texts(tok, 50):
        assert enc(text, False) == tok.encode(text, add_special_tokens=False)


def test_the_merge_rank_swap_changes_some_ids(tiny_model_dir, tmp_path):
    """The control of the case above: with those ids swapped, tiktoken's ids would differ somewhere."""
    tok = _variant(tiny_model_dir, tmp_path, _swap_merge_ranks)
    spec = json.loads(tok._tok.to_str())
    enc = bpe._encoding(spec)
    assert enc is not None
    assert any(enc.encode(t, allowed_special="all") != tok.encode(t, add_special_tokens=False)
               for t in bpe._probes(spec))


def test_without_tiktoken_the_router_tokenizes_with_hugging_face(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails
    tok = Tokenizer(str(tiny_model_dir))
    assert bpe.tiktoken_encoder(tok) is None
