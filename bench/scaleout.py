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

`--autoscale` (with --quick about 3 minutes): no fixed events; the load steps low -> high -> low
(--rate-low, --rate-high) and the operator's real autoscaler sets the replicas in the loop: every
scrape interval `autoscale_pass.scrape` of the router, `make_sample`, `decide` (operator/autoscale_policy.py,
unchanged), then /sim/start or drain + terminate. Two autoscalers, each with its own fleet and router:
`cache_aware` (targetQueuedPrefillTokens, hit-ratio protection, warm-up, scale-in of the replica with
the fewest cached blocks, as pod-deletion-cost does) and `queue_only` (HPA-like: the same `decide`
fed in-flight requests instead of queued tokens, so desired = ceil(requests / target); no hit-ratio
protection, `--no-warmup`, the youngest replica goes first). Reported per autoscaler: scale events,
cached-token ratio, TTFT p90 (model s) and client errors per phase and overall, replica-seconds,
the decisions; targets: cache_aware has zero client errors, scaled out and in, and a cached ratio
>= queue_only's. Writes scaleout-autoscale.json and scaleout-autoscale.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from warmfleet.localprocs import free_port

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent
BLOCK = 16
SPEEDUP = 10.0  # the calibrated engine x10, as bench/trace_replay.py
PRESTOP_S = 1.0  # time between the router's drain notice and the replica's SIGTERM (a preStop sleep)


progress = harness.reporter("scaleout")


replay_fleet = harness.sibling("replay_fleet")
replay_runners = harness.sibling("replay_runners")
replay_workload = harness.sibling("replay_workload")


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
    replay_fleet.wait_for(ready.exists, "simulated fleet", p, 120)
    return p, json.loads(ready.read_text())


def start_router(model: Path, sim: dict, extra: list[str], cwd: str):
    """warmfleet's router in front of `sim` (as bench/trace_replay.py runs it), up once in sync with the serving replicas."""
    port = free_port()
    cmd, env = replay_fleet.router_command("warmfleet", model, sim, port, BLOCK, extra)
    serving = {r["url"] for r in sim["replicas"] if r["state"] == "serving"}
    return harness.start_router("warmfleet", cmd, port, cwd, env=env, log="router.log", health_s=None,
                                synced=functools.partial(harness.in_sync, ids=serving))


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
        prompt, salt = self.work.next()
        if self.router:
            base = self.router
        else:
            base = self.urls[self.live[self._rr % len(self.live)]]
            self._rr += 1
        body = {"model": "bench", "prompt": prompt, "max_tokens": 8, "stream": True, "cache_salt": salt,
                "stream_options": {"include_usage": True}, "user": f"r{i}"}
        t = self.now()
        res = await replay_runners.stream_completion(session, base + "/v1/completions", body)
        if res["prompt"] is None and res["error"] is None:
            res["error"] = "no usage"
        self.rec.append({"tag": f"r{i}", "t": round(t, 4), "replica": res["replica"],
                         "ttft_client_s": res["ttft_client_s"], "cached": res["cached"], "prompt": res["prompt"],
                         "error": res["error"], "route": res["route"]})

    def rate_at(self, t: float) -> float:
        return self.rate

    async def load(self) -> None:
        import aiohttp

        rng = random.Random(1)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks, i = [], 0
            while not self.stop:
                tasks.append(asyncio.create_task(self.one(session, i)))
                i += 1
                await asyncio.sleep(rng.expovariate(self.rate_at(self.now())))
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
quantile = harness.quantile


def window(rec: list[dict], t0: float, t1: float) -> dict:
    rows = [r for r in rec if t0 <= r["t"] < t1]
    ok = [r for r in rows if not r["error"]]
    prompt = sum(r["prompt"] for r in ok)
    reasons: dict[str, int] = {}  # the router's decision reasons (x-warmfleet-route): spills show as load_spill
    for r in ok:
        if r.get("route"):
            reason = r["route"].split(";")[0]
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"requests": len(rows), "errors": len(rows) - len(ok), "reasons": reasons,
            "error_kinds": sorted({r["error"] for r in rows if r["error"]}),
            "cached_ratio": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
            "ttft_p90_model_s": quantile([r.get("ttft_model_s") for r in ok], 0.9),
            "ttft_p90_client_s": quantile([r["ttft_client_s"] for r in ok], 0.9),
            "from_s": round(t0, 2), "to_s": round(t1, 2)}


def served(rec: list[dict], t0: float, t1: float) -> list[dict]:
    """The requests that arrived in [t0, t1) and were answered."""
    return [r for r in rec if t0 <= r["t"] < t1 and not r["error"]]


def tail_of(ok: list[dict], p90: float | None, joiner: str) -> dict:
    """A window's answered requests at or over its TTFT p90 (model): how many went to the joiner, their decision
    reasons, and their cached share of the prompt (a cold prefill or a queue behind one)."""
    rows = [r for r in ok if p90 is not None and (r.get("ttft_model_s") or 0) >= p90]
    reasons: dict[str, int] = {}
    for r in rows:
        reason = (r.get("route") or "none").split(";")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    prompt = sum(r["prompt"] for r in rows)
    return {"requests": len(rows), "on_joiner": sum(1 for r in rows if r["replica"] == joiner), "reasons": reasons,
            "cached_ratio": round(sum(r["cached"] for r in rows) / prompt, 4) if prompt else None,
            "mean_prompt_tokens": round(prompt / len(rows)) if rows else None}


def summarize(run: Run, simlog: list[dict], window_s: float) -> dict:
    by_tag = {x["tag"]: x for x in simlog if x["tag"]}
    for r in run.rec:
        x = by_tag.get(r["tag"])
        r["ttft_model_s"] = x["ttft_model_s"] if x else None
    ev = {e["event"]: e["t"] for e in run.events}
    bounds = {"steady": (ev["steady"], ev["scale_out"]), "scale_out": (ev["scale_out"], ev["scale_out"] + window_s),
              "scale_in": (ev["scale_in"], ev["scale_in"] + window_s), "rolling_update": (ev["rolling_update"], ev["end"])}
    wins = {name: window(run.rec, t0, t1) for name, (t0, t1) in bounds.items()}
    ttfts = {}
    for name in ("steady", "scale_out"):  # where each window's TTFT tail is: the requests at or over its p90
        ok = served(run.rec, *bounds[name])
        wins[name]["tail"] = tail_of(ok, wins[name]["ttft_p90_model_s"], run.spare)
        ttfts[name] = [r["ttft_model_s"] for r in ok if r["ttft_model_s"]]
    wins["scale_out"]["ttft_p90_over_steady_ci90"] = harness.quantile_ratio_interval(
        ttfts["steady"], ttfts["scale_out"], 0.9)
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


# --- autoscaling in the loop (--autoscale) ------------------------------------------------------
IN_FLIGHT = "warmfleet_router_replica_in_flight"
# variant -> router flags, the figure fed to the real `decide` as its queue, hit-ratio protection, scale-in choice
AUTOSCALERS = {
    "cache_aware": {"router": [], "metric": "queued_prefill_tokens", "protect_hit_ratio": True, "victim": "coldest"},
    "queue_only": {"router": ["--no-warmup"], "metric": "in_flight_requests", "protect_hit_ratio": False,
                   "victim": "newest"},
}


def in_flight(text: str) -> float:
    """Requests the router has open, all replicas: the queue-length-only autoscaler's metric."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(max(0.0, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == IN_FLIGHT)


def autoscaling_cfg(variant: str, lo: int, hi: int, target: float, window_s: int, up_s: int, down_s: int):
    """The operator's own spec.autoscaling: queued prefill tokens for cache_aware, the same field fed with
    in-flight requests (HPA-like: desired = ceil(requests / target)) for queue_only."""
    from warmfleet.operator.spec.inference_service import Autoscaling

    return Autoscaling(min_replicas=lo, max_replicas=hi, target_queued_prefill_tokens=max(1, round(target)),
                       protect_hit_ratio=AUTOSCALERS[variant]["protect_hit_ratio"], metrics_window_seconds=window_s,
                       scale_up_stabilization_seconds=up_s, scale_down_stabilization_seconds=down_s)


class AutoRun(Run):
    """One autoscaler's run: a load that steps up and down; the real operator's scrape and `decide` set the replicas."""

    def __init__(self, variant: str, sim: dict, router: str, phases: list[tuple[str, float, float]], seed: int,
                 cfg, interval_s: float):
        super().__init__(variant, sim, router, phases[0][1], seed)
        self.variant, self.phases, self.cfg, self.interval_s = variant, phases, cfg, interval_s
        self.slots = [r["id"] for r in sim["replicas"]]
        self.started = {rid: 0.0 for rid in self.live}  # when each serving replica started (newest goes first for HPA)
        self.drained: set[str] = set()  # slots the router was told are going (until a new pod starts there)
        self.leaving: set[str] = set()  # slots draining or finishing their in-flight requests
        self.timeline: list[tuple[float, int]] = [(0.0, len(self.live))]  # replicas running (serving or finishing)
        self.running = len(self.live)
        self.decisions: list[dict] = []
        self.busy: set[asyncio.Task] = set()

    def rate_at(self, t: float) -> float:
        end = 0.0
        for _, rate, secs in self.phases:
            end += secs
            if t < end:
                return rate
        return self.phases[-1][1]

    def _count(self, d: int) -> None:
        self.running += d
        self.timeline.append((round(self.now(), 3), self.running))

    async def scale_out(self, client, rid: str) -> None:
        self.mark("scale_out", replica=rid)
        await self.sim_call(client, "/sim/start", rid)
        self._count(+1)
        if rid in self.drained:  # a slot scaled in before: a new pod on its address, the drain notice ends
            self.drained.discard(rid)
            await self.drain(client, rid, False)
        elif rid not in self.live:
            self.live.append(rid)
        self.started[rid] = self.now()

    async def scale_in(self, client, rid: str) -> None:
        self.mark("scale_in", replica=rid)
        self.drained.add(rid)
        self.leaving.add(rid)
        try:
            await self.terminate(client, rid)
        finally:
            self.leaving.discard(rid)
        self._count(-1)

    def victims(self, views: list[dict], k: int) -> list[str]:
        if AUTOSCALERS[self.variant]["victim"] == "coldest":  # pod-deletion-cost: fewest cached blocks go first
            blocks = {r["id"]: int(r.get("gpu_blocks") or 0) + int(r.get("cpu_blocks") or 0)
                      for v in views for r in v.get("replicas") or []}
            order = sorted(self.live, key=lambda rid: (blocks.get(self.urls[rid], 0), rid))
        else:  # the ReplicaSet's default among equals: the youngest pod
            order = sorted(self.live, key=lambda rid: -self.started.get(rid, 0.0))
        return order[:k]

    async def autoscale_loop(self) -> None:
        import httpx

        from warmfleet.operator.passes import autoscale_pass
        from warmfleet.operator.planning import autoscale_policy as a

        hist = a.History()
        cfg = self.cfg
        metric = AUTOSCALERS[self.variant]["metric"]
        await asyncio.sleep(self.phases[0][2])  # the warm-in: caches fill before the autoscaler watches
        async with httpx.AsyncClient(timeout=30) as client:
            while not self.stop:
                t = time.monotonic()
                metrics, views, errors = await autoscale_pass.scrape(client, [self.router])
                n = in_flight((await client.get(self.router + "/metrics")).text) if metrics else None
                raw = {"queued_tokens": sum(m["queued"] for m in metrics.values()) if metrics else None, "in_flight": n}
                if metric == "in_flight_requests" and metrics:
                    metrics = {u: {**m, "queued": n} for u, m in metrics.items()}
                sample = a.make_sample(t, metrics)
                if sample is not None:
                    hist.samples.append(sample)
                hist.keep(t, cfg.metrics_window_seconds + max(cfg.scale_up_stabilization_seconds,
                                                              cfg.scale_down_stabilization_seconds))
                cur = len(self.live)
                d = a.decide(current={"pool": cur}, capacities={"pool": len(self.slots)}, cfg=cfg,
                             samples=hist.samples, recommendations=hist.recommendations, now=t)
                hist.recommendations.append((t, d.recommendation))
                self.decisions.append({"t": round(self.now(), 2), "current": cur, "desired": d.total, "reason": d.reason,
                                       "queue": round(sample.queued_tokens, 1) if sample else None, **raw})
                if d.total > cur:
                    idle = [rid for rid in self.slots if rid not in self.live and rid not in self.leaving]
                    for rid in idle[:d.total - cur]:
                        await self.scale_out(client, rid)
                    progress(f"{self.variant}: {d.reason} {cur} -> {d.total} ({d.message})")
                elif d.total < cur:
                    for rid in self.victims(views, cur - d.total):
                        self.live.remove(rid)  # out of the count at once; its drain runs beside the loop
                        task = asyncio.create_task(self.scale_in(client, rid))
                        self.busy.add(task)
                        task.add_done_callback(self.busy.discard)
                    progress(f"{self.variant}: {d.reason} {cur} -> {d.total} ({d.message})")
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - t)))
            await asyncio.gather(*list(self.busy))

    async def script(self, *_args) -> None:
        for name, rate, secs in self.phases:
            self.mark(name, rate=rate)
            await asyncio.sleep(secs)
        self.mark("end")
        self.stop = True

    async def go(self, *_args) -> None:
        await asyncio.gather(self.load(), self.script(), self.autoscale_loop())


def replica_seconds(timeline: list[tuple[float, int]], end: float) -> float:
    pts = [*timeline, (end, timeline[-1][1])]
    return round(sum((t1 - t0) * n for (t0, n), (t1, _) in zip(pts, pts[1:]) if t1 > t0), 1)


def summarize_auto(run: AutoRun, simlog: list[dict]) -> dict:
    by_tag = {x["tag"]: x for x in simlog if x["tag"]}
    for r in run.rec:
        x = by_tag.get(r["tag"])
        r["ttft_model_s"] = x["ttft_model_s"] if x else None
    ev = [e for e in run.events if e["event"] in {p[0] for p in run.phases[1:]} | {"end"}]
    phases = {a["event"]: window(run.rec, a["t"], b["t"]) for a, b in zip(ev, ev[1:])}
    start, end = ev[0]["t"], ev[-1]["t"]  # after the warm-in
    outs = [e for e in run.events if e["event"] == "scale_out"]
    ins = [e for e in run.events if e["event"] == "scale_in"]
    reasons: dict[str, int] = {}
    for d in run.decisions:
        reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
    timeline = [(max(t, start), n) for t, n in run.timeline]
    return {"all": window(run.rec, start, end + 1e9), "phases": phases,
            "scale_events": len(outs) + len(ins), "scale_outs": len(outs), "scale_ins": len(ins),
            "max_replicas": max(n for _, n in run.timeline), "replica_seconds": replica_seconds(timeline, end),
            "timeline": run.timeline, "decision_reasons": reasons, "decisions": run.decisions,
            "scale_events_at": [{"event": e["event"], "t": e["t"], "replica": e.get("replica")} for e in outs + ins],
            "total_requests": len(run.rec), "total_errors": sum(1 for r in run.rec if r["error"])}


def run_autoscale(variant: str, model: Path, lo: int, hi: int, phases: list[tuple[str, float, float]], target: float,
                  window_s: int, up_s: int, down_s: int, interval_s: float, gpu_blocks: int, cwd: str, seed: int = 0,
                  router_extra: list[str] = ()) -> dict:
    import httpx

    sim_p, sim = start_sim(model, lo, hi - lo, gpu_blocks, cwd)
    router_p = None
    try:
        router, router_p = start_router(model, sim, [*AUTOSCALERS[variant]["router"], *router_extra], cwd)
        cfg = autoscaling_cfg(variant, lo, hi, target, window_s, up_s, down_s)
        run = AutoRun(variant, sim, router, phases, seed, cfg, interval_s)
        asyncio.run(run.go())
        simlog = httpx.get(sim["control"] + "/sim/log", timeout=60).json()
        out = summarize_auto(run, simlog)
        out["autoscaling"] = {"metric": AUTOSCALERS[variant]["metric"], "target_per_replica": cfg.target_queued_prefill_tokens,
                              "protect_hit_ratio": cfg.protect_hit_ratio, "warmup": "--no-warmup" not in AUTOSCALERS[variant]["router"],
                              "scale_in_victim": AUTOSCALERS[variant]["victim"]}
        return out
    finally:
        harness.stop(router_p)
        harness.stop(sim_p)


def verdict_auto(auto: dict) -> dict:
    ca, qo = auto.get("cache_aware"), auto.get("queue_only")
    out = {}
    if ca:
        out["autoscale_cache_aware_zero_client_errors"] = ca["total_errors"] == 0
        out["autoscale_cache_aware_scaled_out_and_in"] = ca["scale_outs"] > 0 and ca["scale_ins"] > 0
    if ca and qo:
        out["autoscale_cache_aware_cached_ratio_ge_queue_only"] = (ca["all"]["cached_ratio"] or 0) >= (qo["all"]["cached_ratio"] or 0)
    return out


def chart_auto(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    auto = res["autoscale"]
    names = [n for n in AUTOSCALERS if n in auto]
    colors = {"cache_aware": "#2e9e5b", "queue_only": "#999999"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for n in names:
        tl = auto[n]["timeline"]
        end = auto[n]["phases"] and max(w["to_s"] for w in auto[n]["phases"].values())
        axes[0].step([t for t, _ in tl] + [end], [c for _, c in tl] + [tl[-1][1]], where="post", color=colors[n], label=n)
    ax2 = axes[0].twinx()
    t, xs, ys = 0.0, [], []
    for _, rate, secs in auto["phases"]:
        xs += [t, t + secs]
        ys += [rate, rate]
        t += secs
    ax2.plot(xs, ys, "k:", label="req/s")
    ax2.set_ylabel("req/s", fontsize=8)
    axes[0].set_title("replicas running (load dotted)", fontsize=9)
    axes[0].legend(fontsize=8, loc="upper left")
    phases = [p[0] for p in auto["phases"][1:]]  # the warm-in is not compared
    width = 0.8 / max(1, len(names))
    for k, n in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(phases) + 1)]
        ws = [auto[n]["phases"][p] for p in phases] + [auto[n]["all"]]
        axes[1].bar(xs, [w["cached_ratio"] or 0 for w in ws], width, color=colors[n], label=n)
        axes[2].bar(xs, [w["ttft_p90_model_s"] or 0 for w in ws], width, color=colors[n], label=n)
    for ax, title in ((axes[1], "cached-token ratio"), (axes[2], "TTFT p90 (model s)")):
        ax.set_xticks(range(len(phases) + 1), phases + ["all"], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("autoscaling in the loop: cache-aware (queued prefill tokens, hit-ratio protection, warm-up) vs "
                 "queue-length only (in-flight requests, no warm-up)", fontsize=10)
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
        harness.stop(router_p)
        harness.stop(sim_p)


QUEUED_TARGET, IN_FLIGHT_TARGET = 24.0, 1.0


def main_autoscale(args) -> int:
    # seconds: warm-in, phases, scrape interval, metrics window, scale-up and scale-down stabilisation (3 scrapes
    # and 10 scrapes: one scrape's spike of queued tokens, e.g. a drain's hand-off replays, does not scale out)
    if args.quick:
        secs, interval_s, window_s, up_s, down_s = (10.0, 15.0, 30.0, 30.0), 1.0, 10, 3, 10
    else:
        secs, interval_s, window_s, up_s, down_s = (30.0, 90.0, 180.0, 180.0), 5.0, 30, 15, 60
    phases = [("warm_in", args.rate_low, secs[0]), ("low", args.rate_low, secs[1]), ("high", args.rate_high, secs[2]),
              ("low_again", args.rate_low, secs[3])]
    variants = [v for v in args.autoscalers.split(",") if v]
    unknown = [v for v in variants if v not in AUTOSCALERS]
    if unknown:
        raise SystemExit(f"unknown autoscalers {unknown}: choose from {sorted(AUTOSCALERS)}")
    if not 1 <= args.min_replicas < args.max_replicas:
        raise SystemExit("--min-replicas must be >= 1 and below --max-replicas")
    model = replay_workload.tiny_model()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    router_extra = ["--warmup-budget-s", "5"] if args.quick else []
    targets = {"cache_aware": args.target_queued_tokens, "queue_only": args.target_in_flight}
    auto: dict = {"phases": phases, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                  "scrape_interval_s": interval_s, "metrics_window_s": window_s, "scale_up_stabilization_s": up_s,
                  "scale_down_stabilization_s": down_s}
    res: dict = {"mode": "autoscale", "router_flags": router_extra, "gpu_blocks": args.gpu_blocks,
                 "engine_speedup": SPEEDUP, "prestop_s": PRESTOP_S, "loadavg_1m": os.getloadavg()[0], "autoscale": auto}
    with tempfile.TemporaryDirectory(prefix="scaleout-auto-") as cwd:
        for v in variants:
            progress(f"autoscaler {v}")
            auto[v] = run_autoscale(v, model, args.min_replicas, args.max_replicas, phases, targets[v], window_s,
                                    up_s, down_s, interval_s, args.gpu_blocks, cwd, router_extra=router_extra)
            r = auto[v]
            progress(f"{v}: scale events {r['scale_events']} (max {r['max_replicas']} replicas), cached "
                     f"{r['all']['cached_ratio']}, p90 {r['all']['ttft_p90_model_s']} s, errors {r['total_errors']}, "
                     f"replica-seconds {r['replica_seconds']}")
    res["targets"] = verdict_auto(auto)
    (out_dir / "scaleout-autoscale.json").write_text(json.dumps(res, indent=1))
    chart_auto(res, out_dir / "scaleout-autoscale.png")
    progress(f"wrote {out_dir / 'scaleout-autoscale.json'} and scaleout-autoscale.png; targets {res['targets']}")
    if args.json:
        slim = json.loads(json.dumps(res))
        for v in variants:
            slim["autoscale"][v].pop("decisions", None)
        print(json.dumps(slim))
    return 0


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
    ap.add_argument("--autoscale", action="store_true",
                    help="Instead of fixed events: the operator's autoscaler in the loop (cache-aware vs queue-length only) "
                         "over a load that steps up and down (--quick: about 3 minutes).")
    ap.add_argument("--autoscalers", default="cache_aware,queue_only")
    ap.add_argument("--rate-low", type=float, default=6.0, help="--autoscale: requests per second before and after the step.")
    ap.add_argument("--rate-high", type=float, default=30.0, help="--autoscale: requests per second during the step.")
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--max-replicas", type=int, default=6)
    ap.add_argument("--target-queued-tokens", type=float, default=QUEUED_TARGET,
                    help="cache_aware: targetQueuedPrefillTokens per replica.")
    ap.add_argument("--target-in-flight", type=float, default=IN_FLIGHT_TARGET,
                    help="queue_only: in-flight requests per replica.")
    args = ap.parse_args(argv)
    if args.autoscale:
        return main_autoscale(args)
    window_s = args.window_s or (8.0 if args.quick else 120.0)
    warm_in_s = min(30.0, max(5.0, window_s / 2))
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIG_FLAGS]
    if unknown:
        ap.error(f"unknown configs {unknown}: choose from {sorted(CONFIG_FLAGS)}")
    model = replay_workload.tiny_model()
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
