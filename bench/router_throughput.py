"""Router throughput: the largest request rate one router process sustains with p99 added latency under 10 ms.

    python -P bench/router_throughput.py [--routers warmfleet,sglang] [--replicas 8] [--rates 100,200,...]
                                         [--duration 8] [--repeats 1] [--router-core 0] [--load-core 1]
                                         [--unique-prompts] [--load-generator hey|vegeta]
                                         [--json] [--out DIR]

Backends are `bench/simfleet.py` with the zero time model (answers as soon as the engine's real
scheduler and block pool have run the request: contract-1 hashing, KV events published, usage
with cached_tokens), so the router under test is the bottleneck. The load generator is vegeta
(compiled Go; `go install github.com/tsenart/vegeta/v12@v12.13.0`, found on PATH or in ~/go/bin): an
open rate with at most C requests in flight. Its own p99 is a few ms lower than hey's, which is what
lets the added-latency targets be read. `--load-generator hey` runs the earlier rig
(`go install github.com/rakyll/hey@latest`): C hey processes (`hey -z D -c 1 -q R/C`), started 1/R
apart so the arrivals are spread evenly (one process with C workers sends synchronized bursts of C).

Pinning (taskset): every router process (all its threads) on --router-core, the simulator and the load generator
on --load-core. All routers run at once against the same simulator and are measured in turn at
each rate, after one direct run against a replica at that rate (so they share the machine's
load); added latency = router p99 - direct p99. A rate is sustained when the achieved rate is
>= 95% of the offered one, there are no errors, and added p99 < 10 ms. With --repeats N each
step is run N times (direct run and every router, interleaved) and the run with the median added
p99 stands for the step (a shared machine's stalls hit single runs). The sustained rate is the
largest rate sustained (`max_sustained_rps`; `max_sustained_rps_contiguous`: the largest with
every step up to it sustained, which one noisy step below pulls down). Also reported: the router's CPU per request (utime +
stime of its process tree) and the rate one core of it would serve at that cost, a figure that
holds on a machine shared with other work, where latency does not.

Targets, under `targets`: warmfleet's sustained rate >= 0.5x sglang-router's (issue #11); issue #26's: >= 1.0x its
sustained rate, CPU per request <= 1.5x its at every rate both sustained (medians over the repeats:
`cpu_per_request_warmfleet_over_sglang`), added latency p50 <= 1 ms (router p50 - direct p50, median
over the repeats) and p99 <= 3 ms at warmfleet's step nearest half its sustained rate. The bodies
repeat (a few bodies, cycled), so warmfleet's segment memo serves their tokenization. `--unique-prompts`
sends every request a prompt never sent before instead (the shared first block, then random words), from
vegeta (`go install github.com/tsenart/vegeta/v12@v12.13.0`; open rate, at most --concurrency in flight),
so each router pays for every prompt what a production stream of new prompts costs it (always from vegeta).
Writes router_throughput.json and router_throughput.png (achieved rate, added p99, CPU per request).

Requests: POST /v1/completions, non-streaming, max_tokens 1, a text prompt of --prompt-words
single-token words (several full blocks), one of --distinct-prompts prompts that share a prefix
(vegeta cycles over them; hey sends one body per process). Text because sglang-router
0.3.2 refuses token-id prompts.
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent


progress = harness.reporter("throughput")


replay_fleet = harness.sibling("replay_fleet")
replay_workload = harness.sibling("replay_workload")


GO_TOOLS = {"hey": "go install github.com/rakyll/hey@latest",
            "vegeta": "go install github.com/tsenart/vegeta/v12@v12.13.0"}  # load generators: how to install


def go_tool(name: str) -> str:
    """The path of load generator `name` (GO_TOOLS), on PATH or in ~/go/bin."""
    found = shutil.which(name) or str(Path.home() / "go" / "bin" / name)
    if not Path(found).exists():
        raise FileNotFoundError(f"{name} not found: {GO_TOOLS[name]}")
    return found


def run_hey(url: str, bodies: list[bytes], rate: float, duration: float, core: str, procs: int) -> dict:
    """Offered `rate` as `procs` hey processes of one worker each, started 1/rate apart; latencies from hey's CSV.

    One worker per process, phases spread: hey's -q ticker is per worker and all workers of one
    process start together, so `-c 32 -q R/32` sends synchronized bursts of 32 (measured here: p50
    33 ms at 100 req/s against 2.6 ms for the same rate from one worker). A worker is closed-loop:
    a request slower than procs/rate drops ticks, which shows as achieved < offered.
    """
    tmp = Path(tempfile.mkdtemp(prefix="wf-hey-"))
    files = []
    for k, b in enumerate(bodies):
        f = tmp / f"b{k}.json"
        f.write_bytes(b)
        files.append(f)
    running = []
    for k in range(procs):
        cmd = ["taskset", "-c", core, go_tool("hey"), "-z", f"{duration}s", "-c", "1", "-q", f"{rate / procs:.4f}",
               "-m", "POST", "-T", "application/json", "-D", str(files[k % len(files)]), "-o", "csv", url]
        running.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1.0 / rate)
    lat, errors, n = [], 0, 0
    for p in running:
        out, err = p.communicate(timeout=duration + 120)
        for row in csv.DictReader(io.StringIO(out)):
            n += 1
            if row.get("status-code") != "200":
                errors += 1
                continue
            lat.append(float(row["response-time"]))
    shutil.rmtree(tmp, ignore_errors=True)
    lat.sort()

    def q(p):
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 3) if lat else None

    return {"offered_rps": rate, "achieved_rps": round(n / duration, 1), "requests": n, "errors": errors,
            "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99)}


def run_vegeta(url: str, bodies: list[bytes], rate: float, duration: float, core: str, workers: int) -> dict:
    """Offered `rate` for `duration` from vegeta (open rate, at most `workers` requests in flight), one body each from
    `bodies` in order (as many as it sends, so none repeats); the same figures as run_hey."""
    tmp = Path(tempfile.mkdtemp(prefix="wf-vegeta-"))
    targets = tmp / "targets.jsonl"
    with targets.open("w") as f:
        for b in bodies:
            f.write(json.dumps({"method": "POST", "url": url, "body": base64.b64encode(b).decode(),
                                "header": {"Content-Type": ["application/json"]}}) + "\n")
    attack = subprocess.run(["taskset", "-c", core, go_tool("vegeta"), "attack", "-format=json", f"-targets={targets}",
                             f"-rate={rate:g}/1s", f"-duration={duration}s", f"-workers={workers}",
                             f"-max-workers={workers}", "-timeout=30s", f"-output={tmp / 'results.bin'}"],
                            capture_output=True, text=True, timeout=duration + 120)
    if attack.returncode != 0:
        raise RuntimeError(f"vegeta attack failed: {attack.stderr.strip()[-300:]}")
    rep = json.loads(subprocess.run([go_tool("vegeta"), "report", "-type=json", str(tmp / "results.bin")],
                                    capture_output=True, text=True, check=True, timeout=120).stdout)
    shutil.rmtree(tmp, ignore_errors=True)
    n = rep["requests"]
    ok = rep.get("status_codes", {}).get("200", 0)
    lat = rep["latencies"]

    def q(key):  # vegeta reports nanoseconds, over every request (failed ones too)
        return round(lat[key] / 1e6, 3) if n else None

    return {"offered_rps": rate, "achieved_rps": round(ok / duration, 1), "requests": n, "errors": n - ok,
            "p50_ms": q("50th"), "p90_ms": q("90th"), "p99_ms": q("99th")}


class UniqueBodies:
    """Completion bodies nobody sent before: the throughput bench's shared first block, then `n_words` - 16 words
    drawn at random per body (so every tokenization and radix-tree insert is a miss)."""

    def __init__(self, words, n_words: int, seed: int = 1):
        self.words, self.n_words, self.shared = words, n_words, [words.words[i][0] for i in words.run(10**9)]
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[bytes]:
        rest = self.n_words - len(self.shared)
        vocab = [w for w, _ in self.words.words]
        return [json.dumps({"model": "bench", "prompt": "".join(self.shared + self.rng.choices(vocab, k=rest)),
                            "max_tokens": 1}).encode() for _ in range(n)]


def bodies_for(words, n_words: int, distinct: int) -> list[bytes]:
    shared = [words.words[i][0] for i in words.run(10**9)][: n_words // 2]
    out = []
    for k in range(distinct):
        rest = [words.words[i][0] for i in words.run(10**9 + 1 + k)] * (n_words // words.block + 1)
        text = "".join(shared + rest[: n_words - len(shared)])
        out.append(json.dumps({"model": "bench", "prompt": text, "max_tokens": 1}).encode())
    return out


def chat_bodies_for(words, n_words: int, distinct: int) -> list[bytes]:
    """Chat bodies of about `n_words` tokens: one shared system prompt (half), then a conversation of its own each
    (user, assistant, user), as a multi-turn client sends them."""
    shared = [words.words[i][0] for i in words.run(10**9)] * (n_words // 2 // words.block + 1)
    out = []
    for k in range(distinct):
        rest = [words.words[i][0] for i in words.run(10**9 + 1 + k)] * (n_words // words.block + 1)
        turn = max(1, (n_words - n_words // 2) // 3)
        msgs = [{"role": "system", "content": "".join(shared[: n_words // 2])},
                {"role": "user", "content": "".join(rest[:turn])},
                {"role": "assistant", "content": "".join(rest[turn: 2 * turn])},
                {"role": "user", "content": "".join(rest[2 * turn: 3 * turn])}]
        out.append(json.dumps({"model": "bench", "messages": msgs, "max_tokens": 1}).encode())
    return out


def make_bodies(kind: str, words, n_words: int, distinct: int) -> list[bytes]:
    """`kind` "completion" (bodies_for) or "chat" (chat_bodies_for)."""
    return (chat_bodies_for if kind == "chat" else bodies_for)(words, n_words, distinct)


def load_sender(kind: str, words, core: str, concurrency: int, n_words: int = 96, distinct: int = 4,
                tool: str = "hey"):
    """send(url, rate, duration) -> run figures, on `core`: repeating bodies ("completion", "chat") from `tool` (hey
    or vegeta, which cycles over them), or never-sent ones ("unique", always vegeta)."""
    if kind == "unique":
        unique = UniqueBodies(words, n_words)
        return lambda url, rate, duration: run_vegeta(url, unique.take(int(rate * duration * 1.05) + 10), rate,
                                                      duration, core, concurrency)
    bodies = make_bodies(kind, words, n_words, distinct)
    run = run_vegeta if tool == "vegeta" else run_hey
    return lambda url, rate, duration: run(url, bodies, rate, duration, core, concurrency)


def measure(kinds: list[str], args, model: Path, cwd: str, send, rates: list[float]) -> dict:
    """Every router against the same simulated fleet, interleaved at each rate (same machine load)."""
    sim, desc = harness.start_simfleet(model, cwd, ["--replicas", str(args.replicas), "--time-model", "zero",
                                                    "--gpu-blocks", "4096"], taskset=args.load_core, timeout_s=60)
    routers: dict = {}
    try:
        for kind in kinds:
            routers[kind] = replay_fleet.start_router(kind, model, desc, 16, cwd, harness.variants(args.variant).get(kind, []),
                                               taskset=args.router_core)
        direct = desc["replicas"][0]["url"]
        out = {k: {"steps": [], "max_sustained_rps": None, "max_sustained_rps_contiguous": None, "contiguous": True,
                   "failures_in_a_row": 0} for k in kinds}
        for rate in rates:
            live = [k for k in kinds if out[k]["failures_in_a_row"] < 2]
            if not live:
                break
            runs: dict = {k: [] for k in live}
            for _ in range(args.repeats):
                d = send(direct + "/v1/completions", rate, args.duration / 2)
                for kind in live:
                    runs[kind].append(measure_one(routers[kind], send, rate, args, d))
            for kind in live:
                # the run with the median added p99 stands for the step (a failed run sorts last)
                ranked = sorted(runs[kind], key=lambda r: (r["added_p99_ms"] is None, r["added_p99_ms"] or 0.0))
                r = dict(ranked[(len(ranked) - 1) // 2])
                # CPU per request and added p50 as the median over the repeats (a repeat's own stall moves its p99,
                # not these)
                r["router_cpu_ms_per_request_median"] = statistics.median(
                    run["router_cpu_ms_per_request"] for run in runs[kind])
                p50s = [run["added_p50_ms"] for run in runs[kind] if run["added_p50_ms"] is not None]
                r["added_p50_ms_median"] = round(statistics.median(p50s), 3) if p50s else None
                if args.repeats > 1:
                    r["repeats"] = [{x: run[x] for x in ("achieved_rps", "errors", "p50_ms", "p99_ms", "added_p50_ms",
                                                          "added_p99_ms", "router_cpu_ms_per_request", "sustained")}
                                    for run in runs[kind]]
                out[kind]["steps"].append(r)
                progress(f"{kind} @ {rate:g}/s: {r}")
                if r["sustained"]:
                    out[kind]["max_sustained_rps"] = rate
                    if out[kind]["contiguous"]:
                        out[kind]["max_sustained_rps_contiguous"] = rate
                else:
                    out[kind]["contiguous"] = False
                # keep climbing past the latency limit until the router saturates (two steps below 90% of
                # the offered rate): the saturation rate is reported too
                saturated = r["errors"] > 0 or r["achieved_rps"] < 0.9 * rate
                out[kind]["failures_in_a_row"] = out[kind]["failures_in_a_row"] + 1 if saturated else 0
        for kind, o in out.items():
            o.pop("failures_in_a_row")
            o.pop("contiguous")
            per = [s["router_cpu_ms_per_request"] for s in o["steps"] if s["requests"]]
            # what one core of router CPU could serve at the CPU cost measured (robust to a shared machine)
            o["cpu_bound_rps_per_core"] = round(1e3 / statistics.median(per)) if per else None
            o["max_achieved_rps"] = max((s["achieved_rps"] for s in o["steps"]), default=None)
            o["max_rps_with_p99_under_10ms"] = max((s["offered_rps"] for s in o["steps"] if s["p99_ms"] is not None
                                                    and s["p99_ms"] < 10.0 and s["achieved_rps"] >= 0.95 * s["offered_rps"]),
                                                   default=None)
        return out
    finally:
        for _, proc in routers.values():
            harness.stop(proc)
        harness.stop(sim)


def measure_one(router: tuple, send, rate: float, args, direct: dict) -> dict:
    """One warmed-up run of a router at `rate`: latencies, CPU per request, added p99 against `direct`."""
    base, proc = router
    send(base + "/v1/completions", rate, 1.5)  # warm
    c0 = harness.tree_cpu_s(proc.pid)
    r = send(base + "/v1/completions", rate, args.duration)
    cpu = harness.tree_cpu_s(proc.pid) - c0
    r["router_cpu_s_per_s"] = round(cpu / args.duration, 3)
    r["router_cpu_ms_per_request"] = round(cpu / max(1, r["requests"]) * 1e3, 3)
    r["direct_p50_ms"], r["direct_p99_ms"], r["direct_achieved_rps"] = (direct["p50_ms"], direct["p99_ms"],
                                                                         direct["achieved_rps"])
    r["added_p50_ms"] = round(r["p50_ms"] - direct["p50_ms"], 3) if r["p50_ms"] and direct["p50_ms"] else None
    r["added_p99_ms"] = round(r["p99_ms"] - direct["p99_ms"], 3) if r["p99_ms"] and direct["p99_ms"] else None
    r["sustained"] = (r["errors"] == 0 and r["achieved_rps"] >= 0.95 * rate
                      and r["added_p99_ms"] is not None and r["added_p99_ms"] < 10.0)
    return r


def cpu_ratios(res: dict) -> dict:
    """Rate -> warmfleet's over SGLang's CPU per request (medians over the repeats), at the rates both sustained."""
    wf, sg = (res["routers"].get(k, {}).get("steps", []) for k in ("warmfleet", "sglang"))
    sg_at = {s["offered_rps"]: s for s in sg if s["sustained"]}
    return {str(s["offered_rps"]): round(s["router_cpu_ms_per_request_median"]
                                         / sg_at[s["offered_rps"]]["router_cpu_ms_per_request_median"], 3)
            for s in wf if s["sustained"] and s["offered_rps"] in sg_at}


def half_rate_step(res: dict) -> Optional[dict]:
    """warmfleet's step nearest half its sustained rate (the rate the added-latency targets are judged at)."""
    o = res["routers"].get("warmfleet", {})
    if not o.get("max_sustained_rps") or not o.get("steps"):
        return None
    half = o["max_sustained_rps"] / 2
    return min(o["steps"], key=lambda s: (abs(s["offered_rps"] - half), s["offered_rps"]))


def verdict(res: dict) -> dict:
    """The issues' targets as booleans (None when a router is missing or sustained no rate at all).

    Issue #11: sustained rate >= 0.5x sglang-router's. Issue #26: >= 1.0x its sustained rate; CPU per request
    <= 1.5x its at every rate both sustained; added latency p50 <= 1 ms and p99 <= 3 ms at half the sustained rate."""
    wf, sg = (res["routers"].get(k, {}).get("max_sustained_rps") for k in ("warmfleet", "sglang"))
    ratios = cpu_ratios(res)
    half = half_rate_step(res)
    return {"warmfleet_sustained_rate_ge_0.5x_sglang": None if not sg else bool(wf and wf >= 0.5 * sg),
            "warmfleet_sustained_rate_ge_1.0x_sglang": None if not sg else bool(wf and wf >= sg),
            "warmfleet_cpu_per_request_le_1.5x_sglang": bool(max(ratios.values()) <= 1.5) if ratios else None,
            "warmfleet_added_p50_le_1ms_at_half_rate": (None if half is None or half["added_p50_ms_median"] is None
                                                        else bool(half["added_p50_ms_median"] <= 1.0)),
            "warmfleet_added_p99_le_3ms_at_half_rate": (None if half is None or half["added_p99_ms"] is None
                                                        else bool(half["added_p99_ms"] <= 3.0))}


def chart(res: dict, path: Path) -> None:
    """Achieved vs offered rate, added p99 (10 ms line) and router CPU per request, one line per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sglang": "#d9822b", "vllm": "#4a7ebb", "warmfleet": "#2e9e5b"}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    top = 0.0
    for kind, o in res["routers"].items():
        steps = o["steps"]
        x = [s["offered_rps"] for s in steps]
        top = max([top, *x])
        c = colors.get(kind.split(":")[0], "#555555")
        label = f"{kind} (sustained {o['max_sustained_rps']}/s)"
        ax[0].plot(x, [s["achieved_rps"] for s in steps], "o-", color=c, label=label)
        ax[1].plot(x, [s["added_p99_ms"] for s in steps], "o-", color=c, label=kind)
        ax[2].plot(x, [s["router_cpu_ms_per_request"] for s in steps], "o-", color=c, label=kind)
    ax[0].plot([0, top], [0, top], ls=":", color="k", lw=1, label="offered")
    ax[0].set_title("achieved vs offered requests/s", fontsize=9)
    ax[1].axhline(10, ls="--", color="k", lw=1, label="10 ms")
    ax[1].set_title("p99 added latency (router p99 - direct p99), ms", fontsize=9)
    ax[1].set_yscale("symlog", linthresh=10)
    ax[1].set_yticks([-10, -5, 0, 5, 10, 20, 50, 100], ["-10", "-5", "0", "5", "10", "20", "50", "100"])
    ax[2].set_title("router CPU ms per request (its process tree)", fontsize=9)
    ax[2].set_ylim(bottom=0)
    for a in ax:
        a.set_xlabel("offered requests/s")
        a.legend(fontsize=8)
    t = res["targets"]
    met = ", ".join(f"{k.removeprefix('warmfleet_')}: {v}" for k, v in t.items())
    fig.suptitle(f"router throughput: {res['replicas']} simulated replicas, one router core (taskset), repeats "
                 f"{res['repeats']}; CPU per request warmfleet/SGLang by rate "
                 f"{res.get('cpu_per_request_warmfleet_over_sglang')}\n{met}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routers", default="warmfleet,sglang")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--rates", default="100,200,300,400,500,600,800,1000,1300,1600,2000,2500,3000,4000")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="Runs per step (direct and every router, interleaved); the median added p99 run counts.")
    ap.add_argument("--concurrency", type=int, default=16,
                    help="Requests in flight at most (vegeta's workers), or hey processes of one worker each (their "
                         "phases spread over the rate's period).")
    ap.add_argument("--prompt-words", type=int, default=96, help="Prompt length in tokens (one word = one token).")
    ap.add_argument("--distinct-prompts", type=int, default=4)
    ap.add_argument("--load-generator", choices=("hey", "vegeta"), default="vegeta",
                    help="For the repeating bodies: hey (closed-loop processes) or vegeta (open rate; its own p99 is a "
                         "few ms lower, so added latency can be read).")
    ap.add_argument("--unique-prompts", action="store_true",
                    help="Every request a prompt never sent before (vegeta, not hey): tokenizing is never a memo hit.")
    ap.add_argument("--router-core", default="0")
    ap.add_argument("--load-core", default="1")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    from warmfleet.server.tokenizer import Tokenizer

    model = replay_workload.tiny_model()
    words = replay_workload.Words(Tokenizer(str(model)), 16)
    unique = args.unique_prompts
    tool = "vegeta" if unique else args.load_generator
    send = load_sender("unique" if unique else "completion", words, args.load_core, args.concurrency,
                       args.prompt_words, args.distinct_prompts, tool)
    rates = [float(x) for x in args.rates.split(",")]
    cwd = tempfile.mkdtemp(prefix="wf-tput-")
    path, install = go_tool(tool), GO_TOOLS[tool]
    tool_v = subprocess.run(["go", "version", "-m", path], capture_output=True, text=True).stdout.split("\n")
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv),
           "load_generator": {"tool": tool, "path": path, "install": install,
                              "module": next((x.strip() for x in tool_v if x.strip().startswith("mod")), None)},
           "prompts": "unique (never sent before)" if unique else f"{args.distinct_prompts} repeating bodies",
           "pinning": {"router": f"taskset -c {args.router_core}",
                       "simulator_and_load": f"taskset -c {args.load_core}",
                       "note": "other processes on the machine are not excluded from these cores"},
           "replicas": args.replicas, "prompt_tokens": args.prompt_words, "duration_s": args.duration,
           "concurrency": args.concurrency, "repeats": args.repeats, "loadavg_start": os.getloadavg(), "routers": {}}
    res["routers"] = measure(args.routers.split(","), args, model, cwd, send, rates)
    wf, sg = (res["routers"].get(k, {}) for k in ("warmfleet", "sglang"))
    for key in ("max_sustained_rps", "max_sustained_rps_contiguous", "max_achieved_rps", "cpu_bound_rps_per_core",
                "max_rps_with_p99_under_10ms"):
        a, b = wf.get(key), sg.get(key)
        res[f"ratio_warmfleet_over_sglang_{key}"] = round(a / b, 3) if a and b else None
    res["cpu_per_request_warmfleet_over_sglang"] = cpu_ratios(res)  # by rate, medians over the repeats
    half = half_rate_step(res)
    res["added_latency_at_half_rate"] = None if half is None else {
        "offered_rps": half["offered_rps"], "added_p50_ms_median": half["added_p50_ms_median"],
        "added_p99_ms": half["added_p99_ms"], "direct_p99_ms": half["direct_p99_ms"]}
    res["loadavg_end"] = os.getloadavg()
    res["targets"] = verdict(res)
    shutil.rmtree(cwd, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_throughput.json").write_text(json.dumps(res, indent=1))
    chart(res, out / "router_throughput.png")
    summary = {k: {x: v[x] for x in ("max_sustained_rps", "max_sustained_rps_contiguous", "max_achieved_rps",
                                     "cpu_bound_rps_per_core", "max_rps_with_p99_under_10ms")}
               for k, v in res["routers"].items()}
    summary["cpu_per_request_warmfleet_over_sglang"] = res["cpu_per_request_warmfleet_over_sglang"]
    summary["added_latency_at_half_rate"] = res["added_latency_at_half_rate"]
    summary["targets"] = res["targets"]
    progress(f"{summary}; ratios {[(k, v) for k, v in res.items() if k.startswith('ratio_')]}")
    print(json.dumps(res) if args.json else json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
