"""Coalesces `GET /v1/kv/snapshot` calls so snapshot spam cannot stall the engine core's step loop; no engine import.

A snapshot walks every cached block inside the engine core, between two steps. Each HTTP request used to cost
one; now at most one runs at a time, the next starts at least MIN_INTERVAL_S after the previous ended, and
every caller that arrives meanwhile shares that next one. A caller never gets a snapshot that began before it
arrived, so its `seq` still covers every event the caller had seen (a router resyncing after a gap).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

MIN_INTERVAL_S = 0.25  # the engine core spends at most snapshot / (snapshot + this) of its time on snapshots


class SnapshotGate:
    """At most one engine snapshot in flight; callers arriving while one runs share the next."""

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S):
        self.min_interval_s = min_interval_s
        self._lock = asyncio.Lock()
        self._next: Optional[asyncio.Future] = None  # the snapshot callers arriving now will get (not started)
        self._last_end = float("-inf")
        self._tasks: set[asyncio.Task] = set()

    async def get(self, engine: Any) -> dict:
        """The engine's snapshot, taken after this call began."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._take(engine, self._next))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(self._next)

    async def _take(self, engine: Any, fut: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        async with self._lock:
            wait = self._last_end + self.min_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._next = None  # from here on, arrivals wait for the one after this
            try:
                result = await engine.snapshot()
            except Exception as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved here: every caller may have gone
            else:
                fut.set_result(result)
            finally:
                self._last_end = loop.time()
