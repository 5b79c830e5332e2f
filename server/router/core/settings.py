"""`warmfleet route` flags as dataclasses (the one declaration of their names, defaults, help and checks); no I/O.

Fields carry their flag in `metadata` (server/flagfields.py), in the order `--help` lists them;
`__post_init__` raises ValueError with one readable line for an impossible value. The operator
imports this module to render the router's args, so it must not import fastapi, httpx or zmq.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ... import engine_kinds
from ...config import HASH_ALGOS, CacheConfig, SchedulerConfig, ServerConfig
from ...flagfields import flag_of, opt

LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_node_tier_events(text: str) -> tuple[str, int]:
    """--node-tier-events HOST:PORT (or [v6]:PORT) -> (host, port); ValueError with one readable line."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--node-tier-events takes HOST:PORT, got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class PolicyConfig:
    """How the policy weighs cached prefix against load (policy.py explains each rule)."""

    # a swap-tier block is worth this fraction of a GPU block (it must be copied back)
    cpu_weight: float = field(default=0.5, metadata=opt(
        "--cpu-tier-weight", "Worth of a swap-tier block relative to a GPU block in scoring (0..1)."))
    # a node-tier block (server/nodetier) is worth this fraction of a GPU block until the copy and the prefill are
    # known: below the swap tier's (a copy over the node's TCP, bench/node_tier.py), so local primary > local swap >
    # node tier > cold
    node_weight: float = field(default=0.4, metadata=opt(
        "--node-tier-weight", "Worth of a block held by the replica's node tier relative to a GPU block (0..1; "
        "keep it under --cpu-tier-weight) while the copy or the prefill cost is unknown; once both are (measured, "
        "or the two flags below), the priced worth 1 - copy / recompute replaces it."))
    # priced: a node-tier block is worth 1 - (its copy) / (its recompute), policy.priced_copy_weight; each figure
    # from its flag, else measured (core/pricing.py)
    node_copy_s_per_block: float = field(default=0.0, metadata=opt(
        "--node-tier-copy-s-per-block", "Seconds to load one KV block from the node tier into a replica (0, the "
        "default: the median of what the replicas measure and report in their Load events)."))
    prefill_s_per_token: float = field(default=0.0, metadata=opt(
        "--prefill-s-per-token", "Seconds a replica takes to prefill one prompt token, the recompute a node-tier "
        "copy saves (0, the default: the slope per prefill token the router fits from streamed first tokens)."))
    load_weight: float = field(default=32.0, metadata=opt(  # cached prompt tokens one request of load outweighs
        "--load-weight", "Cached prompt tokens that one in-flight request on a replica outweighs."))
    # cost of one uncached prompt token queued ahead on the replica, in tokens saved, when the prompt's cache is at
    # stake (hits differ by >= warm_min_tokens)
    queue_weight: float = field(default=0.0, metadata=opt(
        "--queue-weight", "Cost, in cached tokens, of one uncached prompt token the routers have queued on a replica "
        "(requests awaiting their first token) when the prompt's cache is at stake; 0 (default) = a warm prefix "
        "stays where it is whatever prefill is queued there (bounded load still applies)."))
    cold_queue_weight: Optional[float] = field(default=1.0, metadata=opt(  # the same when nothing is at stake (None: queue_weight)
        "--cold-queue-weight", "--queue-weight for requests whose cache is not at stake (no replica holds "
        "--warm-min-tokens more of the prompt than another: a new conversation, a prefix every replica holds); "
        "1 = a queued token costs as much as one the request computes itself."))
    epsilon: float = field(default=0.25, metadata=opt(  # bounded load: no replica above (1 + epsilon) x mean load
        "--balance-epsilon", "Bounded load: no replica above (1 + EPS) x mean load while another can take the request."))
    share_epsilon: float = field(default=0.15, metadata=opt(  # share of recent requests within (1 + this) x mean + 1
        "--balance-share-epsilon", "No replica's share of recent requests above (1 + EPS) x the mean + 1 while another "
        "can take the request (keeps request counts even)."))
    warm_slack: int = field(default=1, metadata=opt(  # requests above the caps a replica holding much of the prompt may take
        "--warm-slack", "Requests above the bounded-load cap a replica may take when it holds much more of the prompt "
        "than any replica under the cap (0 = strict bounded load)."))
    warm_inflight_slack: int = field(default=1, metadata=opt(  # beyond warm_slack, above the in-flight bound only
        "--warm-inflight-slack", "Beyond --warm-slack, requests above the in-flight bound (not the share cap) a "
        "replica may take when it holds much more of the prompt than any replica under the caps."))
    common_prefix_free: bool = field(default=True, metadata=opt(  # leading tokens most replicas hold score nothing
        "--common-prefix-free", "The leading tokens of a prompt that more than half of the replicas hold score "
        "nothing, so replicas lacking a prefix every request shares still get new work (default on)."))
    warm_min_tokens: int = field(default=64, metadata=opt(  # tokens beyond the best replica under the cap to use the slack
        "--warm-min-tokens", "Cached prompt tokens a replica must hold beyond the best replica under the cap to use "
        "--warm-slack."))
    share_slack_tokens: int = field(default=128, metadata=opt(  # 0: off; one more share slack per this many warm tokens
        "--share-slack-tokens", "Beyond --warm-slack, one more request of share-cap slack per this many tokens the "
        "best replica holds over the best one under the caps (0: off)."))
    max_share_slack: int = field(default=1, metadata=opt(  # cap on that extra share slack
        "--max-share-slack", "Cap on that extra share-cap slack."))
    # an image whose encoder output is warm on a replica (outside its KV prefix) saves this many prefill tokens per
    # image token: the vision encoder's cost per image token over the prefill's per token (bench/encode_cost.py)
    encoder_weight: float = field(default=0.5, metadata=opt(
        "--encoder-weight", "Prefill tokens saved per image token whose vision-encoder output a replica has cached "
        "(outside the request's cached prefix): encode cost per image token over prefill cost per token, as "
        "bench/encode_cost.py measures it for a checkpoint (0: ignore encoder caches)."))
    adapter_weight: float = field(default=256.0, metadata=opt(  # a resident LoRA adapter, in prompt tokens
        "--adapter-weight", "Prompt tokens a replica that has the request's LoRA adapter resident is worth (no load "
        "into a device slot); the bounded-load caps still spread a hot adapter to more replicas."))
    adapter_share_slack: int = field(default=2, metadata=opt(  # requests above the share cap to keep an adapter home
        "--adapter-share-slack", "Beyond --warm-slack, requests above the share cap a replica with the request's "
        "LoRA adapter resident may take when no replica under the caps has it resident (a spill there would load "
        "the adapter and evict another); the in-flight bound's slack is unchanged."))
    # 0: off; else the samples (streamed first tokens) a fitted TTFT model needs before it replaces the fixed weights
    ttft_model_samples: int = field(default=0, metadata=opt(
        "--ttft-model-samples", "Score replicas by a predicted TTFT fitted online (one fleet shape: fixed cost, per "
        "prefill token, per request of load; times a per-replica slowdown; core/ttft.py), with caps that follow "
        "each replica's speed, once the fleet's streamed requests gave this many first tokens; 0 (default): the "
        "fixed --load-weight and queue weights. Bounded load still applies."))

    def __post_init__(self) -> None:
        if not 0 <= self.cpu_weight <= 1:
            raise ValueError("--cpu-tier-weight must be in [0, 1]")
        if not 0 <= self.node_weight <= 1:
            raise ValueError("--node-tier-weight must be in [0, 1]")
        if self.node_copy_s_per_block < 0 or self.prefill_s_per_token < 0:
            raise ValueError("--node-tier-copy-s-per-block and --prefill-s-per-token must be >= 0")
        if min(self.warm_slack, self.warm_inflight_slack, self.warm_min_tokens, self.share_epsilon,
               self.share_slack_tokens, self.max_share_slack) < 0:
            raise ValueError("--warm-slack, --warm-inflight-slack, --warm-min-tokens, --balance-share-epsilon, "
                             "--share-slack-tokens and --max-share-slack must be >= 0")
        if self.queue_weight < 0 or self.load_weight < 0 or (self.cold_queue_weight or 0) < 0:
            raise ValueError("--queue-weight, --cold-queue-weight and --load-weight must be >= 0")
        if self.ttft_model_samples < 0:
            raise ValueError("--ttft-model-samples must be >= 0")
        if self.adapter_weight < 0 or self.adapter_share_slack < 0:
            raise ValueError("--adapter-weight and --adapter-share-slack must be >= 0")
        if self.encoder_weight < 0:
            raise ValueError("--encoder-weight must be >= 0")
        if self.epsilon < 0:
            raise ValueError("--balance-epsilon must be >= 0")


@dataclass(frozen=True)
class ProxyConfig:
    """How one request is placed cold (router.py) and retried (the HTTP relay, http/proxy.py)."""

    cold_key_blocks: int = field(default=1, metadata=opt(  # leading blocks whose chain hash places a prefix nobody holds
        "--cold-key-blocks", "Leading blocks whose hash places a prefix no replica holds (consistent hashing)."))
    max_attempts: int = field(default=3, metadata=opt(  # replicas tried before the first byte
        "--max-attempts", "Replicas tried before the first byte."))
    connect_timeout_s: float = field(default=1.0, metadata=opt(  # connecting to a replica
        "--connect-timeout-s", "Connect timeout to a replica, seconds."))
    read_timeout_s: float = field(default=600.0, metadata=opt(  # between two bytes of an answer
        "--upstream-timeout-s", "Longest silence from a replica while answering, seconds."))

    def __post_init__(self) -> None:
        if self.cold_key_blocks < 1 or self.max_attempts < 1:
            raise ValueError("--cold-key-blocks and --max-attempts must be >= 1")


@dataclass(frozen=True)
class WarmupConfig:
    """Hot-prefix replay into joining replicas, and what the router remembers for it (warmup.py)."""

    enabled: bool = field(default=True, metadata=opt(
        "--no-warmup", "Route to a joining or restarted replica at once, cold (default: replay the router's hottest "
        "prefixes into it first, within the budgets below).", action="store_false"))
    budget_tokens: int = field(default=65_536, metadata=opt(  # prompt tokens replayed into one joining replica, at most
        "--warmup-budget-tokens", "Prompt tokens replayed into one joining replica before it takes traffic, at most."))
    budget_s: float = field(default=30.0, metadata=opt(  # seconds one warm-up may take
        "--warmup-budget-s", "Seconds a warm-up may take before the replica takes traffic anyway."))
    capacity: int = 1024  # prefixes remembered
    max_tokens: int = 4_000_000  # token ids remembered, in all
    half_life_s: float = 300.0  # hits halve every this many seconds
    concurrency: int = 2  # replay requests in flight per warming replica

    def __post_init__(self) -> None:
        if self.budget_tokens < 0 or self.budget_s < 0:
            raise ValueError("--warmup-budget-tokens and --warmup-budget-s must be >= 0")


@dataclass(frozen=True)
class RouterSettings:
    """Every flag of `warmfleet route`, in `--help` order; groups are the policy, proxy and warm-up knobs."""

    model: str = field(default="", metadata=opt(
        "--model", "Checkpoint directory the replicas serve (tokenizer and chat template are read from it; its "
        "fingerprint roots every block hash).", required=True))
    replicas: list = field(default_factory=list, metadata=opt(  # URL[,events=...] strings (registry.parse_replica)
        "--replica", "A replica's HTTP base URL, optionally with its KV-event endpoint (repeatable).",
        action="append", metavar="URL[,events=tcp://HOST:PORT]"))
    kv_events_port: Optional[int] = field(default=None, metadata=opt(
        "--kv-events-port", "KV-event port of every replica without events=...: tcp://<URL host>:PORT. With "
        "discovery, used when the EndpointSlice names no 'kv-events' port."))
    engine: str = field(default="warmfleet", metadata=opt(  # the replicas' engine kind
        "--engine", "The replicas' engine: how they name KV blocks, publish events and are resynced (fastdeploy "
        "publishes no events: the router predicts from its own decisions).", choices=engine_kinds.KINDS))
    predicted_capacity_blocks: int = field(default=16_384, metadata=opt(  # FastDeploy: blocks per replica predicted
        "--predicted-capacity-blocks", "fastdeploy: KV blocks per replica in the router's predicted cache (set to "
        "the replicas' pool)."))
    predicted_ttl_s: float = field(default=600.0, metadata=opt(  # FastDeploy: age after which a block is forgotten
        "--predicted-ttl-s", "fastdeploy: seconds after which a predicted block is forgotten."))
    index_max_blocks: Optional[int] = field(default=None, metadata=opt(  # KV-index entries per replica (None: unbounded)
        "--index-max-blocks", "Cap on KV-index entries per replica (blocks, GPU + CPU tier); beyond it the index "
        "forgets that replica's least recently stored or routed-to blocks, CPU tier first (about 250 bytes an entry; "
        "default: unbounded, the index mirrors the replicas' pools)."))
    node_tier_events: list = field(default_factory=list, metadata=opt(  # node tiers' KV-event addresses
        "--node-tier-events", "KV-event address of the node tiers (`warmfleet node-tier --events-port`), HOST:PORT "
        "(repeatable); a name that resolves to several addresses (a headless Service) follows each one. Replicas "
        "started with --node-name are paired with their node's tier.", action="append", metavar="HOST:PORT"))
    kv_replay_port: Optional[int] = field(default=None, metadata=opt(
        "--kv-replay-port", "vLLM: event replay (ROUTER) port of every replica without replay=...; with discovery, "
        "used when the EndpointSlice names no 'kv-replay' port."))
    replica_metrics_port: Optional[int] = field(default=None, metadata=opt(
        "--replica-metrics-port", "fastdeploy: Prometheus port of every replica without metrics=... (its "
        "--metrics-port); with discovery, used when the EndpointSlice names no 'metrics' port."))
    vllm_hash_seed: str = field(default="0", metadata=opt(  # "unset": the replicas run without PYTHONHASHSEED
        "--vllm-hash-seed", "vLLM: the replicas' PYTHONHASHSEED (the operator sets 0); 'unset' if they run "
        "without one."))
    media_url_capacity: int = field(default=100_000, metadata=opt(  # (salt, image URL) entries, LRU beyond
        "--media-url-capacity", "http(s) image URLs (per tenant salt) whose mm_hash the router remembers from the "
        "replicas' x-warmfleet-media answers, at most (least recently used forgotten first; ~200 bytes each)."))
    media_url_ttl_s: float = field(default=600.0, metadata=opt(  # an entry older than this is forgotten
        "--media-url-ttl-s", "Seconds after which a learned image URL is forgotten (the object behind it may have "
        "changed; a stale entry only costs a predicted hit, never a wrong one)."))
    kv_events_curve_server_key: Optional[str] = field(default=None, metadata=opt(  # the replicas' public key
        "--kv-events-curve-server-key", "Subscribe to the replicas' KV events (and the node tiers' of "
        "--node-tier-events) over ZMQ CURVE: a certificate file (zmq.auth's format) holding the public key of the "
        "replicas' --kv-events-curve-secret-key (one key for the fleet; node tiers run with the same pair). Needs "
        "--kv-events-curve-secret-key.", metavar="FILE"))
    kv_events_curve_secret_key: Optional[str] = field(default=None, metadata=opt(  # this router's key pair
        "--kv-events-curve-secret-key", "This router's CURVE key pair (a secret certificate file as "
        "zmq.auth.create_certificates writes it); its public key must be in the replicas' (and node tiers') "
        "--kv-events-curve-clients directory.", metavar="FILE"))
    discover_service: Optional[str] = field(default=None, metadata=opt(
        "--discover-service", "Watch the EndpointSlices of this Service for replicas (Ready endpoints only).",
        metavar="NAMESPACE/NAME"))
    discover_port_name: str = field(default="http", metadata=opt(
        "--discover-port-name", "EndpointSlice port name of the HTTP API."))
    discover_events_port_name: str = field(default="kv-events", metadata=opt(
        "--discover-events-port-name", "EndpointSlice port name of the KV-event socket."))
    host: str = field(default="127.0.0.1", metadata=opt("--host", "Address to bind."))
    port: int = field(default=8080, metadata=opt("--port", "Port to bind."))
    block_size: int = field(default=CacheConfig.block_size, metadata=opt(
        flag_of(CacheConfig, "block_size"), "Tokens per KV block; must equal the replicas' (checked against their "
        "snapshots)."))
    prefix_hash_algo: str = field(default=CacheConfig.prefix_hash_algo, metadata=opt(
        flag_of(CacheConfig, "prefix_hash_algo"), "Block-hash digest; must equal the replicas'.", choices=HASH_ALGOS))
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    health_interval_s: float = field(default=0.2, metadata=opt(
        "--health-interval-s", "Active health-check period, seconds."))
    health_passive_max_s: float = field(default=1.0, metadata=opt(  # fleet.py: passive health; 0 = probe every round
        "--health-passive-max-s", "A replica that answered a routed request within the last health interval skips "
        "that round's probe, but is probed at least this often, seconds (0: probe every round)."))
    health_timeout_s: float = field(default=0.5, metadata=opt("--health-timeout-s", "Health-check timeout, seconds."))
    health_failures: int = field(default=2, metadata=opt(  # in a row before a replica leaves; refused: at once
        "--health-failures", "Health checks failed in a row (timeout, non-200) before a replica leaves routing; a "
        "refused connection takes it out at once."))
    max_request_bytes: int = field(default=ServerConfig.max_request_bytes, metadata=opt(  # 413 above, never buffered
        flag_of(ServerConfig, "max_request_bytes"), "Largest request body in bytes; larger ones get a 413 and are "
        "never buffered."))
    max_choices_per_request: Optional[int] = field(default=None, metadata=opt(
        flag_of(SchedulerConfig, "max_choices_per_request"), "Most engine requests one API request may start (prompts "
        "x n in /v1/completions, n in chat); more is the replicas' own 400, answered here before forwarding. Default: "
        "the --engine's own limit: warmfleet 4 x its default --max-num-seqs (256); vllm, fastdeploy: none (they have "
        "no such cap). Set it to the replicas' when they run with another."))
    limit_mm_per_prompt: Optional[str] = field(default=None, metadata=opt(
        flag_of(ServerConfig, "limit_mm_per_prompt"), "Most media items of each kind one request may carry, as JSON "
        "(the replicas' flag, vLLM's forms); more is the replicas' own 400, answered here before any image is read or "
        "fetched. Default: the --engine's own: warmfleet {\"image\": 16}; vllm 999 per modality; fastdeploy: none. "
        "Set it to the replicas' when they run with another."))
    request_header_timeout_s: float = field(default=ServerConfig.request_header_timeout_s, metadata=opt(
        flag_of(ServerConfig, "request_header_timeout_s"), "Seconds a request's head may take to arrive, from the "
        "connection's opening or the request's first byte; later: 408 and the connection is closed."))
    request_body_timeout_s: float = field(default=ServerConfig.request_body_timeout_s, metadata=opt(
        flag_of(ServerConfig, "request_body_timeout_s"), "Seconds a request's body may take to arrive after its head "
        "(a total: a trickling client cannot extend it); later: 408 and the connection is closed."))
    max_concurrent_per_client: int = field(default=0, metadata=opt(  # 0 = unlimited
        "--max-concurrent-per-client", "Open requests per API key (or client address without keys); 0 = unlimited."))
    api_keys: list = field(default_factory=list, metadata=opt(
        "--api-key", "Accepted client key (repeatable; env WARMFLEET_API_KEY). Each key gets its own cache_salt.",
        action="append"))
    api_keys_file: Optional[str] = field(default=None, metadata=opt(
        "--api-keys-file", 'JSON {"key": "salt" or null}; null derives the salt as HMAC-SHA256(secret, key).'))
    salt_secret: Optional[str] = field(default=None, metadata=opt(
        "--salt-secret", "HMAC secret for derived salts (env WARMFLEET_SALT_SECRET); same on every router."))
    replica_api_key: Optional[str] = field(default=None, metadata=opt(  # sent upstream as Bearer
        "--replica-api-key", "Key sent to replicas as Bearer (env WARMFLEET_REPLICA_API_KEY)."))
    admin_key: Optional[str] = field(default=None, metadata=opt(  # None: admin routes open only if no API keys
        "--admin-key", "Bearer key of the admin routes (POST/DELETE /v1/router/replicas/ID/drain, "
        "/v1/router/peer-load, the full /v1/router/replicas; env WARMFLEET_ADMIN_KEY); peer routers share it. "
        "Without it they answer only requests from this host's loopback, and the replicas view is reduced to "
        "counts for anyone else."))
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    peers: Optional[str] = field(default=None, metadata=opt(  # peer routers' base URLs (peers.parse_peers)
        "--peers", "Other router processes in front of the same fleet (base URLs; this router's own URL may be "
        "listed too). Their in-flight load per replica and open requests per client are polled and added to this "
        "router's, so balancing and --max-concurrent-per-client hold fleet-wide.", metavar="URL,URL,..."))
    peer_interval_s: float = field(default=0.1, metadata=opt(
        "--peer-interval-s", "How often peer routers are polled, seconds."))
    peer_jitter: float = field(default=4.0, metadata=opt(  # tie-break noise in recent requests (peers.py: herding)
        "--peer-jitter", "With --peers: random tie-break noise between equally loaded replicas, in recent requests, "
        "so routers sharing one view do not all pick the same replica between two polls (0: off)."))
    peer_partition_tokens: int = field(default=256, metadata=opt(  # peers.PeerLoad.preferred: simultaneous picks
        "--peer-partition-tokens", "With --peers: replicas that are not this router's by rendezvous over the routers "
        "(or are, but above the mean recent share) count this many prompt tokens of queued work more when little is "
        "cached, so routers deciding at the same moment prefer different replicas (0: off)."))
    otlp_traces_endpoint: Optional[str] = field(default=None, metadata=opt(  # server/otel.py
        "--otlp-traces-endpoint", "OTLP/HTTP traces URL (vLLM's flag), e.g. http://collector:4318/v1/traces: a span "
        "per routing decision (chosen replica, reason, predicted cached tokens) continuing the request's traceparent, "
        "whose own traceparent goes upstream. Also on with OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT; needs the tracing "
        "extra.", metavar="URL"))
    log_level: str = field(default="info", metadata=opt("--log-level", None, choices=LOG_LEVELS))

    def __post_init__(self) -> None:
        engine_kinds.check(self.engine)
        if self.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if self.index_max_blocks is not None and self.index_max_blocks < 1:
            raise ValueError("--index-max-blocks must be >= 1")
        if self.predicted_capacity_blocks < 1 or self.predicted_ttl_s <= 0:
            raise ValueError("--predicted-capacity-blocks must be >= 1 and --predicted-ttl-s > 0")
        if self.media_url_capacity < 1 or self.media_url_ttl_s <= 0:
            raise ValueError("--media-url-capacity must be >= 1 and --media-url-ttl-s > 0")
        for a in self.node_tier_events:
            parse_node_tier_events(a)
        if self.health_passive_max_s < 0:
            raise ValueError("--health-passive-max-s must be >= 0")
        if self.health_failures < 1:
            raise ValueError("--health-failures must be >= 1")
        if self.peer_partition_tokens < 0:
            raise ValueError("--peer-partition-tokens must be >= 0")
        if (self.kv_events_curve_server_key is None) != (self.kv_events_curve_secret_key is None):
            raise ValueError("--kv-events-curve-server-key and --kv-events-curve-secret-key go together")
        if self.max_choices_per_request is not None and self.max_choices_per_request < 1:
            raise ValueError("--max-choices-per-request must be >= 1")
        self.mm_limits()  # raises ValueError naming a malformed --limit-mm-per-prompt
        if self.request_header_timeout_s <= 0 or self.request_body_timeout_s <= 0:
            raise ValueError("--request-header-timeout-s and --request-body-timeout-s must be > 0")
        if self.peer_interval_s <= 0 or self.peer_jitter < 0:
            raise ValueError("--peer-interval-s must be > 0 and --peer-jitter >= 0")

    def mm_limits(self) -> dict[str, int]:
        """--limit-mm-per-prompt as given (modality -> count; {} when unset: the engine's defaults apply)."""
        return {} if self.limit_mm_per_prompt is None else engine_kinds.parse_mm_limits(self.limit_mm_per_prompt)

    @property
    def choice_limit(self) -> Optional[int]:
        """--max-choices-per-request, else the --engine's default (None: no cap)."""
        if self.max_choices_per_request is not None:
            return self.max_choices_per_request
        return engine_kinds.REQUEST_LIMITS[self.engine].max_choices()

    @property
    def image_limit(self) -> Optional[int]:
        """Most image parts per request: --limit-mm-per-prompt's "image", else the --engine's default (None: none)."""
        return engine_kinds.REQUEST_LIMITS[self.engine].mm_limit(self.mm_limits(), "image")

    @property
    def hash_seed(self) -> Optional[str]:
        """The vLLM replicas' PYTHONHASHSEED, None for 'unset'."""
        return None if self.vllm_hash_seed == "unset" else self.vllm_hash_seed
