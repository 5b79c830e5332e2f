"""One idempotent reconcile of an InferenceService: plan, apply children, prune pools, write status."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import kopf

from warmfleet.kube import Kube, KubeError, Login
from warmfleet.operator.passes import model_config as mc
from warmfleet.operator.passes.admin_secret import ensure_admin_secret
from warmfleet.operator.passes.kv_curve_secret import ensure_kv_curve_secret
from warmfleet.operator.passes.kube_client import connect
from warmfleet.operator.passes.node_tier_secret import ensure_node_tier_secret
from warmfleet.operator.planning import admin_policy, engine_choice, gateway, lora_plan, objects
from warmfleet.operator.planning.diagnose import claims_to_check, diagnose
from warmfleet.operator.planning.engine_descriptions import check_spec
from warmfleet.operator.planning.kv_curve import curve_secret_name
from warmfleet.operator.planning.node_tier_objects import tier_daemonset_name, tier_names, tier_pools
from warmfleet.operator.planning.nodes import NodeInfo
from warmfleet.operator.planning.plan import Plan, make_plan
from warmfleet.operator.planning.service_status import healthy_status, invalid_status, status_patch, warnings
from warmfleet.operator.spec.constants import KIND, MANAGED_BY, SERVICE_LABEL
from warmfleet.operator.spec.inference_service import parse_spec, served_name
from warmfleet.operator.spec.schema import SpecError

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

    default_images: objects.Images  # the engine and router images when a service names none
    policy: admin_policy.AdminPolicy = field(default_factory=admin_policy.AdminPolicy)  # what the admin allows specs
    connection: Any = None  # kopf ConnectionInfo from the login handler
    login: Login | None = None  # the login handler again: fresh credentials when the client needs them
    kube: Kube | None = None
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)  # service uid → last applied plan digest
    pod_digests: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # uid → diagnosis of the pods last reconciled
    conditions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # uid → conditions last written (Event de-dup)
    model_configs: mc.ConfigCache = field(default_factory=mc.ConfigCache)  # config.json reads of hf:// and s3:// sources
    autoscale: dict[str, Any] = field(default_factory=dict)  # uid → autoscale_policy.History (samples, recommendations)

    def client(self) -> Kube:
        """The API client, built on first use from the login handler's connection."""
        if self.kube is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in yet", delay=1)
            self.kube = connect(self.connection, self.login)
        return self.kube

    def lock(self, uid: str) -> asyncio.Lock:
        """Serialises reconciles of one service (handler vs node or child events)."""
        return self.locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        """Drop per-service state after deletion."""
        self.locks.pop(uid, None)
        self.fingerprints.pop(uid, None)
        self.pod_digests.pop(uid, None)
        self.conditions.pop(uid, None)
        self.autoscale.pop(uid, None)


def pod_digest(pods: list[Mapping[str, Any]]) -> tuple[str | None, str]:
    """What the pods say about a service, before any API check: a pod event that leaves it equal changes nothing."""
    d = diagnose(pods)
    return d.reason, d.message


def owned(children: list[dict[str, Any]], body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Children with the owner reference to `body` (kopf.append_owner_reference; GC deletes them with it)."""
    kopf.append_owner_reference(children, owner=kopf.Body(dict(body)) if not isinstance(body, kopf.Body) else body)
    return children


def plan_for(body: Mapping[str, Any], nodes: list[NodeInfo], default_images: objects.Images,
             learned: mc.Learned | None = None, policy: admin_policy.AdminPolicy | None = None,
             ) -> tuple[objects.Owner, Any, Plan]:
    """Parse the spec, check it against its engine's capabilities and the admin's `policy`, and plan; raises
    SpecError for a bad spec.

    The hidden size and dtype come from the spec, else from config.json (`learned`, or what the
    service's status remembers of it), else defaults; the returned spec carries the values used.
    """
    meta = body.get("metadata") or {}
    owner = objects.Owner(name=meta["name"], namespace=meta.get("namespace") or "default")
    spec = parse_spec(body.get("spec"))
    previous_model = (body.get("status") or {}).get("model")
    if previous_model and previous_model != served_name(spec, owner.name):
        raise SpecError("spec.model.servedName", f"is immutable: was {previous_model!r}, now {served_name(spec, owner.name)!r}")
    spec, choice = engine_choice.resolve(spec, nodes)  # engine.kind auto -> the engine the pools fit
    check_spec(spec)
    policy = policy or admin_policy.AdminPolicy()
    admin_policy.check(spec, policy)
    spec = mc.effective(spec, mc.resolve(spec, learned if learned is not None else mc.from_status(body)))
    lora_plan.check(spec, served_name(spec, owner.name))
    return owner, spec, make_plan(owner, spec, nodes, objects.images_for(spec, default_images), policy, choice)


def fingerprint(plan: Plan) -> str:
    """Digest of the desired children and of the nodes left out for taints (TaintsTolerated says which): equal digests
    mean a node change altered nothing."""
    untolerated = [[u.node, u.pool, [str(t) for t in u.taints]] for u in plan.untolerated]
    return hashlib.sha256(json.dumps([plan.children, untolerated], sort_keys=True).encode()).hexdigest()


@dataclass
class Outcome:
    """What one reconcile did (for logs and tests)."""

    actions: dict[str, str] = field(default_factory=dict)  # "Kind/name" → created|patched|unchanged|deleted
    status_written: bool = False
    invalid: str | None = None
    reason: str | None = None  # the Ready condition's reason
    missing: str | None = None  # a CRD gateway mode needs is not served (why): the handler retries with backoff
    pools: int | None = None  # node pools the plan sized (None: no plan, e.g. an invalid spec)


async def reconcile(
    state: OperatorState, body: Mapping[str, Any], nodes: list[NodeInfo], *, post_event: EventFn = kopf_event,
    now: Callable[[], str] = utcnow, alive: Callable[[], bool] = lambda: True,
    pods: Callable[[], list[Mapping[str, Any]]] | list[Mapping[str, Any]] | None = None,
) -> Outcome:
    """Bring children and status in line with spec + nodes. Idempotent; a bad spec becomes InvalidSpec + Event.

    `alive` is checked once the per-service lock is held: a reconcile queued behind another
    one for a service deleted meanwhile does nothing. `pods` are the service's pods (slim
    copies from the operator's pod index, or a function returning them, called once the lock
    is held so a queued reconcile sees the latest; None: not watched) and say why it is not
    Ready; a Ready or Degraded reason that changes to a problem is posted once as a Warning Event.
    """
    meta = body.get("metadata") or {}
    uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    async with state.lock(uid):
        if not alive():
            return Outcome()
        return await _reconcile(state, body, nodes, post_event, now, uid, pods() if callable(pods) else pods)


async def _reconcile(state: OperatorState, body: Mapping[str, Any], nodes: list[NodeInfo],
                     post_event: EventFn, now: Callable[[], str], uid: str,
                     pods: list[Mapping[str, Any]] | None = None) -> Outcome:
    """1. plan (an invalid spec stops here), 2. apply children and prune pools, 3. readiness, 4. status and Events."""
    kube = state.client()
    meta = body.get("metadata") or {}
    name, ns = meta["name"], meta.get("namespace") or "default"
    generation = meta.get("generation")
    previous = dict(body.get("status") or {})
    out = Outcome()
    learned = await mc.learn(state.model_configs, kube, ns, body, state.policy.allowed_endpoint_hosts)
    try:
        owner, spec, plan = plan_for(body, nodes, state.default_images, learned, state.policy)
    except SpecError as exc:
        out.invalid = str(exc)
        out.status_written = await _report_invalid_spec(state, kube, body, uid, str(exc), learned, post_event, now)
        return out

    digest = fingerprint(plan)  # before owner references are added, as the node watch computes it
    out.pools = len(plan.pools)
    served = await _served_gateway_kinds(kube, spec, previous)
    admin = await ensure_admin_secret(kube, owner, spec, lambda objs: owned(objs, body))  # before pods read it
    curve = await ensure_kv_curve_secret(kube, owner, spec, lambda objs: owned(objs, body))  # likewise
    token = await ensure_node_tier_secret(kube, owner, bool(tier_pools(plan.pools)), lambda objs: owned(objs, body))
    children = [c for c in owned(plan.children, body) if served.get(c["kind"], True)]  # a kind not served waits
    live, out.actions = await _apply_and_prune(kube, children, name, ns, meta.get("uid"),
                                               PRUNED_KINDS + tuple(k for k, ok in served.items() if ok))
    if admin == "created":
        out.actions[f"Secret/{objects.names(owner)['admin']}"] = "created"
    if curve == "created":
        out.actions[f"Secret/{curve_secret_name(owner)}"] = "created"
    if token == "created":
        out.actions[f"Secret/{tier_names(owner)['token']}"] = "created"
    state.fingerprints[uid] = digest
    ready_by_pool, router_ready = ready_replicas(plan, live, name, owner)
    node_tiers = tier_pods(plan, live, name)
    gw = None
    if spec.router.mode == "gateway":
        gw = gateway.gateway_state(owner, spec, live, pool_served=served["InferencePool"], route_served=served["HTTPRoute"],
                                   gateway_obj=await _read_gateway(kube, spec, ns) if served["HTTPRoute"] else None)
        out.missing = gw.missing[1] if gw.missing else None
    diag = None
    if pods is not None:
        diag = diagnose(pods, await _missing_claims(kube, ns, pods))
        state.pod_digests[uid] = pod_digest(pods)
    new = healthy_status(
        plan=plan, generation=generation, model=served_name(spec, owner.name),
        endpoint=gw.endpoint if gw is not None else objects.endpoint_url(owner, spec),
        selector=objects.selector_string(owner), ready_by_pool=ready_by_pool, router_ready=router_ready,
        previous=previous, now=now(), pods=diag, gateway=gw, node_tiers=node_tiers,
    )
    new = mc.with_model_config(new, body, learned, now(), generation)
    out.status_written = await _write_status(kube, ns, name, previous, new)
    _post_new_warnings(state, body, uid, previous, new, post_event)
    out.reason = next((c.get("reason") for c in new["conditions"] if c.get("type") == "Ready"), None)
    return out


async def _report_invalid_spec(state: OperatorState, kube: Kube, body: Mapping[str, Any], uid: str, error: str,
                               learned: mc.Learned | None, post_event: EventFn, now: Callable[[], str]) -> bool:
    """Step 1 failed: an InvalidSpec Event when the error is new, then the InvalidSpec status; True if written."""
    meta = body.get("metadata") or {}
    generation, previous = meta.get("generation"), dict(body.get("status") or {})
    last = state.conditions.get(uid, previous.get("conditions", []))
    old = next((c for c in last if c.get("type") == "InvalidSpec"), {})
    if old.get("status") != "True" or old.get("message") != error:
        post_event(body, "Warning", "InvalidSpec", error)
    new = invalid_status(message=error, generation=generation, previous=previous, now=now())
    new = mc.with_model_config(new, body, learned, now(), generation)
    _post_model_config_warning(post_event, body, last, new)
    written = await _write_status(kube, meta.get("namespace") or "default", meta["name"], previous, new)
    state.conditions[uid] = new["conditions"]
    return written


# Kinds of children that some specs render and others do not (a pool's Deployment, the router's objects in proxy
# mode, the endpoint picker's in gateway mode): what is labelled ours, owned by the service and no longer wanted is
# deleted. InferencePool and HTTPRoute join them where the cluster serves them. ConfigMap is always rendered.
PRUNED_KINDS = ("Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy",
                "DaemonSet")
GATEWAY_KINDS = ("InferencePool", "HTTPRoute")


async def _served_gateway_kinds(kube: Kube, spec: Any, previous: Mapping[str, Any]) -> dict[str, bool]:
    """Whether the cluster serves InferencePool and HTTPRoute: asked (discovery) in gateway mode and on the pass after
    it (its conditions still in status: what it created is pruned), else not asked (and nothing of them rendered)."""
    was_gateway = any(c.get("type") in gateway.CONDITION_TYPES for c in previous.get("conditions") or [])
    if spec.router.mode != "gateway" and not was_gateway:
        return {}
    return {kind: await kube.serves(kind) for kind in GATEWAY_KINDS}


async def _read_gateway(kube: Kube, spec: Any, ns: str) -> dict[str, Any] | None:
    """spec.router.gateway's Gateway (for its address), or None: none named, absent, or not ours to read (403)."""
    ref = spec.router.gateway
    if ref is None:
        return None
    try:
        return await kube.get("Gateway", ref.namespace or ns, ref.name)
    except KubeError as exc:
        if exc.status != 403:
            raise
        return None


async def _apply_and_prune(kube: Kube, children: list[dict[str, Any]], name: str, ns: str, owner_uid: str | None,
                           pruned: tuple[str, ...] = PRUNED_KINDS,
                           ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, str]]:
    """Step 2: apply every child, delete the service's objects of `pruned` kinds no longer planned: (live, actions)."""
    live: dict[tuple[str, str], dict[str, Any]] = {}
    actions: dict[str, str] = {}
    for obj in children:
        key = (obj["kind"], obj["metadata"]["name"])
        live[key], actions[f"{key[0]}/{key[1]}"] = await kube.apply(obj)
    ours = {SERVICE_LABEL: name[:63], **MANAGED_BY}
    for kind in pruned:
        for found in await kube.list(kind, ns, ours):
            fname = found["metadata"]["name"]
            if (kind, fname) not in live and _owned_by(found, owner_uid):
                await kube.delete(kind, ns, fname)
                actions[f"{kind}/{fname}"] = "deleted"
    return live, actions


def ready_replicas(plan: Plan, live: Mapping[tuple[str, str], Mapping[str, Any]], name: str,
                   owner: objects.Owner) -> tuple[dict[str, int], int]:
    """Step 3: ready replicas of each pool's Deployment and of the router's, as the applied objects report them."""
    ready_by_pool = {}
    for p in plan.pools:
        dep = live.get(("Deployment", objects.k8s_name(name, p.pool.name)))
        ready_by_pool[p.pool.name] = int(((dep or {}).get("status") or {}).get("readyReplicas") or 0)
    router = live.get(("Deployment", objects.names(owner)["router"])) or {}
    return ready_by_pool, int((router.get("status") or {}).get("readyReplicas") or 0)


def _post_new_warnings(state: OperatorState, body: Mapping[str, Any], uid: str, previous: dict[str, Any],
                       new: dict[str, Any], post_event: EventFn) -> None:
    """Step 4's Events: a Warning for each problem `new` raises that the last written status did not; remember `new`."""
    # De-dup against what this process last wrote (the body may predate it), else the stored status (a restart).
    last = {"conditions": state.conditions[uid]} if uid in state.conditions else previous
    for reason, message in warnings(last, new):
        post_event(body, "Warning", reason, message)
    _post_model_config_warning(post_event, body, last.get("conditions", []), new)
    state.conditions[uid] = new["conditions"]


async def _missing_claims(kube: Kube, ns: str, pods: list[Mapping[str, Any]]) -> set[str]:
    """Claims mounted by not-Ready pods that do not exist (a GET each; none while every pod is Ready).

    The scheduler names a missing claim, but a pod already bound to a node only waits in
    ContainerCreating while the kubelet reports FailedMount as an Event: this check covers both.
    Without RBAC for it (403) nothing is known, and the pods' own messages still speak.
    """
    missing = set()
    for claim in sorted(claims_to_check(pods)):
        try:
            if await kube.get("PersistentVolumeClaim", ns, claim) is None:
                missing.add(claim)
        except KubeError as exc:
            if exc.status != 403:
                raise
    return missing


def _post_model_config_warning(post_event: EventFn, body: Mapping[str, Any], last: list[dict[str, Any]],
                               new: dict[str, Any]) -> None:
    warning = mc.model_config_warning({"conditions": last}, new)
    if warning:
        post_event(body, "Warning", *warning)


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


async def _write_status(kube: Kube, ns: str, name: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    patch = status_patch(old, new)
    if patch is None:
        return False
    await kube.patch_status(KIND, ns, name, patch)
    return True


def render(body: Mapping[str, Any], nodes: list[NodeInfo], default_images: objects.Images,
           learned: mc.Learned | None = None) -> list[dict[str, Any]]:
    """The exact children the operator would apply for `body` and `nodes`, offline; raises SpecError.

    config.json is not read here: `learned` (model_config.learn_now), else the body's status, says what it holds.
    """
    body = dict(body)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", "00000000-0000-0000-0000-000000000000")
    body["metadata"] = meta
    body.setdefault("apiVersion", "serving.warmfleet.io/v1alpha1")
    body.setdefault("kind", KIND)
    _, _, plan = plan_for(body, nodes, default_images, learned)
    return owned(plan.children, body)


def tier_pods(plan: Plan, live: Mapping[tuple[str, str], Mapping[str, Any]], name: str) -> dict[str, tuple[int, int]]:
    """Step 3 for the node tier: (ready, desired) pods of each tier pool's DaemonSet as applied (0, 0 before its
    controller has counted)."""
    out = {}
    for pool in tier_pools(plan.pools):
        st = (live.get(("DaemonSet", tier_daemonset_name(name, pool))) or {}).get("status") or {}
        out[pool] = (int(st.get("numberReady") or 0), int(st.get("desiredNumberScheduled") or 0))
    return out
