"""LoRA adapters per replica as the router sees them: served (with their hash identity), resident, busy; no web server.

    GET /v1/models  entries with `parent`  → served: name → the dialect's adapter_identity (warmfleet: name and
                                             content digest; vLLM: ("lora", name, lora_path))
    GET /metrics    vllm:lora_requests_info → max_lora, running (resident) and waiting adapters, newest series
    this router     requests it sent        → in flight per adapter, and the last `max_loras` adapters it sent
                                             (resident until the next scrape says otherwise: a burst for a new
                                             adapter converges on one replica before any scrape)

An adapter is *resident* on a replica when the metric's running label or this router's recent sends say so.
A replica has a *slot* for an adapter when it is resident there, or fewer than `max_loras` other adapters are
busy there (requests of this router in flight, waiting on the replica, or for vLLM, whose running label names
every adapter with requests, running there), so taking it evicts nothing in use. Our engine's running label
names its resident slots, busy or idle.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import aiohttp

log = logging.getLogger(__name__)

LORA_INFO = "vllm:lora_requests_info"
RECENT_UNKNOWN_SLOTS = 4  # adapters taken as resident from this router's sends before a scrape says max_lora
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class LoraInfo:
    """One `vllm:lora_requests_info` reading (the GIE model-server protocol's adapter metric)."""

    max_loras: int  # device slots
    running: frozenset  # adapters resident / running there
    waiting: frozenset  # adapters wanted by waiting requests, not resident yet


def parse_lora_info(text: str) -> Optional[LoraInfo]:
    """The newest `vllm:lora_requests_info` series of a Prometheus text page (its value is the time it was read);
    None if the page has none."""
    best, best_t = None, float("-inf")
    for line in text.splitlines():
        if not line.startswith(LORA_INFO + "{"):
            continue
        labels_text, _, value = line.rpartition("}")
        try:
            t = float(value.strip())
        except ValueError:
            continue
        if t >= best_t:
            best, best_t = dict(_LABEL.findall(labels_text)), t
    if best is None:
        return None

    def names(key: str) -> frozenset:
        return frozenset(n for n in best.get(key, "").split(",") if n)

    try:
        max_loras = int(best.get("max_lora", "0") or 0)
    except ValueError:
        max_loras = 0
    return LoraInfo(max_loras, names("running_lora_adapters"), names("waiting_lora_adapters"))


def served_adapters(models: Any, dialect) -> dict[str, Hashable]:
    """Adapter name → identity from a /v1/models answer (entries with a `parent`); entries the dialect cannot key
    (e.g. no digest) are left out, so requests for them are routed as if the replica did not list them."""
    data = models.get("data") if isinstance(models, dict) else None
    out: dict[str, Hashable] = {}
    for card in data if isinstance(data, list) else ():
        if isinstance(card, dict) and card.get("parent") and isinstance(card.get("id"), str):
            ident = dialect.adapter_identity(card)
            if ident is not None:
                out[card["id"]] = ident
    return out


@dataclass
class ReplicaAdapters:
    """What one replica serves and holds, as of its last scrape and this router's sends since."""

    served: dict = field(default_factory=dict)  # name -> identity (dialect.adapter_identity)
    max_loras: int = 0  # device slots; 0: unknown (every replica is taken to have a slot)
    running: frozenset = frozenset()  # the metric's resident / running adapters
    running_busy: bool = False  # the engine's running label names adapters with requests (vLLM), not idle slots
    waiting: frozenset = frozenset()  # the metric's waiting adapters
    recent: OrderedDict = field(default_factory=OrderedDict)  # adapters this router sent, newest last
    in_flight: dict = field(default_factory=dict)  # adapter -> requests of this router in flight there


class AdapterView:
    """Every replica's ReplicaAdapters; fed by `learn_*` (scrapes) and `sent` / `done` (this router's requests)."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaAdapters] = {}
        self._names: frozenset = frozenset()  # every adapter some replica serves (is_adapter: once per request)

    def _update_names(self) -> None:
        self._names = frozenset(n for st in self.replicas.values() for n in st.served)

    def _of(self, rid: str) -> ReplicaAdapters:
        st = self.replicas.get(rid)
        if st is None:
            st = self.replicas[rid] = ReplicaAdapters()
        return st

    def learn_served(self, rid: str, served: dict) -> None:
        self._of(rid).served = dict(served)
        self._update_names()

    def learn_info(self, rid: str, info: LoraInfo, running_busy: bool = False) -> None:
        """A scrape; `running_busy`: the dialect's `lora_running_busy` (what its running label means)."""
        st = self._of(rid)
        st.max_loras, st.running, st.waiting = info.max_loras, info.running, info.waiting
        st.running_busy = running_busy
        # NOTE: `recent` is kept: vLLM's running label names only adapters with running requests, while its
        # slots keep the last max_loras adapters loaded (an LRU, as ours), which is what `recent` models.

    def describe(self, rid: str) -> Optional[dict]:
        """The replicas view's entry: served and resident adapters, slots, this router's in flight (None: none)."""
        st = self.replicas.get(rid)
        if st is None or not st.served:
            return None
        return {"served": sorted(st.served), "max_loras": st.max_loras,
                "resident": sorted(n for n in st.served if self.resident(rid, n)),
                "waiting": sorted(st.waiting), "in_flight": dict(st.in_flight)}

    def forget(self, rid: str) -> None:
        """The replica is down or gone: it comes back with nothing resident."""
        self.replicas.pop(rid, None)
        self._update_names()

    def is_adapter(self, name: Optional[str]) -> bool:
        """Whether some replica serves `name` as an adapter."""
        return name in self._names

    def identity(self, rid: str, name: str) -> Optional[Hashable]:
        st = self.replicas.get(rid)
        return st.served.get(name) if st is not None else None

    def resident(self, rid: str, name: str) -> bool:
        st = self.replicas.get(rid)
        return st is not None and (name in st.running or name in st.recent)

    def has_slot(self, rid: str, name: str) -> bool:
        """Resident, or fewer than max_loras other adapters busy there (or max_loras unknown)."""
        st = self.replicas.get(rid)
        if st is None or not st.max_loras or self.resident(rid, name):
            return True
        busy = {n for n, k in st.in_flight.items() if k > 0} | set(st.waiting)
        if st.running_busy:
            busy |= st.running
        busy.discard(name)
        return len(busy) < st.max_loras

    def sent(self, rid: str, name: Optional[str]) -> None:
        """This router sent `rid` a request for adapter `name` (None: the base model)."""
        if name is None:
            return
        st = self._of(rid)
        st.in_flight[name] = st.in_flight.get(name, 0) + 1
        st.recent[name] = None
        st.recent.move_to_end(name)
        while len(st.recent) > (st.max_loras or RECENT_UNKNOWN_SLOTS):
            oldest = next((n for n in st.recent if not st.in_flight.get(n)), None)
            if oldest is None:
                break
            del st.recent[oldest]

    def done(self, rid: str, name: Optional[str]) -> None:
        """That request has ended (answered, failed or moved)."""
        st = self.replicas.get(rid)
        if name is None or st is None or name not in st.in_flight:
            return
        left = st.in_flight[name] - 1
        if left > 0:
            st.in_flight[name] = left
        else:
            del st.in_flight[name]


async def scrape(view: AdapterView, rid: str, url: str, http, headers: dict, dialect, models: bool) -> None:
    """One replica's adapters: its /v1/models (when `models`) and, if it serves any, its lora_requests_info.

    `http`: an aiohttp.ClientSession (the health checks' one: a GET there costs a fifth of httpx's CPU, and this
    runs every second for every replica). A replica that does not answer keeps what was known of it (its health
    check decides whether it is gone)."""
    timeout = aiohttp.ClientTimeout(total=5.0)
    try:
        if models:
            async with http.get(url + "/v1/models", headers=headers, timeout=timeout, allow_redirects=False) as resp:
                if resp.status == 200:
                    view.learn_served(rid, served_adapters(await resp.json(content_type=None), dialect))
        st = view.replicas.get(rid)
        if st is None or not st.served:
            return
        async with http.get(url + "/metrics", headers=headers, timeout=timeout, allow_redirects=False) as resp:
            info = parse_lora_info(await resp.text()) if resp.status == 200 else None
        if info is not None:
            view.learn_info(rid, info, dialect.lora_running_busy)
    except Exception as exc:  # noqa: BLE001 - a scrape never takes the loop down
        log.debug("adapter scrape of %s failed: %s", rid, type(exc).__name__)
