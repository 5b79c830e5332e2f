"""The CPU backend's compiled decode-attention kernel (kernels/paged_decode.c): built once per source and flags with the system C compiler, called through ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_decode.c"
# x86-64-v3 (AVX2, FMA): portable across the x86 nodes a prebuilt image lands on; on Zen 4 AVX-512 runs
# at the same width per cycle, so nothing is lost against -march=native there.
_TARGET = ["-march=x86-64-v3"] if platform.machine() in ("x86_64", "AMD64") else []
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", *_TARGET]
_I64 = ctypes.c_int64


def kernel_dir() -> Path:
    """Where built kernels live: $WARMFLEET_KERNEL_DIR (images prebuild there), else the user's cache."""
    env = os.environ.get("WARMFLEET_KERNEL_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "warmfleet" / "kernels"


def _library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return f"paged_decode-{digest}.so"


def build(directory: Optional[Path] = None) -> Path:
    """Compile the kernel into `directory` unless it is there already; raise RuntimeError with the reason."""
    directory = directory or kernel_dir()
    target = directory / _library_name()
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)  # then an atomic rename: concurrent builders race safely
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def paged_decode_f32() -> Optional[ctypes._CFuncPtr]:
    """The kernel's C function, or None (logged once, with the fix) when it cannot be built or loaded."""
    try:
        fn = ctypes.CDLL(str(build())).wf_paged_decode_f32
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning("native decode attention unavailable, using Paddle ops (slower decode): %s; to fix, install "
                    "a C compiler or point WARMFLEET_KERNEL_DIR at a writable directory or a prebuilt kernel", exc)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_void_p]
    return fn
