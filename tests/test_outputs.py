"""OutputStream: deltas from engine outputs, stop strings across token boundaries, finish reasons, logprob shapes."""

from __future__ import annotations

import pytest

from warmfleet.server.engine.request import RequestOutput
from warmfleet.server.outputs import (
    EngineError, OutputStream, TokenLogprob, chat_logprobs, completion_logprobs,
)
from warmfleet.server.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def run(tok: Tokenizer, text: str, stop=(), finish: str = "length", per_step: int = 1, eos: bool = False):
    """Feed `text`'s tokens through an OutputStream, `per_step` tokens per output; return (deltas, stream)."""
    ids = tok.encode(text)
    if eos:
        ids.append(tok.eos_token_ids[0])
    stream = OutputStream(IncrementalDetokenizer(tok), stop)
    deltas = []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        out = RequestOutput("r", ids[i:i + per_step], last, finish if last else None, num_prompt_tokens=7)
        deltas.append(stream.push(out))
        if stream.finished:
            break
    return deltas, stream


def test_plain_text_round_trips_and_maps_finish_reason(tok):
    text = "Hello there, how are you?"
    deltas, s = run(tok, text, finish="length")
    assert "".join(d.text for d in deltas) == text == s.text
    assert [d.finish_reason for d in deltas][-1] == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert s.engine_finished and s.num_generated_tokens == len(tok.encode(text)) and s.num_prompt_tokens == 7


def test_multibyte_characters_are_never_split(tok):
    text = "héllo ünïcode 日本語 ok"
    deltas, s = run(tok, text)
    assert "".join(d.text for d in deltas) == text
    assert not any("\ufffd" in d.text for d in deltas)


def test_eos_gives_stop_and_no_text(tok):
    deltas, s = run(tok, "Hi", eos=True, finish="stop")
    assert s.text == "Hi" and s.finish_reason == "stop"


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_stop_string_across_token_boundaries_truncates_before_it(tok, per_step):
    text = "The answer is 42. END of story, more text"
    stop = "42. END"
    assert len(tok.encode(stop)) > 1  # the stop string spans several tokens
    deltas, s = run(tok, text, stop=[stop], per_step=per_step)
    assert s.text == "The answer is "
    assert s.finish_reason == "stop"
    assert not s.engine_finished  # the caller must abort the engine request
    assert deltas[-1].finish_reason == "stop"
    # nothing past the stop string was ever shown, even transiently
    assert "".join(d.text for d in deltas) == "The answer is "


def test_stop_prefix_is_held_back_then_released(tok):
    s = OutputStream(IncrementalDetokenizer(tok), ["42. END"])
    first = s.push(RequestOutput("r", tok.encode("The answer is 42"), False))
    assert first.text == "The answer is "  # "42" could still become the stop string
    second = s.push(RequestOutput("r", tok.encode(" and more"), True, "length"))
    assert second.text == "42 and more" and second.finish_reason == "length"
    assert s.text == "The answer is 42 and more"


def test_held_back_prefix_is_flushed_when_the_engine_finishes(tok):
    s = OutputStream(IncrementalDetokenizer(tok), ["42. END"])
    d = s.push(RequestOutput("r", tok.encode("The answer is 42"), True, "length"))
    assert d.text == "The answer is 42" and d.finish_reason == "length"


def test_earliest_of_several_stop_strings_wins(tok):
    _, s = run(tok, "alpha beta gamma delta", stop=["delta", "beta"])
    assert s.text == "alpha " and s.finish_reason == "stop"


def test_engine_error_raises_and_later_outputs_are_ignored_after_finish(tok):
    s = OutputStream(IncrementalDetokenizer(tok))
    with pytest.raises(EngineError, match="boom"):
        s.push(RequestOutput("r", [], True, "abort", error="boom"))
    s2 = OutputStream(IncrementalDetokenizer(tok), ["x"])
    d = s2.push(RequestOutput("r", tok.encode("ax"), False))
    assert d.text == "a" and s2.finished
    assert s2.push(RequestOutput("r", tok.encode("more"), False)).text == ""


def test_abort_finish_reason_passes_through(tok):
    s = OutputStream(IncrementalDetokenizer(tok))
    assert s.push(RequestOutput("r", tok.encode("a"), True, "abort")).finish_reason == "abort"


def test_cached_token_counts_are_kept(tok):
    s = OutputStream(IncrementalDetokenizer(tok))
    s.push(RequestOutput("r", tok.encode("a"), False, num_prompt_tokens=100, num_cached_tokens=64, num_cached_tokens_cpu=16))
    s.push(RequestOutput("r", tok.encode("b"), True, "stop", num_prompt_tokens=100))
    assert (s.num_cached_tokens, s.num_cached_tokens_cpu, s.num_prompt_tokens) == (64, 16, 100)


def test_logprobs_shapes(tok):
    ids = tok.encode("Hello")
    s = OutputStream(IncrementalDetokenizer(tok))
    lps = [(-0.5, [(ids[0], -0.5), (7, -float("inf"))])] + [(-1.0, [])] * (len(ids) - 1)
    d = s.push(RequestOutput("r", ids, True, "stop", new_logprobs=lps))
    assert [e.token_id for e in d.logprobs] == ids

    chat = chat_logprobs(d.logprobs, tok, top_logprobs=2)["content"]
    assert "".join(c["token"] for c in chat) == "Hello"
    assert chat[0]["logprob"] == -0.5 and bytes(chat[0]["bytes"]).decode() == chat[0]["token"]
    assert [t["logprob"] for t in chat[0]["top_logprobs"]] == [-0.5, -9999.0]  # -inf is not JSON
    assert chat[1]["top_logprobs"] == []

    comp = completion_logprobs(d.logprobs, tok, 1, text_offset=3)
    assert "".join(comp["tokens"]) == "Hello"
    assert comp["token_logprobs"][0] == -0.5 and len(comp["top_logprobs"][0]) == 1
    assert comp["text_offset"][0] == 3 and comp["text_offset"][1] == 3 + len(comp["tokens"][0])


def test_no_logprobs_requested_gives_empty_entries(tok):
    s = OutputStream(IncrementalDetokenizer(tok))
    assert s.push(RequestOutput("r", tok.encode("a"), False)).logprobs == []
    assert chat_logprobs([TokenLogprob(1, -1.0)], tok, 0)["content"][0]["top_logprobs"] == []
