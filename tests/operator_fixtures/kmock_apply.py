"""kmock taught server-side apply, test side only: an apply-PATCH creates a missing object and removes
the fields its field manager applied last time but not this time.

kmock 0.8 answers an apply-PATCH to a missing object with 404 and merges every PATCH body into the
object, so a dropped field would stay. This emulation is what the operator relies on from a real API
server; it is simplified: lists are atomic (no merge keys), nothing conflicts, managedFields are not
written. Use with `pytestmark = pytest.mark.kmock(cls=FakeApplyEmulator)`. `FakeVersionedEmulator` also bumps
an InferenceService's resourceVersion on each merge patch.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp.web
import attrs
import kmock

APPLY_PATCH = "application/apply-patch+yaml"


def apply_as_merge_patch(previous: Any, intent: Any) -> Any:
    """The merge patch that turns what a manager applied before (`previous`) into `intent`: None drops a key."""
    if not isinstance(previous, dict) or not isinstance(intent, dict):
        return intent
    patch = {k: apply_as_merge_patch(previous.get(k), v) for k, v in intent.items()}
    patch.update({k: None for k in previous if k not in intent})
    return patch


@attrs.define(kw_only=True)
class FakeApplyEmulator(kmock.KubernetesEmulator):
    """kmock's emulator, plus server-side apply (create if missing; drop what the manager no longer applies)."""

    applied: dict[tuple[Any, ...], dict[str, Any]] = attrs.field(factory=dict, init=False)  # (object, manager) → intent
    applies: int = attrs.field(default=0, init=False)  # apply-PATCH requests served

    async def _handle(self, request: kmock.Request) -> Any:
        if (request.method == kmock.method.PATCH and request.name is not None and request.subresource is None
                and (request.headers.get("Content-Type") or "").startswith(APPLY_PATCH)):
            async with self._lock:  # as the emulator's own writes: store, then tell the watchers
                event = self._apply(request, json.loads(request.body))
                await self._buses[request.resource].put(event)
            return aiohttp.web.json_response(event["object"])
        return await super()._handle(request)

    def _apply(self, request: kmock.Request, intent: dict[str, Any]) -> dict[str, Any]:
        self.applies += 1
        obj_key = (request.resource, request.namespace, request.name)
        key = (*obj_key, request.params.get("fieldManager"))
        previous, self.applied[key] = self.applied.get(key), intent
        try:
            obj = self.objects[obj_key]
        except KeyError:
            self.objects[obj_key] = intent
            return {"type": "ADDED", "object": self.objects[obj_key].raw}
        if obj.deleted:
            obj.create(intent)
            return {"type": "ADDED", "object": obj.raw}
        obj.patch(apply_as_merge_patch(previous, intent))
        return {"type": "MODIFIED", "object": obj.raw}


@attrs.define(kw_only=True)
class FakeVersionedEmulator(FakeApplyEmulator):
    """Bumps an InferenceService's resourceVersion on each merge patch (status included), as a real API server does.

    kmock keeps it constant; kopf then cannot tell a fresh body from its own echo (its consistency check waits for
    the resourceVersion its last patch returned): it hands handlers a stale spec once the operator itself writes
    spec.replicas (which only the autoscaler does), and it runs the handlers again for every queued event of its
    own or another replica's writes, each one with the stale last-handled configuration.
    """

    version: int = attrs.field(default=100, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if (request.method == kmock.method.PATCH and isinstance(request.data, dict) and request.resource is not None
                and request.resource.plural == "inferenceservices"):
            self.version += 1
            request.data.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        return await super()._handle(request)
