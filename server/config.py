"""`warmfleet serve` flags as dataclasses: the one source of flag names and units (contract 3); no paddle, nothing of attention/.

The operator imports this module to render pod args, so a renamed flag breaks a unit test,
not a cluster. Every field carries its flag, help text and unit in `metadata` (server/flagfields.py
turns them into argparse flags and back into args). Names that another package registers (attention backends)
are checked where that package is asked for them (attention/registry.py `check`, called by serve and LLM).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Optional

from . import flagfields
from .flagfields import flag_of, opt  # noqa: F401  (flag_of: re-exported, the operator reads flag names here)

GiB = 1 << 30
DEFAULT_MAX_REQUEST_BYTES = 64 << 20  # also the router's default

HASH_ALGOS = ("blake3", "sha256", "xxhash")
MM_MODALITIES = ("image", "video", "audio")  # --limit-mm-per-prompt's keys, as vLLM's
DEFAULT_LIMIT_MM_PER_PROMPT = '{"image": 16}'
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # --media-max-pixels
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each --dtype
DTYPES = tuple(DTYPE_BYTES)
DEFAULT_ATTENTION_BACKEND = "cpu"  # a name in attention/registry.py BACKENDS (tests/test_attention.py checks)


@dataclass
class ModelConfig:
    model: str = field(default="", metadata=opt("--model", "Hugging Face checkpoint directory."))
    served_model_name: Optional[str] = field(
        default=None, metadata=opt("--served-model-name", "Name clients use in `model` (default: the directory name).")
    )
    dtype: str = field(default="float32", metadata=opt("--dtype", "Weight and activation dtype.", choices=DTYPES))
    max_model_len: Optional[int] = field(
        default=None, metadata=opt("--max-model-len", "Context length in tokens (default: the checkpoint's).")
    )
    seed: int = field(default=0, metadata=opt("--seed", "Seed for sampling without a request seed."))
    engine_cpus: Optional[str] = field(
        default=None,
        metadata=opt("--engine-cpus", "CPUs the engine-core process runs on, as a list like 0 or 0-3,6 (default: "
                      "not pinned). The API process stays unpinned, as vLLM pins only its CPU worker."),
    )
    engine_threads: int = field(
        default=1,
        metadata=opt("--engine-threads", "Math threads (MKL/OpenMP) of the engine-core process; the API process "
                      "runs no math. 1 leaves the other cores to the API process, as vLLM's CPU worker does."),
    )
    attention_backend: str = field(
        default=DEFAULT_ATTENTION_BACKEND,
        metadata=opt("--attention-backend", "Attention backend by name (registered in server/attention/registry.py)."),
    )


@dataclass
class CacheConfig:
    block_size: int = field(default=64, metadata=opt("--block-size", "Tokens per KV block."))
    num_gpu_blocks: Optional[int] = field(
        default=None, metadata=opt("--num-gpu-blocks", "Blocks in the primary KV pool (overrides the memory budget).")
    )
    kv_cache_memory: Optional[float] = field(
        default=None, metadata=opt("--kv-cache-memory", "Primary KV pool budget in GiB when running on CPU.")
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=opt("--gpu-memory-utilization", "Fraction of GPU memory the engine may use (GPU only).")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=opt("--enable-prefix-caching", "Reuse cached KV blocks across requests.")
    )
    swap_space: float = field(
        default=0.0, metadata=opt("--swap-space", "CPU swap tier for evicted KV blocks, in GiB (0 disables).")
    )
    node_tier: Optional[str] = field(
        default=None, metadata=opt("--node-tier", "HOST:PORT of this node's tier (`warmfleet node-tier`), shared by "
                                   "the service's replicas on the node: evicted KV blocks and encoder outputs go "
                                   "there and local misses look there. It replaces the swap tier (--swap-space is "
                                   "then not allocated). Unset: off.")
    )
    node_tier_timeout_ms: int = field(
        default=500, metadata=opt("--node-tier-timeout-ms", "Deadline of one node-tier lookup, in ms; a call that "
                                  "fails or times out is a miss (recomputed) and pauses the tier with backoff.")
    )
    prefix_hash_algo: str = field(
        default="blake3",
        metadata=opt(
            "--prefix-hash-algo",
            "Block-hash digest. blake3/sha256 are collision resistant; xxhash is faster but lets a "
            "tenant who can craft collisions poison shared cache entries.",
            choices=HASH_ALGOS,
        ),
    )
    max_encoder_cache: int = field(
        default=16384, metadata=opt("--max-encoder-cache", "Vision-encoder output cache, in tokens (0 disables).")
    )
    max_processor_cache: float = field(
        default=1.0, metadata=opt("--max-processor-cache", "Preprocessed-image cache shared over ZMQ, in GiB (0 disables).")
    )


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = field(
        default=2048, metadata=opt("--max-num-batched-tokens", "Token budget of one engine step (prefill chunks + decodes).")
    )
    max_num_seqs: int = field(default=64, metadata=opt("--max-num-seqs", "Most requests running at once."))
    max_choices_per_request: Optional[int] = field(
        default=None,
        metadata=opt("--max-choices-per-request", "Most engine requests one API request may start (prompts x n in "
                     "/v1/completions, n in chat); more is a 400 before any tokenizing. Default: 4 x --max-num-seqs, "
                     "because choices beyond a few batches' worth only queue in the engine while each holds a task, a "
                     "detokenizer and a queue in the API process; this bounds what one body can allocate."),
    )

    @property
    def choice_limit(self) -> int:
        """--max-choices-per-request, or its default of 4 x --max-num-seqs."""
        return self.max_choices_per_request if self.max_choices_per_request is not None else 4 * self.max_num_seqs


@dataclass
class LoraConfig:
    enable_lora: bool = field(
        default=False, metadata=opt("--enable-lora", "Serve LoRA adapters (implied by --lora-modules); adapters can "
                                    "then also be loaded at run time (POST /v1/load_lora_adapter).")
    )
    lora_modules: list = field(
        default_factory=list,
        metadata=opt("--lora-modules", "PEFT adapters served at start, as NAME=PATH (several, or the flag repeated); "
                     "clients select one with `model: NAME`.", action="extend", metavar="NAME=PATH"),
    )
    max_loras: int = field(
        default=1, metadata=opt("--max-loras", "Adapters resident on the device at once (slots, LRU); a request "
                                "whose adapter finds every slot busy waits.")
    )
    max_cpu_loras: Optional[int] = field(
        default=None, metadata=opt("--max-cpu-loras", "Adapters kept in host memory (LRU over the files on disk); "
                                   "default: --max-loras. Must be >= --max-loras.")
    )
    max_lora_rank: int = field(
        default=16, metadata=opt("--max-lora-rank", "Largest adapter rank accepted; bigger adapters are refused at load.")
    )

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def modules(self) -> dict[str, str]:
        """--lora-modules as name -> path; ValueError for a malformed or repeated entry."""
        out: dict[str, str] = {}
        for item in self.lora_modules:
            name, eq, path = str(item).partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH entries, got {item!r}")
            if name in out:
                raise ValueError(f"--lora-modules names {name!r} twice")
            out[name] = path
        return out


@dataclass
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=opt("--host", "Address the HTTP API binds."))
    port: int = field(default=8000, metadata=opt("--port", "HTTP API port."))
    kv_events_port: Optional[int] = field(
        default=None, metadata=opt("--kv-events-port", "Port of the ZMQ PUB socket for KV events (unset disables).")
    )
    kv_events_host: str = field(default="127.0.0.1", metadata=opt("--kv-events-host", "Address the KV-event socket binds."))
    kv_events_token_ids: bool = field(
        default=False, metadata=opt("--kv-events-token-ids", "Publish each stored block's token ids in BlockStored "
                                    "(vLLM's field, for consumers that rebuild hashes from tokens). Off: the list is "
                                    "empty, so the unauthenticated event port never carries prompt text; warmfleet's "
                                    "router needs only the hashes.")
    )
    kv_events_curve_secret_key: Optional[str] = field(
        default=None, metadata=opt("--kv-events-curve-secret-key", "ZMQ certificate file with this replica's CURVE key "
                                   "pair (zmq.auth.create_certificates writes one): the KV-event socket is then "
                                   "encrypted and admits only the clients of --kv-events-curve-clients. Give both.")
    )
    kv_events_curve_clients: Optional[str] = field(
        default=None, metadata=opt("--kv-events-curve-clients", "Directory of the public-key certificates of the "
                                   "subscribers (routers) allowed on the KV-event socket (with "
                                   "--kv-events-curve-secret-key).")
    )
    replica_id: Optional[str] = field(
        default=None, metadata=opt("--replica-id", "Identity in KV events (default: host:port).")
    )
    node_name: Optional[str] = field(
        default=None, metadata=opt("--node-name", "The node this replica runs on (downward API spec.nodeName), "
                                   "told to routers in its KV snapshot so they match it with that node's tier.")
    )
    api_key: Optional[str] = field(
        default=None, metadata=opt("--api-key", "Require `Authorization: Bearer KEY` (env WARMFLEET_API_KEY also works).")
    )
    admin_key: Optional[str] = field(
        default=None, metadata=opt("--admin-key", "Bearer key of the admin routes (POST /v1/load_lora_adapter, "
                                   "/v1/unload_lora_adapter; env WARMFLEET_ADMIN_KEY). Without it they are open only "
                                   "while the server checks no API key.")
    )
    api_keys_file: Optional[str] = field(
        default=None, metadata=opt("--api-keys-file", "Also accept the client keys of this JSON file {\"KEY\": "
                                   "\"SALT\" | null} (the router's and picker's --api-keys-file): a request with one runs "
                                   "under that key's cache salt (a body cache_salt only partitions further inside it), "
                                   "as through the router, so a client cannot reach another tenant's cached prefixes. "
                                   "--api-key stays the fleet key of routers, whose cache_salt is trusted; env "
                                   "WARMFLEET_CLIENT_API_KEY adds one client key, salted as the router salts its "
                                   "--api-key.")
    )
    salt_secret: Optional[str] = field(
        default=None, metadata=opt("--salt-secret", "HMAC secret of the salts --api-keys-file derives for keys mapped "
                                   "to null (env WARMFLEET_SALT_SECRET); the routers' --salt-secret.")
    )
    allowed_local_media_path: Optional[str] = field(
        default=None, metadata=opt("--allowed-local-media-path", "Directory under which file:// images may be read.")
    )
    allowed_media_hosts: list = field(
        default_factory=list,
        metadata=opt("--allowed-media-host", "Host or CIDR that image URLs may reach even if private (repeatable).", action="append"),
    )
    max_request_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BYTES, metadata=opt("--max-request-bytes", "Largest HTTP request body, in bytes (413 above it).")
    )
    request_header_timeout_s: float = field(
        default=10.0, metadata=opt("--request-header-timeout-s", "Seconds a request's head (request line and headers) "
                                   "may take to arrive, from the connection's opening or the request's first byte; "
                                   "later: 408 and the connection is closed.")
    )
    request_body_timeout_s: float = field(
        default=60.0, metadata=opt("--request-body-timeout-s", "Seconds a request's body may take to arrive after its "
                                   "head (a total, not between bytes: a trickling client cannot extend it); later: 408 "
                                   "and the connection is closed.")
    )
    media_fetch_timeout_s: float = field(
        default=10.0, metadata=opt("--media-fetch-timeout-s", "Timeout for downloading one image, in seconds.")
    )
    media_max_bytes: int = field(
        default=20 << 20, metadata=opt("--media-max-bytes", "Largest image download, in bytes.")
    )
    media_request_timeout_s: float = field(
        default=30.0, metadata=opt("--media-request-timeout-s", "Seconds all image downloads of one request may take "
                                   "together (they run concurrently; each also within --media-fetch-timeout-s); "
                                   "later: 400.")
    )
    media_max_pixels: int = field(
        default=DEFAULT_MAX_IMAGE_PIXELS, metadata=opt("--media-max-pixels", "Largest image, in pixels (width x "
                                                       "height), read from the header before decoding; bigger: 400. "
                                                       "The default, 4096 x 4096, decodes to 64 MiB.")
    )
    limit_mm_per_prompt: str = field(
        default=DEFAULT_LIMIT_MM_PER_PROMPT, metadata=opt("--limit-mm-per-prompt", "Most media items of each kind one "
                                                          "request may carry, as JSON (vLLM's flag), e.g. "
                                                          "'{\"image\": 4}'; more is a 400 before any is loaded. "
                                                          "Bounds one request's downloads and decoding.")
    )
    otlp_traces_endpoint: Optional[str] = field(
        default=None, metadata=opt("--otlp-traces-endpoint", "OTLP/HTTP traces URL (vLLM's flag), e.g. "
                                   "http://collector:4318/v1/traces: a span per request continuing its traceparent "
                                   "(server/otel.py). Also on with OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT; needs the "
                                   "tracing extra.", metavar="URL")
    )
    log_level: str = field(default="info", metadata=opt("--log-level", "Log level.", choices=("debug", "info", "warning", "error")))


    def mm_limits(self) -> dict[str, int]:
        """--limit-mm-per-prompt as modality -> count; ValueError names a malformed value."""
        try:
            limits = json.loads(self.limit_mm_per_prompt)
        except ValueError:
            limits = None
        if not isinstance(limits, dict) or not all(
                k in MM_MODALITIES and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in limits.items()):
            raise ValueError(f"--limit-mm-per-prompt takes a JSON object of counts >= 0 per modality "
                             f"({', '.join(MM_MODALITIES)}), e.g. '{{\"image\": 4}}', got {self.limit_mm_per_prompt!r}")
        return {**json.loads(DEFAULT_LIMIT_MM_PER_PROMPT), **limits}


def replica_id(server: "ServerConfig") -> str:
    """The replica's name in KV events, metrics and the x-warmfleet-replica header: --replica-id, else host:port."""
    return server.replica_id or f"{server.host}:{server.port}"


@dataclass
class EngineConfig:
    """Everything `warmfleet serve` accepts, grouped."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> None:
        """Raise ValueError with one readable sentence for an impossible combination."""
        c, s = self.cache, self.scheduler
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ValueError(f"--block-size must be a power of two >= 1, got {c.block_size}")
        if c.num_gpu_blocks is not None and c.num_gpu_blocks < 2:
            raise ValueError(f"--num-gpu-blocks must be >= 2, got {c.num_gpu_blocks}")
        if c.swap_space < 0:
            raise ValueError(f"--swap-space is GiB and must be >= 0, got {c.swap_space}")
        if c.max_encoder_cache < 0 or c.max_processor_cache < 0:
            raise ValueError("--max-encoder-cache and --max-processor-cache must be >= 0")
        if not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.max_num_batched_tokens < 1 or s.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be >= 1")
        if s.choice_limit < 1:
            raise ValueError(f"--max-choices-per-request must be >= 1, got {s.choice_limit}")
        if self.model.engine_threads < 1:
            raise ValueError(f"--engine-threads must be >= 1, got {self.model.engine_threads}")
        if self.model.engine_cpus is not None:
            parse_cpu_list(self.model.engine_cpus)
        lo = self.lora
        if lo.max_loras < 1 or lo.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        if lo.num_cpu_loras < lo.max_loras:
            raise ValueError(f"--max-cpu-loras ({lo.num_cpu_loras}) must be >= --max-loras ({lo.max_loras})")
        lo.modules()
        self.server.mm_limits()
        if self.server.media_request_timeout_s <= 0 or self.server.media_max_pixels < 1:
            raise ValueError("--media-request-timeout-s and --media-max-pixels must be > 0")
        if (self.server.kv_events_curve_secret_key is None) != (self.server.kv_events_curve_clients is None):
            raise ValueError("--kv-events-curve-secret-key and --kv-events-curve-clients go together")
        if self.server.request_header_timeout_s <= 0 or self.server.request_body_timeout_s <= 0:
            raise ValueError("--request-header-timeout-s and --request-body-timeout-s must be > 0")
        if c.node_tier is not None:
            from .nodetier.client import parse_address

            parse_address(c.node_tier)
            if not c.enable_prefix_caching:
                raise ValueError("--node-tier needs prefix caching (--enable-prefix-caching)")
        if c.node_tier_timeout_ms < 1:
            raise ValueError(f"--node-tier-timeout-ms must be >= 1, got {c.node_tier_timeout_ms}")
        if not 0 < self.server.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.server.port}")


def parse_cpu_list(spec: str) -> set[int]:
    """CPU numbers of a list like "0", "0-3" or "0,2-3" (taskset's syntax); ValueError names a bad item."""
    cpus: set[int] = set()
    for item in spec.split(","):
        lo, dash, hi = item.strip().partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"--engine-cpus takes CPU numbers and ranges like 0 or 0-3,6, got {spec!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field, named and documented by the field's metadata (one section a group)."""
    flagfields.add_arguments(parser, EngineConfig, show_defaults=True, sections=True, metavar_from_flag=False)


def from_namespace(ns: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from parsed flags and validate it."""
    cfg = flagfields.from_namespace(ns, EngineConfig)
    cfg.validate()
    return cfg


def to_args(cfg: EngineConfig) -> list[str]:
    """Render a config as `warmfleet serve` arguments, omitting defaults (used by the operator)."""
    return flagfields.to_args(cfg)
