"""A well-behaved client's latency while another client floods the router, with and without per-client limits.

    python bench/flood.py [--requests N] [--flood C] [--json] [--model DIR] [--out FILE]

One real `warmfleet serve` (tiny Qwen2 checkpoint by default) behind two `warmfleet route`
processes on loopback, both with API keys "good" and "flooder": one with
`--max-concurrent-per-client 4 --max-request-bytes 1048576` ("limited"), one without limits
("open"). Three phases, one after the other: the good client alone; the good client while the
flooder keeps `--flood` chat requests (256 tokens each) plus 4 uploads of 4 MiB in flight through
the limited router; the same flood through the open router. The good client sends `--requests`
short chats one after another in each phase.

Reports (JSON, last stdout line with --json; a PNG beside --out): per phase the good client's
p50 / p99 / max latency and failures, the flooder's requests by status. `targets`: good client never
fails in any phase; with limits its p99 stays within 3x of its p99 alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from warmfleet.livefleet import MODEL_NAME, LiveFleet, Router

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

GOOD, FLOODER = "good", "flooder"


def model_dir(arg: str | None) -> Path:
    return harness.model_dir(arg, "tiny", "qwen2")


def chat(text: str, max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


async def good_client(url: str, n: int) -> tuple[list[float], int]:
    lat, failed = [], 0
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n):
            t0 = time.monotonic()
            r = await c.post(url + "/v1/chat/completions", json=chat(f"polite question {i}", 8),
                             headers={"Authorization": f"Bearer {GOOD}"})
            lat.append(time.monotonic() - t0)
            failed += r.status_code != 200
    return lat, failed


async def flooder(url: str, concurrency: int, stop: asyncio.Event, statuses: dict) -> None:
    headers = {"Authorization": f"Bearer {FLOODER}"}

    async def loop(c: httpx.AsyncClient, i: int, upload: bool) -> None:
        while not stop.is_set():
            try:
                if upload:
                    r = await c.post(url + "/v1/chat/completions", content=b'{"messages": [' + b" " * (4 << 20) + b"]}",
                                     headers={**headers, "content-type": "application/json"})
                else:
                    r = await c.post(url + "/v1/chat/completions", json=chat(f"flood {i}", 256), headers=headers)
                key = str(r.status_code)
                if r.status_code == 429:
                    await asyncio.sleep(0.01)  # a flooder that does not back off, but lets the event loop breathe
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        await asyncio.gather(*(loop(c, i, False) for i in range(concurrency)), *(loop(c, i, True) for i in range(4)))


def stats(lat: list[float], failed: int) -> dict:
    a = np.asarray(lat) * 1000
    return {"n": len(lat), "failed": failed, "p50_ms": round(float(np.median(a)), 1),
            "p99_ms": round(float(np.quantile(a, 0.99)), 1), "max_ms": round(float(a.max()), 1)}


async def run(limited: str, open_: str, n: int, concurrency: int) -> dict:
    out = {"alone": stats(*await good_client(limited, n))}
    for name, url in (("flood_limited", limited), ("flood_open", open_)):
        stop, statuses = asyncio.Event(), {}
        task = asyncio.create_task(flooder(url, concurrency, stop, statuses))
        await asyncio.sleep(2.0)  # the flood is under way
        out[name] = stats(*await good_client(url, n))
        stop.set()
        await task
        out[name]["flooder_statuses"] = statuses
        print(f"[flood] {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["alone", "flood_limited", "flood_open"]
    x = np.arange(len(phases))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, [res[p]["p50_ms"] for p in phases], 0.4, label="p50")
    ax.bar(x + 0.2, [res[p]["p99_ms"] for p in phases], 0.4, label="p99")
    ax.set_xticks(x, phases)
    ax.set_ylabel("good client latency (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40, help="good client's requests per phase")
    ap.add_argument("--flood", type=int, default=32, help="flooder's concurrent chat requests")
    ap.add_argument("--model", help="a Qwen2 checkpoint (default: the tiny one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here, and the PNG beside it")
    args = ap.parse_args()

    cwd = Path(tempfile.mkdtemp(prefix="warmfleet-flood-"))
    model = model_dir(args.model)
    keys = ("--api-key", GOOD, "--api-key", FLOODER)
    fleet = LiveFleet(model, cwd, n=1, router_args=(*keys, "--max-concurrent-per-client", "4",
                                                    "--max-request-bytes", str(1 << 20)))
    open_router = Router(model, fleet.replicas, cwd, keys)
    open_router.name = "router-open"
    try:
        fleet.start()
        open_router.start()
        open_router.wait_synced()
        res = asyncio.run(run(fleet.router.url, open_router.url, args.requests, args.flood))
    finally:
        open_router.stop()
        fleet.close()
    res["targets"] = {
        "good_client_never_fails": all(res[p]["failed"] == 0 for p in ("alone", "flood_limited", "flood_open")),
        "limited_p99_within_3x_alone": res["flood_limited"]["p99_ms"] <= 3 * res["alone"]["p99_ms"],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
        plot(res, Path(args.out).with_suffix(".png"))
    print(json.dumps(res, indent=None if args.json else 2))
    return 0 if all(res["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
