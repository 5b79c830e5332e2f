"""spec.router.keysSecret reaches the server pods (issue 40): warmfleet replicas mount the keys and take
`--api-keys-file`, in proxy and gateway mode alike, and the front doors and the operator send them a fleet key that no
client holds (the service's admin key; apiKeySecret is a client key at the replicas too)."""

from __future__ import annotations

import argparse
from typing import Any

from operator_fixtures.rendered import HF, children, container
from warmfleet.operator.planning import client_keys, objects
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.server import config as server_config

KEYS = {"keysSecret": {"name": "tenants", "key": "clients.json"}}
API = {"apiKeySecret": {"name": "fleet", "key": "k"}}


def env(c: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def secret_env(name: str, key: str) -> dict:
    return {"secretKeyRef": {"name": name, "key": key}}


def served_config(c: dict) -> server_config.EngineConfig:
    parser = argparse.ArgumentParser()
    server_config.add_arguments(parser)
    assert c["args"][0] == "serve"
    return server_config.from_namespace(parser.parse_args(c["args"][1:]))


def test_replicas_check_client_keys_in_both_modes_and_trust_only_the_fleet_key():
    for mode, door in (("proxy", "router"), ("gateway", "epp")):
        objs = children({"model": HF, "router": {"mode": mode, **KEYS, **API}})
        pod, server = container(objs, "server")
        cfg = served_config(server)  # contract 3: `warmfleet serve` takes what the operator renders
        assert cfg.server.api_keys_file == "/etc/warmfleet/keys/keys.json"
        assert {"name": "client-keys", "mountPath": "/etc/warmfleet/keys", "readOnly": True} in server["volumeMounts"]
        vol = next(v for v in pod["volumes"] if v["name"] == "client-keys")
        assert vol["secret"] == {"secretName": "tenants", "items": [{"key": "clients.json", "path": "keys.json"}],
                                 "defaultMode": 0o440}
        # the fleet key is the admin key, which no client holds; apiKeySecret is a client key at both doors
        admin = secret_env("qwen-admin", objects.ADMIN_KEY)
        assert env(server)["WARMFLEET_API_KEY"] == admin
        assert env(server)["WARMFLEET_CLIENT_API_KEY"] == secret_env("fleet", "k")
        _, front = container(objs, door)
        assert env(front)["WARMFLEET_REPLICA_API_KEY"] == admin
        assert env(front)["WARMFLEET_API_KEY"] == secret_env("fleet", "k")
        for c in (server, front):
            names = [e["name"] for e in c["env"]]
            assert len(names) == len(set(names)), names


def test_without_an_api_key_secret_the_fleet_key_is_the_admin_key_too():
    objs = children({"model": HF, "router": {"mode": "gateway", **KEYS}})
    _, server = container(objs, "server")
    _, picker = container(objs, "epp")
    admin = secret_env("qwen-admin", objects.ADMIN_KEY)
    assert env(server)["WARMFLEET_API_KEY"] == admin and env(server)["WARMFLEET_ADMIN_KEY"] == admin
    assert "WARMFLEET_CLIENT_API_KEY" not in env(server)
    assert env(picker)["WARMFLEET_REPLICA_API_KEY"] == admin
    assert "WARMFLEET_API_KEY" not in env(picker)  # the picker's clients are the keys file's, never the admin key
    spec = parse_spec({"model": HF, "engine": {"kind": "warmfleet"}, "router": KEYS})
    assert client_keys.fleet_key_ref(objects.Owner("qwen", "team-a"), spec) == ("qwen-admin", objects.ADMIN_KEY)


def test_no_keys_secret_or_another_engine_leaves_the_replicas_as_they_were():
    for spec in ({"model": HF, "router": API}, {"model": HF, "engine": {"kind": "vllm"}, "router": {**KEYS, **API}}):
        objs = children(spec)
        pod, server = container(objs, "server")
        assert "--api-keys-file" not in server["args"]
        assert "client-keys" not in [v["name"] for v in pod["volumes"]]
        assert secret_env("fleet", "k") in env(server).values() and "WARMFLEET_CLIENT_API_KEY" not in env(server)
    plain = parse_spec({"model": HF, "engine": {"kind": "warmfleet"}})
    assert client_keys.fleet_key_ref(objects.Owner("qwen", "team-a"), plain) is None
