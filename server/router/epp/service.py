"""The ext_proc stream of one HTTP request (`Exchange`) and the ExternalProcessor servicer; what the pick books.

One gRPC stream per HTTP request, FULL_DUPLEX_STREAMED (what GIE gateways configure):

    Envoy ─ request_headers ──────────▶  held: nothing is answered until the body is whole
          ─ request_body … (eos) ─────▶  Router.route → its Booking: enter(primary)
          ◀──────── headers response ─   destination header + envoy.lb metadata, clear_route_cache (and
                                         x-request-id when the request came without a usable one)
          ◀──── streamed body chunks ─   the body as hashed (rewritten if the router changed it)
          ─ response_headers ─────────▶  served endpoint: the load moves there if the gateway retried
                                         (enter again); served: the media header (URL image hashes) removed
          ◀───────── headers response ─   x-request-id on the answer
          ─ response_body chunk ──────▶  first one: first_token (prefilled); each one handed back at once
          ◀───────── streamed chunk ───
          ─ … eos / trailers ─────────▶  usage (usage.cached_tokens) + leave
    a stream that ends any other way (Envoy cancels it) still leaves and frees the client's slot.

A generation body over the replicas' per-request limits (`--max-choices-per-request`, `--limit-mm-per-prompt`:
core/admission.py) is answered with the replicas' own 400 as an immediate response, before any pick.

BUFFERED request bodies are answered in the body response instead (headers pass at once: Envoy holds them until
the body response, which carries the header mutation). Paths other than chat and completions are not routed by
cache: they go to the least-loaded eligible endpoint, picked from the headers, and the body passes unchanged.

Headers the EPP does not name pass as they came: the client's `authorization` (the replicas check it too, or trust
the gateway's network: docs/security.md) and W3C `traceparent`/`tracestate` (with --otlp-traces-endpoint the EPP sets
them to its routing-decision span's, the child of the client's: otel.py). The EPP sets no secret on a request.
"""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator, Optional

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from ... import otel, tracing
from ...multimodal.url_hashes import HEADER as MEDIA_HEADER
from ..core.admission import request_limits
from ..core.booking import Booking
from ..core.errors import NO_REPLICA, Refusal, parse_json_object
from ..core.policy import least_loaded
from ..core.registry import Replica
from ..core.router import Router
from ..core.runtime import RouterRuntime
from ..core.tenants import ConcurrencyLimiter, admit_client
from ..core.usage import UsageScanner
from . import pick

log = logging.getLogger(__name__)

FULL_DUPLEX = mode_pb.ProcessingMode.FULL_DUPLEX_STREAMED
GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
REQUEST_ID = tracing.REQUEST_ID  # made here when absent or unusable (Envoy makes one first), returned on the answer
NO_SUBSET_ENDPOINT = Refusal(503, "no endpoint of the gateway's subset hint is eligible", "service_unavailable")


class Exchange:
    """One HTTP request and its response as the gateway relays them: what was picked and what it booked."""

    def __init__(self, door: "EppDoor"):
        self.door, self.router = door, door.router
        self.request_mode = self.response_mode = FULL_DUPLEX  # until protocol_config says otherwise
        self.kind: Optional[str] = None  # "chat" | "completion": routed by cache; None: by load
        self.auth: Optional[str] = None
        self.request_id = ""  # the request's x-request-id (the client's, the gateway's or made here)
        self.upstream: dict = {}  # headers set on the request: x-request-id when the EPP made it, its span's
        # traceparent/tracestate when it traces (otel.py)
        self.trace: dict = {}  # the request's traceparent/tracestate, kept only when the EPP traces
        self.host = "unknown"
        self.subset: Optional[frozenset[str]] = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.picked = False  # the pick (or an immediate answer) has been sent
        self.booking: Optional[Booking] = None  # the decision and its load (after the served report: there)
        self.client: Optional[str] = None  # the per-client slot held
        self.scanner: Optional[UsageScanner] = None  # routed by cache: reads the answer's usage
        self.status = 0
        self.t_pick = 0.0
        self.done = False
        self.answered = False  # the EPP answered the client itself (ImmediateResponse): the stream ends

    # --- request --------------------------------------------------------------------------------
    async def on_request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            cfg = req.protocol_config
            self.request_mode, self.response_mode = cfg.request_body_mode, cfg.response_body_mode
        h = req.request_headers
        path = (pick.header_value(h, ":path") or "/").split("?", 1)[0]
        method = pick.header_value(h, ":method") or "GET"
        self.auth = pick.header_value(h, "authorization")
        given = pick.header_value(h, REQUEST_ID)
        self.request_id = tracing.request_id(given)  # the client's (or the gateway's) when usable, else made here
        if self.request_id != given:
            self.upstream = {REQUEST_ID: self.request_id}
        if self.door.spans is not None:
            names = (tracing.TRACEPARENT, tracing.TRACESTATE)
            self.trace = {k: v for k in names if (v := pick.header_value(h, k))}
        xff = pick.header_value(h, "x-forwarded-for")
        self.host = xff.split(",")[-1].strip() if xff else "unknown"  # the gateway appends the peer it saw
        self.subset = pick.subset_of(req)
        self.kind = GENERATION_PATHS.get(path) if method == "POST" else None
        declared = pick.header_value(h, "content-length")
        limit = self.door.max_request_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return [self.refuse(Refusal(413, f"request body larger than {limit} bytes", "invalid_request_error"))]
        if self.kind is None or h.end_of_stream:
            return [self.pick_by_load()]
        if self.request_mode == FULL_DUPLEX:
            return []  # the pick rides on the headers response, sent when the body is whole
        return [pick.request_headers_response()]  # BUFFERED: the pick rides on the body response

    async def on_request_body(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        b = req.request_body
        if self.picked:  # routed by load (or refused): the body passes as it is
            if self.done:
                return []
            return ([pb.ProcessingResponse(request_body=pb.BodyResponse(response=pick.streamed(b.body, b.end_of_stream)))]
                    if self.request_mode == FULL_DUPLEX else [pick.request_body_response()])
        self.size += len(b.body)
        if self.size > self.door.max_request_bytes:
            return [self.refuse(Refusal(413, f"request body larger than {self.door.max_request_bytes} bytes",
                                        "invalid_request_error"))]
        self.chunks.append(b.body)
        if not b.end_of_stream:
            return [] if self.request_mode == FULL_DUPLEX else [pick.request_body_response()]
        return await self.route(end_of_stream=True)

    async def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        out = [] if self.picked else await self.route(end_of_stream=False)  # trailers ended the body
        if not self.done:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return out

    async def route(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """The whole body is here: parse, admit, route, and send the pick (and the body as the router hashed it)."""
        spans = self.door.spans
        if spans is None:
            return await self._route(end_of_stream)
        span = spans.start("warmfleet.route", self.trace, {otel.REQUEST_ID: self.request_id})
        try:  # the replica's span becomes this decision's child
            self.upstream = spans.hand_on(span, {**self.upstream})
            out = await self._route(end_of_stream)
            b = self.booking
            if b is not None and b.rep is not None and b.decision is not None:
                d = b.decision
                span.set_attributes(otel.decision_attributes(b.rep.id, d.reason, d.predicted_for(b.rep.id)))
            if self.answered:
                spans.error(span, self.status)
        finally:
            span.end()
        return out

    async def _route(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        raw = b"".join(self.chunks)
        self.chunks = []
        body = parse_json_object(raw)
        if isinstance(body, Refusal):
            return [self.refuse(body)]
        client = admit_client(self.door.rt.tenants, self.door.limiter, self.host, self.auth, body)
        if isinstance(client, Refusal):
            return [self.refuse(client)]
        self.client = client
        refused = self.door.limits.refusal(self.kind, body)  # the replicas' own 400, before any pick or fetch
        if refused is not None:
            return [self.refuse(refused)]
        booking = await self.router.route(self.kind, body, self.eligible())
        if booking is None:
            return [self.refuse(NO_REPLICA if self.subset is None else NO_SUBSET_ENDPOINT)]
        reps = list(booking.replicas(self.door.max_attempts))  # primary, then the fallbacks a gateway retry walks
        if not reps:  # every replica of the order went unhealthy while the request was rendered
            return [self.refuse(NO_REPLICA if self.subset is None else NO_SUBSET_ENDPOINT)]
        changed = booking.body_changed or self.door.rt.tenants.enabled  # a dialect rewrite or the tenant's salt
        out_body = json.dumps(body).encode() if changed else raw
        self.booking, self.scanner = booking, UsageScanner(bool(body.get("stream")))
        self.book(reps[0])
        value = pick.destination(pick.endpoint_of(r) for r in reps)
        self.picked = True
        if self.request_mode == FULL_DUPLEX:  # Envoy drops content-length itself in this mode
            return [pick.request_headers_response(pick.pick_common(value, len(out_body) if changed else None,
                                                                   extra=self.upstream),
                                                  value), *pick.streamed_request_body(out_body, end_of_stream)]
        return [pick.request_body_response(pick.pick_common(
            value, len(out_body) if changed else None, out_body if changed else None, self.upstream), value)]

    def eligible(self):
        if self.subset is None:
            return None
        subset = self.subset
        return lambda r: pick.endpoint_of(r) in subset

    def pick_by_load(self) -> pb.ProcessingResponse:
        """A request not routed by cache (models, tokenize, a body-less call): the least-loaded eligible endpoint."""
        client = admit_client(self.door.rt.tenants, self.door.limiter, self.host, self.auth, None)
        if isinstance(client, Refusal):
            return self.refuse(client)
        self.client = client
        eligible = self.eligible()
        reps = least_loaded((r for r in self.router.fleet.routable() if eligible is None or eligible(r)),
                            self.door.max_attempts)
        if not reps:
            return self.refuse(NO_REPLICA if self.subset is None else NO_SUBSET_ENDPOINT)
        self.booking = Booking(self.router)  # routed by load: nothing predicted, nothing learnt from the answer
        self.book(reps[0])
        self.picked = True
        value = pick.destination(pick.endpoint_of(r) for r in reps)
        return pick.request_headers_response(pick.pick_common(value, extra=self.upstream), value)

    def refuse(self, refusal: Refusal) -> pb.ProcessingResponse:
        self.picked = self.done = self.answered = True
        self.status = refusal.status
        self.door.metrics.requests.labels(f"{refusal.status // 100}xx").inc()
        self.close()
        return pick.immediate(refusal, {REQUEST_ID: self.request_id} if self.request_id else None)

    # --- load -----------------------------------------------------------------------------------
    def book(self, rep: Replica) -> None:
        """The request's load goes to `rep` (moved there from the pick when the gateway served another)."""
        self.booking.enter(rep)
        self.t_pick = time.perf_counter()

    def settle_served(self, served: Optional[str]) -> None:
        """The gateway says who served: after a retry, the load moves from the pick to that endpoint."""
        b = self.booking
        if b is None or b.rep is None or served is None or served == pick.endpoint_of(b.rep):
            return
        rep = self.door.replica_at(served)
        if rep is None:
            log.warning("the gateway reports endpoint %s, which is not in this pool", served)
            return
        self.book(rep)

    def close(self) -> None:
        """Release what this request holds (idempotent): its booked load and its client slot."""
        if self.booking is not None:
            self.booking.leave()
        if self.client is not None:
            self.door.limiter.release(self.client)
            self.client = None

    # --- response -------------------------------------------------------------------------------
    async def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        h = req.response_headers
        self.settle_served(pick.served_of(req, h))
        status = pick.header_value(h, ":status")
        self.status = int(status) if status and status.isdigit() else 0
        media = pick.header_value(h, MEDIA_HEADER)
        if self.status == 200 and self.booking is not None:
            self.booking.served(media)
        if self.scanner is not None and "text/event-stream" not in (pick.header_value(h, "content-type") or ""):
            self.scanner.stream = False
        common = pick.set_headers(pb.CommonResponse(), {REQUEST_ID: self.request_id} if self.request_id else {})
        if pick.header_value(h, pick.SERVED) is not None:  # the gateway's note to the EPP, not for the client
            common.header_mutation.remove_headers.append(pick.SERVED)
        if media is not None:  # the replica's note to the router (url_hashes.py), not for the client
            common.header_mutation.remove_headers.append(MEDIA_HEADER)
        out = [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]
        if h.end_of_stream:
            self.finish()
        return out

    async def on_response_body(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        b = req.response_body
        booking = self.booking
        if booking is not None and booking.prefilling:  # the answer's first bytes
            self.door.metrics.ttft.observe(time.perf_counter() - self.t_pick)
            if self.status == 200 and self.scanner is not None and self.scanner.stream:  # an SSE first token
                booking.first_token()
            else:
                booking.prefilled()
        if self.scanner is not None:
            self.scanner.feed(b.body)
        out = [pb.ProcessingResponse(response_body=pb.BodyResponse(
            response=pick.streamed(b.body, b.end_of_stream) if self.response_mode == FULL_DUPLEX
            else pb.CommonResponse()))]
        if b.end_of_stream:
            self.finish()
        return out

    async def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        self.finish()
        return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def finish(self) -> None:
        """The answer's last byte has passed: actual cached tokens for the replica that served it, then release."""
        if self.done:
            return
        self.done = True
        if self.status:
            self.door.metrics.requests.labels(f"{self.status // 100}xx").inc()
        if self.scanner is not None:
            self.booking.usage(self.scanner.finish())
        self.close()

    async def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        which = req.WhichOneof("request")
        if which == "request_headers":
            return await self.on_request_headers(req)
        if which == "request_body":
            return await self.on_request_body(req)
        if which == "request_trailers":
            return await self.on_request_trailers()
        if which == "response_headers":
            return await self.on_response_headers(req)
        if which == "response_body":
            return await self.on_response_body(req)
        if which == "response_trailers":
            return await self.on_response_trailers()
        return []


class EppDoor:
    """What every stream shares: the router, the per-client limiter and the endpoint ↔ replica map."""

    def __init__(self, rt: RouterRuntime, router: Router, limiter: ConcurrencyLimiter):
        self.rt, self.router, self.limiter, self.metrics = rt, router, limiter, router.metrics
        self.max_request_bytes = rt.settings.max_request_bytes
        self.max_attempts = rt.settings.proxy.max_attempts
        self.limits = request_limits(rt.settings)  # --max-choices-per-request, --limit-mm-per-prompt
        self.spans = rt.spans  # otel.Spans, None: no spans

    def replica_at(self, endpoint: str) -> Optional[Replica]:
        return next((r for r in self.router.fleet.registry.replicas.values() if pick.endpoint_of(r) == endpoint),
                    None)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """envoy.service.ext_proc.v3.ExternalProcessor over the router: one `Exchange` per stream."""

    def __init__(self, door: EppDoor):
        self.door = door
        self.open_streams = 0

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self.door)
        self.open_streams += 1
        try:
            async for req in request_iterator:
                if req.observability_mode:  # nothing may be answered; a pick would be ignored anyway
                    continue
                for resp in await ex.handle(req):
                    yield resp
                if ex.answered:
                    return  # an immediate answer ends the exchange
        finally:  # also when Envoy resets the stream (client gone, timeout): nothing stays booked
            self.open_streams -= 1
            ex.close()
