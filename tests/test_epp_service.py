"""The EPP's ext_proc stream state machine over real gRPC in-process (FakeEnvoy), in front of fake replicas:
FULL_DUPLEX_STREAMED and BUFFERED picks, fallbacks, subset hint, refusals, body mutations, the response side's
accounting, cancelled streams, gRPC health and the side HTTP port."""

from __future__ import annotations

import json

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_fakes import (BUFFERED, EppFleet, lb_value, request_body, request_headers, response_body,
                       response_headers, set_headers, usage_event)
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from router_fakes import chat
from waiting import until
from warmfleet.server.router.core.tenants import Tenants, derive_salt
from warmfleet.server.router.epp import pick


def raw(body: dict) -> bytes:
    return json.dumps(body).encode()


async def pick_full_duplex(f: EppFleet, body: bytes, headers=None, subset=None, split: int = 2):
    """Headers, then the body in `split` chunks (the last with end_of_stream); returns the stream and its answers."""
    s = f.stream()
    await s.send(request_headers(headers=headers, subset=subset))
    cut = len(body) // split
    parts = [body[i * cut:(i + 1) * cut] for i in range(split - 1)] + [body[(split - 1) * cut:]]
    for part in parts[:-1]:
        await s.send(request_body(part, eos=False))
    await s.send(request_body(parts[-1], eos=True))
    first = await s.recv()
    if first.HasField("immediate_response"):
        return s, first, b"", []
    chunks = []
    while True:
        r = await s.recv()
        chunks.append(r)
        if r.request_body.response.body_mutation.streamed_response.end_of_stream:
            break
    sent = b"".join(c.request_body.response.body_mutation.streamed_response.body for c in chunks)
    return s, first, sent, chunks


async def test_full_duplex_pick_header_equals_metadata_body_unchanged_and_response_passes_at_once(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        body = raw(chat("What is a KV cache?", stream=True))
        s, first, sent, _ = await pick_full_duplex(f, body, split=3)
        assert first.HasField("request_headers")
        common = first.request_headers.response
        value = set_headers(common)[pick.DESTINATION]
        assert value == lb_value(first)  # one value in the header and in envoy.lb
        assert common.clear_route_cache
        eps = value.split(",")
        assert sorted(eps) == sorted([f.endpoint(0), f.endpoint(1)])  # primary, then the fallback
        assert "content-length" not in set_headers(common)  # nothing rewritten
        assert not common.header_mutation.remove_headers and "authorization" not in set_headers(common)
        assert sent == body  # the client's bytes, as they came
        primary = eps[0]
        assert f.in_flight() == {primary: 1, eps[1]: 0}
        assert f.queued()[primary] > 0  # its prompt is queued prefill until the first byte
        # response: every chunk handed back unchanged before the next one is sent
        (h,) = await s.exchange(response_headers(served=primary, content_type="text/event-stream"))
        assert h.HasField("response_headers")
        assert list(h.response_headers.response.header_mutation.remove_headers) == [pick.SERVED]
        chunk1 = b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'
        (r1,) = await s.exchange(response_body(chunk1, eos=False))
        streamed = r1.response_body.response.body_mutation.streamed_response
        assert streamed.body == chunk1 and not streamed.end_of_stream
        assert f.queued()[primary] == 0 and f.in_flight()[primary] == 1  # prefilled, still in flight
        before = f.metric("warmfleet_router_actual_cached_tokens_total")
        tail = usage_event(48)
        (r2,) = await s.exchange(response_body(tail, eos=True))
        assert r2.response_body.response.body_mutation.streamed_response.body == tail
        assert r2.response_body.response.body_mutation.streamed_response.end_of_stream
        assert f.in_flight() == {primary: 0, eps[1]: 0}
        assert f.metric("warmfleet_router_actual_cached_tokens_total") == before + 48
        await s.close()


async def test_buffered_pick_rides_on_the_body_response(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        s = f.stream()
        (h,) = await s.exchange(request_headers(mode=BUFFERED))
        assert h.HasField("request_headers") and not set_headers(h.request_headers.response)  # headers pass
        (b,) = await s.exchange(request_body(raw(chat("buffered")), eos=True))
        common = b.request_body.response
        value = set_headers(common)[pick.DESTINATION]
        assert value == lb_value(b) and common.clear_route_cache
        assert not common.HasField("body_mutation")  # unchanged body: passes as buffered
        (rh,) = await s.exchange(response_headers(served=value.split(",")[0]))
        (rb,) = await s.exchange(response_body(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}', True))
        assert rb.HasField("response_body") and not rb.response_body.response.HasField("body_mutation")
        assert sum(f.in_flight().values()) == 0


async def test_subset_hint_is_honoured_and_nothing_eligible_is_a_503(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        only = f.endpoint(1)
        for _ in range(3):
            s, first, _, _ = await pick_full_duplex(f, raw(chat("subset please")), subset=[only])
            assert set_headers(first.request_headers.response)[pick.DESTINATION] == only
            s.cancel()
        await until(lambda: sum(f.in_flight().values()) == 0, "cancelled streams released")
        for subset in (["10.9.9.9:8000"], []):
            s, first, _, _ = await pick_full_duplex(f, raw(chat("subset please")), subset=subset)
            assert first.immediate_response.status.code == 503
            assert json.loads(first.immediate_response.body)["error"]["code"] == 503


async def test_no_ready_endpoint_is_a_503_and_readiness_is_not_serving(tiny_model_dir):
    async with EppFleet(tiny_model_dir, replica_urls=["http://127.0.0.1:9"]) as f:
        s, first, _, _ = await pick_full_duplex(f, raw(chat("anyone?")))
        assert first.immediate_response.status.code == 503
        err = json.loads(first.immediate_response.body)["error"]
        assert err["type"] == "service_unavailable"
        stub = health_pb2_grpc.HealthStub(f.channel)
        for service, want in (("liveness", health_pb2.HealthCheckResponse.SERVING),
                              ("readiness", health_pb2.HealthCheckResponse.NOT_SERVING),
                              ("envoy.service.ext_proc.v3.ExternalProcessor",
                               health_pb2.HealthCheckResponse.NOT_SERVING)):
            got = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert got.status == want, service


async def test_health_services_serve_when_a_replica_is_routable(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        stub = health_pb2_grpc.HealthStub(f.channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            got = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_client_limit_sheds_with_429_until_the_first_request_ends(tiny_model_dir):
    async with EppFleet(tiny_model_dir, max_concurrent_per_client=1) as f:
        a, first, _, _ = await pick_full_duplex(f, raw(chat("first")))
        assert first.HasField("request_headers")
        b, refused, _, _ = await pick_full_duplex(f, raw(chat("second")))
        assert refused.immediate_response.status.code == 429
        assert json.loads(refused.immediate_response.body)["error"]["type"] == "rate_limit_error"
        await a.exchange(response_headers())
        await a.exchange(response_body(b"{}", eos=True))
        c, again, _, _ = await pick_full_duplex(f, raw(chat("third")))
        assert again.HasField("request_headers")
        c.cancel()


async def test_tenant_salt_is_written_into_the_body_with_its_content_length(tiny_model_dir):
    async with EppFleet(tiny_model_dir, tenants=Tenants({"key-a": None}), replica_api_key="replica-key") as f:
        body = raw(chat("salted"))
        s, first, sent, _ = await pick_full_duplex(f, body, headers={"authorization": "Bearer key-a"})
        forwarded = json.loads(sent)
        assert forwarded["cache_salt"] == derive_salt("key-a")
        headers = set_headers(first.request_headers.response)
        assert headers["content-length"] == str(len(sent))
        assert "authorization" not in headers  # no secret in a header mutation: not the replica's key (issue 40)
        assert not first.request_headers.response.header_mutation.remove_headers  # the client's key goes on
        s.cancel()
        _, refused, _, _ = await pick_full_duplex(f, body, headers={"authorization": "Bearer nope"})
        assert refused.immediate_response.status.code == 401


async def test_vllm_image_uuids_are_written_into_the_body(tiny_vl_dir):
    async with EppFleet(tiny_vl_dir, engine="vllm", events=False) as f:
        msg = {"model": "tiny", "messages": [{"role": "user", "content": [
            image_part(data_uri(image_bytes(seed=3))), {"type": "text", "text": "what is this?"}]}]}
        body = raw(msg)
        s, first, sent, chunks = await pick_full_duplex(f, body)
        forwarded = json.loads(sent)
        uuid = forwarded["messages"][0]["content"][0]["uuid"]
        assert isinstance(uuid, str) and uuid
        assert "uuid" not in json.loads(body)["messages"][0]["content"][0]
        assert set_headers(first.request_headers.response)["content-length"] == str(len(sent))
        assert all(len(c.request_body.response.body_mutation.streamed_response.body) <= pick.BODY_CHUNK_BYTES
                   for c in chunks)
        s.cancel()


async def test_served_endpoint_after_a_gateway_retry_settles_the_load_there(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        for served_in in ("header", "metadata"):
            s, first, _, _ = await pick_full_duplex(f, raw(chat(f"retried via {served_in}")))
            primary, fallback = set_headers(first.request_headers.response)[pick.DESTINATION].split(",")
            retries = f.metric("warmfleet_router_retries_total")
            await s.exchange(response_headers(served=fallback, served_in=served_in))
            assert f.in_flight() == {primary: 0, fallback: 1}
            assert f.queued()[primary] == 0
            assert f.metric("warmfleet_router_retries_total") == retries + 1
            await s.exchange(response_body(b"{}", eos=True))
            assert f.in_flight() == {primary: 0, fallback: 0}
            assert f.queued() == {primary: 0, fallback: 0}


async def test_a_cancelled_stream_leaves_no_in_flight_and_frees_the_client_slot(tiny_model_dir):
    async with EppFleet(tiny_model_dir, max_concurrent_per_client=1) as f:
        s, first, _, _ = await pick_full_duplex(f, raw(chat("cancel me", stream=True)))
        assert sum(f.in_flight().values()) == 1
        await s.exchange(response_headers(content_type="text/event-stream"))
        await s.exchange(response_body(b"data: {}\n\n", eos=False))
        s.cancel()  # Envoy resets the stream mid-answer (client gone)
        await until(lambda: sum(f.in_flight().values()) == 0 and not f.epp.limiter.open, "stream released")
        assert sum(f.queued().values()) == 0
        await until(lambda: f.epp.processor.open_streams == 0, "stream closed")


@pytest.mark.parametrize("bad,status", [(b"{not json", 400), (b"[1, 2]", 400)])
async def test_bad_bodies_get_an_openai_error(tiny_model_dir, bad, status):
    async with EppFleet(tiny_model_dir) as f:
        _, first, _, _ = await pick_full_duplex(f, bad)
        assert first.immediate_response.status.code == status
        err = json.loads(first.immediate_response.body)["error"]
        assert err["code"] == status and err["type"] == "invalid_request_error"
        assert sum(f.in_flight().values()) == 0


async def test_too_large_a_body_is_refused_from_its_declared_length(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        s = f.stream()
        (r,) = await s.exchange(request_headers(headers={"content-length": str(10**10)}))
        assert r.immediate_response.status.code == 413


async def test_other_paths_go_to_the_least_loaded_endpoint_with_the_body_unchanged(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        s = f.stream()
        (r,) = await s.exchange(request_headers("/v1/models", "GET", eos=True))
        value = set_headers(r.request_headers.response)[pick.DESTINATION]
        assert value == lb_value(r) and r.request_headers.response.clear_route_cache
        await s.exchange(response_headers())
        await s.exchange(response_body(b'{"data": []}', eos=True))
        t = f.stream()
        (r,) = await t.exchange(request_headers("/tokenize"))
        assert pick.DESTINATION in set_headers(r.request_headers.response)
        (b,) = await t.exchange(request_body(b'{"prompt": "x"}', eos=True))
        assert b.request_body.response.body_mutation.streamed_response.body == b'{"prompt": "x"}'
        t.cancel()
        await until(lambda: sum(f.in_flight().values()) == 0, "released")


async def test_side_port_serves_replicas_metrics_and_drain(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        base = f"http://127.0.0.1:{f.epp.http_port}"
        async with httpx.AsyncClient(base_url=base) as c:
            view = (await c.get("/v1/router/replicas")).json()
            assert {r["id"] for r in view["replicas"]} == {s.url for s in f.served}
            assert (await c.get("/ready")).status_code == 200
            text = (await c.get("/metrics")).text
            assert "warmfleet_epp_open_streams" in text and "warmfleet_router_decisions_total" in text
            rid = f.served[0].url
            r = await c.post("/v1/router/replicas/" + rid.replace(":", "%3A").replace("/", "%2F") + "/drain")
            assert r.status_code == 200 and r.json()["draining"]
        for _ in range(3):  # a draining replica gets no new pick
            s, first, _, _ = await pick_full_duplex(f, raw(chat("after drain")))
            assert set_headers(first.request_headers.response)[pick.DESTINATION].split(",")[0] == f.endpoint(1)
            s.cancel()


async def test_no_header_mutation_carries_a_key_whoever_checks_keys(tiny_model_dir):
    """The replica key is never in a header mutation (anyone reading the ext_proc stream would read it); the
    client's own authorization passes untouched, for the replica to check again."""
    for tenants in (Tenants({}), Tenants({"key-a": None})):
        async with EppFleet(tiny_model_dir, tenants=tenants, replica_api_key="replica-key") as f:
            for body in (raw(chat("keyed")), None):  # routed by cache, and by load (a body-less GET)
                s = f.stream()
                hdrs = {"authorization": "Bearer key-a"}
                if body is None:
                    first = (await s.exchange(request_headers("/v1/models", "GET", eos=True, headers=hdrs)))[0]
                else:
                    s, first, _, _ = await pick_full_duplex(f, body, headers=hdrs)
                mutation = first.request_headers.response.header_mutation
                assert "authorization" not in set_headers(first.request_headers.response)
                assert "replica-key" not in str(first)
                assert not mutation.remove_headers
                s.cancel()


async def test_a_request_id_is_made_when_absent_and_returned_with_the_answer(tiny_model_dir):
    async with EppFleet(tiny_model_dir) as f:
        s, first, _, _ = await pick_full_duplex(f, raw(chat("which id?")))
        made = set_headers(first.request_headers.response)["x-request-id"]
        assert len(made) == 32
        answer = (await s.exchange(response_headers()))[0]
        assert set_headers(answer.response_headers.response)["x-request-id"] == made
        s.cancel()
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        s, first, _, _ = await pick_full_duplex(f, raw(chat("which id?")), headers={
            "x-request-id": "client-id-1", "traceparent": trace, "tracestate": "vendor=1"})
        mutation = first.request_headers.response.header_mutation
        assert "x-request-id" not in set_headers(first.request_headers.response)  # the client's goes on as it is
        assert not {"traceparent", "tracestate"} & ({h.header.key for h in mutation.set_headers} |
                                                    set(mutation.remove_headers))
        answer = (await s.exchange(response_headers()))[0]
        assert set_headers(answer.response_headers.response)["x-request-id"] == "client-id-1"
        s.cancel()
        s, first, _, _ = await pick_full_duplex(f, raw(chat("which id?")), headers={"x-request-id": "bad id\x01"})
        replaced = set_headers(first.request_headers.response)["x-request-id"]  # not a usable token: replaced
        assert replaced != "bad id\x01" and len(replaced) == 32
        s.cancel()
        refused = (await f.stream().exchange(request_headers(headers={
            "content-length": str(1 << 40), "x-request-id": "too-big"})))[0]
        assert refused.immediate_response.status.code == 413
        assert any(h.header.key == "x-request-id" and h.header.raw_value == b"too-big"
                   for h in refused.immediate_response.headers.set_headers)


async def test_an_adapter_request_goes_only_where_the_adapter_is_served_and_books_it_there(tiny_model_dir):
    from warmfleet.server.hashing import AdapterId

    async with EppFleet(tiny_model_dir) as f:
        url = f.served[1].url
        f.fleet.adapters.learn_served(url, {"sql": AdapterId("sql", "d-sql")})  # as its /v1/models would list it
        s, first, _, _ = await pick_full_duplex(f, raw({**chat("adapter question", stream=True), "model": "sql"}))
        assert set_headers(first.request_headers.response)[pick.DESTINATION] == f.endpoint(1)  # no fallback: 404
        assert f.fleet.adapters.replicas[url].in_flight == {"sql": 1} and f.fleet.adapters.resident(url, "sql")
        s.cancel()
        await until(lambda: sum(f.in_flight().values()) == 0, "stream released")
        assert f.fleet.adapters.replicas[url].in_flight == {}


async def test_requests_over_the_replicas_limits_get_their_400_before_any_pick(tiny_model_dir):
    """Issue 40: `warmfleet epp --max-choices-per-request/--limit-mm-per-prompt` refuse as the proxy door does, with
    the replicas' own 400 as an immediate response, before the router renders, picks or books anything."""
    from warmfleet.server.api.errors import APIError
    from warmfleet.server.api.limits import check_fanout
    async with EppFleet(tiny_model_dir, settings={"max_choices_per_request": 8,
                                                  "limit_mm_per_prompt": '{"image": 2}'}) as f:
        routed = []
        router = f.epp.door.router

        async def counting(kind, body, eligible=None):
            routed.append(body)
            return await real_route(kind, body, eligible)

        real_route = router.route
        router.route = counting
        with pytest.raises(APIError) as replica:  # the very answer a replica with the same limit gives
            check_fanout(5, 2, 8)
        s = f.stream()
        await s.send(request_headers(path="/v1/completions"))
        await s.send(request_body(raw({"model": "tiny", "prompt": ["hi"] * 5, "n": 2}), eos=True))
        first = await s.recv()
        assert first.immediate_response.status.code == 400
        assert json.loads(first.immediate_response.body)["error"] == {
            "message": replica.value.message, "type": "invalid_request_error", "param": "prompt",
            "code": "too_many_choices"}
        _, over_n, _, _ = await pick_full_duplex(f, raw(chat("many samples", n=9)))
        assert over_n.immediate_response.status.code == 400
        assert json.loads(over_n.immediate_response.body)["error"]["param"] == "n"
        image = {"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png"}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                                           image, image, image]}]}
        _, over_images, _, _ = await pick_full_duplex(f, raw(body))
        assert over_images.immediate_response.status.code == 400
        err = json.loads(over_images.immediate_response.body)["error"]
        assert err["code"] == "invalid_image" and err["param"] == "messages.0.content.3"
        assert routed == [] and sum(f.in_flight().values()) == 0 and not f.epp.limiter.open
        ok, at_limit, _, _ = await pick_full_duplex(f, raw(chat("just enough", n=8)))
        assert at_limit.HasField("request_headers") and len(routed) == 1  # at the limit: picked
        ok.cancel()


async def test_a_vllm_picker_picks_what_vllm_accepts(tiny_vl_dir):
    """The picker's limits follow the engine it fronts: 20 images and n=300 are vLLM 0.32's to take (999 items per
    modality, no prompts x n cap), so they are picked, not refused with warmfleet's limits (16 images, 256)."""
    part = image_part(data_uri(image_bytes(seed=5)))
    msg = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}] + [part] * 20}]}
    async with EppFleet(tiny_vl_dir, engine="vllm", events=False) as f:
        for body in (msg, {**msg, "n": 300}):
            s, first, _, _ = await pick_full_duplex(f, raw(body))
            assert first.HasField("request_headers"), first
            s.cancel()
