"""The CURVE key pairs of spec.router.kvEventsCurve, generated once into the owned Secret NAME-kv-curve.

zmq's own key generation (libsodium); never rewritten, so the running replicas and routers keep agreeing; delete the
Secret to rotate (every pod of the service then needs a restart to read the new keys)."""

from __future__ import annotations

from typing import Any

import zmq

from warmfleet.kube import Kube
from warmfleet.operator.passes.create_once import create_once
from warmfleet.operator.planning import kv_curve
from warmfleet.operator.planning.objects import Owner
from warmfleet.operator.spec.inference_service import InferenceServiceSpec


def new_key_pairs() -> dict[str, tuple[str, str]]:
    """A fresh (public, secret) Z85 key pair for the replicas and one for the routers (pickers)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE (libsodium): cannot generate spec.router.kvEventsCurve keys")
    pairs = {}
    for who in (kv_curve.REPLICA, kv_curve.ROUTER):
        public, secret = zmq.curve_keypair()
        pairs[who] = (public.decode("ascii"), secret.decode("ascii"))
    return pairs


async def ensure_kv_curve_secret(kube: Kube, owner: Owner, spec: InferenceServiceSpec,
                                 own: Any = lambda objs: objs) -> str:
    """Create NAME-kv-curve with fresh key pairs if spec.router.kvEventsCurve is on and it does not exist; never touch
    an existing one. `own` adds the owner reference. Returns 'created', 'exists' or 'off'."""
    if not spec.router.kv_events_curve:
        return "off"
    return await create_once(kube, owner.namespace, kv_curve.curve_secret_name(owner),
                             lambda: kv_curve.curve_secret(owner, new_key_pairs()), own)
