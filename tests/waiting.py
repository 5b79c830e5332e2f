"""Waiting in tests for a condition with a deadline, never for a fixed time."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import httpx


async def until(pred: Callable[[], Any], what: str, timeout_s: float = 5.0, interval_s: float = 0.005) -> float:
    """Wait for `pred()` to be truthy; returns the seconds it took. After `timeout_s`: AssertionError naming `what`."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval_s)
    return time.monotonic() - t0


async def poll(check: Callable[[], Any], timeout_s: float, interval_s: float = 0.02) -> Any:
    """`check()`'s first truthy value within `timeout_s` (a lookup that fails counts as not yet), else None.

    The sleep only yields to the tasks under test: the condition decides, not the delay.
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


async def apoll(pred: Callable[[], Awaitable[Any]], what: str, timeout_s: float, poll_s: float = 0.01) -> float:
    """Await `pred()` until truthy (an HTTP error or a bad answer counts as not yet); returns the seconds it took.
    After `timeout_s`: AssertionError naming `what`."""
    t0 = time.monotonic()
    while True:
        try:
            if await pred():
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError, StopIteration):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)
