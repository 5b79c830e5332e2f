"""The replica's span per request (server/otel.py): ASGI middleware `warmfleet serve` installs only when it traces."""

from __future__ import annotations

from typing import Any

from .. import otel

_TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}
_UNTRACED = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: no span


class RequestSpans:
    """Outermost middleware: one SERVER span per API request, the child of its `traceparent` (the router's or
    picker's decision span, or the client's), ended when the answer's last byte is sent; it carries the replica,
    the request id the replica answered with and the HTTP status."""

    def __init__(self, app: Any, spans: otel.Spans, replica_id: str):
        self.app, self.spans, self.replica_id = app, spans, replica_id

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNTRACED:
            await self.app(scope, receive, send)
            return
        parent = {_TRACE_HEADERS[k]: v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
        spans = self.spans
        attributes = {"http.request.method": scope.get("method", ""), "url.path": scope.get("path", ""),
                      otel.REPLICA: self.replica_id}
        span = spans.start("warmfleet.request", parent, attributes)

        async def send_observed(message: dict) -> None:
            if message["type"] == "http.response.start":
                spans.error(span, message["status"])
                rid = next((v for k, v in message.get("headers", ()) if k == b"x-request-id"), None)
                if rid is not None:
                    span.set_attribute(otel.REQUEST_ID, rid.decode("latin-1"))
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            span.end()
