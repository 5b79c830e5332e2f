"""spec.engine.kind `auto` -> the engine that fits the service's pools (vLLM on GPUs, warmfleet on CPUs), and why; pure."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from warmfleet.operator.planning.engine_descriptions import ENGINES
from warmfleet.operator.planning.nodes import NodeInfo, Pool, derive_pools
from warmfleet.operator.spec.inference_service import EngineKind, EngineStatus, InferenceServiceSpec

AUTO_GPU_ENGINE: EngineKind = "vllm"  # auto's pick where any pool has GPUs: the engine with GPU kernels and exact hashes
AUTO_CPU_ENGINE: EngineKind = "warmfleet"  # auto's pick where every pool is CPU-only (or none matches yet)


@dataclass(frozen=True)
class EngineChoice:
    """The engine every pool runs, who chose it, and the pools that decided it."""

    kind: EngineKind
    chosen_by: Literal["spec", "auto"]
    gpu_pools: tuple[str, ...]  # pools whose nodes have allocatable GPUs
    pools: int  # pools in all
    cpu_replicas: bool = False  # spec.server.gpusPerReplica is 0: every pool's replicas run on CPUs
    cpu_pools: tuple[str, ...] = ()  # pools whose nodes have no allocatable GPU

    @property
    def reason(self) -> str:
        """Why this engine, in one sentence."""
        gpus = f"{'pool' if len(self.gpu_pools) == 1 else 'pools'} {', '.join(self.gpu_pools)}"
        if self.chosen_by == "spec":
            return f"{self.kind}: spec.engine.kind says so" + (f" (GPUs on {gpus})" if self.gpu_pools else "")
        if self.cpu_replicas:
            return f"{self.kind}: spec.engine.kind is auto and spec.server.gpusPerReplica is 0 (CPU-only replicas)"
        if self.gpu_pools:
            return f"{self.kind}: spec.engine.kind is auto and {gpus} {'has' if len(self.gpu_pools) == 1 else 'have'} GPUs"
        if self.pools:
            return f"{self.kind}: spec.engine.kind is auto and every pool is CPU-only"
        return (f"{self.kind}: spec.engine.kind is auto and no node matches yet (nodes with GPUs would make it "
                f"{AUTO_GPU_ENGINE})")

    @property
    def lacks_gpu_backend(self) -> bool:
        """The engine has no GPU attention backend but some pools have GPUs its replicas take (gpusPerReplica above 0):
        it would run on their CPUs."""
        return bool(self.gpu_pools) and not self.cpu_replicas and not ENGINES[self.kind].gpu_attention

    @property
    def gpu_engine_on_cpu_pools(self) -> bool:
        """A GPU engine (vLLM, FastDeploy: the operator renders no CPU build of either) and only pools without GPUs,
        so no replica runs anywhere (beside GPU pools, a CPU pool's own status says it hosts none)."""
        return bool(self.cpu_pools) and not self.gpu_pools and ENGINES[self.kind].gpu_attention

    def cpu_pools_message(self) -> str:
        """The warning for `gpu_engine_on_cpu_pools` (condition and Event)."""
        return (f"engine {self.kind} runs on GPUs (the operator renders no CPU build of it): pools "
                f"{', '.join(self.cpu_pools)} have no allocatable GPU and host none of its replicas; for CPU-only "
                "nodes set spec.engine.kind to auto or warmfleet (CPU attention), or add GPU nodes")

    def no_gpu_backend_message(self) -> str:
        """The warning for `lacks_gpu_backend` (condition, Event and `warmfleet operator render`)."""
        return (f"engine {self.kind} has no GPU attention backend (docs/performance.md): on pools "
                f"{', '.join(self.gpu_pools)} it runs on the CPU and leaves the GPUs idle; set spec.engine.kind to auto "
                f"or {AUTO_GPU_ENGINE}")

    def status(self) -> EngineStatus:
        """status.engine."""
        return EngineStatus(kind=self.kind, chosen_by=self.chosen_by, reason=self.reason)


def choose(spec: InferenceServiceSpec, pools: list[Pool]) -> EngineChoice:
    """spec.engine.kind when it names one; for auto, vLLM if any pool has GPUs, else warmfleet."""
    gpu_pools = tuple(p.name for p in pools if p.has_gpus)
    cpu_pools = tuple(p.name for p in pools if not p.has_gpus)
    cpu_replicas = spec.server.gpus_per_replica == 0  # replicas without GPUs: only an engine with CPU attention runs them
    if spec.engine.kind != "auto":
        return EngineChoice(spec.engine.kind, "spec", gpu_pools, len(pools), cpu_replicas, cpu_pools)
    kind = AUTO_CPU_ENGINE if cpu_replicas or not gpu_pools else AUTO_GPU_ENGINE
    return EngineChoice(kind, "auto", gpu_pools, len(pools), cpu_replicas, cpu_pools)


def resolve(spec: InferenceServiceSpec, nodes: list[NodeInfo]) -> tuple[InferenceServiceSpec, EngineChoice]:
    """The spec with engine.kind resolved for these nodes (every later step sees a concrete kind), and the choice. GPU
    nodes whose taints the server pods do not tolerate count for auto: a missing toleration is reported
    (TaintsTolerated), it does not turn the service into CPU replicas elsewhere."""
    choice = choose(spec, derive_pools(spec, nodes, tolerated_only=spec.engine.kind != "auto"))
    if spec.engine.kind == choice.kind:
        return spec, choice
    return dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, kind=choice.kind)), choice
