"""Fuzzing harness shared by bench/fuzz.py and tests/reliability/test_fuzz.py: schemathesis cases from each
server's OpenAPI schema, a hand corpus of hostile requests, and the verdict on one response.

The OpenAI routes parse their bodies themselves (so malformed JSON gets an OpenAI-shaped 400, not
FastAPI's 422), so the served schema has no request bodies; `schema_with_bodies` adds them from
the pydantic models in `server/api/protocol.py`, the models that really validate those bodies.
A response passes when it is not a 5xx, arrives within the client's timeout, and, for a 4xx on an
OpenAI route, is `{"error": {"message": ...}}` with a message.
"""

from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import httpx

from warmfleet.livefleet import MODEL_NAME
from warmfleet.server.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize")
SKIP_PATHS = ("/drain",)
# hand-corpus cases that are valid requests (NUL is a Unicode character; like OpenAI, a JSON body is read
# whatever its content type says): a 200 is right for them, so long as nothing breaks
ACCEPTED = ("NUL bytes in content", "wrong content type")  # admin routes that take a replica out of rotation: fuzzed by hand, not at random


def schema_with_bodies(raw: dict) -> dict:
    """The served OpenAPI document with request bodies for the OpenAI routes (from protocol.py's models)."""
    doc = json.loads(json.dumps(raw))
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        comps[model.__name__] = js
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    doc["paths"] = {p: ops for p, ops in doc.get("paths", {}).items() if not any(s in p for s in SKIP_PATHS)}
    return doc

# the OpenAI and status routes every server has, for a server whose /openapi.json fails
FALLBACK_SCHEMA = {"openapi": "3.1.0", "info": {"title": "fallback", "version": "0"}, "paths": {
    **{p: {"post": {"responses": {"200": {"description": "ok"}}}} for p in BODIES},
    **{p: {"get": {"responses": {"200": {"description": "ok"}}}} for p in ("/health", "/ready", "/metrics", "/v1/models")}}}


@dataclass
class Verdicts:
    """What a fuzz run saw: counts by status and the failures (each a short description)."""

    cases: int = 0
    by_status: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    slowest_s: float = 0.0

    def add(self, what: str, path: str, status: Optional[int], body: bytes, seconds: float,
            error: Optional[str] = None) -> None:
        self.cases += 1
        self.slowest_s = max(self.slowest_s, seconds)
        key = str(status) if status is not None else (error or "no answer")
        self.by_status[key] = self.by_status.get(key, 0) + 1
        problem = verdict(path, status, body, error)
        if problem:
            self.failures.append(f"{what}: {problem}")


def verdict(path: str, status: Optional[int], body: bytes, error: Optional[str] = None) -> Optional[str]:
    """None if the answer is acceptable, else what is wrong with it."""
    if status is None:
        return f"no answer ({error})"
    if status >= 500:
        return f"{status}: {body[:300]!r}"
    if 400 <= status < 500 and any(path.startswith(p) for p in OPENAI_PATHS):
        try:
            err = json.loads(body)["error"]
            if not isinstance(err.get("message"), str) or not err["message"]:
                return f"{status} without an error message: {body[:300]!r}"
        except (ValueError, KeyError, TypeError):
            return f"{status} not OpenAI-shaped: {body[:300]!r}"
    return None


def run_schema_cases(base_url: str, max_examples: int, seed: int = 0, timeout_s: float = 30.0,
                     verdicts: Optional[Verdicts] = None) -> Verdicts:
    """`max_examples` schemathesis cases per operation (valid and invalid data), each sent once and judged."""
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from schemathesis.generation import GenerationMode

    verdicts = verdicts or Verdicts()
    r = httpx.get(base_url + "/openapi.json", timeout=10)
    verdicts.add("GET /openapi.json", "/openapi.json", r.status_code, r.content[:300], r.elapsed.total_seconds())
    raw = r.json() if r.status_code == 200 else FALLBACK_SCHEMA  # its failure is recorded; fuzz the known routes
    schema = schemathesis.openapi.from_dict(schema_with_bodies(raw))
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                strategy = op.as_strategy(generation_mode=mode)

                @hypothesis.settings(max_examples=max_examples, database=None, deadline=None, derandomize=False,
                                     suppress_health_check=list(hypothesis.HealthCheck),
                                     phases=[hypothesis.Phase.generate])
                @hypothesis.seed(seed)
                @hypothesis.given(strategy)
                def one(case) -> None:
                    send_case(client, case, verdicts)

                try:
                    one()
                except hypothesis.errors.Unsatisfiable:  # e.g. no invalid request exists for GET /health
                    pass
    return verdicts


def send_case(client: httpx.Client, case, verdicts: Verdicts) -> None:
    """Send one schemathesis case with httpx (bounded by the client's timeout) and judge the answer."""
    path = case.formatted_path
    kwargs: dict = {"params": case.query or None, "headers": {k: str(v) for k, v in (case.headers or {}).items()}}
    if case.body is not None and not isinstance(case.body, type(None)):
        try:
            kwargs["content"] = json.dumps(case.body).encode()
        except (TypeError, ValueError):
            kwargs["content"] = repr(case.body).encode()
        kwargs["headers"]["content-type"] = "application/json"
    what = f"{case.method} {path} {kwargs.get('content', b'')[:200]!r}"
    t0 = time.monotonic()
    try:
        r = client.request(case.method, path, **kwargs)
        verdicts.add(what, path, r.status_code, r.content, time.monotonic() - t0)
    except httpx.HTTPError as exc:
        verdicts.add(what, path, None, b"", time.monotonic() - t0, type(exc).__name__)


# ---- the hand corpus -----------------------------------------------------------------------------

def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (w, h)).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def _chat(content, **extra) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}], **extra}


def _image_chat(url: str) -> dict:
    return _chat([image_part(url), {"type": "text", "text": "what is it?"}])


def hand_corpus(max_model_len: int, many_parts: int = 5000) -> Iterator[tuple[str, str, bytes, dict]]:
    """(name, path, raw body, extra headers) of hostile requests; each must get a 4xx naming the problem."""
    png = image_bytes(64, 48, seed=1)
    j = lambda obj: json.dumps(obj).encode()  # noqa: E731
    yield "truncated PNG", "/v1/chat/completions", j(_image_chat(data_uri(png[: len(png) // 2]))), {}
    corrupt = bytearray(png)
    corrupt[40:80] = b"\xff" * 40
    yield "corrupt PNG body", "/v1/chat/completions", j(_image_chat(data_uri(bytes(corrupt)))), {}
    yield "PNG header only", "/v1/chat/completions", j(_image_chat(data_uri(png[:8]))), {}
    yield "decompression bomb (20000x20000 PNG, 400 MP)", "/v1/chat/completions", j(_image_chat(data_uri(_png(20000, 20000)))), {}
    yield "HTML as an image", "/v1/chat/completions", j(_image_chat(data_uri(b"<html><body>hi</body></html>", "image/png"))), {}
    yield "HTML with an html mime", "/v1/chat/completions", j(_image_chat("data:text/html;base64," + base64.b64encode(b"<html></html>").decode())), {}
    yield "bad base64", "/v1/chat/completions", j(_image_chat("data:image/png;base64,@@@not base64@@@")), {}
    yield "empty data URI", "/v1/chat/completions", j(_image_chat("data:image/png;base64,")), {}
    yield "invalid UTF-8 body", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe\xc0"}]}', {}
    yield "lone surrogate escape", "/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}', {}
    yield "lone surrogate in a key and the model name", "/v1/chat/completions", b'{"model": "t\\udfff", "\\ud800": 1, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}', {}
    yield "NUL bytes in content", "/v1/chat/completions", j(_chat("a\u0000b" * 10)), {}
    yield "deep JSON nesting (100000)", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, {}
    yield "deep nesting inside a field", "/v1/chat/completions", j(_chat("x"))[:-1] + b', "logit_bias": ' + b"{\"a\":" * 5000 + b"1" + b"}" * 5000 + b"}", {}
    yield "huge max_tokens", "/v1/chat/completions", j(_chat("hi", max_tokens=10**30)), {}
    yield "huge temperature", "/v1/chat/completions", j(_chat("hi", temperature=1e308 * 10)), {}
    yield "NaN temperature", "/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}', {}
    yield "huge n", "/v1/chat/completions", j(_chat("hi", n=10**9)), {}
    yield "huge seed", "/v1/chat/completions", j(_chat("hi", seed=10**40)), {}
    yield "huge top_logprobs", "/v1/chat/completions", j(_chat("hi", logprobs=True, top_logprobs=10**12)), {}
    yield "huge token id", "/v1/completions", j({"model": MODEL_NAME, "prompt": [10**20], "max_tokens": 1}), {}
    yield "negative token id", "/v1/completions", j({"model": MODEL_NAME, "prompt": [-1], "max_tokens": 1}), {}
    yield "huge logit_bias key", "/v1/chat/completions", j(_chat("hi", logit_bias={str(10**30): 1})), {}
    yield f"{many_parts} text parts", "/v1/chat/completions", j(_chat([{"type": "text", "text": "a"}] * many_parts)), {}
    yield f"{many_parts} image parts", "/v1/chat/completions", j(_chat([image_part(data_uri(png))] * many_parts)), {}
    yield f"{many_parts} messages", "/v1/chat/completions", j({"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "a"}] * many_parts}), {}
    yield "unknown part type", "/v1/chat/completions", j(_chat([{"type": "video_url", "video_url": {"url": "x"}}])), {}
    yield "prompt one token over the context", "/v1/completions", j({"model": MODEL_NAME, "prompt": [5] * (max_model_len + 1), "max_tokens": 1}), {}
    yield "prompt exactly the context, 1 new token", "/v1/completions", j({"model": MODEL_NAME, "prompt": [5] * max_model_len, "max_tokens": 1}), {}
    yield "wrong content type", "/v1/chat/completions", j(_chat("hi")), {"content-type": "text/plain"}
    yield "empty body", "/v1/chat/completions", b"", {}
    yield "JSON array body", "/v1/completions", b"[1, 2]", {}
    yield "messages not a list", "/v1/chat/completions", j({"model": MODEL_NAME, "messages": "hi"}), {}
    yield "file:// image", "/v1/chat/completions", j(_image_chat("file:///etc/passwd")), {}
    yield "gopher:// image", "/v1/chat/completions", j(_image_chat("gopher://127.0.0.1:70/_x")), {}


def run_hand_corpus(base_url: str, max_model_len: int, timeout_s: float = 60.0,
                    verdicts: Optional[Verdicts] = None,
                    accept_200: tuple[str, ...] = ACCEPTED, many_parts: int = 5000) -> Verdicts:
    """Send the hand corpus; besides `verdict`, each must be a 4xx unless named in `accept_200`."""
    verdicts = verdicts or Verdicts()
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for name, path, body, headers in hand_corpus(max_model_len, many_parts):
            t0 = time.monotonic()
            try:
                r = client.post(path, content=body, headers={"content-type": "application/json", **headers})
            except httpx.HTTPError as exc:
                verdicts.add(name, path, None, b"", time.monotonic() - t0, type(exc).__name__)
                continue
            verdicts.add(name, path, r.status_code, r.content, time.monotonic() - t0)
            if r.status_code == 200 and name not in accept_200:
                verdicts.failures.append(f"{name}: accepted (200), expected a 4xx naming the problem")
            elif r.status_code < 400 and r.status_code != 200:
                verdicts.failures.append(f"{name}: unexpected {r.status_code}")
            verdicts.by_case = getattr(verdicts, "by_case", {})
            try:
                msg = json.loads(r.content)["error"]["message"] if r.status_code >= 400 else "ok"
            except (ValueError, KeyError, TypeError):
                msg = r.text[:120]
            verdicts.by_case[name] = (r.status_code, msg[:160], round(time.monotonic() - t0, 3))
    return verdicts

