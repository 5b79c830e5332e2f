"""An in-memory stand-in for the operator's Kube client (get, create, apply, list, delete, patch_status), recording each call."""

from __future__ import annotations

from typing import Any


class MemoryKube:
    """get / create / apply / list / delete / patch_status over a dict, recording each call."""

    def __init__(self, existing: list[dict[str, Any]] = ()) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): o for o in existing}
        self.deleted: list[str] = []
        self.status_patches: list[dict[str, Any]] = []

    async def apply(self, obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
        key = (obj["kind"], obj["metadata"]["name"])
        action = "unchanged" if self.objects.get(key) == obj else "patched" if key in self.objects else "created"
        self.objects[key] = obj
        return obj, action

    async def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        from warmfleet.kube import KubeError

        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            raise KubeError(409, f"{key[0]} {key[1]} already exists")
        self.objects[key] = obj
        return obj

    async def list(self, kind: str, ns: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return [o for (k, _), o in self.objects.items() if k == kind
                and selector.items() <= ((o["metadata"].get("labels") or {}).items())]

    async def delete(self, kind: str, ns: str, name: str) -> None:
        self.deleted.append(f"{kind}/{name}")
        self.objects.pop((kind, name), None)

    async def patch_status(self, kind: str, ns: str, name: str, patch: dict[str, Any]) -> None:
        self.status_patches.append(patch)
