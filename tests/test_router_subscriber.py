"""The router's KV-event subscriber drains a burst in order, keeps listening after it, and survives bad frames."""

from __future__ import annotations

import asyncio

import zmq

from warmfleet.server.events import EventBatch, Load, decode, encode
from warmfleet.server.router.core.subscriber import DRAIN_BATCH, EventSubscriber, cancel

from waiting import until


async def test_a_burst_arrives_whole_and_in_order_and_the_feed_goes_on():
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    seen, bad, connects = [], [], []
    sub = EventSubscriber(endpoint, decode, seen.append, lambda: connects.append(1), bad.append)
    task = asyncio.create_task(sub.run())
    try:
        seq = 0

        def send(frames=None):
            nonlocal seq
            seq += 1
            pub.send_multipart(frames or encode(EventBatch("r", seq, [Load(seq, 0, 1, 2)])))

        await until(lambda: connects, "the subscriber connected")
        while not seen:  # PUB/SUB joins asynchronously: the first messages may be dropped
            send()
            await asyncio.sleep(0.01)
        start = seq
        burst = 20 * DRAIN_BATCH  # drained in many turns of the loop
        for _ in range(burst):
            send()
        send([b"r", b"short", b"x"])  # malformed: counted, not fatal
        await until(lambda: seen[-1].seq == start + burst, "the whole burst", timeout_s=10)
        tail = [b.seq for b in seen if b.seq > start]
        assert tail == list(range(start + 1, start + burst + 1))
        await until(lambda: len(bad) == 1, "the malformed message counted")
        assert isinstance(bad[0], ValueError)
        await asyncio.sleep(0.05)  # the socket drained and went back to polling; a later message still arrives
        send()
        await until(lambda: seen[-1].seq == seq, "a message after the burst")
    finally:
        await cancel(task)
        pub.close(0)
