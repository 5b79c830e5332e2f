"""Engine descriptions (warmfleet, vllm, fastdeploy): start command, flags per sized cache, ports, probes, footprint; no kopf."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Literal, Mapping

from warmfleet.operator.spec.inference_service import EngineKind, InferenceServiceSpec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server import engine_kinds
from warmfleet.server.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    flag_of,
    to_args,
)

HTTP_PORT = 8000
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558  # vLLM's replay socket (ZMQ ROUTER): a subscriber that saw a gap asks it for missed batches
METRICS_PORT = 8001  # FastDeploy's separate Prometheus port
KV_EVENTS_TOPIC = "kv-events"
VLLM_PYTHONHASHSEED = "0"  # fixes vLLM's NONE_HASH; the router's --vllm-hash-seed defaults to the same value
PEER_GPU_MEMORY_UTILIZATION = 0.9  # share of each GPU a peer engine may claim (weights, activations, KV pool)
# vLLM's native CPU tier is a /dev/shm region. vllm#53042 measured 1.92x the --kv-offloading-size in host
# memory (vLLM 0.26, PyTorch's pinned allocator rounds each tensor up to a power of two, so the bound is 2x;
# vllm#48436 likewise). 0.32.0 maps one exact-size region on CUDA (vllm/v1/kv_offload/cpu/spec.py, checked
# here), but the image is the user's: size for the bound so no build is OOM-killed for its own tier.
VLLM_OFFLOAD_HOST_OVERHEAD = 2.0
# vLLM's default ("lru") processor cache is mirrored in the API process and the engine core:
# mm_processor_cache_gb x (api_server_count + data_parallel_size) = 2 copies with one of each.
VLLM_PROCESSOR_CACHE_COPIES = 2

# Default images, pinned by version (never `latest`): vLLM's official OpenAI-server image of the release whose
# flags VLLM_FLAGS were checked against; FastDeploy's official CUDA 12.6 release image (its installation docs).
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
FASTDEPLOY_IMAGE = "ccr-2vdh3abv-pub.cnc.bj.baidubce.com/paddlepaddle/fastdeploy-cuda-12.6:2.3.0"

CacheContract = Literal["exact-ours", "exact-vllm", "predicted"]


@dataclass(frozen=True)
class FlagDoc:
    """One flag an engine accepts: unit, meaning, and where name and unit were checked."""

    unit: str
    meaning: str
    source: str


@dataclass(frozen=True)
class Port:
    """A named container port; Service and EndpointSlice carry the same name for the router."""

    name: str
    number: int


@dataclass(frozen=True)
class Probes:
    """HTTP paths on the `http` port the kubelet probes."""

    startup: str
    readiness: str
    liveness: str


@dataclass(frozen=True)
class LoadSource:
    """Where the router reads a replica's load: the KV-event stream, or a Prometheus endpoint."""

    via: Literal["kv-events", "prometheus"]
    port: str  # port name
    path: str = ""


@dataclass(frozen=True)
class HostFootprint:
    """How the sized host caches occupy a pod's memory and /dev/shm."""

    processor_in_shm: bool  # the processor cache lives in /dev/shm (once)
    processor_copies: int  # copies of the processor cache in process memory
    swap_in_shm: bool  # the CPU KV tier lives in /dev/shm
    swap_overhead: float  # host bytes taken per byte of the CPU KV tier asked for


@dataclass(frozen=True)
class LoraLimits:
    """spec.lora as the engines take it: the limits only (adapters are loaded at run time, never in the arguments)."""

    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int


@dataclass(frozen=True)
class RenderInput:
    """What an engine's arguments are rendered from, in our units (sizes per replica)."""

    model_dir: str
    served_name: str
    dtype: str
    max_model_len: int | None
    block_size: int
    prefix_caching: bool
    max_num_batched_tokens: int
    tensor_parallel: int
    swap_space_gib: float
    processor_cache_gib: float
    encoder_cache_tokens: int | None
    gpu_memory_utilization: float | None
    lora: LoraLimits | None = None  # spec.lora; None: LoRA off (arguments as before)


@dataclass(frozen=True)
class Engine:
    """Everything the operator knows about one engine kind; manifests and sizing render from it."""

    kind: EngineKind
    command: tuple[str, ...]
    render_args: Callable[[RenderInput], list[str]]
    flags: Mapping[str, FlagDoc]  # every flag render_args may emit
    ports: tuple[Port, ...]
    probes: Probes
    env: tuple[tuple[str, str], ...]  # static environment
    pod_name_env: bool  # POD_NAME from the downward API (warmfleet's --replica-id)
    api_key_env: str  # the engine reads the API key from this variable
    working_dir: str | None  # for engines that write next to their cwd
    tmp_gib: int  # /tmp emptyDir (HOME: compile caches, logs)
    footprint: HostFootprint
    sizes_encoder_cache: bool  # False: the engine sizes its own encoder cache
    encoder_note: str  # why, when it does not take ours
    gpu_memory_utilization: float | None  # None: the engine's own budget (not rendered)
    tensor_parallel: bool
    cache_contract: CacheContract
    load: LoadSource
    lora_env: tuple[tuple[str, str], ...] = ()  # environment with spec.lora (runtime adapter updates)
    default_image: str | None = None  # pinned official image when spec.engine.image is unset (None: the operator's own)
    gpu_attention: bool = True  # has GPU attention kernels; False: on a GPU pool it runs on the CPU (a Warning)

    def args(self, ri: RenderInput) -> list[str]:
        """Arguments after `command` for one pool."""
        return self.render_args(ri)


def _num(x: float) -> str:
    return repr(float(x))


# ---- warmfleet: flags from server/config.py (contract 3) ----

WARMFLEET_FLAGS: Mapping[str, FlagDoc] = MappingProxyType({
    f.metadata["flag"]: FlagDoc(unit="see help", meaning=f.metadata["help"], source=f"server/config.py {cls.__name__}.{f.name}")
    for cls in (g.default_factory for g in dataclasses.fields(EngineConfig)) for f in dataclasses.fields(cls)
} | {"--no-enable-prefix-caching": FlagDoc("-", "BooleanOptionalAction negation", "server/config.py CacheConfig.enable_prefix_caching")})


def _warmfleet_args(ri: RenderInput) -> list[str]:
    cfg = EngineConfig(
        model=ModelConfig(model=ri.model_dir, served_model_name=ri.served_name, dtype=ri.dtype, max_model_len=ri.max_model_len),
        cache=CacheConfig(
            block_size=ri.block_size, enable_prefix_caching=ri.prefix_caching, swap_space=ri.swap_space_gib,
            max_encoder_cache=ri.encoder_cache_tokens or 0, max_processor_cache=ri.processor_cache_gib,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=ri.max_num_batched_tokens),
        server=ServerConfig(host="0.0.0.0", port=HTTP_PORT, kv_events_port=KV_EVENTS_PORT, kv_events_host="0.0.0.0",
                            replica_id="$(POD_NAME)"),
        lora=LoraConfig(enable_lora=True, max_loras=ri.lora.max_loras, max_cpu_loras=ri.lora.max_cpu_loras,
                        max_lora_rank=ri.lora.max_lora_rank) if ri.lora else LoraConfig(),
    )
    args = ["serve", *to_args(cfg)]
    if ri.lora:  # limits always explicit; no --lora-modules: the operator loads adapters at run time
        for fname, n in (("max_loras", ri.lora.max_loras), ("max_cpu_loras", ri.lora.max_cpu_loras),
                         ("max_lora_rank", ri.lora.max_lora_rank)):
            if flag_of(LoraConfig, fname) not in args:
                args += [flag_of(LoraConfig, fname), str(n)]
    # Sizes are always explicit, even when they equal a server default, so a pod shows what it got.
    for fname, value in (("swap_space", ri.swap_space_gib), ("max_encoder_cache", ri.encoder_cache_tokens or 0),
                         ("max_processor_cache", ri.processor_cache_gib)):
        flag = flag_of(CacheConfig, fname)
        if flag not in args:
            args += [flag, str(value)]
    return args


# ---- vLLM 0.32: every name and unit below checked against 0.32.0's `--help=all` on this machine ----

_VLLM_HELP = "vLLM 0.32.0 `python -m vllm.entrypoints.openai.api_server --help=all`"
VLLM_FLAGS: Mapping[str, FlagDoc] = MappingProxyType({
    "--model": FlagDoc("path", "checkpoint directory", _VLLM_HELP),
    "--served-model-name": FlagDoc("name", "name clients send as `model`", _VLLM_HELP),
    "--host": FlagDoc("address", "HTTP bind address", _VLLM_HELP),
    "--port": FlagDoc("port", "HTTP port", _VLLM_HELP),
    "--dtype": FlagDoc("dtype", "weight and activation dtype", _VLLM_HELP),
    "--max-model-len": FlagDoc("tokens", "context length", _VLLM_HELP),
    "--block-size": FlagDoc("tokens", "tokens per KV block (the router hashes with the same size)", _VLLM_HELP),
    "--enable-prefix-caching": FlagDoc("-", "reuse cached KV blocks", _VLLM_HELP),
    "--no-enable-prefix-caching": FlagDoc("-", "disable prefix caching", _VLLM_HELP),
    "--prefix-caching-hash-algo": FlagDoc("sha256_cbor", "reproducible, cross-language block hash (router re-computes it)", _VLLM_HELP),
    "--kv-events-config": FlagDoc("JSON", "KVEventsConfig: zmq publisher endpoint, replay_endpoint, topic", _VLLM_HELP + "; vllm/config/kv_events.py"),
    "--mm-processor-cache-gb": FlagDoc("GiB", "multimodal processor cache (mirrored in API process and engine core)", _VLLM_HELP),
    "--max-num-batched-tokens": FlagDoc("tokens", "token budget of one step; also vLLM's encoder-cache budget", _VLLM_HELP),
    "--gpu-memory-utilization": FlagDoc("fraction", "share of GPU memory for the executor (0.32 default 0.92)", _VLLM_HELP),
    "--tensor-parallel-size": FlagDoc("GPUs", "tensor-parallel degree = gpusPerReplica", _VLLM_HELP),
    "--enable-prompt-tokens-details": FlagDoc("-", "report usage.prompt_tokens_details.cached_tokens", _VLLM_HELP),
    "--kv-offloading-size": FlagDoc("GiB", "native CPU KV tier, total across TP ranks; must be > 0 when set", _VLLM_HELP + "; vllm/config/kv_offloading.py"),
    "--kv-offloading-backend": FlagDoc("native|lmcache", "CPU KV tier backend", _VLLM_HELP),
    # LoRA: EngineArgs fields in vllm/engine/arg_utils.py (enable_lora, max_loras, max_lora_rank, max_cpu_loras, from
    # LoRAConfig); runtime /v1/load_lora_adapter needs VLLM_ALLOW_RUNTIME_LORA_UPDATING (lora_env below)
    "--enable-lora": FlagDoc("-", "serve LoRA adapters", _VLLM_HELP + "; vllm/engine/arg_utils.py"),
    "--max-loras": FlagDoc("adapters", "adapters in one batch (GPU slots)", _VLLM_HELP + "; vllm/engine/arg_utils.py"),
    "--max-lora-rank": FlagDoc("rank", "largest adapter rank", _VLLM_HELP + "; vllm/engine/arg_utils.py"),
    "--max-cpu-loras": FlagDoc("adapters", "adapters cached in CPU memory (>= --max-loras)", _VLLM_HELP + "; vllm/engine/arg_utils.py"),
    # spec.tracing (planning/tracing.py): the exporter is chosen by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc by default,
    # http/protobuf: vllm/tracing/otel.py get_span_exporter); 0.32.0 requires opentelemetry-sdk and -exporter-otlp
    "--otlp-traces-endpoint": FlagDoc("URL", "OTLP traces URL spans are exported to",
                                      _VLLM_HELP + "; vllm/config/observability.py ObservabilityConfig"),
})
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vllm/envs.py: enables /v1/load_lora_adapter and unload
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # --max-lora-rank's choices in 0.32.0's --help=all


def _vllm_args(ri: RenderInput) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": KV_EVENTS_TOPIC}
    args = [
        "--model", ri.model_dir, "--served-model-name", ri.served_name, "--host", "0.0.0.0", "--port", str(HTTP_PORT),
        "--dtype", ri.dtype, "--block-size", str(ri.block_size),
        "--enable-prefix-caching" if ri.prefix_caching else "--no-enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps(events, separators=(",", ":")),
        "--mm-processor-cache-gb", _num(ri.processor_cache_gib),
        "--max-num-batched-tokens", str(ri.max_num_batched_tokens),
        "--gpu-memory-utilization", _num(ri.gpu_memory_utilization or PEER_GPU_MEMORY_UTILIZATION),
        "--tensor-parallel-size", str(ri.tensor_parallel),
        "--enable-prompt-tokens-details",
    ]
    if ri.max_model_len is not None:
        args += ["--max-model-len", str(ri.max_model_len)]
    if ri.swap_space_gib > 0:  # vLLM refuses --kv-offloading-size 0; leaving it out disables the tier
        args += ["--kv-offloading-size", _num(ri.swap_space_gib), "--kv-offloading-backend", "native"]
    if ri.lora:  # no --lora-modules: adapters are loaded at run time, so the pod template does not follow spec.adapters
        args += ["--enable-lora", "--max-loras", str(ri.lora.max_loras), "--max-lora-rank", str(ri.lora.max_lora_rank),
                 "--max-cpu-loras", str(ri.lora.max_cpu_loras)]
    return args


# ---- FastDeploy: names from its parameter docs, units from its source where the docs are loose ----

_FD_DOCS = "PaddlePaddle/FastDeploy docs/parameters.md"
_FD_ARGS = "fastdeploy/engine/args_utils.py"
_FD_SERVER = "fastdeploy/entrypoints/openai/utils.py make_arg_parser"
FASTDEPLOY_FLAGS: Mapping[str, FlagDoc] = MappingProxyType({
    "--model": FlagDoc("path", "checkpoint directory", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--served-model-name": FlagDoc("name", "name clients send as `model`", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--host": FlagDoc("address", "HTTP bind address (default 0.0.0.0)", _FD_SERVER),
    "--port": FlagDoc("port", "HTTP port", f"{_FD_DOCS}; {_FD_SERVER}"),
    "--metrics-port": FlagDoc("port", "separate Prometheus /metrics port", f"{_FD_DOCS}; {_FD_SERVER}"),
    "--max-model-len": FlagDoc("tokens", "context length (FastDeploy's default is 2048, not the checkpoint's)", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--block-size": FlagDoc("tokens", "tokens per KV block", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--enable-prefix-caching": FlagDoc("-", "reuse cached KV blocks (BooleanOptionalAction)", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--no-enable-prefix-caching": FlagDoc("-", "disable prefix caching", _FD_ARGS),
    # The docs say "unit: GB"; the source divides by 1024**3 (fastdeploy/config.py CacheConfig: num_cpu_blocks =
    # swap_space * 1024**3 / bytes_per_block, all KV heads, i.e. the total across TP ranks): GiB, passed as is.
    "--swap-space": FlagDoc("GiB", "CPU KV tier (docs say GB; source computes GiB); unset disables", f"{_FD_DOCS}; fastdeploy/config.py"),
    "--max-encoder-cache": FlagDoc("tokens", "encoder output cache (0 disables)", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--max-processor-cache": FlagDoc("GiB", "processor cache, float (0 disables)", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--max-num-batched-tokens": FlagDoc("tokens", "token budget of one prefill batch", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--gpu-memory-utilization": FlagDoc("fraction", "share of GPU memory FastDeploy profiles into (default 0.9)", f"{_FD_DOCS}; {_FD_ARGS}"),
    "--tensor-parallel-size": FlagDoc("GPUs", "tensor-parallel degree = gpusPerReplica", f"{_FD_DOCS}; {_FD_ARGS}"),
})


def _fastdeploy_args(ri: RenderInput) -> list[str]:
    args = [
        "--model", ri.model_dir, "--served-model-name", ri.served_name, "--host", "0.0.0.0", "--port", str(HTTP_PORT),
        "--metrics-port", str(METRICS_PORT), "--block-size", str(ri.block_size),
        "--enable-prefix-caching" if ri.prefix_caching else "--no-enable-prefix-caching",
        "--max-encoder-cache", str(ri.encoder_cache_tokens or 0),
        "--max-processor-cache", _num(ri.processor_cache_gib),
        "--max-num-batched-tokens", str(ri.max_num_batched_tokens),
        "--gpu-memory-utilization", _num(ri.gpu_memory_utilization or PEER_GPU_MEMORY_UTILIZATION),
        "--tensor-parallel-size", str(ri.tensor_parallel),
    ]
    if ri.max_model_len is not None:
        args += ["--max-model-len", str(ri.max_model_len)]
    if ri.swap_space_gib > 0:  # any --swap-space, even 0, turns FastDeploy's hierarchical cache on
        args += ["--swap-space", _num(ri.swap_space_gib)]
    return args


# ---- the three descriptions ----

_HTTP = Port("http", HTTP_PORT)
_KV_EVENTS = Port("kv-events", KV_EVENTS_PORT)

WARMFLEET = Engine(
    kind="warmfleet", command=("warmfleet",), render_args=_warmfleet_args, flags=WARMFLEET_FLAGS,
    ports=(_HTTP, _KV_EVENTS), probes=Probes(startup="/health", readiness="/ready", liveness="/health"),
    env=(("HOME", "/tmp"),), pod_name_env=True, api_key_env="WARMFLEET_API_KEY", working_dir=None, tmp_gib=1,
    footprint=HostFootprint(processor_in_shm=True, processor_copies=0, swap_in_shm=False, swap_overhead=1.0),
    sizes_encoder_cache=True, encoder_note="", gpu_memory_utilization=None, tensor_parallel=False,
    cache_contract="exact-ours", load=LoadSource("kv-events", "kv-events"),
    gpu_attention=False,  # docs/performance.md: CPU attention only, never run on a GPU
)

VLLM = Engine(
    # The module form: the `vllm` console script is broken in CPU builds (it asks importlib.metadata for `vllm`).
    kind="vllm", command=("python3", "-m", "vllm.entrypoints.openai.api_server"), render_args=_vllm_args,
    flags=VLLM_FLAGS, ports=(_HTTP, _KV_EVENTS, Port("kv-replay", KV_REPLAY_PORT)),
    probes=Probes(startup="/health", readiness="/health", liveness="/health"),
    # PYTHONHASHSEED fixes vLLM's NONE_HASH so the router can re-compute its block hashes.
    env=(("HOME", "/tmp"), ("PYTHONHASHSEED", VLLM_PYTHONHASHSEED)), pod_name_env=False, api_key_env="VLLM_API_KEY",
    working_dir=None, tmp_gib=8,
    footprint=HostFootprint(processor_in_shm=False, processor_copies=VLLM_PROCESSOR_CACHE_COPIES, swap_in_shm=True,
                            swap_overhead=VLLM_OFFLOAD_HOST_OVERHEAD),
    sizes_encoder_cache=False,
    encoder_note="vLLM has no encoder-cache size flag: it sizes its encoder cache from maxNumBatchedTokens",
    gpu_memory_utilization=PEER_GPU_MEMORY_UTILIZATION, tensor_parallel=True,
    cache_contract="exact-vllm", load=LoadSource("prometheus", "http", "/metrics"),
    lora_env=((VLLM_RUNTIME_LORA_ENV, "True"),),
    default_image=VLLM_IMAGE,
)

FASTDEPLOY = Engine(
    kind="fastdeploy", command=("python3", "-m", "fastdeploy.entrypoints.openai.api_server"),
    render_args=_fastdeploy_args, flags=FASTDEPLOY_FLAGS, ports=(_HTTP, Port("metrics", METRICS_PORT)),
    probes=Probes(startup="/health", readiness="/health", liveness="/health"),
    # FastDeploy writes logs to ./log (FD_LOG_DIR) and IPC files under /dev/shm; the root filesystem is read-only.
    env=(("HOME", "/tmp"), ("FD_LOG_DIR", "/tmp/log")), pod_name_env=False, api_key_env="FD_API_KEY",
    working_dir="/tmp", tmp_gib=8,
    footprint=HostFootprint(processor_in_shm=False, processor_copies=1, swap_in_shm=False, swap_overhead=1.0),
    sizes_encoder_cache=True, encoder_note="", gpu_memory_utilization=PEER_GPU_MEMORY_UTILIZATION,
    tensor_parallel=True, cache_contract="predicted", load=LoadSource("prometheus", "metrics", "/metrics"),
    default_image=FASTDEPLOY_IMAGE,
)

ENGINES: Mapping[str, Engine] = MappingProxyType({e.kind: e for e in (WARMFLEET, VLLM, FASTDEPLOY)})
assert tuple(ENGINES) == engine_kinds.KINDS, "one description per registered engine kind (server/engine_kinds.py)"


def engine_of(spec: InferenceServiceSpec) -> Engine:
    """The description of the spec's engine kind, which engine_choice.resolve has made concrete (never auto)."""
    if spec.engine.kind not in ENGINES:
        raise ValueError(f"engine kind {spec.engine.kind!r} is not resolved: planning/engine_choice.resolve runs first")
    return ENGINES[spec.engine.kind]


def check_spec(spec: InferenceServiceSpec) -> None:
    """What the schema cannot see: the engine's capabilities. Raises SpecError (InvalidSpec)."""
    engine = engine_of(spec)
    if spec.lora is not None and engine.kind == "fastdeploy":
        raise SpecError("spec.lora", "engine fastdeploy serves no LoRA adapters (its docs/parameters.md and "
                                     "fastdeploy/engine/args_utils.py define no LoRA flag); use engine.kind warmfleet or vllm, "
                                     "or remove spec.lora and spec.adapters")
    if spec.lora is not None and engine.kind == "vllm" and spec.lora.max_lora_rank not in VLLM_LORA_RANKS:
        raise SpecError("spec.lora.maxLoraRank", f"is {spec.lora.max_lora_rank}; vLLM's --max-lora-rank takes one of "
                                                f"{', '.join(map(str, VLLM_LORA_RANKS))}")
    if spec.lora is not None and spec.lora.admin_key_secret is not None and engine.kind != "warmfleet":
        raise SpecError("spec.lora.adminKeySecret", f"applies to engine warmfleet only: {engine.kind}'s runtime LoRA routes "
                                                   "take its API key (spec.router.apiKeySecret)")
    if spec.router.kv_events_curve and engine.kind != "warmfleet":
        raise SpecError("spec.router.kvEventsCurve", f"applies to engine warmfleet only: {engine.kind}'s KV-event "
                                                    "socket has no CURVE (keep spec.server.networkPolicy on instead)")
    gpr = spec.server.gpus_per_replica
    if gpr == 0 and engine.gpu_attention:
        raise SpecError("spec.server.gpusPerReplica", f"is 0, but engine {engine.kind} runs on GPUs (the operator renders "
                                                      "no CPU build of it); use engine.kind warmfleet or auto for CPU-only "
                                                      "replicas, or gpusPerReplica 1 or more")
    if gpr > 1 and not engine.tensor_parallel:
        raise SpecError(
            "spec.server.gpusPerReplica",
            f"is {gpr}, but engine {engine.kind} runs one GPU per replica; "
            f"use gpusPerReplica 1, or engine.kind vllm or fastdeploy for tensor parallelism",
        )


def render_flags(args: list[str]) -> list[str]:
    """The flags (tokens starting with --) of an argument list."""
    return [a for a in args if a.startswith("--")]
