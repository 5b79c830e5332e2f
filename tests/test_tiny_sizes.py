"""make-tiny-model --size qwen2.5-0.5b: Qwen2.5-0.5B's shape, checked by its parameter count, without writing 2.5 GB."""

from __future__ import annotations

import math

from warmfleet.server.tiny_checkpoints.text import ADDED_TOKENS, _arch_config, weight_shapes

QWEN25_05B_PARAMS = 494_032_768  # Qwen/Qwen2.5-0.5B (tied embeddings), as transformers counts it


def test_the_qwen25_05b_size_has_that_models_config_and_parameter_count():
    ids = {content: 151_643 + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    cfg = _arch_config("qwen2", "qwen2.5-0.5b", 151_936, ids)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (896, 24, 14, 2, 4864, 151_936)
    tied = sum(math.prod(s) for s in weight_shapes({**cfg, "tie_word_embeddings": True}).values())
    assert tied == QWEN25_05B_PARAMS
    untied = sum(math.prod(s) for s in weight_shapes(cfg).values())
    assert untied == QWEN25_05B_PARAMS + 151_936 * 896  # the default writes lm_head too
