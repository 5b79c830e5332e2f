"""Model parity with Hugging Face golden logits (no torch needed), paged/chunked equivalence, loader errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest

from warmfleet.server.attention.cpu import CpuPagedAttention
from warmfleet.server.engine.model_runner import kv_layout
from warmfleet.server.models.loader import load_model, register_model, MODEL_REGISTRY
from warmfleet.server.tiny_checkpoints.text import make_tiny_model

GOLDEN = Path(__file__).parent / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text(encoding="utf-8"))
ATOL = 1e-4


class PagedRunner:
    """Minimal stand-in for the engine's model runner: block tables, positions, paged caches."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 16):
        self.model = model
        self.block_size = block_size
        self.backend = model.model.layers[0].self_attn.backend
        self.caches = self.backend.allocate(kv_layout(model, block_size, "float32"), num_blocks)
        # hand out blocks in a scrambled order so tests cover non-contiguous block tables
        self.free = list(np.random.default_rng(0).permutation(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, batch: list[tuple[str, list[int]]]) -> list[np.ndarray]:
        """batch: (seq id, new token ids) per sequence -> logits [len(new), vocab] per sequence."""
        meta_batch, ids, positions = [], [], []
        for seq, new in batch:
            table = self.tables.setdefault(seq, [])
            done = self.num_computed.get(seq, 0)
            while len(table) * self.block_size < done + len(new):
                table.append(int(self.free.pop()))
            meta_batch.append((table, done, len(new)))
            ids += new
            positions += range(done, done + len(new))
            self.num_computed[seq] = done + len(new)
        meta = self.backend.build_metadata(self.block_size, meta_batch)
        with self.backend.step():
            hidden = self.model(paddle.to_tensor(ids, dtype="int64"), paddle.to_tensor(positions, dtype="int64"),
                                self.caches, meta)
        logits = self.model.compute_logits(hidden).numpy()
        out, start = [], 0
        for _, new in batch:
            out.append(logits[start:start + len(new)])
            start += len(new)
        return out


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    """name -> (model, golden arrays), checkpoints rebuilt from the recorded make_tiny_model arguments."""
    out = {}
    root = tmp_path_factory.mktemp("golden-ckpt")
    for name, entry in MANIFEST["models"].items():
        model_dir = make_tiny_model(root / name, **entry["make_tiny_model"])
        model, _ = load_model(model_dir, CpuPagedAttention(), "float32")
        out[name] = (model, dict(np.load(GOLDEN / f"{name}.npz")))
    return out


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_logits_match_transformers(golden_models, name):
    model, gold = golden_models[name]
    runner = PagedRunner(model)
    num_prompts = len(MANIFEST["prompts"])
    full_idx = MANIFEST["models"][name]["full_logits_prompt"]
    for i in range(num_prompts):
        (logits,) = runner.step([(f"p{i}", gold[f"prompt_{i}"].tolist())])
        np.testing.assert_allclose(logits[-1], gold["last_logits"][i], atol=ATOL, rtol=0)
        if i == full_idx:
            np.testing.assert_allclose(logits, gold["full_logits"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_greedy_decode_matches_transformers(golden_models, name):
    """Prefill then one token per step through the paged cache: the same 16 tokens as HF."""
    model, gold = golden_models[name]
    runner = PagedRunner(model, block_size=4)  # small blocks: decode crosses block boundaries
    (logits,) = runner.step([("s", gold["prompt_0"].tolist())])
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < len(gold["greedy"]):
        (logits,) = runner.step([("s", [tokens[-1]])])
        tokens.append(int(np.argmax(logits[-1])))
    assert tokens == gold["greedy"].tolist()


def test_golden_comparison_notices_wrong_positions(golden_models):
    """The tiny models are sensitive enough that wrong relative positions show far above ATOL.

    (A constant shift would not: RoPE attention depends only on position differences.)
    """
    model, gold = golden_models["qwen2_tiny"]
    ids = gold["prompt_1"].tolist()
    backend = CpuPagedAttention()
    caches = backend.allocate(kv_layout(model, 16, "float32"), 8)
    meta = backend.build_metadata(16, [([0, 1, 2], 0, len(ids))])
    stretched = paddle.arange(0, 2 * len(ids), 2, dtype="int64")
    logits = model.compute_logits(model(paddle.to_tensor(ids), stretched, caches, meta)).numpy()
    assert np.abs(logits - gold["full_logits"]).max() > 100 * ATOL


def test_llama3_rope_scaling_is_exercised(golden_models, tmp_path):
    """Dropping llama3 scaling moves llama_tiny's logits far off golden, so parity checks the scaling."""
    entry = MANIFEST["models"]["llama_tiny"]["make_tiny_model"]
    assert entry["overrides"] == {}
    model_dir = make_tiny_model(tmp_path / "m", **{**entry, "overrides": {"rope_scaling": None}})
    model, _ = load_model(model_dir, CpuPagedAttention())
    gold = golden_models["llama_tiny"][1]
    (logits,) = PagedRunner(model).step([("s", gold["prompt_3"].tolist())])
    assert np.abs(logits[-1] - gold["last_logits"][3]).max() > 100 * ATOL


@pytest.mark.parametrize("name", ["qwen2_tiny", "llama_tiny"])
def test_chunked_prefill_equals_one_shot(golden_models, name):
    model, gold = golden_models[name]
    ids = gold["prompt_3"].tolist()
    assert len(ids) > 40
    (one_shot,) = PagedRunner(model).step([("s", ids)])
    runner = PagedRunner(model)
    (first,) = runner.step([("s", ids[:37])])  # chunk boundary inside a block
    (second,) = runner.step([("s", ids[37:])])
    np.testing.assert_allclose(np.concatenate([first, second]), one_shot, atol=1e-5, rtol=0)


def test_mixed_batch_equals_separate_runs(golden_models):
    """A prefill and a decode in one flattened step give what they give alone."""
    model, gold = golden_models["qwen2_tiny"]
    a, b = gold["prompt_0"].tolist(), gold["prompt_2"].tolist()
    alone = PagedRunner(model)
    (a_logits,) = alone.step([("a", a)])
    alone.step([("b", b[:-1])])
    (b_last,) = alone.step([("b", b[-1:])])
    batched = PagedRunner(model)
    batched.step([("b", b[:-1])])
    a_mixed, b_mixed = batched.step([("a", a), ("b", b[-1:])])
    np.testing.assert_allclose(a_mixed, a_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(b_mixed, b_last, atol=1e-5, rtol=0)


def test_inputs_embeds_override_input_ids(golden_models):
    model, gold = golden_models["qwen2_tiny"]
    ids = gold["prompt_0"].tolist()
    backend = CpuPagedAttention()
    results = []
    for kwargs in ({"input_ids": paddle.to_tensor(ids)},
                   {"input_ids": None, "inputs_embeds": model.embed(paddle.to_tensor(ids))}):
        caches = backend.allocate(kv_layout(model, 16, "float32"), 4)
        meta = backend.build_metadata(16, [([0, 1], 0, len(ids))])
        results.append(model(positions=paddle.arange(len(ids), dtype="int64"), caches=caches, meta=meta, **kwargs).numpy())
    np.testing.assert_array_equal(results[0], results[1])
    assert results[0].shape == (len(ids), model.hidden_size)


def test_model_attributes(golden_models):
    model, _ = golden_models["llama_tiny_headdim32"]
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.hidden_size, model.vocab_size) == (2, 2, 32, 64, 1024)


# ---- loader ------------------------------------------------------------------------------------

def _rewrite_weights(model_dir: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path))


@pytest.fixture
def ckpt(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "ckpt"))


def test_loader_reports_missing_tensor(ckpt):
    _rewrite_weights(ckpt, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model.layers.1.mlp.up_proj.weight"):
        load_model(ckpt, CpuPagedAttention())


def test_loader_reports_unexpected_tensor(ckpt):
    _rewrite_weights(ckpt, lambda w: w.update({"model.layers.9.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): model.layers.9.extra.weight"):
        load_model(ckpt, CpuPagedAttention())


def test_loader_reports_shape_mismatch(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp.*has shape .* expects"):
        load_model(ckpt, CpuPagedAttention())


def test_loader_rejects_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture \['MambaForCausalLM'\]; supported: .*Qwen2ForCausalLM"):
        load_model(ckpt, CpuPagedAttention())


def test_loader_requires_config_and_weights(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere", CpuPagedAttention())
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(ckpt, CpuPagedAttention())


def test_loader_reads_sharded_checkpoint(ckpt, tiny_model_dir):
    from safetensors.numpy import load_file, save_file

    from warmfleet.server.models import loader

    weights = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for fname, keys in {"model-00001-of-00002.safetensors": names[::2],
                        "model-00002-of-00002.safetensors": names[1::2]}.items():
        save_file({k: weights[k] for k in keys}, str(ckpt / fname))
        weight_map.update({k: fname for k in keys})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    config = loader.read_config(ckpt)
    model = loader.resolve_architecture(config)[1](config, CpuPagedAttention())
    messages: list[str] = []
    loader.load_weights(model, loader.safetensors_files(ckpt), progress=messages.append)
    assert [m.split(" (")[0] for m in messages] == [
        "loaded shard 1/2 model-00001-of-00002.safetensors", "loaded shard 2/2 model-00002-of-00002.safetensors"]
    assert messages[-1].split("(")[1].startswith("100%")
    params = model.checkpoint_parameters()
    assert set(params) <= set(weights)
    for name, param in params.items():  # every tensor, from whichever shard, in its parameter
        got = param.numpy().T if getattr(param, "checkpoint_transposed", False) else param.numpy()
        np.testing.assert_array_equal(got, weights[name])

    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(ckpt, CpuPagedAttention())


def test_register_model_adds_an_architecture(ckpt):
    from warmfleet.server.models.qwen2 import Qwen2ForCausalLM

    class Renamed(Qwen2ForCausalLM):
        pass

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["RenamedForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    register_model("RenamedForCausalLM", Renamed)
    try:
        model, config = load_model(ckpt, CpuPagedAttention())
        assert type(model) is Renamed and config["architectures"] == ["RenamedForCausalLM"]
    finally:
        MODEL_REGISTRY.pop("RenamedForCausalLM")


def test_bfloat16_weights_load_and_run(ckpt):
    """bf16 checkpoints (the usual real-world dtype) load; logits stay close to fp32."""
    from safetensors.paddle import save_file as save_paddle
    from safetensors.numpy import load_file

    prompt = list(range(40, 90))
    fp32_model, _ = load_model(ckpt, CpuPagedAttention(), "float32")
    (ref,) = PagedRunner(fp32_model).step([("p", prompt)])
    weights = load_file(str(ckpt / "model.safetensors"))
    save_paddle({k: paddle.to_tensor(v).astype("bfloat16") for k, v in weights.items()}, str(ckpt / "model.safetensors"))
    model, _ = load_model(ckpt, CpuPagedAttention(), "float32")
    (got,) = PagedRunner(model).step([("p", prompt)])
    assert not np.array_equal(got, ref)  # the weights really were rounded to bf16
    # bf16 keeps ~3 significant digits of each weight; the logits of this tiny model stay within 2% of their range
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.02 * float(np.abs(ref).max()))


def test_half_precision_on_cpu_fails_at_load_with_a_clear_error(tiny_model_dir):
    if not paddle.device.get_device().startswith("cpu"):
        pytest.skip("GPU present: bfloat16 is supported")
    with pytest.raises(ValueError, match="bfloat16 needs a GPU"):
        load_model(tiny_model_dir, CpuPagedAttention(), "bfloat16")


def test_rope_config_layouts_agree():
    """transformers v5 writes `rope_parameters`; v4 writes `rope_theta` + `rope_scaling`."""
    from warmfleet.server.models.qwen2 import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
    v4 = rope_inv_freq({"rope_theta": 500000.0, "rope_scaling": scaling}, 64)
    v5 = rope_inv_freq({"rope_parameters": {"rope_theta": 500000.0, **scaling}}, 64)
    np.testing.assert_array_equal(v4, v5)
    plain = rope_inv_freq({"rope_theta": 500000.0}, 64)
    assert plain[0] == v4[0] == 1.0 and v4[-1] == pytest.approx(plain[-1] / 8)  # high freqs kept, low freqs / factor
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        rope_inv_freq({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 64)


@pytest.mark.parametrize("out_major", [True, False])
@pytest.mark.parametrize("name", ["qwen2_tiny", "qwen2_tiny_tied"])
def test_either_weight_layout_matches_transformers(tmp_path, monkeypatch, name, out_major):
    """The layouts timed at load (layout.py, Paddle's matmul) only change how projections are stored and multiplied."""
    from warmfleet.server.cpu_math import layout, onednn

    monkeypatch.setenv(onednn.ENV, "paddle")
    monkeypatch.setattr(layout, "out_major_is_faster", lambda *a: out_major)
    entry = MANIFEST["models"][name]
    model, _ = load_model(make_tiny_model(tmp_path / name, **entry["make_tiny_model"]), CpuPagedAttention(), "float32")
    table = model.model.embed_tokens.weight
    assert (list(table.shape)[0] == model.vocab_size) == (out_major or not model.tie_word_embeddings)
    linears = [m for m in model.sublayers() if hasattr(m, "out_major")]
    assert linears and all(m.out_major == out_major for m in linears)
    gold = dict(np.load(GOLDEN / f"{name}.npz"))
    runner = PagedRunner(model)
    (logits,) = runner.step([("p", gold["prompt_0"].tolist())])  # many rows: x @ W^T for [out, in]
    np.testing.assert_allclose(logits[-1], gold["last_logits"][0], atol=ATOL, rtol=0)
    (logits,) = runner.step([("q", gold["prompt_1"].tolist()[:layout.SMALL_ROWS])])  # few rows: W @ x^T
    (whole,) = PagedRunner(model).step([("q", gold["prompt_1"].tolist()[:layout.SMALL_ROWS])])
    np.testing.assert_allclose(logits, whole, atol=1e-5, rtol=0)


def test_projection_layout_is_timed_once_per_shape():
    from warmfleet.server.cpu_math import layout

    layout.out_major_is_faster.cache_clear()
    first = layout.out_major_is_faster(64, 512, "float32")
    assert layout.out_major_is_faster(64, 512, "float32") is first
    assert layout.out_major_is_faster.cache_info().hits == 1
    assert layout.out_major_is_faster(64, 512, "bfloat16") is False  # not timed: [in, out]


@pytest.mark.parametrize("width", [896, 4096, 32768, 32000, 151936, 128256, 152064, 65536, 262144])
def test_a_wide_projection_is_timed_on_a_slice_with_its_stride_factor(width):
    from warmfleet.server.cpu_math import layout

    timed = layout.timed_width(width)
    assert timed <= layout.TIMED_WIDTH
    if width <= layout.TIMED_WIDTH:
        assert timed == width
    elif width & -width < layout.TIMED_WIDTH:  # e.g. Qwen2's 151,936 = 2^7 x 1187: 32,640, not 32,768
        assert timed & -timed == width & -width and timed > layout.TIMED_WIDTH // 2
    else:
        assert timed == layout.TIMED_WIDTH


@pytest.mark.parametrize("rows", [1, 16, 17, 64])
def test_both_layouts_project_alike_at_every_row_count(rows):
    from warmfleet.server.cpu_math import layout

    paddle.seed(rows)
    w, x = paddle.randn([24, 40]), paddle.randn([rows, 24])
    with CpuPagedAttention().step():
        np.testing.assert_allclose(layout.project(x, w.T.contiguous(), True).numpy(),
                                   layout.project(x, w, False).numpy(), atol=1e-5)
