"""What a router process runs, built from its settings (RouterRuntime) and started around a front door (`running`)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import httpx

from ... import flagfields
from ...hashing import model_fingerprint
from .discovery import EndpointSliceDiscovery
from .engines import dialect_for
from .fleet import Fleet
from .metrics import RouterMetrics
from .peers import PeerLoad, parse_peers
from .prompt import HashConfig, PromptRenderer
from .registry import ReplicaSpec, parse_replica
from .router import Router
from .settings import RouterSettings
from .subscriber import CurveKeys
from .tenants import Tenants
from .url_memo import UrlHashMemo

Discovery = Callable[[Fleet], Awaitable[None]]  # runs until cancelled, calling fleet.set_members


@dataclass
class RouterRuntime:
    """What a front door runs: the settings (every flag) and what was built from them."""

    hash_cfg: HashConfig  # block size, digest and the model's fingerprint
    settings: RouterSettings = field(default_factory=RouterSettings)
    replicas: list[ReplicaSpec] = field(default_factory=list)  # static members (--replica)
    renderer: Optional[PromptRenderer] = None  # None: route by load and cold hashing of nothing (tests only)
    tenants: Tenants = field(default_factory=lambda: Tenants({}))
    discovery: Optional[Discovery] = None
    peers: list[str] = field(default_factory=list)  # peer routers' base URLs (--peers): load and client limits shared
    freeze_gc: bool = False  # gc.freeze() once started (`warmfleet route` sets it; a process-wide act, not for tests)
    event_curve: Optional[CurveKeys] = None  # KV events over CURVE (--kv-events-curve-*), read at startup
    spans: Any = None  # otel.Spans of --otlp-traces-endpoint / OTEL_EXPORTER_OTLP_*ENDPOINT; None: no tracing


def settings_from_args(args: argparse.Namespace, cls: type = RouterSettings) -> RouterSettings:
    """The flags as RouterSettings (or the front door's subclass `cls`; validated), with the environment's keys where
    a flag gives none."""
    s: RouterSettings = flagfields.from_namespace(args, cls)
    return replace(s, replica_api_key=s.replica_api_key or os.environ.get("WARMFLEET_REPLICA_API_KEY"),
                   admin_key=s.admin_key or os.environ.get("WARMFLEET_ADMIN_KEY"))


def runtime_from_settings(s: RouterSettings) -> RouterRuntime:
    """Build what the router runs from its settings: members, discovery, tokenizer, tenants, peers."""
    if not s.replicas and not s.discover_service:
        raise ValueError("give at least one --replica URL or --discover-service NAMESPACE/NAME")
    keys = list(s.api_keys)
    if os.environ.get("WARMFLEET_API_KEY"):
        keys.append(os.environ["WARMFLEET_API_KEY"])
    discovery = None
    if s.discover_service:
        discovery = EndpointSliceDiscovery.from_flag(s.discover_service, s.discover_port_name,
                                                     s.discover_events_port_name, s.kv_events_port,
                                                     s.kv_replay_port, s.replica_metrics_port).run
    return RouterRuntime(
        hash_cfg=HashConfig(s.block_size, model_fingerprint(s.model), s.prefix_hash_algo),
        settings=s,
        replicas=[parse_replica(r, s.kv_events_port, s.kv_replay_port, s.replica_metrics_port) for r in s.replicas],
        renderer=PromptRenderer(s.model, hash_algo=s.prefix_hash_algo,
                                urls=UrlHashMemo(s.media_url_capacity, s.media_url_ttl_s)),
        tenants=Tenants.from_flags(keys, s.api_keys_file, s.salt_secret or os.environ.get("WARMFLEET_SALT_SECRET")),
        discovery=discovery,
        peers=parse_peers(s.peers),
        event_curve=(CurveKeys.from_files(s.kv_events_curve_server_key, s.kv_events_curve_secret_key)
                     if s.kv_events_curve_server_key else None),
    )


def upstream_headers(settings: RouterSettings) -> dict:
    """Headers every request to a replica carries: the replica key as Bearer, if one is set."""
    return {"authorization": f"Bearer {settings.replica_api_key}"} if settings.replica_api_key else {}


@asynccontextmanager
async def running(rt: RouterRuntime, metrics: RouterMetrics,
                  peers: Optional[PeerLoad] = None) -> AsyncIterator[Router]:
    """The core of one router process, started: the fleet (members, health checks, event feeds, warm-up), discovery
    and peer polling; yields the Router a front door asks, and stops them all when the door closes."""
    settings = rt.settings
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    fleet = Fleet(http, metrics, health_interval_s=settings.health_interval_s,
                  health_timeout_s=settings.health_timeout_s, health_passive_max_s=settings.health_passive_max_s,
                  health_failures=settings.health_failures, model_fingerprint=rt.hash_cfg.model_fingerprint,
                  block_size=rt.hash_cfg.block_size, upstream_headers=upstream_headers(settings),
                  dialect=dialect_for(settings), warmup=settings.warmup,
                  index_max_blocks=settings.index_max_blocks, event_curve=rt.event_curve)
    nodes = None
    if settings.node_tier_events:
        from .node_tiers import NodeTiers

        nodes = fleet.node_tiers = NodeTiers(settings.node_tier_events, fleet.index, curve=rt.event_curve)
    router = Router(fleet, rt.renderer, rt.hash_cfg, metrics, settings.policy, settings.proxy.cold_key_blocks)
    router.peers = peers
    await fleet.set_members(rt.replicas)
    await fleet.start()
    if rt.freeze_gc:
        # what is loaded by now (tokenizer, FastAPI, pydantic: ~85k objects) lives as long as the process; out
        # of the collector's reach, a full collection no longer walks it (35-55 ms a pass under load before:
        # a p99 spike every few seconds; 2-3 ms after; docs/scale.md)
        gc.freeze()
    disc = asyncio.create_task(rt.discovery(fleet)) if rt.discovery else None
    node_feeds = asyncio.create_task(nodes.run()) if nodes is not None else None
    gossip = asyncio.create_task(peers.run()) if peers else None
    try:
        yield router
    finally:
        if gossip is not None:
            gossip.cancel()
            await asyncio.gather(gossip, return_exceptions=True)
        for task in (disc, node_feeds):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if nodes is not None:
            await nodes.stop()
        await fleet.stop()
        router.close()
        await http.aclose()
