"""Pure sizing: node pools, per-pool cache sizes (docs/sizing.md) and the replica split."""

from __future__ import annotations

import itertools

import pytest

from operator_fixtures.shapes import GiB, TiB, a100, h200, l4, node
from warmfleet.operator.planning.engine_descriptions import VLLM_OFFLOAD_HOST_OVERHEAD, engine_of
from warmfleet.operator.planning.nodes import derive_pools, format_bytes, node_info, parse_quantity
from warmfleet.operator.planning.sizing import assign_replicas, size_pool, sizes_hash
from warmfleet.operator.spec.inference_service import parse_spec

MiB = 1 << 20


VLLM = {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"}
FD = {"kind": "fastdeploy", "image": "fastdeploy:2.3"}


def spec(**over):
    """A spec for warmfleet's engine unless `engine` says otherwise (auto's choice: test_operator_engine_choice.py)."""
    return parse_spec({"model": {"path": "/m"}, "engine": {"kind": "warmfleet"}, **over})


def only_pool(s, *nodes):
    pools = derive_pools(s, [node_info(n) for n in nodes])
    assert len(pools) == 1
    return pools[0]


# ---- quantities and node parsing ----

@pytest.mark.parametrize("text,value", [
    ("2113929216Ki", 2113929216 * 1024), ("1Ti", TiB), ("192Gi", 192 * GiB), ("8", 8), ("500m", 0.5), ("1e3", 1000), ("2G", 2 * 10**9),
])
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


def test_parse_quantity_rejects_garbage():
    with pytest.raises(ValueError):
        parse_quantity("12 apples")


@pytest.mark.parametrize("n,text", [(GiB, "1Gi"), (1536 * MiB, "1536Mi"), (TiB, "1Ti"), (1000, "1000"), (5 * GiB + 1024, "5242881Ki")])
def test_format_bytes_is_canonical(n, text):
    assert format_bytes(n) == text
    assert parse_quantity(text) == n


def test_node_info_reads_labels_and_allocatable():
    info = node_info(h200())
    assert (info.gpu_product, info.gpu_memory_mib, info.gpus, info.memory_bytes, info.schedulable) == ("NVIDIA-H200", 143771, 8, 2 * TiB, True)


def test_node_without_gpu_labels():
    info = node_info(node("cpu", memory=64 * GiB))
    assert (info.gpu_product, info.gpu_memory_mib, info.gpus) == ("unknown", 0, 0)


# ---- pools ----

def test_pools_group_by_shape_and_skip_unready_and_cordoned():
    nodes = [h200("h1"), h200("h2"), a100("a1"), l4("l1"), h200("h3", ready=False), h200("h4", cordoned=True)]
    pools = derive_pools(spec(), [node_info(n) for n in nodes])
    by_product = {p.gpu_product: p for p in pools}
    assert set(by_product) == {"NVIDIA-H200", "NVIDIA-A100-SXM4-80GB", "NVIDIA-L4"}
    assert by_product["NVIDIA-H200"].nodes == ("h1", "h2")


def test_pool_memory_jitter_within_a_gib_is_one_pool_sized_for_the_smallest():
    small = h200("h2")
    small["status"]["allocatable"]["memory"] = f"{(2 * TiB - 300 * MiB) // 1024}Ki"
    pool = only_pool(spec(), h200("h1"), small)
    assert pool.nodes == ("h1", "h2") and pool.host_memory_bytes == 2 * TiB - 300 * MiB


def test_different_host_memory_is_a_different_pool_and_the_majority_keeps_the_name():
    plain = derive_pools(spec(), [node_info(h200("h1")), node_info(h200("h2"))])[0].name
    pools = derive_pools(spec(), [node_info(h200("h1")), node_info(h200("h2")), node_info(h200("h3", memory=1 * TiB))])
    assert [(p.name, p.nodes) for p in pools] == [(plain, ("h1", "h2")), (f"{plain}-1024gi", ("h3",))]


def test_selector_and_named_pools():
    nodes = [h200("h1", labels={"zone": "a", "serve": "yes"}), h200("h2", labels={"zone": "b", "serve": "yes"}), h200("h3", labels={"zone": "a"})]
    s = spec(nodeSelector={"serve": "yes"}, pools=[{"name": "east", "nodeSelector": {"zone": "a"}}, {"name": "west", "nodeSelector": {"zone": "b"}}])
    pools = derive_pools(s, [node_info(n) for n in nodes])
    assert [(p.named, p.nodes) for p in pools] == [("east", ("h1",)), ("west", ("h2",))]
    assert pools[0].name.startswith("east-h200-8g-") and pools[0].selector == (("zone", "a"),)


def test_pool_names_are_stable_dns_labels():
    a = derive_pools(spec(), [node_info(h200("x"))])[0].name
    b = derive_pools(spec(), [node_info(h200("y")), node_info(h200("z"))])[0].name
    assert a == b and len(a) <= 63 and a.replace("-", "").isalnum() and a == a.lower()


# ---- sizing: the Auto formulas, shape by shape ----

def gib(x):
    return int(round(x * GiB))


def test_h200_2tib():
    sz = size_pool(spec(), only_pool(spec(), h200()))
    assert sz.fits and sz.replicas_per_node == 8
    # H = 2048 GiB * 0.9 / 8 = 230.4 GiB; P = min(4, 23.04) = 4; shm = P + 1 = 5 GiB
    # S = min(0.9 * (230.4 - 16 - 5), 0.7 * 230.4) = min(188.46, 161.28) -> 161.25 (0.25 GiB steps)
    assert sz.sizes.processor_cache_gib == 4.0
    assert sz.sizes.swap_space_gib == 161.25
    assert sz.sizes.shm_bytes == 5 * GiB
    assert sz.sizes.memory_bytes == gib(16 + 5 + 161.25)
    # encoder: floor(0.05 * 143771 MiB / (4096 * 2 bytes)) = floor(920134.4)
    assert sz.sizes.encoder_cache_tokens == 920134
    assert sz.inputs.host_bytes_per_replica == int(2 * TiB * 0.9 / 8)
    assert sz.inputs.sources == {"processorCache": "auto", "swapSpace": "auto", "encoderCache": "auto", "gpuMemory": "label"}


def test_a100_1tib():
    sz = size_pool(spec(), only_pool(spec(), a100()))
    # H = 115.2; S = min(0.9 * 94.2 = 84.78, 0.7 * 115.2 = 80.64) -> 80.5
    assert (sz.sizes.swap_space_gib, sz.sizes.processor_cache_gib, sz.sizes.encoder_cache_tokens) == (80.5, 4.0, 524288)
    assert sz.sizes.memory_bytes == gib(101.5)


def test_l4_192gib():
    sz = size_pool(spec(), only_pool(spec(), l4()))
    # R = 4; H = 43.2; P = min(4, 4.32) = 4; S = min(0.9 * 22.2 = 19.98, 30.24) -> 19.75
    assert sz.replicas_per_node == 4
    assert (sz.sizes.swap_space_gib, sz.sizes.processor_cache_gib, sz.sizes.encoder_cache_tokens) == (19.75, 4.0, 147417)
    assert sz.sizes.memory_bytes == gib(16 + 5 + 19.75) <= sz.inputs.host_bytes_per_replica


def test_gpus_per_replica_divides_the_node():
    s = spec(engine=FD, server={"gpusPerReplica": 2})
    sz = size_pool(s, only_pool(s, h200()))
    assert sz.replicas_per_node == 4
    assert sz.inputs.gpu_bytes_per_replica == 2 * 143771 * MiB
    # H = 2048 GiB * 0.9 / 4 = 460.8: S = min(0.9 * (460.8 - 16 - 4 - 1), 0.7 * 460.8) = 322.56 -> 322.5
    assert sz.sizes.swap_space_gib == 322.5
    # the encoder budget is per GPU (every tensor-parallel rank holds every encoder output), not doubled
    assert sz.sizes.encoder_cache_tokens == 920134
    s3 = spec(engine=FD, server={"gpusPerReplica": 3})
    assert size_pool(s3, only_pool(s3, h200())).replicas_per_node == 2  # floor(8 / 3)


def test_replica_wider_than_the_node_does_not_fit():
    s = spec(engine=VLLM, server={"gpusPerReplica": 8})
    sz = size_pool(s, only_pool(s, l4()))
    assert not sz.fits and sz.capacity_per_node == 0
    assert "4 allocatable GPUs, a replica needs 8" in sz.message


# ---- CPU-only pools (warmfleet's engine: CPU attention) ----

def test_a_cpu_only_pool_hosts_warmfleet_replicas_packed_by_cpu():
    s = spec(server={"cpus": 8})
    sz = size_pool(s, only_pool(s, node("cpu", memory=512 * GiB)))  # 64 CPUs (the fixture's), no GPU
    assert sz.fits and sz.replicas_per_node == 8  # 64 / 8; memory would allow 27 (460.8 GiB / (16 + 1))
    src = sz.inputs.sources
    assert src["replicasPerNode"] == "cpu (64 allocatable / 8 per replica)" and src["gpuMemory"] == "none (CPU-only)"
    H = 512 * GiB * 0.9 / 8
    assert sz.inputs.host_bytes_per_replica == int(H) and sz.inputs.gpu_bytes_per_replica == 0
    # the encoder cache is budgeted from, and held in, host memory: encoderFraction x H / (hiddenSize x dtype bytes)
    token_bytes = sz.inputs.bytes_per_encoder_token
    assert src["encoderCache"] == "auto (host memory)"
    assert sz.sizes.encoder_cache_tokens == int(s.cache.encoder_fraction * int(H) // token_bytes)
    enc_bytes = sz.sizes.encoder_cache_tokens * token_bytes
    assert sz.sizes.swap_space_gib > 0 and sz.sizes.processor_cache_gib == 4.0
    assert sz.sizes.memory_bytes >= 16 * GiB + enc_bytes + sz.sizes.swap_space_gib * GiB
    assert sz.sizes.memory_bytes <= H and sz.sizes.gpu_memory_utilization is None


def test_a_cpu_only_pool_packs_fewer_replicas_when_memory_binds():
    sz = size_pool(spec(), only_pool(spec(), node("cpu")))  # 64 CPUs / 4 = 16, but 64 GiB host memory
    assert sz.fits and sz.replicas_per_node == 2
    assert sz.inputs.sources["replicasPerNode"] == "memory (the CPUs would host 16)"
    assert sz.sizes.memory_bytes <= sz.inputs.host_bytes_per_replica
    three = size_pool(spec(), only_pool(spec(), node("cpu", memory=96 * GiB)))
    # 86.4 GiB usable: 5 x (16 + 1) would fit engines and headroom alone, but not with the caches: 4
    assert three.replicas_per_node == 4 and three.inputs.sources["replicasPerNode"].startswith("memory")


def test_a_cpu_only_pool_with_too_few_cpus_says_so():
    s = spec(server={"cpus": 128})
    sz = size_pool(s, only_pool(s, node("cpu", memory=512 * GiB)))
    assert not sz.fits and sz.capacity_per_node == 0
    assert "nodes have 64 allocatable CPUs, a replica needs 128 (spec.server.cpus)" in sz.message


def test_a_cpu_only_replica_too_big_for_its_node_names_its_encoder_cache():
    s = spec(server={"cpus": 8}, cache={"encoderCache": {"mode": "Fixed", "size": 100_000_000}})
    sz = size_pool(s, only_pool(s, node("cpu", memory=512 * GiB)))
    assert not sz.fits and sz.replicas_per_node == 1  # no count of replicas per node fits it
    enc_gib = 100_000_000 * sz.inputs.bytes_per_encoder_token / GiB
    assert f"+ encoder cache {enc_gib:.2f}" in sz.message and "host memory" in sz.message


def test_gpus_per_replica_0_makes_gpu_nodes_host_cpu_only_replicas():
    s = spec(server={"gpusPerReplica": 0, "cpus": 16})
    sz = size_pool(s, only_pool(s, h200()))
    assert sz.fits and sz.replicas_per_node == 4  # 64 CPUs / 16, not the 8 GPUs
    assert sz.inputs.sources["gpuMemory"] == "none (CPU-only)" and sz.inputs.gpu_bytes_per_replica == 0


@pytest.mark.parametrize("engine", [VLLM, FD])
def test_a_gpu_engine_on_a_cpu_only_node_cannot_host_and_says_which_would(engine):
    s = spec(engine=engine)
    sz = size_pool(s, only_pool(s, node("cpu", memory=512 * GiB)))
    assert not sz.fits and sz.capacity_per_node == 0
    assert "0 allocatable GPUs (nvidia.com/gpu)" in sz.message and "engine.kind auto or warmfleet" in sz.message


def test_gpus_without_memory_label_use_the_batched_tokens_floor():
    n = node("bare", gpus=2, memory=256 * GiB)
    sz = size_pool(spec(), only_pool(spec(), n))
    assert sz.fits and sz.sizes.encoder_cache_tokens == 2048
    assert sz.inputs.sources["encoderCache"].startswith("floor")


def test_pool_too_small_for_the_caches_is_reported():
    n = node("tiny", product="NVIDIA-T4", gpu_mib=15360, gpus=1, memory=16 * GiB)
    sz = size_pool(spec(), only_pool(spec(), n))
    # H = 14.4 GiB < engine 16 GiB: swap goes to 0 and the pod still does not fit
    assert not sz.fits and sz.capacity_per_node == 0
    assert sz.sizes.swap_space_gib == 0
    assert "host memory" in sz.message and "14.40 GiB" in sz.message


def test_fixed_sizes_win_over_auto():
    s = spec(cache={"swapSpace": {"mode": "Fixed", "size": 10}, "processorCache": {"mode": "Fixed", "size": 0},
                    "encoderCache": {"mode": "Fixed", "size": 4096}})
    sz = size_pool(s, only_pool(s, l4()))
    assert (sz.sizes.swap_space_gib, sz.sizes.processor_cache_gib, sz.sizes.encoder_cache_tokens) == (10.0, 0.0, 4096)
    assert sz.sizes.shm_bytes == GiB
    assert set(sz.inputs.sources.values()) == {"fixed", "label"}  # gpuMemory: nvidia.com/gpu.memory


def test_fixed_swap_too_large_does_not_fit():
    s = spec(cache={"swapSpace": {"mode": "Fixed", "size": 100}})
    sz = size_pool(s, only_pool(s, l4()))
    assert not sz.fits and "swap 100" in sz.message


def test_min_max_clamp_auto():
    s = spec(cache={"swapSpace": {"max": 64}, "processorCache": {"min": 8}, "encoderCache": {"max": 100000}})
    sz = size_pool(s, only_pool(s, h200()))
    assert (sz.sizes.swap_space_gib, sz.sizes.processor_cache_gib, sz.sizes.encoder_cache_tokens) == (64, 8, 100000)
    assert sz.inputs.sources == {"swapSpace": "max", "processorCache": "min", "encoderCache": "max", "gpuMemory": "label"}


def test_encoder_cache_never_below_one_step():
    s = spec(cache={"encoderFraction": 0.0001}, server={"maxNumBatchedTokens": 8192})
    sz = size_pool(s, only_pool(s, l4()))
    assert sz.sizes.encoder_cache_tokens == 8192 and sz.inputs.sources["encoderCache"] == "floor"


def test_encoder_cache_scales_with_hidden_size_and_dtype():
    base = size_pool(spec(), only_pool(spec(), a100())).sizes.encoder_cache_tokens
    s = spec(model={"path": "/m", "hiddenSize": 8192, "dtype": "float32"})
    assert size_pool(s, only_pool(s, a100())).sizes.encoder_cache_tokens == base // 4


@pytest.mark.parametrize("engine", [None, VLLM, FD], ids=["warmfleet", "vllm", "fastdeploy"])
def test_sizes_always_fit_the_host_share_when_they_fit(engine):
    for n in (h200(), a100(), l4()):
        for reserve, frac in itertools.product((0.0, 0.1, 0.5), (0.0, 0.5, 1.0)):
            s = spec(cache={"hostReserveFraction": reserve, "swapFraction": frac}, **({"engine": engine} if engine else {}))
            sz = size_pool(s, only_pool(s, n))
            fp = engine_of(s).footprint
            assert sz.fits
            assert sz.sizes.memory_bytes <= sz.inputs.host_bytes_per_replica
            assert sz.sizes.swap_space_gib * GiB * fp.swap_overhead <= 0.7 * sz.inputs.host_bytes_per_replica
            if fp.swap_in_shm:  # the CPU tier's /dev/shm region counts against the pod's memory limit
                assert sz.sizes.shm_bytes >= sz.sizes.swap_space_gib * GiB * fp.swap_overhead
                assert sz.sizes.memory_bytes >= sz.sizes.shm_bytes


# ---- sizing per engine ----

def test_vllm_sizes_its_offload_tier_in_shm_with_the_overhead_and_no_encoder_cache():
    s = spec(engine=VLLM)
    sz = size_pool(s, only_pool(s, h200()))
    # H = 230.4; processor 4 GiB mirrored twice (API process + engine core) = 8; /dev/shm headroom 1
    # S = min(0.9 * (230.4 - 16 - 8 - 1), 0.7 * 230.4) / 2.0 (offload overhead) = 80.64 -> 80.5
    assert VLLM_OFFLOAD_HOST_OVERHEAD == 2.0
    assert sz.sizes.swap_space_gib == 80.5 and sz.sizes.processor_cache_gib == 4.0
    assert sz.sizes.shm_bytes == gib(1 + 2 * 80.5)  # the native tier is a /dev/shm region
    assert sz.sizes.memory_bytes == gib(16 + 2 * 4 + 1 + 2 * 80.5)
    assert sz.sizes.encoder_cache_tokens is None and sz.inputs.sources["encoderCache"].startswith("engine")
    assert "maxNumBatchedTokens" in sz.inputs.sources["encoderCache"]
    assert sz.sizes.gpu_memory_utilization == 0.9


def test_vllm_without_a_cpu_tier_needs_no_shm_for_it():
    s = spec(engine=VLLM, cache={"swapSpace": {"mode": "Fixed", "size": 0}})
    sz = size_pool(s, only_pool(s, l4()))
    assert sz.sizes.shm_bytes == GiB and sz.sizes.memory_bytes == gib(16 + 2 * 4 + 1)


def test_fastdeploy_sizes_like_warmfleet_on_the_host_and_carves_the_encoder_cache_out_of_the_gpu_share():
    s = spec(engine=FD)
    sz = size_pool(s, only_pool(s, h200()))
    ours = size_pool(spec(), only_pool(spec(), h200()))
    assert (sz.sizes.swap_space_gib, sz.sizes.encoder_cache_tokens, sz.sizes.processor_cache_gib) == (161.25, 920134, 4.0)
    assert sz.sizes.memory_bytes == ours.sizes.memory_bytes == gib(16 + 4 + 1 + 161.25)
    assert sz.sizes.shm_bytes == GiB  # its processor cache lives in process memory, not /dev/shm
    # 0.9 minus the encoder cache's share of one GPU (0.05), floored to 0.01
    assert sz.sizes.gpu_memory_utilization == 0.85
    assert ours.sizes.gpu_memory_utilization is None  # warmfleet budgets its own GPU memory


def test_an_encoder_cache_that_eats_the_gpu_does_not_fit():
    s = spec(engine=FD, cache={"encoderCache": {"mode": "Fixed", "size": 10_000_000}})
    sz = size_pool(s, only_pool(s, l4()))
    assert not sz.fits and "--gpu-memory-utilization" in sz.message


def test_warmfleet_sizing_hash_is_unchanged_by_the_engine_seam():
    """Existing warmfleet pools must not roll when the operator learns other engines."""
    sz = size_pool(spec(), only_pool(spec(), h200()))
    assert sz.sizes.hash == sizes_hash(161.25, 920134, 4.0, gib(16 + 5 + 161.25), 5 * GiB) == "85fad215f060"


def test_sizes_hash_changes_only_with_sizes():
    a = size_pool(spec(), only_pool(spec(), h200("x"))).sizes.hash
    b = size_pool(spec(), only_pool(spec(), h200("y"))).sizes.hash
    c = size_pool(spec(), only_pool(spec(), h200("y", memory=TiB))).sizes.hash
    assert a == b != c


# ---- replica split ----

def test_assign_replicas_proportional():
    assert assign_replicas(12, [8, 16, 4]) == [3, 7, 2]
    assert assign_replicas(3, [4, 4, 4]) == [1, 1, 1]
    assert assign_replicas(1, [4, 4]) == [1, 0]


def test_assign_replicas_caps_at_capacity_and_handles_zero():
    assert assign_replicas(100, [2, 3, 0]) == [2, 3, 0]
    assert assign_replicas(0, [2, 3]) == [0, 0]
    assert assign_replicas(5, [0, 0]) == [0, 0]
    assert assign_replicas(5, []) == []


def test_assign_replicas_invariants():
    for desired in range(0, 30):
        for caps in itertools.product((0, 1, 3, 8), repeat=3):
            out = assign_replicas(desired, list(caps))
            assert sum(out) == min(desired, sum(caps))
            assert all(0 <= o <= c for o, c in zip(out, caps))


def test_replica_split_is_monotone_proportional_and_capped():
    import itertools

    from warmfleet.operator.planning.sizing import assign_replicas

    assert assign_replicas(3, [1, 3, 3]) == [1, 1, 1] and assign_replicas(4, [1, 3, 3]) == [1, 2, 1]
    for caps in itertools.product(range(0, 5), repeat=3):
        prev = [0, 0, 0]
        for n in range(0, sum(caps) + 3):
            split = assign_replicas(n, list(caps))
            assert sum(split) == min(n, sum(caps)) and all(s <= c for s, c in zip(split, caps))
            assert all(s >= p for s, p in zip(split, prev)), (caps, n, prev, split)  # adding one never removes one
            prev = split
    assert assign_replicas(12, [8, 8, 4]) == [5, 5, 2]  # in proportion to capacity
    assert assign_replicas(-1, [2]) == [0] and assign_replicas(5, []) == []
