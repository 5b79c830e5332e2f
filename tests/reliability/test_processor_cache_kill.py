"""The pod's processor-cache process killed (and frozen) under image load: the frontend keeps answering, the cache returns.

A real `warmfleet serve` on the tiny Qwen2-VL checkpoint with a processor cache; three clients send
image chats (eight seeded pictures, so the cache hits) while the cache process is SIGKILLed three
times and once stopped with SIGSTOP for 1.5 s (a cache that hangs instead of dying). Every request
must succeed (the frontend preprocesses itself while the cache is away: a call to a dead cache
fails at once, a call to a frozen one times out after 0.5 s), each within a bounded time (the
clients' 30 s timeout: nothing hangs), the server must restart the cache after each kill (counted in
`warmfleet:processor_cache_restarts`), and the restarted cache must serve hits again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from warmfleet.server.multimodal.processor_cache import ProcessorCacheProcess

from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from warmfleet.livefleet import MODEL_NAME, Replica, metric, tree_pids, wait_for
from waiting import apoll

pytestmark = pytest.mark.slow

KILLS = 3
IMAGES = [data_uri(image_bytes(64, 48, seed=100 + i)) for i in range(8)]


def cache_pid(replica: Replica) -> int | None:
    """Pid of the replica's processor-cache process (a child running `...multimodal.processor_cache`)."""
    for pid in tree_pids(replica.popen.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"processor_cache" in cmd and pid != replica.popen.pid:
            return pid
    return None


@pytest.fixture(scope="module")
def vl_replica(tiny_vl_dir, tmp_path_factory):
    r = Replica("vl", tiny_vl_dir, tmp_path_factory.mktemp("pc-kill"),
                ("--max-processor-cache", "0.05", "--max-encoder-cache", "4096"))
    r.start()
    try:
        r.wait_ready()
        wait_for(lambda: cache_pid(r) is not None, "processor cache process", [r], 30)
        yield r
    finally:
        r.stop()


def client_failures(text: str) -> float:
    return metric(text, "warmfleet:processor_cache_client_failures_total") or 0.0


async def image_chat(client: httpx.AsyncClient, url: str, image: str) -> tuple[int, float]:
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [image_part(image), {"type": "text", "text": "what is it?"}]}]}
    t0 = time.monotonic()
    r = await client.post(url + "/v1/chat/completions", json=body)
    return r.status_code, time.monotonic() - t0


async def test_processor_cache_killed_and_frozen_under_load(vl_replica):
    url = vl_replica.url
    results: list[tuple[int, float]] = []
    errors: list[str] = []
    stop = asyncio.Event()

    async def client_loop(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as c:
            while not stop.is_set():
                try:
                    results.append(await image_chat(c, url, rng.choice(IMAGES)))
                except httpx.HTTPError as exc:  # a timeout here is a hang
                    errors.append(type(exc).__name__)

    async def metrics() -> str:
        async with httpx.AsyncClient(timeout=5) as c:
            return (await c.get(url + "/metrics")).text

    tasks = [asyncio.create_task(client_loop(i)) for i in range(3)]
    try:
        await apoll(lambda: asyncio.sleep(0, len(results) >= 12), "warm-up requests", 60)
        pids = []
        for k in range(KILLS):
            pid = cache_pid(vl_replica)
            pids.append(pid)
            os.kill(pid, signal.SIGKILL)
            n = len(results)

            async def restarted() -> bool:
                new = cache_pid(vl_replica)
                return new is not None and new not in pids and metric(await metrics(), "warmfleet:processor_cache_up") == 1

            await apoll(restarted, f"processor cache restarted after kill {k + 1}", 30, poll_s=0.1)
            await apoll(lambda: asyncio.sleep(0, len(results) >= n + 6), "requests after the restart", 60)
        # a frozen cache: calls time out (0.5 s each) and the frontend preprocesses itself
        pid = cache_pid(vl_replica)
        failed_before = client_failures(await metrics())
        os.kill(pid, signal.SIGSTOP)
        try:
            n = len(results)
            await apoll(lambda: asyncio.sleep(0, len(results) >= n + 3), "requests while the cache is frozen", 60)
            failed_frozen = client_failures(await metrics()) - failed_before
        finally:
            os.kill(pid, signal.SIGCONT)
        n = len(results)
        await apoll(lambda: asyncio.sleep(0, len(results) >= n + 6), "requests after the thaw", 60)
    finally:
        stop.set()
        await asyncio.gather(*tasks)

    statuses = [s for s, _ in results]
    slowest = max(t for _, t in results)
    text = await metrics()
    failures = {kind: metric(text, "warmfleet:processor_cache_client_failures_total", kind=kind)
                for kind in ("timeout", "unavailable", "error")}
    print(f"\nprocessor cache kill: {len(results)} image requests, statuses {sorted(set(statuses))}, "
          f"slowest {slowest:.2f} s, client failures {failures} ({failed_frozen:.0f} while frozen), restarts "
          f"{metric(text, 'warmfleet:processor_cache_restarts_total')}")
    assert not errors, f"client-side failures (a timeout is a hang): {errors}"
    assert statuses.count(200) == len(statuses), f"non-200 answers: {[s for s in statuses if s != 200]}"
    assert metric(text, "warmfleet:processor_cache_restarts_total") == KILLS  # SIGSTOP is no exit: no restart
    assert failed_frozen >= 1  # the frozen cache did not answer (timeouts, then a full pipe): the frontend went on alone

    # the restarted (and thawed) cache serves hits again
    hits0 = metric(text, "warmfleet:processor_cache_hits_total")
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(3):
            assert (await image_chat(c, url, IMAGES[0]))[0] == 200
    assert metric(await metrics(), "warmfleet:processor_cache_hits_total") > hits0


class FakeCrashingCacheProcess(ProcessorCacheProcess):
    """A cache 'process' that exits with status 3 right after its start (a bad address, say)."""

    def _spawn(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def test_a_cache_that_dies_at_start_is_restarted_with_a_pause_not_in_a_spin(tmp_path):
    proc = FakeCrashingCacheProcess(f"ipc://{tmp_path}/x.sock", 1 << 20).start()
    try:
        time.sleep(1.5)  # NOTE: a bound on the count, not on time: a slow host only restarts fewer times
        restarts = proc.num_restarts
    finally:
        proc.stop()
    # pauses of 0.1, 0.2, 0.4, 0.8 s: at most 4 restarts in 1.5 s (a spin made ~40 here)
    assert 1 <= restarts <= 4, restarts
