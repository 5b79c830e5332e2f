"""Router CPU per request, this checkout against an earlier commit, side by side at fixed request rates.

    python -P bench/router_cpu_ab.py --baseline COMMIT [--rates 800,1600] [--rounds 3] [--duration 5]
                                     [--body completion|chat|unique] [--replicas 8] [--json]

Both routers (`warmfleet route`, the baseline's code from `git archive COMMIT` on PYTHONPATH) run at
once against one `bench/simfleet.py` (--replicas, default 8; zero time model) with the setup and pinning of
`bench/router_throughput.py` (router core 0; simulator and hey core 1); at each rate they are
measured in turn, `--rounds` times, and the median CPU ms per request (utime + stime of the
router's process tree over the run / requests answered) is reported for each. CPU per request is
the figure that survives a machine shared with other work; latency is reported, not judged.
Bodies: router_throughput's 96-token text completions, or with `--body chat` its multi-turn chats
on one shared system prompt (/v1/chat/completions: template render, tokenize, hash, choose), or with
`--body unique` completions whose every prompt is new (vegeta; each router gets its own new prompts).
Writes router_cpu_ab.json and router_cpu_ab.png in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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


def checkout(commit: str, dest: Path) -> Path:
    """The package of `commit` laid out as installed (warmfleet/, warmfleet/server, warmfleet/operator) in `dest`."""
    repo = HERE.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "warmfleet", "server", "operator"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "server").rename(dest / "warmfleet" / "server")
    (dest / "warmfleet" / "operator").mkdir(exist_ok=True)
    for part in (dest / "operator").iterdir():  # the operator's rooms (an older commit: its flat modules)
        part.rename(dest / "warmfleet" / "operator" / part.name)
    return dest


def start(name: str, pythonpath: str | None, model: Path, desc: dict, cwd: str) -> tuple:
    old = os.environ.pop("PYTHONPATH", None)
    try:
        if pythonpath:  # a plain directory on PYTHONPATH is found before the editable install's finder
            os.environ["PYTHONPATH"] = pythonpath
        return replay_fleet.start_router("warmfleet", model, desc, 16, cwd, [], taskset="0")
    finally:
        os.environ.pop("PYTHONPATH", None)
        if old is not None:
            os.environ["PYTHONPATH"] = old


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = res["rates"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, color) in enumerate((("baseline", "#999999"), ("head", "#2e9e5b"))):
        med = [res["routers"][name]["median_cpu_ms_per_request"][str(r)] for r in rates]
        ax.bar([k + (i - 0.5) * 0.4 for k in range(len(rates))], med, 0.4, color=color,
               label=f"{name} ({res['routers'][name]['code']})")
    ax.set_xticks(range(len(rates)), [f"{r:g}/s" for r in rates])
    ax.set_ylabel("router CPU ms per request (median of rounds)")
    ax.set_title(f"one router process, {res['rounds']} interleaved rounds per rate", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="Commit whose router is compared with this checkout's.")
    ap.add_argument("--rates", default="800,1600")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--body", choices=("completion", "chat", "unique"), default="completion",
                    help="unique: completions whose every prompt is new (router_throughput.UniqueBodies, vegeta)")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    from warmfleet.server.tokenizer import Tokenizer

    model = replay_workload.tiny_model()
    send = rt.load_sender(args.body, replay_workload.Words(Tokenizer(str(model)), 16), "1", 16)
    path = "/v1/chat/completions" if args.body == "chat" else "/v1/completions"
    rates = [float(x) for x in args.rates.split(",")]
    cwd = tempfile.mkdtemp(prefix="wf-cpu-ab-")
    base_dir = checkout(args.baseline, Path(tempfile.mkdtemp(prefix="wf-baseline-")))
    head = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    sim, desc = harness.start_simfleet(model, cwd, ["--replicas", str(args.replicas), "--time-model", "zero",
                                                    "--gpu-blocks", "4096"], taskset="1", timeout_s=60)
    routers: dict = {}
    runs: dict = {"baseline": {}, "head": {}}
    try:
        routers["baseline"] = start("baseline", str(base_dir), model, desc, cwd)
        routers["head"] = start("head", None, model, desc, cwd)
        for rnd in range(args.rounds):
            for rate in rates:
                for name, (base, proc) in routers.items():
                    send(base + path, rate, 1.0)  # warm
                    c0 = harness.tree_cpu_s(proc.pid)
                    r = send(base + path, rate, args.duration)
                    r["router_cpu_ms_per_request"] = round((harness.tree_cpu_s(proc.pid) - c0)
                                                           / max(1, r["requests"]) * 1e3, 3)
                    r["loadavg_1m"] = os.getloadavg()[0]
                    runs[name].setdefault(str(rate), []).append(r)
                    rt.progress(f"round {rnd} {name} @ {rate:g}/s: {r}")
    finally:
        for _, p in routers.values():
            harness.stop(p)
        harness.stop(sim)
        shutil.rmtree(cwd, ignore_errors=True)
        shutil.rmtree(base_dir, ignore_errors=True)
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv), "body": args.body, "replicas": args.replicas,
           "rates": rates, "rounds": args.rounds,
           "duration_s": args.duration, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "routers": {}}
    for name, code in (("baseline", args.baseline), ("head", head)):
        res["routers"][name] = {
            "code": code,
            "median_cpu_ms_per_request": {k: statistics.median(x["router_cpu_ms_per_request"] for x in v)
                                          for k, v in runs[name].items()},
            "runs": runs[name]}
    res["head_over_baseline_cpu"] = {k: round(res["routers"]["head"]["median_cpu_ms_per_request"][k] / b, 3)
                                     for k, b in res["routers"]["baseline"]["median_cpu_ms_per_request"].items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_cpu_ab.json").write_text(json.dumps(res, indent=1))
    chart(res, out / "router_cpu_ab.png")
    summary = {"median_cpu_ms_per_request": {n: r["median_cpu_ms_per_request"] for n, r in res["routers"].items()},
               "head_over_baseline_cpu": res["head_over_baseline_cpu"]}
    print(json.dumps(res) if args.json else json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
