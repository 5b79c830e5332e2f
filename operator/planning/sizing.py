"""Per-pool sizing: CPU KV tier, encoder and processor caches, pod memory and /dev/shm per engine; pure, see docs/sizing.md."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from warmfleet.operator.planning import lora_plan
from warmfleet.operator.planning.engine_descriptions import Engine, engine_of
from warmfleet.operator.planning.nodes import GiB, MiB, Pool
from warmfleet.operator.spec.inference_service import (
    CacheSpec,
    DEFAULT_DTYPE,
    DEFAULT_HIDDEN_SIZE,
    GiBSize,
    InferenceServiceSpec,
    PoolInputs,
    PoolSizes,
    TokenSize,
)
from warmfleet.operator.spec.node_tier import NodeTierStatus
from warmfleet.server.config import DTYPE_BYTES

PROCESSOR_GIB_PER_FRONTEND = 4.0  # Auto processor cache ceiling per API frontend
API_FRONTENDS = 1  # `warmfleet serve` runs one API frontend per replica
PROCESSOR_HOST_SHARE = 0.10  # Auto processor cache ceiling as a share of H
SWAP_HOST_CAP = 0.7  # Auto swap never exceeds this share of H
SHM_HEADROOM_BYTES = 1 * GiB  # /dev/shm beyond the caches placed there (IPC buffers, workers, NCCL)
MIN_GPU_MEMORY_UTILIZATION = 0.1  # a peer engine left less than this share of GPU memory cannot host a KV pool
LORA_GPU_SHARE = 0.25  # resident adapters may take at most this share of a replica's GPU memory (the KV pool needs the rest)
GIB_STEP = 0.25  # GiB sizes are floored to this step so flags stay readable and stable
CPU_ONLY = "none (CPU-only)"  # sources.gpuMemory of a replica that takes no GPU (cpu_only)


@dataclass(frozen=True)
class PoolSizing:
    """The outcome for one pool: sizes when a replica fits, otherwise the reason."""

    fits: bool
    message: str  # empty when fits
    replicas_per_node: int
    sizes: PoolSizes | None
    inputs: PoolInputs | None
    node_tier: NodeTierStatus | None = None  # spec.cache.nodeTier on: the tier's size (planning/node_tier.py)

    @property
    def capacity_per_node(self) -> int:
        """Replicas one node of the pool can host (0 if nothing fits)."""
        return self.replicas_per_node if self.fits else 0


def _floor_step(gib: float) -> float:
    return max(0.0, math.floor(gib / GIB_STEP + 1e-9) * GIB_STEP)


def _clamp(value: float, size: GiBSize | TokenSize) -> tuple[float, str]:
    if size.min is not None and value < size.min:
        return size.min, "min"
    if size.max is not None and value > size.max:
        return size.max, "max"
    return value, "auto"


def cpu_only(spec: InferenceServiceSpec, pool: Pool) -> bool:
    """Replicas of `pool` request no GPU: an engine without a GPU attention backend (warmfleet's) on a pool without
    GPUs, or with spec.server.gpusPerReplica 0. They are packed by allocatable CPU and host memory instead."""
    return not engine_of(spec).gpu_attention and (spec.server.gpus_per_replica == 0 or not pool.has_gpus)


def size_pool(spec: InferenceServiceSpec, pool: Pool) -> PoolSizing:
    """Derive per-replica sizes for `pool` (formulas in docs/sizing.md); explicit (Fixed) sizes win.

    The engine's description says where each cache lives (process memory, /dev/shm) and how
    many host bytes its CPU KV tier takes per byte asked for; the formulas are the same for all.
    GPU pools host GPUs per node / gpusPerReplica replicas; CPU-only ones (cpu_only) as many as CPU and memory allow.
    """
    if cpu_only(spec, pool):
        return _size_cpu_pool(spec, pool)
    gpr = spec.server.gpus_per_replica
    R = pool.gpus_per_node // gpr if gpr else 0
    if R == 0:
        return PoolSizing(False, _too_few_gpus(spec, pool), 0, None, None)
    return _size_replicas(spec, pool, R, gpr)


def _too_few_gpus(spec: InferenceServiceSpec, pool: Pool) -> str:
    """Why a GPU engine's replica does not fit the pool's GPUs; on a CPU-only pool, which engine would."""
    have, gpr, kind = pool.gpus_per_node, spec.server.gpus_per_replica, spec.engine.kind
    if have == 0:
        return (f"nodes have 0 allocatable GPUs ({pool.gpu_resource}), a replica needs {gpr}: engine {kind} runs on GPUs "
                "here (the operator renders no CPU build of it); for CPU-only nodes use engine.kind auto or warmfleet")
    return f"nodes have {have} allocatable {'GPU' if have == 1 else 'GPUs'}, a replica needs {gpr}"


def _size_cpu_pool(spec: InferenceServiceSpec, pool: Pool) -> PoolSizing:
    """A CPU-only pool: as many replicas per node as its allocatable CPU (spec.server.cpus each) hosts, fewer while a
    replica's memory does not fit its share of host memory; sources.replicasPerNode says which limit held."""
    cpus = spec.server.cpus
    by_cpu = pool.cpu_millis // (cpus * 1000)
    if by_cpu == 0:
        return PoolSizing(False, f"nodes have {pool.cpu_millis / 1000:g} allocatable CPUs, a replica needs {cpus} "
                                 "(spec.server.cpus)", 0, None, None)
    usable = pool.host_memory_bytes * (1 - spec.cache.host_reserve_fraction)
    engine_bytes = spec.server.engine_memory_gib * GiB + SHM_HEADROOM_BYTES
    R = max(1, min(by_cpu, int(usable // engine_bytes)))  # no replica needs less than its engine and /dev/shm headroom
    while True:
        sizing = _size_replicas(spec, pool, R, 0)
        if sizing.fits or R == 1:
            break
        R -= 1
    assert sizing.inputs is not None
    sizing.inputs.sources["replicasPerNode"] = (
        f"cpu ({pool.cpu_millis / 1000:g} allocatable / {cpus} per replica)" if R == by_cpu
        else f"memory (the CPUs would host {by_cpu})")
    return sizing


def _size_replicas(spec: InferenceServiceSpec, pool: Pool, R: int, gpr: int) -> PoolSizing:
    """The sizes of R replicas per node of `pool`, each with `gpr` GPUs (0: a CPU-only replica, whose encoder cache
    is budgeted from, and held in, its host memory)."""
    engine = engine_of(spec)
    fp = engine.footprint
    cache = spec.cache
    H = int(pool.host_memory_bytes * (1 - cache.host_reserve_fraction) / R)
    E = int(spec.server.engine_memory_gib * GiB)
    sources: dict[str, str] = {"gpuMemory": (pool.gpu_memory_source or "unknown") if gpr else CPU_ONLY}
    adapter, lora_device, lora_host = _lora_budget(spec, sources)
    P_gib = _processor_cache_gib(cache, H, sources)
    P = int(P_gib * GiB)
    processor_host = P * fp.processor_copies
    shm_fixed = (P if fp.processor_in_shm else 0) + SHM_HEADROOM_BYTES
    # plan_for fills both in (spec, else config.json, else default: passes/model_config.py); a bare spec gets the defaults
    token_bytes = (spec.model.hidden_size or DEFAULT_HIDDEN_SIZE) * DTYPE_BYTES[spec.model.dtype or DEFAULT_DTYPE]
    g = pool.gpu_memory_mib * MiB if gpr else H  # a CPU-only replica's encoder cache is a share of its host memory
    enc = _encoder_tokens(spec, engine, g, token_bytes, sources)
    enc_host = enc * token_bytes if not gpr and enc else 0
    if not gpr and enc is not None and sources["encoderCache"] == "auto":
        sources["encoderCache"] = "auto (host memory)"
    S_gib = _swap_space_gib(cache, H, E + processor_host + shm_fixed + enc_host + (lora_host or 0), fp.swap_overhead, sources)
    swap_host = int(S_gib * GiB * fp.swap_overhead)
    shm = _round_up_mib(shm_fixed + (swap_host if fp.swap_in_shm else 0))
    gpu_util = _gpu_memory_utilization(engine, g, enc, token_bytes, cache.encoder_fraction) if gpr else None
    memory = _round_up_mib(E + processor_host + enc_host + shm + (0 if fp.swap_in_shm else swap_host) + (lora_host or 0))
    inputs = PoolInputs(host_bytes_per_replica=H, engine_bytes=E, gpu_bytes_per_replica=pool.gpu_memory_mib * MiB * gpr,
                        bytes_per_encoder_token=token_bytes, bytes_per_adapter=adapter, sources=sources)
    sizes = PoolSizes(replicas_per_node=R, swap_space_gib=S_gib, encoder_cache_tokens=enc, processor_cache_gib=P_gib,
                      gpu_memory_utilization=gpu_util, memory_bytes=memory, shm_bytes=shm, lora_device_bytes=lora_device,
                      lora_host_bytes=lora_host, hash=sizes_hash(S_gib, enc, P_gib, memory, shm, gpu_util, lora_device))
    msg = why_unfit(sizes, inputs, engine)
    return PoolSizing(not msg, msg, R, sizes, inputs)


def _lora_budget(spec: InferenceServiceSpec, sources: dict[str, str]) -> tuple[int | None, int | None, int | None]:
    """(bytes per adapter, device bytes, host bytes) with spec.lora, else Nones. The budget depends on spec.lora only
    (maxLoraRank, all seven projections: the largest adapter the engine accepts), never on spec.adapters."""
    if spec.lora is None:
        return None, None, None
    size = lora_plan.budget_size(spec)
    sources["lora"] = f"{size.note}; {lora_plan.shape_note(spec)}"
    return size.bytes, spec.lora.max_loras * size.bytes, spec.lora.num_cpu_loras * size.bytes


def _processor_cache_gib(cache: CacheSpec, host_bytes: int, sources: dict[str, str]) -> float:
    """Processor cache per replica, GiB: Fixed as given, Auto min(4 GiB per frontend, 10% of H) within its bounds."""
    if cache.processor_cache.mode == "Fixed":
        sources["processorCache"] = "fixed"
        return float(cache.processor_cache.size)  # type: ignore[arg-type]
    auto = min(PROCESSOR_GIB_PER_FRONTEND * API_FRONTENDS, PROCESSOR_HOST_SHARE * host_bytes / GiB)
    gib, sources["processorCache"] = _clamp(_floor_step(auto), cache.processor_cache)
    return gib


def _swap_space_gib(cache: CacheSpec, host_bytes: int, fixed_bytes: int, swap_overhead: float,
                    sources: dict[str, str]) -> float:
    """CPU KV tier per replica, GiB: Fixed as given, Auto a share of the host bytes left after `fixed_bytes`."""
    if cache.swap_space.mode == "Fixed":
        sources["swapSpace"] = "fixed"
        return float(cache.swap_space.size)  # type: ignore[arg-type]
    auto = min(cache.swap_fraction * (host_bytes - fixed_bytes), SWAP_HOST_CAP * host_bytes) / swap_overhead / GiB
    gib, sources["swapSpace"] = _clamp(_floor_step(auto), cache.swap_space)
    return gib


def why_unfit(sizes: PoolSizes, inputs: PoolInputs, engine: Engine) -> str:
    """Why a replica of `sizes` does not fit its share of a node: host memory, or GPU memory left ("": it fits)."""
    fp, H, E, R = engine.footprint, inputs.host_bytes_per_replica, inputs.engine_bytes, sizes.replicas_per_node
    S_gib, P_gib, memory, shm = sizes.swap_space_gib, sizes.processor_cache_gib, sizes.memory_bytes, sizes.shm_bytes
    if memory > H:
        swap = f"swap {S_gib:g}" + (f" x {fp.swap_overhead:g}" if fp.swap_overhead != 1 else "")
        proc = f" + processor cache {P_gib:g} x {fp.processor_copies}" if fp.processor_copies else ""
        if inputs.sources.get("gpuMemory") == CPU_ONLY and sizes.encoder_cache_tokens:  # held in host memory
            proc += f" + encoder cache {sizes.encoder_cache_tokens * inputs.bytes_per_encoder_token / GiB:.2f}"
        return (f"a replica needs {memory / GiB:.2f} GiB host memory (engine {E / GiB:.2f} + {swap}{proc} "
                f"+ /dev/shm {shm / GiB:.2f}) but {R} per node leaves {H / GiB:.2f} GiB each")
    if sizes.lora_device_bytes and inputs.gpu_bytes_per_replica and \
            sizes.lora_device_bytes > LORA_GPU_SHARE * inputs.gpu_bytes_per_replica:
        return (f"LoRA adapters resident on the accelerator need {sizes.lora_device_bytes / GiB:.2f} GiB (maxLoras x "
                f"{(inputs.bytes_per_adapter or 0) / MiB:.1f} MiB), more than {LORA_GPU_SHARE:g} of the "
                f"{inputs.gpu_bytes_per_replica / GiB:.2f} GiB GPU memory per replica; lower spec.lora.maxLoras or maxLoraRank")
    gpu_util, enc = sizes.gpu_memory_utilization, sizes.encoder_cache_tokens
    if gpu_util is not None and gpu_util < MIN_GPU_MEMORY_UTILIZATION:
        return (f"the encoder cache ({enc} tokens) leaves {engine.kind} --gpu-memory-utilization {gpu_util:g}, "
                f"below {MIN_GPU_MEMORY_UTILIZATION:g}")
    return ""


def _encoder_tokens(spec: InferenceServiceSpec, engine: Engine, g: int, token_bytes: int, sources: dict[str, str]) -> int | None:
    """Encoder cache per replica in tokens, budgeted per GPU: with tensor parallelism every rank holds every output."""
    cache = spec.cache
    floor_tokens = spec.server.max_num_batched_tokens
    if not engine.sizes_encoder_cache:
        sources["encoderCache"] = f"engine ({engine.encoder_note})"
        return None
    if cache.encoder_cache.mode == "Fixed":
        sources["encoderCache"] = "fixed"
        return int(cache.encoder_cache.size)  # type: ignore[arg-type]
    if g == 0:
        sources["encoderCache"] = "floor (GPU memory unknown)"
        return floor_tokens
    value, src = _clamp(math.floor(cache.encoder_fraction * g / token_bytes), cache.encoder_cache)
    if value < floor_tokens:
        sources["encoderCache"] = "floor"
        return floor_tokens
    sources["encoderCache"] = src
    return int(value)


def _gpu_memory_utilization(engine: Engine, g: int, enc: int | None, token_bytes: int, encoder_fraction: float) -> float | None:
    """A peer engine's GPU share, less the encoder cache it allocates beside the KV pool it profiles into."""
    if engine.gpu_memory_utilization is None:
        return None
    share = 0.0
    if enc is not None:
        share = enc * token_bytes / g if g else encoder_fraction
    return math.floor((engine.gpu_memory_utilization - share) * 100 + 1e-9) / 100


def _round_up_mib(n: int) -> int:
    return -(-n // MiB) * MiB


def sizes_hash(swap_gib: float, encoder_tokens: int | None, processor_gib: float, memory: int, shm: int,
               gpu_memory_utilization: float | None = None, lora_device_bytes: int | None = None) -> str:
    """Digest of everything sizing puts into a pod template; a new value rolls the pool."""
    key = f"{swap_gib!r}|{encoder_tokens}|{processor_gib!r}|{memory}|{shm}"
    if gpu_memory_utilization is not None:  # absent for warmfleet, whose digests stay as they were
        key += f"|{gpu_memory_utilization!r}"
    if lora_device_bytes is not None:  # only with spec.lora: digests without it stay as they were
        key += f"|lora {lora_device_bytes}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def assign_replicas(desired: int, capacities: list[int], floors: list[int] | None = None) -> list[int]:
    """Split `desired` replicas across pools in proportion to capacity, capped by capacity.

    Each pool first gets its floor (autoscaling per-pool minReplicas, capped by its capacity);
    the rest are handed out one at a time, each to the pool with the highest priority
    capacity / (2 * assigned + 1) that still has room (Sainte-Lague), ties to the earlier pool.
    Handing out one at a time makes the split monotone: one more replica never takes one from
    another pool, so scaling out never restarts pods elsewhere (the largest-remainder rule did:
    capacities [1, 3, 3] split 3 as [1, 1, 1] and 4 as [0, 2, 2]). Floors count towards `desired`,
    which is raised to their sum when it is below.
    """
    out = [min(f, c) for f, c in zip(floors, capacities)] if floors else [0] * len(capacities)
    for _ in range(min(max(desired, 0), sum(capacities)) - sum(out)):
        best = max((i for i, c in enumerate(capacities) if out[i] < c),
                   key=lambda i: (capacities[i] / (2 * out[i] + 1), -i))
        out[best] += 1
    return out
