"""What an OpenTelemetry routing-decision span costs the router per request (server/otel.py), CPU microseconds.

    python -P bench/otel_span_cost.py [--requests 20000] [--rounds 5]

In-process, on the SDK as `warmfleet route --otlp-traces-endpoint` runs it (a BatchSpanProcessor), with an exporter
that drops what it is given (the collector's network cost is off the request path: the batch leaves on the SDK's
own thread). Per request, what Frontend._respond_traced adds: the span started as the child of a client
traceparent, its own traceparent handed on, the decision's attributes set, the status recorded, the span ended.
Off, the router tests `spans is None` once. Prints one JSON line: per round CPU us per request (process time, so
the export thread counts too), their median, and the off path's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from warmfleet.server import otel

PARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "x-request-id": "r"}


class DroppingExporter(SpanExporter):
    """Takes each batch and drops it (counts spans, so the work is not optimised away)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def traced_round(spans: otel.Spans, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        forward = dict(PARENT)
        span = spans.start("warmfleet.route", forward, {otel.REQUEST_ID: "r", "url.path": "/v1/chat/completions"})
        spans.hand_on(span, forward)
        span.set_attributes(otel.route_header_attributes("http://10.0.0.7:8000",
                                                         "prefix_hit; predicted_cached_tokens=512"))
        spans.error(span, 200)
        span.end()
    spans.provider.force_flush()
    return (time.process_time() - t0) / n * 1e6


def off_round(n: int) -> float:
    spans = None
    t0 = time.process_time()
    hits = 0
    for _ in range(n):
        if spans is not None:
            hits += 1
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    exporter = DroppingExporter()
    spans = otel.start("warmfleet-router", exporter=exporter)
    traced_round(spans, 1000)  # warm-up
    on = [traced_round(spans, a.requests) for _ in range(a.rounds)]
    off = [off_round(a.requests) for _ in range(a.rounds)]
    spans.shutdown()
    print(json.dumps({"requests_per_round": a.requests, "span_cpu_us_per_request": [round(x, 2) for x in on],
                      "span_cpu_us_median": round(statistics.median(on), 2),
                      "off_cpu_us_median": round(statistics.median(off), 4), "spans_exported": exporter.spans}))


if __name__ == "__main__":
    main()
