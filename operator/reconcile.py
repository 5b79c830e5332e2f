"""One idempotent reconcile of an InferenceService: plan, apply children, prune pools, write status."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import kopf

from warmfleet.operator import manifests as m
from warmfleet.operator.engines import check_spec
from warmfleet.operator.kube import Kube
from warmfleet.operator.nodes import NodeInfo
from warmfleet.operator.plan import Plan, make_plan
from warmfleet.operator.schema import SpecError
from warmfleet.operator.spec import KIND, parse_spec, served_name
from warmfleet.operator.status import healthy_status, invalid_status, status_patch

# (body, type, reason, message) → posts a Kubernetes Event; kopf.event in the operator
EventFn = Callable[[Mapping[str, Any], str, str, str], None]


def kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post an Event about `body` through kopf's background poster."""
    kopf.event(dict(body), type=type_, reason=reason, message=message)


def utcnow() -> str:
    """RFC 3339 UTC timestamp, seconds precision."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class OperatorState:
    """Operator-wide state, created in the startup hook and shared through kopf's memo."""

    default_image: str
    connection: Any = None  # kopf ConnectionInfo from the login handler
    kube: Kube | None = None
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)  # service uid → last applied plan digest

    def client(self) -> Kube:
        """The API client, built on first use from the login handler's connection."""
        if self.kube is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in yet", delay=1)
            self.kube = Kube.from_connection(self.connection)
        return self.kube

    def lock(self, uid: str) -> asyncio.Lock:
        """Serialises reconciles of one service (handler vs node or child events)."""
        return self.locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        """Drop per-service state after deletion."""
        self.locks.pop(uid, None)
        self.fingerprints.pop(uid, None)


def owned(children: list[dict[str, Any]], body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Children with the owner reference to `body` (kopf.append_owner_reference; GC deletes them with it)."""
    kopf.append_owner_reference(children, owner=kopf.Body(dict(body)) if not isinstance(body, kopf.Body) else body)
    return children


def plan_for(body: Mapping[str, Any], nodes: list[NodeInfo], default_image: str) -> tuple[m.Owner, Any, Plan]:
    """Parse the spec, check it against its engine's capabilities and plan; raises SpecError for a bad spec."""
    meta = body.get("metadata") or {}
    owner = m.Owner(name=meta["name"], namespace=meta.get("namespace") or "default")
    spec = parse_spec(body.get("spec"))
    previous_model = (body.get("status") or {}).get("model")
    if previous_model and previous_model != served_name(spec, owner.name):
        raise SpecError("spec.model.servedName", f"is immutable: was {previous_model!r}, now {served_name(spec, owner.name)!r}")
    check_spec(spec)
    return owner, spec, make_plan(owner, spec, nodes, m.images_for(spec, default_image))


def fingerprint(plan: Plan) -> str:
    """Digest of the desired children: equal digests mean a node change altered nothing."""
    return hashlib.sha256(json.dumps(plan.children, sort_keys=True).encode()).hexdigest()


@dataclass
class Outcome:
    """What one reconcile did (for logs and tests)."""

    actions: dict[str, str] = field(default_factory=dict)  # "Kind/name" → created|patched|unchanged|deleted
    status_written: bool = False
    invalid: str | None = None


async def reconcile(
    state: OperatorState, body: Mapping[str, Any], nodes: list[NodeInfo], *, post_event: EventFn = kopf_event,
    now: Callable[[], str] = utcnow, alive: Callable[[], bool] = lambda: True,
) -> Outcome:
    """Bring children and status in line with spec + nodes. Idempotent; a bad spec becomes InvalidSpec + Event.

    `alive` is checked once the per-service lock is held: a reconcile queued behind another
    one for a service deleted meanwhile does nothing.
    """
    meta = body.get("metadata") or {}
    uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    async with state.lock(uid):
        if not alive():
            return Outcome()
        return await _reconcile(state, body, nodes, post_event, now, uid)


async def _reconcile(state: OperatorState, body: Mapping[str, Any], nodes: list[NodeInfo],
                     post_event: EventFn, now: Callable[[], str], uid: str) -> Outcome:
    kube = state.client()
    meta = body.get("metadata") or {}
    name, ns = meta["name"], meta.get("namespace") or "default"
    generation = meta.get("generation")
    previous = dict(body.get("status") or {})
    out = Outcome()
    try:
        owner, spec, plan = plan_for(body, nodes, state.default_image)
    except SpecError as exc:
        out.invalid = str(exc)
        old = next((c for c in previous.get("conditions", []) if c.get("type") == "InvalidSpec"), {})
        if old.get("status") != "True" or old.get("message") != str(exc):
            post_event(body, "Warning", "InvalidSpec", str(exc))
        new = invalid_status(message=str(exc), generation=generation, previous=previous, now=now())
        out.status_written = await _write_status(kube, ns, name, previous, new)
        return out

    digest = fingerprint(plan)  # before owner references are added, as the node watch computes it
    children = owned(plan.children, body)
    live: dict[tuple[str, str], dict[str, Any]] = {}
    for obj in children:
        key = (obj["kind"], obj["metadata"]["name"])
        live[key], out.actions[f"{key[0]}/{key[1]}"] = await kube.apply(obj)
    wanted = {o["metadata"]["name"] for o in children if o["kind"] == "Deployment"}
    server_sel = {m.SERVICE_LABEL: name[:63], m.COMPONENT_LABEL: "server"}
    for dep in await kube.list("Deployment", ns, server_sel):
        dname = dep["metadata"]["name"]
        if dname not in wanted and _owned_by(dep, meta.get("uid")):
            await kube.delete("Deployment", ns, dname)
            out.actions[f"Deployment/{dname}"] = "deleted"
    state.fingerprints[uid] = digest

    ready_by_pool = {}
    for p in plan.pools:
        dep = live.get(("Deployment", m.k8s_name(name, p.pool.name)))
        ready_by_pool[p.pool.name] = int(((dep or {}).get("status") or {}).get("readyReplicas") or 0)
    router = live.get(("Deployment", m.names(owner)["router"])) or {}
    router_ready = int((router.get("status") or {}).get("readyReplicas") or 0)
    new = healthy_status(
        plan=plan, generation=generation, model=served_name(spec, owner.name), endpoint=m.endpoint_url(owner, spec),
        selector=m.selector_string(owner), ready_by_pool=ready_by_pool, router_ready=router_ready,
        previous=previous, now=now(),
    )
    out.status_written = await _write_status(kube, ns, name, previous, new)
    return out


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


async def _write_status(kube: Kube, ns: str, name: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    patch = status_patch(old, new)
    if patch is None:
        return False
    await kube.patch_status(KIND, ns, name, patch)
    return True


def render(body: Mapping[str, Any], nodes: list[NodeInfo], default_image: str) -> list[dict[str, Any]]:
    """The exact children the operator would apply for `body` and `nodes`, offline; raises SpecError."""
    body = dict(body)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", "00000000-0000-0000-0000-000000000000")
    body["metadata"] = meta
    body.setdefault("apiVersion", "serving.warmfleet.io/v1alpha1")
    body.setdefault("kind", KIND)
    _, _, plan = plan_for(body, nodes, default_image)
    return owned(plan.children, body)
