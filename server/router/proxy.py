"""Route one request and relay the replica's answer: retries before the first byte, streams without buffering.

    client ◀─ headers + first event ─┐   nothing reached the client yet: a refused/reset
    attempt 1 ──✗ connect/reset      │   connection or 502/503/504 moves the request to
    attempt 2 ──▶ 200, first chunk ──┘   the next replica in the decision's order
              ──▶ events relayed as they arrive (cut at event boundaries, never held longer)
              ──✗ mid-stream break  →  `data: {"error": ...}` then `data: [DONE]`

A non-streaming answer is produced by the replica only at the end, so it is read whole before
the client sees a byte: any failure before then is retried too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Optional

import aiohttp
import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import rendering
from .fleet import Fleet
from .metrics import RouterMetrics
from .policy import RETRY, Candidate, Decision, PolicyConfig, choose
from .prompt import HashConfig, Prompt, PromptRenderer
from .registry import Replica
from .settings import ProxyConfig

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {502, 503, 504}
SHARE_WINDOW = 512  # requests over which the policy's share cap evens out request counts
SHARE_DECAY = 1.0 - 1.0 / SHARE_WINDOW
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                    httpx.WriteError, httpx.PoolTimeout)  # forward_plain (httpx)
# forwarding (aiohttp): a connect timeout counts as a failed health check (fleet.report_timeout), a refused or
# reset connection takes the replica out at once; any other timeout is the replica being slow
UPSTREAM_FAILURES = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)
CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())  # aiohttp >= 3.10; older: a plain timeout (504)
PASSTHROUGH_HEADERS = ("content-type", "x-warmfleet-replica", "x-request-id")


def error_response(status: int, message: str, type_: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status_code=status)


def sse_error(message: str) -> bytes:
    payload = json.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}})
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


def _event_boundary(buf: bytes) -> int:
    """End of the last complete SSE event in `buf` (0 if none)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def cached_tokens_of(body: dict) -> Optional[int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def upstream_session() -> aiohttp.ClientSession:
    """Pooled keep-alive connections for forwarding (aiohttp writes headers and a small body in one send)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=60),
                                 auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))


@dataclass(frozen=True)
class _Attempt:
    """What every replica's try of one request sends and accounts against."""

    path: str
    raw: bytes  # the body sent upstream
    headers: dict
    stream: bool
    decision: Decision
    hashes: list[bytes]  # the prompt's block names (recorded as served by the replica that answers 200)
    t_arrival: float  # perf_counter() when the request arrived (TTFT)


def _has_images(body: dict) -> bool:
    """Whether a chat body holds an image part (cheap: no decoding)."""
    messages = body.get("messages")
    return isinstance(messages, list) and rendering.has_images(messages)


class Proxy:
    peers = None  # peers.PeerLoad when other routers share the fleet: their load is added to this router's

    def __init__(self, fleet: Fleet, renderer: Optional[PromptRenderer], hash_cfg: HashConfig,
                 metrics: RouterMetrics, policy: PolicyConfig = PolicyConfig(), cfg: ProxyConfig = ProxyConfig(),
                 upstream_headers: Optional[dict] = None, session: Optional[aiohttp.ClientSession] = None):
        self.fleet, self.renderer, self.hash_cfg = fleet, renderer, hash_cfg
        self.metrics, self.policy, self.cfg = metrics, policy, cfg
        self.upstream_headers = upstream_headers or {}
        self.timeout = httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s)
        self.session = session  # created lazily inside the running loop when not given
        self._media_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # render_off_loop's thread
        self.aio_timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                                 sock_read=cfg.read_timeout_s)

    # --- decision ---------------------------------------------------------------------------
    def render(self, kind: str, body: dict) -> Optional[Prompt]:
        if self.renderer is None:
            return None
        try:
            return self.renderer.chat(body) if kind == "chat" else self.renderer.completion(body)
        except Exception as exc:  # the replica will judge the request; the router only loses its prediction
            log.debug("cannot render %s request: %s", kind, exc)
            return None

    async def render_off_loop(self, kind: str, body: dict) -> Optional[Prompt]:
        """`render` for a request with images (decoding and hashing them is CPU work: 5,000 parts held the loop
        ~3.5 s) on one worker thread, so text requests keep flowing; one thread keeps the image memo single-writer."""
        if self._media_pool is None:
            self._media_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="router-media")
        return await asyncio.get_running_loop().run_in_executor(self._media_pool, self.render, kind, body)

    def close(self) -> None:
        """Stop render_off_loop's thread (a render under way finishes; nothing waits for it)."""
        if self._media_pool is not None:
            self._media_pool.shutdown(wait=False, cancel_futures=True)

    def decide(self, kind: str, body: dict, replicas: list[Replica],
               rendered: Optional[tuple[Optional[Prompt]]] = None) -> tuple[Decision, Optional[Prompt], list[bytes]]:
        """The routing decision, the rendered prompt (None if the router cannot render it) and its block names.

        `rendered` is `(prompt,)` when the caller rendered it already (off the loop); else it is rendered here."""
        t0 = time.perf_counter()
        prompt = rendered[0] if rendered is not None else self.render(kind, body)
        bs = self.hash_cfg.block_size
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None  # not a string: the replica answers the 400, not a crash here
        hashes = self.fleet.dialect.block_hashes(prompt, salt, self.hash_cfg) if prompt else []
        matches = self.fleet.index.match(hashes, [r.id for r in replicas])
        cands = []
        combined = self.peers.combined if self.peers is not None else None
        for r in replicas:
            m = matches[r.id]
            warm = 0
            if prompt and prompt.mm_items:
                hits = self.fleet.index.encoder_hits(r.id, [i.mm_hash for i in prompt.mm_items])
                warm = sum(i.length for i in prompt.mm_items if i.mm_hash in hits and i.offset >= m.blocks * bs)
            if combined is None:
                cands.append(Candidate(r.id, m.gpu_blocks, m.cpu_blocks, warm,
                                       load=max(r.in_flight, self.fleet.engine_load(r.id)),
                                       queued_tokens=r.queued_tokens, sent=r.sent))
            else:  # every router's load on it: ours exact, the peers' as of their last report (peers.py)
                in_flight, queued, sent = combined(r.id, r.in_flight, r.queued_tokens, r.sent)
                cands.append(Candidate(r.id, m.gpu_blocks, m.cpu_blocks, warm,
                                       load=max(in_flight, self.fleet.engine_load(r.id)),
                                       queued_tokens=queued, sent=sent, tie=random.random() * self.peers.jitter,
                                       unseen=self.peers.fresh))
        cold_key = hashes[min(len(hashes), self.cfg.cold_key_blocks) - 1] if hashes else None
        num_tokens = prompt.num_tokens if prompt else 0
        decision = choose(cands, block_size=bs, num_prompt_tokens=num_tokens, cold_key=cold_key, cfg=self.policy)
        if self.fleet.index.max_blocks_per_replica is not None and decision.order:  # capped index: LRU by use
            used = matches.get(decision.order[0])
            if used is not None and used.blocks:
                self.fleet.index.touch(decision.order[0], hashes[:used.blocks])
        if prompt is not None and not prompt.mm_items:  # remembered for warming replicas that join later
            self.fleet.warmer.hot.observe(prompt.token_ids, hashes, bs, body.get("cache_salt"), body.get("model"),
                                          cold_key, time.monotonic())
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        self.metrics.decisions.labels(decision.reason).inc()
        if self.fleet.dialect.contract == "predicted":
            self.metrics.predicted_decisions.labels(decision.reason).inc()
        self.metrics.prompt_tokens.inc(num_tokens)
        return decision, prompt, hashes

    # --- forwarding -------------------------------------------------------------------------
    async def forward(self, path: str, kind: str, body: dict, client_headers: dict,
                      raw: Optional[bytes] = None) -> Response:
        """Route and relay; `raw` is the client's body when `body` is still exactly it (no re-serialising)."""
        t_arrival = time.perf_counter()
        rendered = None
        if kind == "chat" and self.renderer is not None and _has_images(body):
            rendered = (await self.render_off_loop(kind, body),)
        replicas = self.fleet.routable()  # after the render: the fleet may change while it runs
        if not replicas:
            return self._count(error_response(503, "no healthy replica", "service_unavailable"))
        decision, prompt, hashes = self.decide(kind, body, replicas, rendered)
        if prompt is not None and self.fleet.dialect.prepare_body(body, prompt):
            raw = None  # the engine needs what the router computed (e.g. vLLM: image uuids)
        attempt = _Attempt(path, raw if raw is not None else json.dumps(body).encode(),
                           {"content-type": "application/json", **client_headers, **self.upstream_headers},
                           bool(body.get("stream")), decision, hashes, t_arrival)
        last_error = "no replica accepted the request"
        for tried, rep in enumerate(self._retry_order(decision), 1):
            outcome = await self._try(rep, attempt, retried=tried > 1)
            if isinstance(outcome, Response):
                return outcome
            last_error = outcome
        return self._count(error_response(502, last_error, "upstream_error"))

    def _retry_order(self, decision: Decision) -> Iterator[Replica]:
        """The decision's replicas still healthy when their turn comes, at most max_attempts; each after the first
        counts as a retry."""
        tried = 0
        for rid in decision.order:
            rep = self.fleet.registry.get(rid)
            if rep is None or not rep.healthy:
                continue
            if tried == self.cfg.max_attempts:
                return
            if tried:
                self.metrics.retries.inc()
                self.metrics.decisions.labels(RETRY).inc()
            tried += 1
            yield rep

    async def _try(self, rep: Replica, a: _Attempt, retried: bool) -> Response | str:
        """One replica's try: the answer for the client, or why the next replica should be tried."""
        rid = rep.id
        queued = a.decision.uncached_for(rid)
        self._enter(rep, queued)  # queued prefill until the first token, the answer or a failure
        released = False
        resp: Optional[aiohttp.ClientResponse] = None
        try:
            resp = await self._send(rep, a.path, a.raw, a.headers)
            if resp.status in RETRYABLE_STATUS:
                resp.release()
                return f"{rid} answered {resp.status}"
            if resp.status == 200:
                self.fleet.record_served(rid, a.hashes)
            if a.stream and resp.status == 200:
                out = await self._first_event(rep, resp, a, retried)
                released = True  # from here the relay owns the in-flight count
                return out
            content = await resp.read()
            resp.release()
            self._observe_usage(a.decision, content, rid)
            return self._count(Response(content, resp.status, self._reply_headers(resp, rep, a.decision, retried)))
        except CONNECT_TIMEOUT:
            self.fleet.report_timeout(rid, f"{rid}: ConnectTimeout")
            return f"{rid}: ConnectTimeout"
        except asyncio.TimeoutError:
            if resp is not None:
                resp.close()
            return self._count(error_response(504, f"replica {rid} timed out", "upstream_timeout"))
        except UPSTREAM_FAILURES as exc:
            if resp is not None:
                resp.close()
            self.fleet.report_failure(rid, f"{rid}: {type(exc).__name__}")
            return f"{rid}: {type(exc).__name__}"
        finally:
            self._prefilled(rep, queued)
            if not released:
                self._leave(rep)

    async def _first_event(self, rep: Replica, resp: aiohttp.ClientResponse, a: _Attempt,
                           retried: bool) -> StreamingResponse:
        """Wait for a stream's first bytes (a replica sends them with the first token: TTFT), then relay the rest."""
        chunks = resp.content.iter_any()
        first = await anext(chunks, b"")
        self.metrics.ttft.observe(time.perf_counter() - a.t_arrival)
        return self._stream(rep, resp, chunks, first, a.decision, retried=retried)

    async def forward_plain(self, method: str, path: str, raw: bytes, client_headers: dict) -> Response:
        """A request without cache affinity (/v1/models, /tokenize): least-loaded replica, retried the same way."""
        headers = {**client_headers, **self.upstream_headers}
        if raw:
            headers.setdefault("content-type", "application/json")
        last_error = "no healthy replica"
        for rep in sorted(self.fleet.routable(), key=lambda r: (r.in_flight, r.id))[: self.cfg.max_attempts]:
            try:
                resp = await self.fleet.http.request(method, rep.spec.url + path, content=raw or None,
                                                     headers=headers, timeout=self.timeout)
            except CONNECT_FAILURES as exc:
                last_error = f"{rep.id}: {type(exc).__name__}"
                self.fleet.report_failure(rep.id, last_error)
                continue
            except httpx.TimeoutException:
                return error_response(504, f"replica {rep.id} timed out", "upstream_timeout")
            if resp.status_code in RETRYABLE_STATUS:
                last_error = f"{rep.id} answered {resp.status_code}"
                continue
            return Response(resp.content, resp.status_code, self._reply_headers(resp, rep, None))
        return error_response(503 if last_error == "no healthy replica" else 502, last_error, "upstream_error")

    async def _send(self, rep: Replica, path: str, raw: bytes, headers: dict) -> aiohttp.ClientResponse:
        if self.session is None or self.session.closed:
            self.session = upstream_session()
        return await self.session.post(rep.spec.url + path, data=raw, headers=headers, timeout=self.aio_timeout,
                                       allow_redirects=False)

    def _stream(self, rep: Replica, resp: aiohttp.ClientResponse, chunks: AsyncIterator[bytes], first: bytes,
                decision: Decision, retried: bool = False) -> StreamingResponse:
        async def relay() -> AsyncIterator[bytes]:
            buf = first
            try:
                while True:
                    cut = _event_boundary(buf)
                    if cut:
                        out, buf = buf[:cut], buf[cut:]
                        if b'"cached_tokens"' in out:
                            self._observe_sse_usage(decision, out, rep.id)
                        yield out
                    chunk = await anext(chunks, None)
                    if chunk is None:
                        break
                    buf += chunk
                if buf:
                    yield buf
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self.metrics.stream_breaks.inc()
                log.warning("stream from %s broke: %s", rep.id, type(exc).__name__)
                yield (b"\n\n" if buf else b"") + sse_error(f"replica {rep.id} failed mid-stream ({type(exc).__name__})")
            finally:
                resp.close() if not resp.content.at_eof() else resp.release()
                self._leave(rep)

        return self._count(StreamingResponse(relay(), resp.status, self._reply_headers(resp, rep, decision, retried)))

    # --- bookkeeping ------------------------------------------------------------------------
    def _reply_headers(self, resp, rep: Replica, decision: Optional[Decision], retried: bool = False) -> dict:
        out = {k: resp.headers[k] for k in PASSTHROUGH_HEADERS if k in resp.headers}
        out.setdefault("x-warmfleet-replica", rep.id)
        if decision is not None:
            reason = RETRY if retried else decision.reason
            out["x-warmfleet-route"] = f"{reason}; predicted_cached_tokens={decision.predicted_for(rep.id)}"
        return out

    def _enter(self, rep: Replica, queued_tokens: int = 0) -> None:
        rep.in_flight += 1
        rep.queued_tokens += queued_tokens
        for r in self.fleet.registry.replicas.values():  # recent share: counts decay over ~SHARE_WINDOW requests
            r.sent *= SHARE_DECAY
        rep.sent += 1
        self.metrics.replica_in_flight.labels(rep.id).set(rep.in_flight)
        self.metrics.replica_queued_tokens.labels(rep.id).set(rep.queued_tokens - rep.replay_tokens)

    def _prefilled(self, rep: Replica, queued_tokens: int) -> None:
        """The request's prompt is no longer work queued ahead of others (first token, answer or failure)."""
        rep.queued_tokens -= queued_tokens
        self.metrics.replica_queued_tokens.labels(rep.id).set(rep.queued_tokens - rep.replay_tokens)

    def _leave(self, rep: Replica) -> None:
        rep.in_flight -= 1
        self.metrics.replica_in_flight.labels(rep.id).set(rep.in_flight)

    def _count(self, resp: Response) -> Response:
        self.metrics.requests.labels(f"{resp.status_code // 100}xx").inc()
        return resp

    def _observe_usage(self, decision: Decision, content: bytes, rid: str) -> None:
        try:
            actual = cached_tokens_of(json.loads(content))
        except (ValueError, UnicodeDecodeError):
            return
        self._record_actual(decision, rid, actual)

    def _observe_sse_usage(self, decision: Decision, events: bytes, rid: str) -> None:
        for line in events.splitlines():
            if line.startswith(b"data: {") and b'"cached_tokens"' in line:
                try:
                    self._record_actual(decision, rid, cached_tokens_of(json.loads(line[6:])))
                except (ValueError, UnicodeDecodeError):
                    pass
                return

    def _record_actual(self, decision: Decision, rid: str, actual: Optional[int]) -> None:
        """Actual vs predicted for the replica that answered (after a retry: that replica's own prediction)."""
        if actual is None:
            return
        predicted = decision.predicted_for(rid)
        self.metrics.actual_cached_tokens.inc(actual)
        self.metrics.usage_prompt_tokens.inc(decision.num_prompt_tokens)
        self.metrics.predicted_cached_tokens.inc(predicted)
        self.metrics.prediction_error.observe(actual - predicted)
