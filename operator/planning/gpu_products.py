"""Known accelerators: memory per GPU by GFD product label, and the big clouds' GPU instance types; data only, no I/O.

Used by nodes.py when a node has no `nvidia.com/gpu.memory` label (stock GKE, EKS and AKS node images run
the device plugin without GPU feature discovery). Figures are MiB per GPU. Where this repository's own
fixtures carry a GFD label value read from a real node (tests/operator_fixtures/shapes.py, examples/nodes.yaml)
that value is used; otherwise the vendor's datasheet capacity in GB taken as GiB (x 1024 MiB), which is what the
HBM and GDDR parts carry physically; nvidia-smi, and so GFD, report up to a few hundred MiB less (ECC, driver
reserve), about 1%, which moves the encoder-cache budget by as much. A product or type not listed here falls
through to spec.server.gpuMemoryGib, else a GPUMemoryUnknown condition: never a guess.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Mapping

# GFD's nvidia.com/gpu.product value (nvidia-smi's name, spaces as '-') -> MiB per GPU.
PRODUCT_MEMORY_MIB: Mapping[str, int] = MappingProxyType({
    "NVIDIA-H200": 143771,  # GFD label of an 8x H200 node (examples/nodes.yaml); datasheet: 141 GB HBM3e
    "NVIDIA-H200-NVL": 141 * 1024,  # NVIDIA H200 datasheet (NVL form factor): 141 GB HBM3e
    "NVIDIA-H100-80GB-HBM3": 80 * 1024,  # NVIDIA H100 datasheet (SXM5): 80 GB HBM3
    "NVIDIA-H100-PCIe": 80 * 1024,  # NVIDIA H100 datasheet (PCIe): 80 GB HBM2e
    "NVIDIA-H100-NVL": 94 * 1024,  # NVIDIA H100 datasheet (NVL): 94 GB HBM3
    "NVIDIA-A100-SXM4-80GB": 81920,  # GFD label of an 8x A100 node (examples/nodes.yaml); datasheet: 80 GB HBM2e
    "NVIDIA-A100-SXM4-40GB": 40 * 1024,  # NVIDIA A100 datasheet (SXM4 40GB): 40 GB HBM2
    "NVIDIA-A100-80GB-PCIe": 80 * 1024,  # NVIDIA A100 datasheet (PCIe 80GB): 80 GB HBM2e
    "NVIDIA-A100-PCIE-40GB": 40 * 1024,  # NVIDIA A100 datasheet (PCIe 40GB): 40 GB HBM2
    "NVIDIA-L40S": 48 * 1024,  # NVIDIA L40S datasheet: 48 GB GDDR6
    "NVIDIA-L40": 48 * 1024,  # NVIDIA L40 datasheet: 48 GB GDDR6
    "NVIDIA-L4": 23034,  # GFD label of a 4x L4 node (examples/nodes.yaml); datasheet: 24 GB GDDR6
    "NVIDIA-A10G": 24 * 1024,  # AWS G5 instance page: NVIDIA A10G, 24 GiB per GPU
    "NVIDIA-A10": 24 * 1024,  # NVIDIA A10 datasheet: 24 GB GDDR6
    "Tesla-T4": 16 * 1024,  # NVIDIA T4 datasheet: 16 GB GDDR6
    "Tesla-V100-SXM2-16GB": 16 * 1024,  # NVIDIA V100 datasheet (SXM2 16GB): 16 GB HBM2
    "Tesla-V100-SXM2-32GB": 32 * 1024,  # NVIDIA V100 datasheet (SXM2 32GB): 32 GB HBM2
    "AMD-Instinct-MI300X": 192 * 1024,  # AMD Instinct MI300X datasheet: 192 GB HBM3 (key of the instance table only)
})

# node.kubernetes.io/instance-type patterns -> the product above its GPUs are (the count comes from allocatable).
_AWS = "AWS EC2 accelerated computing instance types (aws.amazon.com/ec2/instance-types, 'Accelerated Computing')"
_GCP = "Google Cloud GPU machine types (cloud.google.com/compute/docs/gpus)"
_AZURE = "Azure GPU-accelerated VM sizes (learn.microsoft.com/azure/virtual-machines/sizes, 'GPU accelerated')"
INSTANCE_TYPES: tuple[tuple[str, str, str], ...] = (
    # (regular expression over the whole label value, product key, source)
    (r"p4d\.\w+", "NVIDIA-A100-SXM4-40GB", f"{_AWS}: P4d, 8x A100 40 GB"),
    (r"p4de\.\w+", "NVIDIA-A100-SXM4-80GB", f"{_AWS}: P4de, 8x A100 80 GB"),
    (r"p5\.\w+", "NVIDIA-H100-80GB-HBM3", f"{_AWS}: P5, H100 80 GB HBM3"),
    (r"p5e\.\w+", "NVIDIA-H200", f"{_AWS}: P5e, 8x H200 141 GB HBM3e"),
    (r"p5en\.\w+", "NVIDIA-H200", f"{_AWS}: P5en, 8x H200 141 GB HBM3e"),
    (r"g5\.\w+", "NVIDIA-A10G", f"{_AWS}: G5, A10G 24 GB"),
    (r"g6\.\w+", "NVIDIA-L4", f"{_AWS}: G6, L4 24 GB"),
    (r"g6e\.\w+", "NVIDIA-L40S", f"{_AWS}: G6e, L40S 48 GB"),
    (r"g4dn\.\w+", "Tesla-T4", f"{_AWS}: G4dn, T4 16 GB"),
    (r"a2-(highgpu|megagpu)-\w+", "NVIDIA-A100-SXM4-40GB", f"{_GCP}: A2 Standard, A100 40GB"),
    (r"a2-ultragpu-\w+", "NVIDIA-A100-SXM4-80GB", f"{_GCP}: A2 Ultra, A100 80GB"),
    (r"a3-(highgpu|megagpu|edgegpu)-\w+", "NVIDIA-H100-80GB-HBM3", f"{_GCP}: A3 High/Mega/Edge, H100 80GB"),
    (r"a3-ultragpu-\w+", "NVIDIA-H200", f"{_GCP}: A3 Ultra, H200 141GB"),
    (r"g2-standard-\w+", "NVIDIA-L4", f"{_GCP}: G2, L4 24 GB"),
    (r"Standard_ND96asr_v4", "NVIDIA-A100-SXM4-40GB", f"{_AZURE}: ND A100 v4, 8x A100 40 GB"),
    (r"Standard_ND96amsr_A100_v4", "NVIDIA-A100-SXM4-80GB", f"{_AZURE}: NDm A100 v4, 8x A100 80 GB"),
    (r"Standard_NC\d+ads_A100_v4", "NVIDIA-A100-80GB-PCIe", f"{_AZURE}: NC A100 v4, A100 PCIe 80 GB"),
    (r"Standard_ND96isr_H100_v5", "NVIDIA-H100-80GB-HBM3", f"{_AZURE}: ND H100 v5, 8x H100 80 GB"),
    (r"Standard_ND96isr_H200_v5", "NVIDIA-H200", f"{_AZURE}: ND H200 v5, 8x H200 141 GB"),
    (r"Standard_NC\d+ads_H100_v5", "NVIDIA-H100-NVL", f"{_AZURE}: NC H100 v5, H100 NVL 94 GB"),
    (r"Standard_NC\d+as_T4_v3", "Tesla-T4", f"{_AZURE}: NCasT4_v3, T4 16 GB"),
    (r"Standard_ND96isr_MI300X_v5", "AMD-Instinct-MI300X", f"{_AZURE}: ND MI300X v5, 8x MI300X 192 GB"),
)
_COMPILED = tuple((re.compile(rx, re.IGNORECASE), product) for rx, product, _ in INSTANCE_TYPES)


def whole_gpu(product: str) -> bool:
    """False for a MIG slice or a time-sliced GPU (GFD's `-MIG-...` and `-SHARED` products): a share of a GPU, whose
    memory neither table knows."""
    return "-MIG-" not in product and not product.endswith("-SHARED")


def product_memory_mib(product: str) -> int | None:
    """MiB per GPU of a GFD product label value, or None when the table does not know it."""
    return PRODUCT_MEMORY_MIB.get(product)


def instance_type_product(instance_type: str) -> str | None:
    """The product a cloud's GPU instance type carries, or None when it is not one listed here."""
    return next((product for rx, product in _COMPILED if rx.fullmatch(instance_type)), None)
