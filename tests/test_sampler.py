"""Sampler: a step's logits read in place (no copy on CPU) and the batch's greedy tokens as per-row argmaxes."""

from __future__ import annotations

import numpy as np
import paddle

from warmfleet.server.engine.sampler import host_rows, sample, sample_step
from warmfleet.server.engine.sampling_params import SamplingParams


def _logits(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, vocab)).astype(np.float32)
    x[1, [7, 3]] = 50.0  # a tie: the lowest id wins, as np.argmax per row
    return x


def test_host_rows_reads_a_cpu_tensor_in_place():
    t = paddle.to_tensor(_logits(4, 32))
    rows = host_rows(t)
    assert not rows.flags.owndata  # a view of the tensor's memory, not a copy
    np.testing.assert_array_equal(rows, t.numpy())


class FakeDeviceTensor:
    """A tensor without a host view (as on a GPU): only `numpy()` copies it out."""

    def __init__(self, x: np.ndarray):
        self.x = x

    def numpy(self) -> np.ndarray:
        return self.x.copy()


def test_host_rows_copies_what_it_cannot_view():
    x = _logits(2, 16)
    rows = host_rows(FakeDeviceTensor(x))
    assert rows.flags.owndata
    np.testing.assert_array_equal(rows, x)


def test_a_greedy_batch_takes_each_rows_argmax_with_ties_to_the_lowest_id():
    x = _logits(5, 64)
    params = [SamplingParams(temperature=0.0)] * 5
    tokens, lps = sample_step(paddle.to_tensor(x), params, [np.random.default_rng(0)] * 5)
    assert tokens == [int(np.argmax(r)) for r in x]
    assert tokens[1] == 3
    assert all(isinstance(t, int) for t in tokens) and lps == [None] * 5


def test_a_mixed_batch_samples_each_row_as_alone():
    x = _logits(3, 64)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=0)]
    tokens, lps = sample_step(paddle.to_tensor(x), params, [np.random.default_rng(5) for _ in params])
    assert tokens[0] == int(np.argmax(x[0])) and tokens[2] == int(np.argmax(x[2]))
    assert tokens[1] == sample(x[1], params[1], np.random.default_rng(5))
    assert lps[0] is None and len(lps[1][1]) == 2 and lps[2][1] == []
    expected = x[2].astype(np.float64) - np.log(np.exp(x[2].astype(np.float64) - x[2].max()).sum()) - x[2].max()
    assert abs(lps[2][0] - expected[tokens[2]]) < 1e-9
