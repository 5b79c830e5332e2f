"""Where one router process's CPU goes: py-spy on `warmfleet route` under a fixed rate from `hey`, samples by stage.

    python -P bench/router_profile.py [--rate 600] [--duration 20] [--body chat|completion|unique] [--native]
                                      [--speedscope FILE] [--json] [--out DIR]

Setup and pinning as bench/router_throughput.py (router on core 0; bench/simfleet.py with the zero
time model, 8 replicas, and hey on core 1; non-streaming requests, max_tokens 1). `--body chat`
sends multi-turn chat bodies on one shared system prompt (router_throughput.chat_bodies_for),
`completion` the throughput bench's text prompts, `unique` completions whose every prompt is new (from vegeta,
router_throughput.load_sender). py-spy (`pip install py-spy`; needs ptrace)
records the router's non-idle samples (`record --format raw`, 200 Hz; `--nonblocking` unless
`--native`, which needs the process stopped per sample); a sample whose innermost frame is epoll is
a thread woken and not yet on a core (with --native; counted apart, not CPU). Each other
stack is given to the first stage (STAGES, in order) one of whose patterns occurs in it, read
from the innermost frame outwards, so a tokenizer call inside the proxy counts as tokenize.
Writes router_profile.json (shares per stage, the top stacks) and the raw collapsed stacks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent
rt = harness.sibling("router_throughput")
replay_fleet = harness.sibling("replay_fleet")
replay_workload = harness.sibling("replay_workload")
progress = harness.reporter("profile")

# stage -> substrings of a py-spy frame ("function (file:line)"); the innermost frame that matches one decides
STAGES = [
    ("metrics (prometheus_client)", ("prometheus_client", "metrics.py")),
    ("logging", ("logging/__init__",)),
    ("KV events (zmq, index apply)", ("subscriber.py", "zmq", "libzmq", "msgpack", "apply_batch", "apply_snapshot",
                                      "server/events.py")),
    ("tokenize", ("tokenizers", "tiktoken", "core/bpe.py", "encode_batch_fast", "SegmentEncoder", "ids_encoder",
                  "tokenizer.py:encode")),
    ("chat template render", ("jinja2", "minijinja", "core/template.py", "apply_chat_template", "_prepare_message", "<template>", "_as_replica_sees")),
    ("hash", ("hashing.py", "HashMemo", "block_hashes", "blake3")),
    ("index match", ("index.py",)),
    ("policy choose", ("policy.py",)),
    ("hot-prefix bookkeeping", ("warmup.py",)),
    ("body JSON parse", ("json/decoder", "json/__init__", "parse_json_object", "receive_capped", "_json.c")),
    ("upstream client (aiohttp or http/upstream.py)", ("aiohttp", "upstream.py")),
    ("response relay (starlette)", ("starlette/responses",)),
    ("HTTP server (uvicorn, httptools)", ("uvicorn", "httptools", "transport.py")),
    ("route / forward (router code)", ("router/core/", "router/http/")),
    ("health checks, peers", ("fleet.py", "peers.py")),
    ("event loop (uvloop, asyncio)", ("uvloop", "asyncio")),
]
GC = ("gc_collect", "_PyGC_", "(gc)")
SYSCALLS = ("write (libc", "read (libc", "writev (libc", "send", "recv", "connect (libc")  # innermost frame (--native)
# a sample whose innermost frame is epoll is a thread woken but not yet on a core (runnable in epoll_wait):
# run-queue wait on a busy machine, not CPU; counted apart and left out of the shares
WAITING = ("epoll_pwait", "epoll_wait")


def stage_of(stack: list[str]) -> str:
    """The stage of one stack: gc anywhere in it, a socket syscall innermost, else the first stage matching its
    innermost Python frame that matches any (C frames count for the Python code that called them)."""
    if any(g in f for f in stack for g in GC):
        return "gc"
    if stack[-1].startswith(SYSCALLS):
        return "socket syscalls (loopback TCP in the kernel)"
    for frame in reversed(stack):
        if ".py" not in frame and "<template>" not in frame:
            continue
        for name, pats in STAGES:
            if any(p in frame for p in pats):
                return name
    return "other"


def attribute(raw: str, top: int = 15) -> dict:
    """Shares per stage of the CPU samples and the `top` innermost frames by samples, from py-spy's collapsed stacks."""
    per: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = waiting = 0
    for line in raw.splitlines():
        stacks, _, n = line.rpartition(" ")
        if not stacks or not n.isdigit():
            continue
        frames = stacks.split(";")
        if any(w in frames[-1] for w in WAITING):
            waiting += int(n)
            continue
        total += int(n)
        per[stage_of(frames)] += int(n)
        inner = [f for f in frames if "(" in f][-3:]
        leaves[" < ".join(reversed(inner))] += int(n)
    return {"samples": total, "samples_runnable_in_epoll": waiting,
            "stage_share": {k: round(v / total, 3) for k, v in per.most_common()} if total else {},
            "top_stacks": [{"share": round(v / total, 3), "frames": k} for k, v in leaves.most_common(top)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=600.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--body", choices=("chat", "completion", "unique"), default="chat",
                    help="unique: completions whose every prompt is new (router_throughput.UniqueBodies, vegeta)")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C frames of extensions too)")
    ap.add_argument("--speedscope", default=None, help="also write a speedscope profile here (second recording)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    from warmfleet.server.tokenizer import Tokenizer

    spy = harness.find_tool("py-spy")
    if spy is None:
        raise FileNotFoundError("py-spy not found: pip install py-spy")
    model = replay_workload.tiny_model()
    send = rt.load_sender(args.body, replay_workload.Words(Tokenizer(str(model)), 16), "1", 16)
    cwd = tempfile.mkdtemp(prefix="wf-profile-")
    path = "/v1/chat/completions" if args.body == "chat" else "/v1/completions"
    sim, desc = harness.start_simfleet(model, cwd, ["--replicas", "8", "--time-model", "zero", "--gpu-blocks", "4096"],
                                       taskset="1", timeout_s=60)
    router = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        base, router = replay_fleet.start_router("warmfleet", model, desc, 16, cwd, [], taskset="0")
        send(base + path, args.rate, 2.0)  # warm
        formats = [("raw", out / "router_profile.txt")]
        if args.speedscope:
            formats.append(("speedscope", Path(args.speedscope)))
        res: dict = {}
        for fmt, dest in formats:
            cmd = [spy, "record", "--pid", str(router.pid), "--rate", "200", "--format", fmt,
                   "--output", str(dest), "--duration", str(int(args.duration)),
                   "--native" if args.native else "--nonblocking"]
            rec = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(1.0)
            c0 = harness.tree_cpu_s(router.pid)
            r = send(base + path, args.rate, args.duration - 2)
            r["router_cpu_ms_per_request"] = round((harness.tree_cpu_s(router.pid) - c0) / max(1, r["requests"])
                                                   * 1e3, 3)
            err = rec.communicate(timeout=args.duration + 60)[1]
            if rec.returncode != 0:
                raise RuntimeError(f"py-spy failed: {err.strip()[-400:]}")
            progress(f"{fmt}: {r}")
            if fmt == "raw":
                res = {"load": r, **attribute(dest.read_text())}
    finally:
        harness.stop(router)
        harness.stop(sim)
        shutil.rmtree(cwd, ignore_errors=True)
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv), "body": args.body, "rate": args.rate,
           "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **res}
    (out / "router_profile.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res) if args.json else json.dumps({k: res[k] for k in ("load", "stage_share")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
