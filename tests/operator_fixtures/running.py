"""The operator run in-process (kopf) against an emulated cluster, and polling for what it then does."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable

import kmock
import kopf

from warmfleet.operator.handlers import make_registry


@contextlib.asynccontextmanager
async def run_operator(cluster: kmock.KubernetesEmulator, timeout_s: float, **options: Any) -> AsyncIterator[asyncio.Task]:
    """The operator (make_registry with `options`) logged in to `cluster` until the block ends; `timeout_s` bounds
    its start and its stop."""
    registry = make_registry(default_image="img:test", login=lambda **_: kopf.ConnectionInfo(server=str(cluster.url)),
                             **options)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, clusterwide=True, standalone=True,
                                             stop_flag=stop, ready_flag=ready, liveness_endpoint=None))
    await asyncio.wait_for(ready.wait(), timeout_s)
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout_s)


async def poll(check: Callable[[], Any], timeout_s: float, interval_s: float = 0.02) -> Any:
    """`check()`'s first truthy value within `timeout_s` (a lookup that fails counts as not yet), else None.

    The sleep only yields to the operator's tasks: the condition decides, not the delay.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except (KeyError, TypeError, LookupError):
            value = None
        if value:
            return value
        await asyncio.sleep(interval_s)
    return None
