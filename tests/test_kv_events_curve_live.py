"""KV events over ZMQ CURVE end to end: a real `warmfleet serve` replica publishing as a CURVE server, a real
`warmfleet route` subscribing with the fleet's server key and its own key pair, and an unauthenticated subscriber
beside it that receives nothing."""

from __future__ import annotations

import httpx
import pytest
import zmq
import zmq.auth

from warmfleet.livefleet import Replica, Router, metric, wait_for

pytestmark = pytest.mark.slow

PROMPT = "CURVE keeps the block hashes of one fleet away from pods that were never listed. " * 8


def index_blocks(router: Router) -> float:
    return metric(router.metrics(), "warmfleet_router_index_blocks") or 0.0


def resyncs(router: Router) -> float:
    """Snapshot resyncs of every cause."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in router.metrics().splitlines()
               if line.startswith("warmfleet_router_resyncs_total{"))


def test_the_router_with_keys_indexes_events_and_a_plain_subscriber_gets_nothing(tiny_model_dir, tmp_path):
    keys = {d: tmp_path / d for d in ("replica", "clients", "router")}
    for d in keys.values():
        d.mkdir()
    zmq.auth.create_certificates(keys["replica"], "replica")
    zmq.auth.create_certificates(keys["router"], "router")
    (keys["clients"] / "router.key").write_bytes((keys["router"] / "router.key").read_bytes())  # public only
    replica = Replica("r0", tiny_model_dir, tmp_path, (
        "--kv-events-curve-secret-key", str(keys["replica"] / "replica.key_secret"),
        "--kv-events-curve-clients", str(keys["clients"])))
    router = Router(tiny_model_dir, [replica], tmp_path, (
        "--kv-events-curve-server-key", str(keys["replica"] / "replica.key"),
        "--kv-events-curve-secret-key", str(keys["router"] / "router.key_secret")))
    ctx = zmq.Context()
    plain = ctx.socket(zmq.SUB)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        replica.start()
        replica.wait_ready()
        router.start()
        router.wait_synced()
        plain.connect(replica.events)
        before_blocks, before_resyncs = index_blocks(router), resyncs(router)
        # straight to the replica: the router learns of the new blocks only from the event stream
        r = httpx.post(replica.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        wait_for(lambda: index_blocks(router) > before_blocks, "the router indexed the replica's new blocks",
                 [replica, router], 60)
        assert resyncs(router) == before_resyncs  # from events, not from a snapshot
        assert not plain.poll(1000)  # the unlisted subscriber got nothing, though batches went out
    finally:
        plain.close(0)
        ctx.term()
        router.stop()
        replica.stop()


def test_one_key_file_without_the_other_is_a_readable_error(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "warmfleet.cli", "route", "--model", str(tiny_model_dir),
                          "--replica", "http://127.0.0.1:1", "--kv-events-curve-server-key", str(tmp_path / "k")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--kv-events-curve-server-key and --kv-events-curve-secret-key go together" in out.stderr
    assert "Traceback" not in out.stderr
