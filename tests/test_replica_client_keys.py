"""A replica with `--api-keys-file` (issue 40): client keys accepted under their tenant's salt, the salt the router and
picker give the same key (server/tenant_keys.py), a body cache_salt never escaping the tenant, the fleet key trusted."""

from __future__ import annotations

import json

import httpx
import pytest

from fakes import FakeEngine
from warmfleet.server.api.app import build_app
from warmfleet.server.config import EngineConfig
from warmfleet.server.router.core.tenants import Tenants, derive_salt
from warmfleet.server.tenant_keys import read_keys_file, tenant_salt
from warmfleet.server.tokenizer import Tokenizer

KEYS = {"alice-key": None, "bob-key": "team-b"}
SECRET = "test-salt-secret"
FLEET = "fleet-key"


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


def cfg_with(model_dir, **server) -> EngineConfig:
    cfg = EngineConfig()
    cfg.model.model, cfg.model.served_model_name = str(model_dir), "tiny"
    for k, v in server.items():
        setattr(cfg.server, k, v)
    return cfg


async def salts_seen(app, engine, key: str, bodies: list[dict], path: str = "/v1/completions") -> list:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        for body in bodies:
            r = await c.post(path, headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
    seen = [r.cache_salt for r in engine.requests]
    engine.requests.clear()
    return seen


async def test_a_client_key_runs_under_its_tenants_salt_whatever_the_body_says(tok, tiny_model_dir, keys_file):
    engine = FakeEngine(tok, tiny_model_dir)
    app = build_app(engine, tok, cfg_with(tiny_model_dir, api_key=FLEET, api_keys_file=keys_file, salt_secret=SECRET))
    alice, bob = derive_salt("alice-key", SECRET), "team-b"
    seen = await salts_seen(app, engine, "alice-key", [{}, {"cache_salt": bob}, {"cache_salt": "mine"},
                                                        {"cache_salt": alice}, {"cache_salt": f"{alice}/mine"}])
    # bob's salt named in the body stays inside alice's tenant; alice's own (as a door salted it) is kept
    assert seen == [alice, f"{alice}/{bob}", f"{alice}/mine", alice, f"{alice}/mine"]
    assert await salts_seen(app, engine, "bob-key", [{}, {"cache_salt": alice}]) == [bob, f"{bob}/{alice}"]
    # the fleet key (routers) is trusted: the salt the router set goes through as it is
    assert await salts_seen(app, engine, FLEET, [{"cache_salt": bob}, {}]) == [bob, None]
    chat = {"messages": [{"role": "user", "content": "hi"}], "cache_salt": bob}
    assert await salts_seen(app, engine, "alice-key", [chat], "/v1/chat/completions") == [f"{alice}/{bob}"]


async def test_the_replica_and_the_router_salt_a_key_alike_through_either_door(tok, tiny_model_dir, keys_file):
    """Contract 1: a request straight to the replica and the same request through the router (which salts the body,
    then the gateway passes the client's key on) run under one salt, so they hash to the same cache entries."""
    engine = FakeEngine(tok, tiny_model_dir)
    app = build_app(engine, tok, cfg_with(tiny_model_dir, api_keys_file=keys_file, salt_secret=SECRET))
    router = Tenants.from_flags([], keys_file, SECRET)
    for key in KEYS:
        for client_salt in (None, "x", "team-b"):
            through_router = router.salt_for(key, client_salt)  # the body the picker hands the gateway
            direct, via_gateway = await salts_seen(app, engine, key, [
                {"cache_salt": client_salt} if client_salt else {}, {"cache_salt": through_router}])
            assert direct == via_gateway == through_router


async def test_the_client_key_from_the_environment_is_salted_as_the_routers_api_key(tok, tiny_model_dir, keys_file,
                                                                                   monkeypatch):
    """WARMFLEET_CLIENT_API_KEY (the operator's apiKeySecret when keysSecret is set): a client key like the router's
    `--api-key` ones, salted alike, never trusted with a body salt."""
    monkeypatch.setenv("WARMFLEET_CLIENT_API_KEY", "shared-key")
    engine = FakeEngine(tok, tiny_model_dir)
    app = build_app(engine, tok, cfg_with(tiny_model_dir, api_key=FLEET, api_keys_file=keys_file, salt_secret=SECRET))
    router = Tenants.from_flags(["shared-key"], keys_file, SECRET)
    shared = router.salt_for("shared-key", None)
    assert shared == derive_salt("shared-key", SECRET)
    assert await salts_seen(app, engine, "shared-key", [{}, {"cache_salt": "team-b"}]) == [shared, f"{shared}/team-b"]
    assert await salts_seen(app, engine, "alice-key", [{}]) == [derive_salt("alice-key", SECRET)]  # the file still


async def test_client_keys_are_refused_where_only_the_fleet_may_go(tok, tiny_model_dir, keys_file):
    engine = FakeEngine(tok, tiny_model_dir)
    app = build_app(engine, tok, cfg_with(tiny_model_dir, api_key=FLEET, api_keys_file=keys_file))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer alice-key"})).status_code == 200
        unknown = await c.post("/v1/completions", headers={"Authorization": "Bearer carol-key"},
                               json={"model": "tiny", "prompt": "hi"})
        assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "invalid_api_key"
        snap = await c.get("/v1/kv/snapshot", headers={"Authorization": "Bearer alice-key"})
        assert snap.status_code == 403 and snap.json()["error"]["code"] == "fleet_key_required"
        assert (await c.get("/v1/kv/snapshot", headers={"Authorization": f"Bearer {FLEET}"})).status_code == 200
        # no admin key: a server checking client keys keeps its admin routes shut
        lora = await c.post("/v1/load_lora_adapter", headers={"Authorization": "Bearer alice-key"},
                            json={"lora_name": "a", "lora_path": "/x"})
        assert lora.status_code == 403
    assert engine.requests == []


def test_tenant_salts_never_cross_and_keys_files_are_checked(tmp_path):
    assert tenant_salt("a", None) == "a" and tenant_salt("a", "a/x") == "a/x" and tenant_salt("a", "ab") == "a/ab"
    bad = {"slash": {"k": "team/b"}, "empty-key": {"": None}, "list": ["k"], "number": {"k": 1}}
    for name, data in bad.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=str(path)):
            read_keys_file(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_keys_file(str(tmp_path / "missing.json"))
    cfg = cfg_with(tmp_path, api_keys_file=str(tmp_path / "slash.json"))
    with pytest.raises(ValueError, match="may not contain"):  # `warmfleet serve` exits with this line at startup
        build_app(None, None, cfg)


def test_a_bad_keys_file_stops_serve_with_one_line(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps({"k": "team/a"}))
    out = subprocess.run([sys.executable, "-m", "warmfleet.cli", "serve", "--model", str(tiny_model_dir),
                          "--api-keys-file", str(bad)], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "may not contain '/'" in lines[0], out.stderr
