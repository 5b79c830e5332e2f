"""Tokenizer parity with transformers (encode, decode, chat template), EOS ids, streaming detokenization, stop strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from warmfleet.server.tiny_checkpoints.text import QWEN2_VL_CHAT_TEMPLATE_PATH
from warmfleet.server.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStringMatcher, Tokenizer

GOLDEN = json.loads((Path(__file__).parent / "golden" / "manifest.json").read_text(encoding="utf-8"))["tokenizer"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    assert GOLDEN["make_tiny_model"] == dict(arch="qwen2", size="tiny", seed=0, overrides={})  # same as the fixture
    return Tokenizer(tiny_model_dir)


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    dst = Path(shutil.copytree(src, dst))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case", GOLDEN["encode"], ids=lambda c: c["text"][:20])
def test_encode_matches_transformers(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", GOLDEN["decode"], ids=lambda c: f"{c['text'][:16]}-{c['skip_special_tokens']}")
def test_decode_matches_transformers(tok, case):
    assert tok.decode(case["ids"], skip_special_tokens=case["skip_special_tokens"]) == case["text"]


@pytest.mark.parametrize("case", GOLDEN["chat"], ids=lambda c: f"{len(c['messages'])}msg-tools{bool(c['tools'])}")
def test_chat_template_matches_transformers(tok, case):
    rendered = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                       tools=case["tools"])
    assert rendered == case["rendered"]


def test_special_tokens_and_eos(tok):
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == [im_end, eot]  # generation_config's list, in order
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.pad_token_id == eot
    assert tok.vocab_size == 1024
    assert {im_end, eot, tok.token_to_id("<|image_pad|>")} <= tok.all_special_ids
    assert tok.token_to_id("<tool_call>") not in tok.all_special_ids  # added but not special, as in Qwen2.5


def test_eos_falls_back_to_tokenizer_config(tiny_model_dir, tmp_path):
    d = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    (d / "generation_config.json").unlink()
    assert Tokenizer(d).eos_token_ids == [Tokenizer(d).token_to_id("<|im_end|>")]


def test_tool_call_arguments_as_json_string_render_like_objects(tok):
    as_object = GOLDEN["chat"][3]
    messages = json.loads(json.dumps(as_object["messages"]))
    fn = messages[1]["tool_calls"][0]["function"]
    fn["arguments"] = json.dumps(fn["arguments"])  # OpenAI's wire form
    assert tok.apply_chat_template(messages, tools=as_object["tools"]) == as_object["rendered"]


def test_text_parts_are_joined_for_string_templates(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert tok.content_format == "string"
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == \
        tok.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])
    with pytest.raises(ChatTemplateError, match="only text"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_vl_template_receives_content_parts(tiny_model_dir, tmp_path):
    d = _copy_with_config(tiny_model_dir, tmp_path / "vl", chat_template=QWEN2_VL_CHAT_TEMPLATE_PATH.read_text())
    tok = Tokenizer(d)
    assert tok.content_format == "openai"
    parts = [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "What is this?"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                        "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(rendered)
    assert ids.count(tok.token_to_id("<|image_pad|>")) == 1


def test_raise_exception_and_missing_template(tiny_model_dir, tmp_path):
    d = _copy_with_config(tiny_model_dir, tmp_path / "strict",
                          chat_template="{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    tok = Tokenizer(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    d2 = _copy_with_config(tiny_model_dir, tmp_path / "none", chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(d2).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_attribute_escape(tiny_model_dir, tmp_path):
    d = _copy_with_config(tiny_model_dir, tmp_path / "evil",
                          chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenizer_never_splits_characters(tok):
    text = "Café 你好，世界 🙂👍 done."
    prompt = tok.encode("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert "" in deltas  # some tokens completed no character and were held back


def test_incremental_detokenizer_flushes_incomplete_bytes(tok):
    ids = tok.encode("🙂")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == "\ufffd"  # the stream ended mid-character


def test_incremental_detokenizer_skips_special_tokens(tok):
    detok = IncrementalDetokenizer(tok)
    out = detok.push(tok.encode("Hi")) + detok.push([tok.token_to_id("<|im_end|>")])
    assert out == "Hi"


def test_stop_string_split_across_deltas():
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.push("hello ST") == ("hello ", False)  # "ST" might begin "STOP"
    assert m.push("O") == ("", False)
    assert m.push("P and more") == ("", True)
    assert m.stopped_on == "STOP"
    assert m.push("later") == ("", True)


def test_stop_string_false_alarm_and_flush():
    m = StopStringMatcher(["STOP"], include_stop=False)
    assert m.push("ST") == ("", False)
    assert m.push("ART") == ("START", False)
    assert m.push("xS") == ("x", False)
    assert m.flush() == "S"
    inc = StopStringMatcher(["</s>"], include_stop=True)
    assert inc.push("a</s>b") == ("a</s>", True)
