"""What a front door answers instead of routing (a refusal: status, OpenAI-shaped error); no HTTP."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import msgspec

_decode = msgspec.json.Decoder().decode  # strict RFC 8259 JSON in UTF-8, ~6x faster than json.loads on a request


@dataclass(frozen=True)
class Refusal:
    """A request the router answers itself: the HTTP status and the OpenAI error it carries."""

    status: int  # 4xx / 5xx
    message: str
    type: str  # OpenAI error type, e.g. "invalid_request_error", "rate_limit_error"
    param: Optional[str] = None  # the request field at fault, when the replica would name one
    code: Optional[str] = None  # the replica's error code (e.g. "too_many_choices"); None: the status

    def payload(self) -> dict:
        """The OpenAI error body: {"error": {"message", "type", "code"}} (and "param" when one is named)."""
        if self.code is None:
            return {"error": {"message": self.message, "type": self.type, "code": self.status}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


NO_REPLICA = Refusal(503, "no healthy replica", "service_unavailable")


def parse_json_object(raw: bytes) -> dict | Refusal:
    """The request's JSON object, or the 400 to answer (NaN, Infinity and lone surrogates are not JSON: 400 too)."""
    try:
        body = _decode(raw)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nesting too deep
        return Refusal(400, _why_not_json(raw), "invalid_request_error")
    if not isinstance(body, dict):
        return Refusal(400, "request body must be a JSON object", "invalid_request_error")
    return body


def _why_not_json(raw: bytes) -> str:
    """The 400's message for a body strict JSON refuses: what Python's lenient parser reads is named."""
    try:
        lenient = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "request body is not valid JSON"
    try:  # json.loads also reads UTF-16 and UTF-32, and a byte-order mark
        raw.decode("utf-8")
        utf8 = not raw.startswith(b"\xef\xbb\xbf")
    except UnicodeDecodeError:
        utf8 = False
    if not utf8:
        return "request body is not valid JSON (JSON is UTF-8, without a byte-order mark)"
    try:
        json.dumps(lenient, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return "request body is not valid Unicode text (a lone surrogate escape such as \\ud800)"
    return "request body is not valid JSON (NaN, Infinity and numbers beyond a double are not JSON numbers)"
