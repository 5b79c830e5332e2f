"""What every bench script shares: progress lines, quantiles, the spread, checkpoints, the LRU bound, sibling scripts.

bench/ is no package, and the scripts run as `python -P bench/X.py` (bench/ off sys.path, so bench/trace.py
never shadows the stdlib's trace). Each script appends its own folder and imports this module:

    sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
    import harness

No warmfleet imports at module level (a script's --help must not pay for them).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Callable, Hashable, Iterable, Sequence

BENCH = Path(__file__).resolve().parent
EXE = [sys.executable, "-P", "-m", "warmfleet.cli"]


def reporter(tag: str) -> Callable[[str], None]:
    """`progress(msg)` for one script: `[tag HH:MM:SS] msg` on stderr, flushed."""
    def progress(msg: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return progress


def quantile(xs: Iterable[float | None], p: float) -> float | None:
    """The `p` quantile (nearest rank, rounded to 4 places) of the values that are not None; None if there are none."""
    ys = sorted(x for x in xs if x is not None)
    return round(ys[min(len(ys) - 1, int(p * len(ys)))], 4) if ys else None


def spread(counts: Sequence[float], num_replicas: int) -> float | None:
    """max / mean requests per replica over all `num_replicas` replicas; `counts` names those that got any.

    A replica that got nothing counts in the mean (as zero), so sending everything to one of four
    replicas is 4.0, not 1.0. None when nothing was counted.
    """
    total = sum(counts)
    if not counts or not total or num_replicas <= 0:
        return None
    if len(counts) > num_replicas:
        raise ValueError(f"{len(counts)} replicas counted, fleet of {num_replicas}")
    return round(max(counts) / (total / num_replicas), 3)


# --- chart panels (matplotlib axes; the caller owns the figure) ----------------------------------
ROUTER_COLORS = {"rr": "#999999", "sglang": "#d9822b", "vllm": "#4a7ebb", "warmfleet": "#2e9e5b"}


def router_colors(names: Sequence[str]) -> list[str]:
    """One color per router name; a variant (`warmfleet:NAME`, `warmfleet@3`) takes its router's."""
    return [ROUTER_COLORS.get(n.split(":")[0].split("@")[0], "#555555") for n in names]


def ttft_panel(ax, res: dict, names: Sequence[str], colors: Sequence[str], title: str) -> None:
    """TTFT p50 (light) and p90 (dark) bars per router from `res[name]["ttft_p50_s"|"ttft_p90_s"]`."""
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [res[n]["ttft_p50_s"] or 0 for n in names], 0.4, color=colors, alpha=0.5,
           label="p50")
    ax.bar([i + 0.2 for i in x], [res[n]["ttft_p90_s"] or 0 for n in names], 0.4, color=colors, label="p90")
    ax.set_xticks(list(x), names)
    ax.set_title(f"{title}, p50 light / p90 dark", fontsize=9)


def spread_panel(ax, res: dict, names: Sequence[str], colors: Sequence[str], where: str, target: float = 1.25) -> None:
    """`spread` bars per router with the target dashed."""
    ax.bar(names, [res[n]["spread"] or 0 for n in names], color=colors)
    ax.axhline(target, ls="--", color="k", lw=1)
    ax.set_title(f"{where}: spread (max / mean requests per replica, all replicas)", fontsize=9)


def model_dir(arg: str | None, size: str = "tiny", arch: str = "qwen2",
              say: Callable[[str], None] | None = None) -> Path:
    """`arg` if given, else the cached `size` (tiny | bench) checkpoint of `arch`, written on first use."""
    if arg:
        return Path(arg)
    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" \
        / f"{size}-{arch.replace('_', '-')}"
    if not (out / "config.json").exists():
        if say is not None:
            say(f"writing the {size} {arch} checkpoint to {out}")
        subprocess.run(EXE + ["make-tiny-model", str(out), "--arch", arch, "--size", size], check=True,
                       cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    return out


def lru_prefix(seen: OrderedDict, hs: Sequence[Hashable], capacity: int | None) -> int:
    """Leading blocks of `hs` found in the LRU `seen`; then `hs` are the most recent, and `seen` is cut to
    `capacity` blocks (None: unbounded). The oracle (unbounded) and the fleet-sized LRU bound of the benches."""
    hit = next((i for i, h in enumerate(hs) if h not in seen), len(hs))
    for h in hs:
        seen[h] = None
        seen.move_to_end(h)
    while capacity is not None and len(seen) > capacity:
        seen.popitem(last=False)
    return hit


def sibling(script: str) -> ModuleType:
    """bench/`script`.py as module `wf_bench_<script>`, loaded once per process and shared by every importer
    (by location: `trace` is a stdlib name)."""
    name = f"wf_bench_{script}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None, f"no bench script {script}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
