"""Soak: mixed text and image chat traffic through `warmfleet route` into 2 replicas, with periodic faults.

    python bench/soak.py --minutes N [--quick] [--json] [--clients C] [--fault-every-s S] [--faults LIST]
                         [--image-share F] [--model DIR] [--out FILE]

Starts two real `warmfleet serve` replicas of a tiny Qwen2-VL checkpoint (made on first run
under ~/.cache/warmfleet/models; a VL model answers text and image requests alike) and one
`warmfleet route`, all on loopback, then runs `--clients` closed-loop clients for `--minutes`:
each request is a chat on one of six tenant system prompts, with an image from a Zipf-popular
pool of eight (share `--image-share`), streamed or not at random. Clients never retry, so every
failure the router lets through is counted; a client waits 0.25 s after a refused connection.

Every `--fault-every-s` seconds the next fault of the cycle runs: SIGKILL replica r0 (and its
engine-core and processor-cache processes), restart it on the same ports 2 s later; SIGKILL
the router and start it again on the same port; the same for r1; the router again (`--faults`
names another cycle; `r0-pc` / `r1-pc` SIGKILL only that replica's processor-cache process, which
its API server restarts, and any error after it is counted as a bug, cause "none").

Reports (JSON, the last stdout line with --json; progress on stderr every 10 s):
  requests, ok, errors by class ("http 5xx", "stream error" = a stream cut by a dying replica
  with an error event and [DONE], "stream cut" = no [DONE], "client timeout", "connect" = refused,
  "transport ..." = reset), and the same errors by cause: "router_down" (sent between a router
  SIGKILL and the new one listening: no router can answer those), "replica_fault" (ended within
  5 s after a replica SIGKILL), "none" (anything else: a bug);
  latency p50/p99 (end to end, successful requests; also per kind: text / image);
  per fault: out-of-rotation time, restart and resync times;
  peak RSS (VmHWM, sampled every 2 s and at each kill) per process role over all incarnations, and
  the largest VmRSS growth of one incarnation after its first 15 s (a leak grows with --minutes).

--quick: the tiny VL checkpoint (default: the bench-size one), 3 clients, a fault every 20 s
(default 4 clients, every 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from warmfleet.livefleet import LiveFleet, Proc, Replica, metric, tree_pids
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

chatload = harness.sibling("chatload")

T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[soak {time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def model_dir(arg: str | None, quick: bool) -> Path:
    return harness.model_dir(arg, "tiny" if quick else "bench", "qwen2_vl", say=progress)


# --- traffic ----------------------------------------------------------------------------------
class Traffic:
    """Closed-loop clients; every request's outcome is kept with its kind ("text" | "image")."""

    def __init__(self, base: str, clients: int, image_share: float, timeout_s: float, seed: int = 0):
        self.base, self.clients, self.image_share, self.timeout_s = base, clients, image_share, timeout_s
        self.systems = chatload.tenant_systems()
        self.images = [data_uri(image_bytes(64 + 32 * (k % 6), 64 + 16 * (k % 5), seed=k)) for k in range(8)]
        self.zipf = [1 / (k + 1) for k in range(len(self.images))]
        self.seed = seed
        self.done: list[tuple[str, chatload.Outcome]] = []
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 100 + i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0)) as client:
            while not self.stopping.is_set():
                kind = "image" if rng.random() < self.image_share else "text"
                stream = rng.random() < 0.5
                user: str | list = chatload.question(rng)
                if kind == "image":
                    k = rng.choices(range(len(self.images)), self.zipf)[0]
                    user = [{"type": "image_url", "image_url": {"url": self.images[k]}},
                            {"type": "text", "text": user}]
                messages = [{"role": "system", "content": rng.choice(self.systems)}, {"role": "user", "content": user}]
                out = await chatload.send_chat(client, self.base, messages, stream, 32 if stream else 16,
                                               chatload.Outcome(i, stream, time.monotonic()))
                if out.error == "timeout":
                    out.error = "client timeout"
                self.done.append((kind, out))
                if out.error == "connect":
                    await asyncio.sleep(0.25)


# --- faults -----------------------------------------------------------------------------------
async def _view(c: httpx.AsyncClient, router_url: str) -> dict:
    return {r["id"]: r for r in (await c.get(router_url + "/v1/router/replicas")).json()["replicas"]}


async def _until(pred, timeout_s: float) -> float | None:
    """Seconds until the async predicate holds, None if it did not within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if await pred():
                return round(time.monotonic() - t0, 3)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.02)
    return None


async def kill_replica(fleet: LiveFleet, rep: Replica, down_s: float, sampler: "RssSampler") -> dict:
    router = fleet.router
    async with httpx.AsyncClient(timeout=5) as c:
        sampler.sample()
        t_kill = rep.kill()
        seen = await _until(lambda: _replica_down(c, router.url, rep.url), 10)
        out = round(time.monotonic() - t_kill, 3) if seen is not None else None
        await asyncio.sleep(max(0.0, down_s - (time.monotonic() - t_kill)))
        rep.start()
        t_start = time.monotonic()
        ready = await _until(lambda: _status_ok(c, rep.url + "/ready"), 300)
        back = await _until(lambda: _replica_back(c, router.url, rep.url), 60)
    return {"fault": f"SIGKILL {rep.name}", "t_kill": t_kill, "at_s": round(t_kill - T0, 1),
            "out_of_rotation_s": out,
            "restarted_after_s": round(t_start - t_kill, 2), "ready_after_restart_s": ready,
            "back_in_rotation_after_ready_s": back}


PC_SUFFIX = "-pc"


async def kill_processor_cache(fleet: LiveFleet, rep: Replica, sampler: "RssSampler") -> dict:
    """SIGKILL the replica's processor-cache process; its API server restarts it (counted in its metrics)."""
    def pc_pid() -> int | None:
        for pid in tree_pids(rep.popen.pid):
            try:
                if b"processor_cache" in Path(f"/proc/{pid}/cmdline").read_bytes() and pid != rep.popen.pid:
                    return pid
            except OSError:
                continue
        return None

    async def restarted(c) -> bool:
        new = pc_pid()
        text = (await c.get(rep.url + "/metrics")).text
        return new not in (None, old) and metric(text, "warmfleet:processor_cache_up") == 1

    sampler.sample()
    old = pc_pid()
    if old is None:
        return {"fault": f"SIGKILL {rep.name}{PC_SUFFIX}", "t_kill": time.monotonic(), "skipped": "no processor cache"}
    t_kill = time.monotonic()
    os.kill(old, signal.SIGKILL)
    async with httpx.AsyncClient(timeout=5) as c:
        back = await _until(lambda: restarted(c), 60)
    return {"fault": f"SIGKILL {rep.name}{PC_SUFFIX}", "t_kill": t_kill, "at_s": round(t_kill - T0, 1),
            "cache_back_after_s": back}


async def restart_router(fleet: LiveFleet, sampler: "RssSampler") -> dict:
    router = fleet.router
    async with httpx.AsyncClient(timeout=5) as c:
        sampler.sample()
        t_kill = router.kill()
        router.start()
        listen = await _until(lambda: _status_ok(c, router.url + "/health"), 120)
        synced = await _until(lambda: _all_synced(c, router.url, len(fleet.replicas)), 30)
    return {"fault": "SIGKILL router", "at_s": round(t_kill - T0, 1), "listening_after_s": listen,
            "index_rebuilt_after_listening_s": synced, "t_kill": t_kill,
            "t_listen": t_kill + (listen or 0) if listen is not None else None}


async def _replica_down(c, router_url, url) -> bool:
    return not (await _view(c, router_url))[url]["healthy"]


async def _replica_back(c, router_url, url) -> bool:
    r = (await _view(c, router_url))[url]
    return r["healthy"] and r["synced"]


async def _status_ok(c, url) -> bool:
    return (await c.get(url)).status_code == 200


async def _all_synced(c, router_url, n) -> bool:
    v = await _view(c, router_url)
    return len(v) == n and all(r["healthy"] and r["synced"] for r in v.values())


# --- memory -----------------------------------------------------------------------------------
class RssSampler:
    """Peak VmHWM per process role ("router", "r0 api", "r0 engine-core", "r0 processor-cache"), all incarnations."""

    ROLES = (("engine.core_proc", "engine-core"), ("processor_cache", "processor-cache"), ("warmfleet.cli", "api"))

    WARM_S = 15.0  # RSS growth counts from this long after a process is first seen (start-up is not a leak)

    def __init__(self, procs: list[Proc]):
        self.procs = procs
        self.peak_kib: dict[str, int] = {}
        self.seen: dict[int, float] = {}  # pid → when first sampled
        self.warm_rss_kib: dict[int, int] = {}  # pid → VmRSS at its first sample after WARM_S
        self.last_rss_kib: dict[int, tuple[str, int]] = {}

    def role(self, proc: Proc, pid: int) -> str:
        if proc.name == "router":
            return "router"
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return f"{proc.name} ?"
        return f"{proc.name} " + next((r for key, r in self.ROLES if key in cmd), "other")

    def sample(self) -> None:
        for p in self.procs:
            if not p.alive():
                continue
            for pid in tree_pids(p.popen.pid):
                fields = _status_fields(pid)
                if "VmHWM" not in fields:
                    continue
                role = self.role(p, pid)
                self.peak_kib[role] = max(self.peak_kib.get(role, 0), fields["VmHWM"])
                now = time.monotonic()
                if now - self.seen.setdefault(pid, now) >= self.WARM_S:
                    self.warm_rss_kib.setdefault(pid, fields["VmRSS"])
                    self.last_rss_kib[pid] = (role, fields["VmRSS"])

    async def run(self, every_s: float = 2.0) -> None:
        while True:
            self.sample()
            await asyncio.sleep(every_s)

    def report(self) -> dict:
        peak = {role: round(kib / 1024, 1) for role, kib in sorted(self.peak_kib.items())}
        # VmRSS growth of each incarnation from WARM_S after its start to its last sample, largest per role
        # (a leak shows as growth that rises with the soak's length)
        growth: dict[str, float] = {}
        for pid, (role, last) in self.last_rss_kib.items():
            g = round((last - self.warm_rss_kib[pid]) / 1024, 1)
            growth[role] = max(growth.get(role, g), g)
        return {"peak_rss_mib": peak, "rss_growth_after_warm_up_mib": dict(sorted(growth.items()))}


def _status_fields(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return out


# --- report -----------------------------------------------------------------------------------
quantile = harness.quantile


def cause_of(o: chatload.Outcome, faults: list[dict]) -> str:
    """"router_down": under way or sent while no router listened; "replica_fault": ended <= 5 s after a replica kill."""
    for f in faults:
        if f["fault"] == "SIGKILL router" and o.t_end >= f["t_kill"] and \
                (f["t_listen"] is None or o.t_start <= f["t_listen"]):
            return "router_down"
    for f in faults:  # a processor-cache kill is no excuse: the frontend must preprocess alone meanwhile
        if f["fault"] != "SIGKILL router" and not f["fault"].endswith(PC_SUFFIX) and 0 <= o.t_end - f["t_kill"] <= 5.0:
            return "replica_fault"
    return "none"


def summarize(done: list[tuple[str, chatload.Outcome]], faults: list[dict], seconds: float) -> dict:
    ok = [(k, o) for k, o in done if o.ok]
    errors = [o for _, o in done if not o.ok]
    by_class = Counter(o.error for o in errors)
    by_cause = Counter(cause_of(o, faults) for o in errors)
    lat = [o.latency_s for _, o in ok]
    out = {
        "seconds": round(seconds, 1), "requests": len(done), "ok": len(ok),
        "requests_by_kind": dict(Counter(k + (" stream" if o.stream else "") for k, o in done)),
        "errors": len(errors), "errors_by_class": dict(by_class.most_common()),
        "errors_by_cause": dict(by_cause.most_common()),
        "errors_by_cause_and_class": {c: dict(Counter(o.error for o in errors if cause_of(o, faults) == c))
                                      for c in by_cause},
        "latency_p50_s": quantile(lat, 0.5), "latency_p99_s": quantile(lat, 0.99),
        "latency_by_kind": {k: {"p50_s": quantile([o.latency_s for kk, o in ok if kk == k], 0.5),
                                "p99_s": quantile([o.latency_s for kk, o in ok if kk == k], 0.99)}
                            for k in ("text", "image")},
        "cached_ratio": round(sum(o.cached_tokens for _, o in ok) / max(1, sum(o.prompt_tokens for _, o in ok)), 4),
        "faults": [{k: v for k, v in f.items() if not k.startswith("t_")} for f in faults],
    }
    return out


async def soak(args: argparse.Namespace, fleet: LiveFleet) -> dict:
    sampler = RssSampler([fleet.router, *fleet.replicas])
    traffic = Traffic(fleet.router.url, args.clients, args.image_share, args.client_timeout_s, args.seed)
    faults: list[dict] = []
    end = time.monotonic() + args.minutes * 60
    t_begin = time.monotonic()
    sampler_task = asyncio.create_task(sampler.run())
    clients = asyncio.create_task(traffic.run())

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(10)
            errs = Counter(o.error for _, o in traffic.done if not o.ok)
            progress(f"{len(traffic.done)} requests, errors {dict(errs)}, faults so far {len(faults)}")

    reporter = asyncio.create_task(report_progress())
    cycle = args.faults.split(",")
    n = 0
    try:
        while True:
            next_fault = t_begin + (n + 1) * args.fault_every_s
            if next_fault >= end:
                break
            await asyncio.sleep(max(0.0, next_fault - time.monotonic()))
            what = cycle[n % len(cycle)]
            progress(f"fault {n + 1}: SIGKILL {what}")
            if what == "router":
                f = await restart_router(fleet, sampler)
            elif what.endswith(PC_SUFFIX):
                f = await kill_processor_cache(fleet, fleet.by_id(what[: -len(PC_SUFFIX)]), sampler)
            else:
                f = await kill_replica(fleet, fleet.by_id(what), args.replica_down_s, sampler)
            progress(f"  {json.dumps({k: v for k, v in f.items() if not k.startswith('t_')})}")
            faults.append(f)
            n += 1
        await asyncio.sleep(max(0.0, end - time.monotonic()))
    finally:
        traffic.stopping.set()
        await clients
        sampler.sample()
        for t in (reporter, sampler_task):
            t.cancel()
    res = summarize(traffic.done, faults, time.monotonic() - t_begin)
    res.update(sampler.report())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, required=True, help="Length of the soak, minutes.")
    ap.add_argument("--quick", action="store_true", help="Tiny VL checkpoint, 3 clients, a fault every 20 s.")
    ap.add_argument("--json", action="store_true", help="Print the report as one JSON object on the last stdout line.")
    ap.add_argument("--model", default=None, help="A Qwen2-VL checkpoint directory (default: made on first run).")
    ap.add_argument("--clients", type=int, default=None, help="Concurrent closed-loop clients (default 4; quick 3).")
    ap.add_argument("--fault-every-s", type=float, default=None, help="Seconds between faults (default 30; quick 20).")
    ap.add_argument("--faults", default="r0,router,r1,router",
                    help="The fault cycle, comma-separated: r0 / r1 (SIGKILL the replica, restart it), router "
                         "(SIGKILL, restart), r0-pc / r1-pc (SIGKILL the replica's processor-cache process; "
                         "errors after it count as cause 'none').")
    ap.add_argument("--replica-down-s", type=float, default=2.0, help="Seconds a killed replica stays down.")
    ap.add_argument("--image-share", type=float, default=0.3, help="Share of requests carrying an image.")
    ap.add_argument("--client-timeout-s", type=float, default=30.0, help="Client timeout per request, seconds.")
    ap.add_argument("--gpu-blocks", type=int, default=256, help="KV blocks per replica.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="Also write the JSON report to this file.")
    args = ap.parse_args()
    args.clients = args.clients or (3 if args.quick else 4)
    args.fault_every_s = args.fault_every_s or (20.0 if args.quick else 30.0)
    model = model_dir(args.model, args.quick)
    cwd = Path(tempfile.mkdtemp(prefix="wf-soak-"))  # outside the repo; process logs are kept here
    progress(f"starting 2 replicas of {model.name} and a router (logs in {cwd})")
    fleet = LiveFleet(model, cwd, replica_args=("--num-gpu-blocks", str(args.gpu_blocks))).start()
    try:
        res = asyncio.run(soak(args, fleet))
    finally:
        fleet.close()
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv), "model": str(model),
           "clients": args.clients, "fault_every_s": args.fault_every_s, "image_share": args.image_share,
           "logs": str(cwd), **res}
    progress(f"done: {res['requests']} requests, {res['errors']} errors {res['errors_by_cause']}, "
             f"p50 {res['latency_p50_s']} s, p99 {res['latency_p99_s']} s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    harness.print_results(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
