"""bench/scaleout.py's runs: the simulated fleet and the router, the load, the fleet events, the autoscaler in the loop."""

from __future__ import annotations

import asyncio
import functools
import random
import sys
import time
from pathlib import Path
from urllib.parse import quote

from warmfleet.localprocs import free_port

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

replay_fleet = harness.sibling("replay_fleet")
replay_runners = harness.sibling("replay_runners")
scaleout_report = harness.sibling("scaleout_report")
scaleout_workload = harness.sibling("scaleout_workload")
progress = harness.reporter("scaleout")


# --- processes ----------------------------------------------------------------------------------
def start_sim(model: Path, n: int, spares: int, gpu_blocks: int, cwd: str) -> tuple:
    """`n` serving and `spares` standby simulated replicas (the calibrated time model, SPEEDUP x faster)."""
    return harness.start_simfleet(model, cwd, ["--replicas", str(n), "--spares", str(spares), "--block-size",
                                               str(scaleout_workload.BLOCK), "--gpu-blocks", str(gpu_blocks),
                                               "--time-model", "calibrated",
                                               "--engine-speedup", str(scaleout_workload.SPEEDUP)])


def start_router(model: Path, sim: dict, extra: list[str], cwd: str):
    """warmfleet's router in front of `sim` (as bench/trace_replay.py runs it), up once in sync with the serving replicas."""
    port = free_port()
    cmd, env = replay_fleet.router_command("warmfleet", model, sim, port, scaleout_workload.BLOCK, extra)
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
        self.work = scaleout_workload.Workload(seed)
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
        await asyncio.sleep(scaleout_workload.PRESTOP_S)
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


# --- one run per config or autoscaler -----------------------------------------------------------
def run_config(config: str, model: Path, n: int, rate: float, warm_in_s: float, window_s: float,
               gpu_blocks: int, cwd: str, seed: int = 0, router_extra: list[str] = ()) -> dict:
    import httpx

    sim_p, sim = start_sim(model, n, 1, gpu_blocks, cwd)
    router_p = None
    try:
        router = None
        flags = scaleout_workload.CONFIG_FLAGS[config]
        if flags is not None:
            router, router_p = start_router(model, sim, [*flags, *router_extra], cwd)
        run = Run(config, sim, router, rate, seed)
        asyncio.run(run.go(warm_in_s, window_s))
        simlog = httpx.get(sim["control"] + "/sim/log", timeout=60).json()
        out = scaleout_report.summarize(run, simlog, window_s)
        if router:
            out["router_replicas"] = httpx.get(router + "/v1/router/replicas", timeout=10).json()["replicas"]
        return out
    finally:
        harness.stop(router_p)
        harness.stop(sim_p)


# --- autoscaling in the loop (--autoscale) ------------------------------------------------------
IN_FLIGHT = "warmfleet_router_replica_in_flight"


def in_flight(text: str) -> float:
    """Requests the router has open, all replicas: the queue-length-only autoscaler's metric."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(max(0.0, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == IN_FLIGHT)


def autoscaling_cfg(variant: str, lo: int, hi: int, target: float, window_s: int, up_s: int, down_s: int):
    """The operator's own spec.autoscaling: queued prefill tokens for cache_aware, the same field fed with
    in-flight requests (HPA-like: desired = ceil(requests / target)) for queue_only."""
    from warmfleet.operator.spec.inference_service import Autoscaling

    return Autoscaling(min_replicas=lo, max_replicas=hi, target_queued_prefill_tokens=max(1, round(target)),
                       protect_hit_ratio=scaleout_workload.AUTOSCALERS[variant]["protect_hit_ratio"],
                       metrics_window_seconds=window_s,
                       scale_up_stabilization_seconds=up_s, scale_down_stabilization_seconds=down_s)


class AutoRun(Run):
    """One autoscaler's run: a load that steps up and down; the real operator's scrape and `decide` set the replicas."""

    def __init__(self, variant: str, sim: dict, router: str, phases: list[tuple[str, float, float]], seed: int,
                 cfg, interval_s: float):
        super().__init__(variant, sim, router, phases[0][1], seed)
        self.variant, self.phases, self.cfg, self.interval_s = variant, phases, cfg, interval_s
        self.kind = scaleout_workload.AUTOSCALERS[variant]
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
        if self.kind["victim"] == "coldest":  # pod-deletion-cost: fewest cached blocks go first
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
        metric = self.kind["metric"]
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


def run_autoscale(variant: str, model: Path, lo: int, hi: int, phases: list[tuple[str, float, float]], target: float,
                  window_s: int, up_s: int, down_s: int, interval_s: float, gpu_blocks: int, cwd: str, seed: int = 0,
                  router_extra: list[str] = ()) -> dict:
    import httpx

    kind = scaleout_workload.AUTOSCALERS[variant]
    sim_p, sim = start_sim(model, lo, hi - lo, gpu_blocks, cwd)
    router_p = None
    try:
        router, router_p = start_router(model, sim, [*kind["router"], *router_extra], cwd)
        cfg = autoscaling_cfg(variant, lo, hi, target, window_s, up_s, down_s)
        run = AutoRun(variant, sim, router, phases, seed, cfg, interval_s)
        asyncio.run(run.go())
        simlog = httpx.get(sim["control"] + "/sim/log", timeout=60).json()
        out = scaleout_report.summarize_auto(run, simlog)
        out["autoscaling"] = {"metric": kind["metric"], "target_per_replica": cfg.target_queued_prefill_tokens,
                              "protect_hit_ratio": cfg.protect_hit_ratio, "warmup": "--no-warmup" not in kind["router"],
                              "scale_in_victim": kind["victim"]}
        return out
    finally:
        harness.stop(router_p)
        harness.stop(sim_p)

