"""FakeRouter: a loopback HTTP server answering a router's /metrics (the real RouterMetrics, scripted) and
/v1/router/replicas (a scripted list), for the autoscaler's tests; runs in a thread, so sync and async tests
and an operator in another process can all scrape it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from warmfleet.server.router.core.metrics import RouterMetrics


class FakeRouter:
    """Set `metrics` (a real RouterMetrics) and `replicas` (the /v1/router/replicas list) to script a router."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.replicas: list[dict[str, Any]] = []
        self.scrapes = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/metrics":
                    owner.scrapes += 1
                    self._send(owner.metrics.render(), "text/plain; version=0.0.4")
                elif self.path == "/v1/router/replicas":
                    self._send(json.dumps({"replicas": owner.replicas}).encode(), "application/json")
                else:
                    self.send_error(404)

            def _send(self, body: bytes, ctype: str) -> None:
                self.send_response(200)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-router", daemon=True)

    def set_queued(self, tokens_by_replica: dict[str, float]) -> None:
        """Queued prefill tokens per replica, as the router's gauge reports them."""
        for rid, n in tokens_by_replica.items():
            self.metrics.replica_queued_tokens.labels(rid).set(n)

    def replica(self, rid: str, *, state: str = "ready", gpu_blocks: int = 0, cpu_blocks: int = 0,
                last_warmup: dict[str, Any] | None = None) -> dict[str, Any]:
        """One entry of /v1/router/replicas in the router's own shape."""
        return {"id": rid, "state": state, "healthy": state != "down", "gpu_blocks": gpu_blocks,
                "cpu_blocks": cpu_blocks, "last_warmup": last_warmup, "in_flight": 0, "synced": True}

    def __enter__(self) -> "FakeRouter":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
