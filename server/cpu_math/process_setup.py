"""Math-library setup of the process that runs the model (engine core, offline LLM): MKL path, threads, oneDNN, allocator; imports paddle only inside `configure`.

Call `configure` before the first matmul of the process:

- MKL code path. Paddle's CPU wheel links MKL 2019 (mklml), which runs a generic, ~3x slower
  sgemm on CPUs whose vendor is not Intel; `MKL_DEBUG_CPU_TYPE=5` selects its AVX2 kernels
  (docs/performance.md) where the CPU has AVX2 (cpu_features.py: a guest may be shown AVX without
  it). MKL reads the variable at its first call, so setting it here, after `import paddle`, still
  counts. A value set by the user is left alone.
- Math threads (MKL and OpenMP): `--engine-threads`, default 1, as Paddle's own default and as
  vLLM's CPU worker. The API process does no math and starts no math pool.
- Projections: oneDNN's matmul on weights packed at load where Paddle's wheel ships it
  (onednn.py), on its own OpenMP runtime, given the same thread count here.
- Allocator: a prefill step allocates and frees tens of megabytes per layer. glibc serves
  blocks above 128 KiB (a threshold it adapts) with mmap and hands freed heap back to the
  kernel, so every step pays page faults to get the same memory again; keeping blocks up to
  32 MiB (glibc's maximum) in the heap and not trimming it cut a 2k-token prefill's CPU time
  by ~14% (docs/performance.md). Blocks above 32 MiB were still mmapped per allocation: on
  Qwen2.5-0.5B a 2,048-token step's 40 MB gate/up outputs paid ~10k page faults each, every layer
  (101 vs 112 GFLOP/s for that projection), so mmap is now off altogether (M_MMAP_MAX 0) and
  every block comes from the heap. The process keeps its peak heap instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Optional

from . import cpu_features

log = logging.getLogger("warmfleet.engine")

MKL_AVX2 = "5"  # MKL_DEBUG_CPU_TYPE value that selects MKL's AVX2 code path
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt parameters
TRIM_THRESHOLD_BYTES = 1 << 30


def cpu_vendor() -> Optional[str]:
    """`vendor_id` of /proc/cpuinfo (e.g. AuthenticAMD, GenuineIntel); None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def configure(threads: int = 1) -> dict:
    """Apply the settings above to this process; returns what was applied (for the start-up log)."""
    if threads < 1:
        raise ValueError(f"--engine-threads must be >= 1, got {threads}")
    if "MKL_DEBUG_CPU_TYPE" not in os.environ and cpu_vendor() == "AuthenticAMD" and cpu_features.runs("avx2", "fma"):
        os.environ["MKL_DEBUG_CPU_TYPE"] = MKL_AVX2
    import paddle

    from . import onednn

    paddle.base.core.set_num_threads(threads)
    applied = {"threads": threads, "mkl_debug_cpu_type": os.environ.get("MKL_DEBUG_CPU_TYPE"),
               "malloc_tuned": tune_malloc(), "onednn_matmul": onednn.load(threads) or "yes"}
    log.info("engine math: %s", applied)
    return applied


def tune_malloc() -> bool:
    """Serve every block from glibc's heap and keep freed ones there (see the module docstring); False without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the running process's libc
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
