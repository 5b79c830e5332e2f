"""HTTP API against FakeEngine: OpenAI shapes, every error case, SSE streaming, n>1, stop strings, disconnects, tokenize, metrics, images."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from fakes import ENCODER_CACHE_STATS, FakeEngine
from warmfleet.server.multimodal import wire
from warmfleet.server.api.app import REPLICA_HEADER, attach_engine, build_app
from warmfleet.server.config import EngineConfig
from warmfleet.server.tokenizer import Tokenizer
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part

REPLY = "Hello there, how are you?"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def make_cfg(model_dir, **server) -> EngineConfig:
    cfg = EngineConfig()
    cfg.model.model = str(model_dir)
    cfg.model.served_model_name = "tiny"
    cfg.server.replica_id = "replica-a"
    for k, v in server.items():
        setattr(cfg.server, k, v)
    return cfg


@pytest.fixture
def engine(tok, tiny_model_dir) -> FakeEngine:
    return FakeEngine(tok, tiny_model_dir, reply=REPLY)


@pytest.fixture
def app(engine, tok, tiny_model_dir):
    return build_app(engine, tok, make_cfg(tiny_model_dir))


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        yield c


def chat_body(**kw: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body strictly: every event is one `data: ...` line followed by a blank line."""
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- happy paths --------------------------------------------------------------------------------
async def test_chat_completion_shape_usage_and_replica_header(client, engine, tok):
    r = await client.post(CHAT, json=chat_body())
    assert r.status_code == 200
    assert r.headers[REPLICA_HEADER] == "replica-a"
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None,
                      "finish_reason": "stop"}
    prompt_ids = engine.requests[0].prompt_token_ids
    assert prompt_ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(tok.encode(REPLY)) + 1  # + EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert engine.aborted == []  # finished by the engine: nothing to abort


async def test_sampling_fields_reach_the_engine(client, engine):
    r = await client.post(CHAT, json=chat_body(temperature=0.5, top_p=0.9, top_k=7, seed=11, max_completion_tokens=3,
                                               stop_token_ids=[5], cache_salt="tenant-a"))
    assert r.status_code == 200
    req = engine.requests[0]
    sp = req.sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens, sp.stop_token_ids, sp.n) == (0.5, 0.9, 7, 11, 3, [5], 1)
    assert req.cache_salt == "tenant-a"
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_defaults_to_the_rest_of_the_context(client, engine):
    await client.post(CHAT, json=chat_body())
    req = engine.requests[0]
    assert req.sampling_params.max_tokens == engine.model_info.max_model_len - len(req.prompt_token_ids)


async def test_models_lists_the_served_model(client, engine):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["max_model_len"] == engine.model_info.max_model_len


async def test_kv_snapshot_is_the_engines(client):
    r = await client.get("/v1/kv/snapshot")
    assert r.status_code == 200
    assert r.json()["gpu"] == ["01" * 32] and r.json()["replica_id"] == "fake-replica"


async def test_cached_tokens_reported_for_a_repeated_prefix_and_isolated_by_salt(client, engine):
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    first = await client.post(CHAT, json=chat_body(messages=[system, {"role": "user", "content": "one"}]))
    again = await client.post(CHAT, json=chat_body(messages=[system, {"role": "user", "content": "two"}]))
    salted = await client.post(CHAT, json=chat_body(messages=[system, {"role": "user", "content": "two"}], cache_salt="t2"))
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % engine.model_info.block_size == 0
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_chat_logprobs(client):
    r = await client.post(CHAT, json=chat_body(logprobs=True, top_logprobs=2, max_tokens=3))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} for c in content)
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == r.json()["choices"][0]["message"]["content"]


async def test_n_choices_with_seed_offsets(client, engine, tok):
    r = await client.post(CHAT, json=chat_body(n=3, seed=5))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [f"{REPLY} #5", f"{REPLY} #6", f"{REPLY} #7"]
    assert sorted(q.sampling_params.seed for q in engine.requests) == [5, 6, 7]
    assert all(q.sampling_params.n == 1 for q in engine.requests)
    prompt_len = len(engine.requests[0].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == prompt_len  # the prompt counts once
    assert body["usage"]["completion_tokens"] == sum(len(tok.encode(c["message"]["content"])) + 1 for c in body["choices"])


async def test_stop_string_across_tokens_truncates_and_aborts(client, engine, tok):
    stop = "there, how"
    assert len(tok.encode(stop)) > 1
    r = await client.post(CHAT, json=chat_body(stop=stop))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello " and choice["finish_reason"] == "stop"
    assert engine.aborted == [engine.requests[0].request_id]  # the engine never saw the stop string


async def test_stop_list_in_completions(client, engine):
    r = await client.post(COMPLETIONS, json={"model": "tiny", "prompt": "x", "stop": ["zzz", "how"], "max_tokens": 50})
    assert r.json()["choices"][0]["text"] == "Hello there, " and r.json()["choices"][0]["finish_reason"] == "stop"


# ---- completions --------------------------------------------------------------------------------
async def test_completion_prompt_forms(client, engine, tok):
    r = await client.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == tok.decode(tok.encode(REPLY)[:2]) and body["choices"][0]["finish_reason"] == "length"
    assert engine.requests[-1].prompt_token_ids == tok.encode("Hello", add_special_tokens=True)

    r = await client.post(COMPLETIONS, json={"prompt": ["a b", "c d e"], "max_tokens": 2, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(tok.encode("a b")) + len(tok.encode("c d e"))

    r = await client.post(COMPLETIONS, json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert r.status_code == 200 and engine.requests[-1].prompt_token_ids == [1, 2, 3]
    r = await client.post(COMPLETIONS, json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert len(r.json()["choices"]) == 2 and engine.requests[-1].prompt_token_ids == [3]


async def test_completion_default_max_tokens_is_16_and_shrinks_to_fit(client, engine, tok):
    await client.post(COMPLETIONS, json={"prompt": "Hello"})
    assert engine.requests[-1].sampling_params.max_tokens == 16
    ids = list(range(1, engine.model_info.max_model_len - 3))
    r = await client.post(COMPLETIONS, json={"prompt": ids})
    assert r.status_code == 200 and engine.requests[-1].sampling_params.max_tokens == 4


async def test_completion_echo_and_logprobs(client, tok):
    r = await client.post(COMPLETIONS, json={"prompt": "Say:", "echo": True, "max_tokens": 2})
    assert r.json()["choices"][0]["text"].startswith("Say:")
    ids = tok.encode("Say:", add_special_tokens=False)
    r = await client.post(COMPLETIONS, json={"prompt": [ids, ids], "echo": True, "max_tokens": 2})
    assert [c["text"][:4] for c in r.json()["choices"]] == ["Say:", "Say:"]  # token-id prompts echo their text
    r = await client.post(COMPLETIONS, json={"prompt": [ids, ids], "max_tokens": 2})
    assert not any(c["text"].startswith("Say:") for c in r.json()["choices"])
    r = await client.post(COMPLETIONS, json={"prompt": "Say:", "logprobs": 2, "max_tokens": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


async def test_completion_streaming(client):
    r = await client.post(COMPLETIONS, json={"prompt": "Hi", "stream": True, "max_tokens": 4,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


# ---- streaming ----------------------------------------------------------------------------------
async def test_chat_streaming_framing_and_usage(client):
    r = await client.post(CHAT, json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert all(c["usage"] is None for c in body_chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body_chunks) == REPLY
    assert body_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in body_chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] > 0


async def test_chat_streaming_without_usage_has_no_usage_key(client):
    r = await client.post(CHAT, json=chat_body(stream=True))
    chunks = sse_events(r.text)[:-1]
    assert all("usage" not in c for c in chunks)


async def test_chat_streaming_n_choices_each_finish(client):
    r = await client.post(CHAT, json=chat_body(stream=True, n=2, seed=1))
    chunks = sse_events(r.text)[:-1]
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        (ch,) = c["choices"]
        texts[ch["index"]] += ch["delta"].get("content", "")
        if ch["finish_reason"]:
            finished.add(ch["index"])
    assert texts == {0: f"{REPLY} #1", 1: f"{REPLY} #2"} and finished == {0, 1}


async def test_streaming_stop_string_never_leaks(client, engine):
    r = await client.post(CHAT, json=chat_body(stream=True, stop=["there, how"]))
    chunks = sse_events(r.text)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello "
    assert engine.aborted == [engine.requests[0].request_id]


async def test_engine_error_mid_stream_is_an_error_event_then_done(client, engine):
    engine.error = "engine step failed: boom"
    r = await client.post(CHAT, json=chat_body(stream=True))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "boom" in events[-2]["error"]["message"] and events[-2]["error"]["code"] == "engine_error"


async def test_stream_sends_nothing_before_the_engine_answers(client, engine):
    """The role chunk rides with the first engine output: an engine that fails first leaves only the error."""
    engine.raises = RuntimeError("engine process died")
    r = await client.post(CHAT, json=chat_body(stream=True))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and len(events) == 2
    assert "engine process died" in events[0]["error"]["message"]


async def test_engine_error_non_streaming_is_json(client, engine):
    engine.error = "engine step failed: boom"
    err = assert_error(await client.post(CHAT, json=chat_body()), 500, code="engine_error")
    assert "boom" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_dead_engine_is_reported_not_hung(client, engine, stream):
    engine.raises = RuntimeError("engine process exited with code -9")
    r = await client.post(CHAT, json=chat_body(stream=stream))
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "exited" in events[-2]["error"]["message"]
    else:
        assert "exited" in assert_error(r, 500, code="engine_error")["message"]
    assert_error(await client.get("/v1/kv/snapshot"), 503, code="engine_unavailable")


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{bad json", b"", b"[1, 2]", b"\xff\xfe", b"[" * 100000])
async def test_malformed_body_is_400(client, content):
    r = await client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(n="many"), "n"),
    (chat_body(seed=-1), "seed"),
    (chat_body(top_k=-5), "top_k"),
    (chat_body(stream_options={"include_usage": "yes please"}), "stream_options.include_usage"),
])
async def test_validation_errors_are_400_not_422(client, body, param):
    assert_error(await client.post(CHAT, json=body), 400, param=param)


async def test_unknown_model_is_404(client):
    err = assert_error(await client.post(CHAT, json=chat_body(model="gpt-9")), 404, code="model_not_found", param="model")
    assert "gpt-9" in err["message"]
    assert_error(await client.post(COMPLETIONS, json={"model": "nope", "prompt": "x"}), 404, code="model_not_found")


async def test_empty_messages_is_400(client):
    assert_error(await client.post(CHAT, json=chat_body(messages=[])), 400, param="messages")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -3])
async def test_max_tokens_below_one_is_400(client, field, value):
    assert_error(await client.post(CHAT, json=chat_body(**{field: value})), 400, param=field)


async def test_max_tokens_below_one_in_completions_is_400(client):
    assert_error(await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 0}), 400, param="max_tokens")


async def test_prompt_longer_than_context_names_both_numbers(client, engine):
    limit = engine.model_info.max_model_len
    ids = [7] * (limit + 5)
    err = assert_error(await client.post(COMPLETIONS, json={"prompt": ids}), 400, code="context_length_exceeded")
    assert str(limit) in err["message"] and str(limit + 5) in err["message"]
    long_text = "word " * limit
    err = assert_error(await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": long_text}])),
                       400, code="context_length_exceeded")
    assert str(limit) in err["message"]


async def test_prompt_plus_max_tokens_over_context_is_400(client, engine):
    limit = engine.model_info.max_model_len
    err = assert_error(await client.post(COMPLETIONS, json={"prompt": [7] * 10, "max_tokens": limit}), 400,
                       code="context_length_exceeded", param="max_tokens")
    assert str(limit) in err["message"] and str(limit + 10) in err["message"]


async def test_kv_pool_smaller_than_context_limits_requests(tok, tiny_model_dir):
    engine = FakeEngine(tok, tiny_model_dir, max_model_len=4096, block_size=16, gpu_blocks=8)  # holds 128 tokens
    app = build_app(engine, tok, make_cfg(tiny_model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        err = assert_error(await c.post(COMPLETIONS, json={"prompt": [7] * 200}), 400, code="context_length_exceeded")
    assert "128" in err["message"] and "200" in err["message"]


@pytest.mark.parametrize("body, param", [
    (chat_body(presence_penalty=0.5), "presence_penalty"),
    (chat_body(frequency_penalty=1), "frequency_penalty"),
    (chat_body(logit_bias={"5": 10}), "logit_bias"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat_body(response_format={"type": "json_object"}), "response_format"),
    (chat_body(top_logprobs=3), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat_body(stream_options={"include_usage": True}), "stream_options"),
    (chat_body(stop_token_ids=[10 ** 6]), "stop_token_ids"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
     "messages.0.content.0"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]),
     "messages.0.content"),
])
async def test_unsupported_values_are_400(client, engine, body, param):
    assert_error(await client.post(CHAT, json=body), 400, param=param)
    assert engine.requests == []


@pytest.mark.parametrize("body", [
    chat_body(n=17), chat_body(n=0), chat_body(temperature=2.5), chat_body(top_p=0), chat_body(stop=["s"] * 9),
    chat_body(temperature=float("nan")),
])
async def test_out_of_range_sampling_values_are_400(client, engine, body):
    r = await client.post(CHAT, content=json.dumps(body), headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert engine.requests == []


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10 ** 6]}, "prompt"),
    ({"prompt": [-1]}, None),
    ({"prompt": "x", "logprobs": 50}, None),
])
async def test_completion_errors_are_400(client, engine, body, param):
    assert_error(await client.post(COMPLETIONS, json=body), 400, param=param)
    assert engine.requests == []


async def test_unknown_route_and_method_are_openai_shaped(client):
    assert_error(await client.get("/v1/nope"), 404)
    assert_error(await client.get(CHAT), 405)


async def test_chat_template_rejection_is_400(client, tok, tiny_model_dir):
    # a template that raises for a conversation it cannot render
    tok2 = Tokenizer(tiny_model_dir)
    tok2.chat_template = "{{ raise_exception('roles must alternate') }}"
    engine = FakeEngine(tok2, tiny_model_dir)
    app = build_app(engine, tok2, make_cfg(tiny_model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        err = assert_error(await c.post(CHAT, json=chat_body()), 400, param="messages")
    assert "roles must alternate" in err["message"]


# ---- auth ---------------------------------------------------------------------------------------
async def test_api_key_guards_v1_but_not_probes(engine, tok, tiny_model_dir):
    app = build_app(engine, tok, make_cfg(tiny_model_dir, api_key="sekret"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert_error(await c.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(await c.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(await c.post("/tokenize", json={"prompt": "x"}), 401)
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert (await c.get(path)).status_code == 200
    assert engine.requests == []


# ---- tokenize -----------------------------------------------------------------------------------
async def test_tokenize_prompt_and_messages(client, engine, tok):
    r = await client.post("/tokenize", json={"prompt": "Hello world"})
    assert r.json() == {"count": len(tok.encode("Hello world", add_special_tokens=True)),
                        "max_model_len": engine.model_info.max_model_len,
                        "tokens": tok.encode("Hello world", add_special_tokens=True)}
    msgs = [{"role": "user", "content": "hi"}]
    r = await client.post("/tokenize", json={"model": "tiny", "messages": msgs})
    await client.post(CHAT, json=chat_body(messages=msgs))
    assert r.json()["tokens"] == engine.requests[0].prompt_token_ids  # what /tokenize says is what the engine gets
    assert r.json()["count"] == len(r.json()["tokens"])


async def test_detokenize_round_trips(client, tok):
    ids = tok.encode("héllo wörld")
    r = await client.post("/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": "héllo wörld"}


@pytest.mark.parametrize("path, body, status", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/tokenize", {}, 400),
    ("/tokenize", {"messages": []}, 400),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404),
    ("/detokenize", {"tokens": [10 ** 6]}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
])
async def test_tokenize_errors(client, path, body, status):
    assert_error(await client.post(path, json=body), status)


# ---- probes and metrics -------------------------------------------------------------------------
async def test_ready_only_after_engine_attached(engine, tok, tiny_model_dir):
    app = build_app(None, None, make_cfg(tiny_model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).status_code == 503
        assert_error(await c.post(CHAT, json=chat_body()), 503, code="model_loading")
        assert (await c.get("/metrics")).status_code == 200
        attach_engine(app, engine, tok)
        assert (await c.get("/ready")).status_code == 200
        assert (await c.post(CHAT, json=chat_body())).status_code == 200
        engine.healthy = False
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/ready")).status_code == 503


async def test_metrics_engine_gauges_and_request_counters(client, tok):
    await client.post(CHAT, json=chat_body())
    await client.post(CHAT, json=chat_body(max_tokens=2))
    await client.post(CHAT, json=chat_body(model="nope"))
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    assert samples[("vllm:num_requests_running", ())] == 1
    assert samples[("vllm:num_requests_waiting", ())] == 2
    assert samples[("vllm:kv_cache_usage_perc", ())] == 0.75
    assert samples[("warmfleet:kv_cache_usage_perc", (("tier", "cpu"),))] == pytest.approx(0.1)
    assert samples[("vllm:prefix_cache_queries_total", ())] == 1000
    assert samples[("vllm:prefix_cache_hits_total", ())] == 700
    assert samples[("warmfleet:prefix_cache_hits_total", (("tier", "cpu"),))] == 100
    assert samples[("warmfleet:swap_in_blocks_total", ())] == 3
    assert samples[("warmfleet:swap_out_blocks_total", ())] == 7
    assert samples[("vllm:num_preemptions_total", ())] == 2
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert samples[("vllm:generation_tokens_total", ())] == len(tok.encode(REPLY)) + 1 + 2
    assert samples[("vllm:prompt_tokens_total", ())] > 0
    assert samples[("vllm:time_to_first_token_seconds_count", ())] == 2
    assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 2
    assert samples[("vllm:inter_token_latency_seconds_count", ())] > 0
    assert samples[("warmfleet:request_errors_total", (("status", "404"),))] == 1
    # GIE's optional BlockSize / NumGPUBlocks, in vLLM's info-gauge form (labels are integers as text)
    info = {(k, v) for (name, labels), value in samples.items() if name == "vllm:cache_config_info" and value == 1
            for k, v in labels}
    assert {("block_size", "16"), ("num_gpu_blocks", "1024"), ("num_cpu_blocks", "100"), ("engine", "0")} <= info


def test_cache_config_info_absent_until_the_engine_has_loaded():
    from warmfleet.server.api.metrics import CacheConfigInfo, Metrics
    from warmfleet.server.engine.protocol import EngineStats

    m = Metrics("tiny")
    stats = EngineStats(gpu_blocks_total=10, gpu_blocks_free=10)
    assert b"vllm:cache_config_info" not in m.render(stats)
    m.set_cache_config(CacheConfigInfo(block_size=64, enable_prefix_caching=False))
    fams = {f.name: f for f in text_string_to_metric_families(m.render(stats).decode())}
    (sample,) = fams["vllm:cache_config_info"].samples
    assert fams["vllm:cache_config_info"].type == "gauge" and sample.value == 1
    assert sample.labels == {"block_size": "64", "num_gpu_blocks": "10", "num_cpu_blocks": "0",
                             "enable_prefix_caching": "False", "engine": "0"}
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0.0  # all blocks free: idle server


# ---- disconnects --------------------------------------------------------------------------------
async def call_until_hanging(app, engine: FakeEngine, path: str, body: dict) -> list[dict]:
    """Drive the ASGI app directly; the client disconnects once the engine has started generating."""
    sent: list[dict] = []
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await engine.hanging.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 5000), "server": ("test", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=30)  # a hang fails the test instead of blocking it
    return sent


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
async def test_client_disconnect_aborts_engine_requests(app, engine, stream, n):
    engine.hang_after = 2
    await call_until_hanging(app, engine, CHAT, chat_body(stream=stream, n=n))
    ids = sorted(q.request_id for q in engine.requests)
    assert len(ids) == n
    assert sorted(set(engine.aborted)) == ids
    assert sorted(engine.closed) == ids  # the engine streams were closed too, not left running


async def test_client_disconnect_during_completion_aborts(app, engine):
    engine.hang_after = 1
    await call_until_hanging(app, engine, COMPLETIONS, {"prompt": "x", "max_tokens": 50})
    assert set(engine.aborted) == {engine.requests[0].request_id}


# ---- the official client ------------------------------------------------------------------------
async def test_openai_client_chat_streaming_and_completions(app):
    import openai

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")
    client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)
    try:
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_completion_tokens=50)
        assert chat.choices[0].message.content == REPLY and chat.choices[0].finish_reason == "stop"
        assert chat.usage.prompt_tokens_details.cached_tokens == 0

        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert text == REPLY and usage is not None and usage.completion_tokens > 0

        comp = await client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert comp.choices[0].finish_reason == "length"

        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="tiny", messages=[])
        assert exc.value.body["param"] == "messages"
    finally:
        await client.close()
        await http.aclose()


# ---- images (Qwen2-VL-like FakeEngine) ----------------------------------------------------------
@pytest.fixture(scope="module")
def vl_tok(tiny_vl_dir) -> Tokenizer:
    return Tokenizer(tiny_vl_dir)


@pytest.fixture
def vl_engine(vl_tok, tiny_vl_dir) -> FakeEngine:
    return FakeEngine(vl_tok, tiny_vl_dir, reply=REPLY, multimodal=True, max_model_len=2048)


def vl_app_for(vl_engine, vl_tok, tiny_vl_dir, **server):
    return build_app(vl_engine, vl_tok, make_cfg(tiny_vl_dir, **server))


@pytest.fixture
async def vl_client(vl_engine, vl_tok, tiny_vl_dir):
    app = vl_app_for(vl_engine, vl_tok, tiny_vl_dir)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        c.app = app
        yield c


def image_chat(*parts: dict, text: str = "What is in the picture?", **kw) -> dict:
    return chat_body(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], **kw)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


async def test_image_request_reaches_engine_with_placeholders_and_pixels(vl_client, vl_engine, vl_tok):
    r = await vl_client.post(CHAT, json=image_chat(image_part(data_uri(image_bytes()))))
    assert r.status_code == 200, r.text
    (req,) = vl_engine.requests
    (ph,) = req.mm_placeholders
    pad = vl_tok.token_to_id("<|image_pad|>")
    ids = req.prompt_token_ids
    assert ph.length == 4  # 64x48 → 56x56 pixels → 4x4 patches → 2x2 merged tokens
    assert ids[ph.offset:ph.offset + ph.length] == [pad] * 4 and ids.count(pad) == 4
    assert ids[ph.offset - 1] == vl_tok.token_to_id("<|vision_start|>")
    (img,) = [wire.from_msgpack(d) for d in req.mm_inputs]
    assert img.grid_thw == (1, 4, 4) and img.pixel_values.shape[0] == 16
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "image_tokens": 4}
    assert r.json()["choices"][0]["message"]["content"] == REPLY


async def test_text_only_request_to_a_vl_model_builds_no_image_pipeline(vl_client, vl_engine):
    r = await vl_client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]))
    assert r.status_code == 200
    assert vl_client.app.state.wf._image_preparer is None
    assert vl_engine.requests[0].mm_placeholders == [] and vl_engine.requests[0].mm_inputs == []
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "image_tokens": 0}


async def test_two_images_in_order_and_n_samples_share_them(vl_client, vl_engine):
    a, b = data_uri(image_bytes(seed=1)), data_uri(image_bytes(w=120, h=60, seed=2, fmt="JPEG"), "image/jpeg")
    r = await vl_client.post(CHAT, json=image_chat(image_part(a), image_part(b), n=2, seed=1))
    assert r.status_code == 200, r.text
    r0, r1 = vl_engine.requests
    assert r0.mm_placeholders == r1.mm_placeholders and len(r0.mm_placeholders) == 2
    first, second = r0.mm_placeholders
    assert first.offset + first.length < second.offset and first.mm_hash != second.mm_hash
    grids = [wire.from_msgpack(d).grid_thw for d in r0.mm_inputs]
    assert grids[0] == (1, 4, 4) and grids[1][1:] != (4, 4)
    assert r.json()["usage"]["prompt_tokens_details"]["image_tokens"] == first.length + second.length


async def test_image_streaming_reports_image_tokens(vl_client):
    body = image_chat(image_part(data_uri(image_bytes())), stream=True, stream_options={"include_usage": True})
    r = await vl_client.post(CHAT, json=body)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"]) == REPLY
    assert events[-2]["usage"]["prompt_tokens_details"]["image_tokens"] == 4


def _bomb_png() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buf, "PNG")  # 81 Mpx (over the 64 Mpx cap) in a few kB
    return buf.getvalue()


@pytest.mark.parametrize("part, code, words", [
    (image_part("data:image/png;base64,@@not base64@@"), "invalid_image", "invalid base64"),
    (image_part(data_uri(b"these bytes are no picture")), "invalid_image", "not a supported image"),
    (image_part(data_uri(image_bytes()[:200])), "invalid_image", "truncated"),
    (image_part(data_uri(_bomb_png())), "invalid_image", "more than the limit"),
    (image_part("data:text/plain;base64,aGk="), "invalid_image", "expected image/*"),
    (image_part("http://127.0.0.1:9/cat.png"), "invalid_image", "non-public address"),
    (image_part("http://169.254.169.254/latest/meta-data"), "invalid_image", "non-public address"),
    (image_part("http://[::1]:9/cat.png"), "invalid_image", "non-public address"),
    (image_part("file:///etc/passwd"), "invalid_image", "--allowed-local-media-path"),
    (image_part("ftp://example.com/cat.png"), "invalid_image", "unsupported image URL scheme"),
    (image_part(uuid="never-sent"), "unknown_image", "unknown image uuid 'never-sent'"),
    (image_part(), "invalid_image", "needs image_url.url or a uuid"),
    (image_part(data_uri(image_bytes()), uuid=""), "invalid_image", "uuid"),
])
async def test_bad_images_are_400s_naming_the_part(vl_client, vl_engine, part, code, words):
    body = chat_body(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "look:"}, part]},
    ])
    err = assert_error(await vl_client.post(CHAT, json=body), 400, code=code, param="messages.1.content.1")
    assert err["message"].startswith("messages[1].content[1]: ") and words in err["message"], err
    assert vl_engine.requests == []


async def test_video_parts_and_handwritten_placeholders_are_400s(vl_client, vl_engine, vl_tok):
    video = chat_body(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}])
    assert_error(await vl_client.post(CHAT, json=video), 400, param="messages.0.content")
    pads = chat_body(messages=[{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>hi"}])
    assert_error(await vl_client.post(CHAT, json=pads), 400, code="invalid_value", param="messages")
    extra = image_chat(image_part(data_uri(image_bytes())), text="and <|image_pad|> here")
    assert_error(await vl_client.post(CHAT, json=extra), 400, code="invalid_messages", param="messages")
    pad = vl_tok.token_to_id("<|image_pad|>")
    assert_error(await vl_client.post(COMPLETIONS, json={"prompt": [1, pad, 2]}), 400, param="prompt")
    assert vl_engine.requests == []


async def test_image_to_a_text_only_model_is_400(client, engine):
    body = image_chat(image_part(data_uri(image_bytes())))
    err = assert_error(await client.post(CHAT, json=body), 400, code="unsupported_value", param="messages.0.content.0")
    assert "does not accept images" in err["message"] and err["message"].startswith("messages[0].content[0]: ")
    assert engine.requests == []


async def test_file_urls_only_under_the_allowed_directory(vl_engine, vl_tok, tiny_vl_dir, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(image_bytes())
    (tmp_path / "secret.png").write_bytes(image_bytes())
    app = vl_app_for(vl_engine, vl_tok, tiny_vl_dir, allowed_local_media_path=str(media))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        ok = await c.post(CHAT, json=image_chat(image_part((media / "cat.png").as_uri())))
        assert ok.status_code == 200, ok.text
        escape = image_part(f"file://{media}/../secret.png")
        err = assert_error(await c.post(CHAT, json=image_chat(escape)), 400, code="invalid_image")
        assert "outside the allowed media directory" in err["message"]
    assert len(vl_engine.requests) == 1


async def test_tokenize_expands_image_pads(vl_client, vl_tok):
    body = {"messages": image_chat(image_part(data_uri(image_bytes())))["messages"]}
    r = await vl_client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"].count(vl_tok.token_to_id("<|image_pad|>")) == 4


async def test_image_and_encoder_cache_metrics(vl_client):
    assert (await vl_client.post(CHAT, json=image_chat(image_part(data_uri(image_bytes()))))).status_code == 200
    text = (await vl_client.get("/metrics")).text
    assert metric_value(text, "warmfleet:image_tokens_total") == 4
    assert metric_value(text, "warmfleet:request_images_total") == 1
    assert metric_value(text, "warmfleet:image_hash_seconds_count") == 1
    assert metric_value(text, "warmfleet:image_prepare_seconds_count") == 1
    for name, value in ENCODER_CACHE_STATS.items():
        suffix = "_total" if name.split("_")[-1] in ("hits", "misses", "evictions") else ""
        assert metric_value(text, f"warmfleet:{name}{suffix}") == value, name
    assert metric_value(text, "warmfleet:processor_cache_up") is None  # no processor cache in this app


async def test_encoder_cache_series_are_zero_when_the_engine_has_none(client):
    text = (await client.get("/metrics")).text
    assert metric_value(text, "warmfleet:encoder_cache_hits_total") == 0
    assert metric_value(text, "warmfleet:encoder_cache_budget_tokens") == 0


@pytest.fixture
def processor_cache(tmp_path):
    from warmfleet.server.multimodal.processor_cache import ProcessorCacheProcess

    proc = ProcessorCacheProcess(f"ipc://{tmp_path}/pc.sock", capacity_bytes=64 << 20).start()
    yield proc
    proc.stop()


async def test_processor_cache_hits_uuid_reuse_metrics_and_fallback(vl_engine, vl_tok, tiny_vl_dir, processor_cache):
    import os
    import signal

    app = vl_app_for(vl_engine, vl_tok, tiny_vl_dir)
    state = app.state.wf
    state.connect_processor_cache(processor_cache.address, timeout_s=10.0)  # exact counts even on a busy machine
    state.processor_cache_process = processor_cache
    assert state.processor_cache.ping(timeout_s=30.0)
    uri = data_uri(image_bytes(seed=7))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        for _ in range(2):
            assert (await c.post(CHAT, json=image_chat(image_part(uri)))).status_code == 200
        with_uuid = await c.post(CHAT, json=image_chat(image_part(uri, uuid="cat-1")))
        only_uuid = await c.post(CHAT, json=image_chat(image_part(uuid="cat-1")))
        assert with_uuid.status_code == 200 and only_uuid.status_code == 200, only_uuid.text
        r_plain, _, r_uuid, r_only = vl_engine.requests
        assert r_only.prompt_token_ids == r_uuid.prompt_token_ids
        assert r_only.mm_placeholders == r_uuid.mm_placeholders and r_uuid.mm_placeholders[0].mm_hash == "uuid:cat-1"
        assert r_only.mm_inputs == r_uuid.mm_inputs == r_plain.mm_inputs  # the same pixels, from the cache
        assert r_plain.mm_placeholders[0].mm_hash != "uuid:cat-1"
        text = (await c.get("/metrics")).text
        assert metric_value(text, "warmfleet:processor_cache_up") == 1
        assert metric_value(text, "warmfleet:processor_cache_hits_total") == 2  # repeat by bytes, uuid-only
        assert metric_value(text, "warmfleet:processor_cache_lookups_total", result="hit") == 2
        assert metric_value(text, "warmfleet:processor_cache_entries") == 2  # by digest and by uuid
        assert metric_value(text, "warmfleet:processor_cache_usage_bytes") > 0
        assert metric_value(text, "warmfleet:processor_cache_capacity_bytes") == 64 << 20

        os.kill(processor_cache.process.pid, signal.SIGKILL)  # the cache dies: requests still work
        processor_cache.process.wait()
        r = await c.post(CHAT, json=image_chat(image_part(data_uri(image_bytes(seed=8)))))
        assert r.status_code == 200, r.text
        assert wire.from_msgpack(vl_engine.requests[-1].mm_inputs[0]).grid_thw == (1, 4, 4)
        text = (await c.get("/metrics")).text  # answers even if the cache is still restarting
        assert metric_value(text, "warmfleet:processor_cache_restarts_total") in (0, 1)
    state.close()


async def test_oversized_body_is_413_without_reaching_the_engine(engine, tok, tiny_model_dir):
    app = build_app(engine, tok, make_cfg(tiny_model_dir, max_request_bytes=2000))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        big = chat_body(messages=[{"role": "user", "content": "x" * 5000}])
        assert_error(await c.post("/v1/chat/completions", json=big), 413, "request_too_large")

        async def chunks():  # no content-length: the cap applies while streaming the body in
            for _ in range(10):
                yield b" " * 500
        r = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, "request_too_large")
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    assert len(engine.requests) == 1


async def test_tokenize_prepares_images_under_the_tenants_salt(vl_engine, vl_tok, tiny_vl_dir, tmp_path):
    """/tokenize with images fills the same processor and encoder caches a chat does: under the caller's tenant salt,
    so tokenizing cannot warm (or probe) another tenant's image entries."""
    import json as _json

    from warmfleet.server.router.core.tenants import derive_salt
    from warmfleet.server.tenant_keys import tenant_salt

    keys = tmp_path / "keys.json"
    keys.write_text(_json.dumps({"alice-key": None}))
    app = vl_app_for(vl_engine, vl_tok, tiny_vl_dir, api_key="fleet-key", api_keys_file=str(keys), salt_secret="s")
    preparer = app.state.wf.image_preparer()
    seen, real = [], preparer.prepare_async

    async def spy(messages, cache_salt=None, **kw):
        seen.append(cache_salt)
        return await real(messages, cache_salt, **kw)

    preparer.prepare_async = spy
    msgs = [{"role": "user", "content": [image_part(data_uri(image_bytes())), {"type": "text", "text": "hi"}]}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        for body in ({}, {"cache_salt": "mine"}):
            r = await c.post("/tokenize", headers={"Authorization": "Bearer alice-key"},
                             json={"model": "tiny", "messages": msgs, **body})
            assert r.status_code == 200, r.text
    alice = derive_salt("alice-key", "s")
    assert seen == [tenant_salt(alice, None), tenant_salt(alice, "mine")] and None not in seen
