"""The router's hot POST routes in raw ASGI (app.FastPath / Frontend.serve) on a started router: bodies, errors, slots."""

from __future__ import annotations

import json

from router_fakes import Fleet2, chat


async def chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def test_a_chunked_body_is_read_whole_and_forwarded_as_sent(tiny_model_dir):
    async with Fleet2(tiny_model_dir) as f:
        raw = json.dumps(chat("a body that arrives in pieces " * 20)).encode()
        # an async iterator: httpx sends it chunked, without content-length, so the router gets several messages
        r = await f.client.post("/v1/chat/completions", content=chunks(raw, 97),
                                headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        got = f.by_url[f.url_of(r.headers["x-warmfleet-replica"])].received[-1]
        assert got == json.loads(raw)
        assert not f.app.state.limiter.open  # the client's slot is back once the answer has gone


async def test_bad_bodies_get_openai_errors_and_hold_no_slot(tiny_model_dir):
    async with Fleet2(tiny_model_dir, max_concurrent_per_client=1) as f:
        f.app.frontend.max_request_bytes = 1000
        cases = [
            (b"{" + b" " * 2000 + b"}", {}, 413, "1000 bytes"),  # declared length over the cap
            (chunks(b"{" + b" " * 2000 + b"}", 300), {}, 413, "1000 bytes"),  # no declared length: counted
            (b"{not json", {}, 400, "not valid JSON"),
            (b"[1, 2]", {}, 400, "must be a JSON object"),
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
