"""Trace replay: a production trace (Mooncake) through each router into a simulated fleet of 16-128 replicas.

    python -P bench/trace_replay.py [--trace FILE] [--replicas 16,64] [--time-scale X] [--requests N]
                             [--routers rr,sglang,vllm,warmfleet] [--gpu-blocks 512] [--cpu-blocks 512]
                             [--engine-speedup S] [--prompt-format text|tokens] [--spread-arrivals] [--quick] [--json]
                             [--out DIR]

The replicas are `bench/simfleet.py` (one process, N replicas, the engine's real scheduler and
block pool, a time model calibrated on the real engine, real KV events), the routers are the
real processes: `warmfleet route` unchanged, SGLang's and vllm-router's `cache_aware`, and
round-robin (the client cycles over the replicas, no router process). Every router gets a fresh
fleet (empty caches), the same requests and the same arrival times.

Requests. Trace line i arrives at `timestamp / X` seconds (X = --time-scale). Each 512-token
block id becomes a fixed pseudo-random run of B words (B = the engine block size, 16), each word
one token of the tiny checkpoint's vocabulary with its leading space, so the prompt's text
tokenizes to exactly the planned ids and two requests sharing k block ids share k engine blocks
(verified on the first requests). The prompt is ceil(input_length x B / 512) tokens long (the
trace scaled by B/512 = 1/32: one engine block per trace block), the output
ceil(output_length x B / 512) tokens (--output-scale). Requests go as streamed /v1/completions with
a *text* prompt: sglang-router 0.3.2 refuses token-id prompts (422, its CompletionRequest takes
strings only), so text is the one form every router accepts; every router therefore pays its
own tokenization (warmfleet: the checkpoint's tokenizer; vllm-router: its own with
VLLM_ROUTER_TOKENIZER; SGLang routes on characters). `--prompt-format tokens` sends token ids
(peers that refuse them count errors).

Reported per fleet size and router: cached-token ratio (the simulator's `cached_tokens`, GPU and
CPU tier, over prompt tokens), simulated TTFT p50/p90 (the model's: arrival at the replica to the
step that produced the first token, queueing included), client TTFT p50/p90 (wall clock, router
and machine included), spread (max / mean requests per replica over all N replicas), router CPU
seconds per 1,000 requests (utime + stime of the router's process tree from /proc, over the
replay; its idle rate before the replay separately), errors; for warmfleet its decision reasons.
Bounds as bench/routing.py computes them: the oracle (one unbounded cache that saw every
earlier request) and one LRU cache as large as the whole fleet (N x (gpu + cpu blocks), no
prefix held twice); and, not a bound on every router but what per-replica caches give a router that
never moves a prefix for load, per-replica LRUs with pure affinity (`affinity_hits`). Warmfleet
routers run with WARMFLEET_HEALTH (below). Targets (booleans): warmfleet >= 0.95 x the fleet-sized LRU bound (and
>= 0.97 x, issue 26's); ahead of every other router on cached ratio and on simulated TTFT p90; spread <= 1.25.

Active-active: `warmfleet@K` runs K router processes in front of the same fleet, each given all K
URLs with --peers (they share in-flight load and client limits), `warmfleet@K-nopeers` the same
without; the client spreads requests over them round-robin as a plain L4 balancer would
(`--active-active K` adds both). Router CPU is then the sum over the K processes. Targets: K routers'
cached ratio within 0.02 of one router's (and within 0.01), their simulated TTFT p90 at most 1.1x one
router's. Mooncake's conversation trace rounds its timestamps to 3 s, so 4-16 requests arrive in the
same instant and K routers place them before any could learn of the others' picks; `--spread-arrivals`
spreads each such group evenly up to the next timestamp (order kept).

--quick: the committed 600-request excerpt (bench/traces/), 16 replicas, time scale 10, under 5
minutes. Writes trace.json and trace.png to --out; progress on stderr; with --json the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from warmfleet.localprocs import free_port

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # bench/harness.py, after the stdlib
import harness  # noqa: E402
EXCERPT = HERE / "traces" / "mooncake_conversation_head600.jsonl"
TRACE_BLOCK = 512  # tokens per Mooncake hash id
EXE = harness.EXE
# One simulator process hosts every replica, so one host stall (seen here at load average 10-14 on 2 cores) times
# out the health checks of the whole fleet at once and the router's defaults (0.5 s, 2 in a row) take every replica
# out: 503s and a wrecked run that measure the machine, not routing. The same stall makes the replicas' accept
# queues overflow and requests' connects time out (1 s default), which also takes a replica out and purges its
# index. The peers' checks are far slower to give up.
WARMFLEET_HEALTH = ["--health-timeout-s", "2", "--health-failures", "4", "--connect-timeout-s", "5"]
PEERS = ("rr", "sglang", "vllm")


progress = harness.reporter("trace")


def tiny_model() -> Path:
    return harness.model_dir(None, "tiny", "qwen2", say=progress)


# --- requests from the trace ----------------------------------------------------------------
def read_trace(path: Path, limit: int | None = None) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit and len(out) >= limit:
                    break
    return out


class Words:
    """Single-token words (with their leading space) of a tokenizer, and the run of B of them per hash id."""

    def __init__(self, tokenizer, block: int, seed: int = 0):
        import re

        vocab = tokenizer._tok.get_vocab()
        cands = sorted(k for k in vocab if re.fullmatch("\u0120[a-z]{2,12}", k))
        words = []
        for k in cands:
            w = " " + k[1:]
            if tokenizer.encode(w, add_special_tokens=False) == [vocab[k]]:
                words.append((w, vocab[k]))
        if len(words) < 32:
            raise RuntimeError(f"only {len(words)} single-token words in this vocabulary")
        self.words, self.block, self.seed = words, block, seed
        self._runs: dict[int, list[int]] = {}

    def run(self, hash_id: int) -> list[int]:
        """Indices into self.words of hash id's run: the same id always gives the same run."""
        r = self._runs.get(hash_id)
        if r is None:
            rng = random.Random(hash_id * 1_000_003 + self.seed)
            r = self._runs[hash_id] = [rng.randrange(len(self.words)) for _ in range(self.block)]
        return r

    def prompt(self, hash_ids: list[int], n_tokens: int) -> tuple[list[int], str]:
        idx = [i for h in hash_ids for i in self.run(h)][:n_tokens]
        return [self.words[i][1] for i in idx], "".join(self.words[i][0] for i in idx)


def scaled(n: int, block: int, scale: float | None = None) -> int:
    return max(1, math.ceil(n * (scale if scale is not None else block / TRACE_BLOCK)))


def build_requests(trace: list[dict], words: Words, block: int, output_scale: float | None) -> list[dict]:
    reqs = []
    for i, r in enumerate(trace):
        n = min(scaled(r["input_length"], block), len(r["hash_ids"]) * block)
        ids, text = words.prompt(r["hash_ids"], n)
        reqs.append({"i": i, "t": r["timestamp"] / 1000.0, "ids": ids, "text": text,
                     "max_tokens": scaled(r["output_length"], block, output_scale)})
    return reqs


def spread_arrivals(reqs: list[dict]) -> None:
    """Requests that share a timestamp spread evenly up to the next timestamp (the last group over the median gap),
    order kept: Mooncake's conversation trace rounds its timestamps to 3 s, so 4-16 requests arrive in one instant."""
    times = sorted({r["t"] for r in reqs})
    gaps = [b - a for a, b in zip(times, times[1:])]
    nxt = dict(zip(times, gaps + [statistics.median(gaps) if gaps else 0.0]))
    groups: dict[float, list[dict]] = {}
    for r in reqs:
        groups.setdefault(r["t"], []).append(r)
    for t, group in groups.items():
        for k, r in enumerate(group):
            r["t"] = t + nxt[t] * k / len(group)


def check_tokenization(tokenizer, reqs: list[dict], k: int = 20) -> None:
    """The text of a prompt must tokenize (as a replica does for a completion) to exactly its planned ids."""
    from warmfleet.server import rendering

    for r in reqs[:k]:
        got = rendering.completion_ids(tokenizer, r["text"])
        if got != r["ids"]:
            raise RuntimeError(f"request {r['i']}: text does not tokenize to the planned ids")


def bound_hits(reqs: list[dict], block: int, fingerprint: str, capacity: int | None = None,
               hashes: list | None = None) -> list[tuple[int, int]]:
    """bench/routing.py's oracle_hits on token ids: per request (cached, prompt) for one cache of `capacity` blocks
    (None: unbounded) that saw every earlier request; hit = leading blocks present, capped at the last token."""
    from warmfleet.server.hashing import block_hashes
    from warmfleet.server.router.core.policy import cacheable_tokens

    seen: OrderedDict = OrderedDict()
    out = []
    for k, r in enumerate(reqs):
        hs = hashes[k] if hashes is not None else block_hashes(r["ids"], [], block, fingerprint)
        hit = harness.lru_prefix(seen, hs, capacity)
        out.append((min(hit * block, cacheable_tokens(len(r["ids"]), block)), len(r["ids"])))
    return out


def affinity_hits(reqs: list[dict], block: int, n: int, capacity: int, hashes: list,
                  cold_tokens: int = 64) -> tuple[list, float]:
    """Per-replica caches with pure affinity and no load balancing: each request goes to the replica holding the
    longest prefix of it (ties: fewest requests so far; a prefix under `cold_tokens`, such as the first block
    every Mooncake request shares, counts as none: the request goes to the replica with the fewest requests),
    each replica one LRU of `capacity` blocks (its GPU and CPU tiers as one). What a router that never moves a
    prefix for load gets from per-replica caches; returns per request (cached, prompt) and the spread (max /
    mean requests per replica) it costs."""
    from warmfleet.server.router.core.policy import cacheable_tokens

    caches = [OrderedDict() for _ in range(n)]
    counts = [0] * n
    out = []
    for k, r in enumerate(reqs):
        hs = hashes[k]
        best, best_hit = 0, -1
        for i, c in enumerate(caches):
            hit = 0
            for h in hs:
                if h not in c:
                    break
                hit += 1
            if hit > best_hit or (hit == best_hit and counts[i] < counts[best]):
                best, best_hit = i, hit
        if best_hit * block < cold_tokens:
            best = min(range(n), key=counts.__getitem__)
            best_hit = next((j for j, h in enumerate(hs) if h not in caches[best]), len(hs))
        cache = caches[best]
        counts[best] += 1
        out.append((min(best_hit * block, cacheable_tokens(len(r["ids"]), block)), len(r["ids"])))
        harness.lru_prefix(cache, hs, capacity)
    return out, harness.spread(counts, n)


def ratio(hits: list[tuple[int, int]]) -> float:
    return round(sum(c for c, _ in hits) / max(1, sum(t for _, t in hits)), 4)


# --- processes --------------------------------------------------------------------------------
def wait_for(check, what: str, proc: subprocess.Popen | None, timeout_s: float = 120) -> None:
    """Poll `check` until true, failing early when `proc` (if any) exits."""
    from warmfleet.livefleet import wait_for as wait

    wait(check, what, [proc] if proc is not None else [], timeout_s, poll_s=0.2)


def slow_pool(spec: str) -> tuple[float, float]:
    """--slow-pool FRAC:F (argparse type)."""
    try:
        frac, factor = (float(x) for x in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want FRAC:F, e.g. 0.5:3, got {spec!r}")
    if not 0 <= frac <= 1 or factor <= 0:
        raise argparse.ArgumentTypeError("FRAC must be in [0, 1] and F > 0")
    return frac, factor


def start_sim(model: Path, n: int, args, cwd: str, time_model: str) -> tuple[subprocess.Popen, dict]:
    ready = Path(cwd) / f"sim-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-P", str(HERE / "simfleet.py"), "--model", str(model), "--replicas", str(n),
           "--block-size", str(args.block_size), "--gpu-blocks", str(args.gpu_blocks),
           "--cpu-blocks", str(args.cpu_blocks), "--time-model", time_model,
           "--engine-speedup", str(args.engine_speedup), "--ready-file", str(ready)]
    if getattr(args, "node_tier_blocks", 0):  # one shared host tier per node of K replicas
        cmd += ["--replicas-per-node", str(args.replicas_per_node), "--node-tier-blocks", str(args.node_tier_blocks)]
    if getattr(args, "slow_pool", None):  # other benches start the fleet with their own flags
        frac, factor = args.slow_pool
        cmd += ["--slow-replicas", f"{round(frac * n)}:{factor}"]
    log = open(Path(cwd) / "sim.log", "ab")
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=log)
    wait_for(ready.exists, "simulated fleet", p, 120)
    return p, json.loads(ready.read_text())


def router_command(kind: str, model: Path, sim: dict, port: int, block: int, extra: list[str] = ()) -> tuple[list, dict]:
    """Router `kind` in front of the simulated fleet `sim`: warmfleet with WARMFLEET_HEALTH, a peer `cache_aware`."""
    if kind.startswith("warmfleet"):
        replicas = [f"{r['url']},events={r['events']}" for r in sim["replicas"]]
        return harness.route_command(model, port, block, replicas, [*WARMFLEET_HEALTH, *extra]), dict(os.environ)
    cmd = harness.peer_command(kind, [r["url"] for r in sim["replicas"]], port, listen_port(),
                               ["--policy", "cache_aware"], extra)
    return cmd, dict(os.environ, VLLM_ROUTER_TOKENIZER=str(model)) if kind == "vllm" else dict(os.environ)


def listen_port() -> int:
    """A free loopback port for a router to listen on, below the kernel's ephemeral range when there is room.

    `free_port` hands out a port of the ephemeral range and releases it; vllm-router binds its port only after
    checking every worker, i.e. after opening one outgoing connection per replica (64 at 64 replicas), and any
    outgoing connection on the host (the bench's own, other processes') may take that port in the meantime. A
    taken port (its --port or its --prometheus-port) makes vllm-router exit with 1 and sglang-router panic.
    Ports below the ephemeral range are never given to outgoing connections."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    if lo - 10_000 < 1024:
        return free_port()
    for _ in range(200):
        port = random.randrange(lo - 10_000, lo)
        if port in _LISTEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _LISTEN_PORTS.add(port)
        return port
    return free_port()


_LISTEN_PORTS: set[int] = set()


def start_router(kind: str, model: Path, sim: dict, block: int, cwd: str, extra: list[str] = (),
                 taskset: str | None = None, port: int | None = None, attempts: int = 3) -> tuple[str, subprocess.Popen]:
    """Start one router in front of `sim` and wait until it is in sync and forwards; a router that exits during
    start-up is started again (fresh ports unless `port` is fixed) up to `attempts` times."""
    from warmfleet.livefleet import ProcessExited

    synced = functools.partial(harness.in_sync, count=len(sim["replicas"])) if kind.startswith("warmfleet") else None
    for attempt in range(1, attempts + 1):
        listen = port or listen_port()
        cmd, env = router_command(kind, model, sim, listen, block, extra)
        try:
            # one request shorter than a block (caches nothing) proves the router forwards
            return harness.start_router(kind, cmd, listen, cwd, env=env, taskset=taskset, synced=synced,
                                        probe={"model": "bench", "prompt": " hello", "max_tokens": 1})
        except ProcessExited as exc:
            progress(f"router {kind} exited during start-up (attempt {attempt} of {attempts}): {exc}")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


# --- driving ------------------------------------------------------------------------------------
async def stream_completion(session, url: str, body: dict) -> dict:
    """POST one streamed completion; its client TTFT, usage, replica/route headers and error (None if it went well)."""
    import aiohttp

    t0 = time.perf_counter()
    out = {"ttft_client_s": None, "cached": None, "prompt": None, "replica": None, "route": None, "error": None}
    try:
        async with session.post(url, json=body) as resp:
            out["replica"] = resp.headers.get("x-warmfleet-replica")
            out["route"] = resp.headers.get("x-warmfleet-route")
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}"
                await resp.read()
                return out
            buf = b""
            async for chunk in resp.content.iter_any():
                if out["ttft_client_s"] is None:
                    out["ttft_client_s"] = time.perf_counter() - t0
                buf += chunk
            for line in buf.split(b"\n"):
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["error"] = "stream error"
                    if ev.get("usage"):
                        out["prompt"] = ev["usage"].get("prompt_tokens")
                        out["cached"] = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        out["error"] = type(exc).__name__
    return out


async def one(session, base: str, r: dict, fmt: str, rec: list, t_start: float) -> None:
    body = {"model": "bench", "prompt": r["text"] if fmt == "text" else r["ids"], "max_tokens": r["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "user": f"r{r['i']}"}
    t0 = time.perf_counter()
    res = await stream_completion(session, base + "/v1/completions", body)
    rec.append({"i": r["i"], "sent": round(t0 - t_start, 4), **res})


async def drive(bases: list[str], reqs: list[dict], time_scale: float, fmt: str) -> list[dict]:
    """Open loop: request i at trace time / time_scale; several bases = round-robin over them."""
    import aiohttp

    rec: list[dict] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t_start = time.perf_counter()
        tasks = []
        t0_trace = reqs[0]["t"] if reqs else 0.0
        for k, r in enumerate(reqs):
            delay = (r["t"] - t0_trace) / time_scale - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, bases[k % len(bases)], r, fmt, rec, t_start)))
        await asyncio.gather(*tasks)
    return rec


quantile = harness.quantile


def summarize(rec: list[dict], simlog: list[dict], n: int, cpu_s: float | None, wall_s: float,
              oracle: list[tuple[int, int]] | None = None, slowdown: dict | None = None) -> dict:
    by_tag = {x["tag"]: x for x in simlog}
    ok = [r for r in rec if not r["error"]]
    sim = [by_tag[f"r{r['i']}"] for r in ok if f"r{r['i']}" in by_tag]
    per: dict[str, int] = {}
    for x in sim:
        per[x["replica"]] = per.get(x["replica"], 0) + 1
    prompt = sum(x["prompt"] for x in sim)
    out = {"requests": len(rec), "errors": len(rec) - len(ok),
           "cached_ratio": round(sum(x["cached"] for x in sim) / prompt, 4) if prompt else None,
           "cpu_tier_share": round(sum(x["cached_cpu"] for x in sim) / max(1, sum(x["cached"] for x in sim)), 4),
           "node_tier_share": round(sum(x.get("cached_node", 0) for x in sim) / max(1, sum(x["cached"] for x in sim)), 4),
           "ttft_p50_s": quantile([x["ttft_model_s"] for x in sim], 0.5),
           "ttft_p90_s": quantile([x["ttft_model_s"] for x in sim], 0.9),
           "ttft_client_p50_s": quantile([r["ttft_client_s"] for r in ok], 0.5),
           "ttft_client_p90_s": quantile([r["ttft_client_s"] for r in ok], 0.9),
           "spread": harness.spread(list(per.values()), n),
           "replicas_used": len(per),
           "router_cpu_s_per_1k": round(cpu_s / len(rec) * 1000, 3) if cpu_s is not None and rec else None,
           "replay_wall_s": round(wall_s, 1)}
    pools = sorted(set((slowdown or {}).values()))
    if len(pools) > 1:  # --slow-pool: requests, cached ratio and simulated TTFT p90 per node pool
        out["by_pool"] = {}
        for f in pools:
            xs = [x for x in sim if slowdown.get(x["replica"]) == f]
            p = sum(x["prompt"] for x in xs)
            out["by_pool"][f"x{f:g} slower" if f != 1 else "fast"] = {
                "requests": len(xs), "cached_ratio": round(sum(x["cached"] for x in xs) / p, 4) if p else None,
                "ttft_p90_s": quantile([x["ttft_model_s"] for x in xs], 0.9)}
    # the simulator's usage and the client's agree (a router that altered answers would show here)
    mism = sum(1 for r in ok if f"r{r['i']}" in by_tag and r["cached"] is not None
               and r["cached"] != by_tag[f"r{r['i']}"]["cached"])
    out["usage_mismatches"] = mism
    if any(r["route"] for r in ok):  # warmfleet: decisions by reason, tokens lost against the oracle, mispredictions
        reasons: dict = {}
        ttfts: dict = {}
        for r in ok:
            reason = (r["route"] or "none").split(";")[0]
            predicted = int((r["route"] or "=0").rsplit("=", 1)[1])
            x = by_tag.get(f"r{r['i']}", {})
            actual = x.get("cached", 0)
            d = reasons.setdefault(reason, {"requests": 0, "lost_vs_oracle": 0, "mispredicted": 0})
            d["requests"] += 1
            d["mispredicted"] += abs(predicted - actual)
            if oracle is not None:
                d["lost_vs_oracle"] += max(0, oracle[r["i"]][0] - actual)
            if x:
                ttfts.setdefault(reason, []).append(x["ttft_model_s"])
        for reason, xs in ttfts.items():  # where simulated TTFT goes: new conversations vs kept prefixes
            reasons[reason].update(ttft_p50_s=quantile(xs, 0.5), ttft_p90_s=quantile(xs, 0.9))
        out["reasons"] = reasons
    if oracle is not None:  # TTFT of new conversations (the oracle holds under 64 tokens of them) and the rest
        kinds: dict = {}
        for r in ok:
            x = by_tag.get(f"r{r['i']}")
            if x:
                kinds.setdefault("new" if oracle[r["i"]][0] < 64 else "continued", []).append(x["ttft_model_s"])
        out["ttft_by_kind"] = {k: {"requests": len(xs), "p50_s": quantile(xs, 0.5), "p90_s": quantile(xs, 0.9)}
                               for k, xs in kinds.items()}
    return out


def parse_kind(kind: str) -> tuple[str, int, bool]:
    """'warmfleet[:VARIANT]@K[-nopeers]' -> (router kind, K router processes, share load with --peers)."""
    base, _, many = kind.partition("@")
    if not many:
        return kind, 1, False
    count, _, flag = many.partition("-")
    if not base.startswith("warmfleet") or not count.isdigit() or int(count) < 1 or flag not in ("", "nopeers"):
        raise ValueError(f"router {kind!r}: active-active is warmfleet[:VARIANT]@K or warmfleet[:VARIANT]@K-nopeers")
    return base, int(count), flag != "nopeers"


def start_routers(kind: str, model: Path, sim: dict, args, cwd: str, extra: list[str]) -> tuple[list, list]:
    """One router process, or K active-active ones (each given every router's URL with --peers unless -nopeers)."""
    base_kind, count, peers = parse_kind(kind)
    if count == 1:
        base, proc = start_router(base_kind, model, sim, args.block_size, cwd, extra)
        return [base], [proc]
    ports = [listen_port() for _ in range(count)]
    flags = ["--peers", ",".join(f"http://127.0.0.1:{p}" for p in ports)] if peers else []
    bases, procs = [], []
    try:
        for port in ports:
            base, proc = start_router(base_kind, model, sim, args.block_size, cwd, [*extra, *flags], port=port)
            bases.append(base)
            procs.append(proc)
    except BaseException:
        for p in procs:
            harness.stop(p)
        raise
    return bases, procs


def run_one(kind: str, n: int, reqs: list[dict], model: Path, args, cwd: str, extra: list[str],
            oracle: list[tuple[int, int]] | None = None) -> dict:
    import httpx

    t0 = time.monotonic()
    sim_proc, sim = start_sim(model, n, args, cwd, args.time_model)
    procs: list = []
    try:
        if kind == "rr":
            bases = [r["url"] for r in sim["replicas"]]
        else:  # several routers: the client spreads requests over them round-robin, as a plain L4 balancer
            bases, procs = start_routers(kind, model, sim, args, cwd, extra)

        def routers_cpu() -> float:
            return sum(harness.tree_cpu_s(p.pid) for p in procs)

        idle = None
        if procs:
            c0 = routers_cpu()
            time.sleep(args.idle_s)
            idle = round((routers_cpu() - c0) / args.idle_s, 4)
        progress(f"{kind} x {n}: fleet and {len(procs)} router(s) up in {time.monotonic() - t0:.0f} s; "
                 f"replaying {len(reqs)} requests")
        c0 = routers_cpu() if procs else None
        sim_c0 = harness.tree_cpu_s(sim_proc.pid)
        w0 = time.monotonic()
        rec = asyncio.run(drive(bases, reqs, args.time_scale, args.prompt_format))
        wall = time.monotonic() - w0
        cpu = routers_cpu() - c0 if procs else None
        sim_cpu = harness.tree_cpu_s(sim_proc.pid) - sim_c0
        stats = httpx.get(sim["control"] + "/sim/stats", timeout=60).json()
        simlog = httpx.get(sim["control"] + "/sim/log", timeout=60).json()
        out = summarize(rec, simlog, n, cpu, wall, oracle, {r["id"]: r.get("slowdown", 1.0) for r in sim["replicas"]})
        busy = [r["busy_model_s"] for r in stats["per_replica"]]
        out.update(router_processes=len(procs), router_idle_cpu_s_per_s=idle, sim_cpu_s=round(sim_cpu, 1),
                   sim_busy_mean=round(statistics.mean(busy) / wall, 3), sim_busy_max=round(max(busy) / wall, 3),
                   sim_max_loop_lag_s=max(r["max_loop_lag_s"] for r in stats["per_replica"]),
                   preemptions=sum(r["preemptions"] for r in stats["per_replica"]))
        if stats.get("per_node"):
            out["node_tier"] = node_tier_hits(stats)
        if kind.startswith("warmfleet"):  # the first router's fitted TTFT models (--ttft-model-samples), if any
            view = httpx.get(bases[0] + "/v1/router/replicas", timeout=30).json()["replicas"]
            slow = {r["url"]: r.get("slowdown", 1.0) for r in sim["replicas"]}
            models = {r["id"]: dict(r["ttft_model"], sim_slowdown=slow.get(r["id"])) for r in view if r.get("ttft_model")}
            if models:
                out["ttft_models"] = models
        errs = [r["error"] for r in rec if r["error"]]
        if errs:
            out["error_kinds"] = {e: errs.count(e) for e in set(errs)}
        return out
    finally:
        for p in procs:
            harness.stop(p)
        harness.stop(sim_proc)


def node_tier_hits(stats: dict) -> dict:
    """The node tiers' hits (blocks and tokens served from them) over the fleet, per node and per replica."""
    nodes = stats["per_node"]
    return {"hit_blocks": sum(x["hit_blocks"] for x in nodes), "hit_tokens": sum(x["hit_tokens"] for x in nodes),
            "per_node": nodes,
            "per_replica": [{k: r[k] for k in ("id", "node", "node_hit_blocks", "node_hit_tokens", "cached_tokens_node",
                                                "node_stored_blocks")} for r in stats["per_replica"] if "node" in r]}


# --- verdict and chart --------------------------------------------------------------------------
def verdict(res: dict, fleet_lru: float) -> dict:
    wf = res.get("warmfleet")
    if not wf or wf.get("cached_ratio") is None:
        return {}
    others = {k: v for k, v in res.items() if not k.startswith("warmfleet") and v.get("cached_ratio") is not None}
    out = {"ratio_vs_fleet_lru": round(wf["cached_ratio"] / fleet_lru, 3) if fleet_lru else None,
           "ratio_ok_fleet_lru": bool(fleet_lru and wf["cached_ratio"] >= 0.95 * fleet_lru),
           "ratio_ge_0.97_fleet_lru": bool(fleet_lru and wf["cached_ratio"] >= 0.97 * fleet_lru),
           "spread_ok": wf["spread"] is not None and wf["spread"] <= 1.25,
           "errors_ok": wf["errors"] == 0}
    if others:
        out["ratio_ahead_of_every_peer"] = all(wf["cached_ratio"] > v["cached_ratio"] for v in others.values())
        out["ttft_p90_ahead_of_every_peer"] = all(
            wf["ttft_p90_s"] is not None and v["ttft_p90_s"] is not None and wf["ttft_p90_s"] < v["ttft_p90_s"]
            for v in others.values())
    for k, v in res.items():  # active-active: K routers sharing load vs one router, same fleet and requests
        base, count, peers = parse_kind(k)
        if base == "warmfleet" and count > 1 and peers and v.get("cached_ratio") is not None:
            gap = abs(v["cached_ratio"] - wf["cached_ratio"])
            out[f"active_active_{count}_within_0.02"] = gap <= 0.02
            out[f"active_active_{count}_within_0.01"] = gap <= 0.01
            out[f"active_active_{count}_ttft_p90_le_1.1x"] = (
                v["ttft_p90_s"] is not None and wf["ttft_p90_s"] is not None and v["ttft_p90_s"] <= 1.1 * wf["ttft_p90_s"])
            out[f"active_active_{count}_spread_ok"] = v["spread"] is not None and v["spread"] <= 1.25
    return out


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s for s in results["fleets"]]
    fig, axes = plt.subplots(len(sizes), 4, figsize=(17, 3.8 * len(sizes)), squeeze=False)
    for row, n in zip(axes, sizes):
        f = results["fleets"][n]
        res = f["routers"]
        names = list(res)
        c = harness.router_colors(names)
        row[0].bar(names, [res[k]["cached_ratio"] or 0 for k in names], color=c)
        row[0].axhline(f["oracle_cached_ratio"], ls="--", color="k", lw=1, label="oracle (unbounded)")
        row[0].axhline(f["fleet_lru_cached_ratio"], ls="-.", color="#7a3b9e", lw=1, label="one LRU of the fleet's size")
        row[0].axhline(0.95 * f["fleet_lru_cached_ratio"], ls=":", color="#7a3b9e", lw=1, label="0.95 x that")
        row[0].set_title(f"{n} replicas: cached-token ratio", fontsize=9)
        row[0].legend(fontsize=7)
        harness.ttft_panel(row[1], res, names, c, f"{n}: simulated TTFT (s)")
        harness.spread_panel(row[2], res, names, c, str(n))
        row[3].bar(names, [res[k].get("router_cpu_s_per_1k") or 0 for k in names], color=c)
        row[3].set_title(f"{n}: router CPU s per 1,000 requests (rr: none)", fontsize=9)
        for ax in row:
            ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    fig.suptitle(f"trace replay: {results['trace_name']} ({results['requests']} requests, time scale "
                 f"{results['time_scale']}), simulated replicas", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help=f"Mooncake-format JSONL (default: the excerpt {EXCERPT.name}).")
    ap.add_argument("--replicas", default=None, help="Fleet sizes, comma-separated (default 16,64; quick 16).")
    ap.add_argument("--time-scale", type=float, default=None, help="Replay X times faster than recorded (default 10).")
    ap.add_argument("--requests", type=int, default=None, help="Only the first N requests (quick: 600).")
    ap.add_argument("--routers", default="rr,sglang,vllm,warmfleet",
                    help="Comma-separated: rr, sglang, vllm, warmfleet, warmfleet:VARIANT; warmfleet[:VARIANT]@K runs K "
                         "router processes sharing load (--peers), @K-nopeers K that do not; requests go round-robin.")
    ap.add_argument("--active-active", type=int, default=None, metavar="K",
                    help="Also run warmfleet@K and warmfleet@K-nopeers (K routers, with and without shared load).")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="A warmfleet variant run as router 'warmfleet:NAME' with these extra flags.")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=512, help="Primary KV pool per simulated replica (blocks).")
    ap.add_argument("--cpu-blocks", type=int, default=512, help="CPU tier per simulated replica (blocks).")
    ap.add_argument("--time-model", default="calibrated",
                    help="'calibrated' (bench/sim_calibration.json), 'h200' (bench/sim_h200.json), 'zero', or a file.")
    ap.add_argument("--replicas-per-node", type=int, default=8, help="Simulated replicas per node (with the node tier).")
    ap.add_argument("--node-tier-blocks", type=int, default=0,
                    help="One shared host-memory KV tier of this many blocks per node (needs --cpu-blocks 0; equal host "
                         "memory to --cpu-blocks C is K x C).")
    ap.add_argument("--slow-pool", type=slow_pool, default=None, metavar="FRAC:F",
                    help="A fraction FRAC of the replicas F times slower (two node pools, e.g. 0.5:3).")
    ap.add_argument("--engine-speedup", type=float, default=10.0,
                    help="Simulated engine this many times faster than the calibration (default 10).")
    ap.add_argument("--output-scale", type=float, default=None,
                    help="Output tokens per trace output token (default: the prompt's, block / 512).")
    ap.add_argument("--prompt-format", choices=("text", "tokens"), default="text")
    ap.add_argument("--spread-arrivals", action="store_true",
                    help="Spread requests that share a timestamp evenly up to the next one (the trace rounds to 3 s).")
    ap.add_argument("--idle-s", type=float, default=3.0, help="Seconds of router idle CPU measured before a replay.")
    ap.add_argument("--quick", action="store_true", help="The committed excerpt, 16 replicas, 600 requests.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default=None, help="Keep simulator and router logs here.")
    args = ap.parse_args()
    if args.replicas_per_node < 1:
        ap.error("--replicas-per-node must be at least 1")
    if args.node_tier_blocks < 0 or (args.node_tier_blocks and args.cpu_blocks):
        ap.error("--node-tier-blocks takes the place of the per-replica swap tier: give it with --cpu-blocks 0")
    trace_path = Path(args.trace) if args.trace else EXCERPT
    sizes = [int(x) for x in (args.replicas or ("16" if args.quick else "16,64")).split(",")]
    args.time_scale = args.time_scale or 10.0
    limit = args.requests or (600 if args.quick else None)
    routers = args.routers.split(",")
    if args.active_active and args.active_active > 1:
        routers += [f"warmfleet@{args.active_active}", f"warmfleet@{args.active_active}-nopeers"]
    for kind in routers:
        parse_kind(kind)  # a typo fails here, not an hour into the run
    variants = harness.variants(args.variant)

    from warmfleet.server.hashing import block_hashes, model_fingerprint
    from warmfleet.server.tokenizer import Tokenizer

    model = tiny_model()
    tok = Tokenizer(str(model))
    words = Words(tok, args.block_size)
    trace = read_trace(trace_path, limit)
    reqs = build_requests(trace, words, args.block_size, args.output_scale)
    if args.spread_arrivals:
        spread_arrivals(reqs)
    if args.prompt_format == "text":
        check_tokenization(tok, reqs)
    fp = model_fingerprint(model)
    hashes = [block_hashes(r["ids"], [], args.block_size, fp) for r in reqs]
    oracle_per = bound_hits(reqs, args.block_size, fp, None, hashes)
    oracle = ratio(oracle_per)
    sim_mod = harness.sibling("simfleet")
    tm = sim_mod.TimeModel.load(args.time_model)
    results: dict = {
        "command": " ".join([Path(sys.executable).name] + sys.argv), "trace": str(trace_path),
        "trace_name": trace_path.name, "requests": len(reqs), "trace_span_s": round(reqs[-1]["t"] - reqs[0]["t"], 1),
        "time_scale": args.time_scale, "replay_span_s": round((reqs[-1]["t"] - reqs[0]["t"]) / args.time_scale, 1),
        "prompt_format": args.prompt_format, "block_size": args.block_size, "spread_arrivals": args.spread_arrivals,
        "scaling": f"one engine block of {args.block_size} tokens per 512-token trace block (x{args.block_size}/512); "
                   f"output x{args.output_scale or args.block_size / TRACE_BLOCK:g}",
        "mean_prompt_tokens": round(statistics.mean(len(r["ids"]) for r in reqs), 1),
        "mean_output_tokens": round(statistics.mean(r["max_tokens"] for r in reqs), 1),
        "gpu_blocks_per_replica": args.gpu_blocks, "cpu_blocks_per_replica": args.cpu_blocks,
        "replicas_per_node": args.replicas_per_node, "node_tier_blocks_per_node": args.node_tier_blocks,
        "time_model": args.time_model,
        "time_model_calibrated": vars(tm) if hasattr(tm, "__dict__") else None,
        "engine_speedup": args.engine_speedup,
        "slow_pool": args.slow_pool,
        "time_model_effective": vars(tm.scaled(args.engine_speedup)),
        "calibration": json.loads(sim_mod.CALIBRATION.read_text()) if sim_mod.CALIBRATION.exists() else None,
        "oracle_cached_ratio": oracle, "routers": routers, "variants": variants,
        "warmfleet_health_flags": WARMFLEET_HEALTH,
        "cores": len(os.sched_getaffinity(0)), "loadavg_start": os.getloadavg(), "fleets": {}}
    progress(f"{len(reqs)} requests over {results['trace_span_s']} s of trace, replayed in "
             f"{results['replay_span_s']} s; oracle {oracle}")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="wf-trace-", dir=args.logs)
    for n in sizes:
        nodes = -(-n // args.replicas_per_node) if args.node_tier_blocks else 0
        cap = n * (args.gpu_blocks + args.cpu_blocks) + nodes * args.node_tier_blocks  # every block of the fleet
        lru = ratio(bound_hits(reqs, args.block_size, fp, cap, hashes))
        aff, aff_spread = affinity_hits(reqs, args.block_size, n, cap // n, hashes)
        fleet = {"replicas": n, "oracle_cached_ratio": oracle, "fleet_lru_cached_ratio": lru,
                 "fleet_lru_capacity_blocks": cap, "affinity_lru_cached_ratio": ratio(aff),
                 "affinity_lru_spread": aff_spread, "routers": {}}
        results["fleets"][n] = fleet
        progress(f"{n} replicas: fleet-sized LRU bound {lru} ({cap} blocks); per-replica LRUs with pure affinity "
                 f"{fleet['affinity_lru_cached_ratio']} at spread {aff_spread}")
        for kind in routers:
            try:
                res = run_one(kind, n, reqs, model, args, cwd, variants.get(parse_kind(kind)[0], []), oracle_per)
            except Exception as exc:  # one router failing to start must not lose the others' figures
                progress(f"{kind} x {n} failed: {exc!r}")
                res = {"failed": repr(exc), "cached_ratio": None, "ttft_p50_s": None, "ttft_p90_s": None,
                       "spread": None, "errors": None}
            fleet["routers"][kind] = res
            progress(f"{kind} x {n}: { {k: v for k, v in res.items() if k != 'reasons'} }")
        fleet["targets"] = verdict(fleet["routers"], lru)
        progress(f"{n} replicas targets: {fleet['targets']}")
    results["loadavg_end"] = os.getloadavg()
    results["targets"] = {str(n): f["targets"] for n, f in results["fleets"].items()}
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "trace", results, chart, progress)
    if args.json:
        print(json.dumps(results))
    else:
        for n, f in results["fleets"].items():
            print(f"{n} replicas (oracle {f['oracle_cached_ratio']}, fleet LRU {f['fleet_lru_cached_ratio']})")
            for k, v in f["routers"].items():
                print(f"  {k:12s} {v}")
            print(f"  targets {f['targets']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
