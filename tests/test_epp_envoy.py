"""A real Envoy 1.40 configured by `warmfleet envoy-bootstrap`'s builder, a real `warmfleet epp` and two real
`warmfleet serve` replicas on the tiny Qwen2-VL checkpoint (text and images), all on loopback: warm prefixes,
images staying home, streaming, fail-open / fail-closed, a replica killed mid-run and served-endpoint accounting.

The EPP runs with a long health interval here, so after a kill it keeps naming the dead replica first for a
while: what saves those requests is the gateway's retry down the pick's fallback list, not the EPP noticing."""

from __future__ import annotations

import json

import httpx
import pytest

from envoy_gateway import Envoy, envoy_binary
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from warmfleet.livefleet import Epp, MediaServer, Replica, free_port, metric, wait_for
from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

pytestmark = pytest.mark.slow

SYSTEM = "You are the warmfleet gateway assistant. Answer briefly about caches, routing and endpoints. " * 6


@pytest.fixture(scope="module")
def gateway(tiny_vl_dir, tmp_path_factory):
    envoy_binary()  # fail first, before starting anything, when no Envoy is given
    cwd = tmp_path_factory.mktemp("epp-envoy")  # never the repo root: its operator/ folder shadows the stdlib
    replicas = [Replica(f"r{i}", tiny_vl_dir, cwd, ("--max-encoder-cache", "4096", "--allowed-media-host", "127.0.0.1"))
                for i in range(2)]
    epp = Epp(tiny_vl_dir, replicas, cwd, ("--health-interval-s", "30"))
    envoy = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        epp.start()
        epp.wait_synced()
        envoy = Envoy(GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{r.port}" for r in replicas],
                                    num_retries=2), cwd).start()
        yield envoy, epp, replicas, cwd
    finally:
        if envoy is not None:
            envoy.stop()
        for p in [epp, *replicas]:
            p.stop()


def ask(base: str, question: str, system: str = SYSTEM, **extra) -> httpx.Response:
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **extra})
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def in_flight(epp: Epp) -> dict:
    return {r["id"]: r["in_flight"] for r in epp.view()["replicas"]}


def test_a_shared_prefix_lands_warm_on_the_same_replica(gateway):
    envoy, epp, _, _ = gateway
    first = ask(envoy.url, "What is a prefix cache?")
    second = ask(envoy.url, "And what is a KV block?")
    assert second.headers["x-warmfleet-replica"] == first.headers["x-warmfleet-replica"]
    assert cached(second) > 0
    assert "x-gateway-destination-endpoint-served" not in second.headers  # the gateway's note to the EPP only
    assert metric(epp.metrics(), "warmfleet_router_actual_cached_tokens_total") >= cached(second)
    wait_for(lambda: not any(in_flight(epp).values()), "in-flight back to 0", [epp], 30)


def test_an_image_conversation_stays_home(gateway):
    envoy, _, _, _ = gateway
    image = image_part(data_uri(image_bytes(112, 112, seed=21)))
    turn = [{"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]}]
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": turn}
    first = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    follow = turn + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"] or "x"},
                     {"role": "user", "content": "And its colours?"}]
    second = httpx.post(envoy.url + "/v1/chat/completions", json={**body, "messages": follow}, timeout=120)
    assert second.status_code == 200, second.text
    assert second.headers["x-warmfleet-replica"] == first.headers["x-warmfleet-replica"]
    assert cached(second) > 0


def test_a_url_image_is_learned_from_the_replica_through_the_gateway(gateway, tiny_vl_dir):
    """Envoy hands the EPP the answer's headers: the replica's media header (what the URL it fetched hashed to)
    teaches the EPP, is removed before the client, and the next turn is predicted warm past the image, exactly."""
    from warmfleet.server.router.core.prompt import PromptRenderer

    envoy, epp, _, cwd = gateway
    data = image_bytes(112, 168, seed=43)
    (cwd / "media").mkdir(exist_ok=True)
    with MediaServer(cwd / "media") as media:
        url = media.put("gw.png", data)
        image = {"type": "image_url", "image_url": {"url": url}}
        turn = [{"role": "system", "content": "One picture, several questions."},
                {"role": "user", "content": [image, {"type": "text", "text": "What is in it?"}]}]
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": turn}
        first = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert "x-warmfleet-media" not in first.headers  # the replica's note to the router only
        assert metric(epp.metrics(), "warmfleet_router_media_urls_learned_total") >= 1
        follow = turn + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"] or "x"},
                         {"role": "user", "content": "And its corners?"}]
        before = {n: metric(epp.metrics(), n) or 0 for n in ("warmfleet_router_predicted_cached_tokens_total",
                                                             "warmfleet_router_actual_cached_tokens_total")}
        second = httpx.post(envoy.url + "/v1/chat/completions", json={**body, "messages": follow}, timeout=120)
        assert second.status_code == 200, second.text
    item = PromptRenderer(str(tiny_vl_dir)).chat({"messages": [
        turn[0], {"role": "user", "content": [image_part(data_uri(data)), turn[1]["content"][1]]}]}).mm_items[0]
    predicted, actual = (metric(epp.metrics(), n) - before[n] for n in before)
    assert predicted == actual == cached(second) > item.offset + item.length  # warm past the image, as predicted


def test_streaming_passes_through_envoy_event_by_event(gateway):
    envoy, epp, _, _ = gateway
    events = []
    with httpx.stream("POST", envoy.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stream a word."}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] > 0  # the system prompt was warm
    wait_for(lambda: not any(in_flight(epp).values()), "in-flight back to 0", [epp], 30)


@pytest.mark.parametrize("allow", [True, False])
def test_with_the_epp_down_failure_mode_allow_decides(gateway, allow):
    _, _, replicas, cwd = gateway
    dead_epp = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = GatewayConfig(epp=dead_epp, endpoints=[f"127.0.0.1:{r.port}" for r in replicas], failure_mode_allow=allow)
    with Envoy(cfg, cwd, name=f"envoy-epp-down-{allow}") as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "anyone there?"}]})
        if allow:  # fail open: the pool round-robin
            assert r.status_code == 200, r.text
            assert r.headers["x-warmfleet-replica"] in {"r0", "r1"}
        else:  # fail closed: the gateway answers itself, no replica sees the request
            assert r.status_code >= 500 and "x-warmfleet-replica" not in r.headers, (r.status_code, r.text)


def test_a_bad_body_is_answered_by_the_epp_through_the_gateway(gateway):
    envoy, epp, _, _ = gateway
    r = httpx.post(envoy.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    wait_for(lambda: not any(in_flight(epp).values()), "in-flight back to 0", [epp], 30)


def test_buffered_gateway_and_tenant_salts_reach_the_engine(gateway, tiny_vl_dir):
    """A BUFFERED gateway (the pick rides on the body response, whose content-length Envoy checks) in front of an
    EPP that checks API keys: each tenant's salt is written into the body, so one tenant's prefix is warm for it
    and cold for the other."""
    _, _, replicas, cwd = gateway
    epp = Epp(tiny_vl_dir, replicas, cwd, ("--api-key", "key-a", "--api-key", "key-b"))
    epp.name = "epp-tenants"
    try:
        epp.start()
        epp.wait_synced()
        cfg = GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{r.port}" for r in replicas],
                            request_body_mode="BUFFERED", response_body_mode="BUFFERED")
        with Envoy(cfg, cwd, name="envoy-buffered") as gw:
            system = "Tenant-separated caches keep one customer's prompts away from another's. " * 6

            def turn(key: str, q: str) -> httpx.Response:
                r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={"authorization": f"Bearer {key}"},
                               json={"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
                                   {"role": "system", "content": system}, {"role": "user", "content": q}]})
                assert r.status_code == 200, r.text
                return r

            turn("key-a", "first")
            assert cached(turn("key-a", "second")) > 0  # warm for its tenant
            assert cached(turn("key-b", "first")) == 0  # the same prefix under another salt: cold
            assert httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={"messages": []},
                              headers={"authorization": "Bearer wrong"}).status_code == 401
            wait_for(lambda: not any(in_flight(epp).values()), "in-flight back to 0", [epp], 30)
    finally:
        epp.stop()


def test_a_client_that_leaves_mid_stream_leaves_nothing_in_flight(gateway):
    """The client hangs up after the first event of a long answer: Envoy resets the ext_proc stream and the EPP
    releases what it booked (the deterministic version, a stream cancelled at a known point, is in
    test_epp_service.py; here the real gateway's reset path, whatever point the answer had reached)."""
    envoy, epp, _, _ = gateway
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", envoy.url + "/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Talk for a long while."}]}) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
    wait_for(lambda: not any(in_flight(epp).values()) and
             metric(epp.metrics(), "warmfleet_epp_open_streams") == 0, "the stream released", [epp], 60)


def test_an_original_dst_gateway_routes_by_the_single_endpoint_pick(gateway, tiny_vl_dir):
    """`--lb original-dst` (the host straight from the header) with an EPP naming one endpoint (--max-attempts 1)."""
    _, _, replicas, cwd = gateway
    epp = Epp(tiny_vl_dir, replicas, cwd, ("--max-attempts", "1"))
    epp.name = "epp-one-endpoint"
    try:
        epp.start()
        epp.wait_synced()
        with Envoy(GatewayConfig(epp=epp.address, lb="original-dst"), cwd, name="envoy-original-dst") as gw:
            system = "Original destination: the gateway connects where the header says. " * 6
            first = ask(gw.url, "one", system=system)
            second = ask(gw.url, "two", system=system)
            assert second.headers["x-warmfleet-replica"] == first.headers["x-warmfleet-replica"]
            assert cached(second) > 0
    finally:
        epp.stop()


def test_the_subset_hint_set_by_the_gateway_is_honoured(gateway):
    """A filter ahead of ext_proc puts envoy.lb.subset_hint in the metadata (as a GIE gateway may): the bootstrap
    forwards that namespace, and every pick, warm or not, is the one endpoint allowed."""
    envoy, epp, replicas, cwd = gateway
    system = "A prefix warmed elsewhere, then fenced off by the gateway's subset hint. " * 6
    home = ask(envoy.url, "warm it", system=system).headers["x-warmfleet-replica"]  # through the plain gateway
    assert ask(envoy.url, "warm again", system=system).headers["x-warmfleet-replica"] == home
    allowed = next(r for r in replicas if r.name != home)  # the replica the prefix would not go to
    hint = {"name": "envoy.filters.http.set_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
        "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                      "value": {"x-gateway-destination-endpoint-subset": [f"127.0.0.1:{allowed.port}"]}}]}}
    cfg = GatewayConfig(epp=epp.address, endpoints=[f"127.0.0.1:{r.port}" for r in replicas])
    with Envoy(cfg, cwd, name="envoy-subset", filters_before=(hint,)) as gw:
        for q in ("a", "b", "c"):
            assert ask(gw.url, q, system=system).headers["x-warmfleet-replica"] == allowed.name
    wait_for(lambda: not any(in_flight(epp).values()), "in-flight back to 0", [epp], 30)


def test_a_killed_replica_costs_no_request_and_the_load_settles_where_served(gateway):
    """Last in the module (a replica stays dead). Kill the replica holding a conversation; its next turns are picked there first (the EPP has not
    noticed), refused, retried by Envoy on the fallback: every one answers, the served endpoint takes the load."""
    envoy, epp, replicas, _ = gateway
    system = "A conversation that lives on one replica until it dies. " * 8
    home = ask(envoy.url, "first turn", system=system).headers["x-warmfleet-replica"]
    victim = next(r for r in replicas if r.name == home)
    survivor = next(r for r in replicas if r.name != home)
    retries_before = metric(epp.metrics(), "warmfleet_router_retries_total") or 0.0
    victim.kill()
    answers = [ask(envoy.url, f"turn {i}", system=system) for i in range(4)]
    assert {a.headers["x-warmfleet-replica"] for a in answers} == {survivor.name}
    text = epp.metrics()
    assert metric(text, "warmfleet_router_retries_total") >= retries_before + 1  # the gateway retried, the EPP saw
    view = in_flight(epp)
    assert view == {r.url: 0 for r in replicas}, view  # nothing leaked on the pick nor on the served replica
