"""Thin kopf handlers: settings in one startup hook; create/update/resume, node, child and pod events → reconcile."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Awaitable, Callable

import kopf

from warmfleet.kube import KubeError
from warmfleet.operator.passes import adapters_pass, autoscale_pass
from warmfleet.operator.passes import model_config as mc
from warmfleet.operator.passes.operator_metrics import OperatorMetrics
from warmfleet.operator.passes.reconcile import OperatorState, fingerprint, plan_for, pod_digest, reconcile
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.admin_policy import policy_from_env
from warmfleet.operator.planning.diagnose import slim_pod
from warmfleet.operator.planning.nodes import NodeInfo, node_info
from warmfleet.operator.spec.constants import GROUP, MANAGED_BY, PLURAL, SERVICE_LABEL, VERSION
from warmfleet.operator.spec.schema import SpecError

FINALIZER = f"{GROUP}/finalizer"
PROGRESS_PREFIX = GROUP
WATCH_SERVER_TIMEOUT_S = 300  # the API server closes each watch after this, so a stalled watch recovers
WATCH_CLIENT_TIMEOUT_S = 330

LoginFn = Callable[..., Awaitable[Any] | Any]


def default_login(**kwargs: Any) -> Any:
    """In-cluster service account first, then kubeconfig."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def make_registry(*, default_image: str, router_image: str | None = None, engine_images: tuple[tuple[str, str], ...] = (),
                  login: LoginFn = default_login,
                  router_url_template: str | None = None,
                  autoscale_interval_s: float = autoscale_pass.DEFAULT_INTERVAL_S,
                  adapters_interval_s: float | None = None, server_url_template: str | None = None,
                  metrics: OperatorMetrics | None = None, leading: Callable[[], bool] | None = None) -> kopf.OperatorRegistry:
    """A registry holding every handler; `login` is replaceable so tests can point kopf at kmock.

    `default_image` runs `warmfleet` engine pods, `router_image` (default: the same) router pods and the
    fetch-model init step, for services whose spec names no image; `engine_images` ((kind, image)) replaces vLLM's and
    FastDeploy's pinned default images (--vllm-image, --fastdeploy-image).
    `router_url_template` overrides where the autoscaler finds a service's routers (autoscale_pass.router_urls),
    `server_url_template` where the adapter pass finds server pods ({ip}, {name}, {port}; adapters_pass.ready_server_urls).
    `metrics` counts every reconcile (passes/operator_metrics.py); `leading` (leader election, passes/leader_election.py)
    says whether this process still holds the Lease: a reconcile that finds it lapsed does nothing.
    The InferenceService's own handlers are defined here: their ids (qualified names) are kopf's progress keys.
    """
    registry = kopf.OperatorRegistry()
    isvc = (GROUP, VERSION, PLURAL)
    adapters_interval_s = adapters_interval_s or adapters_pass.interval_s()
    _add_lifecycle(registry, objects.Images(engine=default_image, router=router_image or default_image,
                                            engines=engine_images), login,
                   metrics or OperatorMetrics(), leading or (lambda: True))
    _add_indexes(registry)

    @kopf.on.resume(*isvc, registry=registry)
    @kopf.on.create(*isvc, registry=registry)
    @kopf.on.update(*isvc, registry=registry)
    async def reconcile_service(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, service_pods: kopf.Index,
                                logger: Any, retry: int = 0, **_: Any) -> None:
        outcome = await _run(body, memo, nodes, logger, service_pods=service_pods)
        if outcome is not None and outcome.missing:  # a CRD gateway mode needs: status says so; try again later
            raise kopf.TemporaryError(outcome.missing, delay=missing_crd_delay(retry))

    @kopf.timer(*isvc, interval=mc.RETRY_DELAY_S, initial_delay=mc.RETRY_DELAY_S, registry=registry,
                when=lambda status, **_: mc.unavailable(status))
    async def retry_model_config(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, services: kopf.Index,
                                 service_pods: kopf.Index, logger: Any, **_: Any) -> None:
        """While the model's config.json cannot be read (ModelConfigUnavailable), try again now and then."""
        await _run(body, memo, nodes, logger, services, service_pods)

    @kopf.timer(*isvc, id="autoscale", interval=autoscale_interval_s, initial_delay=autoscale_interval_s, registry=registry)
    async def autoscale(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, patch: kopf.Patch, **_: Any) -> None:
        """The routers' metrics → spec.replicas (spec.autoscaling with a target), status.warmup, pod-deletion costs."""
        await autoscale_pass.run_pass(memo.state, body, _node_list(nodes), patch, template=router_url_template)

    @kopf.timer(*isvc, id="adapters", interval=adapters_interval_s, initial_delay=adapters_interval_s, registry=registry,
                when=lambda spec, status, **_: bool((spec or {}).get("lora")) or bool((status or {}).get("adapters")))
    async def adapters(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, patch: kopf.Patch, **_: Any) -> None:
        """spec.adapters → every ready server pod (load/unload at run time), status.adapters."""
        await adapters_pass.run_pass(memo.state, body, _node_list(nodes), patch, template=server_url_template)

    @kopf.on.delete(*isvc, registry=registry, optional=True)
    def forget(uid: str, memo: kopf.Memo, namespace: str, name: str, **_: Any) -> None:
        memo.state.forget(uid)
        memo.metrics.forget(namespace, name)

    _add_watchers(registry)
    return registry


def _add_lifecycle(registry: kopf.OperatorRegistry, default_images: objects.Images, login: LoginFn,
                   metrics: OperatorMetrics, leading: Callable[[], bool]) -> None:
    """Startup (every operator-wide setting, the shared state), cleanup and login."""

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PROGRESS_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=PROGRESS_PREFIX, key="last-handled-configuration")
        settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
        settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
        settings.watching.connect_timeout = 30
        # Only the pods of our own Deployments, filtered by the API server (not every pod of the cluster).
        settings.watching.label_selectors["", "v1", "pods"] = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        settings.posting.level = logging.WARNING  # only warnings become Kubernetes Events
        settings.peering.standalone = True  # one active replica: the chart runs one pod with a Recreate strategy
        settings.execution.max_workers = 4
        memo.state = OperatorState(default_images=default_images, policy=policy_from_env(os.environ))
        memo.metrics, memo.leading = metrics, leading

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        if memo.state.kube is not None:
            await memo.state.kube.close()

    @kopf.on.login(registry=registry)
    async def authenticate(memo: kopf.Memo, **kwargs: Any) -> Any:
        """kopf logs in (at start, after its own 401s); the operator's client logs in again through `again`."""
        async def again() -> Any:  # a rotated token file, a renewed kubeconfig: read them anew
            info = login(memo=memo, **kwargs)
            return await info if hasattr(info, "__await__") else info

        state: OperatorState = memo.state
        info = await again()
        state.login = again
        if info is not None:
            state.connection = info
            if state.kube is not None:
                await state.kube.use(info)
        return info


def _add_indexes(registry: kopf.OperatorRegistry) -> None:
    """kopf's in-memory indexes the handlers read: nodes, InferenceServices, and our pods by service."""

    @kopf.index("", "v1", "nodes", id="nodes", registry=registry)
    def nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, NodeInfo]:
        return {name: node_info(body)}

    @kopf.index(GROUP, VERSION, PLURAL, id="services", registry=registry)
    def services(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, name): dict(body)}

    @kopf.index("", "v1", "pods", id="service_pods", labels=MANAGED_BY, registry=registry)
    def service_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        """(namespace, service label) → a slim copy of each of its pods (what diagnose reads)."""
        owner = labels.get(SERVICE_LABEL)
        return {(namespace, owner): slim_pod(body)} if owner else {}


MISSING_CRD_DELAYS_S = (10, 20, 40, 80, 160, 300)  # retries of a service whose CRD (gateway mode) is not served


def missing_crd_delay(retry: int) -> int:
    """Seconds before retry number `retry` (0: the first) of a reconcile that found a needed CRD missing: doubling, capped."""
    return MISSING_CRD_DELAYS_S[min(max(retry, 0), len(MISSING_CRD_DELAYS_S) - 1)]


async def _run(body: Any, memo: kopf.Memo, nodes: kopf.Index, logger: Any, services: kopf.Index | None = None,
               service_pods: kopf.Index | None = None) -> Any:
    """Reconcile one service; API errors become kopf retries (a slow one, with a warning Event, when permanent)."""
    key = (body["metadata"].get("namespace"), body["metadata"]["name"])
    alive = (lambda: key in services) if services is not None else (lambda: True)
    pods = (lambda: _pods_of(service_pods, key)) if service_pods is not None else None
    if not memo.leading():  # the Lease lapsed: this process stops any moment now, a standby takes over
        logger.warning("not reconciling: this operator no longer holds the leader Lease")
        return None
    started = time.monotonic()
    try:
        outcome = await reconcile(memo.state, body, _node_list(nodes), alive=alive, pods=pods)
    except KubeError as exc:
        memo.metrics.observe(key[0], key[1], None, time.monotonic() - started, exc)
        if exc.status in (400, 403, 422):  # permanent for this spec: say so, do not retry hot
            kopf.warn(dict(body), reason="ApplyFailed", message=str(exc))
            raise kopf.TemporaryError(str(exc), delay=60) from exc
        raise kopf.TemporaryError(str(exc), delay=5) from exc
    memo.metrics.observe(key[0], key[1], outcome, time.monotonic() - started)
    changed = {k: v for k, v in outcome.actions.items() if v != "unchanged"}
    if changed or outcome.status_written:
        logger.info(f"reconciled: {changed or 'no child changed'}; status {'written' if outcome.status_written else 'unchanged'}"
                    + (f"; Ready reason {outcome.reason}" if outcome.reason else ""))
    return outcome


def _add_watchers(registry: kopf.OperatorRegistry) -> None:
    """Events that lead back to a service's reconcile: a node, one of our Deployments or DaemonSets, one of our pods."""

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_changed(memo: kopf.Memo, nodes: kopf.Index, services: kopf.Index, service_pods: kopf.Index,
                           logger: Any, **_: Any) -> None:
        state: OperatorState = memo.state
        node_list = _node_list(nodes)
        for key in list(services):
            for body in services.get(key, []):
                uid = body["metadata"].get("uid")
                if not _plan_changed(state, body, node_list, uid):
                    continue
                await _run(body, memo, nodes, logger, services, service_pods)

    @kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY, registry=registry)
    async def child_changed(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, services: kopf.Index,
                            service_pods: kopf.Index, logger: Any, **_: Any) -> None:
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(SERVICE_LABEL)
        for parent in services.get((meta.get("namespace"), owner), []):
            await _run(parent, memo, nodes, logger, services, service_pods)

    @kopf.on.event("apps", "v1", "daemonsets", labels=MANAGED_BY, registry=registry)
    async def node_tier_changed(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, services: kopf.Index,
                                service_pods: kopf.Index, logger: Any, **_: Any) -> None:
        """A node tier's DaemonSet changed (its ready pods: status.pools[].nodeTier, NodeTierReady)."""
        await child_changed(body=body, memo=memo, nodes=nodes, services=services, service_pods=service_pods,
                            logger=logger)

    @kopf.on.event("", "v1", "pods", labels=MANAGED_BY, registry=registry)
    async def pod_changed(body: kopf.Body, memo: kopf.Memo, nodes: kopf.Index, services: kopf.Index,
                          service_pods: kopf.Index, logger: Any, **_: Any) -> None:
        """A pod of ours changed: back to its service by label; reconcile only if what its pods say changed."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace"), (meta.get("labels") or {}).get(SERVICE_LABEL))
        state: OperatorState = memo.state
        for parent in services.get(key, []):
            uid = parent["metadata"].get("uid") or f"{key[0]}/{key[1]}"
            digest = pod_digest(_pods_of(service_pods, key))
            if state.pod_digests.get(uid) == digest:
                continue  # a pod event that says nothing new (same reasons, same counts)
            state.pod_digests[uid] = digest  # claimed now, so the pod events of one burst reconcile once
            try:
                await _run(parent, memo, nodes, logger, services, service_pods)
            except BaseException:
                state.pod_digests.pop(uid, None)  # the next pod or Deployment event tries again
                raise


def _pods_of(index: kopf.Index, key: tuple[Any, Any]) -> list[dict[str, Any]]:
    """The slim pods of one service: the index is keyed by the pods' service label (a name cut to 63 characters)."""
    ns, name = key
    return list(index.get((ns, str(name)[:63]), []))


def _node_list(index: kopf.Index) -> list[NodeInfo]:
    return [info for key in index for info in index.get(key, [])]


def _plan_changed(state: OperatorState, body: Any, nodes: list[NodeInfo], uid: str | None) -> bool:
    """Whether a node event changes what this service should look like (cheap, pure)."""
    try:
        _, _, plan = plan_for(body, nodes, state.default_images, policy=state.policy)
    except SpecError:
        return False  # an invalid spec waits for a spec change, not a node change
    return state.fingerprints.get(uid or "") != fingerprint(plan)
