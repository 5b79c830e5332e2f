"""Engine profile: step times for prefill, prefix hit and decode, then where a step's time goes.

    python -P bench/profile_engine.py [--model DIR] [--runs 5] [--sections prefill,hit,tail,decode1,decode16,decode64]
                                      [--detail layers,ops,cprofile] [--threads 1,2]

Runs EngineCore in-process on the `bench` checkpoint (fp32, block size 64; made on first run).
Sections, each a median over --runs of one engine step:

    prefill   a cold 2,112-token prompt (2,048 prefix + 64 question), max_tokens=1: TTFT without HTTP
    hit       the same 2,048-token prefix again with a new 64-token question (32 blocks cached)
    tail      a cold 64-token prompt: what the hit's uncached tail costs on its own
    decode1   one decode step at batch 1 (32-token prompts, context grows while measuring)
    decode16  one decode step at batch 16
    decode64  one decode step at batch 64
    prefill16x32, prefill64x32   one step prefilling 16 / 64 cold 32-token prompts (what the decode
              requests of bench/prefix_cache.py spend before their first token)

Details (per section, from extra steps after the timed ones):

    layers    wall and thread-CPU time per model component (embedding, each decoder layer's norms,
              projections, attention, MLP; summed over layers) and per engine stage (schedule,
              metadata, forward, logits, sample, update), taken by wrapping each component with a
              timer (CPU ops are synchronous); medians over runs
    ops       Paddle's profiler: per-op time and kernel time per step, and the profiled step split into
              kernel_ms, op_overhead_ms (Paddle's C++ op path outside kernels: infer_meta, allocation,
              dispatch) and python_ms (everything outside Paddle ops)
    cprofile  the 20 functions with the most self time per step (Python functions and Paddle's C ops)

--threads runs every section once per math-thread count (as --engine-threads sets it, in this process).
Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

PREFIX_TOKENS = 2048
QUESTION_TOKENS = 64
BLOCK_SIZE = 64
DECODE_PROMPT_TOKENS = 32
SECTIONS = ("prefill", "hit", "tail", "decode1", "decode16", "decode64", "prefill16x32", "prefill64x32")


progress = harness.reporter("profile")


def bench_model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / "bench-qwen2"
    if not (out / "config.json").exists():
        progress(f"writing the bench checkpoint to {out}")
        make_tiny_model(out, arch="qwen2", size="bench", seed=0)
    return out


def thread_report() -> dict:
    """Math-thread settings and OS threads of this process (the engine core runs in-process here)."""
    import paddle

    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    threads = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")), None)
    return {
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE",
                                                "KMP_AFFINITY", "KMP_BLOCKTIME")},
        "paddle_num_threads_flag": paddle.get_flags(["FLAGS_paddle_num_threads"])["FLAGS_paddle_num_threads"],
        "os_threads": threads,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
    }


class Engine:
    """An EngineCore plus helpers that submit requests and time single steps."""

    def __init__(self, model_dir: Path, attention_backend: str = "cpu"):
        from warmfleet.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
        from warmfleet.server.engine.core import EngineCore

        cfg = EngineConfig(ModelConfig(model=str(model_dir), attention_backend=attention_backend),
                           CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=512, enable_prefix_caching=True),
                           SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64), ServerConfig())
        cfg.validate()
        self.core = EngineCore(cfg)
        self.vocab = self.core.hf_config["vocab_size"]
        self.num_requests = 0
        import numpy as np

        self.rng = np.random.default_rng(0)

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(10, self.vocab - 10, size=n)]

    def add(self, prompt: list[int], max_tokens: int, salt: str) -> str:
        from warmfleet.server.engine.protocol import GenerateRequest
        from warmfleet.server.engine.sampling_params import SamplingParams

        self.num_requests += 1
        rid = f"p{self.num_requests}"
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(GenerateRequest(rid, prompt, sp, salt))
        return rid

    def timed_step(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one step."""
        t0, c0 = time.perf_counter(), time.process_time()
        self.core.step()
        return time.perf_counter() - t0, time.process_time() - c0

    def drain(self) -> None:
        while self.core.has_work:
            self.core.step()

    # ---- one measured step per section; `setup` leaves exactly the step to measure ----------
    def setup(self, section: str, run: int) -> None:
        salt = f"{section}-{run}-{self.num_requests}"
        if section == "prefill":
            self.add(self.tokens(PREFIX_TOKENS + QUESTION_TOKENS), 1, salt)
        elif section == "hit":
            prefix = self.tokens(PREFIX_TOKENS)
            self.add(prefix + self.tokens(QUESTION_TOKENS), 1, salt)
            self.drain()
            self.add(prefix + self.tokens(QUESTION_TOKENS), 1, salt)
        elif section == "tail":
            self.add(self.tokens(QUESTION_TOKENS), 1, salt)
        elif section.startswith("prefill") and "x" in section:  # e.g. prefill64x32: the decode64 batch's prefill
            num, length = (int(x) for x in section[len("prefill"):].split("x"))
            for _ in range(num):
                self.add(self.tokens(length), 1, salt)
        elif section.startswith("decode"):
            batch = int(section[len("decode"):])
            for _ in range(batch):
                self.add(self.tokens(DECODE_PROMPT_TOKENS), 1 << 20, salt)
            self.core.step()  # the batch's prefill
            for _ in range(4):  # warm decode shapes
                self.core.step()
        else:
            raise ValueError(section)

    def finish(self, section: str) -> None:
        if section.startswith("decode"):
            self.core.abort(list(self.core.scheduler.requests))
        self.drain()

    def measure(self, section: str, runs: int) -> list[tuple[float, float]]:
        times = []
        for r in range(runs):
            self.setup(section, r)
            if section.startswith("decode"):
                times.extend(self.timed_step() for _ in range(8))
            else:
                times.append(self.timed_step())
            self.finish(section)
        return times


# ---- layer/stage timers ------------------------------------------------------------------------
class Timers:
    """Wall and thread-CPU time per label (CPU time is what a component costs when other processes compete)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.undo: list = []

    def clear(self) -> None:
        self.total.clear()
        self.cpu.clear()
        self.calls.clear()

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:
            return
        total, cpu, calls = self.total, self.cpu, self.calls

        @functools.wraps(fn)
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                total[label] += time.perf_counter() - t0
                cpu[label] += time.thread_time() - c0
                calls[label] += 1

        own = getattr(obj, "__dict__", {})
        original = own[attr] if attr in own else None  # classmethods are restored as they were defined
        setattr(obj, attr, timed)
        self.undo.append((obj, attr, original))

    def restore(self) -> None:
        for obj, attr, original in reversed(self.undo):
            if original is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, original)
        self.undo.clear()


def instrument(core) -> Timers:
    """Timers on engine stages and on every model sublayer (labels without the layer index)."""
    import warmfleet.server.engine.core as core_mod

    t = Timers()
    t.wrap(core.scheduler, "schedule", "engine.schedule")
    t.wrap(core.scheduler, "update", "engine.update")
    t.wrap(core.runner, "execute", "engine.execute")
    t.wrap(core_mod, "sample", "engine.sample")  # per request (the tree before the first pass, docs/history/performance-passes.md)
    t.wrap(core_mod, "sample_step", "engine.sample")  # per step
    t.wrap(core.kv, "find_prefix", "engine.schedule.find_prefix")
    t.wrap(core.kv, "allocate", "engine.schedule.allocate")
    t.wrap(core.kv, "cache_computed_blocks", "engine.update.cache_computed_blocks")
    t.wrap(core.runner.backend, "build_metadata", "execute.metadata")
    model = core.model
    t.wrap(model, "forward", "execute.model_forward")
    t.wrap(model, "compute_logits", "execute.compute_logits")
    for name, sub in model.named_sublayers():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) >= 3:
            label = ".".join(["layer"] + parts[3:]) if len(parts) > 3 else "layer"
        else:
            label = name
        if label.count(".") > 3:
            continue
        t.wrap(sub, "forward", f"model.{label}")
    backend = getattr(model.model.layers[0].self_attn, "backend", None)
    if backend is not None:
        t.wrap(backend, "forward", "model.layer.self_attn.attention_backend")
    return t


def layer_profile(eng: Engine, section: str, runs: int) -> dict:
    t = instrument(eng.core)
    n = 8 if section.startswith("decode") else 1
    walls: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, int] = {}
    try:
        for r in range(runs):
            eng.setup(section, 1000 + r)
            t.clear()
            for _ in range(n):
                eng.core.step()
            for k in t.total:
                walls[k].append(t.total[k] / n)
                cpus[k].append(t.cpu[k] / n)
                calls[k] = t.calls[k] // n
            eng.finish(section)
    finally:
        t.restore()
    return {k: {"ms": round(1e3 * statistics.median(walls[k]), 3), "cpu_ms": round(1e3 * statistics.median(cpus[k]), 3),
                "calls": calls[k]} for k in sorted(walls)}


def op_profile(eng: Engine, section: str) -> dict:
    """Paddle's profiler over one measured step (8 for decode): per-op time, and the step split into
    kernels, the rest of Paddle's C++ op path (infer_meta, allocation, dispatch) and Python."""
    import paddle.profiler as profiler
    from paddle.profiler.profiler_statistic import StatisticData
    from paddle.profiler.profiler_statistic import TracerEventType

    eng.setup(section, 2000)
    n = 8 if section.startswith("decode") else 1
    p = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda prof: None)
    p.start()
    t0 = time.perf_counter()
    for _ in range(n):
        eng.core.step()
        p.step()
    wall_ms = (time.perf_counter() - t0) / n * 1e3
    p.stop()
    eng.finish(section)
    data = StatisticData(p.profiler_result.get_data(), p.profiler_result.get_extra_info())
    ops = []
    kernel_total = 0.0
    for name, item in data.event_summary.items.items():
        kernel = sum(v.cpu_time for k, v in item.operator_inners.items() if "kernel" in k.lower())
        kernel_total += kernel
        ops.append({"op": name.replace(" dygraph", ""), "calls": round(item.call / n, 1),
                    "ms": round(item.cpu_time / n / 1e6, 3), "kernel_ms": round(kernel / n / 1e6, 3)})
    ops.sort(key=lambda o: -o["ms"])
    op_ms = data.time_range_summary.get_cpu_range_sum(TracerEventType.Operator) / n / 1e6
    kernel_ms = kernel_total / n / 1e6
    return {
        "profiled_step_ms": round(wall_ms, 3),
        "num_ops": round(sum(o["calls"] for o in ops), 1),
        "kernel_ms": round(kernel_ms, 3),
        "op_overhead_ms": round(op_ms - kernel_ms, 3),  # Paddle's C++ per-op path outside kernels
        "python_ms": round(wall_ms - op_ms, 3),  # everything outside Paddle ops (includes profiler overhead)
        "ops": ops[:25],
    }


def cprofile(eng: Engine, section: str) -> list[dict]:
    eng.setup(section, 3000)
    n = 8 if section.startswith("decode") else 1
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        eng.core.step()
    prof.disable()
    eng.finish(section)
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}:{func}" if file != "~" else func
        rows.append({"function": where, "calls_per_step": round(nc / n, 1), "self_ms_per_step": round(1e3 * tt / n, 3),
                     "cum_ms_per_step": round(1e3 * ct / n, 3)})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    return rows[:20]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: the bench checkpoint)")
    ap.add_argument("--runs", type=int, default=5, help="repetitions per section (medians reported)")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--detail", default="", help="comma list of layers, ops, cprofile")
    ap.add_argument("--attention-backend", default="cpu", help="as `warmfleet serve --attention-backend`")
    ap.add_argument("--threads", default="", help="comma list of math-thread counts to sweep (default: as configured)")
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    details = {d for d in args.detail.split(",") if d}
    for s in sections:
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")

    model_dir = bench_model_dir(args.model)
    progress(f"loading {model_dir}")
    eng = Engine(model_dir, args.attention_backend)
    import paddle

    result: dict = {"benchmark": "profile_engine", "model": str(model_dir), "runs": args.runs,
                    "threads": thread_report(), "sections": {}}
    progress(f"threads: {result['threads']}")
    progress("warm-up")
    for s in sections:
        eng.setup(s, -1)
        eng.core.step()
        eng.finish(s)

    sweep = [int(x) for x in args.threads.split(",") if x] or [None]
    for nthreads in sweep:
        if nthreads is not None:
            paddle.base.core.set_num_threads(nthreads)
        for s in sections:
            times = eng.measure(s, args.runs)
            step_s = statistics.median(w for w, _ in times)
            cpu_s = statistics.median(c for _, c in times)
            batch = int(s[len("decode"):]) if s.startswith("decode") else None
            entry: dict = {"step_ms": round(step_s * 1e3, 3), "step_cpu_ms": round(cpu_s * 1e3, 3), "steps": len(times)}
            if batch:
                entry["tok_s"] = round(batch / step_s, 1)
                entry["tok_s_cpu"] = round(batch / cpu_s, 1)  # tok/s if this process had a core to itself
            progress(f"{s}{'' if nthreads is None else f' threads={nthreads}'}: {entry}")
            if "layers" in details:
                entry["layers"] = layer_profile(eng, s, max(1, min(args.runs, 3)))
            if "ops" in details:
                entry["ops"] = op_profile(eng, s)
            if "cprofile" in details:
                entry["cprofile"] = cprofile(eng, s)
            key = s if nthreads is None else f"{s}@threads={nthreads}"
            result["sections"][key] = entry
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
