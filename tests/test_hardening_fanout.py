"""Fan-out limits (issue 40): prompts x n of one request is bounded by --max-choices-per-request, refused before any work."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest

from fakes import FakeEngine
from warmfleet.server.api.app import build_app
from warmfleet.server.config import EngineConfig
from warmfleet.server.tokenizer import Tokenizer


class FakeCountingTokenizer(Tokenizer):
    """The real tokenizer, counting encode calls (a refused request must tokenize nothing)."""

    num_encodes = 0

    def encode(self, *a, **kw):
        type(self).num_encodes += 1
        return super().encode(*a, **kw)


@pytest.fixture
def tok(tiny_model_dir):
    FakeCountingTokenizer.num_encodes = 0
    return FakeCountingTokenizer(tiny_model_dir)


def make_app(tok, model_dir, **scheduler):
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(model_dir), "tiny"
    for k, v in scheduler.items():
        setattr(cfg.scheduler, k, v)
    engine = FakeEngine(tok, model_dir)
    return build_app(engine, tok, cfg), engine


async def post(app, path, body):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=120) as c:
        return await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def assert_refused(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_choices" and err["type"] == "invalid_request_error" and err["param"] == param
    assert "--max-choices-per-request" in err["message"]


async def test_prompts_times_n_over_the_default_limit_is_400_before_tokenizing(tok, tiny_model_dir):
    app, engine = make_app(tok, tiny_model_dir, max_num_seqs=8)  # default limit: 4 x 8 = 32
    r = await post(app, "/v1/completions", {"prompt": ["hello"] * 17, "n": 2, "max_tokens": 1})
    assert_refused(r, "prompt")
    assert "34 completions" in r.json()["error"]["message"]
    assert engine.requests == [] and FakeCountingTokenizer.num_encodes == 0
    r = await post(app, "/v1/completions", {"prompt": ["hello"] * 16, "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 32  # at the limit: served


async def test_chat_n_over_the_limit_is_400(tok, tiny_model_dir):
    app, engine = make_app(tok, tiny_model_dir, max_choices_per_request=3)
    r = await post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 4})
    assert_refused(r, "n")
    assert engine.requests == [] and FakeCountingTokenizer.num_encodes == 0


async def test_a_two_megabyte_fanout_bomb_is_400_with_memory_flat(tok, tiny_model_dir):
    """400,000 prompts x n=16 in a 1.6 MB body: refused with no engine request; Python's allocations while it is
    answered stay far below what 6.4 million choices would take (the body itself is a few MB once parsed)."""
    app, engine = make_app(tok, tiny_model_dir)
    body = {"prompt": ["a"] * 400_000, "n": 16, "max_tokens": 1}
    assert len(json.dumps(body)) > 1_500_000
    tracemalloc.start()
    try:
        r = await post(app, "/v1/completions", body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_refused(r, "prompt")
    assert engine.requests == [] and FakeCountingTokenizer.num_encodes == 0
    assert peak < 256 << 20, f"peak {peak >> 20} MiB"
