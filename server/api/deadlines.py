"""Read deadlines of `warmfleet serve`'s HTTP connections (uvicorn's httptools protocol, extended); no engine import.

uvicorn bounds idle keep-alive connections but not a request being read: a client sending one byte every few
seconds holds a connection, a task and its buffers forever. This protocol gives each request two deadlines,
counted from when the phase began (not between bytes, which a trickling client would reset):

    connection open / first byte of the next request ──head──► headers complete ──body──► body complete
                    │ --request-header-timeout-s                 │ --request-body-timeout-s
                    └─ late: 408 (OpenAI-shaped JSON), connection closed; a body still being read by the app
                       ends for it as a client disconnect, and what it would answer is dropped.

A protocol class is uvicorn's extension point for this (`uvicorn.Config(http=...)`); an ASGI middleware cannot
do it, because the app is called only once the head is complete and it cannot close the socket.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_body


def deadline_protocol(header_timeout_s: float, body_timeout_s: float) -> type["DeadlineHttpProtocol"]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines, in seconds."""
    return type("DeadlineHttpProtocol", (DeadlineHttpProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


def _timeout_response(phase: str, limit_s: float) -> bytes:
    body = json.dumps(error_body(408, f"the request {phase} did not arrive within {limit_s:g} s", code="request_timeout"))
    return (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n{body}").encode()


class DeadlineHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's head and for its body."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0
    _timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head", self.header_timeout_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # the first request's clock started with the connection
            self._arm("head", self.header_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm("body", self.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str, limit_s: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(limit_s, self._expired, phase, limit_s)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str, limit_s: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if phase == "body" and cycle is not None:
            answered = cycle.response_started  # the app answered without waiting for the body
            cycle.disconnected = True  # the app's next read is a disconnect; its response goes nowhere
            cycle.message_event.set()
        else:  # a pipelined head: the previous response may still be streaming; no bytes into its middle
            answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if not answered:
            self.transport.write(_timeout_response(phase, limit_s))
        self.transport.close()
