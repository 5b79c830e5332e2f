"""One request's decision and the load it books on the replica serving it: what a front door holds; no HTTP.

    Router.route ─▶ Booking (decision, block names, body)
      enter(rep)         in flight +1, its uncached prompt queued on rep (the policy weighs both); again with
                         another replica: the load moves there, counted as a retry (the next replica after a
                         failure, or the endpoint a gateway served instead of the pick)
      first_token()      the answer's first bytes: its prompt is no longer queued; the TTFT model learns
      prefilled()        the same without a TTFT sample (a whole answer, a failure)
      served(media)      rep answered 200: it is up, engines without KV events learn the prompt, URL image hashes
      failed(reason)     rep refused, reset or timed out: reported to the fleet, the load leaves it
      usage(cached)      actual vs predicted cached tokens of the replica that answered
      leave()            the last byte has gone (or the request failed): nothing stays booked

Like SGLang's gateway's one `on_request_complete`, a door reports what happened and the core does the rest. Every
step is idempotent and harmless out of order (leave twice, a first token after leave, usage with nothing booked):
a door's error paths may call them as they unwind. Made once per request on the hot path: slots, no closures.
Imports no front door (and router.py only for types: the router hands its bookings out).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, Optional

from .policy import RETRY, Decision
from .registry import Replica

if TYPE_CHECKING:
    from .router import Router

SHARE_WINDOW = 512  # requests over which the policy's share cap evens out request counts
SHARE_DECAY = 1.0 - 1.0 / SHARE_WINDOW


class Booking:
    """One request: where the core decided it goes (None: routed by load only), and where its load is booked."""

    __slots__ = ("router", "decision", "hashes", "body", "body_changed", "rep", "queued", "prefilling", "tries",
                 "sample")

    def __init__(self, router: "Router", decision: Optional[Decision] = None, hashes: list[bytes] = (),
                 body: Optional[dict] = None, body_changed: bool = False):
        self.router = router
        self.decision = decision  # replicas in the order to try them, predicted hits; None: not routed by cache
        self.hashes = hashes  # the prompt's block names as the fleet's engine names them
        self.body = body  # the request as routed (its cache_salt scopes what the answer's media header teaches)
        self.body_changed = body_changed  # the dialect rewrote the body: the client's bytes no longer do
        self.rep: Optional[Replica] = None  # where the load is booked now (None: nowhere)
        self.queued = 0  # its uncached prompt tokens, queued on `rep` until the first byte
        self.prefilling = False  # `queued` is still counted on `rep`
        self.tries = 0  # replicas booked so far (after the first, each is a retry)
        self.sample: Optional[tuple[float, int, float]] = None  # TTFT: (sent at, prefill waited for, load then)

    def replicas(self, max_attempts: int) -> Iterator[Replica]:
        """The decision's replicas still healthy when their turn comes, at most `max_attempts`."""
        registry, tried = self.router.fleet.registry, 0
        for rid in self.decision.order:
            rep = registry.get(rid)
            if rep is None or not rep.healthy:
                continue
            if tried == max_attempts:
                return
            tried += 1
            yield rep

    def enter(self, rep: Replica) -> None:
        """Book the request on `rep` (already there: nothing); booked elsewhere, the load moves, as a retry."""
        if rep is self.rep:
            return
        router = self.router
        if self.rep is not None:
            self.leave()
        if self.tries:
            router.metrics.retries.inc()
            router.metrics.decisions.labels(RETRY).inc()
        self.tries += 1
        queued = self.decision.uncached_for(rep.id) if self.decision is not None else 0
        if router.ttft_fit is not None:
            self.sample = (time.perf_counter(), rep.queued_tokens + queued,
                           max(rep.in_flight, router.fleet.engine_load(rep.id)))
        rep.in_flight += 1
        adapter = self.decision.adapter if self.decision is not None else None
        if adapter is not None:
            router.fleet.adapters.sent(rep.id, adapter)
        rep.queued_tokens += queued
        for r in router.fleet.registry.replicas.values():  # recent share: counts decay over ~SHARE_WINDOW requests
            r.sent *= SHARE_DECAY
        rep.sent += 1
        self.rep, self.queued, self.prefilling = rep, queued, True

    def prefilled(self) -> None:
        """The request's prompt is no longer work queued ahead of others on its replica."""
        if self.prefilling:
            self.prefilling = False
            self.rep.queued_tokens -= self.queued

    def first_token(self) -> None:
        """A streamed answer's first bytes (its first token): prefilled, and the replica's TTFT model learns."""
        if not self.prefilling:
            return
        self.prefilled()
        sample, ttft = self.sample, self.router.ttft_fit
        if sample is not None and ttft is not None:
            ttft.observe(self.rep.id, sample[1], sample[2], time.perf_counter() - sample[0])

    def served(self, media_header: Optional[str]) -> None:
        """The replica answered a routed request 200: it is up (passive health), an engine without KV events now
        holds the prompt, and its media header says what its http(s) images hashed to."""
        if self.rep is None or self.decision is None:
            return
        self.router.fleet.record_served(self.rep.id, self.hashes)
        if media_header:
            self.router.learn_media(self.body, media_header)

    def failed(self, reason: str, timeout: bool = False) -> None:
        """The replica refused or reset the connection (out of routing at once), or its connect timed out
        (`timeout`: one failed health check); the load leaves it."""
        if self.rep is None:
            return
        fleet = self.router.fleet
        (fleet.report_timeout if timeout else fleet.report_failure)(self.rep.id, reason)
        self.leave()

    def usage(self, actual: Optional[int]) -> None:
        """What the replica that answered reports as cached (None: nothing): counted against its prediction."""
        if actual is None or self.rep is None or self.decision is None:
            return
        d, metrics = self.decision, self.router.metrics
        predicted = d.predicted_for(self.rep.id)
        metrics.actual_cached_tokens.inc(actual)
        metrics.usage_prompt_tokens.inc(d.num_prompt_tokens)
        metrics.predicted_cached_tokens.inc(predicted)
        metrics.prediction_error.observe(actual - predicted)

    def leave(self) -> None:
        """The last byte has gone, or the request failed: one fewer in flight on the replica (and its adapter)."""
        rep = self.rep
        if rep is None:
            return
        self.prefilled()
        rep.in_flight -= 1
        adapter = self.decision.adapter if self.decision is not None else None
        if adapter is not None:
            self.router.fleet.adapters.done(rep.id, adapter)
        self.rep = None
