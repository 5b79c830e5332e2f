"""`warmfleet route`: flags → RouterSettings (settings.py) → RouterRuntime → uvicorn; nothing heavy until run()."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace

from .. import flagfields
from .settings import RouterSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    flagfields.add_arguments(p, RouterSettings)


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """The flags as RouterSettings (validated), with the environment's keys where a flag gives none."""
    s: RouterSettings = flagfields.from_namespace(args, RouterSettings)
    return replace(s, replica_api_key=s.replica_api_key or os.environ.get("WARMFLEET_REPLICA_API_KEY"),
                   admin_key=s.admin_key or os.environ.get("WARMFLEET_ADMIN_KEY"))


def runtime_from_settings(s: RouterSettings):
    """Build what the router runs from its settings: members, discovery, tokenizer, tenants, peers."""
    from ..hashing import model_fingerprint
    from .app import RouterRuntime
    from .auth import Tenants
    from .peers import parse_peers
    from .prompt import HashConfig, PromptRenderer
    from .registry import parse_replica

    if not s.replicas and not s.discover_service:
        raise ValueError("give at least one --replica URL or --discover-service NAMESPACE/NAME")
    keys = list(s.api_keys)
    if os.environ.get("WARMFLEET_API_KEY"):
        keys.append(os.environ["WARMFLEET_API_KEY"])
    discovery = None
    if s.discover_service:
        from .discovery import EndpointSliceDiscovery

        discovery = EndpointSliceDiscovery.from_flag(s.discover_service, s.discover_port_name,
                                                     s.discover_events_port_name, s.kv_events_port,
                                                     s.kv_replay_port, s.replica_metrics_port).run
    return RouterRuntime(
        hash_cfg=HashConfig(s.block_size, model_fingerprint(s.model), s.prefix_hash_algo),
        settings=s,
        replicas=[parse_replica(r, s.kv_events_port, s.kv_replay_port, s.replica_metrics_port) for r in s.replicas],
        renderer=PromptRenderer(s.model, hash_algo=s.prefix_hash_algo),
        tenants=Tenants.from_flags(keys, s.api_keys_file, s.salt_secret or os.environ.get("WARMFLEET_SALT_SECRET")),
        discovery=discovery,
        peers=parse_peers(s.peers),
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..logging_setup import setup_logging
    from .app import build_app
    from .transport import coalescing_protocol

    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    if settings.log_level != "debug":  # one line per health check per replica every 0.2 s is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(replace(runtime_from_settings(settings), freeze_gc=True))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                http=coalescing_protocol())
    return 0
