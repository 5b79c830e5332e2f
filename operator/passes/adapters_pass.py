"""One pass of LoRA adapter placement for one InferenceService (a kopf timer in handlers.py runs it): every ready
server pod gets spec.adapters loaded and nothing else, through its /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's routes, which warmfleet's engine serves too); status.adapters says on how many replicas each one is loaded.

Adapters never enter the pod template (lora_plan.py), so adding or removing one restarts nothing; a replica started later
is brought in line by the next pass. The admin key (warmfleet) is spec.lora.adminKeySecret, else the Secret the
operator generated for the service (admin_secret.py), never the client API key; vLLM's LoRA routes take its API key.
Reads are bounded and follow no redirect (bounded_http.py); status.adapters names HTTP statuses, never a body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, MutableMapping

import httpx

from warmfleet.kube import KubeError
from warmfleet.operator.passes import bounded_http
from warmfleet.operator.passes.admin_secret import secret_value
from warmfleet.operator.passes.reconcile import OperatorState, plan_for
from warmfleet.operator.planning import client_keys, engine_descriptions, lora_plan, objects
from warmfleet.operator.planning.nodes import NodeInfo
from warmfleet.operator.spec.inference_service import SecretKeyRef
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
        r = await bounded_http.request(http, "GET", url + "/v1/models", headers=headers, timeout_s=TIMEOUT_S,
                                       limit=bounded_http.JSON_MAX_BYTES)
        r.raise_for_status(url + "/v1/models")
        have = {c["id"]: c.get("root") for c in json.loads(r.content).get("data", []) if c.get("parent")}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
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
    """'' on success, else why: the HTTP status and the error's code where it is a plain identifier. Never the body's
    text: it becomes status, which tenants read, and a replica (or whatever answers at its address) chose it."""
    try:
        r = await bounded_http.request(http, "POST", url + path, json=body, headers=headers, timeout_s=TIMEOUT_S,
                                       limit=bounded_http.JSON_MAX_BYTES)
    except httpx.HTTPError as exc:
        return f"POST {path}: {_why(exc)}"
    if r.status_code < 300:
        return ""
    return f"POST {path}: HTTP {r.status_code}{_error_code(r.content)} (the replica's log says why)"


ERROR_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


def _error_code(content: bytes) -> str:
    """' (CODE)' for an OpenAI-shaped error's code or type when it is a plain identifier, else ''."""
    try:
        err = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return ""
    code = next((c for c in (err.get("code"), err.get("type")) if isinstance(c, str)), None) if isinstance(err, dict) else None
    return f" ({code})" if code and ERROR_CODE.fullmatch(code) else ""


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"  # the client's words (status, timeout, cap), not the peer's


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
    value = secret_value(secret, ref.key)
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
        owner, spec, _ = plan_for(body, nodes, state.default_images, policy=state.policy)
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
    fleet = client_keys.fleet_key_ref(owner, spec)  # apiKeySecret, or the admin key when replicas check client keys
    headers, problem = await _auth_headers(kube, fleet and SecretKeyRef(name=fleet[0], key=fleet[1]), owner.namespace)
    admin_headers = headers  # vLLM: its LoRA routes take the API key
    if not problem and engine_descriptions.engine_of(spec).kind == "warmfleet":
        name, key = objects.admin_key_ref(owner, spec)
        admin_headers, problem = await _auth_headers(kube, SecretKeyRef(name=name, key=key), owner.namespace)
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
