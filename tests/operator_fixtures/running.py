"""The operator run in-process (kopf) against an emulated cluster."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

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
