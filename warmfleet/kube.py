"""The Kubernetes client of the operator and the router: server-side apply, refreshed credentials; no kopf import.

The official `kubernetes` package's asyncio API (`kubernetes.aio`): its ApiClient does transport, TLS,
auth and errors, its DynamicClient the verbs; it runs on kopf's and the router's loop, no threads. Kinds
come from a static table, not API discovery. Writes are server-side apply under one field manager, so a
field we stop setting is removed; an object carrying the digest of the same intent and still holding
every field of it is not written. `login` is asked again every REFRESH_S, before expiry and after a 401.
Why this client and not another: docs/kubernetes-client.md.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from kubernetes.aio.client import ApiClient, Configuration
from kubernetes.aio.dynamic import DynamicClient
from kubernetes.aio.dynamic.exceptions import DynamicApiError
from kubernetes.aio.dynamic.resource import Resource

log = logging.getLogger(__name__)

APPLIED_DIGEST_ANNOTATION = "serving.warmfleet.io/applied-digest"  # sha256 of the last applied intent
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON
MERGE_PATCH = "application/merge-patch+json"
REFRESH_S = 60.0  # ask `login` again this often (a rotated service-account token file is re-read)
EXPIRY_MARGIN_S = 30.0  # ... and this long before the credentials say they expire
REQUEST_TIMEOUT_S = 30.0

Resources = Mapping[str, tuple[str, str]]  # kind → (apiVersion, plural); namespaced kinds only
Login = Callable[[], Awaitable[Any]]  # → a kopf-style ConnectionInfo (duck-typed), or None
Request = Callable[[DynamicClient], Awaitable[Any]]  # one API call, made on the current connection


class KubeError(Exception):
    """An API error: HTTP status and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def is_subset(want: Any, have: Any) -> bool:
    """True if every field of `want` equals the one in `have` (server defaults in `have` are ignored)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(is_subset(w, h) for w, h in zip(want, have))
    return want == have


def with_digest(obj: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """`obj` with APPLIED_DIGEST_ANNOTATION set to the digest of everything else in it, and that digest."""
    meta = dict(obj.get("metadata") or {})
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != APPLIED_DIGEST_ANNOTATION}
    bare = {**obj, "metadata": {**meta, "annotations": annotations} if annotations else
            {k: v for k, v in meta.items() if k != "annotations"}}
    digest = hashlib.sha256(json.dumps(bare, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {**bare, "metadata": {**meta, "annotations": {**annotations, APPLIED_DIGEST_ANNOTATION: digest}}}, digest


def _configuration(info: Any) -> Configuration:
    """A client Configuration from a kopf ConnectionInfo: server, Authorization header, proxy (TLS: _ssl_context)."""
    cfg = Configuration(host=info.server)
    auth = info.as_http_headers().get("Authorization")  # "Bearer <token>" or "Basic ..." (kopf builds it)
    if auth:
        cfg.api_key = {"BearerToken": auth}  # the whole header value, no prefix
    cfg.proxy = getattr(info, "proxy_url", None)
    return cfg


def _tls_identity(info: Any) -> tuple[Any, ...]:
    """What the connection pool depends on: a change here needs a new pool, a token change does not."""
    return tuple(getattr(info, a, None) for a in ("server", "ca_path", "ca_data", "insecure", "certificate_path",
                                                  "certificate_data", "private_key_path", "private_key_data", "proxy_url"))


def _message(exc: DynamicApiError) -> str:
    body = exc.body.decode() if isinstance(exc.body, bytes) else exc.body
    try:
        return json.loads(body).get("message") or body
    except (TypeError, ValueError, AttributeError):
        return str(body or exc.reason)


def _raw(_client: Any, data: Any) -> Any:
    return data  # DynamicClient serializer: keep the JSON as plain dicts


class Kube:
    """One API server, the kinds of `resources`, writes under `field_manager`; created on the event loop."""

    def __init__(self, configuration: Configuration, resources: Resources, *, field_manager: str,
                 ssl_context: Any = None, login: Login | None = None, info: Any = None) -> None:
        self.resources, self.field_manager = dict(resources), field_manager
        self._login, self._info = login, info
        self._relogin_lock = asyncio.Lock()
        self._logins = 0  # credentials switched so far: a 401 on older ones needs no new login
        self._refresh_at = self._next_refresh(info)
        self._connect(configuration, ssl_context)

    @classmethod
    def from_connection(cls, info: Any, resources: Resources, *, field_manager: str,
                        login: Login | None = None) -> "Kube":
        """From a kopf ConnectionInfo; `login` returns a fresh one (kopf's login handler, called again)."""
        return cls(_configuration(info), resources, field_manager=field_manager, ssl_context=info.as_ssl_context(),
                   login=login, info=info)

    @classmethod
    async def from_environment(cls, resources: Resources, *, field_manager: str) -> "Kube":
        """In-cluster service account, else kubeconfig (the client library's loaders refresh the token themselves)."""
        from kubernetes.aio import config

        cfg = Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            await config.load_kube_config(client_configuration=cfg)
        return cls(cfg, resources, field_manager=field_manager)

    def _connect(self, configuration: Configuration, ssl_context: Any) -> None:
        self._api = ApiClient(configuration)
        if ssl_context is not None:  # kopf's context: CA path or data, client certificate, insecure
            self._api.rest_client.ssl_context = ssl_context
        self._dyn = DynamicClient(self._api)  # not awaited: no discovery, kinds come from `resources`
        self._kinds: dict[str, Resource] = {}

    async def close(self) -> None:
        """Close the connection pool."""
        await self._api.close()

    # -- credentials -------------------------------------------------------------------------

    @staticmethod
    def _next_refresh(info: Any) -> float:
        at = time.monotonic() + REFRESH_S
        expiration = getattr(info, "expiration", None)
        if expiration is not None:
            exp = expiration if expiration.tzinfo else expiration.replace(tzinfo=datetime.timezone.utc)
            left = (exp - datetime.datetime.now(datetime.timezone.utc)).total_seconds() - EXPIRY_MARGIN_S
            at = min(at, time.monotonic() + max(left, 0.0))
        return at

    async def use(self, info: Any) -> None:
        """Switch to the credentials of `info`: a new token in place; a new pool if server or TLS changed."""
        if self._info is not None and _tls_identity(info) == _tls_identity(self._info):
            self._api.configuration.api_key = _configuration(info).api_key
        else:
            old = self._api
            self._connect(_configuration(info), info.as_ssl_context())
            await old.close()
        self._info, self._refresh_at = info, self._next_refresh(info)
        self._logins += 1

    async def relogin(self, *, unless_since: int | None = None) -> None:
        """Ask `login` for credentials again and use them; keep the current ones if it has none.

        `unless_since`: skip if the credentials changed since that many logins (another request did it).
        Without it, skip unless a refresh is due.
        """
        if self._login is None:
            return
        async with self._relogin_lock:
            due = self._logins == unless_since if unless_since is not None else time.monotonic() >= self._refresh_at
            if not due:
                return
            info = await self._login()
            if info is None:
                log.warning("Kubernetes login returned no credentials; keeping the current ones. "
                            "Check the service account token or kubeconfig.")
                self._refresh_at = time.monotonic() + REFRESH_S
                return
            await self.use(info)

    # -- transport ---------------------------------------------------------------------------

    def _resource(self, kind: str) -> Resource:
        if kind not in self._kinds:
            api_version, plural = self.resources[kind]
            group, _, version = api_version.rpartition("/")
            self._kinds[kind] = Resource(prefix="apis" if group else "api", group=group or None, api_version=version,
                                         kind=kind, namespaced=True, name=plural, client=self._dyn)
        return self._kinds[kind]

    def _verb(self, verb: str, kind: str, **kw: Any) -> Request:
        kw.setdefault("_request_timeout", REQUEST_TIMEOUT_S)
        return lambda dyn: getattr(dyn, verb)(self._resource(kind), serializer=_raw, **kw)

    async def _send(self, request: Request) -> Any:
        try:
            return await request(self._dyn)
        except DynamicApiError as exc:
            raise KubeError(exc.status, _message(exc)) from None

    async def _call(self, request: Request) -> Any:
        """One request, logged in again first when due, and once more after a 401 (on the new connection)."""
        if self._login is not None and time.monotonic() >= self._refresh_at:
            await self.relogin()
        logins = self._logins
        try:
            return await self._send(request)
        except KubeError as exc:
            if exc.status != 401 or self._login is None:
                raise
            log.info("the API server answered 401 Unauthorized; logging in again")
            await self.relogin(unless_since=logins)
            return await self._send(request)

    # -- verbs -------------------------------------------------------------------------------

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return await self._call(self._verb("get", kind, name=name, namespace=namespace))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def serves(self, kind: str) -> bool:
        """Whether the API server serves `kind` (its group/version's discovery document lists the plural): a CRD that
        is not installed is a 404 there, not an error."""
        api_version, plural = self.resources[kind]
        path = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        try:
            doc = await self._call(lambda dyn: dyn.request("get", path, serializer=_raw, _request_timeout=REQUEST_TIMEOUT_S))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        if not isinstance(doc, Mapping):  # some client versions hand back the raw body
            doc = json.loads(doc)
        return any(r.get("name") == plural for r in doc.get("resources") or [])

    async def list_object(self, kind: str, namespace: str, selector: Mapping[str, str]) -> dict[str, Any]:
        """The List as the server sends it (`items`, `metadata.resourceVersion` to start a watch at)."""
        sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return await self._call(self._verb("get", kind, namespace=namespace, label_selector=sel))

    async def list(self, kind: str, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects matching the label selector (filtered again client-side: some servers ignore it)."""
        items = (await self.list_object(kind, namespace, selector)).get("items") or []
        return [o for o in items if is_subset(dict(selector), (o.get("metadata") or {}).get("labels") or {})]

    async def apply(self, obj: Mapping[str, Any], *, field_manager: str | None = None) -> tuple[dict[str, Any], str]:
        """Server-side apply `obj` (its apiVersion, kind, namespace, name and the fields we own); → (live, action).

        action is "created", "patched" or "unchanged". Unchanged means: the live object carries the
        digest of this very intent and still holds each of its fields, so it is not written. A
        conflict with another manager is logged, then the fields are taken over (force).
        """
        intent, digest = with_digest(obj)
        kind, meta = intent["kind"], intent["metadata"]
        ns, name = meta["namespace"], meta["name"]
        live = await self.get(kind, ns, name)
        if live is not None and ((live.get("metadata") or {}).get("annotations") or {}).get(
                APPLIED_DIGEST_ANNOTATION) == digest and is_subset(intent, live):
            return live, "unchanged"
        manager = field_manager or self.field_manager
        try:
            applied = await self._call(self._verb("server_side_apply", kind, body=intent, namespace=ns,
                                                  field_manager=manager, force_conflicts=False))
        except KubeError as exc:
            if exc.status != 409:
                raise
            log.warning("%s %s/%s: %s; taking these fields over as %s (they are ours to set)",
                        kind, ns, name, exc, manager)
            applied = await self._call(self._verb("server_side_apply", kind, body=intent, namespace=ns,
                                                  field_manager=manager, force_conflicts=True))
        return applied, "created" if live is None else "patched"

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create `obj` (POST); an existing one is a KubeError 409."""
        meta = obj["metadata"]
        return await self._call(self._verb("create", obj["kind"], body=dict(obj), namespace=meta["namespace"]))

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Replace `obj` (PUT) as of its metadata.resourceVersion: a newer write in between is a KubeError 409."""
        meta = obj["metadata"]
        return await self._call(self._verb("replace", obj["kind"], body=dict(obj), name=meta["name"],
                                           namespace=meta["namespace"]))

    async def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *,
                    content_type: str = MERGE_PATCH, subresource: str | None = None) -> dict[str, Any]:
        """Patch one object (merge patch by default), or its `subresource` ("status", "scale")."""
        suffix = f"/{subresource}" if subresource else ""
        return await self._call(lambda dyn: dyn.request(
            "patch", self._resource(kind).path(name=name, namespace=namespace) + suffix, body=dict(patch),
            content_type=content_type, serializer=_raw, _request_timeout=REQUEST_TIMEOUT_S))

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch the status subresource with `status` (a key set to None is removed)."""
        return await self.patch(kind, namespace, name, {"status": dict(status)}, subresource="status")

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object, its dependents in the background; absent is fine."""
        try:
            await self._call(self._verb("delete", kind, name=name, namespace=namespace, propagation_policy="Background"))
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def watch(self, kind: str, namespace: str, selector: Mapping[str, str], resource_version: str | None,
                    timeout_s: int) -> AsyncIterator[tuple[str, Any]]:
        """(type, object) events from `resource_version` on, until the server ends the watch after `timeout_s`.

        An ERROR event (e.g. 410 Gone: the version is too old) is yielded like any other; the
        caller re-lists. Objects are plain dicts.
        """
        sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        resp = await self._call(self._verb("get", kind, namespace=namespace, label_selector=sel, watch=True,
                                           resource_version=resource_version, timeout_seconds=timeout_s,
                                           serialize=False, _request_timeout=timeout_s + REQUEST_TIMEOUT_S))
        try:
            async for line in resp.content:  # one JSON event per line
                if line.strip():
                    event = json.loads(line)
                    yield event.get("type"), event.get("object")
        finally:
            resp.release()
