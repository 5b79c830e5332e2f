"""Clients that stop reading or vanish mid-stream.

  * A client that opens a stream and never reads (a raw socket with a 4 KiB receive buffer) does
    not stall anyone else: other clients' requests through the router and straight to the
    replicas complete normally. The stalled streams are fat (top-20 logprobs, ~1.7 KB a token) and
    long enough to fill the server's kernel send buffer (Linux autotunes it up to 4 MiB, which
    would otherwise absorb the whole stream): the others run only once that buffer has stopped
    growing, i.e. once the router's relay (and the replica's SSE writer) is really blocked.
  * A client that disconnects mid-stream frees its request everywhere: the router's in-flight
    gauge returns to 0, and the replica aborts the request (`vllm:request_success{finished_reason=
    "abort"}`), leaving no request running and every KV block free or merely cached
    (`warmfleet:kv_blocks{tier="gpu",state="free"}` back to the total).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import socket
import struct
import termios
import time

import httpx
import pytest

from bench_scripts import load_bench
from warmfleet.livefleet import MODEL_NAME, metric
from waiting import apoll

chatload = load_bench("chatload.py")
pytestmark = pytest.mark.slow

LONG_TOKENS = 3600  # ~6 MB of top-20 events: more than a socket's largest send buffer (tcp_wmem max 4 MiB)


def long_stream_body(system: str, question: str, max_tokens: int = LONG_TOKENS) -> dict:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": True, "top_logprobs": 20,  # fat events (~1.7 KB a token)
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def open_unread_stream(base_url: str, body: dict) -> socket.socket:
    """POST a streaming request on a raw socket that will never be read (tiny receive buffer)."""
    host, port = base_url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    s.connect((host, int(port)))
    raw = json.dumps(body).encode()
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


def unread_bytes(s: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def send_queue(server_port: int, client_port: int) -> int:
    """Bytes the server side of a loopback connection has queued but the client has not taken (/proc/net/tcp)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == server_port and int(f[2].split(":")[1], 16) == client_port:
            return int(f[4].split(":")[0], 16)
    return 0


async def send_buffer_full(server_port: int, s: socket.socket) -> bool:
    """The server's send queue to `s` is large and stopped growing: its writer is blocked in the process."""
    port = s.getsockname()[1]
    first = send_queue(server_port, port)
    await asyncio.sleep(1.0)
    return first > 1 << 20 and send_queue(server_port, port) == first


def close_abruptly(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, as a client that vanished
    s.close()


async def test_a_client_that_stops_reading_stalls_nobody(fleet):
    router, replicas = fleet.router, fleet.replicas
    systems = chatload.tenant_systems()
    # one stalled reader through the router, one straight on a replica
    stalled = [open_unread_stream(router.url, long_stream_body(systems[0], "stall through the router")),
               open_unread_stream(replicas[0].url, long_stream_body(systems[1], "stall this replica"))]
    try:
        for server_port, s in zip((router.port, replicas[0].port), stalled):
            await apoll(lambda: send_buffer_full(server_port, s), "a stalled stream filling its send buffer", 120)
        before = [unread_bytes(s) for s in stalled]
        queued = [send_queue(port, s.getsockname()[1]) for port, s in zip((router.port, replicas[0].port), stalled)]
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as c:
            jobs = []
            for i in range(8):  # through the router, and straight to each replica, streaming or not
                for base in (router.url, *(r.url for r in replicas)):
                    msgs = [{"role": "system", "content": systems[i % len(systems)]},
                            {"role": "user", "content": f"question {i} while someone stalls"}]
                    jobs.append(chatload.send_chat(c, base, msgs, i % 2 == 1, 24, chatload.Outcome(i, i % 2 == 1, time.monotonic())))
            outs = await asyncio.gather(*jobs)
        assert all(o.ok for o in outs), [(o.error, o.status) for o in outs if not o.ok]
        # the stalled clients were still stalled (nothing read, still open) the whole time
        assert all(unread_bytes(s) >= b for s, b in zip(stalled, before))
        view = {r["id"]: r for r in router.view()["replicas"]}
        assert sum(r["in_flight"] for r in view.values()) >= 1, "the router dropped the stalled stream"
    finally:
        for s in stalled:
            close_abruptly(s)
    slowest = max(o.latency_s for o in outs)
    # and once they vanish, nothing stays held
    await _wait_idle(fleet, timeout_s=60)
    print(f"\nstalled readers: {len(outs)} other requests all completed (slowest {slowest:.2f} s) while 2 streams "
          f"sat unread with full send buffers (router {queued[0] >> 10} KiB, replica {queued[1] >> 10} KiB queued)")


async def test_a_client_that_vanishes_mid_stream_frees_its_blocks(fleet):
    router = fleet.router
    async with httpx.AsyncClient(timeout=30) as c:
        aborts_before = {r.url: await _aborts(c, r.url) for r in fleet.replicas}
        body = long_stream_body(chatload.tenant_systems()[2], "vanish halfway")
        async with c.stream("POST", router.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            replica = fleet.by_id(r.headers["x-warmfleet-replica"])
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 5:
                    break
            # mid-stream: the request holds KV blocks on the replica and a slot in the router
            text = (await c.get(replica.url + "/metrics")).text
            assert metric(text, "vllm:num_requests_running") >= 1
            assert metric(text, "warmfleet:kv_blocks", tier="gpu", state="free") < \
                metric(text, "warmfleet:kv_blocks", tier="gpu", state="total")
            t_gone = time.monotonic()
        # leaving the block closes the connection with the stream unread
        took = await _wait_idle(fleet, timeout_s=30)
        assert await _aborts(c, replica.url) == aborts_before[replica.url] + 1  # aborted, not run to its end
    print(f"\nvanished client: request aborted and its blocks freed {took:.2f} s after the disconnect "
          f"({time.monotonic() - t_gone:.2f} s to confirm)")


async def _aborts(c: httpx.AsyncClient, replica_url: str) -> float:
    text = (await c.get(replica_url + "/metrics")).text
    return metric(text, "vllm:request_success_total", finished_reason="abort") or 0.0


async def _wait_idle(fleet, timeout_s: float) -> float:
    """Until the router holds nothing in flight and every replica runs nothing and has every GPU block free."""
    async with httpx.AsyncClient(timeout=10) as c:
        async def idle() -> bool:
            rtext = (await c.get(fleet.router.url + "/metrics")).text
            if (metric(rtext, "warmfleet_router_replica_in_flight") or 0) != 0:
                return False
            for r in fleet.replicas:
                text = (await c.get(r.url + "/metrics")).text
                if metric(text, "vllm:num_requests_running") or metric(text, "vllm:num_requests_waiting"):
                    return False
                if metric(text, "warmfleet:kv_blocks", tier="gpu", state="free") != \
                        metric(text, "warmfleet:kv_blocks", tier="gpu", state="total"):
                    return False
            return True

        return await apoll(idle, "router and replicas idle, every KV block free", timeout_s, poll_s=0.05)
