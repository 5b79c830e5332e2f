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
