"""Scheduler: token budget, chunked prefill, preemption and resume, abort frees blocks (no model needed)."""

import pytest

from warmfleet.server.config import SchedulerConfig
from warmfleet.server.engine.block_pool import BlockPool
from warmfleet.server.engine.kv_cache_manager import KVCacheManager
from warmfleet.server.engine.request import Request, RequestStatus
from warmfleet.server.engine.sampling_params import SamplingParams
from warmfleet.server.engine.scheduler import Scheduler

BS = 4


def make(num_blocks=64, budget=16, max_seqs=8, max_len=256):
    pool = BlockPool(num_blocks, 0, True, BS)
    kv = KVCacheManager(pool, BS, "m")
    return Scheduler(SchedulerConfig(budget, max_seqs), kv, max_len), pool


def req(rid, n_prompt, max_tokens=3, start=0):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s, token=7):
    """One scheduling step with a fake model that samples `token` for everyone who samples."""
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    s, _ = make(budget=8)
    r = req("a", 20)
    s.add_request(r)
    out, res = step(s)
    assert out.num_tokens == 8 and res == [] and r.num_computed_tokens == 8
    out, res = step(s)
    assert out.num_tokens == 8 and res == []
    out, res = step(s)
    assert out.num_tokens == 4 and len(res) == 1 and res[0].new_token_ids == [7]
    out, res = step(s)  # decode step: one token
    assert out.num_tokens == 1 and r.num_tokens == 22


def test_decodes_and_prefill_share_one_step():
    s, _ = make(budget=10)
    a = req("a", 4)
    s.add_request(a)
    step(s)
    s.add_request(req("b", 30, start=100))
    out, _ = step(s)
    assert [x.num_tokens for x in out.scheduled] == [1, 9]


def test_finish_by_length_frees_blocks():
    s, pool = make()
    s.add_request(req("a", 6, max_tokens=2))
    outs = []
    while s.has_work:
        outs += step(s)[1]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(pool.ref_cnt) == 0 and pool.num_free_blocks == pool.num_gpu_blocks


def test_preemption_resumes_without_losing_tokens():
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens that each grow to 16 tokens
    s, pool = make(num_blocks=6, budget=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, start=50)
    s.add_request(a)
    s.add_request(b)
    finished = {}
    preempted = 0
    for _ in range(200):
        if not s.has_work:
            break
        out, res = step(s, token=5)
        preempted += out.num_preempted
        for r in res:
            if r.finished:
                finished[r.request_id] = r
    assert preempted >= 1 and s.num_preemptions >= 1
    assert set(finished) == {"a", "b"}
    assert a.output_token_ids == [5] * 8 and b.output_token_ids == [5] * 8
    assert sum(pool.ref_cnt) == 0


def test_abort_frees_blocks_and_reports():
    s, pool = make()
    r = req("a", 10, max_tokens=50)
    s.add_request(r)
    step(s)
    assert pool.num_free_blocks < pool.num_gpu_blocks
    s.abort(["a"])
    out, res = step(s)
    assert res and res[0].finish_reason == "abort" and r.status == RequestStatus.FINISHED_ABORTED
    assert pool.num_free_blocks == pool.num_gpu_blocks and not s.has_work


def test_max_num_seqs_limits_admission():
    s, _ = make(max_seqs=2, budget=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, start=10 * i))
    out, _ = step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_prompt_longer_than_context_is_refused():
    s, _ = make(max_len=16)
    with pytest.raises(ValueError, match="16"):
        s.add_request(req("a", 16))


def test_second_request_reuses_first_ones_blocks():
    s, pool = make()
    s.add_request(req("a", 12, max_tokens=1))
    while s.has_work:
        step(s)
    b = req("b", 14, max_tokens=1)
    s.add_request(b)
    out, _ = step(s)
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_tokens == 2


def test_request_outgrowing_the_pool_ends_with_length_not_a_livelock():
    s, pool = make(num_blocks=3, budget=64)  # 12 tokens of KV in all
    r = req("a", 8, max_tokens=50)
    s.add_request(r)
    outs = []
    for _ in range(30):
        if not s.has_work:
            break
        outs += step(s)[1]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert len(r.output_token_ids) == 5 and not s.has_work  # KV for 8 prompt + 4 outputs fills 12 slots; the 5th is sampled from it
    assert pool.num_free_blocks == 3


def test_prompt_larger_than_the_pool_is_refused():
    s, _ = make(num_blocks=2)
    with pytest.raises(ValueError, match="KV pool holds 8"):
        s.add_request(req("a", 8))
