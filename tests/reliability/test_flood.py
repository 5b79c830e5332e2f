"""One client floods the router; another keeps being served. Per-client limits and the body cap hold.

A router with two API keys, `--max-concurrent-per-client 4` and `--max-request-bytes` 1 MiB in
front of one replica (tiny Qwen2). The flooder opens 48 requests at once (long generations) and 24
uploads of 4 MiB each (also at once); meanwhile the well-behaved client sends 12 requests one after
another. Required: every request of the good client succeeds; the flooder never has more than 4
requests admitted at once (the rest get 429 `rate_limit_error`), every oversize upload gets 413
without being buffered (the router's peak RSS stays far below the 96 MiB uploaded), and the router
still answers /health. The latency figure (good client's p50/p99 with and without the flood) is
bench/flood.py's.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from warmfleet.livefleet import MODEL_NAME, LiveFleet, memory_mib

pytestmark = pytest.mark.slow

FLOODER, GOOD = "flooder-key", "good-key"
LIMIT = 4
CAP = 1 << 20


@pytest.fixture(scope="module")
def limited_fleet(tiny_model_dir, tmp_path_factory):
    fleet = LiveFleet(tiny_model_dir, tmp_path_factory.mktemp("flood"), n=1,
                      router_args=("--api-key", FLOODER, "--api-key", GOOD, "--max-concurrent-per-client", str(LIMIT),
                                   "--max-request-bytes", str(CAP)))
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()


def body(text: str, max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


async def test_flood_from_one_client_does_not_starve_another(limited_fleet):
    url = limited_fleet.router.url + "/v1/chat/completions"
    flood_h, good_h = {"Authorization": f"Bearer {FLOODER}"}, {"Authorization": f"Bearer {GOOD}"}
    timeout = httpx.Timeout(60.0, connect=10.0)
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as flood, httpx.AsyncClient(timeout=timeout) as good:

        async def flood_one(i: int) -> int:
            return (await flood.post(url, json=body(f"flood {i}", 256), headers=flood_h)).status_code

        async def upload_one(i: int) -> tuple[int, dict]:
            r = await flood.post(url, content=b'{"model": "tiny", "messages": [' + b" " * (4 << 20) + b"]}",
                                 headers={**flood_h, "content-type": "application/json"})
            return r.status_code, r.json()

        async def good_client() -> list[int]:
            out = []
            for i in range(12):
                out.append((await good.post(url, json=body(f"polite question {i}", 8), headers=good_h)).status_code)
            return out

        flood_task = asyncio.gather(*(flood_one(i) for i in range(48)))
        upload_task = asyncio.gather(*(upload_one(i) for i in range(24)))
        good_statuses = await good_client()
        health = (await good.get(limited_fleet.router.url + "/health")).status_code
        flood_statuses = await flood_task
        uploads = await upload_task
    router_peak = memory_mib(limited_fleet.router.popen.pid)["api"]["peak"]
    print(f"\nflood: good client {good_statuses}; flooder {flood_statuses.count(200)} ok, "
          f"{flood_statuses.count(429)} x 429; uploads {[s for s, _ in uploads].count(413)} x 413; router peak RSS {router_peak} MiB")
    assert good_statuses == [200] * 12
    assert health == 200
    assert set(flood_statuses) <= {200, 429} and flood_statuses.count(429) > 0
    # at most LIMIT of the 48 were admitted at any one time: with all 48 sent at once, most are refused
    assert flood_statuses.count(200) < 48 - LIMIT
    assert [s for s, _ in uploads] == [413] * 24  # the cap is checked before the client limit: never buffered
    assert all("error" in b and b["error"]["message"] for _, b in uploads)
    assert router_peak < 400  # 96 MiB were sent: the cap refuses each upload before buffering it
