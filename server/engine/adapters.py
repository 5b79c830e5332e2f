"""LoRA adapter residency: served names -> files, a host-memory LRU over the disk, device slots pinned by running requests; no paddle.

    disk ──load──► host LRU (--max-cpu-loras adapters) ──put──► device slots (--max-loras, LRU of unpinned)

A request holds its adapter's slot (a pin) from admission until it finishes or is preempted; the
scheduler admits a request only when `can_acquire` says its adapter is resident or a slot is free or
held by an adapter nobody runs, so a request never waits on a slot it could take and is never refused
for want of one. Slots are keyed by identity (name and digest): an adapter unloaded and loaded again
under its name with other files never runs a request with the old weights, nor an old request with
the new ones (`serves`). Loading and moving weights is the caller's (`load`, `put`, `drop` callbacks).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..hashing import AdapterId, adapter_digest


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: its served name, directory and identity in the hash chain."""

    name: str
    path: str
    id: AdapterId


class AdapterManager:
    def __init__(self, max_loras: int, max_cpu_loras: int, load: Callable[[str, str], Any],
                 put: Callable[[int, Any], None], drop: Callable[[int], None]):
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"need 1 <= max_loras ({max_loras}) <= max_cpu_loras ({max_cpu_loras})")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._load, self._put, self._drop = load, put, drop
        self.adapters: dict[str, Adapter] = {}
        self.host: OrderedDict[str, Any] = OrderedDict()  # name -> weights in host memory; first = least recent
        self.resident: OrderedDict[AdapterId, int] = OrderedDict()  # -> device slot; first = least recent
        self.free_slots: list[int] = list(range(max_loras - 1, -1, -1))
        self.pins: dict[AdapterId, int] = {}  # -> running requests holding its slot
        self.num_disk_loads = 0  # adapters read from disk (registration included)
        self.num_device_loads = 0  # adapters copied into a device slot

    # ---- names ---------------------------------------------------------------------------
    def register(self, name: str, path: str) -> Adapter:
        """Serve the adapter at `path` as `name`: read and checked now (ValueError), kept in the host LRU."""
        if name in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        weights = self._load(name, path)
        self.num_disk_loads += 1
        adapter = Adapter(name, str(path), AdapterId(name, adapter_digest(path)))
        self.adapters[name] = adapter
        self._keep_host(name, weights)
        return adapter

    def unregister(self, name: str) -> None:
        """Stop serving `name`; its slot is freed now, or when the last request running on it ends."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        self.host.pop(name, None)
        if adapter.id in self.resident and not self.pins.get(adapter.id):
            self._evict(adapter.id)

    def identity(self, name: str) -> AdapterId:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        return adapter.id

    def serves(self, aid: AdapterId) -> bool:
        """Whether `aid` is still what its name serves (not unloaded, nor replaced by other files)."""
        adapter = self.adapters.get(aid.name)
        return adapter is not None and adapter.id == aid

    @property
    def resident_names(self) -> list[str]:
        return [aid.name for aid in self.resident]

    # ---- slots ---------------------------------------------------------------------------
    def can_acquire(self, aid: AdapterId) -> bool:
        """Whether `acquire(aid)` would find a slot now (resident, free, or held by an idle adapter)."""
        return aid in self.resident or bool(self.free_slots) or any(not self.pins.get(a) for a in self.resident)

    def acquire(self, aid: AdapterId) -> int:
        """Pin the adapter's device slot, loading it (from host memory, else disk) into a slot first if needed."""
        if not self.serves(aid):
            raise ValueError(f"LoRA adapter {aid.name!r} ({aid.digest}) is not loaded")
        name = aid.name
        slot = self.resident.get(aid)
        if slot is None:
            if not self.free_slots:
                victim = next((n for n in self.resident if not self.pins.get(n)), None)
                if victim is None:
                    raise RuntimeError("every LoRA slot is pinned; check can_acquire first")
                self._evict(victim)
            weights = self.host.get(name)
            if weights is None:
                weights = self._load(name, self.adapters[name].path)
                self.num_disk_loads += 1
            self._keep_host(name, weights)
            slot = self.free_slots.pop()
            self._put(slot, weights)
            self.num_device_loads += 1
            self.resident[aid] = slot
        self.resident.move_to_end(aid)
        self.pins[aid] = self.pins.get(aid, 0) + 1
        return slot

    def release(self, aid: AdapterId) -> None:
        """Drop one pin; the slot stays resident (LRU) unless the adapter was unregistered meanwhile."""
        left = self.pins.get(aid, 0) - 1
        if left < 0:
            raise RuntimeError(f"LoRA adapter {aid.name!r} released more often than acquired")
        if left:
            self.pins[aid] = left
            return
        self.pins.pop(aid, None)
        if not self.serves(aid) and aid in self.resident:
            self._evict(aid)

    def _evict(self, aid: AdapterId) -> None:
        slot = self.resident.pop(aid)
        self._drop(slot)
        self.free_slots.append(slot)

    def _keep_host(self, name: str, weights: Any) -> None:
        self.host[name] = weights
        self.host.move_to_end(name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
