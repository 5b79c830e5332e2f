"""Sampler: logits → next token per request (greedy, temperature, top-k, top-p, seeds, logprobs); numpy.

NOTE: on CPU a step's logits are read in place through DLPack. With Qwen2.5's 151,936-token vocabulary,
copying them out (`Tensor.numpy()`) and taking per-row argmaxes cost 1.2 ms of CPU per step at batch 16
and 24 ms at batch 64 (39 MB, past the allocator's mmap threshold); the view and one argmax over the
batch 0.17 and 1.2 ms (docs/performance.md). Greedy argmaxes on the Paddle tensor were slower on CPU;
on a GPU (no host view) the logits are copied, and an argmax there would save that copy.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .sampling_params import SamplingParams


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, sp: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a [vocab] float32 logits row."""
    if sp.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / sp.temperature
    if sp.top_k and sp.top_k < x.shape[0]:
        kth = np.partition(x, -sp.top_k)[-sp.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, sp.top_p) + 1)]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.shape[0], p=p))


def token_logprobs(logits: np.ndarray, token: int, k: Optional[int]) -> Optional[tuple]:
    """(logprob of `token`, [(token id, logprob) for the top k]) from the model's raw distribution."""
    if k is None:
        return None
    lp = log_softmax(logits.astype(np.float64))
    top = []
    if k > 0:
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx])]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top


def host_rows(logits: Any) -> np.ndarray:
    """A step's [N, vocab] logits as numpy: a read-only view of a host tensor (no copy), else a copy."""
    try:
        return np.from_dlpack(logits)
    except (AttributeError, TypeError, RuntimeError, BufferError, ValueError):  # a device tensor, or no DLPack
        return logits.numpy()


def sample_step(logits: Any, params: list[SamplingParams], generators: list[np.random.Generator]
                ) -> tuple[list[int], list[Optional[tuple]]]:
    """(token per row, logprobs per row) for a step's float32 logits [N, vocab] (a Paddle tensor)."""
    rows = host_rows(logits)
    if all(sp.greedy for sp in params):  # one argmax over the batch; ties go to the lowest id, as per row
        tokens = rows.argmax(axis=1).tolist()
    else:
        tokens = [sample(row, sp, g) for row, sp, g in zip(rows, params, generators)]
    return tokens, [token_logprobs(row, t, sp.logprobs) for row, t, sp in zip(rows, tokens, params)]
