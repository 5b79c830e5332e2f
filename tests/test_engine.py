"""EngineCore on a real tiny checkpoint: prefix hits, swap tier, chunking and preemption never change outputs."""

import pytest

from warmfleet import LLM, SamplingParams
from warmfleet.server.hashing import block_hashes, model_fingerprint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n=4, length=70):
    # deterministic token prompts sharing a 48-token head
    head = [(i * 7) % 300 + 20 for i in range(48)]
    return [head + [(i * 13 + j * 5) % 300 + 20 for j in range(length - 48)] for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=16, enable_prefix_caching=False, num_gpu_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]


def test_prefix_hits_report_cached_tokens_and_keep_outputs(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=256)
    first = llm.generate(prompts()[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate(prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert outs[0].num_cached_tokens == 64  # 70-token prompt: 4 full blocks cached from the first run
    assert all(o.num_cached_tokens >= 48 for o in outs[1:])  # shared head, 3 blocks


def test_swap_tier_round_trip_keeps_outputs(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=12, swap_space=0.01, max_num_seqs=1)
    p = prompts()[0]
    llm.generate([p], GREEDY)
    llm.generate([[5] * 191], SamplingParams(max_tokens=1, ignore_eos=True))  # all 12 blocks: p goes to the CPU tier
    out = llm.generate([p], GREEDY)[0]
    assert out.num_cached_tokens_cpu == 64
    assert out.outputs[0].token_ids == reference[0]
    s = llm.stats()
    assert s.swap_out_blocks >= 4 and s.swap_in_blocks == 4


def test_chunked_prefill_and_preemption_keep_outputs(tiny_model_dir, reference):
    # a 24-token budget chunks every prompt; 14 blocks of 16 cannot hold 4 growing requests at once
    llm = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=14, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    outs = llm.generate(prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.stats().preemptions >= 1


def test_stop_strings_and_seeded_sampling(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64)
    free = llm.generate([prompts()[0]], GREEDY)[0].outputs[0].text
    assert len(free) > 3
    stop = free[2:4]
    cut = llm.generate([prompts()[0]], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True))
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == free[: free.index(stop)]
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    a = llm.generate([prompts()[1]], sp)[0].outputs[0].token_ids
    b = llm.generate([prompts()[1]], sp)[0].outputs[0].token_ids
    assert a == b
    assert llm.stats().num_running == 0 and llm.stats().gpu_blocks_free == 64


def test_engine_block_hashes_follow_contract_1(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=64)
    p = prompts()[0]
    llm.generate([p], SamplingParams(max_tokens=1), cache_salt="t1")
    expected = block_hashes(p, [], 16, model_fingerprint(tiny_model_dir), "t1")
    gpu, _ = llm.engine.pool.snapshot()
    assert set(expected) <= set(gpu)
