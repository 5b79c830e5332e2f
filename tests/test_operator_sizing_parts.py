"""The named parts of sizing.size_pool, each on its own: the processor cache, the CPU KV tier, and why a replica
does not fit (pure)."""

from __future__ import annotations

from warmfleet.operator.planning.engine_descriptions import engine_of
from warmfleet.operator.planning.nodes import GiB
from warmfleet.operator.planning.sizing import (
    MIN_GPU_MEMORY_UTILIZATION,
    _processor_cache_gib,
    _swap_space_gib,
    why_unfit,
)
from warmfleet.operator.spec.inference_service import PoolInputs, PoolSizes, parse_spec


def cache(**kw):
    return parse_spec({"model": {"path": "/m"}, "cache": kw}).cache


def test_processor_cache_is_fixed_as_given_else_the_smaller_of_4_gib_and_a_tenth_of_the_host_share():
    sources: dict[str, str] = {}
    assert _processor_cache_gib(cache(processorCache={"mode": "Fixed", "size": 3}), 100 * GiB, sources) == 3.0
    assert sources == {"processorCache": "fixed"}
    assert _processor_cache_gib(cache(), 100 * GiB, sources) == 4.0 and sources["processorCache"] == "auto"
    assert _processor_cache_gib(cache(), 30 * GiB, sources) == 3.0  # 10% of 30 GiB
    assert _processor_cache_gib(cache(), 29 * GiB, sources) == 2.75  # floored to a quarter GiB
    assert _processor_cache_gib(cache(processorCache={"min": 8}), 30 * GiB, sources) == 8
    assert sources["processorCache"] == "min"


def test_swap_space_takes_its_share_of_what_is_left_capped_and_per_overhead():
    sources: dict[str, str] = {}
    c = cache(swapFraction=0.5)
    assert _swap_space_gib(c, 100 * GiB, 20 * GiB, 1.0, sources) == 40.0  # half of the 80 left
    assert sources == {"swapSpace": "auto"}
    assert _swap_space_gib(c, 100 * GiB, 20 * GiB, 2.0, sources) == 20.0  # each GiB costs two host GiB
    assert _swap_space_gib(cache(swapFraction=1.0), 100 * GiB, 0, 1.0, sources) == 70.0  # at most 70% of H
    assert _swap_space_gib(c, 10 * GiB, 20 * GiB, 1.0, sources) == 0.0  # nothing left: none, not negative
    assert _swap_space_gib(cache(swapSpace={"mode": "Fixed", "size": 7}), GiB, GiB, 1.0, sources) == 7.0
    assert sources["swapSpace"] == "fixed"


def sizes(memory: int, gpu_util: float | None = None) -> PoolSizes:
    return PoolSizes(replicas_per_node=2, swap_space_gib=8.0, encoder_cache_tokens=1000, processor_cache_gib=4.0,
                     gpu_memory_utilization=gpu_util, memory_bytes=memory, shm_bytes=GiB, hash="h")


INPUTS = PoolInputs(host_bytes_per_replica=32 * GiB, engine_bytes=16 * GiB, gpu_bytes_per_replica=80 * GiB,
                    bytes_per_encoder_token=8192, sources={})


def test_why_unfit_names_host_memory_then_gpu_memory_and_is_empty_when_it_fits():
    vllm = engine_of(parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm", "image": "v"}}))
    assert why_unfit(sizes(32 * GiB, 0.5), INPUTS, vllm) == ""
    msg = why_unfit(sizes(33 * GiB), INPUTS, vllm)
    assert msg.startswith("a replica needs 33.00 GiB host memory (engine 16.00 + swap 8")
    assert msg.endswith("but 2 per node leaves 32.00 GiB each") and "processor cache 4 x" in msg
    msg = why_unfit(sizes(GiB, MIN_GPU_MEMORY_UTILIZATION / 2), INPUTS, vllm)
    assert msg == "the encoder cache (1000 tokens) leaves vllm --gpu-memory-utilization 0.05, below 0.1"
    assert why_unfit(sizes(GiB, MIN_GPU_MEMORY_UTILIZATION), INPUTS, vllm) == ""
