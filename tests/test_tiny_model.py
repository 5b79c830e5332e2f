"""make-tiny-model: determinism, HF-shaped config and tokenizer files, the CLI entry point."""

from __future__ import annotations

import json

import numpy as np
import pytest

from warmfleet.cli import main as cli_main
from warmfleet.server.tiny_checkpoints.text import ADDED_TOKENS, SIZES, build_tokenizer, make_tiny_model, weight_shapes

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "vocab.json", "merges.txt"]


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch="qwen2", size="tiny", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "other", arch="qwen2", size="tiny", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()


def test_qwen2_config_and_weights(tiny_model_dir):
    from safetensors.numpy import load_file

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["torch_dtype"] == "float32" and cfg["max_position_embeddings"] == 4096
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (2, 64, 4, 2)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    assert {k: v.shape for k, v in weights.items()} == weight_shapes(cfg)
    assert all(v.dtype == np.float32 for v in weights.values())
    assert "model.layers.0.self_attn.q_proj.bias" in weights and "lm_head.weight" in weights
    assert abs(float(weights["model.embed_tokens.weight"].std()) - cfg["initializer_range"]) < 0.01


def test_llama_and_tied_variants(tiny_llama_dir, tmp_path):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_scaling"]["rope_type"] == "llama3"
    shapes = weight_shapes(cfg)
    assert not any(k.endswith("_proj.bias") for k in shapes)
    tied = make_tiny_model(tmp_path / "tied", overrides={"tie_word_embeddings": True})
    assert "lm_head.weight" not in weight_shapes(json.loads((tied / "config.json").read_text()))


def test_tokenizer_fills_the_vocab_and_reserves_vision_tokens(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tcfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    tok_json = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    assert len(tok_json["model"]["vocab"]) + len(tok_json["added_tokens"]) == cfg["vocab_size"]
    added = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
    assert list(added) == [c for c, _ in ADDED_TOKENS]
    assert {"<|vision_start|>", "<|vision_end|>", "<|image_pad|>"} <= set(added)
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    assert cfg["bos_token_id"] == added["<|endoftext|>"] and cfg["eos_token_id"] == added["<|im_end|>"]


def test_bench_vocab_is_filled():
    tok = build_tokenizer(SIZES["bench"]["vocab"])
    assert tok.get_vocab_size() == SIZES["bench"]["vocab"]


def test_cli_writes_a_llama_checkpoint(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "m"), "--arch", "llama", "--seed", "3"]) == 0
    assert "wrote llama/tiny checkpoint (seed 3)" in capsys.readouterr().out
    assert all((tmp_path / "m" / f).is_file() for f in FILES)


def test_rejects_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
