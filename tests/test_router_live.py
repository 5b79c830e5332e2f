"""Two real `warmfleet serve` replicas on the tiny checkpoint behind two real `warmfleet route` processes."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from warmfleet.livefleet import wait_for
from warmfleet.localprocs import free_port, stop_all

pytestmark = pytest.mark.slow

SYSTEM = "You are the warmfleet assistant. Answer briefly and precisely about caches and routing. " * 6






@pytest.fixture(scope="module")
def live_fleet(tiny_model_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("live")  # never the repo root: its operator/ folder shadows the stdlib
    exe = [sys.executable, "-P", "-m", "warmfleet.cli"]
    procs: list[subprocess.Popen] = []
    replicas, routers = [], []
    try:
        for i in range(2):
            port, events = free_port(), free_port()
            procs.append(subprocess.Popen(exe + [
                "serve", "--model", str(tiny_model_dir), "--port", str(port), "--kv-events-port", str(events),
                "--replica-id", f"live-{i}", "--served-model-name", "tiny", "--block-size", "16", "--kv-cache-memory", "0.05",
                "--log-level", "warning"], cwd=cwd))
            replicas.append((f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}"))
        for url, _ in replicas:
            wait_for(lambda: httpx.get(url + "/ready").status_code == 200, f"{url} ready", procs)
        for _ in range(2):
            port = free_port()
            args = exe + ["route", "--model", str(tiny_model_dir), "--port", str(port), "--block-size", "16",
                          "--log-level", "warning"]
            for url, events in replicas:
                args += ["--replica", f"{url},events={events}"]
            procs.append(subprocess.Popen(args, cwd=cwd))
            routers.append(f"http://127.0.0.1:{port}")
        for r in routers:
            wait_for(lambda: all(x["synced"] and x["healthy"]
                                 for x in httpx.get(r + "/v1/router/replicas").json()["replicas"]),
                     f"router {r} synced with both replicas", procs)
        yield replicas, routers
    finally:
        stop_all(procs)


def ask(router: str, question: str, system: str = SYSTEM) -> httpx.Response:
    r = httpx.post(router + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r


def replica_view(router: str) -> dict:
    return {x["id"]: x for x in httpx.get(router + "/v1/router/replicas").json()["replicas"]}


def test_repeated_prefix_lands_on_the_same_replica_and_routers_agree(live_fleet):
    replicas, (ra, rb) = live_fleet
    first = ask(ra, "What is a prefix cache?")
    target = first.headers["x-warmfleet-replica"]
    target_url = replicas[int(target.rsplit("-", 1)[1])][0]  # replica ids are live-<index>
    # both routers learn the new blocks from the replica's events, not from the traffic they saw
    for r in (ra, rb):
        wait_for(lambda: replica_view(r)[target_url]["gpu_blocks"] >= 4, f"{r} indexing the prefix", [])
    for r, q in ((rb, "And why route by it?"), (ra, "What breaks when it is cold?")):
        resp = ask(r, q)
        assert resp.headers["x-warmfleet-replica"] == target
        assert resp.headers["x-warmfleet-route"].startswith("prefix_hit")
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(resp.headers["x-warmfleet-route"].rsplit("=", 1)[1])
        assert cached > 0 and predicted == cached  # router and engine hash the same blocks (contract 1)
    # a brand-new prefix: both routers place it on the same replica before any event exists
    cold_system = "A different tenant's long system prompt about gardening and soil. " * 6
    a = ask(ra, "Which soil?", cold_system)
    b = ask(rb, "Which soil?", cold_system)
    assert a.headers["x-warmfleet-route"].startswith("cold_hash") or a.headers["x-warmfleet-route"].startswith(
        "load_spill")
    assert a.headers["x-warmfleet-replica"] == b.headers["x-warmfleet-replica"]
