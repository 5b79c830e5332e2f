"""Active-active routers: this router's load per replica and open requests per client, shared with peer routers.

Several `warmfleet route` processes behind a plain load balancer each follow every replica's KV
events, so their prefix decisions agree; what each one knows only for itself is the load it put
on the replicas. Each router serves its own figures at `GET /v1/router/peer-load` (JSON) and
polls every peer given with `--peers` every `interval_s` (100 ms):

    router A ── GET /v1/router/peer-load ──▶ router B   {"router": id, "replicas": {url: [in_flight,
             ◀── B's own figures ──────────            queued_tokens, sent]}, "clients": {digest: open}}

The policy then scores replicas on A's own figures plus the sums of its fresh peers' in flight and
queued prefill tokens (real load, whoever sent it), and on the mean over the routers of the recent
share counts (`sent`, decayed per router over its own requests): the share cap's additive slack is
in requests of one router's window, and a sum over k routers would make it k times tighter, throwing
away warm prefixes a single router keeps. The per-client limit counts a client's open requests on
every router. Why polling router figures rather than the replicas' own queue gauges: the gauges
(`Load` in KV events) count only what reached the engine, carry no queued prefill tokens and no
recent share, and an engine without events (FastDeploy) has none; the router figures exist for
every engine kind and are exact at the moment they are read. What polling gives up: a peer's
decisions of the last interval are unseen (at 100 ms and 34 requests/s over 3 routers, about one
request per peer), so a burst can overshoot a bound by that much.

Herding: routers that share one view also share its argmin. Between two reports every router
sends its new conversations to the same least-loaded replica (its own requests are counted at once,
the others' only at their next report), and the queue that piles up there spills that replica's warm
conversations. So with peers each candidate's tie-break (never its share cap) gets a random
`jitter` of up to that many recent requests: equally loaded replicas are then picked at random,
differently by each router.

Simultaneous decisions: requests that reach several routers in the same instant (a burst spread by
a load balancer) are placed before any report, polled or pushed, could tell one router of the
others' picks, so they herd on the same least-loaded replicas; neither a faster poll (0.02 s) nor
pushed deltas changed that (docs/scale.md). `--peer-partition-tokens N` (default 256) gives each
router a preference instead: the replicas it owns (`owned`: rendezvous over the fresh routers' ids, balanced
so that each owns an equal part; the same partition in every router's view) count N fewer queued tokens
than the others, so simultaneous picks of different routers land on different replicas unless the load
says otherwise.
An owned replica above the mean recent share loses its preference (`preferred`): without that rule
each router filled its own third up to the share cap, and spread rose from 1.17 to 1.39 at 64
replicas.

Uncertainty: a peer's in-flight figures are as of its last report, so each router's view of a
replica's in-flight count is off by about one request per fresh peer (sent or finished since).
Bounded load enforced to the request on such a view threw away long warm prefixes for phantom
load (on the 600-request excerpt: 3 routers' 14-25 spills a run lost 1.0-9.7k cached tokens
where one router's lost 0.1-1.0k; docs/history/scale-rounds.md, "Third round"), so `fresh` is handed to the policy
as `Candidate.unseen`, which widens the in-flight slack for keeping a warm prefix by that much and
nothing else.

A peer that has not answered for `stale_s` is left out of the sums (a dead router holds no
requests; a partitioned one is then counted as zero, so a limit can be exceeded by what it
holds). A URL that answers with this router's own id is itself (one `--peers` list for every
router, e.g. a headless Service) and is not polled again. No pickle: JSON both ways. With `--admin-key`
the endpoint needs `Authorization: Bearer <admin key>` and polls send it, so the routers of one service
share one admin key, which also keys the client digests; without one it answers only on the router's own
host (router/status.py, `admin_denied`), so routers on other hosts need the key to share load.

A `--peers` URL whose host is a name (http only) stands for every address the name resolves to,
looked up again every `resolve_s`: on Kubernetes the operator passes the routers' headless Service
(`NAME-router-peers`), so routers that come and go are found without restarts.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import math
import secrets
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import aiohttp

from .policy import rendezvous_weight

log = logging.getLogger(__name__)

PEER_LOAD_PATH = "/v1/router/peer-load"
ZERO = (0, 0, 0.0)


def client_digest(client: str, key: bytes = b"") -> str:
    """A client's name as peers see it: API keys and addresses never leave the router in clear, and with `key` (the
    routers' shared admin key) not even as a digest one could test guesses against."""
    return hashlib.blake2b(client.encode(), digest_size=12, key=key[:64]).hexdigest()


def balanced_owners(replicas: Iterable[str], routers: Sequence[str]) -> dict[str, str]:
    """replica -> the router that owns it: rendezvous with room, each of K routers owning floor(N/K) or
    ceil(N/K) of the N replicas.

    Plain rendezvous splits 16 replicas over 3 routers 5/5/6 in only 15 % of draws and leaves one router 2 or 3
    of them in over 40 %: such a router gets a third of the traffic for under a fifth of the fleet, its replicas
    pass the mean share and lose their preference, and its picks land on the others' parts again. Here
    (replica, router) pairs are taken by weight, highest first, and a pair binds when the replica is still free
    and the router has room: every router draws the same partition from the same sets, and most replicas keep
    their plain rendezvous owner.
    """
    reps = set(replicas)
    pairs = sorted(((rendezvous_weight(rid.encode(), r), rid, r) for rid in reps for r in routers), reverse=True)
    base, extra = divmod(len(reps), len(routers))
    counts = dict.fromkeys(routers, 0)
    out: dict[str, str] = {}
    for _, rid, router in pairs:
        n = counts[router]
        if rid in out or not (n < base or (n == base and extra)):
            continue
        extra -= n == base
        counts[router] = n + 1
        out[rid] = router
    return out


def parse_peers(text: Optional[str]) -> list[str]:
    """`--peers http://a:8080,http://b:8080` → base URLs (no trailing slash); raises ValueError on junk."""
    out = []
    for part in (text or "").split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")) or "://" == url[-3:]:
            raise ValueError(f"--peers takes http(s)://host:port URLs separated by commas, got {part!r}")
        out.append(url)
    return out


@dataclass
class PeerState:
    """What one peer router last told us."""

    url: str
    router: Optional[str] = None  # its id (None until it answered)
    replicas: Optional[dict] = None  # replica id -> (in_flight, queued_tokens, sent)
    clients: Optional[dict] = None  # client digest -> open requests
    seen: float = 0.0  # monotonic time of its last good answer
    is_self: bool = False  # the URL reaches this very router
    failures: int = 0  # polls failed in a row
    last_error: str = ""


class PeerLoad:
    """Polls peer routers and sums their fresh figures; `replica_load` and `client_open` are O(1) lookups."""

    def __init__(self, peers: Iterable[str], *, interval_s: float = 0.1, stale_s: float = 1.0,
                 timeout_s: float = 0.5, router_id: Optional[str] = None, jitter: float = 4.0,
                 resolve_s: float = 5.0, headers: Optional[dict] = None, partition_tokens: int = 0,
                 digest_key: bytes = b""):
        self.router_id = router_id or secrets.token_hex(8)  # random per process: a restarted router is a new peer
        self.configured = list(peers)  # as given; a name's addresses are polled (resolve)
        self.peers = {u: PeerState(u) for u in self.configured}
        self._addresses: dict[str, list[str]] = {}  # configured URL -> the URLs it last resolved to
        self.interval_s, self.stale_s, self.timeout_s = interval_s, stale_s, timeout_s
        self.resolve_s = resolve_s  # how often names in --peers are looked up again
        self.partition_tokens = partition_tokens  # queued tokens added to replicas this router does not own
        self.jitter = jitter  # tie-break noise, in recent requests (see the module docstring: herding)
        self._replicas: dict[str, tuple[int, int, float]] = {}  # sums over fresh peers
        self._clients: dict[str, int] = {}
        self.fresh = 0  # peers (not itself) heard from within stale_s at the last recompute
        self._routers: list[str] = [self.router_id]  # ids of this router and its fresh peers, sorted
        self._owned: dict[frozenset, frozenset] = {}  # replica set -> the part this router owns (see `owned`)
        self._session: Optional[aiohttp.ClientSession] = None
        self.headers = headers or {}  # sent with every poll: the admin key, when the routers have one
        self.digest_key = digest_key  # keys client_digest: the routers' admin key (shared by them, by no client)

    # --- what the policy and the limiter read -------------------------------------------------
    def replica_load(self, rid: str) -> tuple[int, int, float]:
        """(in flight, queued prefill tokens, recent share) that fresh peers have on replica `rid` (sums)."""
        return self._replicas.get(rid, ZERO)

    def combined(self, rid: str, in_flight: int, queued_tokens: int, sent: float) -> tuple[int, int, float]:
        """This router's figures for `rid` with the peers': in flight and queued summed, recent share averaged."""
        p_in, p_queued, p_sent = self._replicas.get(rid, ZERO)
        return in_flight + p_in, queued_tokens + p_queued, (sent + p_sent) / (1 + self.fresh)

    def owned(self, replicas: Iterable[str]) -> frozenset:
        """The replicas of `replicas` this router owns (`balanced_owners` over the fresh routers' ids): every router
        draws the same partition of the same set, so routers deciding at the same moment prefer different replicas
        (--peer-partition-tokens). Memoised per replica set (a request's candidates: the fleet, or an adapter's)."""
        key = replicas if isinstance(replicas, frozenset) else frozenset(replicas)
        got = self._owned.get(key)
        if got is None:
            if len(self._owned) >= 64:
                self._owned.clear()
            owners = balanced_owners(key, self._routers)
            got = self._owned[key] = frozenset(rid for rid, r in owners.items() if r == self.router_id)
        return got

    def preferred(self, combined: dict[str, tuple[int, int, float]]) -> Optional[set]:
        """The replicas this router prefers (`combined`: replica -> its combined figures): those it owns and whose
        recent share is at most the mean, so the preference parts simultaneous picks without loading its own part
        past the others (None: no partition, --peer-partition-tokens 0)."""
        if not self.partition_tokens or not combined:
            return None
        mean = math.fsum(f[2] for f in combined.values()) / len(combined)
        owned = self.owned(combined)
        return {rid for rid, f in combined.items() if f[2] <= mean and rid in owned}

    def client_open(self, client: str) -> int:
        """Requests `client` has open on fresh peers."""
        return self._clients.get(client_digest(client, self.digest_key), 0) if self._clients else 0

    # --- what this router tells its peers -------------------------------------------------------
    def local_report(self, replicas: Iterable, open_by_client: dict[str, int]) -> dict:
        """This router's own figures (never the sums: a peer adds every router once)."""
        return {"router": self.router_id,
                "replicas": {r.id: [r.in_flight, r.queued_tokens, round(r.sent, 3)] for r in replicas},
                "clients": {client_digest(c, self.digest_key): n for c, n in open_by_client.items() if n > 0}}

    def view(self) -> list[dict]:
        now = time.monotonic()
        return [{"url": p.url, "router": p.router, "self": p.is_self,
                 "age_s": round(now - p.seen, 3) if p.seen else None,
                 "fresh": bool(p.seen) and now - p.seen <= self.stale_s, "last_error": p.last_error}
                for p in self.peers.values()]

    # --- polling -----------------------------------------------------------------------------------
    def apply(self, peer: PeerState, report: dict, now: float) -> None:
        """Take one peer's answer (validated: a malformed one is an error, never a crash)."""
        router, reps, clients = report.get("router"), report.get("replicas"), report.get("clients")
        if not isinstance(router, str) or not isinstance(reps, dict) or not isinstance(clients, dict):
            raise ValueError("peer-load answer needs router (str), replicas and clients (objects)")
        if router == self.router_id:
            peer.is_self = True
            return
        parsed = {}
        for rid, v in reps.items():
            if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and x >= 0 for x in v)):
                raise ValueError(f"peer-load replica {rid!r}: expected [in_flight, queued_tokens, sent] >= 0")
            parsed[rid] = (int(v[0]), int(v[1]), float(v[2]))
        if not all(isinstance(n, int) and n >= 0 for n in clients.values()):
            raise ValueError("peer-load clients: expected non-negative integers")
        peer.router, peer.replicas, peer.clients, peer.seen = router, parsed, dict(clients), now
        peer.failures, peer.last_error = 0, ""

    def recompute(self, now: float) -> None:
        """Sums over the peers heard from within `stale_s`; called after every polling round."""
        reps: dict[str, list] = {}
        clients: dict[str, int] = {}
        fresh = 0
        for p in self.peers.values():
            if p.is_self or not p.seen or now - p.seen > self.stale_s:
                continue
            fresh += 1
            for rid, (n, q, s) in p.replicas.items():
                acc = reps.setdefault(rid, [0, 0, 0.0])
                acc[0] += n
                acc[1] += q
                acc[2] += s
            for c, n in p.clients.items():
                clients[c] = clients.get(c, 0) + n
        self._replicas = {rid: (a[0], a[1], a[2]) for rid, a in reps.items()}
        self._clients = clients
        self.fresh = fresh
        routers = sorted({self.router_id} | {p.router for p in self.peers.values()
                                            if p.router and not p.is_self and p.seen and now - p.seen <= self.stale_s})
        if routers != self._routers:  # the fresh routers changed: every replica's owner may have
            self._routers, self._owned = routers, {}

    async def poll(self, peer: PeerState) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None))
        try:
            async with self._session.get(peer.url + PEER_LOAD_PATH, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                self.apply(peer, await resp.json(content_type=None), time.monotonic())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            peer.failures += 1
            peer.last_error = f"{type(exc).__name__}: {exc}"[:200]
            if peer.failures == max(1, round(self.stale_s / self.interval_s)):  # once, as it goes stale
                log.warning("peer router %s not answering %s (%s); its load is left out of routing and client "
                            "limits until it answers; check that --peers lists routers' own URLs",
                            peer.url, PEER_LOAD_PATH, peer.last_error)

    async def resolve(self) -> None:
        """Expand each configured http URL whose host is a name into one URL per address (kept on a failed lookup)."""
        loop = asyncio.get_running_loop()
        for base in self.configured:
            u = urllib.parse.urlsplit(base)
            if u.scheme != "http" or not u.hostname or _is_ip(u.hostname):
                continue  # https: a certificate names the host, not its addresses
            port = u.port or 80
            try:
                infos = await loop.getaddrinfo(u.hostname, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("peer routers %s: cannot resolve %s (%s); polling the addresses it had; check the "
                            "routers' headless Service", base, u.hostname, exc)
                continue
            addrs = sorted({str(info[4][0]) for info in infos})
            self._addresses[base] = [f"http://{f'[{a}]' if ':' in a else a}:{port}" for a in addrs]
        urls = [x for base in self.configured for x in self._addresses.get(base, [base])]
        self.peers = {url: self.peers.get(url) or PeerState(url) for url in dict.fromkeys(urls)}

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.poll(p) for p in self.peers.values() if not p.is_self))
        self.recompute(time.monotonic())

    async def run(self) -> None:
        """Poll every peer each interval until cancelled."""
        resolved = -float("inf")
        try:
            while True:
                if time.monotonic() - resolved >= self.resolve_s:
                    await self.resolve()
                    resolved = time.monotonic()
                await self.poll_once()
                await asyncio.sleep(self.interval_s)
        finally:
            if self._session is not None:
                await self._session.close()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False

