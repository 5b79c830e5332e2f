"""kmock taught PUT and optimistic concurrency for Leases, test side only: every write bumps metadata.resourceVersion,
and a PUT carrying an older one is refused with 409 Conflict, as a real API server does (kmock 0.8 serves no PUT)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp.web
import attrs
import kmock


def conflict(message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict",
                                      "code": 409, "message": message}, status=409)


@attrs.define(kw_only=True)
class FakeLeaseEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with resourceVersion checks on Lease writes; `holders` lists the holder of each accepted write."""

    version: int = attrs.field(default=1, init=False)
    holders: list[str] = attrs.field(factory=list, init=False)
    refused: int = attrs.field(default=0, init=False)  # writes answered 409
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if (request.resource is None or request.resource.plural != "leases"
                or request.method not in (kmock.method.POST, kmock.method.PUT)):
            return await super()._handle(request)
        async with self._writes:  # check and write as one step, as etcd's compare-and-swap
            data: dict[str, Any] = request.data
            meta = data.setdefault("metadata", {})
            try:
                live = self.objects[request.resource, request.namespace or meta.get("namespace"),
                                    request.name or meta.get("name")]
            except KeyError:
                live = None
            live_version = None if live is None or live.deleted else (live.raw.get("metadata") or {}).get("resourceVersion")
            if request.method == kmock.method.PUT and meta.get("resourceVersion") != live_version:
                self.refused += 1
                return conflict(f"the object has been modified (resourceVersion {meta.get('resourceVersion')} "
                                f"is not {live_version})")
            self.version += 1
            meta["resourceVersion"] = str(self.version)
            if request.method == kmock.method.POST:
                response = await super()._handle(request)
            else:  # kmock serves no PUT: a replace of every field the Lease has (the operator writes them all)
                live.patch(data)
                response = aiohttp.web.json_response(live.raw)
            if 200 <= response.status < 300:
                self.holders.append((data.get("spec") or {}).get("holderIdentity") or "")
            return response
