"""The fleet as one router sees it: membership, active health checks, KV-event feeds and snapshot resyncs.

Active checks GET the engine's readiness path (`dialect.ready_path`; a warmfleet replica's
/ready, which is 503 while its model loads). A replica leaves routing at once when it refuses
connections or resets them (a health check or a request: the process is gone), or after
`health_failures` failures in a row: active checks that time out or answer non-200, and requests
whose connect times out (one slow answer from a busy replica is not death: purging its index for it
would send its warm prefixes elsewhere). Its
index entries are purged when it leaves (it may come back cold). When it passes a check again it
is routable, and a snapshot resync rebuilds what it holds.

Passive health: a replica that answered a routed request 200 within the last health interval has
just shown it is up and ready, so that round sends it no probe (counted in
`health_probes_skipped_total`); it is still probed at least every `health_passive_max_s` (1 s), so a
readiness that turns 503 under steady traffic is seen within that. In front of vLLM the probes were
five requests a second per replica into its API server, which shares the CPU with the engine, and
about a third of the router's own samples on a loaded host (issue 26).

A round in which every replica's check timed out (two replicas or more, none refused, none
answered) is not counted against any of them: a stall of the router or of the host between it
and the fleet (CPU throttling, a frozen network path, or a simulator hosting every replica) is far
likelier than every replica hanging in the same 0.2 s, and taking them all out would purge the
whole index and answer 503 to everything until they pass again. Such rounds are counted
(`health_stall_rounds_total`) and logged; once they go on for `stall_grace_s` in a row they count
as usual (a partition, not a stall). Refused connections still take a replica out at once, and
requests that fail to connect still report it (passive detection).

Drain: a replica that is going away (its EndpointSlice endpoint turned terminating, or an admin
call for a static fleet) stays a member but takes no new requests; those in flight, streams
included, finish on it, and its hot prefixes are handed to the replicas that own them without it
(`Warmer.handoff`). Draining replicas are routed only when no other replica is healthy, as
Kubernetes itself uses terminating-but-serving endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable, Optional

import aiohttp
import httpx

from ...events import EventBatch, Snapshot
from . import lora
from .engines.warmfleet import WarmfleetDialect
from .index import Applied, KVIndex
from .metrics import RouterMetrics
from .registry import Registry, Replica, ReplicaSpec
from .subscriber import CurveKeys, EventSubscriber, cancel
from .warmup import Warmer, WarmupConfig

log = logging.getLogger(__name__)

RESYNC_ATTEMPTS = 5  # snapshot fetches in a row before waiting for the next trigger
RESYNC_MIN_INTERVAL_S = 0.2  # spacing of back-to-back snapshot fetches of one replica
ADAPTER_POLL_S = 1.0  # LoRA adapter metric scrape interval (replicas that list adapters only)
MODELS_EVERY = 5  # /v1/models (which adapters, their identities) every this many adapter scrapes
STALL_GRACE_S = 10.0  # rounds of all-timeouts forgiven for this long in a row, then counted (a partition)


class Fleet:
    node_tiers = None  # node_tiers.NodeTiers when --node-tier-events names node tiers (runtime.running sets it)

    def __init__(self, http: httpx.AsyncClient, metrics: RouterMetrics, *, health_interval_s: float = 0.2,
                 health_timeout_s: float = 0.5, health_failures: int = 2, health_passive_max_s: float = 1.0,
                 model_fingerprint: Optional[str] = None, block_size: Optional[int] = None,
                 upstream_headers: Optional[dict] = None, dialect=None,
                 warmup: WarmupConfig = WarmupConfig(), index_max_blocks: Optional[int] = None,
                 stall_grace_s: float = STALL_GRACE_S, adapter_poll_s: Optional[float] = ADAPTER_POLL_S,
                 event_curve: Optional[CurveKeys] = None):
        self.http = http
        self.event_curve = event_curve  # CURVE client keys of the KV-event subscriptions (None: plain ZMQ)
        self.dialect = dialect or WarmfleetDialect()  # how this fleet's engine names blocks, speaks events, resyncs
        self.metrics = metrics
        self.index = KVIndex(index_max_blocks)  # None: unbounded (mirrors the replicas' pools)
        metrics.index_blocks.set_function(self.index.num_blocks)  # index gauges are read when scraped
        self.registry = Registry(on_down=self._on_down, on_up=self._on_up)
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.health_failures = max(1, health_failures)
        self.health_passive_max_s = health_passive_max_s  # 0: every replica probed every round
        self.stall_grace_s = stall_grace_s
        self.health_stall_rounds = 0  # rounds in which every check timed out (not counted against the replicas)
        self._stall_since: Optional[float] = None  # start of the current run of such rounds
        self.model_fingerprint, self.block_size = model_fingerprint, block_size
        self.upstream_headers = upstream_headers or {}
        self._subscribers: dict[str, asyncio.Task] = {}
        self._resyncs: dict[str, asyncio.Task] = {}
        self._resync_again: set[str] = set()
        self._health_task: Optional[asyncio.Task] = None
        self._probe: Optional[aiohttp.ClientSession] = None  # health checks (see _check)
        self.warmer = Warmer(warmup, http, metrics, self.upstream_headers)  # replays hot prefixes into joiners
        self.adapters = lora.AdapterView()  # LoRA adapters each replica serves and holds (lora.py)
        self.adapter_poll_s = adapter_poll_s  # None: never scraped (no adapter affinity)
        self._adapter_task: Optional[asyncio.Task] = None
        self._adapter_rounds = 0

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.check_health()
        self._health_task = asyncio.create_task(self._every(self.health_interval_s, self.check_health, "health"))
        if self.adapter_poll_s is not None:
            await self.scrape_adapters()
            self._adapter_task = asyncio.create_task(self._every(self.adapter_poll_s, self.scrape_adapters,
                                                                 "adapter scrape"))

    def probe_session(self) -> aiohttp.ClientSession:
        """The health checks' own pooled keep-alive session (made in the running loop, closed by stop())."""
        if self._probe is None or self._probe.closed:
            self._probe = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None))
        return self._probe

    async def stop(self) -> None:
        await self.warmer.stop()
        tasks = list(self._subscribers.values()) + list(self._resyncs.values())
        for t in (self._health_task, self._adapter_task):
            if t is not None:
                tasks.append(t)
        for t in tasks:
            await cancel(t)
        self._subscribers.clear()
        self._resyncs.clear()
        if self._probe is not None:
            await self._probe.close()

    async def set_members(self, specs: Iterable[ReplicaSpec]) -> None:
        """Make the fleet exactly `specs` (static flags or a discovery update)."""
        specs = list(specs)
        added, removed = self.registry.set_members(specs)
        for rid in removed:
            task = self._subscribers.pop(rid, None)
            if task is not None:
                await cancel(task)
            self.index.remove(rid)
            self.adapters.forget(rid)
            m = self.metrics
            for gauge, labels in ((m.replica_healthy, (rid,)), (m.replica_in_flight, (rid,)),
                                  (m.replica_queued_tokens, (rid,)), (m.replica_draining, (rid,)),
                                  (m.replica_engine_queue, (rid,)), (m.replica_warming, (rid,)),
                                  (m.replica_blocks, (rid, "gpu")), (m.replica_blocks, (rid, "cpu"))):
                try:
                    gauge.remove(*labels)
                except KeyError:
                    pass
            log.info("replica %s left the fleet", rid)
        for spec in added:
            self.metrics.follow_replica(self.registry.replicas[spec.id])
            self._follow_index(spec.id)
            log.info("replica %s joined the fleet (events: %s)", spec.id, spec.events or "none")
            if spec.events:
                self._subscribers[spec.id] = asyncio.create_task(self._subscribe(spec))
        for spec in specs:  # endpoints that turned terminating drain; the drain of a terminating one ends
            rep = self.registry.get(spec.id)
            if rep is None:
                continue
            if spec.draining:
                self.drain(spec.id, "terminating")
            elif rep.draining and rep.drain_trigger == "terminating":
                self.undrain(spec.id)
        if added:
            await asyncio.gather(*(self._check(self.registry.replicas[s.id]) for s in added))

    # --- drain ------------------------------------------------------------------------------
    def drain(self, rid: str, trigger: str) -> bool:
        """Stop sending `rid` new requests and hand its hot prefixes over; False if it is no member."""
        rep = self.registry.get(rid)
        if rep is None:
            return False
        if self.registry.begin_drain(rid, trigger):
            self.warmer.cancel(rid)  # warming a replica that is leaving is wasted work
            self.metrics.replica_draining.labels(rid).set(1)
            self.metrics.drains.labels(trigger).inc()
            log.info("replica %s is draining (%s): no new requests, %d in flight finish", rid, trigger, rep.in_flight)
            self.warmer.handoff(self, rep)
        return True

    def undrain(self, rid: str) -> bool:
        """Route to `rid` again (warming it first if it came back cold); False if it is no member."""
        rep = self.registry.get(rid)
        if rep is None:
            return False
        if self.registry.end_drain(rid):
            self.metrics.replica_draining.labels(rid).set(0)
            log.info("replica %s drain ended", rid)
            self.even_share(rep)
            if rep.healthy:
                self.warmer.begin(self, rep)
        return True

    # --- routing view -----------------------------------------------------------------------
    def even_share(self, rep: Replica) -> None:
        """`rep` becomes routable (joined, back, warmed, undrained): its recent share starts at the others' mean.

        The share cap is (1 + eps) x the mean share + 1. A joiner at 0 lowers the mean by 1/n, which put
        every other replica over the cap at once: each warm request spilled cold until the shares evened
        out over ~SHARE_WINDOW requests. That was the TTFT tail after a scale-out (bench/scaleout.py:
        no load_spill in the steady window, 2-8 per 0.5 s once the joiner was routable, each a cold prefill)."""
        others = [r.sent for r in self.registry.healthy() if r is not rep and not r.draining and not r.warming]
        rep.sent = sum(others) / len(others) if others else 0.0

    def routable(self) -> list[Replica]:
        """Healthy replicas neither warming up nor draining; failing those, the warming ones, then the draining."""
        healthy = self.registry.healthy()
        serving = [r for r in healthy if not r.draining]
        return [r for r in serving if not r.warming] or serving or healthy

    def engine_load(self, rid: str, max_age_s: float = 2.0, now: Optional[float] = None) -> int:
        """Running + waiting requests from the replica's latest Load event, if fresh (at `now`, monotonic)."""
        st = self.index.replicas.get(rid)
        if st is None or st.load is None or (time.monotonic() if now is None else now) - st.load_time > max_age_s:
            return 0
        return st.load.num_running + st.load.num_waiting

    def node_copy_costs(self) -> list[float]:
        """Each member replica's measured seconds per node-tier load (its latest Load event's), where it sent one."""
        out = []
        for rid in self.registry.replicas:
            st = self.index.replicas.get(rid)
            cost = st.load.node_copy_s_per_block if st is not None and st.load is not None else None
            if cost is not None:
                out.append(cost)
        return out

    # --- LoRA adapters ----------------------------------------------------------------------
    async def scrape_adapters(self) -> None:
        """Every healthy replica's lora_requests_info; its /v1/models too every MODELS_EVERY rounds (and the first)."""
        models = self._adapter_rounds % MODELS_EVERY == 0
        self._adapter_rounds += 1
        reps = self.registry.healthy()
        http = self.probe_session()
        await asyncio.gather(*(lora.scrape(self.adapters, r.id, r.spec.url, http, self.upstream_headers,
                                           self.dialect, models or r.id not in self.adapters.replicas)
                               for r in reps))

    # --- health -----------------------------------------------------------------------------
    @staticmethod
    async def _every(interval_s: float, round_fn, what: str) -> None:
        """`round_fn()` every `interval_s` until cancelled; a failed round is logged, the next one still runs."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await round_fn()
            except Exception:
                log.exception("%s round failed", what)

    def _answered_lately(self, rep: Replica, now: float) -> bool:
        """Passive health (module docstring): it answered within the interval and was probed not too long ago."""
        return (rep.healthy and now - rep.answered_at < self.health_interval_s
                and now - rep.probed_at < self.health_passive_max_s)

    async def _check_or_skip(self, rep: Replica, now: float) -> tuple[bool, bool, bool, str]:
        if self._answered_lately(rep, now):
            self.metrics.health_probes_skipped.inc()
            return True, False, False, ""
        return await self._check_once(rep)

    async def check_health(self) -> None:
        reps = list(self.registry.replicas.values())
        start = time.monotonic()
        results = await asyncio.gather(*(self._check_or_skip(r, start) for r in reps))
        now = time.monotonic()
        if len(reps) >= 2 and all(res[2] for res in results):  # every check timed out: see the module docstring
            first = self._stall_since is None
            if first:
                self._stall_since = now
            if now - self._stall_since < self.stall_grace_s:
                self.health_stall_rounds += 1
                self.metrics.health_stall_rounds.inc()
                if first:  # once per run of such rounds (they come every health interval); the counter counts all
                    log.warning("every replica's health check timed out in the same round (%d replicas): "
                                "taken as a stall of this router or its host, not %d failures; replicas stay "
                                "routable. If this repeats, check the router's CPU limit (throttling) and the network "
                                "path to the replicas", len(reps), len(reps))
                return
        else:
            self._stall_since = None
        for rep, res in zip(reps, results):
            await self._apply_check(rep, res)

    async def _check(self, rep: Replica) -> None:
        await self._apply_check(rep, await self._check_once(rep))

    async def _check_once(self, rep: Replica) -> tuple[bool, bool, bool, str]:
        """One health check: (ok, refused, timed out, error)."""
        path = self.dialect.ready_path  # readiness, not liveness: a replica still loading its model is not routable
        rep.probed_at = time.monotonic()
        # aiohttp, not httpx: ~0.13 ms of CPU per check against ~0.63 ms (bench/router_throughput.py,
        # docs/scale.md); with 64 replicas checked 5 times a second that is 4% of a core instead of 20%
        try:
            async with self.probe_session().get(rep.spec.url + path, headers=self.upstream_headers,
                                                 timeout=aiohttp.ClientTimeout(total=self.health_timeout_s),
                                                 allow_redirects=False) as resp:
                status = resp.status
                await resp.read()
            return status == 200, False, False, "" if status == 200 else f"{path} answered {status}"
        except aiohttp.ClientConnectorError:  # refused or unreachable: nothing is listening
            return False, True, False, f"{path}: ConnectError"
        except asyncio.TimeoutError as exc:  # aiohttp's ServerTimeoutError is one too
            return False, False, True, f"{path}: {type(exc).__name__}"
        except (aiohttp.ClientError, OSError) as exc:
            return False, False, False, f"{path}: {type(exc).__name__}"

    async def _apply_check(self, rep: Replica, result: tuple[bool, bool, bool, str]) -> None:
        ok, refused, _, err = result
        if ok:
            rep.failed_checks = 0
            self.registry.mark_up(rep.id)
            load = await self.dialect.poll_load(rep, self.http)  # engines whose load is not in their events
            if load is not None:
                st = self.index.state(rep.id)
                st.load, st.load_time = load, time.monotonic()
                self.metrics.replica_engine_queue.labels(rep.id).set(load.num_running + load.num_waiting)
            return
        rep.failed_checks += 1
        if refused or rep.failed_checks >= self.health_failures or not rep.healthy:
            self.registry.mark_down(rep.id, err)
        else:
            log.info("replica %s failed a health check (%s); %d more in a row take it out",
                     rep.id, err, self.health_failures - rep.failed_checks)

    def record_served(self, rid: str, hashes: list[bytes]) -> None:
        """A replica answered a routed prompt 200 (it is up: passive health); engines without KV events learn
        it as a prediction."""
        rep = self.registry.get(rid)
        if rep is not None:
            rep.answered_at = time.monotonic()
        self.dialect.served(self.index, rid, hashes)

    def report_failure(self, rid: str, error: str) -> None:
        """Passive detection: a request's connection was refused or reset (the process is gone)."""
        self.registry.mark_down(rid, error)

    def report_timeout(self, rid: str, error: str) -> None:
        """Passive detection: a request's connect timed out. That counts as one failed health check, not
        death: a stalled router host or a replica's full accept queue time out too, and taking every
        replica out on one stall would purge the whole index (refusals and resets still remove at once)."""
        rep = self.registry.get(rid)
        if rep is None:
            return
        rep.failed_checks += 1
        if rep.failed_checks >= self.health_failures:
            self.registry.mark_down(rid, error)

    def _on_down(self, rid: str) -> None:
        log.warning("replica %s is down: %s", rid, self.registry.replicas[rid].last_error)
        self.index.purge(rid)
        self.dialect.forget(rid)
        self.adapters.forget(rid)
        self.warmer.cancel(rid)
        self.metrics.replica_healthy.labels(rid).set(0)

    def _on_up(self, rid: str) -> None:
        log.info("replica %s is up", rid)
        self.metrics.replica_healthy.labels(rid).set(1)
        self.request_resync(rid, "recovered")
        self.even_share(self.registry.replicas[rid])
        self.warmer.begin(self, self.registry.replicas[rid])  # a joiner or a restart starts cold: warm it first

    # --- events and resync ------------------------------------------------------------------
    async def _subscribe(self, spec: ReplicaSpec) -> None:
        rid = spec.id
        sub = EventSubscriber(
            spec.events or "", self.dialect.decode,
            on_batch=lambda b: self._on_batch(rid, b),
            on_connect=lambda: self.request_resync(rid, "connect"),
            on_bad=lambda exc: self.metrics.bad_events.labels(rid).inc(),
            curve=self.event_curve,
        )
        while True:  # a subscription never dies: whatever ends it is logged and it starts over
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV-event subscription to %s failed; reconnecting", spec.events)
                await asyncio.sleep(0.5)

    def _on_batch(self, rid: str, batch: EventBatch) -> None:
        before = self.index.state(rid).seq
        result = self.index.apply_batch(rid, batch)
        self.metrics.event_lag.observe(max(0.0, time.time() - batch.ts))
        if result is Applied.NEED_RESYNC:
            cause = "restart" if before is not None and batch.seq <= before else "gap"
            self.request_resync(rid, cause)
        elif result is Applied.BUFFERED and rid not in self._resyncs:
            self.request_resync(rid, "unsynced")  # an earlier resync gave up; events prove the replica is back

    def request_resync(self, rid: str, cause: str) -> None:
        rep = self.registry.get(rid)
        if rep is None or not rep.spec.events or not rep.kv_tracked:
            return
        self.metrics.resyncs.labels(rid, cause).inc()  # every trigger counts, also one folded into a running fetch
        if rid in self._resyncs:
            self._resync_again.add(rid)  # a newer trigger: run once more after the current fetch
            return
        self._resyncs[rid] = asyncio.create_task(self._resync(rid))

    async def _resync(self, rid: str) -> None:
        try:
            for attempt in range(RESYNC_ATTEMPTS):
                self._resync_again.discard(rid)
                rep = self.registry.get(rid)
                if rep is None:
                    return
                seq_at_request = self.index.state(rid).seq
                snap = await self._fetch_snapshot(rep)
                if snap is None:
                    await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
                    continue
                result = self.index.apply_snapshot(rid, snap, seq_at_request)
                if result is Applied.OK and rid not in self._resync_again:
                    return
                await asyncio.sleep(RESYNC_MIN_INTERVAL_S)  # a flood of bad frames costs a few fetches a second, no more
        finally:
            self._resyncs.pop(rid, None)

    async def _fetch_snapshot(self, rep: Replica) -> Optional[Snapshot]:
        snap = await self.dialect.fetch_state(rep, self.http, self.upstream_headers)
        if snap is not None:
            self._check_compatible(rep.id, snap)
        return snap

    def _check_compatible(self, rid: str, snap: Snapshot) -> None:
        if self.model_fingerprint and snap.model_fingerprint and snap.model_fingerprint != self.model_fingerprint:
            log.error("replica %s serves model %s, the router hashes for %s: its cache will never match",
                      rid, snap.model_fingerprint, self.model_fingerprint)
        if self.block_size and snap.block_size and snap.block_size != self.block_size:
            log.error("replica %s uses block size %d, the router %d: set the router's --block-size to match",
                      rid, snap.block_size, self.block_size)

    def _follow_index(self, rid: str) -> None:
        """`replica_index_blocks{rid, tier}` read the index when scraped (set per event batch, they were a few % of
        the router's CPU on new prompts, whose every request brings events)."""
        def size(tier: str):
            return lambda: len(getattr(self.index.replicas[rid], tier)) if rid in self.index.replicas else 0

        for tier in ("gpu", "cpu"):
            self.metrics.replica_blocks.labels(rid, tier).set_function(size(tier))
