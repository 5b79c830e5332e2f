"""Structured logs: probes and scrapes answered 200 stay out of info-level logs; everything else stays in."""

import json
import logging

from warmfleet.server.logging_setup import setup_logging


def access(path: str, status: int) -> None:
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1", status)


def lines(capsys) -> list[dict]:
    return [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]


def test_probe_access_records_only_at_debug(capsys):
    try:
        setup_logging("info", "json")
        for path, status in (("/health", 200), ("/ready", 200), ("/ready", 503), ("/metrics", 200), ("/health", 503),
                             ("/v1/chat/completions", 200), ("/ready?x=1", 200)):
            access(path, status)
        got = [(d["path"], d["status"]) for d in lines(capsys)]
        assert got == [("/health", 503), ("/v1/chat/completions", 200)]
        setup_logging("debug", "json")
        access("/health", 200)
        assert [(d["path"], d["status"]) for d in lines(capsys)] == [("/health", 200)]
    finally:
        logging.getLogger().handlers[:] = []
        logging.getLogger().setLevel(logging.WARNING)
