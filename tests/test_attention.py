"""Attention backends: the CPU backend equals dense SDPA; a second one, chosen by name, runs the engine."""

import collections
import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from warmfleet import LLM, SamplingParams
from warmfleet.server.attention import registry
from warmfleet.server.attention.cpu import QUERY_CHUNK, STRIDE_KERNEL_FLAG, CpuPagedAttention
from warmfleet.server.attention.interface import KVLayout, LayerCache
from warmfleet.server.config import EngineConfig, ModelConfig

def dense(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = paddle.repeat_interleave(k, rep, axis=1), paddle.repeat_interleave(v, rep, axis=1)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]


def one_layer_cache(backend, num_blocks, block_size):
    (cache,) = backend.allocate(KVLayout(1, 2, 8, block_size, "float32"), num_blocks)
    return cache


@pytest.mark.parametrize("split", [None, 300])
def test_multi_tile_prefill_matches_dense(split):
    paddle.seed(0)
    n, bs = 2 * QUERY_CHUNK + 100, 16
    q, k, v = paddle.randn([n, 4, 8]), paddle.randn([n, 2, 8]), paddle.randn([n, 2, 8])
    backend = CpuPagedAttention()
    num_blocks = -(-n // bs)
    cache = one_layer_cache(backend, num_blocks + 3, bs)
    table = list(np.random.default_rng(0).permutation(num_blocks + 3)[:num_blocks])  # scattered blocks
    with backend.step():
        if split is None:
            out = backend.forward(q, k, v, cache, backend.build_metadata(bs, [(table, 0, n)]), 8 ** -0.5)
        else:  # chunked prefill: second chunk attends to the first chunk's cached keys
            a = backend.forward(q[:split], k[:split], v[:split], cache,
                                backend.build_metadata(bs, [(table, 0, split)]), 8 ** -0.5)
            b = backend.forward(q[split:], k[split:], v[split:], cache,
                                backend.build_metadata(bs, [(table, split, n - split)]), 8 ** -0.5)
            out = paddle.concat([a, b])
    np.testing.assert_allclose(out.numpy(), dense(q, k, v).numpy(), atol=2e-5)


def test_mixed_step_with_padded_decode_batch_matches_dense():
    """One step: a 5-token prefill chunk between two decodes whose contexts differ in length."""
    paddle.seed(1)
    bs, lens = 4, [9, 6, 13]  # total tokens per sequence after this step
    news = [1, 5, 1]  # decode, prefill chunk, decode
    seqs = [(paddle.randn([n, 4, 8]), paddle.randn([n, 2, 8]), paddle.randn([n, 2, 8])) for n in lens]
    backend = CpuPagedAttention()
    cache = one_layer_cache(backend, 16, bs)
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    with backend.step():
        for (q, k, v), table, n, new in zip(seqs, tables, lens, news):  # fill the already-cached part
            backend.forward(q[: n - new], k[: n - new], v[: n - new], cache,
                            backend.build_metadata(bs, [(table, 0, n - new)]), 8 ** -0.5)
        meta = backend.build_metadata(bs, [(t, n - new, new) for t, n, new in zip(tables, lens, news)])
        assert meta.decode is not None and len(meta.seqs) == 1
        out = backend.forward(paddle.concat([q[n - new:] for (q, _, _), n, new in zip(seqs, lens, news)]),
                              paddle.concat([k[n - new:] for (_, k, _), n, new in zip(seqs, lens, news)]),
                              paddle.concat([v[n - new:] for (_, _, v), n, new in zip(seqs, lens, news)]),
                              cache, meta, 8 ** -0.5)
    expected = paddle.concat([dense(q, k, v)[n - new:] for (q, k, v), n, new in zip(seqs, lens, news)])
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=2e-5)


def test_cold_sequences_of_one_length_attend_as_one_batch_and_match_dense():
    """A decode, then three cold 6-token prompts back to back: one batched attention, each causal on its own."""
    paddle.seed(2)
    bs, n, cold = 4, 6, 3
    dq, dk, dv = paddle.randn([7, 4, 8]), paddle.randn([7, 2, 8]), paddle.randn([7, 2, 8])  # a decode at 7 tokens
    seqs = [(paddle.randn([n, 4, 8]), paddle.randn([n, 2, 8]), paddle.randn([n, 2, 8])) for _ in range(cold)]
    backend = CpuPagedAttention()
    cache = one_layer_cache(backend, 16, bs)
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    with backend.step():
        backend.forward(dq[:6], dk[:6], dv[:6], cache, backend.build_metadata(bs, [(tables[0], 0, 6)]), 8 ** -0.5)
        meta = backend.build_metadata(bs, [(tables[0], 6, 1)] + [(t, 0, n) for t in tables[1:]])
        assert meta.cold is not None and meta.cold.num_seqs == cold and not meta.seqs
        out = backend.forward(paddle.concat([dq[6:]] + [q for q, _, _ in seqs]),
                              paddle.concat([dk[6:]] + [k for _, k, _ in seqs]),
                              paddle.concat([dv[6:]] + [v for _, _, v in seqs]), cache, meta, 8 ** -0.5)
        # and the other way round (prompts first, as rows 0..17), returned without re-ordering
        cache2 = one_layer_cache(backend, 16, bs)
        meta2 = backend.build_metadata(bs, [(t, 0, n) for t in tables[1:]])
        out2 = backend.forward(paddle.concat([q for q, _, _ in seqs]), paddle.concat([k for _, k, _ in seqs]),
                               paddle.concat([v for _, _, v in seqs]), cache2, meta2, 8 ** -0.5)
    expected = paddle.concat([dense(dq, dk, dv)[6:]] + [dense(q, k, v) for q, k, v in seqs])
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=2e-5)
    np.testing.assert_allclose(out2.numpy(), expected.numpy()[1:], atol=2e-5)


def stride_kernels_on() -> bool:
    return paddle.get_flags([STRIDE_KERNEL_FLAG])[STRIDE_KERNEL_FLAG]


def test_cpu_step_turns_stride_kernels_off_for_the_whole_step_and_restores_them():
    backend = CpuPagedAttention()
    assert stride_kernels_on()  # Paddle's default, which safetensors loading needs
    with backend.step():
        with backend.step():  # nested (e.g. a test's step around the runner's): the outer one still holds
            assert not stride_kernels_on()
        assert not stride_kernels_on()
    assert stride_kernels_on()


def test_cpu_swap_copies_move_whole_blocks_between_tiers():
    backend = CpuPagedAttention()
    layout = KVLayout(2, 2, 8, 4, "float32")
    primary, swap = backend.allocate(layout, 6), backend.allocate_swap(layout, 3)
    for i, c in enumerate(primary):
        c.key.set_value(paddle.randn(c.key.shape))
        c.value.set_value(paddle.randn(c.value.shape) + i)
    before = [(c.key.numpy().copy(), c.value.numpy().copy()) for c in primary]
    backend.copy_blocks(primary, [4, 1], swap, [0, 2], layout.block_size)  # swap out blocks 4 and 1
    for c in primary:
        c.key.set_value(paddle.zeros(c.key.shape))
        c.value.set_value(paddle.zeros(c.value.shape))
    backend.copy_blocks(swap, [2, 0], primary, [3, 5], layout.block_size)  # swap them in elsewhere
    bs = layout.block_size
    for c, (k, v) in zip(primary, before):
        np.testing.assert_array_equal(c.key.numpy()[:, 3 * bs:4 * bs], k[:, 1 * bs:2 * bs])  # [heads, slots, D]
        np.testing.assert_array_equal(c.value.numpy()[:, 5 * bs:6 * bs], v[:, 4 * bs:5 * bs])
        assert not c.key.numpy()[:, :3 * bs].any()  # nothing else was written


# ---- selection by name ----------------------------------------------------------------------------------


def test_unknown_backend_name_fails_with_one_line_naming_the_choices(tiny_model_dir):
    with pytest.raises(ValueError) as exc:
        registry.create("flash-nope")
    msg = str(exc.value)
    assert "\n" not in msg and "'flash-nope'" in msg and "registered backends: cpu" in msg
    EngineConfig(ModelConfig(model="/m", attention_backend="flash-nope")).validate()  # the flags contract knows no backends
    with pytest.raises(ValueError, match="unknown --attention-backend"):  # before any model is loaded
        LLM(str(tiny_model_dir), attention_backend="flash-nope")


def test_default_backend_is_the_cpu_one():
    assert ModelConfig().attention_backend == registry.DEFAULT == "cpu"
    assert isinstance(registry.create("cpu"), CpuPagedAttention)


class FakeBlockMajorMeta:
    def __init__(self, block_size, writes, queries):
        self.block_size = block_size
        self.writes = writes  # per sequence, in row order: (block table, first new position, new tokens)
        self.queries = queries  # per query row: (block table, its position)
        self.sampled = None


class FakeBlockMajorAttention:
    """A second backend, defined outside the product: numpy K/V in its own layout ([blocks, block_size,
    Hkv, D], not the CPU backend's slots), its own metadata, one query at a time."""

    name = "fake-block-major"

    def __init__(self):
        self.calls = collections.Counter()

    def allocate(self, layout, num_blocks, kind="allocate"):
        self.calls[kind] += 1
        shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        return [LayerCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(layout.num_layers)]

    def allocate_swap(self, layout, num_blocks):
        return self.allocate(layout, num_blocks, "allocate_swap")

    def copy_blocks(self, src, src_ids, dst, dst_ids, block_size):
        self.calls["copy_blocks"] += 1
        for a, b in zip(src, dst):
            b.key[list(dst_ids)] = a.key[list(src_ids)]
            b.value[list(dst_ids)] = a.value[list(src_ids)]

    def build_metadata(self, block_size, spans, samples=None):
        self.calls["build_metadata"] += 1
        writes = [(list(t), done, new) for t, done, new in spans]
        meta = FakeBlockMajorMeta(block_size, writes, [(t, done + i) for t, done, new in writes for i in range(new)])
        if samples is not None:
            meta.sampled = FakeBlockMajorMeta(block_size, writes,
                                              [(t, done + new - 1) for (t, done, new), s in zip(writes, samples) if s])
        return meta

    def step(self):
        self.calls["step"] += 1
        return contextlib.nullcontext()

    def forward(self, q, k, v, cache, meta, scale):
        self.calls["forward"] += 1
        bs, kn, vn, qn = meta.block_size, k.numpy(), v.numpy(), q.numpy()
        row = 0
        for table, done, new in meta.writes:
            for p in range(done, done + new):
                cache.key[table[p // bs], p % bs], cache.value[table[p // bs], p % bs] = kn[row], vn[row]
                row += 1
        rep = qn.shape[1] // kn.shape[1]
        out = np.zeros_like(qn)
        for i, (table, pos) in enumerate(meta.queries):
            keys, vals = (np.repeat(x[table].reshape(-1, *x.shape[2:])[:pos + 1], rep, axis=1)
                          for x in (cache.key, cache.value))  # [context, Hq, D]
            scores = np.einsum("hd,chd->hc", qn[i], keys) * scale
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[i] = np.einsum("hc,chd->hd", probs / probs.sum(axis=-1, keepdims=True), vals)
        return paddle.to_tensor(out)


def swap_tier_run(model_dir, **kw):
    """The swap round trip of test_engine: a prompt, a filler that evicts it to the CPU tier, the prompt again."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), block_size=16, num_gpu_blocks=12, swap_space=0.01, max_num_seqs=1, **kw)
    p = [(i * 7) % 300 + 20 for i in range(70)]
    first = llm.generate([p], greedy)[0]
    llm.generate([[5] * 191], SamplingParams(max_tokens=1, ignore_eos=True))
    again = llm.generate([p], greedy)[0]
    assert again.num_cached_tokens_cpu == 64  # served from the swap tier
    return llm, [first.outputs[0].token_ids, again.outputs[0].token_ids]


def test_a_backend_registered_by_name_runs_the_engine_with_the_same_outputs(tiny_model_dir, monkeypatch):
    """Registering a name is all it takes: metadata, both tiers, swap copies and attention go through
    the backend, and greedy tokens equal the CPU backend's."""
    monkeypatch.setitem(registry.BACKENDS, FakeBlockMajorAttention.name, FakeBlockMajorAttention)
    _, reference = swap_tier_run(tiny_model_dir)
    llm, tokens = swap_tier_run(tiny_model_dir, attention_backend="fake-block-major")
    assert tokens == reference and reference[0] == reference[1]
    backend = llm.engine.runner.backend
    assert isinstance(backend, FakeBlockMajorAttention)
    assert llm.engine.model.model.layers[0].self_attn.backend is backend
    calls = backend.calls
    assert calls["allocate"] == calls["allocate_swap"] == 1
    assert calls["copy_blocks"] >= 2  # swapped out, then back in
    assert calls["step"] >= calls["build_metadata"] >= 12  # every step runs inside step(); idle ones build nothing
    assert calls["forward"] == calls["build_metadata"] * llm.engine.model.num_layers


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (14, 2, 64), (4, 4, 128), (6, 2, 16)])
def test_native_decode_kernel_matches_paddle_ops(heads, kv_heads, head_dim):
    """Ragged decode rows after a prefill chunk (rows out of step order), scattered blocks, grouped-query heads."""
    rng = np.random.default_rng(heads * head_dim)
    native, ops = CpuPagedAttention(native=True), CpuPagedAttention(native=False)
    calls = []
    kernel = native._kernel
    assert kernel is not None, "this machine builds the kernel (it has a C compiler)"
    native._kernel = lambda *a: calls.append(a[5]) or kernel(*a)
    bs, layout = 16, KVLayout(1, kv_heads, head_dim, 16, "float32")
    (cache,) = native.allocate(layout, 40)
    cache.key.set_value(paddle.to_tensor(rng.standard_normal(cache.key.shape, dtype=np.float32)))
    cache.value.set_value(paddle.to_tensor(rng.standard_normal(cache.value.shape, dtype=np.float32)))
    blocks = [int(b) for b in rng.permutation(40)]
    spans = [(blocks[0:3], 40, 1), (blocks[3:5], 20, 7), (blocks[5:6], 0, 1), (blocks[6:10], 63, 1)]
    t = sum(n for _, _, n in spans)
    q = paddle.to_tensor(rng.standard_normal((t, heads, head_dim), dtype=np.float32))
    k, v = (paddle.to_tensor(rng.standard_normal((t, kv_heads, head_dim), dtype=np.float32)) for _ in range(2))
    outs = []
    for backend in (native, ops):
        with backend.step():
            outs.append(backend.forward(q, k, v, cache, backend.build_metadata(bs, spans), head_dim ** -0.5).numpy())
    assert calls == [3]  # one kernel call for the three decode rows
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-5, rtol=1e-5)


def test_without_a_c_compiler_the_cpu_backend_decodes_with_paddle_ops_and_says_how_to_fix(monkeypatch, tmp_path,
                                                                                         caplog):
    from warmfleet.server.attention import native

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("WARMFLEET_KERNEL_DIR", str(tmp_path / "kernels"))
    native.paged_decode_f32.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            backend = CpuPagedAttention()
        assert backend._kernel is None
        assert "using Paddle ops" in caplog.text and "WARMFLEET_KERNEL_DIR" in caplog.text
        cache = one_layer_cache(backend, 4, 4)
        q, k, v = paddle.randn([3, 4, 8]), paddle.randn([3, 2, 8]), paddle.randn([3, 2, 8])
        with backend.step():
            out = backend.forward(q, k, v, cache, backend.build_metadata(4, [([0, 1], 0, 3)]), 8 ** -0.5)
        np.testing.assert_allclose(out.numpy(), dense(q, k, v).numpy(), atol=2e-5)
    finally:
        native.paged_decode_f32.cache_clear()


def test_kernel_is_built_once_per_source_and_reused(monkeypatch, tmp_path):
    from warmfleet.server.attention import native

    monkeypatch.setenv("WARMFLEET_KERNEL_DIR", str(tmp_path))
    first = native.build()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind
