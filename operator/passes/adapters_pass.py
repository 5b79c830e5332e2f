"""One pass of LoRA adapter placement for one InferenceService (a kopf timer in handlers.py runs it): every ready
server pod gets spec.adapters loaded and nothing else, through its /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's routes, which warmfleet's engine serves too); status.adapters says on how many replicas each one is loaded.

Adapters never enter the pod template (lora_plan.py), so adding or removing one restarts nothing; a replica started later
is brought in line by the next pass. The admin key is spec.lora.adminKeySecret (warmfleet only), else the service's
API key (spec.router.apiKeySecret), which the server pods also read as their admin key (warmfleet) or API key (vLLM);
without either the routes are open, as every route of those pods is.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, MutableMapping

import httpx

from warmfleet.kube import KubeError
from warmfleet.operator.passes.reconcile import OperatorState, plan_for
from warmfleet.operator.planning import engine_descriptions, lora_plan, objects
from warmfleet.operator.planning.nodes import NodeInfo
from warmfleet.operator.spec.schema import SpecError

INTERVAL_ENV = "WARMFLEET_ADAPTERS_INTERVAL_S"
DEFAULT_INTERVAL_S = 15.0
TIMEOUT_S = 30.0  # one load reads and checks an adapter's files: allow more than a health probe
URL_TEMPLATE_ENV = "WARMFLEET_SERVER_URL_TEMPLATE"  # tests, or an operator outside the cluster: {ip}, {name}, {port}

log = logging.getLogger(__name__)


def interval_s() -> float:
    """Seconds between passes (env WARMFLEET_ADAPTERS_INTERVAL_S)."""
    try:
        return max(1.0, float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


@dataclass
class PodResult:
    """What one pass did on one pod."""

    loaded: set[str] = field(default_factory=set)  # adapters loaded at the wanted path after the pass
    errors: dict[str, str] = field(default_factory=dict)  # adapter → why it is not loaded
    actions: list[str] = field(default_factory=list)  # "load NAME", "unload NAME"


def ready_server_urls(pods: list[Mapping[str, Any]], template: str | None = None) -> dict[str, str]:
    """pod name → base URL of every Ready, not terminating server pod with an IP."""
    out = {}
    for pod in pods:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if not (ready and st.get("podIP")) or meta.get("deletionTimestamp"):
            continue
        ip = st["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        out[meta["name"]] = (template.format(ip=ip, name=meta["name"], port=engine_descriptions.HTTP_PORT) if template
                             else f"http://{host}:{engine_descriptions.HTTP_PORT}")
    return out


async def sync_pod(http: httpx.AsyncClient, url: str, wanted: Mapping[str, str], headers: Mapping[str, str],
                   admin_headers: Mapping[str, str] | None = None) -> PodResult:
    """Load `wanted` (name → path) on one server, unload the adapters it has that are not wanted; a loaded adapter at
    another path (its source changed) is unloaded and loaded again. `headers` for /v1/models (the API key),
    `admin_headers` for load and unload (default: the same)."""
    res = PodResult()
    admin = headers if admin_headers is None else admin_headers
    try:
        r = await http.get(url + "/v1/models", headers=headers, timeout=TIMEOUT_S)
        r.raise_for_status()
        have = {c["id"]: c.get("root") for c in r.json().get("data", []) if c.get("parent")}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        res.errors = {name: f"GET /v1/models: {_why(exc)}" for name in wanted}
        return res
    for name, root in sorted(have.items()):
        if name in wanted and (root is None or root == wanted[name]):
            res.loaded.add(name)
            continue
        err = await _post(http, url, "/v1/unload_lora_adapter", {"lora_name": name}, admin)
        res.actions.append(f"unload {name}")
        if err and name in wanted:
            res.errors[name] = f"unload (path changed): {err}"
    for name, path in sorted(wanted.items()):
        if name in res.loaded or name in res.errors:
            continue
        err = await _post(http, url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, admin)
        res.actions.append(f"load {name}")
        if err:
            res.errors[name] = err
        else:
            res.loaded.add(name)
    return res


async def _post(http: httpx.AsyncClient, url: str, path: str, body: dict[str, str], headers: Mapping[str, str]) -> str:
    """'' on success, else why (the server's error message where it gives one)."""
    try:
        r = await http.post(url + path, json=body, headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"POST {path}: {_why(exc)}"
    if r.status_code < 300:
        return ""
    try:
        detail = r.json()
        msg = (detail.get("error") or {}).get("message") if isinstance(detail.get("error"), dict) else detail.get("message")
    except ValueError:
        msg = None
    return f"POST {path}: HTTP {r.status_code}: {msg or r.text[:300]}"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def _auth_headers(kube: Any, ref: Any, ns: str) -> tuple[dict[str, str], str]:
    """Bearer header from a SecretKeyRef (the pods' API or admin key), and a problem reading it ('' if none)."""
    if ref is None:
        return {}, ""
    try:
        secret = await kube.get("Secret", ns, ref.name)
    except KubeError as exc:
        if exc.status == 403:
            return {}, (f"the operator may not read Secret {ref.name} (a key of the servers): grant it `get` on "
                        "secrets (chart value operator.readModelCredentials)")
        raise
    if secret is None:
        return {}, f"Secret {ns}/{ref.name} not found"
    raw = (secret.get("data") or {}).get(ref.key)
    value = base64.b64decode(raw).decode(errors="replace").strip() if raw else (secret.get("stringData") or {}).get(ref.key)
    if not value:
        return {}, f"Secret {ns}/{ref.name} has no key {ref.key}"
    return {"Authorization": f"Bearer {value}"}, ""


def adapters_status(spec: Any, wanted: Mapping[str, str], results: Mapping[str, PodResult], problem: str) -> list[dict[str, Any]]:
    """status.adapters: one entry per spec.adapters item: loaded on N of M ready replicas, and why not on the rest."""
    out = []
    for a in spec.adapters:
        loaded = sorted(p for p, r in results.items() if a.name in r.loaded)
        errors = sorted({r.errors[a.name] for r in results.values() if a.name in r.errors})
        message = problem or "; ".join(errors)[:1000]
        out.append({"name": a.name, "source": a.source, "path": wanted[a.name], "loadedReplicas": len(loaded),
                    "readyReplicas": len(results), **({"message": message} if message else {})})
    return out


async def run_pass(state: OperatorState, body: Mapping[str, Any], nodes: list[NodeInfo], patch: MutableMapping[str, Any],
                   *, http: httpx.AsyncClient | None = None, template: str | None = None) -> dict[str, PodResult] | None:
    """Bring every ready server pod's adapters in line with spec.adapters; status.adapters through `patch` (only when
    it changed). None when the spec is invalid (the reconcile reports it) or has no spec.lora."""
    meta = body.get("metadata") or {}
    try:
        owner, spec, _ = plan_for(body, nodes, state.default_images)
    except SpecError:
        return None
    previous = (body.get("status") or {}).get("adapters")
    if spec.lora is None:
        if previous:
            patch.setdefault("status", {})["adapters"] = None
        return None
    kube = state.client()
    wanted = {a.name: lora_plan.adapter_path(spec, a) for a in spec.adapters}
    pods = await kube.list("Pod", owner.namespace, objects.server_selector(owner))
    urls = ready_server_urls(pods, template or os.environ.get(URL_TEMPLATE_ENV))
    headers, problem = await _auth_headers(kube, spec.router.api_key_secret, owner.namespace)
    admin_headers = headers
    if not problem and spec.lora.admin_key_secret is not None:
        admin_headers, problem = await _auth_headers(kube, spec.lora.admin_key_secret, owner.namespace)
    results: dict[str, PodResult] = {}
    if not problem:
        async def one(client: httpx.AsyncClient, name: str, url: str) -> tuple[str, PodResult]:
            return name, await sync_pod(client, url, wanted, headers, admin_headers)

        if http is None:
            async with httpx.AsyncClient() as client:
                results = dict(await asyncio.gather(*(one(client, n, u) for n, u in sorted(urls.items()))))
        else:
            results = dict(await asyncio.gather(*(one(http, n, u) for n, u in sorted(urls.items()))))
    for name, r in sorted(results.items()):
        if r.actions:
            log.info("%s/%s pod %s: %s", owner.namespace, meta.get("name"), name, ", ".join(r.actions))
    status = adapters_status(spec, wanted, {n: PodResult() for n in urls} if problem else results, problem)
    if status != previous:
        patch.setdefault("status", {})["adapters"] = status
    return results
