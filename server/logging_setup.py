"""Structured logging for every warmfleet process: one JSON object per line (or key=value text)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        d.update({k: v for k, v in vars(record).items() if k not in _STD and not k.startswith("_")})
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STD and not k.startswith("_"))
        line = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname.lower():7s} " \
               f"{record.name}: {record.getMessage()}" + (f" {extras}" if extras else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info", fmt: str | None = None) -> None:
    """Configure the root logger once per process; WARMFLEET_LOG_FORMAT=json|text (default text on a tty)."""
    fmt = fmt or os.environ.get("WARMFLEET_LOG_FORMAT") or ("text" if sys.stderr.isatty() else "json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
