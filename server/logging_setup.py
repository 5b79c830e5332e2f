"""Structured logging for every warmfleet process: one JSON object (or key=value line) per record.

`log.info("msg", extra={"fields": {...}})` adds keys; uvicorn access records become fields; a record written
while a request is served carries its request_id and trace_id (tracing.py).
The format comes from the caller or WARMFLEET_LOG_FORMAT (json | text); the default is json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Optional

from .tracing import log_fields

_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
# Probes and scrapes answered 200 are noise at info level (kubelets, routers and Prometheus poll them
# several times a second), and so is /ready's 503 while the model loads (load progress is logged
# on its own); they are logged at debug. Any other answer always is.
PROBE_PATHS = frozenset({"/health", "/healthz", "/ready", "/readyz", "/metrics", "/v1/kv/snapshot"})


class ProbeFilter(logging.Filter):
    """Drops uvicorn access records of successful probes unless the logger is at debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.name != "uvicorn.access" or not isinstance(args, tuple) or len(args) != 5:
            return True
        path = str(args[2]).split("?", 1)[0]
        if path in PROBE_PATHS and (args[4] == 200 or (path in ("/ready", "/readyz") and args[4] == 503)):
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


class StructuredFormatter(logging.Formatter):
    def __init__(self, fmt: str = "json"):
        super().__init__()
        self.json = fmt == "json"

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            d.update(zip(_ACCESS_FIELDS, record.args))
        d.update(log_fields() or ())  # the request's ids, inside one (tracing.bind)
        d.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        if self.json:
            return json.dumps(d, default=str, ensure_ascii=False)
        return " ".join(f"{k}={_kv(v)}" for k, v in d.items())


def _kv(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


def setup_logging(level: str = "info", fmt: Optional[str] = None) -> None:
    """Configure the root logger of this process (call once, early)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(fmt or os.environ.get("WARMFLEET_LOG_FORMAT", "json")))
    handler.addFilter(ProbeFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
