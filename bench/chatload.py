"""A steady closed-loop load of chat requests (non-streaming and streaming) from a few clients, every outcome recorded (bench/soak.py, tests/reliability).

Each client sends one request at a time, alternating non-streaming and streaming, over a seeded
mix of tenant system prompts (shared prefixes, so replicas' caches matter) and fresh questions.
Nothing is retried by the client: the router's retries are what is measured.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from warmfleet.livefleet import MODEL_NAME

WORDS = "cache block prefix replica router token engine swap tier image tenant stream batch fault kill".split()


def tenant_systems(n: int = 6, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Tenant {t} policy: " + " ".join(rng.choice(WORDS) for _ in range(90)) for t in range(n)]


def question(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(8 + rng.randrange(8))) + "?"


@dataclass
class Outcome:
    """One request as its client saw it."""

    client: int
    stream: bool
    t_start: float  # time.monotonic() when sent
    t_end: float = 0.0  # when the last byte (or the error) arrived
    status: Optional[int] = None  # HTTP status of the response head; None if none arrived
    error: Optional[str] = None  # None: a full answer; else "http 5xx", "stream error", "stream cut", "timeout", ...
    replica: Optional[str] = None  # x-warmfleet-replica (the replica id that answered)
    route: Optional[str] = None  # x-warmfleet-route (decision reason; "retry" after a failed attempt)
    t_first_byte: Optional[float] = None  # streams: when the first event arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tail: list = field(default_factory=list)  # streams: the last two `data:` payloads (dicts or "[DONE]")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.t_end - self.t_start


def error_class(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    return "transport " + type(exc).__name__


async def send_chat(client: httpx.AsyncClient, base: str, messages: list[dict], stream: bool, max_tokens: int,
                    out: Outcome) -> Outcome:
    """POST one chat request and fill `out`; never raises for HTTP or transport failures."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            out.replica = r.headers.get("x-warmfleet-replica")
            out.route = r.headers.get("x-warmfleet-route")
            if r.status_code != 200:
                await r.aread()
                out.error = f"http {r.status_code}"
            elif not stream:
                usage = json.loads(await r.aread()).get("usage") or {}
                out.prompt_tokens = usage.get("prompt_tokens", 0)
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if out.t_first_byte is None:
                        out.t_first_byte = time.monotonic()
                    data = line[6:]
                    ev = data if data == "[DONE]" else json.loads(data)
                    out.tail = (out.tail + [ev])[-2:]
                    if isinstance(ev, dict) and ev.get("usage"):
                        out.prompt_tokens = ev["usage"]["prompt_tokens"]
                        out.cached_tokens = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if any(isinstance(ev, dict) and "error" in ev for ev in out.tail):
                    out.error = "stream error"
                elif out.tail[-1:] != ["[DONE]"]:
                    out.error = "stream cut"
    except httpx.HTTPError as exc:
        out.error = error_class(exc)
    out.t_end = time.monotonic()
    return out


class SteadyLoad:
    """`clients` closed-loop clients against `base` until `stop()`; outcomes in `self.outcomes` (in end order)."""

    def __init__(self, base: str, clients: int = 4, seed: int = 0, max_tokens: int = 16, stream_max_tokens: int = 48,
                 timeout_s: float = 60.0, systems: Optional[list[str]] = None):
        self.base, self.clients, self.seed = base, clients, seed
        self.max_tokens, self.stream_max_tokens, self.timeout_s = max_tokens, stream_max_tokens, timeout_s
        self.systems = systems or tenant_systems()
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._paused = asyncio.Event()
        self._paused.set()  # set = running
        self._tasks: list[asyncio.Task] = []
        self._open = 0  # requests in flight

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        self._paused.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes

    async def pause(self) -> None:
        """Stop sending new requests and wait for the open ones to finish."""
        self._paused.clear()
        while self._open:
            await asyncio.sleep(0.01)

    def resume(self) -> None:
        self._paused.set()

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        timeout = httpx.Timeout(self.timeout_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            n = 0
            while not self._stop.is_set():
                await self._paused.wait()
                if self._stop.is_set():
                    break
                stream = (n + i) % 2 == 1
                n += 1
                messages = [{"role": "system", "content": rng.choice(self.systems)},
                            {"role": "user", "content": question(rng)}]
                self._open += 1
                out = await send_chat(client, self.base, messages, stream,
                                      self.stream_max_tokens if stream else self.max_tokens,
                                      Outcome(i, stream, time.monotonic()))
                self._open -= 1
                self.outcomes.append(out)
                if out.error == "connect":  # nothing listening (a router restart): do not spin
                    await asyncio.sleep(0.02)

    async def wait_for(self, pred, what: str, timeout_s: float) -> None:
        """Let the load run until `pred(outcomes)` holds (bounded)."""
        deadline = time.monotonic() + timeout_s
        while not pred(self.outcomes):
            if time.monotonic() > deadline:
                raise AssertionError(f"load: timed out after {timeout_s} s waiting for {what}")
            await asyncio.sleep(0.05)


def cached_ratio(outcomes: list[Outcome]) -> Optional[float]:
    ok = [o for o in outcomes if o.ok and o.prompt_tokens]
    prompt = sum(o.prompt_tokens for o in ok)
    return sum(o.cached_tokens for o in ok) / prompt if prompt else None
