"""The replica simulator (bench/simfleet.py) and the trace replay's helpers (bench/trace_replay.py).

The simulator runs the engine's own scheduler, KV cache manager and block pool with the model
replaced by a time model. These tests check its cache model against the real engine on the same
small cases (the offline LLM on the tiny checkpoint: identical cached_tokens, GPU and CPU tier,
through hits, LRU eviction and swap), its time model on hand-computed cases, its HTTP surface, and
that the real router accepts its events and snapshots (index in sync, prefix_hit decisions whose
prediction equals the cached_tokens the simulator reports).
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from bench_scripts import load_bench
from router_fakes import synced
import waiting
from warmfleet.livefleet import ProcessExited
from warmfleet.localprocs import free_port

BLOCK = 16


sim = load_bench("simfleet.py")
replica = load_bench("simfleet_replica.py")
replay_fleet = load_bench("replay_fleet.py")
replay_report = load_bench("replay_report.py")
replay_workload = load_bench("replay_workload.py")
harness = load_bench("harness.py")


def run(coro):
    return asyncio.run(coro)


def ids(seed: int, n: int) -> list[int]:
    """n pseudo-random token ids of the tiny vocabulary; ids(s, n) is a prefix of ids(s, m) for m > n."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 1014) for _ in range(n)]


# --- cache model: the same answers as the real engine ------------------------------------------
SCRIPT = [  # (prompt, what it exercises); pool: 8 GPU blocks of 16 tokens, a few CPU blocks
    (ids(0, 40), "cold"),
    (ids(0, 40), "repeat: 2 full blocks hit (the last token is always recomputed)"),
    (ids(0, 32) + ids(500, 20), "shared 32-token prefix, new tail"),
    (ids(0, 33), "33 tokens: 2 blocks cacheable"),
    (ids(0, 32), "32 tokens: only 1 block (cap at the last prompt token)"),
    (ids(100, 100), "6 new blocks: evicts the prefix to the CPU tier"),
    (ids(0, 40), "prefix back from the CPU tier"),
    (ids(200, 110), "fills GPU and pushes the CPU tier"),
    (ids(300, 110), "again: the oldest CPU entries go"),
    (ids(0, 40), "prefix gone or partly in CPU, as the engine decides"),
    (ids(100, 100), "an older prompt, partly still somewhere"),
]


def sim_answers(gpu: int, cpu: int, fingerprint: str) -> list[tuple[int, int]]:
    async def go():
        rep = replica.SimReplica("s0", fingerprint, BLOCK, gpu, cpu, sim.TimeModel(), 1024)
        task = asyncio.create_task(rep.run())
        out = []
        for prompt, _ in SCRIPT:
            h = rep.submit(prompt, 1, None, "")
            await h.done
            out.append((h.cached_tokens, h.cached_tokens_cpu))
        task.cancel()
        return out, rep

    return run(go())


def test_cache_model_matches_the_real_engine(tiny_model_dir):
    from warmfleet import LLM, SamplingParams
    from warmfleet.server.hashing import model_fingerprint

    llm = LLM(str(tiny_model_dir), block_size=BLOCK, num_gpu_blocks=8, swap_space=0.00005)
    cpu_blocks = llm.engine.pool.cpu.num_blocks
    assert 2 <= cpu_blocks <= 16
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    real = []
    for prompt, _ in SCRIPT:
        o = llm.generate(prompt, sp)[0]
        real.append((o.num_cached_tokens, o.num_cached_tokens_cpu))
    simulated, rep = sim_answers(8, cpu_blocks, model_fingerprint(tiny_model_dir))
    assert simulated == real, list(zip([w for _, w in SCRIPT], simulated, real))
    # the script did exercise hits, the cap at the last token, the CPU tier and eviction from it
    assert real[1] == (32, 0) and real[3] == (32, 0) and real[4] == (16, 0)
    assert real[6][1] > 0
    assert rep.pool.counters.evicted_cpu_blocks > 0 and rep.pool.counters.swap_in_blocks > 0
    # and the same blocks are cached at the end, in each tier
    gpu_real, cpu_real = llm.engine.pool.snapshot()
    gpu_sim, cpu_sim = rep.pool.snapshot()
    assert len(gpu_sim) == len(gpu_real) and len(cpu_sim) == len(cpu_real)


def test_lru_eviction_keeps_the_recently_used_prefix(tiny_model_dir):
    from warmfleet.server.hashing import model_fingerprint

    async def go():
        rep = replica.SimReplica("s0", model_fingerprint(tiny_model_dir), BLOCK, 6, 0, sim.TimeModel(), 1024)
        task = asyncio.create_task(rep.run())
        got = {}
        for name, prompt in [("a", ids(0, 33)), ("b", ids(100, 33)), ("a2", ids(0, 33)), ("c", ids(200, 33)),
                             ("a3", ids(0, 33)), ("b2", ids(100, 33))]:
            h = rep.submit(prompt, 1, None, name)
            await h.done
            got[name] = h.cached_tokens
        task.cancel()
        return got

    got = run(go())
    # 6 blocks: using `a` again keeps it, so `c` evicts from `b`, the least recently used (tail block first,
    # as the engine frees a request's blocks tail first)
    assert got["a2"] == 32 and got["a3"] == 32 and got["b2"] < 32


# --- time model ----------------------------------------------------------------------------------
def test_fit_time_model_from_prefix_cache_figures():
    pc = {"prefix_tokens": 2000, "question_tokens": 64, "ttft_miss_s": 2.1, "ttft_hit_s": 0.1,
          "ttft_swap_hit_s": 0.3, "decode_tok_s_batch1": 50.0, "decode_tok_s_batch16": 400.0}
    tm = sim.fit_time_model(pc, 16)
    assert tm["prefill_s_per_token"] == pytest.approx(0.001)
    assert tm["decode_s_per_seq"] == pytest.approx((0.04 - 0.02) / 15, rel=1e-3)
    assert tm["step_s"] == pytest.approx(0.02 - tm["decode_s_per_seq"], rel=1e-3)
    assert tm["swap_s_per_block"] == pytest.approx(0.2 / 2000 * 16)
    assert sim.TimeModel(**{k: v for k, v in tm.items() if k != "source"}).scaled(10).prefill_s_per_token == \
        pytest.approx(0.0001)


def test_time_model_prefill_decode_hits_and_queueing(tiny_model_dir):
    from warmfleet.server.hashing import model_fingerprint

    tm = sim.TimeModel(step_s=0.01, prefill_s_per_token=0.0001, decode_s_per_seq=0.002, max_num_batched_tokens=2048)

    async def go():
        rep = replica.SimReplica("s0", model_fingerprint(tiny_model_dir), BLOCK, 512, 0, tm, 1024)
        task = asyncio.create_task(rep.run())
        h = rep.submit(ids(0, 1000), 3, None, "cold")
        await h.done
        h = rep.submit(ids(0, 1000), 1, None, "hit")
        await h.done
        a = rep.submit(ids(2000, 1500), 2, None, "a")  # 1500 + 548 fill the first step's 2048-token budget
        b = rep.submit(ids(4000, 1500), 2, None, "b")
        await asyncio.gather(a.done, b.done)
        task.cancel()
        return {x["tag"]: x for x in rep.log}

    log = run(go())
    tol = replica.LAG_TOLERANCE_S
    cold = 0.01 + 1000 * 0.0001  # one step: the whole prompt, then the first token
    assert cold <= log["cold"]["ttft_model_s"] <= cold + tol
    assert log["cold"]["e2e_model_s"] == pytest.approx(log["cold"]["ttft_model_s"] + 2 * (0.01 + 0.002), abs=tol)
    hit = 0.01 + (1000 - 992) * 0.0001  # 62 cached blocks: 8 tokens to compute
    assert log["hit"]["cached"] == 992 and hit <= log["hit"]["ttft_model_s"] <= hit + tol
    # chunked prefill: b's 1500 tokens split over two steps behind a's, so its first token comes a step later
    step1 = 0.01 + 2048 * 0.0001
    step2 = 0.01 + 952 * 0.0001 + 0.002  # b's remaining 952 tokens and a's decode
    assert step1 <= log["a"]["ttft_model_s"] <= step1 + tol
    assert step1 + step2 <= log["b"]["ttft_model_s"] <= step1 + step2 + 2 * tol


# --- HTTP surface and KV events ----------------------------------------------------------------------
def test_http_surface_streams_usage_snapshot_and_tokenize(tiny_model_dir):
    from warmfleet.server.events import Snapshot
    from warmfleet.server.hashing import model_fingerprint

    async def go():
        fleet = sim.SimFleet(str(tiny_model_dir), 2, block_size=BLOCK, gpu_blocks=64, events=False)
        await fleet.start()
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                u = fleet.urls[1]
                assert (await c.get(u + "/ready")).status_code == 200
                assert (await c.get(u + "/health")).status_code == 200
                body = {"model": "bench", "prompt": ids(0, 40), "max_tokens": 3, "stream": True,
                        "stream_options": {"include_usage": True}}
                for expect in (0, 32):
                    async with c.stream("POST", u + "/v1/completions", json=body) as r:
                        assert r.headers["x-warmfleet-replica"] == "s1"
                        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
                    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
                    assert len(text.split()) == 3 and events[-1]["usage"]["prompt_tokens"] == 40
                    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == expect
                chat = {"model": "bench", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
                r = (await c.post(u + "/v1/chat/completions", json=chat)).json()
                assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] == 2
                tok = (await c.post(u + "/tokenize", json={"prompt": "hello world"})).json()
                assert tok["count"] == len(tok["tokens"]) > 0
                assert (await c.post(u + "/v1/completions", json={"prompt": [5000]})).status_code == 400
                snap = Snapshot.from_json((await c.get(u + "/v1/kv/snapshot")).json())
                assert snap.model_fingerprint == model_fingerprint(tiny_model_dir) and snap.block_size == BLOCK
                assert len(snap.gpu) >= 2 and snap.load is not None
                logs = (await c.get(fleet.control_url + "/sim/log")).json()
                assert [x["cached"] for x in logs if x["prompt"] == 40] == [0, 32]
        finally:
            await fleet.stop()

    run(go())


def test_real_router_follows_the_simulated_fleet(tiny_model_dir):
    """Events and snapshots of the simulator are accepted by the real router: index in sync, exact predictions."""
    import uvicorn

    from warmfleet.server.hashing import model_fingerprint
    from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
    from warmfleet.server.router.core.registry import ReplicaSpec
    from warmfleet.server.router.core.runtime import RouterRuntime
    from warmfleet.server.router.core.settings import RouterSettings
    from warmfleet.server.router.http.app import build_app

    async def until(cond, what):
        await waiting.until(cond, what, timeout_s=15.0, interval_s=0.05)

    async def go():
        fleet = sim.SimFleet(str(tiny_model_dir), 3, block_size=BLOCK, gpu_blocks=64, cpu_blocks=8)
        await fleet.start()
        specs = [ReplicaSpec(u, r.events_endpoint) for u, r in zip(fleet.urls, fleet.replicas)]
        runtime = RouterRuntime(hash_cfg=HashConfig(BLOCK, model_fingerprint(tiny_model_dir)), replicas=specs,
                                renderer=PromptRenderer(str(tiny_model_dir)), settings=RouterSettings(health_interval_s=0.1))
        app = build_app(runtime)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        try:
            await until(lambda: server.started, "router start")
            index = app.state.fleet.index
            await until(lambda: synced(index, fleet.urls), "initial snapshot resync")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
                seen = []
                for k in range(4):  # four prefixes, each asked three times with a different tail
                    for j in range(3):
                        body = {"model": "bench", "prompt": ids(1000 * k, 64) + ids(1000 * k + 500 + j, 7),
                                "max_tokens": 2}
                        held = {u: len(index.state(u).gpu) for u in fleet.urls}
                        r = await c.post("/v1/completions", json=body)
                        assert r.status_code == 200
                        reason, predicted = r.headers["x-warmfleet-route"].split("; predicted_cached_tokens=")
                        seen.append((k, r.headers["x-warmfleet-replica"], reason, int(predicted),
                                     r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
                        url = fleet.urls[int(r.headers["x-warmfleet-replica"][1:])]
                        # the first ask stores the prefix's 4 full blocks (the 7-token tail fills none); wait for
                        # exactly those events, not any 4 blocks the replica already held from an earlier prefix
                        grown = held[url] + (4 if j == 0 else 0)
                        await until(lambda: len(index.state(url).gpu) >= grown, "the replica's BlockStored events")
            for k in range(4):
                reps = {s[1] for s in seen if s[0] == k}
                assert len(reps) == 1, seen  # each prefix stayed on one replica
                warm = [s for s in seen if s[0] == k][1:]
                assert all(s[2] == "prefix_hit" and s[3] == s[4] == 64 for s in warm), seen
            for u, rep in zip(fleet.urls, fleet.replicas):  # the index equals each replica's pool, per tier
                gpu, cpu = rep.pool.snapshot()
                await until(lambda: index.state(u).gpu == set(gpu) and index.state(u).cpu == set(cpu), "index == pool")
            view = (await httpx.AsyncClient().get(f"http://127.0.0.1:{port}/v1/router/replicas")).json()
            assert all(r["synced"] for r in view["replicas"])
        finally:
            server.should_exit = True
            await task
            await fleet.stop()

    run(go())


# --- trace replay helpers ---------------------------------------------------------------------------
def test_trace_prompts_tokenize_exactly_and_bounds_are_consistent(tiny_model_dir):
    from warmfleet.server.hashing import model_fingerprint
    from warmfleet.server.tokenizer import Tokenizer

    tok = Tokenizer(str(tiny_model_dir))
    words = replay_workload.Words(tok, BLOCK)
    rows = replay_workload.read_trace(replay_workload.EXCERPT, 80)
    assert len(rows) == 80
    reqs = replay_workload.build_requests(rows, words, BLOCK, None)
    replay_workload.check_tokenization(tok, reqs, 20)  # the text is exactly the planned token ids
    for row, r in zip(rows, reqs):
        assert len(r["ids"]) == -(-row["input_length"] * BLOCK // 512)
    # two requests sharing k hash ids share k engine blocks
    a, b = rows[0]["hash_ids"], rows[1]["hash_ids"]
    k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert reqs[0]["ids"][:k * BLOCK] == reqs[1]["ids"][:k * BLOCK]
    assert reqs[0]["ids"][k * BLOCK:(k + 1) * BLOCK] != reqs[1]["ids"][k * BLOCK:(k + 1) * BLOCK]
    fp = model_fingerprint(tiny_model_dir)
    oracle = replay_workload.ratio(replay_workload.bound_hits(reqs, BLOCK, fp))
    assert replay_workload.ratio(replay_workload.bound_hits(reqs, BLOCK, fp, 10**9)) == oracle > 0
    assert replay_workload.ratio(replay_workload.bound_hits(reqs, BLOCK, fp, 30)) < oracle
    summary = replay_report.summarize(
        [{"i": 0, "error": None, "ttft_client_s": 0.1, "cached": 16, "route": None},
         {"i": 1, "error": "HTTP 502", "ttft_client_s": None, "cached": None, "route": None}],
        [{"tag": "r0", "replica": "s0", "prompt": 40, "cached": 16, "cached_cpu": 0, "ttft_model_s": 0.05}],
        4, 1.5, 10.0)
    assert summary["errors"] == 1 and summary["cached_ratio"] == 0.4 and summary["spread"] == 4.0
    assert summary["router_cpu_s_per_1k"] == 750.0 and summary["usage_mismatches"] == 0


FAKE_PEER_ROUTER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def _ok(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
    do_GET = do_POST = _ok
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_peer_router_that_exits_during_start_up_is_started_again_and_its_log_named(tmp_path, monkeypatch):
    """vllm-router exits with 1 when a port it was given is taken by the time it binds (seen once at 64 replicas);
    the bench starts it again on fresh ports, and says why if it keeps failing."""
    import sys

    starts = []

    def fake_command(kind, model, sim_desc, port, block, extra=()):
        starts.append(port)
        if len(starts) == 1:  # the first start fails as vllm-router does on a taken port
            code = "import sys; print('RuntimeError: Address already in use (os error 98)'); sys.exit(1)"
            return [sys.executable, "-c", code], {}
        return [sys.executable, "-c", FAKE_PEER_ROUTER, str(port)], {}

    monkeypatch.setattr(replay_fleet, "router_command", fake_command)
    cpu = str(min(os.sched_getaffinity(0)))
    base, proc = replay_fleet.start_router("vllm", tmp_path, {"replicas": []}, BLOCK, str(tmp_path), taskset=cpu)
    try:
        assert len(starts) == 2 and starts[0] != starts[1]  # a second start, on a fresh port
        assert base == f"http://127.0.0.1:{starts[1]}" and proc.poll() is None
        assert proc.args[:3] == ["taskset", "-c", cpu]  # pinned as asked
    finally:
        harness.stop(proc)

    starts.clear()
    monkeypatch.setattr(replay_fleet, "router_command", lambda *a, **k: (starts.append(1), (
        [sys.executable, "-c", "import sys; print('Address already in use'); sys.exit(1)"], {}))[1])
    with pytest.raises(ProcessExited, match="exited with 1.*Address already in use"):
        replay_fleet.start_router("vllm", tmp_path, {"replicas": []}, BLOCK, str(tmp_path), attempts=2)
    assert len(starts) == 2


def test_router_listen_ports_are_outside_the_ephemeral_range_and_never_repeat():
    from pathlib import Path

    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [replay_fleet.listen_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p < lo for p in ports)  # no outgoing connection is ever given one of these


def test_a_slow_pool_is_the_last_k_replicas_f_times_slower(tiny_model_dir):
    tm = sim.TimeModel(0.01, 1e-4, 1e-3, 1e-4)
    fleet = sim.SimFleet(str(tiny_model_dir), 4, tm=tm, slow=sim.parse_slow("2:3", 4))
    assert [fleet.time_model(f"s{i}") is tm for i in range(4)] == [True, True, False, False]
    slow = fleet.time_model("s3")
    assert slow.prefill_s_per_token == pytest.approx(3e-4) and slow.step_s == pytest.approx(0.03)
    assert fleet.time_model("s4") is tm  # a spare slot beyond the n replicas stays in the fast pool
    assert sim.parse_slow(None, 4) == (0, 1.0)
    for bad in ("2", "x:3", "5:2", "2:0"):
        with pytest.raises(SystemExit, match="--slow-replicas"):
            sim.parse_slow(bad, 4)


# --- the node tier (bench/simfleet_node.py) ---------------------------------------------------------
node_tier = load_bench("simfleet_node.py")


def finish_all(rep) -> list[float]:
    """Step `rep`'s scheduler until it has no work (no event loop, no clock); each step's modelled seconds."""
    costs = []
    while rep.sched.has_work:
        out = rep.sched.schedule()
        costs.append(rep.tm.step_seconds(out))
        sampled = {s.request.request_id: 11 for s in out.scheduled
                   if s.num_computed_before + s.num_tokens == s.request.num_tokens}
        for r in rep.sched.update(out, sampled):
            h = rep.live.get(r.request_id)
            if h is not None and (r.new_token_ids or r.finished) and not h.first.done():
                h.cached_tokens, h.cached_tokens_cpu = r.num_cached_tokens, r.num_cached_tokens_cpu
                h.first.set_result(0.0)
    return costs


def keys(tier) -> list:
    return [k for _, k in tier.store.slots()]


def test_node_tier_never_exceeds_its_size():
    tier = node_tier.NodeTier("n0", 4)
    for i in range(10):
        tier.put(f"h{i}", "s0", held=False)
        assert len(tier) <= 4
    assert keys(tier) == ["h6", "h7", "h8", "h9"] and tier.evicted_blocks == 6
    assert tier.put("h7", "s0", held=False) is False and keys(tier)[-1] == "h7"  # held already: released, not copied
    with pytest.raises(ValueError):
        node_tier.NodeTier("n1", 0)


def test_a_prefix_evicted_by_one_replica_is_hit_by_another_on_its_node_only():
    async def go():
        n0, n1 = node_tier.nodes_for(3, 2, 12)  # slots 0, 1 on n0; slot 2 on n1; 12 blocks each (all a writes through)
        tm = sim.TimeModel(prefill_s_per_token=0.001, swap_s_per_block=0.25)
        a, b, c = (replica.SimReplica(f"s{i}", "fp", BLOCK, 8, 0, tm, 1024, node=n) for i, n in enumerate((n0, n0, n1)))
        prefix = ids(0, 40)  # two full blocks cacheable
        a.submit(prefix, 1, None, "a0")
        finish_all(a)
        a.submit(ids(100, 120), 1, None, "a1")  # takes all 8 of a's blocks: the prefix goes to n0
        finish_all(a)
        assert all(len(t) <= t.capacity for t in (n0, n1)) and len(n1) == 0
        hb = b.submit(prefix, 1, None, "b0")
        costs = finish_all(b)
        hc = c.submit(prefix, 1, None, "c0")
        costs_c = finish_all(c)
        return n0, a, b, hb, costs, hc, costs_c

    n0, a, b, hb, costs, hc, costs_c = run(go())
    assert (hb.cached_tokens, hb.cached_tokens_cpu) == (32, 32)  # from the node tier, copied into b's pool
    assert hc.cached_tokens == 0  # another node: cold
    assert costs[0] == pytest.approx(8 * 0.001 + 2 * 0.25)  # 8 tokens prefilled, 2 blocks copied back
    assert costs_c[0] == pytest.approx(40 * 0.001)
    assert b.pool.node_hit_blocks == 2 and n0.hit_blocks_by_replica == {"s1": 2}
    assert a.pool.node_stored_blocks >= 2 and b.pool.node_stored_blocks == 0
    assert b.stats()["node_hit_tokens"] == 32 and b.stats()["node"] == "n0"


def test_a_prefix_still_hot_on_one_replica_is_written_through_to_its_node_tier():
    """As the engine does (BlockPool.cache_block), a computed block goes to the node tier at once, priced as a copy."""
    async def go():
        (n0,) = node_tier.nodes_for(2, 2, 6)
        tm = sim.TimeModel(prefill_s_per_token=0.001, swap_s_per_block=0.25)
        a, b = (replica.SimReplica(f"s{i}", "fp", BLOCK, 8, 0, tm, 1024, node=n0) for i in range(2))
        a.submit(ids(0, 40), 1, None, "a0")
        costs_a = finish_all(a)
        hb = b.submit(ids(0, 40), 1, None, "b0")  # a still holds the prefix in its primary pool
        finish_all(b)
        return n0, a, hb, costs_a

    n0, a, hb, costs_a = run(go())
    assert len(n0) == 2 and a.pool.node_stored_blocks == 2 and costs_a == [pytest.approx(40 * 0.001)]
    assert len(a.pool.plan.swap_out) == 2  # the copies go with a's next step, as the engine reads them out then
    assert (hb.cached_tokens, hb.cached_tokens_cpu) == (32, 32)
    assert n0.store.holders[("kv", n0.store.slots()[0][1])] == {"s0", "s1"}  # both hold it now: claims


def test_the_simulated_node_tier_is_the_products_store_victims_first_unless_plain_lru():
    tier = node_tier.NodeTier("n0", 3)
    tier.put("v", "s0", held=False)  # evicted by its replica: held nowhere else
    for h in ("a", "b", "c"):
        tier.put(h, "s0", held=True)  # computed by a replica, written through
    assert keys(tier) == ["b", "c", "v"]  # "a" went first although "v" is older; "b" is next: victims first
    assert tier.put("b", "s0", held=False) is False  # its replica evicted it: released, now held only here
    tier.put("d", "s1", held=True)
    assert set(keys(tier)) == {"v", "b", "d"} and tier.evicted_blocks == 2
    plain = node_tier.NodeTier("n1", 2, lru=True)
    plain.put("x", "s0", held=True)
    plain.put("v", "s0", held=False)
    plain.put("y", "s0", held=True)  # no claims: the least recent goes, though "x" is still on a replica
    assert keys(plain) == ["v", "y"] and plain.store.holders == {}


def test_the_node_tier_replaces_the_swap_tier():
    with pytest.raises(ValueError):
        replica.SimReplica("s0", "fp", BLOCK, 8, 4, sim.TimeModel(), 1024, node=node_tier.NodeTier("n0", 8))


def test_the_h200_time_model_is_in_the_repo():
    tm = sim.TimeModel.load("h200")
    assert tm.swap_s_per_block == pytest.approx(1.7e-05) and tm.prefill_s_per_token > 0 and "H200" in tm.source


def test_the_node_tier_comparison_targets_and_configs():
    """bench/replay_node.py: equal host memory (C per replica, K x C per node), priced router, issue 41's booleans."""
    import argparse

    replay_node = load_bench("replay_node.py")
    args = argparse.Namespace(cpu_blocks=512, replicas_per_node=8, node_tier_lru=False, node_tier_fixed=True,
                              node_tier_plain_lru=True, time_model="h200", engine_speedup=1.0)
    cfg = replay_node.configs(args)
    assert (cfg["per_replica"][0].cpu_blocks, cfg["per_replica"][0].node_tier_blocks) == (512, 0)
    assert (cfg["node_tier"][0].cpu_blocks, cfg["node_tier"][0].node_tier_blocks) == (0, 4096)
    assert cfg["node_tier"][1] == ["--node-tier-copy-s-per-block", "1.7e-05", "--prefill-s-per-token", "2.58e-05"]
    assert cfg["node_tier_fixed"][1] == [] and not cfg["node_tier"][0].node_tier_lru
    assert cfg["node_tier_plain_lru"][0].node_tier_lru and cfg["node_tier_plain_lru"][1] == cfg["node_tier"][1]
    per = {"cached_ratio": 0.25, "ttft_p90_s": 0.05, "spread": 1.0, "errors": 0,
           "ttft_by_kind": {"continued": {"p90_s": 0.04}}}
    good = {"cached_ratio": 0.2, "ttft_p90_s": 0.039, "ttft_p90_floor_s": 0.03, "spread": 1.05, "errors": 0,
            "ttft_by_kind": {"continued": {"p90_s": 0.01}}}
    both = replay_node.targets({"per_replica": per, "node_tier": good, "node_tier_fixed": {"cached_ratio": None}}, 0.2)
    assert list(both) == ["node_tier"]
    t = both["node_tier"]
    assert t["ratio_ge_0.99_fleet_lru"] and t["ttft_p90_le_0.8x_per_replica"] and t["spread_le_1.1"] and t["errors_ok"]
    assert t["ttft_p90_floor_vs_per_replica"] == 0.6 and t["ttft_p90_continued_vs_per_replica"] == 0.25
    t = replay_node.targets({"per_replica": per, "node_tier": dict(good, cached_ratio=0.19, ttft_p90_s=0.041,
                                                                    spread=1.2)}, 0.2)["node_tier"]
    assert not (t["ratio_ge_0.99_fleet_lru"] or t["ttft_p90_le_0.8x_per_replica"] or t["spread_le_1.1"])
    assert replay_node.targets({"per_replica": per, "node_tier": {"cached_ratio": None}}, 0.2) == {}
