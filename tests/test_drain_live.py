"""Drain before termination with real processes: two `warmfleet serve` replicas on the tiny checkpoint behind
`warmfleet route`. The router is told one replica is going (what a terminating endpoint does), then the replica
gets SIGTERM mid-stream: its readiness drops, new requests go to the other replica, the stream completes and
the process exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import threading
from urllib.parse import quote

import httpx
import pytest

from warmfleet.livefleet import LiveFleet, wait_for

pytestmark = pytest.mark.slow


def not_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code != 200
    except httpx.TransportError:  # the listening socket is closed: refused
        return True


def test_sigterm_mid_stream_after_the_router_drains_loses_nothing(tiny_model_dir, tmp_path):
    fleet = LiveFleet(tiny_model_dir, tmp_path, replica_args=("--max-model-len", "2048", "--drain-timeout-s", "60"))
    fleet.start()
    try:
        router = fleet.router.url
        chunks: list[dict] = []
        opened = threading.Event()
        victim: dict = {}

        def stream() -> None:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1500, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", router + "/v1/completions", json=body, timeout=120) as r:
                victim["id"] = r.headers["x-warmfleet-replica"]
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        opened.set()
                    elif line == "data: [DONE]":
                        chunks.append({"done": True})

        reader = threading.Thread(target=stream)
        reader.start()
        assert opened.wait(120), "the stream never started"
        rep = fleet.by_id(victim["id"])
        other = next(r for r in fleet.replicas if r is not rep)
        r = httpx.post(f"{router}/v1/router/replicas/{quote(rep.url, safe='')}/drain", timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "draining"
        os.kill(rep.popen.pid, signal.SIGTERM)  # what the kubelet does after the preStop hook
        wait_for(lambda: not_ready(rep.url), "the replica's readiness to drop", [], 60)
        during = len(chunks)
        assert not any("done" in c for c in chunks), "the stream ended before the replica stopped being ready"
        for i in range(4):  # new requests meanwhile: all answered, by the other replica
            r = httpx.post(router + "/v1/completions", json={"model": "tiny", "prompt": f"Question {i}",
                                                             "max_tokens": 4}, timeout=60)
            assert r.status_code == 200 and r.headers["x-warmfleet-replica"] == other.name
        reader.join(120)
        assert not reader.is_alive()
        assert len(chunks) > during  # tokens kept coming after the replica stopped taking new work
        assert chunks[-1] == {"done": True} and not any("error" in c for c in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
        assert finish == ["length"]
        assert rep.popen.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
        view = {x["id"]: x for x in fleet.router.view()["replicas"]}
        assert view[rep.url]["draining"] and view[rep.url]["in_flight"] == 0
    finally:
        fleet.close()
