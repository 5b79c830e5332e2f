"""`warmfleet route`: flags → RouterSettings → RouterRuntime (core/runtime.py) → uvicorn; nothing heavy until run()."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from ... import flagfields, otel
from ..core.settings import RouterSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    flagfields.add_arguments(p, RouterSettings)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ...logging_setup import setup_logging
    from ..core.runtime import runtime_from_settings, settings_from_args
    from .app import build_app
    from .hotpath import hot_protocol

    settings = settings_from_args(args)
    spans = otel.start("warmfleet-router", settings.otlp_traces_endpoint)  # TracingUnavailable: one line, exit 2
    setup_logging(settings.log_level)
    if settings.log_level != "debug":  # one line per health check per replica every 0.2 s is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(replace(runtime_from_settings(settings), freeze_gc=True, spans=spans))
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                    http=hot_protocol(app.frontend, settings.request_header_timeout_s, settings.request_body_timeout_s))
    finally:
        if spans is not None:
            spans.shutdown()  # the last batch of spans leaves before the process does
    return 0
