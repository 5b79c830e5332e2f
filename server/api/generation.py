"""Runs the engine requests behind one API request (n choices × prompts) and merges their deltas; no FastAPI.

Every engine request is pumped by its own task into one queue, so choices stream as they are
produced. Whoever stops consuming (client gone, stop string hit, error) ends the pumps, and every
engine request that did not finish on its own is aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import anyio

from ..engine.protocol import EngineClient, GenerateRequest
from ..outputs import Delta, EngineError, OutputStream
from .metrics import Metrics

log = logging.getLogger("warmfleet.api")


@dataclass
class Choice:
    """One engine request and the state of its output."""

    index: int  # choice index in the response
    prompt_index: int  # which prompt of the request it continues
    request: GenerateRequest
    stream: OutputStream
    arrival_s: float = field(default_factory=time.monotonic)
    last_token_s: Optional[float] = None


class _PumpDone:
    """Queue marker: one choice's pump has ended normally."""


async def stream_choices(engine: EngineClient, choices: list[Choice], metrics: Metrics) -> AsyncIterator[tuple[Choice, Delta]]:
    """Yield (choice, delta) as the engine produces them until every choice has finished."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(engine, c, queue, metrics)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, _PumpDone):
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # the pumps' aborts must run even when we are being cancelled
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(engine: EngineClient, choice: Choice, queue: asyncio.Queue, metrics: Metrics) -> None:
    gen = engine.generate(choice.request)
    s = choice.stream
    try:
        async for out in gen:
            delta = s.push(out)
            _observe(choice, delta, metrics)
            await queue.put((choice, delta))
            if s.finished:
                break
        if not s.finished:
            raise EngineError("engine stream ended before the request finished")
        queue.put_nowait(_PumpDone())
    except EngineError as exc:
        queue.put_nowait(exc)
    except Exception as exc:  # a dead or misbehaving engine: report it, never leave the consumer waiting
        log.warning("engine request %s failed", choice.request.request_id, exc_info=True)
        queue.put_nowait(EngineError(f"{type(exc).__name__}: {exc}"))
    finally:
        if not s.finished:
            metrics.finished("abort")
        closer = getattr(gen, "aclose", None)
        with anyio.CancelScope(shield=True):
            if closer is not None:
                await closer()
            if not s.engine_finished:
                await _abort(engine, choice.request.request_id)


async def _abort(engine: EngineClient, request_id: str) -> None:
    try:
        await engine.abort(request_id)
    except Exception:  # an abort that fails must not hide the response; the engine logs its own side
        log.warning("abort of %s failed", request_id, exc_info=True)


def _observe(choice: Choice, delta: Delta, metrics: Metrics) -> None:
    now = time.monotonic()
    if delta.token_ids:
        metrics.generation_tokens.inc(len(delta.token_ids))
        if choice.last_token_s is None:
            metrics.ttft.observe(now - choice.arrival_s)
            metrics.prompt_tokens.inc(choice.stream.num_prompt_tokens)
        else:
            per_token = (now - choice.last_token_s) / len(delta.token_ids)
            for _ in delta.token_ids:
                metrics.itl.observe(per_token)
        choice.last_token_s = now
    if delta.finish_reason is not None:
        metrics.e2e.observe(now - choice.arrival_s)
        metrics.finished(delta.finish_reason)
