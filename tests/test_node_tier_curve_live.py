"""The node tier's KV events over ZMQ CURVE (issue 41): a real `warmfleet node-tier` with the replicas' flags
(--kv-events-curve-secret-key, --kv-events-curve-clients) sends its state only to subscribers holding a listed key; a
real `warmfleet route` with its CURVE keys follows it through --node-tier-events; a bad key file is one readable line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth

from warmfleet.livefleet import NodeTier, Router, wait_for
from warmfleet.localprocs import free_port
from warmfleet.server.events import AllBlocksCleared, BlockStored, decode
from warmfleet.server.nodetier.client import NodeTierClient
from warmfleet.server.router.core.subscriber import CurveKeys

pytestmark = pytest.mark.slow

KEY = b"\x07" * 32  # one KV block's key (a chain hash)


def make_keys(root: Path) -> dict[str, Path]:
    """The tier's pair (the replicas' pair in a cluster), the router's pair, and a clients directory with the
    router's public key only."""
    keys = {d: root / d for d in ("tier", "router", "clients")}
    for d in keys.values():
        d.mkdir()
    zmq.auth.create_certificates(keys["tier"], "replica")
    zmq.auth.create_certificates(keys["router"], "router")
    (keys["clients"] / "router.key").write_bytes((keys["router"] / "router.key").read_bytes())
    return keys


def curve_flags(keys: dict[str, Path]) -> tuple[str, ...]:
    return ("--kv-events-curve-secret-key", str(keys["tier"] / "replica.key_secret"),
            "--kv-events-curve-clients", str(keys["clients"]))


def subscriber(ctx: zmq.Context, endpoint: str, keys: CurveKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.apply(sock)
    sock.setsockopt(zmq.SUBSCRIBE, b"node:")  # a new subscription: the tier answers it with its whole state
    sock.connect(endpoint)
    return sock


def store_one_block(tier: NodeTier) -> None:
    client = NodeTierClient(tier.address, timeout_s=5.0)
    try:
        client.put_async([{"kind": "kv", "key": KEY, "layout": "L", "data": b"x" * 64}])
        assert client.flush()
        assert [bytes(v) for v in client.get("kv", [KEY], "L")] == [b"x" * 64]
    finally:
        client.close()


def test_only_a_subscriber_with_a_listed_key_gets_the_tiers_state(tmp_path):
    keys = make_keys(tmp_path)
    tier = NodeTier(tmp_path, "node-a", extra=curve_flags(keys))
    keyed = CurveKeys.from_files(str(keys["tier"] / "replica.key"), str(keys["router"] / "router.key_secret"))
    stranger_public, stranger_secret = zmq.curve_keypair()  # a well-formed key pair the tier was never given
    ctx = zmq.Context()
    socks = []
    try:
        tier.start()
        tier.wait_ready()
        store_one_block(tier)
        endpoint = f"tcp://{tier.events}"
        socks = [subscriber(ctx, endpoint, None),
                 subscriber(ctx, endpoint, CurveKeys(keyed.server_public, stranger_public, stranger_secret)),
                 subscriber(ctx, endpoint, keyed)]
        plain, stranger, router = socks
        assert router.poll(30_000), "the keyed subscriber received no state batch"
        batch = decode(router.recv_multipart())
        assert batch.replica_id == "node:node-a"
        assert isinstance(batch.events[0], AllBlocksCleared)  # its whole state, led by AllBlocksCleared
        assert [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes] == [KEY]
        # the state went out after the keyed subscription; the others' handshakes failed, so nothing reached them
        assert not plain.poll(1000) and not stranger.poll(0)
        assert tier.alive()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        tier.stop()


def test_a_router_with_its_keys_follows_a_curve_node_tier(tiny_model_dir, tmp_path):
    keys = make_keys(tmp_path)
    tier = NodeTier(tmp_path, "node-a", extra=curve_flags(keys))
    router = Router(tiny_model_dir, [], tmp_path, (
        "--replica", "http://127.0.0.1:1", "--node-tier-events", tier.events,
        "--kv-events-curve-server-key", str(keys["tier"] / "replica.key"),
        "--kv-events-curve-secret-key", str(keys["router"] / "router.key_secret")))
    try:
        tier.start()
        tier.wait_ready()
        store_one_block(tier)
        router.start()

        def synced_with_one_block() -> bool:
            (t,) = router.view()["node_tiers"]
            return t["node_tier"] == "node:node-a" and t["synced"] and t["blocks"] == 1

        wait_for(synced_with_one_block, "the router synced the CURVE node tier's state", [tier, router], 60)
    finally:
        router.stop()
        tier.stop()


@pytest.mark.parametrize("case", ["missing", "no-secret", "no-clients-dir", "alone"])
def test_a_bad_key_flag_is_one_readable_line(tmp_path, case):
    keys = make_keys(tmp_path)
    secret, clients = str(keys["tier"] / "replica.key_secret"), str(keys["clients"])
    flags = {"missing": ["--kv-events-curve-secret-key", str(tmp_path / "nope"), "--kv-events-curve-clients", clients],
             "no-secret": ["--kv-events-curve-secret-key", str(keys["tier"] / "replica.key"),
                           "--kv-events-curve-clients", clients],
             "no-clients-dir": ["--kv-events-curve-secret-key", secret, "--kv-events-curve-clients", str(tmp_path / "x")],
             "alone": ["--kv-events-curve-secret-key", secret]}[case]
    out = subprocess.run([sys.executable, "-m", "warmfleet.cli", "node-tier", "--capacity-bytes", "1048576", "--host",
                          "127.0.0.1", "--port", str(free_port()), "--events-port", str(free_port()), "--node-name", "n", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("warmfleet node-tier: error: --kv-events-curve-"), line
