"""A real `warmfleet serve --api-keys-file` behind a real `warmfleet route` with the same keys file (issue 40): a
client key reaches the same prefix-cache entries through the router and straight at the replica (one salt, contract
1), and another tenant going straight at the replica cannot hit them, whatever cache_salt it sends."""

from __future__ import annotations

import json

import httpx
import pytest

from warmfleet.livefleet import MODEL_NAME, LiveFleet
from warmfleet.server.tenant_keys import derive_salt

pytestmark = pytest.mark.slow

FLEET = "fleet-live-key"
SECRET = "live-salt-secret"
PROMPT = "Tenant isolation holds at every door: the router, the picker, and the replica itself. " * 6


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("client-keys-live")
    keys = cwd / "keys.json"
    keys.write_text(json.dumps({"alice-key": None, "bob-key": None}))
    f = LiveFleet(tiny_model_dir, cwd, n=1,
                  replica_args=("--api-key", FLEET, "--api-keys-file", str(keys), "--salt-secret", SECRET),
                  router_args=("--api-keys-file", str(keys), "--salt-secret", SECRET, "--replica-api-key", FLEET))
    yield f.start()
    f.close()


def cached(url: str, key: str, **body) -> int:
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_key_hits_the_same_entries_through_either_door_and_no_other_tenant_does(fleet):
    replica, router = fleet.replicas[0].url, fleet.router.url
    assert cached(router, "alice-key") == 0  # first sight: alice's entries are stored under her tenant's salt
    assert cached(replica, "alice-key") > 0  # straight at the replica, the same key: the same entries
    # bob, straight at the replica, naming alice's salt (as if he knew it) or none: his own tenant's entries only
    assert cached(replica, "bob-key", cache_salt=derive_salt("alice-key", SECRET)) == 0
    assert cached(replica, "bob-key") == 0
    assert cached(router, "bob-key") > 0  # bob's own entries, stored by his direct request, through the router
    # the fleet key is trusted with the salt the router sets: without one, it shares nobody's entries
    assert cached(replica, FLEET) == 0
    refused = httpx.post(replica + "/v1/completions", headers={"Authorization": "Bearer carol-key"}, timeout=30,
                         json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1})
    assert refused.status_code == 401
