"""LoRA in the engine against transformers + peft goldens (tests/golden_lora, scripts/make_golden_lora.py), residency and hashing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from warmfleet.server.engine.protocol import GenerateRequest
from warmfleet.server.engine.sampling_params import SamplingParams
from warmfleet.server.models.lora import load_adapter, read_config
from warmfleet.server.offline import LLM
from warmfleet.server.tiny_checkpoints.text import make_tiny_model

GOLDEN = Path(__file__).parent / "golden_lora"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text(encoding="utf-8"))
LOGPROB_ATOL = 1e-4  # the text goldens' logit tolerance (tests/test_models.py ATOL)
LABELS = ("base", "a", "b")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    entry = MANIFEST["models"]["qwen2_tiny"]
    return make_tiny_model(tmp_path_factory.mktemp("lora-qwen2") / "m", **entry["make_tiny_model"])


def adapter_dir(model: str, label: str) -> str:
    return str(GOLDEN / model / label)


def make_llm(model_dir, **kw) -> LLM:
    args = dict(block_size=16, num_gpu_blocks=64,
                lora_modules=[f"{x}={adapter_dir('qwen2_tiny', x)}" for x in ("a", "b")], max_loras=2)
    return LLM(str(model_dir), **{**args, **kw})


def run(engine, requests: list[tuple[str, list[int], str | None]], max_tokens: int) -> dict:
    """request id -> (tokens, chosen-token log-probs, cached tokens), all added before the first step."""
    out = {rid: ([], [], 0) for rid, _, _ in requests}
    for rid, ids, lora in requests:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        engine.add_request(GenerateRequest(rid, list(ids), sp, lora_name=None if lora == "base" else lora))
    while engine.has_work:
        for o in engine.step():
            assert o.error is None, o.error
            toks, lps, _ = out[o.request_id]
            toks += o.new_token_ids
            lps += [lp[0] for lp in (o.new_logprobs or [])]
            out[o.request_id] = (toks, lps, o.num_cached_tokens)
    return out


def check_golden(out: dict, gold, rid_of) -> float:
    worst = 0.0
    for (label, i), rid in rid_of.items():
        toks, lps, _ = out[rid]
        assert toks == gold[f"{label}_tokens_{i}"].tolist(), (label, i)
        diff = float(np.abs(np.asarray(lps) - gold[f"{label}_logprobs_{i}"]).max())
        assert diff <= LOGPROB_ATOL, (label, i, diff)
        worst = max(worst, diff)
    return worst


def test_mixed_batch_matches_transformers_and_peft(qwen2_dir):
    """Base, adapter a and adapter b on two prompts, all six in one batch: peft's tokens and log-probs."""
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    llm = make_llm(qwen2_dir, enable_prefix_caching=False)
    rid_of = {(label, i): f"{label}-{i}" for label in LABELS for i in range(2)}
    reqs = [(rid, gold[f"prompt_{i}"].tolist(), label) for (label, i), rid in rid_of.items()]
    first = llm.engine.scheduler
    out = run(llm.engine, reqs, MANIFEST["num_greedy"])
    assert first.num_preemptions == 0
    worst = check_golden(out, gold, rid_of)
    print(f"max |log-prob - peft| = {worst:.2e}")


def test_adapters_change_the_output():
    """The goldens differ per adapter, so matching them needs each adapter's own weights on its own rows."""
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    for i in range(2):
        seqs = {label: gold[f"{label}_tokens_{i}"].tolist() for label in LABELS}
        assert len({tuple(s) for s in seqs.values()}) == 3


def test_cached_equals_cold_and_adapters_never_share_blocks(qwen2_dir):
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    prompt = gold["prompt_1"].tolist() * 3  # several full blocks
    llm = make_llm(qwen2_dir)
    cold = run(llm.engine, [("a0", prompt, "a")], 6)["a0"]
    assert cold[2] == 0
    other = run(llm.engine, [("b0", prompt, "b"), ("base0", prompt, "base")], 6)
    assert other["b0"][2] == 0 and other["base0"][2] == 0  # same tokens, another adapter: no hit
    warm = run(llm.engine, [("a1", prompt, "a"), ("b1", prompt, "b")], 6)
    assert warm["a1"][2] > 0 and warm["b1"][2] > 0  # hits within one adapter
    assert warm["a1"][:2][0] == cold[0]
    np.testing.assert_allclose(warm["a1"][1], cold[1], atol=1e-5)
    assert warm["b1"][0] == other["b0"][0]
    blocks = llm.engine.pool
    names = {blocks.lora_of.get(h) for h in blocks.cached}
    assert names == {None, "a", "b"}


def test_a_request_waits_for_a_busy_slot_and_is_not_refused(qwen2_dir):
    """--max-loras 1: b's request waits while a's runs, then runs with b's weights (its golden tokens)."""
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    llm = make_llm(qwen2_dir, max_loras=1, enable_prefix_caching=False)
    eng = llm.engine
    n = MANIFEST["num_greedy"]
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    eng.add_request(GenerateRequest("a-0", gold["prompt_0"].tolist(), sp, lora_name="a"))
    eng.add_request(GenerateRequest("b-0", gold["prompt_0"].tolist(), sp, lora_name="b"))
    eng.add_request(GenerateRequest("base-0", gold["prompt_0"].tolist(), sp))
    outs = {k: [] for k in ("a-0", "b-0", "base-0")}
    lps = {k: [] for k in outs}
    waited = False
    while eng.has_work:
        results = eng.step()
        running = {r.request_id for r in eng.scheduler.running}
        waiting = {r.request_id for r in eng.scheduler.waiting}
        if "a-0" in running and "b-0" in waiting:
            waited = True
            assert eng.stats().waiting_lora_adapters == ["b"]
            assert "base-0" in running or outs["base-0"]  # the base request is not held behind b
        for o in results:
            assert o.error is None
            outs[o.request_id] += o.new_token_ids
            lps[o.request_id] += [x[0] for x in o.new_logprobs]
    assert waited
    for rid, label in (("a-0", "a"), ("b-0", "b"), ("base-0", "base")):
        assert outs[rid] == gold[f"{label}_tokens_0"].tolist()
        np.testing.assert_allclose(lps[rid], gold[f"{label}_logprobs_0"], atol=LOGPROB_ATOL)
    assert eng.adapters.num_device_loads == 2 and eng.adapters.resident_names == ["b"]


def test_unloading_a_waiting_requests_adapter_ends_it_and_a_reload_never_mixes_weights(qwen2_dir):
    """b is unloaded while its request waits, then loaded again from a's files: the old request ends with an
    error (it was hashed for the old b), a new one runs the new weights (a's golden tokens)."""
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    eng = make_llm(qwen2_dir, max_loras=1, enable_prefix_caching=False).engine
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request(GenerateRequest("a-0", gold["prompt_0"].tolist(), sp, lora_name="a"))
    eng.add_request(GenerateRequest("b-0", gold["prompt_0"].tolist(), sp, lora_name="b"))
    results = eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ["b-0"]
    eng.unload_adapter("b")
    eng.load_adapter("b", adapter_dir("qwen2_tiny", "a"))
    eng.add_request(GenerateRequest("b-1", gold["prompt_0"].tolist(), sp, lora_name="b"))
    outs = {}
    while eng.has_work:
        results += eng.step()
    for o in results:
        outs.setdefault(o.request_id, []).append(o)
    assert outs["b-0"][-1].error and "unloaded" in outs["b-0"][-1].error
    assert outs["b-0"][-1].error_status == 404  # what the API answers: the model is no longer served
    assert sum((o.new_token_ids for o in outs["b-1"]), []) == gold["a_tokens_0"].tolist()[:4]
    assert not eng.adapters.pins


def test_host_lru_reloads_from_disk(qwen2_dir):
    llm = make_llm(qwen2_dir, max_loras=1, max_cpu_loras=1, enable_prefix_caching=False)
    ad = llm.engine.adapters
    assert list(ad.host) == ["b"] and ad.num_disk_loads == 2  # registering b pushed a out of host memory
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    out = run(llm.engine, [("a", gold["prompt_0"].tolist(), "a")], 3)
    assert out["a"][0] == gold["a_tokens_0"].tolist()[:3]
    assert ad.num_disk_loads == 3 and list(ad.host) == ["a"]


def test_runtime_load_and_unload(qwen2_dir):
    llm = make_llm(qwen2_dir, lora_modules=[], enable_lora=True)
    eng = llm.engine
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        eng.add_request(GenerateRequest("x", [1, 2, 3], SamplingParams(max_tokens=1), lora_name="a"))
    info = eng.load_adapter("a", adapter_dir("qwen2_tiny", "a"))
    assert len(info["digest"]) == 32
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_adapter("a", adapter_dir("qwen2_tiny", "b"))
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    assert run(eng, [("r", gold["prompt_0"].tolist(), "a")], 4)["r"][0] == gold["a_tokens_0"].tolist()[:4]
    eng.unload_adapter("a")
    assert not eng.adapters.resident and len(eng.adapters.free_slots) == 2
    with pytest.raises(KeyError):
        eng.unload_adapter("a")


def test_lora_off_refuses_adapter_requests(qwen2_dir):
    llm = LLM(str(qwen2_dir), block_size=16, num_gpu_blocks=16)
    assert llm.engine.adapters is None and llm.engine.runner.lora is None
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        llm.engine.add_request(GenerateRequest("x", [1, 2], SamplingParams(max_tokens=1), lora_name="a"))


# ---- the files -------------------------------------------------------------------------------------
def _edited(tmp_path, src: str, **changes) -> Path:
    d = tmp_path / "adapter"
    shutil.copytree(src, d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, words", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="lora_only"), "bias"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, words):
    d = _edited(tmp_path, adapter_dir("qwen2_tiny", "a"), **changes)
    with pytest.raises(ValueError, match=words):
        read_config(d)


def test_scale_rank_limit_and_foreign_tensors(tmp_path):
    assert read_config(adapter_dir("qwen2_tiny", "a")) == (8, 2.0)  # alpha 16 / r 8
    assert read_config(adapter_dir("qwen2_tiny", "b")) == (4, 4.0)  # rsLoRA: alpha 8 / sqrt(4)
    with pytest.raises(ValueError, match="max-lora-rank 4"):
        read_config(adapter_dir("qwen2_tiny", "a"), max_rank=4)
    from safetensors.numpy import load_file, save_file

    d = _edited(tmp_path, adapter_dir("qwen2_tiny", "a"))
    tensors = load_file(str(d / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lm_head"):
        load_adapter("a", d)


def test_adapter_for_another_model_is_refused_at_load(qwen2_dir, tmp_path):
    other = make_tiny_model(tmp_path / "wide", arch="qwen2", size="tiny", seed=0, overrides={"hidden_size": 128})
    with pytest.raises(ValueError, match="the model's is 128"):
        make_llm(other)


# ---- Qwen2-VL's language model ---------------------------------------------------------------------
def test_vl_mixed_batch_matches_transformers_and_peft(tmp_path):
    """Qwen2-VL with an image: base, a and b in one batch (adapters on the language model only)."""
    import base64

    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    entry = MANIFEST["models"]["qwen2_vl_tiny"]
    gold = np.load(GOLDEN / "qwen2_vl_tiny" / "golden.npz")
    image = np.load(GOLDEN.parent / "golden_vl" / "qwen2_vl" / "one_image.npz")["image0_bytes"].tobytes()
    text = json.loads((GOLDEN.parent / "golden_vl" / "qwen2_vl" / "meta.json").read_text())["prompts"]["one_image"]["text"]
    ckpt = make_tiny_vl_model(tmp_path / "vl", **entry["make_tiny_vl_model"])
    llm = LLM(str(ckpt), block_size=16, num_gpu_blocks=64, enable_prefix_caching=False, max_loras=2,
              lora_modules=[f"{x}={adapter_dir('qwen2_vl_tiny', x)}" for x in ("a", "b")])
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]
    sp = SamplingParams(max_tokens=MANIFEST["num_greedy"], temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.chat([conv] * 3, sp, lora_name=[None, "a", "b"])
    assert outs[0].prompt_token_ids == gold["prompt_0"].tolist()
    worst = 0.0
    for out, label in zip(outs, LABELS):
        assert out.outputs[0].token_ids == gold[f"{label}_tokens_0"].tolist(), label
        worst = max(worst, float(np.abs(np.asarray(out.outputs[0].logprobs) - gold[f"{label}_logprobs_0"]).max()))
    assert worst <= LOGPROB_ATOL
    print(f"VL max |log-prob - peft| = {worst:.2e}")


# ---- contract 1 (hash chain) and contract 2 (events) ----------------------------------------------
def test_adapter_identity_enters_the_chain_root_and_base_roots_are_unchanged():
    import blake3
    import msgpack

    from warmfleet.server.hashing import AdapterId, adapter_digest, block_hashes, root_hash

    fp = "fingerprint"
    assert root_hash(fp, "salt") == blake3.blake3(msgpack.packb([b"warmfleet-kv-v1", fp, "salt"])).digest()
    a = AdapterId("a", adapter_digest(adapter_dir("qwen2_tiny", "a")))
    roots = {root_hash(fp, "salt"), root_hash(fp, "salt", adapter=a), root_hash(fp, "salt", adapter=AdapterId("b", a.digest)),
             root_hash(fp, "salt", adapter=AdapterId("a", "0" * 32)), root_hash(fp, None, adapter=a)}
    assert len(roots) == 5
    assert adapter_digest(adapter_dir("qwen2_tiny", "a")) != adapter_digest(adapter_dir("qwen2_tiny", "b"))
    toks = list(range(32))
    assert block_hashes(toks, [], 16, fp, adapter=a)[0] != block_hashes(toks, [], 16, fp)[0]


def test_engine_hashes_and_events_name_the_adapter(qwen2_dir):
    """The router reproduces an adapter request's chain from (name, adapter_digest(dir)); events say lora_name."""
    from warmfleet.server.events import BlockStored
    from warmfleet.server.hashing import AdapterId, adapter_digest, block_hashes

    class Recorder:
        seq, events = 0, []

        def publish(self, events):
            self.events += events

    llm = make_llm(qwen2_dir)
    eng = llm.engine
    eng.publisher = Recorder()
    prompt = list(range(1, 40))
    run(eng, [("a", prompt, "a"), ("base", prompt, "base")], 1)
    want = block_hashes(prompt, [], 16, eng.info.model_fingerprint, None, "blake3",
                        adapter=AdapterId("a", adapter_digest(adapter_dir("qwen2_tiny", "a"))))
    stored = [e for e in eng.publisher.events if isinstance(e, BlockStored)]
    by_name = {}
    for e in stored:
        by_name.setdefault(e.lora_name, []).extend(e.block_hashes)
    assert by_name["a"] == want and set(by_name) == {"a", None}
    assert set(by_name[None]).isdisjoint(want)
    snap = type(eng.snapshot()).from_json(eng.snapshot().to_json())
    assert {h for h, n in snap.lora.items() if n == "a"} == set(want)


def test_event_wire_is_backwards_compatible():
    from warmfleet.server.events import BlockStored, EventBatch, decode, encode
    import msgpack

    base = BlockStored([b"\x01" * 32], None, [1, 2], 2)
    adapted = BlockStored([b"\x02" * 32], None, [1, 2], 2, lora_name="a")
    frames = encode(EventBatch("r", 1, [base, adapted]))
    wire = msgpack.unpackb(frames[2])[1]
    assert len(wire[0]) == 7 and wire[1][7] == "a"  # base events: byte for byte the old array
    got = decode(frames).events
    assert got[0].lora_name is None and got[1].lora_name == "a"
    bad = [frames[0], frames[1], msgpack.packb([0.0, [wire[1][:7] + [5]], 0])]
    with pytest.raises(ValueError, match="lora_name"):
        decode(bad)


def test_swapped_out_adapter_blocks_keep_their_name():
    from warmfleet.server.engine.block_pool import BlockPool
    from warmfleet.server.events import CPU, BlockStored

    pool = BlockPool(1, 1, True, 2)
    (bid,) = pool.allocate(1)
    pool.cache_block(bid, b"h" * 32, None, [1, 2], "a")
    pool.free_blocks([bid])
    pool.allocate(1)  # evicts it to the CPU tier
    cpu = [e for e in pool.take_events() if isinstance(e, BlockStored) and e.medium == CPU]
    assert [e.lora_name for e in cpu] == ["a"] and pool.lora_of == {b"h" * 32: "a"}


# ---- flags -----------------------------------------------------------------------------------------
def test_lora_flags_round_trip_and_validate():
    import argparse

    from warmfleet.server.config import add_arguments, from_namespace, to_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_namespace(p.parse_args(["--model", "/m", "--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z",
                                       "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "8"]))
    assert cfg.lora.modules() == {"a": "/x", "b": "/y", "c": "/z"} and cfg.lora.enabled
    assert from_namespace(p.parse_args(to_args(cfg))) == cfg
    assert not from_namespace(p.parse_args(["--model", "/m"])).lora.enabled
    for bad, words in ((["--max-loras", "2", "--max-cpu-loras", "1"], "max-cpu-loras"),
                       (["--lora-modules", "a"], "NAME=PATH"), (["--lora-modules", "a=/x", "a=/y"], "twice")):
        with pytest.raises(ValueError, match=words):
            from_namespace(p.parse_args(["--model", "/m", *bad]))


def test_preemption_keeps_adapter_outputs(qwen2_dir):
    """Adapter requests preempted for blocks release their slot, come back and give what they give alone."""
    gold = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    prompts = [(gold["prompt_0"].tolist() + gold["prompt_1"].tolist()) * 2, gold["prompt_1"].tolist() * 4]
    reqs = [(f"{label}-{i}", p, label) for i, p in enumerate(prompts) for label in LABELS]
    alone = run(make_llm(qwen2_dir, enable_prefix_caching=False).engine, reqs, 12)
    tight = make_llm(qwen2_dir, enable_prefix_caching=False, num_gpu_blocks=12, max_num_batched_tokens=32)
    squeezed = run(tight.engine, reqs, 12)
    assert tight.engine.scheduler.num_preemptions > 0
    for rid in alone:
        assert squeezed[rid][0] == alone[rid][0], rid
    assert not tight.engine.adapters.pins


def test_router_side_modules_stay_free_of_paddle(tmp_path):
    """hashing (contract 1), events (contract 2) and the residency policy import no paddle: the router imports the first two."""
    import subprocess
    import sys

    code = ("import sys, warmfleet.server.hashing, warmfleet.server.events, warmfleet.server.engine.adapters; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'paddle'); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_an_unloaded_adapters_request_is_a_404_through_the_wire_and_the_api():
    """The scheduler's 404 survives the engine socket and becomes OpenAI's model_not_found, not an engine 500."""
    from warmfleet.server.api.completions import engine_failure
    from warmfleet.server.engine import serde
    from warmfleet.server.engine.request import RequestOutput
    from warmfleet.server.outputs import EngineError, OutputStream

    gone = serde.output_from_wire(serde.output_to_wire(RequestOutput(
        "r", [], True, "abort", 3, error="the LoRA adapter 'b' was unloaded", error_status=404)))
    assert gone.error_status == 404
    with pytest.raises(EngineError) as exc:
        OutputStream(detokenizer=None).push(gone)  # the error path detokenizes nothing
    err = engine_failure(exc.value)
    assert (err.status, err.code) == (404, "model_not_found") and "unloaded" in err.message
    assert engine_failure(EngineError("boom")).status == 500
