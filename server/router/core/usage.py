"""What a replica's answer says it cached (`usage...cached_tokens`) in JSON or SSE bytes; imports no router module."""

from __future__ import annotations

import json
import re
from typing import Optional


def cached_tokens_of(body: dict) -> Optional[int]:
    """`usage.prompt_tokens_details.cached_tokens` of an OpenAI answer (or stream event), None if it has none."""
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def event_boundary(buf: bytes) -> int:
    """End of the last complete SSE event in `buf` (0 if none)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


# the key as JSON writes it (a quote inside a string value is escaped, so this only matches a key) and its integer
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)\s*[,}]')


def cached_tokens_in_json(content: bytes) -> Optional[int]:
    """Cached tokens of a whole (non-streamed) answer, None if it says none.

    An answer with the key once holds it at `usage.prompt_tokens_details` (OpenAI's shape has it nowhere else):
    its integer is read off the bytes, as parsing the whole answer for it was ~4 % of the router's CPU per request."""
    if b'"cached_tokens"' not in content:
        return None
    found = _CACHED_TOKENS.search(content)
    if found is not None and content.count(b'"cached_tokens"') == 1:
        return int(found.group(1))
    try:
        return cached_tokens_of(json.loads(content))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def cached_tokens_in_events(events: bytes) -> Optional[int]:
    """Cached tokens of the first `data:` event in `events` (complete SSE events) that carries usage."""
    if b'"cached_tokens"' not in events:
        return None
    for line in events.splitlines():
        if line.startswith(b"data: {") and b'"cached_tokens"' in line:
            try:
                return cached_tokens_of(json.loads(line[6:]))
            except (ValueError, UnicodeDecodeError, RecursionError):
                return None
    return None


class UsageScanner:
    """Reads usage out of an answer fed in arbitrary chunks (SSE or one JSON body), keeping only an unfinished event."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.tail = b""  # SSE: bytes after the last complete event; JSON: the body so far
        self.cached_tokens: Optional[int] = None  # what the answer reported, once seen

    def feed(self, chunk: bytes) -> None:
        if self.cached_tokens is not None:
            return
        buf = self.tail + chunk
        if not self.stream:
            self.tail = buf
            return
        cut = event_boundary(buf)
        if cut:
            self.cached_tokens = cached_tokens_in_events(buf[:cut])
            buf = buf[cut:]
        self.tail = buf

    def finish(self) -> Optional[int]:
        """The cached tokens reported, once the answer has ended (None if it reported none)."""
        if self.cached_tokens is None and self.tail:
            self.cached_tokens = (cached_tokens_in_events(self.tail + b"\n\n") if self.stream
                                  else cached_tokens_in_json(self.tail))
        self.tail = b""
        return self.cached_tokens
