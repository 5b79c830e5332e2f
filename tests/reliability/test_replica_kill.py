"""A replica SIGKILLed under steady load through the router, then restarted on the same ports.

Guarantees (docs/router.md "Failures", docs/reliability.md):
  * no non-streaming request fails: one already sent to the dead replica is retried elsewhere
    (nothing had reached its client yet);
  * a stream under way on the dead replica ends with `data: {"error": ...}` then `data: [DONE]`;
  * the dead replica is out of rotation (`healthy` false in GET /v1/router/replicas) within 1 s;
  * restarted, it is back in rotation, resynced, and receives traffic again.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from bench_scripts import load_bench
from warmfleet.livefleet import MODEL_NAME
from waiting import apoll

chatload = load_bench("chatload.py")
pytestmark = pytest.mark.slow

OUT_OF_ROTATION_S = 1.0  # the stated guarantee
LONG_TOKENS = 3000  # a stream still under way seconds later (ignore_eos: the tiny model never stops early)


async def router_view(client: httpx.AsyncClient, router_url: str, replica_url: str) -> dict:
    view = (await client.get(router_url + "/v1/router/replicas")).json()
    return next(r for r in view["replicas"] if r["id"] == replica_url)


async def test_replica_sigkill_under_load_loses_no_request(fleet):
    router = fleet.router
    systems = chatload.tenant_systems()
    pinned_msgs = [{"role": "system", "content": systems[0]},
                   {"role": "user", "content": "Explain the whole cache hierarchy at length."}]
    load = chatload.SteadyLoad(router.url, clients=4, seed=1)
    pinned: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as c:
        load.start()
        try:
            await load.wait_for(lambda o: len(o) >= 16 and all(x.ok for x in o), "16 good answers before the kill", 60)

            # A long stream, under way when its replica dies.
            body = {"model": MODEL_NAME, "messages": pinned_msgs, "max_tokens": LONG_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with c.stream("POST", router.url + "/v1/chat/completions", json=body) as long_stream:
                assert long_stream.status_code == 200
                victim = fleet.by_id(long_stream.headers["x-warmfleet-replica"])
                lines = long_stream.aiter_lines()
                events = []
                while len(events) < 3:  # the role chunk, then tokens: the stream is under way
                    line = await anext(lines)
                    if line.startswith("data: "):
                        events.append(line[6:])

                # Long non-streaming requests on the same prefix: the router sends them where it is cached,
                # so they are in flight on the victim when it dies.
                for k in range(2):
                    msgs = [pinned_msgs[0], {"role": "user", "content": f"Now list every tier, part {k}."}]
                    pinned.append(asyncio.create_task(
                        chatload.send_chat(c, router.url, msgs, False, 600, chatload.Outcome(-1, False, time.monotonic()))))
                await apoll(lambda: _in_flight_at_least(c, router.url, victim.url, 3), "pinned requests in flight", 10)

                t_kill = victim.kill()
                t_out = await apoll(lambda: _unhealthy(c, router.url, victim.url), "victim out of rotation", 10)
                out_of_rotation_s = time.monotonic() - t_kill
                assert out_of_rotation_s <= OUT_OF_ROTATION_S, \
                    f"dead replica still routable {out_of_rotation_s:.3f} s after SIGKILL (poll took {t_out:.3f} s)"

                # The stream under way ends with an error event and [DONE], never a hung connection.
                async def rest() -> list[str]:
                    return [line[6:] async for line in lines if line.startswith("data: ")]

                tail = await asyncio.wait_for(rest(), timeout=30)
            assert tail[-1] == "[DONE]", tail[-3:]
            assert "error" in json.loads(tail[-2]), tail[-3:]

            pinned_out = await asyncio.gather(*pinned)
            assert all(o.ok for o in pinned_out), [(o.error, o.route) for o in pinned_out]

            await asyncio.sleep(1.0)  # the load runs on the survivor alone for a while
            victim.start()
            # While it loads, the restarted replica answers /health but not /ready: it must stay out of rotation.
            routed_while_loading = await _wait_ready_watching_router(c, router.url, victim)
            t_ready = time.monotonic()
            # (a few polls' worth of slack: the router may see /ready turn 200 a moment before this test does)
            assert routed_while_loading < 0.2, \
                f"router listed {victim.name} as healthy {routed_while_loading:.2f} s before it was ready"
            await apoll(lambda: _back(c, router.url, victim.url), "victim healthy and synced again", 15)
            back_s = time.monotonic() - t_ready
            await load.wait_for(lambda o: any(x.replica == victim.name and x.t_start > t_ready and x.ok for x in o),
                                f"traffic on the restarted {victim.name}", 30)
        finally:
            outcomes = await load.stop()
            for t in pinned:
                t.cancel()

    after_kill = [o for o in outcomes if o.t_end > t_kill]
    failed = [o for o in outcomes if not o.ok]
    failed_plain = [o for o in failed if not o.stream]
    assert not failed_plain, [(o.error, o.replica, o.route) for o in failed_plain]
    # Streams that failed are only those under way on the victim, and each ended with error + [DONE].
    for o in failed:
        assert o.error == "stream error" and o.replica == victim.name and o.t_start < t_kill, o
        assert o.tail[-1] == "[DONE]" and isinstance(o.tail[-2], dict) and "error" in o.tail[-2], o.tail
    # Whether a non-streaming request was in flight on the victim at the kill depends on where bounded load
    # sent the "pinned" ones (it may spill them to the survivor); when one was, it was retried there, and
    # either way none failed (asserted above). The retry path itself is covered deterministically by
    # tests/test_router_proxy.py::test_retry_on_next_replica_before_first_byte.
    retried = [o for o in pinned_out + outcomes if not o.stream and (o.route or "").startswith("retry")]
    print(f"\nreplica kill: {len(outcomes) + len(pinned_out)} requests, {len(after_kill)} ended after the kill, "
          f"{len(failed)} streams cut with error+[DONE], {len(retried)} non-streaming retried, "
          f"out of rotation {out_of_rotation_s:.3f} s after SIGKILL, back in rotation {back_s:.2f} s after /ready")


async def _wait_ready_watching_router(c: httpx.AsyncClient, router_url: str, victim, timeout_s: float = 120.0
                                      ) -> float:
    """Poll the replica's /ready until 200; returns how long the router listed it healthy before that (0: never)."""
    first_healthy = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert victim.alive(), victim.log_tail()
        try:
            if (await c.get(victim.url + "/ready", timeout=2)).status_code == 200:
                return time.monotonic() - first_healthy if first_healthy else 0.0
        except httpx.HTTPError:
            pass
        # the replica was not ready a moment ago: is the router already routing to it?
        if first_healthy is None and (await router_view(c, router_url, victim.url))["healthy"]:
            first_healthy = time.monotonic()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{victim.name} not ready after {timeout_s} s")


async def _in_flight_at_least(c: httpx.AsyncClient, router_url: str, replica_url: str, n: int) -> bool:
    return (await router_view(c, router_url, replica_url))["in_flight"] >= n


async def _unhealthy(c: httpx.AsyncClient, router_url: str, replica_url: str) -> bool:
    return not (await router_view(c, router_url, replica_url))["healthy"]


async def _back(c: httpx.AsyncClient, router_url: str, replica_url: str) -> bool:
    r = await router_view(c, router_url, replica_url)
    return r["healthy"] and r["synced"]
