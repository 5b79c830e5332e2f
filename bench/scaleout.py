"""Scale-out, scale-in and rolling update under steady load: warm-up on vs off vs a queue-only policy.

    python -P bench/scaleout.py [--quick] [--json] [--out DIR] [--configs warmfleet,nowarm,rr]
                                [--window-s S] [--rate R] [--replicas N]

A fleet of simulated replicas (bench/simfleet.py: the engine's own scheduler and KV manager, the
calibrated time model run 10x faster, real HTTP and KV events) behind the real `warmfleet route`
takes an open-loop synthetic multi-turn load (token-id prompts: tenants' system prompts, Zipf;
conversations of 3-8 turns that end and are replaced; a hot shared prefix on 30% of requests).
After a warm-in, one run is:

    steady window | scale-out: a spare replica starts cold | window | scale-in: one replica goes
    | window | rolling update: every replica replaced one by one (a fresh, cold one on its address) | window

Scale-in and each rolling step go as in Kubernetes with the router's drain: the router is told
the replica is going (`POST /v1/router/replicas/{id}/drain`, what a terminating EndpointSlice
endpoint does), a preStop-like pause, then the replica gets SIGTERM-like termination (no new
connections, in-flight requests finish); a replaced replica's drain ends when its successor is up.

Configs: `warmfleet` (warm-up and drain), `nowarm` (`--no-warmup`: drain, but joiners take traffic
cold), `rr` (queue-only: client-side round-robin over the live replicas, no cache affinity, no
warm-up; a leaving replica is out of the rotation at once).

Reported per config and window (`--window-s`, 120 s full, 10 s with --quick): cached-token ratio,
TTFT p90 (model seconds from the simulator, and wall-clock through the router), client errors;
the joiner's first 100 requests' cached ratio; for warm-up configs, how many normal requests reached
the joiner before its last warm-up replay (0 = not routable until warm). Targets (warmfleet):
joiner's first 100 >= 0.8 x steady cached ratio; TTFT p90 (model) after scale-out <= 1.1 x before;
zero client errors on scale-in and on the rolling update. Writes scaleout.json and scaleout.png to
--out. Progress goes to stderr; with --json the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
BLOCK = 16
SPEEDUP = 10.0  # the calibrated engine x10, as bench/trace.py
PRESTOP_S = 1.0  # time between the router's drain notice and the replica's SIGTERM (a preStop sleep)


def progress(msg: str) -> None:
    print(f"[scaleout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


trace = _load("wf_bench_trace_scaleout", HERE / "trace.py")


# --- workload ---------------------------------------------------------------------------------
class Workload:
    """Endless seeded requests: token-id prompts with shared system prompts, growing conversations, a hot prefix."""

    def __init__(self, seed: int, tenants: int = 8, conversations: int = 48):
        self.rng = random.Random(seed)
        self.systems = [self.ids(256) for _ in range(tenants)]
        self.hot = self.ids(320)
        self.zipf = [1 / (i + 1) for i in range(tenants)]
        self.convs = [self.new_conv() for _ in range(conversations)]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 1014) for _ in range(n)]

    def new_conv(self) -> dict:
        t = self.rng.choices(range(len(self.systems)), self.zipf)[0]
        return {"hist": list(self.systems[t]), "turns_left": self.rng.randint(3, 8), "tenant": t}

    def next(self) -> tuple[list[int], str]:
        """(prompt ids, cache salt)"""
        if self.rng.random() < 0.3:
            return self.hot + self.ids(16), "hot"
        k = self.rng.randrange(len(self.convs))
        c = self.convs[k]
        c["hist"] += self.ids(32)
        prompt = list(c["hist"])
        c["hist"] += self.ids(16)  # the answer joins the history
        c["turns_left"] -= 1
        if c["turns_left"] == 0:
            self.convs[k] = self.new_conv()
        return prompt, f"tenant-{c['tenant']}"


# --- processes ----------------------------------------------------------------------------------
def start_sim(model: Path, n: int, spares: int, gpu_blocks: int, cwd: str):
    ready = Path(cwd) / f"sim-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-P", str(HERE / "simfleet.py"), "--model", str(model), "--replicas", str(n),
           "--spares", str(spares), "--block-size", str(BLOCK), "--gpu-blocks", str(gpu_blocks),
           "--time-model", "calibrated", "--engine-speedup", str(SPEEDUP), "--ready-file", str(ready)]
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=open(Path(cwd) / "sim.log", "ab"))
    trace.wait_for(ready.exists, "simulated fleet", p, 120)
    return p, json.loads(ready.read_text())


def start_router(model: Path, sim: dict, extra: list[str], cwd: str):
    import httpx

    port = trace.free_port()
    cmd, env = trace.router_command("warmfleet", model, sim, port, BLOCK, extra)
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=open(Path(cwd) / "router.log", "ab"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    serving = {r["url"] for r in sim["replicas"] if r["state"] == "serving"}

    def synced() -> bool:
        view = httpx.get(base + "/v1/router/replicas", timeout=5).json()["replicas"]
        return all(r["healthy"] and r["synced"] for r in view if r["id"] in serving)

    trace.wait_for(synced, "router in sync", p, 120)
    return base, p


# --- driving ------------------------------------------------------------------------------------
class Run:
    """One config's run: load generator, fleet events, records."""

    def __init__(self, config: str, sim: dict, router: str | None, rate: float, seed: int):
        self.config, self.sim, self.router, self.rate = config, sim, router, rate
        self.control = sim["control"]
        self.urls = {r["id"]: r["url"] for r in sim["replicas"]}
        self.live = [r["id"] for r in sim["replicas"] if r["state"] == "serving"]  # rr's rotation
        self.spare = next(r["id"] for r in sim["replicas"] if r["state"] == "standby")
        self.work = Workload(seed)
        self.rec: list[dict] = []
        self.events: list[dict] = []
        self.t0 = time.perf_counter()
        self._rr = 0
        self.stop = False

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, name: str, **extra) -> None:
        # monotonic: the same clock as the simulator's log (CLOCK_MONOTONIC is system-wide)
        self.events.append({"event": name, "t": round(self.now(), 3), "monotonic": time.monotonic(), **extra})
        progress(f"{self.config}: {name} at {self.now():.1f} s {extra or ''}")

    async def one(self, session, i: int) -> None:
        import aiohttp

        prompt, salt = self.work.next()
        if self.router:
            base = self.router
        else:
            base = self.urls[self.live[self._rr % len(self.live)]]
            self._rr += 1
        body = {"model": "bench", "prompt": prompt, "max_tokens": 8, "stream": True, "cache_salt": salt,
                "stream_options": {"include_usage": True}, "user": f"r{i}"}
        t = self.now()
        ttft, cached, nprompt, replica, err = None, None, None, None, None
        try:
            async with session.post(base + "/v1/completions", json=body) as resp:
                replica = resp.headers.get("x-warmfleet-replica")
                if resp.status != 200:
                    err = f"HTTP {resp.status}"
                    await resp.read()
                else:
                    buf = b""
                    async for chunk in resp.content.iter_any():
                        if ttft is None:
                            ttft = self.now() - t
                        buf += chunk
                    for line in buf.split(b"\n"):
                        if line.startswith(b"data: {"):
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                err = "stream error"
                            if ev.get("usage"):
                                nprompt = ev["usage"]["prompt_tokens"]
                                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if nprompt is None and err is None:
                        err = "no usage"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            err = type(exc).__name__
        self.rec.append({"tag": f"r{i}", "t": round(t, 4), "replica": replica, "ttft_client_s": ttft,
                         "cached": cached, "prompt": nprompt, "error": err})

    async def load(self) -> None:
        import aiohttp

        rng = random.Random(1)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks, i = [], 0
            while not self.stop:
                tasks.append(asyncio.create_task(self.one(session, i)))
                i += 1
                await asyncio.sleep(rng.expovariate(self.rate))
            await asyncio.gather(*tasks)

    # fleet events: the simulator's control port and the router's admin route
    async def sim_call(self, client, what: str, rid: str) -> None:
        r = await client.post(self.control + what, json={"replica": rid})
        r.raise_for_status()

    async def sim_state(self, client, rid: str) -> str:
        stats = (await client.get(self.control + "/sim/stats")).json()
        return next(r["state"] for r in stats["replicas"] if r["id"] == rid)

    async def router_view(self, client) -> dict:
        return {r["id"]: r for r in (await client.get(self.router + "/v1/router/replicas")).json()["replicas"]}

    async def wait_routable(self, client, rid: str, timeout_s: float = 60) -> None:
        if not self.router:
            return
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            st = (await self.router_view(client))[self.urls[rid]]
            if st["state"] == "ready" and st["synced"]:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{rid} not routable after {timeout_s} s")

    async def drain(self, client, rid: str, on: bool) -> None:
        """The router's drain notice (or, for rr, the rotation without it), and the bench's own membership."""
        if self.router:
            path = f"{self.router}/v1/router/replicas/{quote(self.urls[rid], safe='')}/drain"
            r = await (client.post(path) if on else client.delete(path))
            r.raise_for_status()
        if on and rid in self.live:
            self.live.remove(rid)
        elif not on and rid not in self.live:
            self.live.append(rid)

    async def terminate(self, client, rid: str) -> None:
        """Drain notice, preStop pause, SIGTERM; returns when the replica has stopped."""
        await self.drain(client, rid, True)
        await asyncio.sleep(PRESTOP_S)
        await self.sim_call(client, "/sim/terminate", rid)
        while await self.sim_state(client, rid) != "stopped":
            await asyncio.sleep(0.05)

    async def script(self, warm_in_s: float, window_s: float) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.sleep(warm_in_s)
            self.mark("steady")
            await asyncio.sleep(window_s)
            self.mark("scale_out", replica=self.spare)
            await self.sim_call(client, "/sim/start", self.spare)
            self.live.append(self.spare)
            await asyncio.sleep(window_s)
            victim = self.live[0]
            self.mark("scale_in", replica=victim)
            await self.terminate(client, victim)
            await asyncio.sleep(window_s)
            self.mark("rolling_update")
            for rid in list(self.live):
                await self.terminate(client, rid)
                await self.sim_call(client, "/sim/start", rid)  # its successor, cold, on the same address
                await self.drain(client, rid, False)
                await self.wait_routable(client, rid)
            self.mark("rolling_done")
            await asyncio.sleep(window_s)
            self.mark("end")
        self.stop = True

    async def go(self, warm_in_s: float, window_s: float) -> None:
        await asyncio.gather(self.load(), self.script(warm_in_s, window_s))


# --- figures ------------------------------------------------------------------------------------
def quantile(xs: list[float], p: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))], 4) if xs else None


def window(rec: list[dict], t0: float, t1: float) -> dict:
    rows = [r for r in rec if t0 <= r["t"] < t1]
    ok = [r for r in rows if not r["error"]]
    prompt = sum(r["prompt"] for r in ok)
    return {"requests": len(rows), "errors": len(rows) - len(ok),
            "error_kinds": sorted({r["error"] for r in rows if r["error"]}),
            "cached_ratio": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
            "ttft_p90_model_s": quantile([r.get("ttft_model_s") for r in ok], 0.9),
            "ttft_p90_client_s": quantile([r["ttft_client_s"] for r in ok], 0.9),
            "from_s": round(t0, 2), "to_s": round(t1, 2)}


def summarize(run: Run, simlog: list[dict], window_s: float) -> dict:
    by_tag = {x["tag"]: x for x in simlog if x["tag"]}
    for r in run.rec:
        x = by_tag.get(r["tag"])
        r["ttft_model_s"] = x["ttft_model_s"] if x else None
    ev = {e["event"]: e["t"] for e in run.events}
    wins = {"steady": window(run.rec, ev["steady"], ev["scale_out"]),
            "scale_out": window(run.rec, ev["scale_out"], ev["scale_out"] + window_s),
            "scale_in": window(run.rec, ev["scale_in"], ev["scale_in"] + window_s),
            "rolling_update": window(run.rec, ev["rolling_update"], ev["end"])}
    joiner = [r for r in sorted(run.rec, key=lambda r: r["t"]) if r["replica"] == run.spare and not r["error"]][:100]
    jp = sum(r["prompt"] for r in joiner)
    # warm-up gating, from the joiner's own log: normal requests that arrived before its last warm-up
    # replay (replays are untagged; those after the scale-in are hand-offs from the leaving replica)
    mono = {e["event"]: e["monotonic"] for e in run.events}
    jlog = [x for x in simlog if x["replica"] == run.spare and x["gen"] == 0]  # before the rolling update
    replays = [x["arrival"] for x in jlog if not x["tag"] and x["arrival"] < mono["scale_in"]]
    normal = [x["arrival"] for x in jlog if x["tag"]]
    early = sum(1 for a in normal if replays and a < max(replays))
    return {"windows": wins, "events": run.events,
            "joiner": {"replica": run.spare, "first_requests": len(joiner),
                       "cached_ratio_first_100": round(sum(r["cached"] for r in joiner) / jp, 4) if jp else None,
                       "warmup_replays": len(replays), "normal_requests_before_last_replay": early},
            "total_requests": len(run.rec), "total_errors": sum(1 for r in run.rec if r["error"])}


def verdict(res: dict) -> dict:
    wf = res.get("warmfleet")
    if not wf:
        return {}
    w = wf["windows"]
    steady = w["steady"]["cached_ratio"] or 0
    joiner = wf["joiner"]["cached_ratio_first_100"] or 0
    before, after = w["steady"]["ttft_p90_model_s"], w["scale_out"]["ttft_p90_model_s"]
    return {"joiner_first_100_ratio_ge_0.8x_steady": joiner >= 0.8 * steady,
            "ttft_p90_after_scale_out_le_1.1x_before": bool(before and after and after <= 1.1 * before),
            "zero_errors_scale_in": w["scale_in"]["errors"] == 0,
            "zero_errors_rolling_update": w["rolling_update"]["errors"] == 0,
            "joiner_not_routed_before_warm": wf["joiner"]["normal_requests_before_last_replay"] == 0}


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in res if isinstance(res[n], dict) and "windows" in res[n]]
    wins = ["steady", "scale_out", "scale_in", "rolling_update"]
    colors = {"warmfleet": "#2e9e5b", "nowarm": "#4a7ebb", "rr": "#999999"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    width = 0.8 / max(1, len(names))
    for k, n in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(wins))]
        w = res[n]["windows"]
        c = colors.get(n, "#555555")
        axes[0].bar(xs, [w[x]["cached_ratio"] or 0 for x in wins], width, color=c, label=n)
        axes[1].bar(xs, [w[x]["ttft_p90_model_s"] or 0 for x in wins], width, color=c, label=n)
        axes[2].bar([k], [res[n]["joiner"]["cached_ratio_first_100"] or 0], 0.6, color=c, label=n)
        axes[2].hlines(0.8 * (w["steady"]["cached_ratio"] or 0), k - 0.3, k + 0.3, colors="k", linestyles="--")
    for ax, title in ((axes[0], "cached-token ratio per window"), (axes[1], "TTFT p90 per window (model s)")):
        ax.set_xticks(range(len(wins)), wins, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="lower left")
    axes[2].set_xticks(range(len(names)), names, fontsize=8)
    axes[2].set_title("joiner's first 100 requests: cached ratio (-- 0.8 x steady)", fontsize=9)
    fig.suptitle(f"scale-out / scale-in / rolling update under load: {res['replicas']} simulated replicas, "
                 f"{res['rate']} req/s, windows of {res['window_s']} s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------
CONFIG_FLAGS = {"warmfleet": [], "nowarm": ["--no-warmup"], "rr": None}


def run_config(config: str, model: Path, n: int, rate: float, warm_in_s: float, window_s: float,
               gpu_blocks: int, cwd: str, seed: int = 0, router_extra: list[str] = ()) -> dict:
    import httpx

    sim_p, sim = start_sim(model, n, 1, gpu_blocks, cwd)
    router_p = None
    try:
        router = None
        if CONFIG_FLAGS[config] is not None:
            router, router_p = start_router(model, sim, [*CONFIG_FLAGS[config], *router_extra], cwd)
        run = Run(config, sim, router, rate, seed)
        asyncio.run(run.go(warm_in_s, window_s))
        simlog = httpx.get(sim["control"] + "/sim/log", timeout=60).json()
        out = summarize(run, simlog, window_s)
        if router:
            out["router_replicas"] = httpx.get(router + "/v1/router/replicas", timeout=10).json()["replicas"]
        return out
    finally:
        trace.stop(router_p)
        trace.stop(sim_p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 s windows, 5 s warm-up budget (under 4 minutes in all).")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--configs", default="warmfleet,nowarm,rr")
    ap.add_argument("--window-s", type=float, default=None, help="Window after each event (120 s; --quick 10 s).")
    ap.add_argument("--rate", type=float, default=16.0, help="Requests per second (open loop).")
    ap.add_argument("--replicas", type=int, default=4, help="Replicas before the scale-out.")
    ap.add_argument("--gpu-blocks", type=int, default=512, help="KV pool per replica, blocks of 16 tokens.")
    args = ap.parse_args(argv)
    window_s = args.window_s or (8.0 if args.quick else 120.0)
    warm_in_s = min(30.0, max(5.0, window_s / 2))
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIG_FLAGS]
    if unknown:
        ap.error(f"unknown configs {unknown}: choose from {sorted(CONFIG_FLAGS)}")
    model = trace.tiny_model()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    router_extra = ["--warmup-budget-s", "5"] if args.quick else []
    res: dict = {"router_flags": router_extra, "replicas": args.replicas, "rate": args.rate, "window_s": window_s, "warm_in_s": warm_in_s,
                 "gpu_blocks": args.gpu_blocks, "engine_speedup": SPEEDUP, "prestop_s": PRESTOP_S,
                 "loadavg_1m": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="scaleout-") as cwd:
        for c in configs:
            progress(f"config {c}")
            res[c] = run_config(c, model, args.replicas, args.rate, warm_in_s, window_s, args.gpu_blocks, cwd,
                                router_extra=router_extra)
            w = res[c]["windows"]
            progress(f"{c}: " + ", ".join(f"{k} ratio {v['cached_ratio']} p90 {v['ttft_p90_model_s']} err {v['errors']}"
                                          for k, v in w.items()) + f"; joiner {res[c]['joiner']}")
    res["targets"] = verdict(res)
    (out_dir / "scaleout.json").write_text(json.dumps(res, indent=1))
    chart(res, out_dir / "scaleout.png")
    progress(f"wrote {out_dir / 'scaleout.json'} and scaleout.png; targets {res['targets']}")
    if args.json:
        slim = {k: v for k, v in res.items() if not isinstance(v, dict) or "windows" not in v}
        for c in configs:
            slim[c] = {k: v for k, v in res[c].items() if k != "router_replicas"}
        print(json.dumps(slim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
