"""Router prompt path: segment-cached tokenizing and memoised block hashes equal the plain ones; write coalescing."""

from __future__ import annotations

import asyncio
import random

import pytest

from warmfleet.server.hashing import MMPlaceholder, block_hashes, model_fingerprint
from warmfleet.server.router.core.prompt import BoundedMemo, HashConfig, HashMemo, Prompt, PromptRenderer, \
    SegmentEncoder, prompt_block_hashes
from warmfleet.server.router.http.transport import CoalescingTransport
from warmfleet.server.tokenizer import Tokenizer


def conversations(seed: int, n: int) -> list[list[dict]]:
    rng = random.Random(seed)
    words = ["cache", "block", " spaced  out ", "ü-umlaut", "emoji 🙂", "\n\nnew para", "tab\there", "<|im_end|>x",
             "<|im_start|>", "a", "12345", "don't", "CamelCase", "  "]
    out, hist = [], [{"role": "system", "content": "System: " + " ".join(rng.choices(words, k=30))}]
    for _ in range(n):
        hist.append({"role": "user", "content": "".join(rng.choices(words, k=rng.randrange(1, 20)))})
        out.append(list(hist))
        hist.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randrange(0, 8)))})
    return out


def test_segment_encoder_equals_plain_encode(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    seg = SegmentEncoder.for_tokenizer(tok)
    assert seg is not None
    renderer = PromptRenderer(str(tiny_model_dir), tokenizer=tok)
    for seed in range(3):
        for msgs in conversations(seed, 12):
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
            assert seg.encode(text) == tok.encode(text, add_special_tokens=False)
            assert renderer.chat({"messages": msgs}).token_ids == tok.encode(text, add_special_tokens=False)
    assert seg.memo.hits > 0  # earlier turns were reused


@pytest.mark.parametrize("model", ["tiny_model_dir", "bos_model_dir"])
def test_completion_prompts_through_the_segment_memo_equal_plain_encode(model, request):
    model_dir = request.getfixturevalue(model)
    tok = Tokenizer(model_dir)
    renderer = PromptRenderer(str(model_dir), tokenizer=tok)
    before, after = renderer._completion_wrap
    assert before == ([tok.token_to_id("<|endoftext|>")] if model == "bos_model_dir" else []) and after == []
    texts = ["".join(m["content"] for m in msgs) for msgs in conversations(5, 8)]
    for text in texts + texts:  # the second pass is served by the memo
        assert renderer.completion({"prompt": text}).token_ids == tok.encode(text, add_special_tokens=True)
    assert renderer.segments.memo.hits >= len(texts)


def test_bounded_memo_keeps_its_character_budget():
    memo = BoundedMemo(capacity=100, budget=10)
    for key in ("aaaa", "bbbb", "cc"):
        memo.put(key, key.upper())
    assert memo.used == 10 and memo.get("aaaa") == "AAAA"
    memo.put("ddd", "DDD")  # evicts the oldest until it fits
    assert memo.get("aaaa") is None and memo.get("ddd") == "DDD" and memo.used == 9
    memo.put("x" * 11, "too big")  # over the whole budget: not kept, nothing evicted
    assert memo.get("x" * 11) is None and memo.used == 9 and len(memo.data) == 3


def test_segment_encoder_refuses_tokenizers_it_cannot_split():
    class Plain:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    assert SegmentEncoder.for_tokenizer(Plain()) is None


def test_hash_memo_equals_block_hashes(tiny_model_dir):
    cfg = HashConfig(16, model_fingerprint(tiny_model_dir))
    memo = HashMemo(capacity=64)  # small: eviction must not change results
    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(300)]
    for i in range(40):
        ids = base[: rng.randrange(0, 300)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
        mm = [MMPlaceholder("img-a", 20, 40)] if i % 3 == 0 and len(ids) > 60 else []
        salt = None if i % 2 else "tenant"
        want = block_hashes(ids, mm, 16, cfg.model_fingerprint, cache_salt=salt)
        assert prompt_block_hashes(Prompt(ids, mm, len(ids)), salt, cfg, memo) == want
    assert memo.memo.hits > 0


class _Sink:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data):
        self.writes.append(bytes(data))

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


async def test_coalescing_transport_joins_one_tick_and_flushes_on_close():
    sink = _Sink()
    t = CoalescingTransport(sink)
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"body")
    assert sink.writes == []  # held only until the end of this tick
    await asyncio.sleep(0)
    assert sink.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    t.write(b"data: 1\n\n")
    await asyncio.sleep(0)
    t.write(b"data: 2\n\n")
    t.close()  # pending bytes go out before the close
    assert sink.writes[1:] == [b"data: 1\n\n", b"data: 2\n\n"] and sink.closed
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_router_protocol_parses_with_httptools_and_coalesces_writes():
    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from warmfleet.server.router.http.app import Frontend
    from warmfleet.server.router.http.hotpath import hot_protocol

    cls = hot_protocol(Frontend.__new__(Frontend))
    assert issubclass(cls, HttpToolsProtocol)
    config = Config(app=lambda scope, receive, send: None)
    config.load()
    proto = cls(config=config, server_state=ServerState(), app_state={})
    sink = _Sink()
    proto.connection_made(sink)
    assert isinstance(proto.transport, CoalescingTransport)
    proto.transport.write(b"a")
    proto.transport.write(b"b")
    await asyncio.sleep(0)
    assert sink.writes == [b"ab"]
