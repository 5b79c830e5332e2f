"""Gateway mode with per-client keys through a real Envoy 1.40, a real `warmfleet epp --api-keys-file` and a real
`warmfleet serve --api-keys-file` (issue 40): the client's own key, which the picker no longer swaps for the replica
key, is served by the replica (before: 401), under the salt the picker wrote, so a request straight at the replica
with the same key hits the same cache entries and another tenant's does not."""

from __future__ import annotations

import json

import httpx
import pytest

from envoy_gateway import Envoy, envoy_binary
from warmfleet.livefleet import Epp, Replica
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig
from warmfleet.server.tenant_keys import derive_salt

pytestmark = pytest.mark.slow

FLEET = "fleet-gw-key"
PROMPT = "The gateway passes the client's own key to the replica, which salts it as the picker did. " * 6


def cached(url: str, key: str, **body) -> int:
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_client_keys_through_the_gateway_and_straight_at_the_replica_share_one_salt(tiny_model_dir, tmp_path):
    envoy_binary()  # fail first, before starting anything, when no Envoy is given
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"alice-key": None, "bob-key": "team-b"}))
    r = Replica("r0", tiny_model_dir, tmp_path, ("--api-key", FLEET, "--api-keys-file", str(keys)))
    epp = Epp(tiny_model_dir, [r], tmp_path, ("--api-keys-file", str(keys), "--replica-api-key", FLEET))
    try:
        r.start()
        r.wait_ready()
        epp.start()
        epp.wait_synced()
        with Envoy(GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{r.port}"]), tmp_path) as gw:
            assert cached(gw.url, "alice-key") == 0  # served with alice's own key, her entries stored
            assert cached(r.url, "alice-key") > 0  # straight at the replica: the same salt, the same entries
            assert cached(r.url, "bob-key", cache_salt=derive_salt("alice-key")) == 0  # bob cannot name her salt
            assert cached(r.url, "bob-key") == 0
            assert cached(gw.url, "bob-key") > 0  # and his own entries are the same through the gateway
            refused = httpx.post(gw.url + "/v1/completions", headers={"Authorization": "Bearer carol-key"},
                                 timeout=60, json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
            assert refused.status_code == 401
    finally:
        epp.stop()
        r.stop()
