"""spec.router.kvEventsCurve (issue 40): the operator generates the CURVE key pairs once into an owned Secret, and
renders flags and mounts that `warmfleet serve`, `route` and `epp` take; the keys laid out as the pods see them
carry a real replica's event publisher to a keyed subscriber and to no other."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest
import zmq

from operator_fixtures.rendered import HF, IMAGES, children, container
from operator_fixtures.shapes import l4, service
from warmfleet.kube import KubeError
from warmfleet.operator.passes.kv_curve_secret import ensure_kv_curve_secret
from warmfleet.operator.planning import kv_curve, objects
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server import config as server_config
from warmfleet.server import flagfields
from warmfleet.server.events import AllBlocksCleared, EventPublisher, decode
from warmfleet.server.router.core.settings import RouterSettings
from warmfleet.server.router.core.subscriber import CurveKeys
from warmfleet.server.router.epp.settings import EppSettings

OWNER = objects.Owner("qwen", "team-a")


class FakeKube:
    """Secrets by (namespace, name): get and create, a 409 for a name that exists."""

    def __init__(self):
        self.secrets: dict[tuple[str, str], dict] = {}
        self.creates = 0

    async def get(self, kind: str, ns: str, name: str):
        assert kind == "Secret"
        return self.secrets.get((ns, name))

    async def create(self, obj: dict) -> dict:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.secrets:
            raise KubeError(409, "exists")
        self.creates += 1
        self.secrets[key] = obj
        return obj


def parse(parser_of, cls, args: list[str]):
    parser = argparse.ArgumentParser()
    parser_of(parser)
    return flagfields.from_namespace(parser.parse_args(args), cls)


def lay_out(secret: dict, volume: dict, root: Path) -> Path:
    """The files a pod sees at the mount: each item of the Secret volume at its path."""
    for item in volume["secret"]["items"]:
        path = root / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secret["stringData"][item["key"]])
    return root


def test_the_flags_and_mounts_are_what_serve_route_and_epp_take():
    for mode, door, cls in (("proxy", "router", RouterSettings), ("gateway", "epp", EppSettings)):
        objs = children({"model": HF, "router": {"mode": mode, "kvEventsCurve": True}})
        pod, server = container(objs, "server")
        parser = argparse.ArgumentParser()
        server_config.add_arguments(parser)
        cfg = server_config.from_namespace(parser.parse_args(server["args"][1:]))
        assert cfg.server.kv_events_curve_secret_key == "/etc/warmfleet/kv-curve/replica.key_secret"
        assert cfg.server.kv_events_curve_clients == "/etc/warmfleet/kv-curve/clients"
        vol = next(v for v in pod["volumes"] if v["name"] == "kv-curve")
        assert vol["secret"]["secretName"] == "qwen-kv-curve"
        assert {i["path"] for i in vol["secret"]["items"]} == {"replica.key_secret", "clients/router.key"}
        dpod, front = container(objs, door)
        got = parse(lambda p: flagfields.add_arguments(p, cls), cls, front["args"][1:])
        assert got.kv_events_curve_server_key == "/etc/warmfleet/kv-curve/replica.key"
        assert got.kv_events_curve_secret_key == "/etc/warmfleet/kv-curve/router.key_secret"
        dvol = next(v for v in dpod["volumes"] if v["name"] == "kv-curve")
        assert {i["key"] for i in dvol["secret"]["items"]} == {"replica.key", "router.key_secret"}  # no replica secret
        assert {"name": "kv-curve", "mountPath": "/etc/warmfleet/kv-curve", "readOnly": True} in front["volumeMounts"]
    plain = children({"model": HF})
    assert "--kv-events-curve-secret-key" not in container(plain, "server")[1]["args"]
    assert "--kv-events-curve-server-key" not in container(plain, "router")[1]["args"]


def test_other_engines_are_refused_as_they_have_no_curve():
    with pytest.raises(SpecError, match="kvEventsCurve"):
        children({"model": HF, "engine": {"kind": "vllm"}, "router": {"kvEventsCurve": True}})


def test_the_key_pairs_are_generated_once_and_never_rotated_by_a_reconcile():
    spec = parse_spec({"model": HF, "router": {"kvEventsCurve": True}})
    kube = FakeKube()
    assert asyncio.run(ensure_kv_curve_secret(kube, OWNER, spec)) == "created"
    first = dict(kube.secrets["team-a", "qwen-kv-curve"]["stringData"])
    for _ in range(3):
        assert asyncio.run(ensure_kv_curve_secret(kube, OWNER, spec)) == "exists"
    assert kube.secrets["team-a", "qwen-kv-curve"]["stringData"] == first and kube.creates == 1
    assert set(first) == set(kv_curve.KEY_NAMES)
    other = FakeKube()
    asyncio.run(ensure_kv_curve_secret(other, objects.Owner("qwen", "team-b"), spec))
    assert other.secrets["team-b", "qwen-kv-curve"]["stringData"]["replica.key_secret"] != first["replica.key_secret"]
    off = parse_spec({"model": HF})
    assert asyncio.run(ensure_kv_curve_secret(FakeKube(), OWNER, off)) == "off"


def subscriber(ctx: zmq.Context, endpoint: str, keys: CurveKeys) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    keys.apply(sock)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def test_the_generated_keys_carry_events_to_the_routers_and_to_nobody_else(tmp_path):
    spec = parse_spec({"model": HF, "router": {"kvEventsCurve": True}})
    kube = FakeKube()
    asyncio.run(ensure_kv_curve_secret(kube, OWNER, spec))
    secret = kube.secrets["team-a", "qwen-kv-curve"]
    objs = children({"model": HF, "router": {"kvEventsCurve": True}})
    server_vol = next(v for v in container(objs, "server")[0]["volumes"] if v["name"] == "kv-curve")
    router_vol = next(v for v in container(objs, "router")[0]["volumes"] if v["name"] == "kv-curve")
    server_dir, router_dir = lay_out(secret, server_vol, tmp_path / "server"), lay_out(secret, router_vol, tmp_path / "router")
    pub = EventPublisher("r0", "tcp://127.0.0.1:*", curve_secret_key_file=str(server_dir / "replica.key_secret"),
                         curve_clients_dir=str(server_dir / "clients"))
    endpoint = pub._sock.getsockopt_string(zmq.LAST_ENDPOINT)
    keyed = CurveKeys.from_files(str(router_dir / "replica.key"), str(router_dir / "router.key_secret"))
    stranger_public, stranger_secret = zmq.curve_keypair()
    ctx = zmq.Context()
    router = subscriber(ctx, endpoint, keyed)
    stranger = subscriber(ctx, endpoint, CurveKeys(keyed.server_public, stranger_public, stranger_secret))
    try:
        deadline = time.monotonic() + 20
        while not router.poll(100) and time.monotonic() < deadline:  # subscriptions take a moment to arrive
            pub.publish([AllBlocksCleared()])
        assert router.poll(0), "the keyed subscriber received no batch"
        assert decode(router.recv_multipart()).replica_id == "r0"
        pub.publish([AllBlocksCleared()])
        assert not stranger.poll(500)  # a key the replicas were not given: the handshake fails, nothing arrives
    finally:
        router.close(0)
        stranger.close(0)
        ctx.term()
        pub.close()


def test_a_reconcile_creates_the_owned_secret_before_the_pods_and_the_next_keeps_it():
    from operator_fixtures.memory import MemoryKube
    from warmfleet.operator.passes.reconcile import OperatorState, reconcile

    body = service("qwen", spec={"router": {"kvEventsCurve": True}})
    kube = MemoryKube()
    state = OperatorState(default_images=IMAGES, kube=kube)
    out = asyncio.run(reconcile(state, body, [node_info(l4())], post_event=lambda *a: None,
                                now=lambda: "2026-01-01T00:00:00Z"))
    assert not out.invalid and out.actions["Secret/qwen-kv-curve"] == "created"
    secret = kube.objects["Secret", "qwen-kv-curve"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"  # garbage-collected with the service
    keys = dict(secret["stringData"])
    again = asyncio.run(reconcile(state, body, [node_info(l4())], post_event=lambda *a: None,
                                  now=lambda: "2026-01-01T00:00:00Z"))
    assert "Secret/qwen-kv-curve" not in again.actions and kube.objects["Secret", "qwen-kv-curve"]["stringData"] == keys
