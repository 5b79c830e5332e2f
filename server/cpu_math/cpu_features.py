"""Which instruction sets this host's CPU runs (/proc/cpuinfo flags), asked before a library path that assumes one.

An instruction the CPU lacks kills the process with SIGILL instead of raising, so such paths ask
here first and take their portable fallback otherwise:

- Paddle 3.3's CPU `fused_rms_norm` (`RmsNormAvxKernel`) is AVX-512 code (zmm registers) with no
  runtime dispatch: on a CPU without AVX-512 (Zen 3, many cloud guests) it dies on its first call.
- MKL's AVX2 sgemm, which process_setup.py selects on AMD CPUs, needs AVX2 and FMA.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.lru_cache(maxsize=None)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset:
    """The first processor's `flags` (empty where there is no such file or line)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runs(*flags: str) -> bool:
    """Whether this x86 CPU has every one of `flags`; False off x86 and where the flags cannot be read."""
    return platform.machine() in ("x86_64", "AMD64") and set(flags) <= cpu_flags()
