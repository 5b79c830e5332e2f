"""The router's minijinja render equals the replica's Jinja2 render, or declines: probes, shapes, fallbacks."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from warmfleet.server.router.core.prompt import PromptRenderer
from warmfleet.server.router.core.template import FastChatTemplate, probed_shape
from warmfleet.server.tokenizer import ChatTemplateError, Tokenizer

from test_router_prompt import conversations

GOLDEN = json.loads((Path(__file__).parent / "golden" / "manifest.json").read_text(encoding="utf-8"))["tokenizer"]


def with_template(src: Path, dst: Path, template: str) -> Tokenizer:
    dst = Path(shutil.copytree(src, dst))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(dst)


def test_qwen2_template_renders_as_jinja2_and_transformers(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    fast = FastChatTemplate.for_tokenizer(tok)
    assert fast is not None
    for case in GOLDEN["chat"]:  # transformers' own renders; tool requests are declined, not rendered
        got = fast.render(case["messages"], case["add_generation_prompt"]) if not case["tools"] else None
        assert got is None or got == case["rendered"]
    assert fast.rendered >= 2
    for seed in range(3):
        for msgs in conversations(seed, 10):
            for add_gen in (True, False):
                assert fast.render(msgs, add_gen) == tok.apply_chat_template(msgs, add_generation_prompt=add_gen)


def test_qwen2_vl_template_with_image_parts(tiny_vl_dir):
    tok = Tokenizer(tiny_vl_dir)
    fast = FastChatTemplate.for_tokenizer(tok)
    assert fast is not None
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    msgs = [{"role": "system", "content": "look"},
            {"role": "user", "content": [{"type": "text", "text": "one "}, image, {"type": "image"}]},
            {"role": "assistant", "content": "two cats"}, {"role": "user", "content": [image]}]
    want = tok.apply_chat_template(msgs)
    assert "<|image_pad|>" in want and fast.render(msgs) == want


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", "HF's generation tag"),
    ("{% for m in messages %}{{ m.content.expandtabs(2) }}{% endfor %}", "a Python string method minijinja lacks"),
])
def test_templates_minijinja_renders_otherwise_keep_jinja2(tiny_model_dir, tmp_path, template, why):
    tok = with_template(tiny_model_dir, tmp_path / "m", template)
    assert FastChatTemplate.for_tokenizer(tok) is None, why
    renderer = PromptRenderer(str(tmp_path / "m"), tokenizer=tok)
    msgs = [{"role": "user", "content": "a\tb"}]
    text = tok.apply_chat_template(msgs)
    assert renderer.chat({"messages": msgs}).token_ids == tok.encode(text)


def test_a_template_that_refuses_a_conversation_refuses_it_through_the_router(tiny_model_dir, tmp_path):
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% if not loop.last %}\n{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = with_template(tiny_model_dir, tmp_path / "m", template)
    fast = FastChatTemplate.for_tokenizer(tok)
    assert fast is not None  # both engines refuse the same probes
    assert fast.render([{"role": "assistant", "content": "x"}]) is None and fast.declined == 1
    renderer = PromptRenderer(str(tmp_path / "m"), tokenizer=tok)
    with pytest.raises(ChatTemplateError, match="user first"):  # Jinja2's refusal, as the replica gives it
        renderer.chat({"messages": [{"role": "assistant", "content": "x"}]})
    msgs = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "yo"}]
    assert renderer.chat({"messages": msgs}).token_ids == tok.encode(tok.apply_chat_template(msgs))
    assert renderer.template.rendered == 1


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "42"},
    {"role": "user", "content": "hi", "name": "alice"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
    {"role": "user", "content": 7},
    "not a dict",
])
def test_shapes_the_probes_did_not_cover_go_to_jinja2(message):
    assert not probed_shape([{"role": "user", "content": "ok"}, message])
    assert probed_shape([{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "image"}]}])


def test_without_minijinja_the_router_keeps_jinja2(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "minijinja", None)  # `import minijinja` raises ImportError
    tok = Tokenizer(tiny_model_dir)
    assert FastChatTemplate.for_tokenizer(tok) is None
    renderer = PromptRenderer(str(tiny_model_dir), tokenizer=tok)
    msgs = conversations(0, 3)[-1]
    assert renderer.chat({"messages": msgs}).token_ids == tok.encode(tok.apply_chat_template(msgs))
