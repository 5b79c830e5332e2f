"""What a replica's answer says it used (core/usage.py): the bytes-level read agrees with parsing the answer."""

from __future__ import annotations

import json

import pytest

from warmfleet.server.router.core.usage import UsageScanner, cached_tokens_in_json, cached_tokens_of


def answer(usage, text: str = "hi") -> bytes:
    return json.dumps({"id": "x", "choices": [{"index": 0, "text": text}], **({"usage": usage} if usage else {})},
                      indent=None).encode()


CASES = [
    answer({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}),
    answer({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 0}}),
    answer({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": None}}),
    answer({"prompt_tokens": 40, "prompt_tokens_details": None}),
    answer({"prompt_tokens": 40}),
    answer(None),
    answer({"prompt_tokens_details": {"cached_tokens": 16}}, text='"cached_tokens": 99, and more'),  # in the text
    answer({"prompt_tokens_details": {"cached_tokens": 7}}, text="cached_tokens"),
    b'{"usage": {"prompt_tokens_details": {"cached_tokens" :  48 }}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": 4.5}}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": "12"}}}',
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": 12}}, "x": {"cached_tokens": 3}}',  # twice: parsed
    b'{"usage": {"prompt_tokens_details": {"cached_tokens": 12',  # cut short
    b"not json",
]


@pytest.mark.parametrize("content", CASES)
def test_cached_tokens_read_off_the_bytes_equal_the_parsed_answers(content):
    try:
        expected = cached_tokens_of(json.loads(content))
    except ValueError:
        expected = None
    assert cached_tokens_in_json(content) == expected


def test_a_json_answer_fed_in_pieces_reports_its_cached_tokens_at_the_end():
    scanner = UsageScanner(stream=False)
    body = CASES[0]
    for i in range(0, len(body), 7):
        scanner.feed(body[i:i + 7])
    assert scanner.finish() == 32
