"""Prefix-cache benchmark: TTFT of a cold prefix vs a GPU-tier hit vs a swap-tier hit, and decode throughput.

    python bench/prefix_cache.py [--quick] [--json] [--model DIR | --size bench|qwen2.5-0.5b] [--runs N]
                                 [--engines warmfleet,vllm] [--vllm-python PATH] [--no-vllm-cpu-tier]
                                 [--no-swap-hit] [--out DIR]

Runs the engine in-process (offline `LLM`) on the `bench` checkpoint (or --size qwen2.5-0.5b: the
shape of Qwen2.5-0.5B; made on first run) so the figures are the engine's own, without HTTP.
Decode figures are batch 1, 16 and 64 (32-token prompts); the primary pool holds the batch-64
decode, and the swap-tier filler is as many prompts as it takes to push the prefix out of it.
Progress goes to stderr; the last stdout line is one JSON object. Ratios are measured side by side
in one run; quote those, not absolute times.

`--engines warmfleet,vllm` measures the same figures for `warmfleet serve` and vLLM 0.32.0
(CPU build; the python of scripts/vllm-env.sh or --vllm-python) side by side instead: both as
HTTP servers on loopback, same checkpoint, fp32, block size 64, the same primary pool, 4,096-token
steps, 64 sequences, ~2,000-token prompts sent as token ids to /v1/completions (TTFT = latency of a
1-token completion). Engines are interleaved per repetition (the first engine alternates; each round
starts once both servers are idle, see `settle`); medians
are reported with warmfleet-over-vLLM speed ratios on wall time and on the CPU seconds of each
server's processes, and issue #13's targets (>= 1.0x at batch 16 and 64, >= 0.8x for one request)
as booleans under `targets`. Both compute on
core 0 with one OMP thread: vLLM's worker through VLLM_CPU_OMP_THREADS_BIND=0 (its own binding;
its API and engine-core processes are not pinned), warmfleet's engine-core process through
`--engine-threads 1 --engine-cpus 0` (where `warmfleet serve` lacks those flags: its whole process
tree under `taskset -c 0` with OMP_NUM_THREADS=1); the JSON records the commands, the
environment, vLLM's reported binding and each process's affinity. Hits are confirmed by
`usage.prompt_tokens_details.cached_tokens` (vLLM: --enable-prompt-tokens-details), swap-tier hits
by the replicas' cached-token counters by tier. vLLM's CPU tier (--kv-offloading-size 1
--kv-offloading-backend native) is tried first (--no-vllm-cpu-tier: not tried); where it does not
start, its swap-tier figures are null with the reason from its log. Writes prefix_cache.json and
prefix_cache.png to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

PREFIX_TOKENS = 2048
QUESTION_TOKENS = 64
BLOCK_SIZE = 64
DECODE_BATCHES = (1, 16, 64)
DECODE_PROMPT_TOKENS = 32
SIZES = ("bench", "qwen2.5-0.5b")


progress = harness.reporter("bench")


def bench_model_dir(arg: str | None, size: str = "bench") -> Path:
    if arg:
        return Path(arg)
    from warmfleet.server.tiny_checkpoints.text import make_tiny_model

    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / f"{size}-qwen2"
    if not (out / "config.json").exists():
        progress(f"writing the {size} checkpoint to {out}")
        make_tiny_model(out, arch="qwen2", size=size, seed=0)
    return out


def pool_blocks(new_tokens: int) -> int:
    """Primary pool: one 2,112-token prompt with room to spare, and the batch-64 decode without preemption."""
    per_seq = -(-(DECODE_PROMPT_TOKENS + new_tokens) // BLOCK_SIZE)
    return max((PREFIX_TOKENS + QUESTION_TOKENS + 2 * BLOCK_SIZE) // BLOCK_SIZE + 2, max(DECODE_BATCHES) * per_seq + 4)


def filler_prompts(rng, vocab: int, blocks: int) -> list[list[int]]:
    """Prompts of one 2,112-token prompt's length whose blocks together exceed the pool: once they ran,
    the least recently used blocks (the prefix) have left the primary pool."""
    n = PREFIX_TOKENS + QUESTION_TOKENS
    return [tokens(rng, vocab, n) for _ in range(-(-blocks * BLOCK_SIZE // n) + 1)]


def tokens(rng, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, vocab - 10, size=n)]


def ttft(llm, prompt: list[int], salt: str) -> tuple[float, int, int]:
    from warmfleet import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=salt)[0]
    return time.perf_counter() - t0, out.num_cached_tokens, out.num_cached_tokens_cpu


def decode_throughput(llm, vocab: int, batch: int, new_tokens: int, rng) -> float:
    from warmfleet import SamplingParams

    prompts = [tokens(rng, vocab, DECODE_PROMPT_TOKENS) for _ in range(batch)]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, cache_salt=f"decode-{rng.integers(1 << 30)}")
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


_HF_SCRIPT = """
import json, sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM
model_dir, batch, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ids = torch.tensor(np.random.default_rng(0).integers(10, model.config.vocab_size - 10, (batch, 32)))
gen = lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)
with torch.no_grad():
    gen(2)  # warm-up
    t0 = time.perf_counter()
    out = gen(new_tokens)
print(json.dumps((out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - t0)))
"""


def transformers_throughput(model_dir: Path, batch: int, new_tokens: int) -> float | None:
    """transformers.generate decode tok/s in its own process (so the two runtimes never share threads)."""
    import subprocess

    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return None
    r = subprocess.run([sys.executable, "-P", "-c", _HF_SCRIPT, str(model_dir), str(batch), str(new_tokens)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        progress(f"transformers baseline failed: {r.stderr.strip().splitlines()[-1:]}")
        return None
    return float(r.stdout.strip().splitlines()[-1])


# --- side by side: warmfleet serve and vLLM as servers (--engines) ---------------------------------
CORE = 0  # both engines compute on this core with one OMP thread
SWAP_GIB = 1
ENGINE_FLAGS = ["--max-num-batched-tokens", "4096", "--max-num-seqs", str(max(DECODE_BATCHES))]


def bench_helpers():
    """bench/routing.py's process helpers."""
    return harness.sibling("routing_fleet")


class Server:
    """One engine behind its OpenAI API: how it was started, and its counters of cached tokens by tier."""

    def __init__(self, name: str, base: str, proc, cmd: list[str], env: dict, log: Path):  # noqa: D107
        self.name, self.base, self.proc, self.cmd, self.env, self.log = name, base, proc, cmd, env, log
        self.swap_tier, self.swap_reason = name == "warmfleet", None

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server's processes have used so far: a figure the other jobs on a
        shared machine disturb far less than wall time."""
        ticks = 0
        for p in process_tree(self.proc.pid):
            try:
                fields = Path(f"/proc/{p['pid']}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                continue
        return ticks / os.sysconf("SC_CLK_TCK")

    def cpu_cached(self, rt) -> float:
        """Prompt tokens served from the CPU tier so far (warmfleet: by tier; vLLM: its host-sourced count)."""
        if self.name == "warmfleet":
            return rt.metric_sum(self.base, "warmfleet:cached_prompt_tokens_total", 'tier="cpu"')
        return rt.metric_sum(self.base, "vllm:prompt_tokens_cached_by_source_total", 'source="host"')


def warmfleet_pinning(rt) -> tuple[list[str], list[str], dict, str]:
    """How to give warmfleet's engine vLLM's setting (one math thread on CORE): prefix, flags, env, a note.

    With `--engine-threads`/`--engine-cpus` (newer `warmfleet serve`) only the engine-core process is
    pinned, as vLLM pins only its worker; without them the whole process tree runs under taskset.
    """
    import subprocess

    usage = subprocess.run(rt.EXE + ["serve", "--help"], capture_output=True, text=True, cwd=os.sep).stdout
    if "--engine-cpus" in usage and "--engine-threads" in usage:
        return [], ["--engine-threads", "1", "--engine-cpus", str(CORE)], {}, \
            f"--engine-threads 1 --engine-cpus {CORE}: the engine-core process on core {CORE} with one math " \
            "thread; its API process is not pinned (as vLLM's worker vs its API process)"
    return ["taskset", "-c", str(CORE)], [], {"OMP_NUM_THREADS": "1"}, \
        f"this warmfleet serve has no thread/CPU flag: its whole process tree (API and engine core) runs under " \
        f"taskset -c {CORE} with OMP_NUM_THREADS=1"


def start_warmfleet(rt, model_dir: Path, blocks: int, cwd: str) -> Server:
    port = rt.free_port()
    prefix, flags, env, note = warmfleet_pinning(rt)
    cmd = prefix + rt.EXE + [
        "serve", "--model", str(model_dir), "--served-model-name", "bench", "--port", str(port),
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(blocks), "--swap-space", str(SWAP_GIB),
        "--log-level", "warning", *ENGINE_FLAGS, *flags]
    log = Path(cwd) / "warmfleet.log"
    proc = rt.start_group(cmd, dict(os.environ, **env), cwd, log)
    server = Server("warmfleet", f"http://127.0.0.1:{port}", proc, cmd, env, log)
    server.pinning = note
    return server


def start_vllm(rt, model_dir: Path, blocks: int, cwd: str, offload: bool) -> Server:
    port = rt.free_port()
    extra = ENGINE_FLAGS + (["--kv-offloading-size", str(SWAP_GIB), "--kv-offloading-backend", "native"]
                            if offload else [])
    max_len = min(blocks * BLOCK_SIZE, json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    cmd = rt.vllm_command(rt.vllm_python(), model_dir, port, BLOCK_SIZE, blocks, max_len, extra)
    env = {k: v for k, v in rt.vllm_env(CORE).items() if k.startswith(("VLLM_", "PYTHONHASHSEED"))}
    log = Path(cwd) / f"vllm{'-offload' if offload else ''}.log"
    proc = rt.start_group(cmd, dict(os.environ, **env), cwd, log)
    server = Server("vllm", f"http://127.0.0.1:{port}", proc, cmd, env, log)
    server.swap_tier = offload
    return server


def wait_ready(server: Server) -> bool:
    from warmfleet.livefleet import wait_http

    try:
        path = "/ready" if server.name == "warmfleet" else "/health"
        wait_http(server.base + path, server.name, [server.proc], 600, poll_s=0.1)
        return True
    except (RuntimeError, TimeoutError):  # it exited, or never answered
        return False


def start_servers(rt, engines: list[str], model_dir: Path, blocks: int, cwd: str,
                  vllm_cpu_tier: bool = True) -> dict[str, Server]:
    """Every engine at once; vLLM with its CPU offload tier first (unless told not to try), and without it if
    that does not start."""
    servers = {}
    if "warmfleet" in engines:
        servers["warmfleet"] = start_warmfleet(rt, model_dir, blocks, cwd)
    if "vllm" in engines:
        servers["vllm"] = start_vllm(rt, model_dir, blocks, cwd, offload=vllm_cpu_tier)
        if not vllm_cpu_tier:
            servers["vllm"].swap_reason = "not tried (--no-vllm-cpu-tier); vLLM 0.32.0's CPU build refuses " \
                                          "--kv-offloading-size (CPU offloading is only supported on GPUs)"
    for name, server in list(servers.items()):
        if wait_ready(server):
            continue
        if name == "vllm" and server.swap_tier:
            reason = rt.log_error(server.log) or f"exited with {server.proc.poll()}"
            progress(f"vLLM with --kv-offloading-size did not start ({reason}); starting it without a CPU tier")
            rt.stop_group(server.proc)
            servers[name] = start_vllm(rt, model_dir, blocks, cwd, offload=False)
            servers[name].swap_reason = f"vLLM 0.32.0 (CPU build) fails to start with --kv-offloading-size " \
                                        f"{SWAP_GIB} --kv-offloading-backend native: {reason}"
            if wait_ready(servers[name]):
                continue
        raise RuntimeError(f"{name} did not start: {rt.log_error(servers[name].log)} (log: {servers[name].log})")
    return servers


@functools.lru_cache(maxsize=None)
def client(base: str):
    """One kept-alive HTTP client per server: `httpx.post` builds a client (and an SSL context) per call,
    ~40 ms that every figure here used to include."""
    import httpx

    return httpx.Client(base_url=base, timeout=600)


def complete(base: str, prompt, salt: str, max_tokens: int = 1) -> tuple[float, dict]:
    """One /v1/completions request (token-id prompts; a list of them is one batch): seconds and usage."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": salt}
    t0 = time.perf_counter()
    r = client(base).post("/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def ttft_round(rt, server: Server, prefix: list[int], questions: list[list[int]], filler: list[list[int]],
               salt: str) -> dict:
    """Miss, hit, and (with a CPU tier) a hit after a filler pushed the prefix out of the primary pool."""
    out = {}
    c0 = server.cpu_s()
    out["miss_s"], u = complete(server.base, prefix + questions[0], salt)
    c1 = server.cpu_s()
    out["miss_cached"] = cached(u)
    out["hit_s"], u = complete(server.base, prefix + questions[1], salt)
    out["miss_cpu_s"], out["hit_cpu_s"] = c1 - c0, server.cpu_s() - c1
    out["hit_cached"] = cached(u)
    if server.swap_tier:
        complete(server.base, filler, salt + "-filler")  # one batch; evicts the prefix into the CPU tier
        cpu0 = server.cpu_cached(rt)
        out["swap_hit_s"], u = complete(server.base, prefix + questions[2], salt)
        out["swap_hit_cached"], out["swap_hit_cached_cpu"] = cached(u), int(server.cpu_cached(rt) - cpu0)
    return out


def settle(servers, window_s: float = 0.3, busy_share: float = 0.1, max_s: float = 5.0) -> float:
    """Wait until the servers' processes together use under `busy_share` of a core over `window_s`; returns the
    seconds waited. vLLM's worker busy-waits (sched_yield) for up to 1 s after its last request, on core 0 where
    the other engine computes too: without this the engine measured right after vLLM shares its core with that
    spin (seen as warmfleet's TTFT miss at 1.3 s vs 0.73 s, alternating with the round order)."""
    t0 = time.monotonic()
    last = sum(s.cpu_s() for s in servers)
    while time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        now = sum(s.cpu_s() for s in servers)
        if now - last < busy_share * window_s:
            break
        last = now
    return time.monotonic() - t0


def decode_round(server: Server, prompts: list[list[int]], new_tokens: int, salt: str) -> tuple[float, float]:
    """(completion tok/s of wall time, completion tokens per CPU second of the server's processes)."""
    c0 = server.cpu_s()
    seconds, usage = complete(server.base, prompts, salt, new_tokens)
    cpu = max(server.cpu_s() - c0, 1 / os.sysconf("SC_CLK_TCK"))
    return usage["completion_tokens"] / seconds, usage["completion_tokens"] / cpu


def process_tree(pid: int) -> list[dict]:
    """Each process of a server: pid, command, the cores it may run on, its thread count."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            threads = next(int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                           if line.startswith("Threads:"))
            out.append({"pid": p, "cmd": " ".join(a.decode() for a in argv[:6] if a)[:160],
                        "cpus": sorted(os.sched_getaffinity(p)), "threads": threads})
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return out


def settings(rt, server: Server) -> dict:
    s = {"command": " ".join(server.cmd), "env": server.env, "processes": process_tree(server.proc.pid)}
    if server.name == "vllm":
        s["vllm_reported_binding"] = rt.vllm_binding(server.log)
    else:
        s["threads_note"] = server.pinning
    return s


def med(xs: list) -> float:
    return round(statistics.median(xs), 4)


def summarize_engine(rounds: list[dict], dec: dict[int, list[float]], server: Server) -> dict:
    """Medians per figure, and every request's cached_tokens (the evidence that hits were hits)."""
    swap = server.swap_tier
    out = {"ttft_miss_s": med([r["miss_s"] for r in rounds]), "ttft_hit_s": med([r["hit_s"] for r in rounds]),
           "ttft_swap_hit_s": med([r["swap_hit_s"] for r in rounds]) if swap else None,
           "swap_hit_null_reason": None if swap else server.swap_reason,
           "cached_tokens_miss": [r["miss_cached"] for r in rounds],
           "cached_tokens_hit": [r["hit_cached"] for r in rounds],
           "cached_tokens_swap_hit": [r["swap_hit_cached"] for r in rounds] if swap else None,
           "cached_tokens_swap_hit_from_cpu": [r["swap_hit_cached_cpu"] for r in rounds] if swap else None,
           **{f"decode_tok_s_batch{b}": med([w for w, _ in dec[b]]) for b in DECODE_BATCHES},
           **{f"decode_tok_s_batch{b}_runs": [round(w, 1) for w, _ in dec[b]] for b in DECODE_BATCHES},
           "cpu": {"ttft_miss_cpu_s": med([r["miss_cpu_s"] for r in rounds]),
                   "ttft_hit_cpu_s": med([r["hit_cpu_s"] for r in rounds]),
                   **{f"decode_tok_per_cpu_s_batch{b}": med([c for _, c in dec[b]]) for b in DECODE_BATCHES}}}
    out["hit_over_miss"] = round(out["ttft_hit_s"] / out["ttft_miss_s"], 4)
    out["swap_hit_over_miss"] = round(out["ttft_swap_hit_s"] / out["ttft_miss_s"], 4) if swap else None
    return out


FIGURES = ("ttft_miss_s", "ttft_hit_s", "ttft_swap_hit_s") + tuple(f"decode_tok_s_batch{b}" for b in DECODE_BATCHES)
# issue #13: warmfleet at least as fast as vLLM at batch 16 and above, at least 0.8x at batch 1 (TTFT: one request)
SPEED_TARGETS = {"ttft_miss_s": 0.8, "ttft_hit_s": 0.8, "decode_tok_s_batch1": 0.8, "decode_tok_s_batch16": 1.0,
                 "decode_tok_s_batch64": 1.0}


def ratios(res: dict) -> dict:
    """vllm / warmfleet for every figure both engines have."""
    if not {"vllm", "warmfleet"} <= res.keys():
        return {}
    return {k: (round(res["vllm"][k] / res["warmfleet"][k], 3) if res["vllm"][k] and res["warmfleet"][k] else None)
            for k in FIGURES}


def cpu_speed_ratios(res: dict) -> dict:
    """The same as speed_ratios on CPU seconds of each server's processes (less disturbed by other jobs)."""
    if not {"vllm", "warmfleet"} <= res.keys():
        return {}
    w, v = res["warmfleet"]["cpu"], res["vllm"]["cpu"]
    return {k: (round(v[k] / w[k] if k.endswith("_s") else w[k] / v[k], 3) if v[k] and w[k] else None) for k in w}


def speed_ratios(res: dict) -> dict:
    """warmfleet's speed over vLLM's for every figure both have: above 1, warmfleet is faster
    (times: vLLM's / warmfleet's; tok/s: warmfleet's / vLLM's)."""
    r = ratios(res)
    return {k: (None if v is None else round(v if k.endswith("_s") else 1 / v, 3)) for k, v in r.items()}


def side_targets(res: dict, cached_prefix: int) -> dict:
    """Booleans: the in-process targets per engine, every hit confirmed by cached_tokens, and warmfleet's
    speed against vLLM's (SPEED_TARGETS)."""
    out = {}
    for k, v in speed_ratios(res).items():
        if k in SPEED_TARGETS and v is not None:
            out[f"warmfleet_{k.removesuffix('_s')}_speed_ge_{SPEED_TARGETS[k]}x_vllm"] = v >= SPEED_TARGETS[k]
    for name, r in res.items():
        out[f"{name}_hit_over_miss_le_0.10"] = r["hit_over_miss"] <= 0.10
        out[f"{name}_misses_cold"] = all(c == 0 for c in r["cached_tokens_miss"])
        out[f"{name}_hits_confirmed"] = all(c >= cached_prefix for c in r["cached_tokens_hit"])
        if r["ttft_swap_hit_s"] is not None:
            out[f"{name}_swap_hit_over_miss_le_0.25"] = r["swap_hit_over_miss"] <= 0.25
            out[f"{name}_swap_hits_confirmed_from_cpu"] = all(
                c >= cached_prefix for c in r["cached_tokens_swap_hit"]) and all(
                c > 0 for c in r["cached_tokens_swap_hit_from_cpu"])
    return out


def side_chart(result: dict, path: Path) -> None:
    """TTFT (miss, hit, swap-tier hit; log scale) and decode tok/s (batch 1, 16), one bar per engine."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = result["engines"]
    colors = {"warmfleet": "#2e9e5b", "vllm": "#4a7ebb"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(res)
    groups = [("ttft_miss_s", "miss"), ("ttft_hit_s", "hit"), ("ttft_swap_hit_s", "swap-tier hit")]
    for j, (name, r) in enumerate(res.items()):
        for i, (k, _) in enumerate(groups):
            x = i + (j - (len(res) - 1) / 2) * width
            if r[k] is None:  # y in axes coordinates: a log axis has no 0
                a.text(x, 0.03, f"{name}: n/a", ha="center", fontsize=7, rotation=90, color=colors.get(name),
                       transform=a.get_xaxis_transform())
            else:
                a.bar(x, r[k], width, color=colors.get(name), label=name if i == 0 else None)
                a.text(x, r[k], f"{r[k] * 1e3:.0f}", ha="center", va="bottom", fontsize=7)
        for i, k in enumerate(f"decode_tok_s_batch{b}" for b in DECODE_BATCHES):
            x = i + (j - (len(res) - 1) / 2) * width
            b.bar(x, r[k], width, color=colors.get(name), label=name if i == 0 else None)
            b.text(x, r[k], f"{r[k]:.0f}", ha="center", va="bottom", fontsize=7)
    a.set_yscale("log")
    a.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    a.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    a.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_ylabel("seconds (log scale)", fontsize=8)
    a.set_xticks(range(3), [g for _, g in groups])
    a.set_title(f"TTFT (ms on bars), {result['prefix_tokens']}+{result['question_tokens']}-token prompts", fontsize=9)
    a.legend(fontsize=8)
    b.set_xticks(range(len(DECODE_BATCHES)), [f"batch {n}" for n in DECODE_BATCHES])
    b.set_title(f"decode tok/s ({result['new_tokens']} new tokens)", fontsize=9)
    b.legend(fontsize=8)
    fig.suptitle(f"prefix cache side by side: medians of {result['runs']} interleaved runs, fp32, block "
                 f"{BLOCK_SIZE}, compute on core {CORE} with one OMP thread", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def side_by_side(args, engines: list[str], runs: int) -> int:
    """The same rounds on every engine as a server, interleaved per repetition; medians and ratios."""
    import shutil
    import tempfile

    import numpy as np

    rt = bench_helpers()
    if args.vllm_python:
        os.environ["WARMFLEET_VLLM_PYTHON"] = args.vllm_python
    unknown = set(engines) - {"warmfleet", "vllm"}
    if unknown:
        raise SystemExit(f"unknown engines: {sorted(unknown)}")
    model_dir = bench_model_dir(args.model, args.size)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    total = PREFIX_TOKENS + QUESTION_TOKENS
    new_tokens = 16 if args.quick else 64
    blocks = pool_blocks(new_tokens)  # as in-process
    cwd = tempfile.mkdtemp(prefix="wf-prefix-")
    load_before = os.getloadavg()
    progress(f"starting {', '.join(engines)} on {model_dir} (pool {blocks} blocks of {BLOCK_SIZE}; logs in {cwd}, "
             "removed after a successful run)")
    servers = start_servers(rt, engines, model_dir, blocks, cwd, args.vllm_cpu_tier)
    if not args.swap_hit:
        for server in servers.values():
            server.swap_tier, server.swap_reason = False, "not measured (--no-swap-hit)"
    try:
        rng = np.random.default_rng(0)
        for server in servers.values():  # warm-up: first request and first batch pay set-up costs
            complete(server.base, tokens(rng, vocab, total), "warmup")
            complete(server.base, [tokens(rng, vocab, DECODE_PROMPT_TOKENS) for _ in range(max(DECODE_BATCHES))],
                     "warmup", 2)
        rounds = {n: [] for n in servers}
        dec = {n: {b: [] for b in DECODE_BATCHES} for n in servers}
        settled: dict[str, list[float]] = {n: [] for n in servers}
        for r in range(runs):
            prefix = tokens(rng, vocab, PREFIX_TOKENS)
            questions = [tokens(rng, vocab, QUESTION_TOKENS) for _ in range(3)]
            filler = filler_prompts(rng, vocab, blocks)
            batch = [tokens(rng, vocab, DECODE_PROMPT_TOKENS) for _ in range(max(DECODE_BATCHES))]
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]  # the first engine alternates
            for name in order:
                server = servers[name]
                settled[name].append(settle(servers.values()))  # the other engine's spin-down, off the clock
                rounds[name].append(ttft_round(rt, server, prefix, questions, filler, f"run-{r}"))
                for b in DECODE_BATCHES:
                    dec[name][b].append(decode_round(server, batch[:b], new_tokens, f"dec{b}-{r}"))
                x = rounds[name][-1]
                progress(f"run {r + 1}/{runs} {name} (after {settled[name][-1]:.1f} s settling): miss {x['miss_s']:.3f}s (cached {x['miss_cached']}) "
                         f"hit {x['hit_s']:.3f}s (cached {x['hit_cached']}) "
                         + (f"swap-hit {x['swap_hit_s']:.3f}s (cached {x['swap_hit_cached']}, from cpu "
                            f"{x['swap_hit_cached_cpu']}) " if "swap_hit_s" in x else "swap-hit n/a ")
                         + "decode " + " / ".join(f"{dec[name][b][-1][0]:.0f}" for b in DECODE_BATCHES)
                         + f" tok/s at batch {'/'.join(map(str, DECODE_BATCHES))}")
        res = {n: summarize_engine(rounds[n], dec[n], servers[n]) for n in servers}
        how = {n: settings(rt, s) for n, s in servers.items()}
    finally:
        for server in servers.values():
            rt.stop_group(server.proc)
    shutil.rmtree(cwd, ignore_errors=True)  # kept when a run fails: the servers' logs
    cached_prefix = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE
    result = {"benchmark": "prefix_cache_side_by_side", "command": " ".join(["python"] + sys.argv),
              "model": str(model_dir), "runs": runs, "prefix_tokens": PREFIX_TOKENS,
              "question_tokens": QUESTION_TOKENS, "new_tokens": new_tokens, "block_size": BLOCK_SIZE,
              "primary_pool_blocks": blocks, "swap_gib": SWAP_GIB, "dtype": "float32",
              "ttft_note": "latency of a 1-token /v1/completions request over loopback HTTP (prefill + 1 token)",
              "decode_note": f"completion tokens / request seconds for one request of {DECODE_BATCHES} "
                             f"{DECODE_PROMPT_TOKENS}-token prompts (prefill of the batch included)",
              "engines": res, "vllm_over_warmfleet": ratios(res), "warmfleet_speed_over_vllm": speed_ratios(res),
              "warmfleet_cpu_speed_over_vllm": cpu_speed_ratios(res),
              "cpu_note": "CPU seconds (user + system) of each server's whole process tree during a request, from "
                          "/proc, taken just before and after it (vLLM's worker busy-waits with sched_yield for up to 1 s after "
                          "its last read: partly outside these windows)",
              "threads_and_cores": how,
              "settle_s": settled,
              "settle_note": "before each engine's round the bench waits until both servers' processes use under 10% "
                             "of a core over 0.3 s (vLLM's worker spins for up to 1 s after a request, on the core "
                             "the other engine computes on); seconds waited per round",
              "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
              "targets_text": "hit/miss <= 0.10 and swap-hit/miss <= 0.25 (the in-process targets), misses report "
                              f"0 cached tokens, hits >= {cached_prefix} cached tokens (swap hits: from the CPU tier); "
                              f"warmfleet's speed over vLLM's >= {SPEED_TARGETS} (issue #13)",
              "targets": side_targets(res, cached_prefix)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps(result, indent=1))
    side_chart(result, out / "prefix_cache.png")
    progress(f"wrote {out / 'prefix_cache.json'} and {out / 'prefix_cache.png'}")
    if not args.json:
        for k in ("engines", "warmfleet_speed_over_vllm", "warmfleet_cpu_speed_over_vllm", "targets"):
            print(f"{k}: {json.dumps(result[k])}")
    print(json.dumps(result))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and decode tokens")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary on stdout")
    ap.add_argument("--model", help="checkpoint directory (default: the --size checkpoint, made on first run)")
    ap.add_argument("--size", choices=SIZES, default="bench",
                    help="which `warmfleet make-tiny-model --size` checkpoint to make and use without --model")
    ap.add_argument("--runs", type=int, default=None, help="repetitions per measurement (default 5, quick 3)")
    ap.add_argument("--engines", default="warmfleet",
                    help="warmfleet (in-process, the default), or a list with vllm: each engine as a server, "
                         "side by side")
    ap.add_argument("--vllm-python", default=None,
                    help="python of the vLLM CPU environment (default: $WARMFLEET_VLLM_PYTHON or scripts/vllm-env.sh)")
    ap.add_argument("--vllm-cpu-tier", action=argparse.BooleanOptionalAction, default=True,
                    help="try vLLM with its CPU KV tier first (its 0.32.0 CPU build refuses it after ~2 min of start-up)")
    ap.add_argument("--swap-hit", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the swap-tier hit (its filler prefills ~9k tokens per run: minutes on a large model)")
    ap.add_argument("--out", default="bench/results", help="directory for prefix_cache.json/.png (--engines only)")
    args = ap.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    engines = args.engines.split(",")
    if engines != ["warmfleet"]:
        return side_by_side(args, engines, runs)

    import numpy as np

    from warmfleet import LLM, SamplingParams

    model_dir = bench_model_dir(args.model, args.size)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    total = PREFIX_TOKENS + QUESTION_TOKENS
    new_tokens = 16 if args.quick else 64
    # The primary pool holds one prompt and the batch-64 decode; a filler batch pushes the prefix into the swap tier.
    num_gpu_blocks = pool_blocks(new_tokens)
    progress(f"loading {model_dir} (primary pool {num_gpu_blocks} blocks, swap 1 GiB)")
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, swap_space=1.0,
              max_num_batched_tokens=4096, max_num_seqs=max(DECODE_BATCHES))
    rng = np.random.default_rng(0)

    progress("warm-up")
    ttft(llm, tokens(rng, vocab, total), "warmup")
    miss, hit, swap_hit = [], [], []
    cached_hit, cached_swap = [], []
    for r in range(runs):
        salt = f"run-{r}"
        prefix = tokens(rng, vocab, PREFIX_TOKENS)
        t, c, _ = ttft(llm, prefix + tokens(rng, vocab, QUESTION_TOKENS), salt)
        assert c == 0, "a cold prompt must not hit"
        miss.append(t)
        t, c, _ = ttft(llm, prefix + tokens(rng, vocab, QUESTION_TOKENS), salt)
        hit.append(t)
        cached_hit.append(c)
        llm.generate(filler_prompts(rng, vocab, num_gpu_blocks), SamplingParams(max_tokens=1, ignore_eos=True),
                     cache_salt=f"filler-{r}")  # evicts the prefix into the swap tier
        t, c, c_cpu = ttft(llm, prefix + tokens(rng, vocab, QUESTION_TOKENS), salt)
        swap_hit.append(t)
        cached_swap.append(c_cpu)
        progress(f"run {r + 1}/{runs}: miss {miss[-1]:.3f}s hit {hit[-1]:.3f}s swap-hit {swap_hit[-1]:.3f}s "
                 f"(cached {cached_hit[-1]} / from cpu {cached_swap[-1]})")

    progress(f"decode throughput, {new_tokens} new tokens at batch {DECODE_BATCHES}")
    dec = {b: decode_throughput(llm, vocab, b, new_tokens, rng) for b in DECODE_BATCHES}
    progress("transformers.generate baseline (only where torch is installed)")
    hf1 = transformers_throughput(model_dir, 1, new_tokens)
    hf16 = transformers_throughput(model_dir, 16, new_tokens) if hf1 is not None else None

    m_miss, m_hit, m_swap = (statistics.median(x) for x in (miss, hit, swap_hit))
    result = {
        "benchmark": "prefix_cache",
        "model": str(model_dir),
        "runs": runs,
        "prefix_tokens": PREFIX_TOKENS,
        "question_tokens": QUESTION_TOKENS,
        "ttft_miss_s": round(m_miss, 4),
        "ttft_hit_s": round(m_hit, 4),
        "ttft_swap_hit_s": round(m_swap, 4),
        "hit_over_miss": round(m_hit / m_miss, 4),
        "swap_hit_over_miss": round(m_swap / m_miss, 4),
        "ideal_ratio": round(QUESTION_TOKENS / total, 4),
        "cached_tokens_hit": int(statistics.median(cached_hit)),
        "cached_tokens_swap_hit_cpu": int(statistics.median(cached_swap)),
        **{f"decode_tok_s_batch{b}": round(dec[b], 1) for b in DECODE_BATCHES},
        "transformers_decode_tok_s_batch1": None if hf1 is None else round(hf1, 1),
        "transformers_decode_tok_s_batch16": None if hf16 is None else round(hf16, 1),
        "targets": {"hit_over_miss_le_0.10": m_hit / m_miss <= 0.10, "swap_hit_over_miss_le_0.25": m_swap / m_miss <= 0.25,
                    "swap_hits_from_cpu": all(c > 0 for c in cached_swap)},
    }
    if not args.json:
        for k, v in result.items():
            print(f"{k:36s} {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
