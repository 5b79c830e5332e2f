"""What every bench script shares: progress lines, quantiles, the spread, checkpoints, the LRU bound, routers, the simulated fleet, sibling scripts.

bench/ is no package; the scripts run as `python bench/X.py` (or `python -P`), and none is named after a
standard-library module (tests/test_bench_harness.py checks), so bench/ on sys.path shadows nothing. Each script
appends its own folder and imports this module:

    sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
    import harness

No warmfleet imports at module level (a script's --help must not pay for them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Collection, Hashable, Iterable, Mapping, Sequence

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


def quantile_ratio_interval(before: Sequence[float], after: Sequence[float], p: float, rounds: int = 1000,
                            seed: int = 0) -> list[float] | None:
    """The 90 % bootstrap interval of quantile(after, p) / quantile(before, p): how finely one run's pair of windows
    can tell two quantiles apart (a p90 of ~120 requests is itself a sample). None if either side is empty."""
    if not before or not after:
        return None
    rng = random.Random(seed)
    ratios = sorted(quantile(rng.choices(after, k=len(after)), p) / max(quantile(rng.choices(before, k=len(before)), p), 1e-9)
                    for _ in range(rounds))
    return [round(ratios[int(0.05 * rounds)], 3), round(ratios[int(0.95 * rounds) - 1], 3)]


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


def subplots(ncols: int, figsize: tuple[float, float]):
    """(figure, axes): `ncols` axes side by side, on matplotlib's Agg backend (no display; imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def save_figure(fig, path: Path, title: str, fontsize: int = 10) -> None:
    """`title` over `fig`, laid out, written to `path` (110 dpi) and closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def write_results(out: Path, stem: str, results: dict, chart_fn, say: Callable[[str], None]) -> None:
    """`stem`.json and the chart `stem`.png (drawn by `chart_fn(results, path)`) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    chart_fn(results, out / f"{stem}.png")
    say(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.png'}")


def print_results(results: dict, as_json: bool) -> None:
    """`results` on stdout: one JSON line (the last line) with --json, else one `key: value` line per key."""
    if as_json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k}: {v}")


# --- routers on loopback: warmfleet's and the peers', started and waited for ----------------------
PEER_TOOLS = {"sglang": "sglang-router", "vllm": "vllm-router"}


def find_tool(name: str) -> str | None:
    """A console script of this venv (found next to the interpreter even when the venv is not on PATH)."""
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def tool(name: str) -> str:
    found = find_tool(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install 'warmfleet[peers]'")
    return found


def variants(specs: Iterable[str]) -> dict[str, list[str]]:
    """`--variant NAME=FLAGS` values -> {"warmfleet:NAME": [flags]}: the extra `warmfleet route` flags per variant."""
    return {"warmfleet:" + v.split("=", 1)[0]: v.split("=", 1)[1].split() for v in specs}


def present_routers(routers: list[str]) -> tuple[list[str], dict[str, str]]:
    """The routers whose programs are installed, and why each other one is skipped (checked before any run)."""
    skipped = {r: f"{PEER_TOOLS[r]} is not installed (pip install 'warmfleet[peers]')"
               for r in routers if r in PEER_TOOLS and find_tool(PEER_TOOLS[r]) is None}
    return [r for r in routers if r not in skipped], skipped


def route_command(model: Path, port: int, block: int, replicas: Iterable[str], flags: Sequence[str] = ()) -> list[str]:
    """`warmfleet route` on `port` in front of `replicas` (each a --replica value: `URL,events=tcp://...`)."""
    cmd = EXE + ["route", "--model", str(model), "--port", str(port), "--block-size", str(block),
                 "--log-level", "warning", *flags]
    for r in replicas:
        cmd += ["--replica", r]
    return cmd


def peer_command(kind: str, urls: Sequence[str], port: int, metrics_port: int, policy: Sequence[str],
                 extra: Sequence[str] = ()) -> list[str]:
    """sglang-router (`kind` "sglang") or vllm-router ("vllm") on `port` in front of `urls`, its metrics on
    `metrics_port` (their default, 29000, is taken on a shared host)."""
    if kind not in PEER_TOOLS:
        raise ValueError(f"unknown router {kind!r}")
    head = [tool("sglang-router"), "launch"] if kind == "sglang" else [tool("vllm-router")]
    return [*head, "--worker-urls", *urls, *policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port), *extra]


def in_sync(view: list[dict], ids: Collection[str] | None = None, count: int | None = None) -> bool:
    """Every replica of a warmfleet router's view (/v1/router/replicas) healthy and synced: only those in `ids`
    when given, and `count` of them when given. A replica that reports no `synced` has nothing to replay."""
    view = [r for r in view if ids is None or r["id"] in ids]
    return (count is None or len(view) == count) and all(r["healthy"] and r.get("synced", True) for r in view)


def start_router(name: str, cmd: list[str], port: int, cwd: str, *, env: dict | None = None, log: str | None = None,
                 taskset: str | None = None, health_s: float | None = 120.0,
                 synced: Callable[[list[dict]], bool] | None = None, sync_s: float = 120.0,
                 probe: dict | None = None, probe_s: float = 120.0) -> tuple[str, subprocess.Popen]:
    """Launch router `name` (`cmd`, listening on `port`; pinned with `taskset -c` when given; logging to
    cwd/`log`, default router-NAME-PORT.log) and wait until it is up: /health answers 200 (skipped when
    `health_s` is None), `synced(view)` holds for its /v1/router/replicas list (warmfleet), `probe` (a
    /v1/completions body) answers 200. A failed wait stops it; ProcessExited (it ended) names its log's tail."""
    import httpx

    from warmfleet.livefleet import ProcessExited, wait_for, wait_http

    base = f"http://127.0.0.1:{port}"
    log_path = Path(cwd) / (log or f"router-{name.replace(':', '-')}-{port}.log")
    with log_path.open("ab") as out:
        p = subprocess.Popen([*(["taskset", "-c", taskset] if taskset else []), *cmd], cwd=cwd, env=env,
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        if health_s is not None:
            wait_http(base + "/health", f"router {name}", [p], health_s, poll_s=0.2)
        if synced is not None:
            wait_for(lambda: synced(httpx.get(base + "/v1/router/replicas", timeout=5).json()["replicas"]),
                     f"router {name} in sync", [p], sync_s, poll_s=0.2)
        if probe is not None:
            wait_for(lambda: httpx.post(base + "/v1/completions", json=probe, timeout=10).status_code == 200,
                     f"router {name} forwarding", [p], probe_s, poll_s=0.2)
    except ProcessExited as exc:
        stop(p)
        raise ProcessExited(f"{exc}; log: {log_tail(log_path)}") from exc
    except BaseException:
        stop(p)
        raise
    return base, p


def start_simfleet(model: Path, cwd: str, flags: Sequence[str] = (), *, taskset: str | None = None,
                   timeout_s: float = 120.0) -> tuple[subprocess.Popen, dict]:
    """bench/simfleet.py over `model` with `flags` (pinned with `taskset -c` when given; stderr to cwd/sim.log),
    and its description (the --ready-file JSON: replicas, control URL) once it listens. A failed wait stops it."""
    from warmfleet.livefleet import wait_for

    ready = Path(cwd) / f"sim-{time.monotonic_ns()}.json"
    cmd = [*(["taskset", "-c", taskset] if taskset else []), sys.executable, "-P", str(BENCH / "simfleet.py"),
           "--model", str(model), *flags, "--ready-file", str(ready)]
    with (Path(cwd) / "sim.log").open("ab") as log:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_for(ready.exists, "simulated fleet", [p], timeout_s, poll_s=0.2)
    except BaseException:
        stop(p)
        raise
    return p, json.loads(ready.read_text())


def log_tail(path: Path, lines: int = 6) -> str:
    """The last lines of a log (colour codes removed) on one line, for a failure message."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in text.splitlines()[-lines:])


def stop(p: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """SIGTERM a process still running, SIGKILL it after `timeout_s`; reaped either way."""
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)


# --- CPU of a router's process tree (/proc) -------------------------------------------------------
# --- CPU of process trees (/proc) ------------------------------------------------------------------
@dataclass(frozen=True)
class ProcCpu:
    """One /proc/PID/stat line's CPU fields, in clock ticks."""

    pid: int
    ppid: int
    self_ticks: int  # utime + stime (fields 14, 15)
    reaped_children_ticks: int  # cutime + cstime (fields 16, 17): children it has waited for


def parse_stat(line: str) -> ProcCpu:
    """/proc/PID/stat → ProcCpu. The command (field 2) is in parentheses and may hold spaces and ')':
    fields are counted from the last ')'."""
    pid = int(line[: line.index("(")])
    rest = line[line.rindex(")") + 2:].split()  # rest[0] is field 3 (state)
    utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
    return ProcCpu(pid, int(rest[1]), utime + stime, cutime + cstime)


def tree_ticks(procs: Iterable[ProcCpu], roots: Iterable[int]) -> int:
    """Ticks of `roots` and every live descendant, each with its reaped children (no tick counted twice:
    a process's cutime holds only children it has reaped, which are no longer in the table)."""
    by_parent: dict[int, list[ProcCpu]] = {}
    table = {p.pid: p for p in procs}
    for p in table.values():
        by_parent.setdefault(p.ppid, []).append(p)
    total, todo, seen = 0, [r for r in roots if r in table], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        p = table[pid]
        total += p.self_ticks + p.reaped_children_ticks
        todo.extend(c.pid for c in by_parent.get(pid, ()))
    return total


def read_procs(proc: Path = Path("/proc")) -> list[ProcCpu]:
    out = []
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                out.append(parse_stat((d / "stat").read_text()))
            except (OSError, ValueError, IndexError):  # exited while we looked
                pass
    return out


def cpu_seconds(roots: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds so far of the process tree under each named root pid (one read of /proc for all)."""
    procs, tick = read_procs(), os.sysconf("SC_CLK_TCK")
    return {name: tree_ticks(procs, [pid]) / tick for name, pid in roots.items()}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of one process tree (its live descendants and the children it reaped included)."""
    return cpu_seconds({"tree": pid})["tree"]


def tree_pids(roots: Iterable[int], proc: Path = Path("/proc")) -> list[int]:
    """`roots` and every live descendant (parents from /proc/PID/stat field 4)."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                raw = (d / "stat").read_text()
            except OSError:  # exited while we looked
                continue
            children.setdefault(int(raw[raw.rindex(")") + 2:].split()[1]), []).append(int(d.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def schedstat_ns(roots: Iterable[int], proc: Path = Path("/proc")) -> tuple[int, int]:
    """(time on a CPU, time waiting on a run queue), ns so far, summed over every thread of the process trees under
    `roots`: /proc/PID/task/TID/schedstat fields 1 and 2 (threads that have ended are not counted)."""
    on_cpu = waiting = 0
    for pid in tree_pids(roots, proc):
        try:
            tasks = list((proc / str(pid) / "task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                f = (t / "schedstat").read_text().split()
            except OSError:
                continue
            on_cpu, waiting = on_cpu + int(f[0]), waiting + int(f[1])
    return on_cpu, waiting


def sched_per_request(before: tuple[int, int], after: tuple[int, int], requests: int) -> dict:
    """On-CPU and run-queue ms per request between two `schedstat_ns` readings, and wait / on-CPU."""
    cpu, wait = after[0] - before[0], after[1] - before[1]
    n = max(1, requests)
    return {"router_cpu_ms_per_request": round(cpu / n / 1e6, 3),
            "router_runq_wait_ms_per_request": round(wait / n / 1e6, 3),
            "router_runq_wait_over_cpu": round(wait / cpu, 3) if cpu else None}


def sibling(script: str) -> ModuleType:
    """bench/`script`.py as module `wf_bench_<script>`, loaded once per process and shared by every importer
    (by location, so a test and the scripts it drives hold the same module whatever sys.path holds)."""
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
