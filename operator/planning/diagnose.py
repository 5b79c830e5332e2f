"""Why an InferenceService is not Ready, from its pods: pure, no kopf, no I/O.

The operator watches the pods of its Deployments (kopf index `service_pods`, one slim copy
per pod, see `slim_pod`) and derives one reason per pod that is not Ready, from what the
scheduler and the kubelet wrote into the pod's status:

- scheduler: PodScheduled=False, reason Unschedulable, with its message
  (`0/4 nodes are available: persistentvolumeclaim "model-store" not found. ...` when the
  claim does not exist; that one becomes MissingPVC);
- kubelet: a container waiting with CreateContainerConfigError (`secret "x" not found`,
  `couldn't find key k in Secret ns/x` → MissingSecret), ErrImagePull / ImagePullBackOff /
  InvalidImageName (→ ImagePullBackOff), CrashLoopBackOff (with the last termination's reason
  and exit code), any other waiting reason verbatim (CreateContainerError, ...);
- a pod bound to a node whose claim is gone waits in ContainerCreating: the kubelet reports
  `FailedMount` only as an Event on the pod, never in its status, so the operator checks the
  claims of not-ready pods directly (`missing_claims`, a GET per claim) and calls it MissingPVC;
- anything else not yet Ready is Starting.

Pods with the same reason are counted per component, most severe reason first (components
whose pods say the same share one detail):
`12/12 server pods, 2/2 router pods MissingPVC: 0/4 nodes are available: ...`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from warmfleet.operator.spec.constants import COMPONENT_LABEL

MISSING_PVC = "MissingPVC"
MISSING_SECRET = "MissingSecret"
IMAGE_PULL = "ImagePullBackOff"
CRASH_LOOP = "CrashLoopBackOff"
UNSCHEDULABLE = "Unschedulable"
STARTING = "Starting"

# Lower is more severe. Reasons a user must act on come first; Starting is progress, not a problem.
_RANK = {MISSING_PVC: 0, MISSING_SECRET: 1, IMAGE_PULL: 2, CRASH_LOOP: 3, UNSCHEDULABLE: 5, STARTING: 7}
_OTHER_KUBELET_RANK = 4  # CreateContainerConfigError, CreateContainerError, RunContainerError, ...
_OTHER_SCHEDULER_RANK = 6  # SchedulingGated, ...

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                                "ErrImageInspect", "RegistryUnavailable", "SignatureValidationFailed"})
PROGRESS_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
COMPONENT_ORDER = ("server", "router", "epp")

_PVC_NOT_FOUND = re.compile(r'persistentvolumeclaims? "([^"]+)" not found')
_SECRET_NOT_FOUND = re.compile(r'secrets? "([^"]+)" not found|couldn\'t find key \S+ in Secret \S+')
DETAIL_LIMIT = 400
MESSAGE_LIMIT = 1000


@dataclass(frozen=True)
class Finding:
    """Why one pod is not Ready."""

    reason: str
    detail: str
    rank: int


@dataclass(frozen=True)
class Diagnosis:
    """The pods' most severe reason and a counted summary of every reason (most severe first)."""

    reason: str | None = None  # None: every pod is Ready (or there are none)
    message: str = ""

    @property
    def problem(self) -> bool:
        """A reason someone must act on (not mere progress)."""
        return self.reason is not None and self.reason != STARTING


def _clip(text: str, limit: int = DETAIL_LIMIT) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def claims_of(pod: Mapping[str, Any]) -> list[str]:
    """PersistentVolumeClaims the pod mounts."""
    vols = (pod.get("spec") or {}).get("volumes") or []
    return [v["persistentVolumeClaim"]["claimName"] for v in vols if (v.get("persistentVolumeClaim") or {}).get("claimName")]


def component_of(pod: Mapping[str, Any]) -> str:
    """server | router | epp (from the pod's labels)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL) or "other"


def counts(pod: Mapping[str, Any]) -> bool:
    """Whether the pod takes part: not being deleted, not finished (a Failed pod is replaced by its ReplicaSet)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def is_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def claims_to_check(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """Claims of pods that take part and are not Ready: the only ones worth a direct existence check."""
    return {c for p in pods if counts(p) and not is_ready(p) for c in claims_of(p)}


def _container_finding(cs: Mapping[str, Any], init: bool) -> Finding | None:
    waiting = (cs.get("state") or {}).get("waiting")
    if not waiting:
        return None
    reason, message = waiting.get("reason") or "", waiting.get("message") or ""
    who = f"{'init container' if init else 'container'} {cs.get('name')}"
    if reason in IMAGE_PULL_REASONS:
        return Finding(IMAGE_PULL, _clip(f"{who}: {reason}: {message}" if message else f"{who}: {reason}"), _RANK[IMAGE_PULL])
    if reason == "CrashLoopBackOff":
        last = (cs.get("lastState") or {}).get("terminated") or {}
        detail = f"{who} restarted {cs.get('restartCount', 0)} times"
        if last:
            detail += f", last exit code {last.get('exitCode')} ({last.get('reason') or 'Error'})"
            if last.get("message"):
                detail += f": {last['message']}"
        return Finding(CRASH_LOOP, _clip(detail), _RANK[CRASH_LOOP])
    if reason == "CreateContainerConfigError" and _SECRET_NOT_FOUND.search(message):
        return Finding(MISSING_SECRET, _clip(message), _RANK[MISSING_SECRET])
    if reason in PROGRESS_REASONS or not reason:
        return None
    return Finding(reason, _clip(f"{who}: {message}" if message else who), _OTHER_KUBELET_RANK)


def pod_finding(pod: Mapping[str, Any], missing_claims: frozenset[str] | set[str] = frozenset()) -> Finding | None:
    """Why this pod is not Ready (its most severe reason), or None when it is Ready."""
    if is_ready(pod):
        return None
    st = pod.get("status") or {}
    found: list[Finding] = []
    missing = [c for c in claims_of(pod) if c in missing_claims]
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    sched = conds.get("PodScheduled") or {}
    if sched.get("status") == "False":
        msg = sched.get("message") or sched.get("reason") or "not scheduled"
        if _PVC_NOT_FOUND.search(msg):
            found.append(Finding(MISSING_PVC, _clip(msg), _RANK[MISSING_PVC]))
        elif sched.get("reason") == UNSCHEDULABLE:
            found.append(Finding(UNSCHEDULABLE, _clip(msg), _RANK[UNSCHEDULABLE]))
        else:
            found.append(Finding(sched.get("reason") or "Pending", _clip(msg), _OTHER_SCHEDULER_RANK))
    if missing:  # checked directly: the scheduler may not have said so, the kubelet says it only in Events
        found.append(Finding(MISSING_PVC, f'persistentvolumeclaim "{missing[0]}" not found', _RANK[MISSING_PVC]))
    statuses = [(cs, True) for cs in st.get("initContainerStatuses") or []] + [(cs, False) for cs in st.get("containerStatuses") or []]
    for cs, init in statuses:
        f = _container_finding(cs, init)
        if f is not None:
            found.append(f)
    if found:
        return min(found, key=lambda f: f.rank)
    return Finding(STARTING, _starting_detail(pod), _RANK[STARTING])


def _starting_detail(pod: Mapping[str, Any]) -> str:
    st = pod.get("status") or {}
    if not (pod.get("spec") or {}).get("nodeName") and not any(
            c.get("type") == "PodScheduled" and c.get("status") == "True" for c in st.get("conditions") or []):
        return "waiting to be scheduled"
    states = []
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        if cs.get("ready"):
            continue
        state = cs.get("state") or {}
        waiting = (state.get("waiting") or {}).get("reason")
        states.append(f"{cs.get('name')} " + (waiting or ("running, not ready" if "running" in state
                                                          else "terminated" if "terminated" in state else "waiting")))
    return "containers not ready: " + ", ".join(states) if states else "containers not ready"


def diagnose(pods: Iterable[Mapping[str, Any]], missing_claims: frozenset[str] | set[str] = frozenset()) -> Diagnosis:
    """The reason and counted message over all pods of one service (deterministic for a given set of pods)."""
    live = sorted((p for p in pods if counts(p)), key=lambda p: (p.get("metadata") or {}).get("name") or "")
    totals: Counter[str] = Counter(component_of(p) for p in live)
    by_reason: dict[str, list[tuple[str, Finding]]] = {}
    for pod in live:
        f = pod_finding(pod, missing_claims)
        if f is not None:
            by_reason.setdefault(f.reason, []).append((component_of(pod), f))
    if not by_reason:
        return Diagnosis()
    order = sorted(by_reason, key=lambda r: (by_reason[r][0][1].rank, r))
    parts = []
    for reason in order:
        items = by_reason[reason]
        per_comp = Counter(comp for comp, _ in items)
        comps = sorted(per_comp, key=lambda c: (COMPONENT_ORDER.index(c) if c in COMPONENT_ORDER else 9, c))
        # each component's most common detail (ties: the first pod by name); components saying the same share it
        details: dict[str, list[str]] = {}
        for c in comps:
            detail = Counter(f.detail for comp, f in items if comp == c).most_common(1)[0][0]
            details.setdefault(detail, []).append(c)
        for detail, group in details.items():
            counted = ", ".join(f"{per_comp[c]}/{totals[c]} {c} pods" for c in group)
            parts.append(f"{counted} {reason}: {detail}")
    return Diagnosis(reason=order[0], message=_clip("; ".join(parts), MESSAGE_LIMIT))


def slim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `diagnose` reads, in the Pod's own shape (what the operator keeps in memory per pod)."""
    meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}

    def state(s: Mapping[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, fields in (("waiting", ("reason", "message")), ("terminated", ("reason", "exitCode", "message")),
                            ("running", ())):
            if key in (s or {}):
                out[key] = {f: (s or {})[key][f] for f in fields if ((s or {})[key] or {}).get(f) is not None}
        return out

    def container(cs: Mapping[str, Any]) -> dict[str, Any]:
        return {"name": cs.get("name"), "ready": bool(cs.get("ready")), "restartCount": cs.get("restartCount", 0),
                "state": state(cs.get("state")), "lastState": state(cs.get("lastState"))}

    labels = meta.get("labels") or {}
    out_meta: dict[str, Any] = {"name": meta.get("name"), "namespace": meta.get("namespace"),
                                "labels": {k: v for k, v in labels.items() if k == COMPONENT_LABEL}}
    if meta.get("deletionTimestamp"):
        out_meta["deletionTimestamp"] = meta["deletionTimestamp"]
    return {
        "metadata": out_meta,
        "spec": {"nodeName": spec.get("nodeName"),
                 "volumes": [{"name": v.get("name"), "persistentVolumeClaim": {"claimName": v["persistentVolumeClaim"].get("claimName")}}
                             for v in spec.get("volumes") or [] if v.get("persistentVolumeClaim")]},
        "status": {
            "phase": st.get("phase"),
            "conditions": [{k: c[k] for k in ("type", "status", "reason", "message") if c.get(k) is not None}
                           for c in st.get("conditions") or []],
            "initContainerStatuses": [container(cs) for cs in st.get("initContainerStatuses") or []],
            "containerStatuses": [container(cs) for cs in st.get("containerStatuses") or []],
        },
    }
