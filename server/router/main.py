"""`warmfleet route`: flags → RouterSettings → uvicorn; imports nothing heavy until run()."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace

from ..config import CacheConfig, ServerConfig, flag_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    cache = CacheConfig()
    p.add_argument("--model", required=True, help="Checkpoint directory the replicas serve (tokenizer and "
                   "chat template are read from it; its fingerprint roots every block hash).")
    p.add_argument("--replica", action="append", default=[], metavar="URL[,events=tcp://HOST:PORT]",
                   help="A replica's HTTP base URL, optionally with its KV-event endpoint (repeatable).")
    p.add_argument("--kv-events-port", type=int, default=None,
                   help="KV-event port of every replica without events=...: tcp://<URL host>:PORT. "
                        "With discovery, used when the EndpointSlice names no 'kv-events' port.")
    p.add_argument("--engine", default="warmfleet", choices=("warmfleet", "vllm", "fastdeploy"),
                   help="The replicas' engine: how they name KV blocks, publish events and are resynced "
                        "(fastdeploy publishes no events: the router predicts from its own decisions).")
    p.add_argument("--predicted-capacity-blocks", type=int, default=16_384,
                   help="fastdeploy: KV blocks per replica in the router's predicted cache (set to the replicas' pool).")
    p.add_argument("--predicted-ttl-s", type=float, default=600.0,
                   help="fastdeploy: seconds after which a predicted block is forgotten.")
    p.add_argument("--index-max-blocks", type=int, default=None,
                   help="Cap on KV-index entries per replica (blocks, GPU + CPU tier); beyond it the index forgets "
                        "that replica's least recently stored or routed-to blocks, CPU tier first (about 250 bytes "
                        "an entry; default: unbounded, the index mirrors the replicas' pools).")
    p.add_argument("--kv-replay-port", type=int, default=None,
                   help="vLLM: event replay (ROUTER) port of every replica without replay=...; with discovery, "
                        "used when the EndpointSlice names no 'kv-replay' port.")
    p.add_argument("--replica-metrics-port", type=int, default=None,
                   help="fastdeploy: Prometheus port of every replica without metrics=... (its --metrics-port); "
                        "with discovery, used when the EndpointSlice names no 'metrics' port.")
    p.add_argument("--vllm-hash-seed", default="0",
                   help="vLLM: the replicas' PYTHONHASHSEED (the operator sets 0); 'unset' if they run without one.")
    p.add_argument("--discover-service", default=None, metavar="NAMESPACE/NAME",
                   help="Watch the EndpointSlices of this Service for replicas (Ready endpoints only).")
    p.add_argument("--discover-port-name", default="http", help="EndpointSlice port name of the HTTP API.")
    p.add_argument("--discover-events-port-name", default="kv-events",
                   help="EndpointSlice port name of the KV-event socket.")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    p.add_argument("--port", type=int, default=8080, help="Port to bind.")
    p.add_argument(flag_of(CacheConfig, "block_size"), type=int, default=cache.block_size,
                   help="Tokens per KV block; must equal the replicas' (checked against their snapshots).")
    p.add_argument(flag_of(CacheConfig, "prefix_hash_algo"), default=cache.prefix_hash_algo,
                   choices=("blake3", "sha256", "xxhash"), help="Block-hash digest; must equal the replicas'.")
    p.add_argument("--cpu-tier-weight", type=float, default=0.5,
                   help="Worth of a swap-tier block relative to a GPU block in scoring (0..1).")
    p.add_argument("--load-weight", type=float, default=32.0,
                   help="Cached prompt tokens that one in-flight request on a replica outweighs.")
    p.add_argument("--queue-weight", type=float, default=0.0,
                   help="Cost, in cached tokens, of one uncached prompt token the routers have queued on a replica "
                        "(requests awaiting their first token) when the prompt's cache is at stake; 0 (default) = "
                        "a warm prefix stays where it is whatever prefill is queued there (bounded load still applies).")
    p.add_argument("--cold-queue-weight", type=float, default=1.0,
                   help="--queue-weight for requests whose cache is not at stake (no replica holds --warm-min-tokens "
                        "more of the prompt than another: a new conversation, a prefix every replica holds); 1 = a "
                        "queued token costs as much as one the request computes itself.")
    p.add_argument("--balance-epsilon", type=float, default=0.25,
                   help="Bounded load: no replica above (1 + EPS) x mean load while another can take the request.")
    p.add_argument("--balance-share-epsilon", type=float, default=0.15,
                   help="No replica's share of recent requests above (1 + EPS) x the mean + 1 while another can "
                        "take the request (keeps request counts even).")
    p.add_argument("--warm-slack", type=int, default=1,
                   help="Requests above the bounded-load cap a replica may take when it holds much more of the "
                        "prompt than any replica under the cap (0 = strict bounded load).")
    p.add_argument("--warm-inflight-slack", type=int, default=1,
                   help="Beyond --warm-slack, requests above the in-flight bound (not the share cap) a replica "
                        "may take when it holds much more of the prompt than any replica under the caps.")
    p.add_argument("--common-prefix-free", action=argparse.BooleanOptionalAction, default=True,
                   help="The leading tokens of a prompt that more than half of the replicas hold score nothing, so "
                        "replicas lacking a prefix every request shares still get new work (default on).")
    p.add_argument("--warm-min-tokens", type=int, default=64,
                   help="Cached prompt tokens a replica must hold beyond the best replica under the cap to use "
                        "--warm-slack.")
    p.add_argument("--share-slack-tokens", type=int, default=128,
                   help="Beyond --warm-slack, one more request of share-cap slack per this many tokens the best "
                        "replica holds over the best one under the caps (0: off).")
    p.add_argument("--max-share-slack", type=int, default=1, help="Cap on that extra share-cap slack.")
    p.add_argument("--cold-key-blocks", type=int, default=1,
                   help="Leading blocks whose hash places a prefix no replica holds (consistent hashing).")
    p.add_argument("--max-attempts", type=int, default=3, help="Replicas tried before the first byte.")
    p.add_argument("--connect-timeout-s", type=float, default=1.0, help="Connect timeout to a replica, seconds.")
    p.add_argument("--upstream-timeout-s", type=float, default=600.0,
                   help="Longest silence from a replica while answering, seconds.")
    p.add_argument("--health-interval-s", type=float, default=0.2, help="Active health-check period, seconds.")
    p.add_argument("--health-timeout-s", type=float, default=0.5, help="Health-check timeout, seconds.")
    p.add_argument("--health-failures", type=int, default=2,
                   help="Health checks failed in a row (timeout, non-200) before a replica leaves routing; "
                        "a refused connection takes it out at once.")
    p.add_argument(flag_of(ServerConfig, "max_request_bytes"), type=int, default=ServerConfig().max_request_bytes,
                   help="Largest request body in bytes; larger ones get a 413 and are never buffered.")
    p.add_argument("--max-concurrent-per-client", type=int, default=0,
                   help="Open requests per API key (or client address without keys); 0 = unlimited.")
    p.add_argument("--api-key", action="append", default=[],
                   help="Accepted client key (repeatable; env WARMFLEET_API_KEY). Each key gets its own cache_salt.")
    p.add_argument("--api-keys-file", default=None,
                   help='JSON {"key": "salt" or null}; null derives the salt as HMAC-SHA256(secret, key).')
    p.add_argument("--salt-secret", default=None,
                   help="HMAC secret for derived salts (env WARMFLEET_SALT_SECRET); same on every router.")
    p.add_argument("--replica-api-key", default=None,
                   help="Key sent to replicas as Bearer (env WARMFLEET_REPLICA_API_KEY).")
    p.add_argument("--admin-key", default=None,
                   help="Bearer key of the admin routes (POST/DELETE /v1/router/replicas/ID/drain; env "
                        "WARMFLEET_ADMIN_KEY). Without it they are open only while the router checks no API keys.")
    p.add_argument("--no-warmup", action="store_true",
                   help="Route to a joining or restarted replica at once, cold (default: replay the router's hottest "
                        "prefixes into it first, within the budgets below).")
    p.add_argument("--warmup-budget-tokens", type=int, default=65_536,
                   help="Prompt tokens replayed into one joining replica before it takes traffic, at most.")
    p.add_argument("--warmup-budget-s", type=float, default=30.0,
                   help="Seconds a warm-up may take before the replica takes traffic anyway.")
    p.add_argument("--peers", default=None, metavar="URL,URL,...",
                   help="Other router processes in front of the same fleet (base URLs; this router's own URL may be "
                        "listed too). Their in-flight load per replica and open requests per client are polled and "
                        "added to this router's, so balancing and --max-concurrent-per-client hold fleet-wide.")
    p.add_argument("--peer-interval-s", type=float, default=0.1, help="How often peer routers are polled, seconds.")
    p.add_argument("--peer-jitter", type=float, default=4.0,
                   help="With --peers: random tie-break noise between equally loaded replicas, in recent requests, so "
                        "routers sharing one view do not all pick the same replica between two polls (0: off).")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def settings_from_args(args: argparse.Namespace):
    """Validate flags and build RouterSettings (loads the tokenizer)."""
    from ..hashing import model_fingerprint
    from .app import RouterSettings
    from .auth import Tenants
    from .policy import PolicyConfig
    from .prompt import HashConfig, PromptRenderer
    from .proxy import ProxyConfig
    from .peers import parse_peers
    from .warmup import WarmupConfig
    from .registry import parse_replica

    if not args.replica and not args.discover_service:
        raise ValueError("give at least one --replica URL or --discover-service NAMESPACE/NAME")
    if args.block_size < 1:
        raise ValueError("--block-size must be >= 1")
    if not 0 <= args.cpu_tier_weight <= 1:
        raise ValueError("--cpu-tier-weight must be in [0, 1]")
    if (args.warm_slack < 0 or args.warm_inflight_slack < 0 or args.warm_min_tokens < 0
            or args.balance_share_epsilon < 0 or args.share_slack_tokens < 0 or args.max_share_slack < 0):
        raise ValueError("--warm-slack, --warm-inflight-slack, --warm-min-tokens, --share-slack-tokens and "
                         "--max-share-slack must be >= 0")
    if args.warmup_budget_tokens < 0 or args.warmup_budget_s < 0:
        raise ValueError("--warmup-budget-tokens and --warmup-budget-s must be >= 0")
    if args.index_max_blocks is not None and args.index_max_blocks < 1:
        raise ValueError("--index-max-blocks must be >= 1")
    if args.predicted_capacity_blocks < 1 or args.predicted_ttl_s <= 0:
        raise ValueError("--predicted-capacity-blocks must be >= 1 and --predicted-ttl-s > 0")
    if args.queue_weight < 0 or args.load_weight < 0 or (args.cold_queue_weight or 0) < 0:
        raise ValueError("--queue-weight, --cold-queue-weight and --load-weight must be >= 0")
    if args.balance_epsilon < 0 or args.cold_key_blocks < 1 or args.max_attempts < 1 or args.health_failures < 1:
        raise ValueError("--balance-epsilon must be >= 0, --cold-key-blocks, --max-attempts and --health-failures >= 1")
    if args.peer_interval_s <= 0 or args.peer_jitter < 0:
        raise ValueError("--peer-interval-s must be > 0 and --peer-jitter >= 0")
    keys = list(args.api_key)
    if os.environ.get("WARMFLEET_API_KEY"):
        keys.append(os.environ["WARMFLEET_API_KEY"])
    discovery = None
    if args.discover_service:
        from .discovery import EndpointSliceDiscovery

        discovery = EndpointSliceDiscovery.from_flag(args.discover_service, args.discover_port_name,
                                                     args.discover_events_port_name, args.kv_events_port,
                                                     args.kv_replay_port, args.replica_metrics_port).run
    return RouterSettings(
        hash_cfg=HashConfig(args.block_size, model_fingerprint(args.model), args.prefix_hash_algo),
        replicas=[parse_replica(r, args.kv_events_port, args.kv_replay_port, args.replica_metrics_port)
                  for r in args.replica],
        renderer=PromptRenderer(args.model, hash_algo=args.prefix_hash_algo),
        policy=PolicyConfig(cpu_weight=args.cpu_tier_weight, load_weight=args.load_weight,
                            queue_weight=args.queue_weight, cold_queue_weight=args.cold_queue_weight, epsilon=args.balance_epsilon, warm_slack=args.warm_slack,
                            warm_min_tokens=args.warm_min_tokens, share_epsilon=args.balance_share_epsilon,
                            share_slack_tokens=args.share_slack_tokens, max_share_slack=args.max_share_slack,
                            warm_inflight_slack=args.warm_inflight_slack, common_prefix_free=args.common_prefix_free),
        proxy=ProxyConfig(max_attempts=args.max_attempts, connect_timeout_s=args.connect_timeout_s,
                          read_timeout_s=args.upstream_timeout_s, cold_key_blocks=args.cold_key_blocks),
        tenants=Tenants.from_flags(keys, args.api_keys_file,
                                   args.salt_secret or os.environ.get("WARMFLEET_SALT_SECRET")),
        max_concurrent_per_client=args.max_concurrent_per_client,
        max_request_bytes=args.max_request_bytes,
        replica_api_key=args.replica_api_key or os.environ.get("WARMFLEET_REPLICA_API_KEY"),
        admin_key=args.admin_key or os.environ.get("WARMFLEET_ADMIN_KEY"),
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        health_failures=args.health_failures,
        discovery=discovery,
        engine=args.engine,
        vllm_hash_seed=None if args.vllm_hash_seed == "unset" else args.vllm_hash_seed,
        predicted_capacity_blocks=args.predicted_capacity_blocks,
        predicted_ttl_s=args.predicted_ttl_s,
        index_max_blocks=args.index_max_blocks,
        warmup=WarmupConfig(enabled=not args.no_warmup, budget_tokens=args.warmup_budget_tokens,
                            budget_s=args.warmup_budget_s),
        peers=parse_peers(args.peers),
        peer_interval_s=args.peer_interval_s,
        peer_jitter=args.peer_jitter,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..logging_setup import setup_logging
    from .app import build_app
    from .transport import coalescing_protocol

    setup_logging(args.log_level)
    if args.log_level != "debug":  # one line per health check per replica every 0.2 s is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(replace(settings_from_args(args), freeze_gc=True))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                http=coalescing_protocol())
    return 0
