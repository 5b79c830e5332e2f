"""Projections through oneDNN's matmul on packed weights (server/cpu_math/onednn.py) against plain math."""

from __future__ import annotations

import logging

import numpy as np
import paddle
import pytest

from warmfleet.server.attention.cpu import CpuPagedAttention
from warmfleet.server.cpu_math import onednn
from warmfleet.server.models.loader import load_model
from warmfleet.server.models.qwen2 import Linear
from warmfleet.server.tiny_checkpoints.text import make_tiny_model


def weights(k: int, n: int, out_major: bool, bias: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    stored = paddle.to_tensor(np.ascontiguousarray(w.T) if out_major else w)
    return w, b, stored, (paddle.to_tensor(b) if bias else None)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 300, 1100])
@pytest.mark.parametrize("out_major", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_projection_equals_x_at_w_plus_b(rows, out_major, bias):
    assert onednn.available("float32")
    k, n = 96, 200  # not multiples of the kernels' blocks
    w, b, stored, pb = weights(k, n, out_major, bias)
    packed = onednn.PackedWeight(stored, out_major, pb)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    want = x @ w + (b if bias else 0)
    got = packed(paddle.to_tensor(x))
    assert got.shape == [rows, n] and got.dtype == paddle.float32
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4, rtol=1e-5)
    if rows > 64:  # run as chunks of 512/256/128/64 rows and an exact rest: no primitive for the size itself
        assert rows not in packed.shape.by_rows


def test_packed_projection_takes_views_batches_and_empty_inputs():
    w, _, stored, _ = weights(32, 48, False, False)
    packed = onednn.PackedWeight(stored, False)
    x = np.random.default_rng(2).standard_normal((2, 5, 32)).astype(np.float32)
    np.testing.assert_allclose(packed(paddle.to_tensor(x)).numpy(), x @ w, atol=1e-4)  # [B, T, in]
    xt = paddle.to_tensor(np.ascontiguousarray(x[0].T)).T  # a transposed view: strides, not rows
    np.testing.assert_allclose(packed(xt).numpy(), x[0] @ w, atol=1e-4)
    assert packed(paddle.zeros([0, 32])).shape == [0, 48]


def test_primitives_are_made_once_per_shape_and_row_count():
    a = onednn.PackedWeight(weights(40, 24, False, False, 3)[2], False)
    b = onednn.PackedWeight(weights(40, 24, True, False, 4)[2], True)
    assert a.shape is b.shape  # shared by every weight of one (in, out, bias)
    x = paddle.ones([7, 40])
    before = len(a.shape.by_rows)
    a(x), b(x), a(x)
    assert len(a.shape.by_rows) == before + 1
    assert onednn.PackedWeight(weights(40, 24, False, True, 5)[2], False, paddle.ones([24])).shape is not a.shape


@pytest.mark.parametrize("tied", [False, True])
def test_a_loaded_model_runs_every_projection_packed(tmp_path, tied):
    model, _ = load_model(make_tiny_model(tmp_path / "m", overrides={"tie_word_embeddings": tied}), CpuPagedAttention())
    linears = [m for m in model.sublayers() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and not m.weight._is_initialized() for m in linears)
    assert (model.tied_packed is not None) == tied and (model.lm_head is None) == tied
    if tied:  # the table stays plain for lookups; the output projection is its packed copy
        hidden = paddle.to_tensor(np.random.default_rng(6).standard_normal((3, model.hidden_size)).astype(np.float32))
        want = hidden.numpy() @ model.model.embed_tokens.weight.numpy().T
        np.testing.assert_allclose(model.compute_logits(hidden).numpy(), want, atol=1e-4)


def test_without_the_library_projections_use_paddles_matmul(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(onednn, "_state", {})
    monkeypatch.setattr(onednn, "library_path", lambda: tmp_path / "libdnnl.so.3")
    with caplog.at_level(logging.WARNING, logger="warmfleet.engine"):
        reason = onednn.load(1)
    assert reason and "OSError" in reason
    assert "projections use Paddle's matmul" in caplog.text and "libgomp1" in caplog.text
    assert not onednn.available("float32")
    model, _ = load_model(make_tiny_model(tmp_path / "m"), CpuPagedAttention())
    assert all(m.packed is None for m in model.sublayers() if isinstance(m, Linear))


def test_the_environment_can_turn_onednn_off(monkeypatch):
    assert onednn.available("float32")
    monkeypatch.setenv(onednn.ENV, "paddle")
    assert not onednn.available("float32")
    assert not onednn.available("bfloat16")


@pytest.mark.parametrize("rows", [1, 16, 300, 1100])
def test_epilogues_apply_silu_and_multiply_inside_the_matmul(rows):
    k, n = 64, 160
    wg, bg, sg, pbg = weights(k, n, True, True, 7)
    wu, _, su, _ = weights(k, n, False, False, 8)
    gate = onednn.PackedWeight(sg, True, pbg, epilogue="silu")
    up = onednn.PackedWeight(su, False, epilogue="mul")
    x = np.random.default_rng(9).standard_normal((rows, k)).astype(np.float32)
    h = x @ wg + bg
    silu = h / (1 + np.exp(-h))
    g = gate(paddle.to_tensor(x))
    np.testing.assert_allclose(g.numpy(), silu, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(up(paddle.to_tensor(x), g).numpy(), (x @ wu) * silu, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown epilogue 'gelu'"):
        onednn.PackedWeight(sg, True, epilogue="gelu")


def test_a_packed_gated_mlp_has_no_elementwise_pass(tmp_path, monkeypatch):
    import paddle.nn.functional as F

    model, _ = load_model(make_tiny_model(tmp_path / "m"), CpuPagedAttention())
    mlp = model.model.layers[0].mlp
    assert (mlp.gate_proj.packed.shape.epilogue, mlp.up_proj.packed.shape.epilogue) == ("silu", "mul")
    x = paddle.to_tensor(np.random.default_rng(10).standard_normal((5, model.hidden_size)).astype(np.float32))
    calls = []
    monkeypatch.setattr(F, "silu", lambda *a, **k: calls.append(a))
    y = mlp(x)
    assert y.shape == [5, model.hidden_size] and not calls


def test_primitives_kept_per_shape_are_bounded(monkeypatch):
    monkeypatch.setattr(onednn, "ROW_COUNTS_KEPT", 3)
    w, _, stored, _ = weights(24, 40, False, False, 11)
    packed = onednn.PackedWeight(stored, False)
    x = np.random.default_rng(12).standard_normal((9, 24)).astype(np.float32)
    for rows in (1, 2, 3, 4, 5, 2, 9):  # batch sizes vary: only the recent ones stay
        np.testing.assert_allclose(packed(paddle.to_tensor(x[:rows])).numpy(), x[:rows] @ w, atol=1e-4)
    assert list(packed.shape.by_rows) == [5, 2, 9]


def test_long_inputs_reuse_a_few_chunk_primitives():
    w, _, stored, _ = weights(24, 44, False, False, 13)  # a shape of its own: primitives are shared per shape
    packed = onednn.PackedWeight(stored, False)
    rng = np.random.default_rng(14)
    for rows in (2112, 1000, 390, 700):  # 4x512 + 64; 512 + 256 + 128 + 64 + 40; 256 + 128 + 6; 512 + 128 + 60
        x = rng.standard_normal((rows, 24)).astype(np.float32)
        np.testing.assert_allclose(packed(paddle.to_tensor(x)).numpy(), x @ w, atol=1e-4)
    assert set(packed.shape.by_rows) == {512, 256, 128, 64, 40, 6, 60}
