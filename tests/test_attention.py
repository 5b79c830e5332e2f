"""CPU paged attention: tiled causal attention over a scattered block table equals dense SDPA."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from warmfleet.server.engine.attention import QUERY_CHUNK, AttentionMetadata, CpuPagedAttention


def dense(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = paddle.repeat_interleave(k, rep, axis=1), paddle.repeat_interleave(v, rep, axis=1)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]


@pytest.mark.parametrize("split", [None, 300])
def test_multi_tile_prefill_matches_dense(split):
    paddle.seed(0)
    n, bs = 2 * QUERY_CHUNK + 100, 16
    q, k, v = paddle.randn([n, 4, 8]), paddle.randn([n, 2, 8]), paddle.randn([n, 2, 8])
    backend = CpuPagedAttention()
    num_blocks = -(-n // bs)
    cache = backend.allocate(num_blocks + 3, bs, 2, 8, "float32")
    table = list(np.random.default_rng(0).permutation(num_blocks + 3)[:num_blocks])  # scattered blocks
    if split is None:
        out = backend.forward(q, k, v, cache, AttentionMetadata.build(bs, [(table, 0, n)]), 8 ** -0.5)
    else:  # chunked prefill: second chunk attends to the first chunk's cached keys
        a = backend.forward(q[:split], k[:split], v[:split], cache,
                            AttentionMetadata.build(bs, [(table, 0, split)]), 8 ** -0.5)
        b = backend.forward(q[split:], k[split:], v[split:], cache,
                            AttentionMetadata.build(bs, [(table, split, n - split)]), 8 ** -0.5)
        out = paddle.concat([a, b])
    np.testing.assert_allclose(out.numpy(), dense(q, k, v).numpy(), atol=2e-5)


def test_mixed_step_with_padded_decode_batch_matches_dense():
    """One step: a 5-token prefill chunk between two decodes whose contexts differ in length."""
    paddle.seed(1)
    bs, lens = 4, [9, 6, 13]  # total tokens per sequence after this step
    news = [1, 5, 1]  # decode, prefill chunk, decode
    seqs = [(paddle.randn([n, 4, 8]), paddle.randn([n, 2, 8]), paddle.randn([n, 2, 8])) for n in lens]
    backend = CpuPagedAttention()
    cache = backend.allocate(16, bs, 2, 8, "float32")
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    for (q, k, v), table, n, new in zip(seqs, tables, lens, news):  # fill the already-cached part
        backend.forward(q[: n - new], k[: n - new], v[: n - new], cache,
                        AttentionMetadata.build(bs, [(table, 0, n - new)]), 8 ** -0.5)
    meta = AttentionMetadata.build(bs, [(t, n - new, new) for t, n, new in zip(tables, lens, news)])
    assert meta.decode is not None and len(meta.seqs) == 1
    out = backend.forward(paddle.concat([q[n - new:] for (q, _, _), n, new in zip(seqs, lens, news)]),
                          paddle.concat([k[n - new:] for (_, k, _), n, new in zip(seqs, lens, news)]),
                          paddle.concat([v[n - new:] for (_, _, v), n, new in zip(seqs, lens, news)]),
                          cache, meta, 8 ** -0.5)
    expected = paddle.concat([dense(q, k, v)[n - new:] for (q, k, v), n, new in zip(seqs, lens, news)])
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=2e-5)
