"""The operator run in-process (kopf) against an emulated cluster: each operator on an event loop and a thread of its own.

Why not on the test's loop: when kopf.operator() stops, it takes every task created in its event loop since it
started for one of its own, waits 5 s for them, then cancels them all and waits for them without a bound
(kopf's run_tasks). On a shared loop that sweep hits whatever else runs there: the emulator's request handlers
(5 s of every stop), and, with two operators, the other operator's internals. Cancelling the cleaner task of
the other operator's watcher Scheduler leaves that watcher in Scheduler.close() for good (the close waits for a
notification only the cleaner sends, and the watcher shields the close from cancellation), so the first stop
waits on it forever and so does the second. Whether a worker is still running at that moment is timing, hence
a hang seen only on a busy machine. On its own loop an operator's sweep finds only its own tasks, as in
production (`warmfleet operator` runs kopf under asyncio.run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
from typing import Any, AsyncIterator

import kmock
import kopf

from warmfleet.operator.wiring.handlers import make_registry

_numbers = itertools.count(1)


class InProcessOperator:
    """kopf.operator(registry) on a new event loop in a daemon thread; started, stopped or killed from the test's loop."""

    def __init__(self, registry: kopf.OperatorRegistry) -> None:
        self.loop = asyncio.new_event_loop()
        self._stop_flag = asyncio.Event()  # set on self.loop only (call_soon_threadsafe)
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()  # kopf raises it from its thread
        self._done: concurrent.futures.Future[str] = concurrent.futures.Future()  # "stopped" | "killed" | the error
        self._task = self.loop.create_task(kopf.operator(
            registry=registry, clusterwide=True, standalone=True, stop_flag=self._stop_flag, ready_flag=self._ready,
            liveness_endpoint=None))
        self._thread = threading.Thread(target=self._run, name=f"kopf-operator-{next(_numbers)}", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        outcome: str | BaseException = "stopped"
        try:
            self.loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            outcome = "killed"
        except BaseException as exc:  # the operator crashed: the test's stop raises it
            outcome = exc
        finally:
            try:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()
                if isinstance(outcome, BaseException):
                    self._done.set_exception(outcome)
                else:
                    self._done.set_result(outcome)

    async def start(self, timeout_s: float) -> None:
        """Start the thread; return once kopf's startup handlers ran (its ready flag), else raise."""
        self._thread.start()
        ready, done = asyncio.wrap_future(self._ready), asyncio.wrap_future(self._done)
        finished, _ = await asyncio.wait({ready, done}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if ready not in finished:
            if done in finished:
                raise RuntimeError(f"the operator ended before it was ready: {done.result()}")  # or raises its error
            raise TimeoutError(f"the operator was not ready within {timeout_s} s; its tasks: {await self.tasks()}")

    async def stop(self, timeout_s: float) -> None:
        """Raise kopf's stop flag (a graceful stop: cleanup handlers run) and wait for the thread to end."""
        self._call(self._stop_flag.set)
        outcome = await self._finished(timeout_s)
        if outcome != "stopped":
            raise RuntimeError(f"the operator ended {outcome} instead of stopping")

    async def kill(self, timeout_s: float) -> None:
        """Cancel the operator's task (no cleanup, as a killed process) and wait for the thread to end, however it ends."""
        self._call(self._task.cancel)
        with contextlib.suppress(Exception):  # a killed operator may end with an error: that is the point
            await self._finished(timeout_s)
        if not self._done.done():
            raise TimeoutError(f"the killed operator did not end within {timeout_s} s; its tasks: {await self.tasks()}")

    async def _finished(self, timeout_s: float) -> str:
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._done)), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the operator did not stop within {timeout_s} s; its tasks: {await self.tasks()}") from None

    def _call(self, fn: Any) -> None:
        if not self._done.done():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the operator has ended anyway
                self.loop.call_soon_threadsafe(fn)

    async def tasks(self) -> list[str]:
        """The operator loop's pending tasks, each with where it waits (for a failure message)."""
        if self._done.done():
            return []
        answer: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self._call(lambda: answer.set_result(sorted(f"{t.get_name()} at {_where(t)}" for t in asyncio.all_tasks(self.loop))))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(answer), 5)
        except TimeoutError:
            return ["(the operator's loop does not answer: blocked)"]


def _where(task: asyncio.Task) -> str:
    """The innermost coroutine frame a task waits in."""
    coro, where = task.get_coro(), "?"
    for _ in range(50):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        where = f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno})"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return where


@contextlib.asynccontextmanager
async def run_operator(cluster: kmock.KubernetesEmulator, timeout_s: float, **options: Any) -> AsyncIterator[InProcessOperator]:
    """The operator (make_registry with `options`) logged in to `cluster` until the block ends; `timeout_s` bounds
    its start and its stop."""
    operator = InProcessOperator(make_operator_registry(cluster, **options))
    try:
        await operator.start(timeout_s)
        yield operator
    finally:
        await operator.stop(timeout_s)


def make_operator_registry(cluster: kmock.KubernetesEmulator, **options: Any) -> kopf.OperatorRegistry:
    """The operator's registry (make_registry with `options`), logging in to `cluster`. The tests' fake hubs and
    stores listen on loopback, which the admin allows here (the operator refuses private endpoints by default)."""
    os.environ["WARMFLEET_ALLOWED_ENDPOINT_HOSTS"] = "127.0.0.1,::1,localhost"
    return make_registry(default_image="img:test", login=lambda **_: kopf.ConnectionInfo(server=str(cluster.url)),
                         **options)
