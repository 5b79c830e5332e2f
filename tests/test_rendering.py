"""One prompt path: the API, /tokenize, the offline LLM and the router give the same token ids.

A checkpoint whose tokenizer adds a BOS token (as Llama's does) is where paths used to part:
offline `generate` encoded without special tokens while the API added them. Text chat,
completions, images and image uuids are compared across every path.
"""

from __future__ import annotations


import httpx
import pytest

from fakes import FakeEngine
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from warmfleet.server import rendering
from warmfleet.server.api.app import build_app
from warmfleet.server.config import EngineConfig
from warmfleet.server.router.core.prompt import PromptRenderer
from warmfleet.server.tokenizer import Tokenizer

from conftest import BOS


def cfg(model_dir) -> EngineConfig:
    c = EngineConfig()
    c.model.model, c.model.served_model_name = str(model_dir), "tiny"
    return c


async def api_ids(model_dir, path: str, body: dict, multimodal: bool = False) -> tuple[list[int], list[int], list]:
    """(ids the engine got for `body`, ids /tokenize gives for it, image placeholders) through the real API."""
    tok = Tokenizer(model_dir)
    engine = FakeEngine(tok, model_dir, multimodal=multimodal)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(engine, tok, cfg(model_dir))),
                                 base_url="http://t") as c:
        r = await c.post(path, json={"model": "tiny", "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        t = await c.post("/tokenize", json={"model": "tiny", **body})
        assert t.status_code == 200, t.text
    req = engine.requests[-1]
    return list(req.prompt_token_ids), t.json()["tokens"], list(req.mm_placeholders)


def offline_ids(model_dir, kind: str, arg) -> list[int]:
    from warmfleet.server.offline import LLM
    from warmfleet.server.engine.sampling_params import SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory=0.02, block_size=16)
    sp = SamplingParams(max_tokens=1)
    out = llm.generate(arg, sp) if kind == "completion" else llm.chat(arg, sp)
    return out[0].prompt_token_ids


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a KV cache?"}]


async def test_text_chat_and_completion_agree_everywhere(bos_model_dir):
    tok = Tokenizer(bos_model_dir)
    bos = tok.token_to_id(BOS)
    router = PromptRenderer(str(bos_model_dir))
    # completion: BOS added once, on every path
    engine, tokenize, _ = await api_ids(bos_model_dir, "/v1/completions", {"prompt": "hello world"})
    assert engine[0] == bos and engine[1] != bos
    assert engine == tokenize == router.completion({"prompt": "hello world"}).token_ids
    assert engine == offline_ids(bos_model_dir, "completion", "hello world")
    assert engine == rendering.completion_ids(tok, "hello world")
    # chat: the template writes its own markers; no BOS is added on top
    engine, tokenize, _ = await api_ids(bos_model_dir, "/v1/chat/completions", {"messages": CHAT})
    assert bos not in engine[:1]
    assert engine == tokenize == router.chat({"messages": CHAT}).token_ids == offline_ids(bos_model_dir, "chat", CHAT)


@pytest.mark.parametrize("uuid", [None, "photo-1"])
async def test_image_chat_agrees_everywhere(tiny_vl_dir, uuid):
    messages = [{"role": "user", "content": [image_part(data_uri(image_bytes(112, 84, seed=3)), uuid=uuid),
                                             {"type": "text", "text": "What is this?"}]}]
    engine, tokenize, placeholders = await api_ids(tiny_vl_dir, "/v1/chat/completions", {"messages": messages},
                                                   multimodal=True)
    routed = PromptRenderer(str(tiny_vl_dir)).chat({"messages": messages})
    assert engine == tokenize == routed.token_ids == offline_ids(tiny_vl_dir, "chat", messages)
    assert placeholders == routed.mm_items and len(placeholders) == 1


def test_image_part_rule_and_multimodal_flag():
    assert rendering.is_image_part({"type": "image_url", "image_url": {"url": "x"}})
    assert rendering.is_image_part({"image_url": {"url": "x"}})  # no type: the field decides
    assert rendering.is_image_part({"type": "image", "image": "x"})
    assert not rendering.is_image_part({"type": "text", "text": "x"}) and not rendering.is_image_part("text")
    msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "image_url", "image_url": {"url": "u"}}]}]
    assert rendering.image_part_positions(msgs) == [(1, 1)] and rendering.has_images(msgs)
    assert rendering.is_multimodal({"vision_config": {"depth": 2}}) and not rendering.is_multimodal({"hidden_size": 8})
