"""Per-pool sizing: swap space, encoder and processor caches, pod memory and /dev/shm; pure, see docs/sizing.md."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from warmfleet.operator.nodes import GiB, MiB, Pool
from warmfleet.operator.spec import GiBSize, InferenceServiceSpec, PoolInputs, PoolSizes, TokenSize

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROCESSOR_GIB_PER_FRONTEND = 4.0  # Auto processor cache ceiling per API frontend
API_FRONTENDS = 1  # `warmfleet serve` runs one API frontend per replica
PROCESSOR_HOST_SHARE = 0.10  # Auto processor cache ceiling as a share of H
SWAP_HOST_CAP = 0.7  # Auto swap never exceeds this share of H
SHM_HEADROOM_BYTES = 1 * GiB  # /dev/shm beyond the processor cache (IPC buffers, paddle workers)
GIB_STEP = 0.25  # GiB sizes are floored to this step so flags stay readable and stable


@dataclass(frozen=True)
class PoolSizing:
    """The outcome for one pool: sizes when a replica fits, otherwise the reason."""

    fits: bool
    message: str  # empty when fits
    replicas_per_node: int
    sizes: PoolSizes | None
    inputs: PoolInputs | None

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


def size_pool(spec: InferenceServiceSpec, pool: Pool) -> PoolSizing:
    """Derive per-replica sizes for `pool` (formulas in docs/sizing.md); explicit (Fixed) sizes win."""
    gpr = spec.server.gpus_per_replica
    R = pool.gpus_per_node // gpr
    if R == 0:
        have = pool.gpus_per_node
        return PoolSizing(False, f"nodes have {have} allocatable {'GPU' if have == 1 else 'GPUs'}, a replica needs {gpr}", 0, None, None)
    cache = spec.cache
    H = int(pool.host_memory_bytes * (1 - cache.host_reserve_fraction) / R)
    E = int(spec.server.engine_memory_gib * GiB)
    sources: dict[str, str] = {}

    if cache.processor_cache.mode == "Fixed":
        P_gib, sources["processorCache"] = float(cache.processor_cache.size), "fixed"  # type: ignore[arg-type]
    else:
        auto = min(PROCESSOR_GIB_PER_FRONTEND * API_FRONTENDS, PROCESSOR_HOST_SHARE * H / GiB)
        P_gib, sources["processorCache"] = _clamp(_floor_step(auto), cache.processor_cache)
    shm = _round_up_mib(int(P_gib * GiB) + SHM_HEADROOM_BYTES)

    if cache.swap_space.mode == "Fixed":
        S_gib, sources["swapSpace"] = float(cache.swap_space.size), "fixed"  # type: ignore[arg-type]
    else:
        auto = min(cache.swap_fraction * (H - E - shm), SWAP_HOST_CAP * H) / GiB
        S_gib, sources["swapSpace"] = _clamp(_floor_step(auto), cache.swap_space)

    g = pool.gpu_memory_mib * MiB
    token_bytes = spec.model.hidden_size * DTYPE_BYTES[spec.model.dtype]
    floor_tokens = spec.server.max_num_batched_tokens
    if cache.encoder_cache.mode == "Fixed":
        enc, sources["encoderCache"] = int(cache.encoder_cache.size), "fixed"  # type: ignore[arg-type]
    elif g == 0:
        enc, sources["encoderCache"] = floor_tokens, "floor (GPU memory unknown)"
    else:
        value, src = _clamp(math.floor(cache.encoder_fraction * g * gpr / token_bytes), cache.encoder_cache)
        enc, sources["encoderCache"] = (int(value), src) if value >= floor_tokens else (floor_tokens, "floor")

    memory = _round_up_mib(E + shm + int(S_gib * GiB))
    inputs = PoolInputs(
        host_bytes_per_replica=H, engine_bytes=E, gpu_bytes_per_replica=g * gpr,
        bytes_per_encoder_token=token_bytes, sources=sources,
    )
    sizes = PoolSizes(
        replicas_per_node=R, swap_space_gib=S_gib, encoder_cache_tokens=enc, processor_cache_gib=P_gib,
        memory_bytes=memory, shm_bytes=shm, hash=sizes_hash(S_gib, enc, P_gib, memory, shm),
    )
    if memory > H:
        msg = (f"a replica needs {memory / GiB:.2f} GiB host memory (engine {E / GiB:.2f} + swap {S_gib:g} "
               f"+ /dev/shm {shm / GiB:.2f}) but {R} per node leaves {H / GiB:.2f} GiB each")
        return PoolSizing(False, msg, R, sizes, inputs)
    return PoolSizing(True, "", R, sizes, inputs)


def _round_up_mib(n: int) -> int:
    return -(-n // MiB) * MiB


def sizes_hash(swap_gib: float, encoder_tokens: int, processor_gib: float, memory: int, shm: int) -> str:
    """Digest of everything sizing puts into a pod template; a new value rolls the pool."""
    key = f"{swap_gib!r}|{encoder_tokens}|{processor_gib!r}|{memory}|{shm}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def assign_replicas(desired: int, capacities: list[int]) -> list[int]:
    """Split `desired` replicas across pools in proportion to capacity (largest remainder), capped by capacity.

    Ties go to the earlier pool, so the split is deterministic for a sorted pool list.
    """
    total = sum(capacities)
    if total == 0 or desired <= 0:
        return [0] * len(capacities)
    want = min(desired, total)
    exact = [want * c / total for c in capacities]
    out = [min(int(x), c) for x, c in zip(exact, capacities)]
    order = sorted(range(len(capacities)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    left = want - sum(out)
    while left > 0:
        for i in order:
            if left and out[i] < capacities[i]:
                out[i] += 1
                left -= 1
    return out
