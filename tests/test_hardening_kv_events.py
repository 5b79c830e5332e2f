"""KV-event hardening (issue 40): bounded queues per subscriber with drops counted, snapshot spam coalesced, CURVE."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from fakes import FakeEngine
from warmfleet.localprocs import free_port
from warmfleet.server.api.app import build_app
from warmfleet.server.config import EngineConfig
from warmfleet.server.engine.protocol import EngineStats
from warmfleet.server.events import BlockStored, EventPublisher, Load, decode
from warmfleet.server.tokenizer import Tokenizer

IDLE_SUBSCRIBERS = """
import sys, zmq
ctx = zmq.Context()
socks = []
for _ in range(50):  # subscribe, then never read: each holds one message and a small kernel buffer
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 65536)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(sys.argv[1])
    socks.append(s)
sys.stdin.read()
"""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def wait_for_handshakes(pub: EventPublisher, count: int) -> None:
    monitor = pub._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        for _ in range(count):
            assert monitor.poll(30_000), "subscribers did not connect"
            recv_monitor_message(monitor)
    finally:
        pub._sock.disable_monitor()
        monitor.close(0)


def test_fifty_idle_subscribers_leave_publisher_memory_bounded_and_are_counted():
    """5,000 batches of ~68 KB (340 MB in all) published to 50 subscribers that never read: the publisher keeps at
    most KV_EVENTS_SNDHWM batches for them (shared), so its memory grows far less than what it sent."""
    port = free_port()
    pub = EventPublisher("replica-a", f"tcp://127.0.0.1:{port}")
    subs = subprocess.Popen([sys.executable, "-c", IDLE_SUBSCRIBERS, f"tcp://127.0.0.1:{port}"], stdin=subprocess.PIPE)
    try:
        wait_for_handshakes(pub, 50)
        events = [BlockStored([i.to_bytes(32, "big") for i in range(2000)], None, [], 16)]
        for _ in range(10):
            pub.publish(events)
        before = rss_bytes()
        for _ in range(5000):
            pub.publish(events)
        grown = rss_bytes() - before
        assert grown < 160 << 20, f"publisher grew by {grown >> 20} MiB"
        assert pub.num_dropped >= 1
    finally:
        subs.stdin.close()
        subs.wait(30)
        pub.close()


def test_dropped_batches_are_a_counter_in_metrics(tiny_model_dir):
    class FakeDroppingEngine(FakeEngine):
        async def stats(self) -> EngineStats:
            stats = await super().stats()
            stats.kv_events_dropped = 3
            return stats

    tok = Tokenizer(tiny_model_dir)
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(tiny_model_dir), "tiny"

    async def scrape() -> str:
        app = build_app(FakeDroppingEngine(tok, tiny_model_dir), tok, cfg)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
            return (await c.get("/metrics")).text

    assert 'warmfleet:kv_events_dropped_total{model_name="tiny"} 3.0' in asyncio.run(scrape())


async def test_snapshot_spam_reaches_the_engine_one_call_at_a_time(tiny_model_dir):
    """50 concurrent snapshot requests: every one answered, the engine never runs two snapshots at once and runs far
    fewer than 50; the callers that arrived during the first share the next (taken after they arrived)."""

    class FakeSlowSnapshotEngine(FakeEngine):
        calls = in_flight = max_in_flight = 0
        release = asyncio.Event()

        async def snapshot(self) -> dict:
            self.calls += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await self.release.wait()
            self.in_flight -= 1
            return {**await super().snapshot(), "seq": self.calls}

    tok = Tokenizer(tiny_model_dir)
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(tiny_model_dir), "tiny"
    engine = FakeSlowSnapshotEngine(tok, tiny_model_dir)
    app = build_app(engine, tok, cfg)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=60) as c:
        first = asyncio.create_task(c.get("/v1/kv/snapshot"))
        while engine.calls == 0:
            await asyncio.sleep(0.01)
        rest = [asyncio.create_task(c.get("/v1/kv/snapshot")) for _ in range(49)]
        await asyncio.sleep(0.2)  # let them reach the server while the first snapshot runs
        engine.release.set()
        answers = await asyncio.gather(first, *rest)
    assert all(r.status_code == 200 for r in answers)
    assert answers[0].json()["seq"] == 1 and all(r.json()["seq"] >= 2 for r in answers[1:])
    assert engine.max_in_flight == 1 and engine.calls < 10


def test_curve_admits_only_listed_subscribers(tmp_path):
    for d in ("server", "allowed", "other"):
        (tmp_path / d).mkdir()
    zmq.auth.create_certificates(tmp_path / "server", "server")
    zmq.auth.create_certificates(tmp_path / "allowed", "router")
    zmq.auth.create_certificates(tmp_path / "other", "intruder")
    server_public, _ = zmq.auth.load_certificate(tmp_path / "server" / "server.key")
    port = free_port()
    pub = EventPublisher("replica-a", f"tcp://127.0.0.1:{port}",
                         curve_secret_key_file=str(tmp_path / "server" / "server.key_secret"),
                         curve_clients_dir=str(tmp_path / "allowed"))
    ctx = zmq.Context()

    def subscriber(cert=None):
        s = ctx.socket(zmq.SUB)
        if cert is not None:
            s.curve_publickey, s.curve_secretkey = zmq.auth.load_certificate(cert)
            s.curve_serverkey = server_public
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{port}")
        return s

    router = subscriber(tmp_path / "allowed" / "router.key_secret")
    plain = subscriber()
    intruder = subscriber(tmp_path / "other" / "intruder.key_secret")
    try:
        deadline = time.monotonic() + 30
        while not router.poll(50):
            pub.publish([Load(0, 0, 8, 8)])
            assert time.monotonic() < deadline, "the listed subscriber never received an event"
        for _ in range(50):
            pub.publish([Load(1, 0, 8, 8)])
        got = [decode(router.recv_multipart()) for _ in range(50)]  # all reach the listed subscriber
        assert got and all(b.replica_id == "replica-a" for b in got)
        assert not plain.poll(200) and not intruder.poll(200)
    finally:
        for s in (router, plain, intruder):
            s.close(0)
        ctx.term()
        pub.close()
