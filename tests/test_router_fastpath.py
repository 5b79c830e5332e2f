"""The router's hot POST routes on a started router, served by http/hotpath.py (as `warmfleet route` serves them)
and in raw ASGI (app.FastPath / Frontend.serve): bodies, errors, slots, pipelining, streams the client leaves."""

from __future__ import annotations

import asyncio
import json

import pytest

from router_fakes import FakeSharedFailures, Fleet2, chat
from waiting import until
from warmfleet.server.router.core.errors import Refusal, parse_json_object

PROTOCOLS = pytest.mark.parametrize("protocol", ["hot", "asgi"])


async def chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


@PROTOCOLS
async def test_a_chunked_body_is_read_whole_and_forwarded_as_sent(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, protocol=protocol) as f:
        raw = json.dumps(chat("a body that arrives in pieces " * 20)).encode()
        # an async iterator: httpx sends it chunked, without content-length, so the router gets several messages
        r = await f.client.post("/v1/chat/completions", content=chunks(raw, 97),
                                headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        got = f.by_url[f.url_of(r.headers["x-warmfleet-replica"])].received[-1]
        assert got == json.loads(raw)
        assert not f.app.state.limiter.open  # the client's slot is back once the answer has gone


@PROTOCOLS
async def test_bad_bodies_get_openai_errors_and_hold_no_slot(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, max_concurrent_per_client=1, protocol=protocol) as f:
        f.app.frontend.max_request_bytes = 1000
        cases = [
            (b"{" + b" " * 2000 + b"}", {}, 413, "1000 bytes"),  # declared length over the cap
            (chunks(b"{" + b" " * 2000 + b"}", 300), {}, 413, "1000 bytes"),  # no declared length: counted
            (b"{not json", {}, 400, "not valid JSON"),
            (b"[1, 2]", {}, 400, "must be a JSON object"),
            # not JSON by RFC 8259, though Python's json module reads them: NaN, an overflowing number, a lone
            # surrogate (no UTF-8 for the tokenizer), bytes that are not UTF-8
            (b'{"prompt": "x", "temperature": NaN}', {}, 400, "NaN, Infinity"),
            (b'{"prompt": "x", "temperature": 1e999}', {}, 400, "numbers beyond a double"),
            (b'{"prompt": "\\ud800"}', {}, 400, "not valid Unicode text"),
            (b'{"prompt": "\xff"}', {}, 400, "not valid JSON"),
            ('{"prompt": "x"}'.encode("utf-16"), {}, 400, "JSON is UTF-8"),
            (b"\xef\xbb\xbf" + b'{"prompt": "x"}', {}, 400, "byte-order mark"),
        ]
        for path in ("/v1/chat/completions", "/v1/completions"):
            for content, headers, status, message in cases:
                if not isinstance(content, bytes):  # a generator is used once
                    content = chunks(b"{" + b" " * 2000 + b"}", 300)
                r = await f.client.post(path, content=content, headers={"content-type": "application/json", **headers})
                assert r.status_code == status and message in r.json()["error"]["message"], (path, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
        assert not f.app.state.limiter.open
        # with a limit of one per client, a request still gets in: no error above kept a slot
        r = await f.client.post("/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 1})
        assert r.status_code == 200, r.text


def completion(prompt: str, **extra) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}).encode()


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"host: router", b"content-type: application/json",
            b"content-length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 answer with a content-length: status, headers, body."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, await reader.readexactly(int(headers["content-length"]))


@PROTOCOLS
async def test_requests_pipelined_on_one_connection_are_answered_in_order(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, protocol=protocol) as f:
        reader, writer = await asyncio.open_connection("127.0.0.1", f.router.port)
        # a hot request, a bad one, a route the ASGI app serves, then a hot one: written at once, before any answer
        writer.write(post("/v1/completions", completion("first request")) + post("/v1/completions", b"{oops")
                     + b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n" + post("/v1/completions", completion("last")))
        answers = [await asyncio.wait_for(read_answer(reader), 10) for _ in range(4)]
        writer.close()
        assert [a[0] for a in answers] == [200, 400, 200, 200]
        assert "not valid JSON" in json.loads(answers[1][2])["error"]["message"]
        prompts = [b["prompt"] for r in f.replicas for b in r.received]
        assert sorted(prompts) == ["first request", "last"]
        assert not f.app.state.limiter.open


@PROTOCOLS
async def test_request_targets_with_a_query_or_in_absolute_form_are_routed(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, protocol=protocol) as f:
        reader, writer = await asyncio.open_connection("127.0.0.1", f.router.port)
        targets = ["/v1/completions?trace=1", "http://router/v1/completions", "/v1/completions/", "/v1/completion"]
        for target in targets:
            writer.write(post(target, completion(f"to {target}")))
        answers = [await asyncio.wait_for(read_answer(reader), 10) for _ in targets]
        writer.close()
        # the first two name the route; the other two are other paths (FastAPI's 307 redirect and 404)
        assert [a[0] for a in answers][:2] == [200, 200] and all(a[0] != 200 for a in answers[2:]), answers
        prompts = [body["prompt"] for rep in f.replicas for body in rep.received]
        assert sorted(prompts) == sorted(f"to {t}" for t in targets[:2])


@PROTOCOLS
async def test_a_client_that_leaves_a_stream_frees_its_replica_and_slot(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, "hold"), max_concurrent_per_client=1,
                      protocol=protocol) as f:
        reader, writer = await asyncio.open_connection("127.0.0.1", f.router.port)
        writer.write(post("/v1/completions", completion("a stream left half way", stream=True)))
        assert b" 200 " in await asyncio.wait_for(reader.readline(), 10)
        await asyncio.wait_for(reader.readuntil(b"world"), 10)  # two events relayed; the replica now holds the rest
        reps = list(f.fleet.registry.replicas.values())
        assert sum(r.in_flight for r in reps) == 1 and f.app.state.limiter.open
        writer.close()
        await until(lambda: sum(r.in_flight for r in reps) == 0, "the relay to end with the client")
        await until(lambda: not f.app.state.limiter.open, "the client's slot back")
        f.replicas[0].release.set()
        f.replicas[1].release.set()


@PROTOCOLS
async def test_a_forwarded_client_address_keys_the_per_client_limit(tiny_model_dir, protocol):
    # uvicorn trusts X-Forwarded-For from loopback: the hot path leaves such requests to the ASGI path, which applies it
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, "hold"), max_concurrent_per_client=1,
                      protocol=protocol) as f:
        held = asyncio.create_task(f.client.post("/v1/completions", content=completion("held", stream=True),
                                                 headers={"x-forwarded-for": "10.0.0.1"}))
        await until(lambda: f.app.state.limiter.open, "the first client's slot")
        other = await f.client.post("/v1/completions", content=completion("other client"),
                                    headers={"x-forwarded-for": "10.0.0.2"})
        same = await f.client.post("/v1/completions", content=completion("same client"),
                                   headers={"x-forwarded-for": "10.0.0.1"})
        assert (other.status_code, same.status_code) == (200, 429), (other.text, same.text)
        for r in f.replicas:
            r.release.set()
        assert (await held).status_code == 200


@PROTOCOLS
async def test_a_body_larger_than_one_socket_read_is_read_whole(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, protocol=protocol) as f:
        prompt = "many words in one long prompt " * 8000  # ~240 KB: many reads, past uvicorn's 64 KiB high water
        r = await f.client.post("/v1/completions", content=completion(prompt))
        assert r.status_code == 200, r.text
        assert [b["prompt"] for rep in f.replicas for b in rep.received] == [prompt]


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_nesting_past_the_recursion_limit_is_a_400_not_a_crash(raw):
    refusal = parse_json_object(raw)
    assert isinstance(refusal, Refusal) and refusal.status == 400 and "not valid JSON" in refusal.message
