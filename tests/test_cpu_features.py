"""CPU feature checks before AVX-512/AVX2-only library paths, and the unfused RMSNorm a CPU without AVX-512 runs."""

from __future__ import annotations

import numpy as np
import paddle

from warmfleet.server.cpu_math import cpu_features
from warmfleet.server.models import qwen2


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_features.cpu_flags(str(info)) == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    assert cpu_features.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_runs_asks_for_every_flag(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    assert cpu_features.runs("avx2", "fma") and not cpu_features.runs("avx512f") and not cpu_features.runs("avx2", "x")
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "aarch64")
    assert not cpu_features.runs("avx2")


def _reference(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    h = (x.astype(np.float64) + residual)
    return w * h / np.sqrt((h * h).mean(-1, keepdims=True) + eps), h


def test_residual_rms_norm_without_the_fused_kernel_is_the_same_arithmetic(monkeypatch):
    monkeypatch.setattr(qwen2, "FUSED_RMS_NORM_ON_CPU", False)  # what a CPU without AVX-512 runs

    def fused(*_a, **_k):
        raise AssertionError("the fused kernel was called on a CPU without AVX-512")

    monkeypatch.setattr(qwen2.IF, "fused_rms_norm", fused)
    rng = np.random.default_rng(0)
    norm = qwen2.ResidualRMSNorm(16, 1e-6, "float32")
    w = rng.normal(size=16).astype(np.float32)
    norm.weight.set_value(w)
    x, res = (rng.normal(size=(3, 16)).astype(np.float32) for _ in range(2))
    out, new_res = norm(paddle.to_tensor(x), paddle.to_tensor(res))
    want, want_res = _reference(x, res, w, 1e-6)
    np.testing.assert_allclose(new_res.numpy(), want_res, rtol=1e-6)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    first, stream = norm(paddle.to_tensor(x))  # no residual yet: the stream starts at x
    np.testing.assert_allclose(first.numpy(), _reference(x, np.zeros_like(x), w, 1e-6)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stream.numpy(), x)
