"""One pass of the autoscaler for one InferenceService (the kopf timer in handlers.py runs it): scrape the
service's routers, write spec.replicas when the decision (autoscale_policy.decide) changes it, status.autoscaling
and status.warmup, and the servers' pod-deletion costs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import httpx

from warmfleet.kube import KubeError
from warmfleet.operator.passes import bounded_http
from warmfleet.operator.passes.admin_secret import secret_value
from warmfleet.operator.passes.reconcile import OperatorState, plan_for, utcnow
from warmfleet.operator.planning import engine_descriptions, gateway, objects, router_objects
from warmfleet.operator.planning import autoscale_policy as a
from warmfleet.operator.planning.nodes import NodeInfo
from warmfleet.operator.planning.plan import planned_limits
from warmfleet.operator.spec.schema import SpecError, to_dict
from warmfleet.server.router.epp.settings import HTTP_PORT as EPP_HTTP_PORT

DEFAULT_INTERVAL_S = 15.0
SCALED = ("ScaleOut", "ScaleIn", "BelowMin", "AboveMax")

log = logging.getLogger(__name__)


def router_urls(template: str | None, owner: objects.Owner, port: int, router_pods: list[Mapping[str, Any]],
                *, pod_port: int = engine_descriptions.HTTP_PORT, service: str | None = None) -> list[str]:
    """Base URLs of the service's routers: the template (tests, a proxy) with {name}, {namespace}, {service}
    and {port}; else every Ready router pod by IP on `pod_port` (counters stay per process); else the router Service
    (`service`: another one, e.g. the endpoint pickers' in gateway mode)."""
    service = service or objects.names(owner)["endpoint"]
    if template:
        return [template.format(name=owner.name, namespace=owner.namespace, service=service, port=port)]
    urls = []
    for pod in router_pods:
        st = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if st.get("podIP") and ready and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            ip = st["podIP"]
            urls.append(f"http://{f'[{ip}]' if ':' in ip else ip}:{pod_port}")
    return sorted(urls) or [f"http://{service}.{owner.namespace}.svc:{port}"]


async def run_pass(state: OperatorState, body: Mapping[str, Any], nodes: list[NodeInfo], patch: MutableMapping[str, Any],
                   *, template: str | None = None, http: httpx.AsyncClient | None = None,
                   clock: Callable[[], float] = time.monotonic, now: Callable[[], str] = utcnow) -> a.Decision | None:
    """Scrape, decide and write through `patch` (kopf's patch of this object: spec.replicas, status) and the client
    (pod annotations). Returns the decision, or None when the service does not autoscale or no router answered."""
    meta = body.get("metadata") or {}
    uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    try:
        owner, spec, plan = plan_for(body, nodes, state.default_images, policy=state.policy)
    except SpecError:
        return None  # the reconcile reports it
    kube = state.client()
    hist: a.History = state.autoscale.setdefault(uid, a.History())
    if spec.router.mode == "gateway":  # the endpoint pickers serve the routers' /metrics and /v1/router/replicas
        component, port, pod_port, service = "epp", EPP_HTTP_PORT, EPP_HTTP_PORT, gateway.names(owner)["epp"]
    else:
        component, port, pod_port, service = "router", spec.router.port, engine_descriptions.HTTP_PORT, None
    router_pods = [] if template else await kube.list("Pod", owner.namespace, router_objects.front_door_selector(owner, component))
    urls = router_urls(template, owner, port, router_pods, pod_port=pod_port, service=service)
    admin = await _admin_headers(kube, owner, spec)
    if http is None:
        async with httpx.AsyncClient() as client:
            metrics, views, errors = await scrape(client, urls, headers=admin)
    else:
        metrics, views, errors = await scrape(http, urls, headers=admin)
    failure = "; ".join(f"{u}: {e}" for u, e in errors.items()) if errors and not metrics else None
    if failure != hist.failure:  # said when it starts or changes, not on every pass
        if failure:
            log.info("%s/%s: no router answered (%s); autoscaling holds, warm-up status and deletion costs wait. "
                     "Check that the operator reaches the router pods (NetworkPolicy) or set --router-url-template.",
                     owner.namespace, owner.name, failure)
        else:
            log.info("%s/%s: the routers answer again", owner.namespace, owner.name)
        hist.failure = failure
    t = clock()
    status = dict(body.get("status") or {})
    if views:
        warmup = to_dict(a.warmup_summary(views))
        if status.get("warmup") != warmup:
            patch.setdefault("status", {})["warmup"] = warmup
        await _deletion_costs(kube, owner, views, hist)

    cfg = spec.autoscaling
    if cfg is None or not cfg.enabled:
        return None
    sample = a.make_sample(t, metrics)
    if sample is not None:
        hist.samples.append(sample)
    hist.keep(t, cfg.metrics_window_seconds + max(cfg.scale_up_stabilization_seconds, cfg.scale_down_stabilization_seconds))
    caps, floors = planned_limits(spec, plan)
    current = {p.pool.name: p.replicas for p in plan.pools}
    d = a.decide(current=current, capacities=caps, floors=floors, cfg=cfg, samples=hist.samples,
                 recommendations=hist.recommendations, now=t)
    hist.recommendations.append((t, d.recommendation))
    previous = status.get("autoscaling") or {}
    scaled = d.reason in SCALED and (body.get("spec") or {}).get("replicas") != d.total
    if scaled:  # through the spec, as `kubectl scale` does: the reconcile that follows splits it over the pools
        patch.setdefault("spec", {})["replicas"] = d.total
    if hist.last != (d.total, d.reason) or (previous.get("desiredReplicas"), previous.get("reason")) != (d.total, d.reason):
        entry = {"desiredReplicas": d.total, "pools": d.pools, "reason": d.reason, "message": d.message}
        last_scale = now() if scaled else previous.get("lastScaleTime")
        if last_scale:
            entry["lastScaleTime"] = last_scale
        patch.setdefault("status", {})["autoscaling"] = entry
        hist.last = (d.total, d.reason)
        level = logging.INFO if scaled else logging.DEBUG
        log.log(level, "%s/%s autoscaling: %s %s", owner.namespace, owner.name, d.reason, d.message)
    return d


async def _admin_headers(kube: Any, owner: objects.Owner, spec: Any) -> dict[str, str]:
    """The service's admin key as a Bearer header for the routers' admin routes; {} when it cannot be read (the
    routers then answer 401/403 and the scrape says so)."""
    name, key = objects.admin_key_ref(owner, spec)
    try:
        value = secret_value(await kube.get("Secret", owner.namespace, name), key)
    except KubeError as exc:
        if exc.status != 403:
            raise
        return {}
    return {"Authorization": f"Bearer {value}"} if value else {}


async def _deletion_costs(kube: Any, owner: objects.Owner, views: list[dict[str, Any]], hist: a.History) -> None:
    """Annotate server pods with what their loss would cost the fleet's caches (only values that changed)."""
    if hist.costs_forbidden:
        return
    pods = await kube.list("Pod", owner.namespace, objects.server_selector(owner))
    costs = a.deletion_costs(views, pods)
    by_name = {p["metadata"]["name"]: p for p in pods}
    for name, cost in sorted(costs.items()):
        have = ((by_name[name].get("metadata") or {}).get("annotations") or {}).get(a.DELETION_COST_ANNOTATION)
        if have == str(cost) or hist.costs.get(name) == cost:
            continue
        try:
            await kube.patch("Pod", owner.namespace, name,  # one merge patch: no read, no applied-intent annotation
                             {"metadata": {"annotations": {a.DELETION_COST_ANNOTATION: str(cost)}}})
        except KubeError as exc:
            if exc.status == 403:
                hist.costs_forbidden = True
                log.warning("%s/%s: cannot annotate pods with %s (%s): scale-in removes arbitrary replicas. Grant "
                            "`patch` on pods (chart value operator.podDeletionCost=true) to keep the warmest ones.",
                            owner.namespace, owner.name, a.DELETION_COST_ANNOTATION, exc)
                return
            if exc.status != 404:  # a pod gone meanwhile is fine
                raise
        hist.costs[name] = cost
    for gone in set(hist.costs) - set(by_name):
        hist.costs.pop(gone, None)


# ---- scrape --------------------------------------------------------------------------------

async def scrape(http: httpx.AsyncClient, urls: Sequence[str], timeout_s: float = 5.0,
                 headers: Mapping[str, str] | None = None,
                 ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], dict[str, str]]:
    """GET /metrics and /v1/router/replicas of every router: (parsed metrics by URL, replica views, errors by URL).
    `headers`: the service's admin key (the routers' replica view is an admin route). Each read is capped
    (bounded_http) and follows no redirect: one router cannot run the operator out of memory."""
    async def one(url: str) -> tuple[str, Any, Any, str | None]:
        try:
            m = await bounded_http.request(http, "GET", url + "/metrics", timeout_s=timeout_s, headers=headers,
                                           limit=bounded_http.METRICS_MAX_BYTES)
            v = await bounded_http.request(http, "GET", url + "/v1/router/replicas", timeout_s=timeout_s,
                                           headers=headers, limit=bounded_http.JSON_MAX_BYTES)
            m.raise_for_status(url + "/metrics")
            v.raise_for_status(url + "/v1/router/replicas")
            view = json.loads(v.content)
            if not isinstance(view, dict):
                raise ValueError("/v1/router/replicas: not a JSON object")
            return url, a.parse_metrics(m.text), view, None
        except (httpx.HTTPError, ValueError) as exc:
            return url, None, None, f"{type(exc).__name__}: {exc}"

    metrics, views, errors = {}, [], {}
    for url, m, v, err in await asyncio.gather(*(one(u) for u in urls)):
        if err is not None:
            errors[url] = err
        else:
            metrics[url] = m
            views.append(v)
    return metrics, views, errors
