"""Tenant isolation through a router with API keys: tenant B never gets tenant A's cache hits, images or uuids.

One replica of the tiny Qwen2-VL checkpoint behind a router started with two keys. The router
writes each key's salt into the forwarded `cache_salt` (server/router/core/tenants.py), which roots every
block hash and scopes client uuids. What B could learn of A is checked where it would show:
`usage.prompt_tokens_details.cached_tokens`, the router's decision header (`x-warmfleet-route`,
`prefix_hit` would say "someone sent this"), uuid-only image parts (A's uuid must be unknown to
B) and the replica's vision-encoder cache (image content hashes are scoped by the salt too). TTFT is measured by bench/tenant_probe.py (docs/reliability.md).
"""

from __future__ import annotations

import httpx
import pytest

from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from warmfleet.livefleet import MODEL_NAME, LiveFleet, metric
from warmfleet.server.router.core.tenants import derive_salt

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
SYSTEM = "You are the billing assistant of tenant A. " + "Internal pricing table follows. " * 20


@pytest.fixture(scope="module")
def keyed_fleet(tiny_vl_dir, tmp_path_factory):
    fleet = LiveFleet(tiny_vl_dir, tmp_path_factory.mktemp("tenants"), n=1,
                      router_args=("--api-key", KEY_A, "--api-key", KEY_B))
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()


def chat(url: str, key: str | None, content, system: str = SYSTEM, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_b_gets_no_cache_hit_on_a_prefix(keyed_fleet):
    url = keyed_fleet.router.url
    assert chat(url, None, "hi").status_code == 401
    assert chat(url, "not-a-key", "hi").status_code == 401
    system = SYSTEM + " (prefix probe)"
    cached(chat(url, KEY_A, "first question", system))
    a_again = chat(url, KEY_A, "second question", system)
    assert cached(a_again) > 0  # A's prefix is cached ...
    b = chat(url, KEY_B, "second question", system)
    assert cached(b) == 0  # ... but not for B
    assert b.headers.get("x-warmfleet-route") != "prefix_hit"  # the router's decision does not tell B either
    # naming A's salt in the body does not help: a client salt only partitions further inside its own tenant
    b_salted = chat(url, KEY_B, "second question", system, cache_salt=derive_salt(KEY_A))
    assert cached(b_salted) == 0
    assert cached(chat(url, KEY_B, "third question", system)) > 0  # B's own cache works as usual


def test_b_cannot_use_a_image_uuid_or_hit_a_image_blocks(keyed_fleet):
    url = keyed_fleet.router.url
    img = data_uri(image_bytes(64, 48, seed=77))
    first = chat(url, KEY_A, [image_part(img, uuid="a-private-scan"), {"type": "text", "text": "what is it?"}])
    assert first.status_code == 200, first.text
    # A may refer to its image by uuid alone; B may not: the uuid is scoped by the tenant's salt
    assert chat(url, KEY_A, [image_part(uuid="a-private-scan"), {"type": "text", "text": "again"}]).status_code == 200
    b = chat(url, KEY_B, [image_part(uuid="a-private-scan"), {"type": "text", "text": "again"}])
    assert b.status_code == 400
    assert "unknown image uuid" in b.json()["error"]["message"]
    # B sending the same picture itself computes its own answer: no KV hit on A's image blocks
    system = "Image desk. " * 30
    cached(chat(url, KEY_A, [image_part(img), {"type": "text", "text": "q1"}], system))
    assert cached(chat(url, KEY_A, [image_part(img), {"type": "text", "text": "q2"}], system)) > 0
    assert cached(chat(url, KEY_B, [image_part(img), {"type": "text", "text": "q2"}], system)) == 0


def test_b_sending_a_image_misses_the_encoder_cache(keyed_fleet):
    """Image content hashes are scoped by the tenant's salt: B's copy of A's picture is encoded again (an encoder
    hit would show in B's first-token time and in where an encoder-aware router places B), A's own repeat is a hit."""
    url, replica = keyed_fleet.router.url, keyed_fleet.replicas[0]
    img = data_uri(image_bytes(72, 56, seed=91))

    def encoder_hits() -> float:
        return metric(httpx.get(replica.url + "/metrics", timeout=5).text, "warmfleet:encoder_cache_hits_total") or 0.0

    # each ask under another system prompt: no KV prefix covers the image, so only the encoder cache could serve it
    cached(chat(url, KEY_A, [image_part(img), {"type": "text", "text": "what is it?"}], "Desk one. " * 12))
    before = encoder_hits()
    cached(chat(url, KEY_B, [image_part(img), {"type": "text", "text": "what is it?"}], "Desk two. " * 12))
    assert encoder_hits() == before
    cached(chat(url, KEY_A, [image_part(img), {"type": "text", "text": "and now?"}], "Desk three. " * 12))
    assert encoder_hits() > before
