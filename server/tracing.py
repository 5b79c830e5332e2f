"""Request ids and W3C trace context of one HTTP request, and the log fields they give; no I/O, no engine import.

A request keeps the `x-request-id` its client sent (made here when absent or unusable) and the
`traceparent`/`tracestate` it came with (https://www.w3.org/TR/trace-context/): the router passes
them to the replica and returns the id on the response; the replica stamps them on every log
record written while it serves the request (`bind`, read by logging_setup's formatter).
"""

from __future__ import annotations

import contextvars
import itertools
import os
import re
from typing import Optional

REQUEST_ID = "x-request-id"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
HEADERS = (REQUEST_ID, TRACEPARENT, TRACESTATE)  # what a router passes upstream
MAX_REQUEST_ID = 128  # characters; a longer or non-token id is replaced
MAX_TRACESTATE = 512  # W3C: 32 members of up to 256 characters; propagators may drop beyond 512

_ID_OK = re.compile(r"[A-Za-z0-9._:/+=@-]{1,%d}" % MAX_REQUEST_ID)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_current: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("warmfleet_request", default=None)


_PREFIX = os.urandom(8).hex()  # this process's; with a counter, unique without a syscall per request
_count = itertools.count(1)


def _new_prefix() -> None:  # a forked child must not repeat its parent's ids
    global _PREFIX
    _PREFIX = os.urandom(8).hex()


os.register_at_fork(after_in_child=_new_prefix)


def new_request_id() -> str:
    """32 hex digits: a random per-process prefix and a counter (unique, not a secret)."""
    return f"{_PREFIX}{next(_count):016x}"


def request_id(given: Optional[str]) -> str:
    """The client's `x-request-id` when it is a plain token of at most 128 characters, else a new one."""
    return given if given is not None and _ID_OK.fullmatch(given) else new_request_id()


def trace_id(traceparent: Optional[str]) -> Optional[str]:
    """The trace id (32 hex digits) of a valid `traceparent`, else None (W3C: an invalid one is ignored)."""
    m = _TRACEPARENT.fullmatch(traceparent) if traceparent else None
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32 or m.group(3) == "0" * 16:
        return None
    return m.group(2)


def forwarded(headers: dict) -> dict:
    """What goes upstream of a request's trace headers (lower-case names -> values): its request id (kept or made),
    and its trace context when the traceparent is valid."""
    out = {REQUEST_ID: request_id(headers.get(REQUEST_ID))}
    parent = headers.get(TRACEPARENT)
    if trace_id(parent) is not None:
        out[TRACEPARENT] = parent
        state = headers.get(TRACESTATE)
        if state and len(state) <= MAX_TRACESTATE:
            out[TRACESTATE] = state
    return out


def bind(rid: str, traceparent: Optional[str]) -> None:
    """Stamp the log records of the current task (and the tasks it starts) with this request's ids."""
    fields = {"request_id": rid}
    tid = trace_id(traceparent)
    if tid is not None:
        fields["trace_id"] = tid
    _current.set(fields)


def log_fields() -> Optional[dict]:
    """The ids `bind` set for the request being served, None outside one."""
    return _current.get()
