"""Relay a request to the replicas the core chose, and their answer back: retries before the first byte, no buffering.

    client ◀─ headers + first event ─┐   nothing reached the client yet: a refused/reset
    attempt 1 ──✗ connect/reset      │   connection or 502/503/504 moves the request to
    attempt 2 ──▶ 200, first chunk ──┘   the next replica in the decision's order (a 4xx never;
                                         a reset after sending once at most: LostMidRequest)
              ──▶ events relayed as they arrive (cut at event boundaries, never held longer)
              ──✗ mid-stream break  →  `data: {"error": ...}` then `data: [DONE]`

A non-streaming answer is produced by the replica only at the end, so it is read whole before
the client sees a byte: any failure before then is retried too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import httpx
from starlette.responses import Response, StreamingResponse

from ...multimodal.url_hashes import HEADER as MEDIA_HEADER
from ..core.admission import RequestLimits
from ..core.booking import Booking
from ..core.policy import RETRY, least_loaded
from ..core.registry import Replica
from ..core.router import Router
from ..core.settings import ProxyConfig
from ..core.usage import cached_tokens_in_events, cached_tokens_in_json, event_boundary
from ..status import error_response, refusal_response
from .upstream import ConnectTimeout, NotSent, Upstream, UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {502, 503, 504}
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                    httpx.WriteError, httpx.PoolTimeout)  # forward_plain (httpx)
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # of those, the ones before any byte left
# forwarding (upstream.py): a connect timeout counts as a failed health check (fleet.report_timeout), a refused or
# reset connection takes the replica out at once; any other timeout is the replica being slow
UPSTREAM_FAILURES = (UpstreamError,)
CONNECT_TIMEOUT = ConnectTimeout
PASSTHROUGH_HEADERS = ("content-type", "x-warmfleet-replica", "x-request-id")


class LostMidRequest(str):
    """Why a try failed, when it failed after the request went out (reset, closed): the replica may have died of the
    request itself, so it is retried once more at most, never on every replica (upstream.NotSent: never sent)."""


def sse_error(message: str) -> bytes:
    payload = json.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}})
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


def upstream_session(cfg: ProxyConfig = ProxyConfig()) -> Upstream:
    """Pooled keep-alive connections for forwarding (headers and a small body in one send)."""
    return Upstream(cfg.connect_timeout_s, cfg.read_timeout_s)


class RelayedResponse(Response):
    """A replica's whole answer as Starlette's Response would send it, its raw headers built in one pass.

    Response's own __init__ renders, lower-cases and re-checks each header (a few us a request); here the
    names are lower-case already (upstream.py and the router's own) and the body is bytes."""

    def __init__(self, content: bytes, status_code: int, headers: dict):
        self.status_code, self.body, self.background = status_code, content, None
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if not (status_code < 200 or status_code in (204, 304)):  # as Response: no length on bodiless statuses
            raw.append((b"content-length", str(len(content)).encode()))
        self.raw_headers = raw


@dataclass(slots=True, eq=False)  # not frozen: a frozen init costs ~3x (treat as read-only)
class _Attempt:
    """What every replica's try of one request sends, and the booking it accounts against."""

    path: str
    raw: bytes  # the body sent upstream
    headers: dict
    stream: bool
    booking: Booking  # the decision, and the load booked on the replica tried now
    t_arrival: float  # perf_counter() when the request arrived (TTFT)


class Proxy:
    """The HTTP relay of `warmfleet route`: asks the core where a request goes (`Router.route`), then sends it."""

    def __init__(self, router: Router, cfg: ProxyConfig = ProxyConfig(), upstream_headers: Optional[dict] = None,
                 session: Optional[Upstream] = None, limits: Optional[RequestLimits] = None):
        self.router, self.fleet, self.metrics, self.cfg = router, router.fleet, router.metrics, cfg
        self.limits = limits  # the replicas' per-request limits, refused here before routing (None: none)
        self.upstream_headers = upstream_headers or {}
        self.timeout = httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s)
        self.session = session  # created lazily when not given

    # --- forwarding -------------------------------------------------------------------------
    async def forward(self, path: str, kind: str, body: dict, client_headers: dict,
                      raw: Optional[bytes] = None) -> Response:
        """Route and relay; `raw` is the client's body when `body` is still exactly it (no re-serialising)."""
        t_arrival = time.perf_counter()
        refused = self.limits.refusal(kind, body) if self.limits is not None else None
        if refused is not None:
            return self._count(refusal_response(refused))
        booking = await self.router.route(kind, body)
        if booking is None:
            return self._count(error_response(503, "no healthy replica", "service_unavailable"))
        if booking.body_changed:
            raw = None  # the engine needs what the router computed (e.g. vLLM: image uuids)
        attempt = _Attempt(path, raw if raw is not None else json.dumps(body).encode(),
                           {"content-type": "application/json", **client_headers, **self.upstream_headers},
                           bool(body.get("stream")), booking, t_arrival)
        last_error = "no replica accepted the request"
        lost = False
        for rep in booking.replicas(self.cfg.max_attempts):
            outcome = await self._try(rep, attempt)
            if isinstance(outcome, Response):
                outcome.replica_id = rep.id  # type: ignore[attr-defined]  # the router's id of it (otel.py's span)
                return outcome
            last_error = outcome
            if lost:  # a second try after a replica died mid-request: no third
                break
            lost = isinstance(outcome, LostMidRequest)
        return self._count(error_response(502, last_error, "upstream_error"))

    async def _try(self, rep: Replica, a: _Attempt) -> Response | str:
        """One replica's try: the answer for the client, or why the next replica should be tried."""
        rid, booking = rep.id, a.booking
        booking.enter(rep)  # queued prefill until the first token, the answer or a failure
        relayed = False
        resp: Optional[UpstreamResponse] = None
        try:
            resp = await self._send(rep, a.path, a.raw, a.headers)
            if resp.status in RETRYABLE_STATUS:
                resp.release()
                return f"{rid} answered {resp.status}"
            if resp.status == 200:
                booking.served(resp.headers.get(MEDIA_HEADER))
            if a.stream and resp.status == 200:
                out = await self._first_event(rep, resp, a)
                relayed = True  # from here the relay holds the booking until the stream's last byte
                return out
            content = await resp.read()
            resp.release()
            booking.usage(cached_tokens_in_json(content))
            return self._count(RelayedResponse(content, resp.status, self._reply_headers(resp, rep, booking)))
        except asyncio.CancelledError:  # the client left: close the upstream request, so the replica aborts it
            if resp is not None:
                resp.close()
            raise
        except CONNECT_TIMEOUT:
            booking.failed(f"{rid}: ConnectTimeout", timeout=True)
            return f"{rid}: ConnectTimeout"
        except asyncio.TimeoutError:
            if resp is not None:
                resp.close()
            return self._count(error_response(504, f"replica {rid} timed out", "upstream_timeout"))
        except UPSTREAM_FAILURES as exc:
            if resp is not None:
                resp.close()
            booking.failed(f"{rid}: {type(exc).__name__}")
            why = f"{rid}: {type(exc).__name__}"
            return why if isinstance(exc, NotSent) else LostMidRequest(why + " after the request was sent")
        finally:
            booking.prefilled()
            if not relayed:
                booking.leave()

    async def _first_event(self, rep: Replica, resp: UpstreamResponse, a: _Attempt) -> StreamingResponse:
        """Wait for a stream's first bytes (a replica sends them with the first token: TTFT), then relay the rest."""
        chunks = resp.chunks()
        first = await anext(chunks, b"")
        self.metrics.ttft.observe(time.perf_counter() - a.t_arrival)
        if first:
            a.booking.first_token()
        return self._stream(rep, resp, chunks, first, a.booking)

    async def forward_plain(self, method: str, path: str, raw: bytes, client_headers: dict) -> Response:
        """A request without cache affinity (/v1/models, /tokenize): least-loaded replica, retried the same way."""
        headers = {**client_headers, **self.upstream_headers}
        if raw:
            headers.setdefault("content-type", "application/json")
        last_error, lost = "no healthy replica", False
        for rep in least_loaded(self.fleet.routable(), self.cfg.max_attempts):
            try:
                resp = await self.fleet.http.request(method, rep.spec.url + path, content=raw or None,
                                                     headers=headers, timeout=self.timeout)
            except CONNECT_FAILURES as exc:
                last_error = f"{rep.id}: {type(exc).__name__}"
                self.fleet.report_failure(rep.id, last_error)
                if lost:  # as forward: a second try after a replica died mid-request, no third
                    break
                lost = not isinstance(exc, NOT_SENT)
                continue
            except httpx.TimeoutException:
                return error_response(504, f"replica {rep.id} timed out", "upstream_timeout")
            if resp.status_code in RETRYABLE_STATUS:
                last_error = f"{rep.id} answered {resp.status_code}"
                continue
            return Response(resp.content, resp.status_code, self._reply_headers(resp, rep, None))
        return error_response(503 if last_error == "no healthy replica" else 502, last_error, "upstream_error")

    async def _send(self, rep: Replica, path: str, raw: bytes, headers: dict) -> UpstreamResponse:
        if self.session is None or self.session.closed:
            self.session = upstream_session(self.cfg)
        return await self.session.post(rep.spec.url, path, raw, headers)

    def _stream(self, rep: Replica, resp: UpstreamResponse, chunks: AsyncIterator[bytes], first: bytes,
                booking: Booking) -> StreamingResponse:
        async def relay() -> AsyncIterator[bytes]:
            buf = first
            try:
                while True:
                    cut = event_boundary(buf)
                    if cut:
                        out, buf = buf[:cut], buf[cut:]
                        if b'"cached_tokens"' in out:
                            booking.usage(cached_tokens_in_events(out))
                        yield out
                    chunk = await anext(chunks, None)
                    if chunk is None:
                        break
                    buf += chunk
                if buf:
                    yield buf
            except (asyncio.TimeoutError, OSError) as exc:
                self.metrics.stream_breaks.inc()
                log.warning("stream from %s broke: %s", rep.id, type(exc).__name__)
                yield (b"\n\n" if buf else b"") + sse_error(f"replica {rep.id} failed mid-stream ({type(exc).__name__})")
            finally:
                resp.close() if not resp.at_eof() else resp.release()
                booking.leave()

        return self._count(StreamingResponse(relay(), resp.status, self._reply_headers(resp, rep, booking)))

    # --- replies ----------------------------------------------------------------------------
    def _reply_headers(self, resp, rep: Replica, booking: Optional[Booking]) -> dict:
        out = {k: resp.headers[k] for k in PASSTHROUGH_HEADERS if k in resp.headers}
        out.setdefault("x-warmfleet-replica", rep.id)
        if booking is not None:
            d = booking.decision
            reason = RETRY if booking.tries > 1 else d.reason
            out["x-warmfleet-route"] = f"{reason}; predicted_cached_tokens={d.predicted_for(rep.id)}"
        return out

    def _count(self, resp: Response) -> Response:
        self.metrics.requests.labels(f"{resp.status_code // 100}xx").inc()
        return resp
