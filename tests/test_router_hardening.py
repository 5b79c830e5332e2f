"""Router-side hardening (issue 40): fan-out and image counts refused before forwarding, bounded retries of a request
that may have killed its replica, never a retry on a 4xx."""

from __future__ import annotations

import asyncio
import json
import threading
from urllib.parse import quote

import httpx
import pytest

from router_fakes import FakeSharedFailures, Fleet2, chat
from warmfleet.server.api.limits import check_fanout
from waiting import until
from test_hardening_deadlines import assert_408, trickle
from warmfleet.server.api.errors import APIError
from warmfleet.server.router.core.tenants import Tenants
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes


def received(f: Fleet2) -> int:
    """Client requests the fake replicas received (warm-up replays are prompt-id completions)."""
    return sum(1 for x in f.replicas for b in x.received if "messages" in b or isinstance(b.get("prompt"), str)
               or (isinstance(b.get("prompt"), list) and b["prompt"] and isinstance(b["prompt"][0], str)))


@pytest.mark.parametrize("protocol", ["hot", "asgi"])
async def test_prompts_times_n_over_the_limit_is_the_replicas_400_before_forwarding(tiny_model_dir, protocol):
    async with Fleet2(tiny_model_dir, protocol=protocol, max_choices_per_request=8) as f:
        r = await f.client.post("/v1/completions", json={"model": "tiny", "prompt": ["hi"] * 5, "n": 2})
        assert r.status_code == 400, r.text
        try:  # the very answer a replica with the same limit gives
            check_fanout(5, 2, 8)
        except APIError as exc:
            assert r.json()["error"] == {"message": exc.message, "type": "invalid_request_error", "param": "prompt",
                                         "code": "too_many_choices"}
        r = await f.client.post("/v1/chat/completions", json=chat("many samples", n=9))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert received(f) == 0 and f.metric("warmfleet_router_requests_total", status="4xx") == 2
        r = await f.client.post("/v1/completions", json={"model": "tiny", "prompt": ["hi"] * 4, "n": 2})
        assert r.status_code == 200 and received(f) == 1  # at the limit: forwarded


def test_the_routers_default_limits_are_the_engines_it_fronts():
    """warmfleet: its replicas' defaults; vLLM 0.32: no prompts x n cap, 999 items per modality; FastDeploy: none."""
    from warmfleet.server.config import EngineConfig, ServerConfig
    from warmfleet.server.router.core.settings import RouterSettings

    s = RouterSettings()
    assert s.choice_limit == EngineConfig().scheduler.choice_limit == 256
    assert s.image_limit == ServerConfig().mm_limits()["image"] == 16
    vllm = RouterSettings(engine="vllm")
    assert (vllm.choice_limit, vllm.image_limit) == (None, 999)
    assert (RouterSettings(engine="fastdeploy").choice_limit, RouterSettings(engine="fastdeploy").image_limit) == (None, None)
    # an explicit flag wins over the engine's default, in vLLM's forms too (a count or {"count": ...})
    given = RouterSettings(engine="vllm", max_choices_per_request=3, limit_mm_per_prompt='{"image": {"count": 5}}')
    assert (given.choice_limit, given.image_limit) == (3, 5)
    assert RouterSettings(engine="vllm", limit_mm_per_prompt='{"video": 1}').image_limit == 999  # vLLM: unnamed = 999
    assert RouterSettings(limit_mm_per_prompt='{"image": 40}').image_limit == 40


def images(count: int) -> dict:
    """A chat body with `count` image parts (data URIs: nothing to fetch)."""
    part = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(seed=1))}}
    return {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}] + [part] * count}]}


async def test_a_vllm_router_forwards_what_vllm_accepts_and_warmfleet_still_refuses_by_default(tiny_vl_dir):
    """The router's limits follow the engine it fronts: 20 images go through to vLLM replicas (vLLM takes 999 by
    default), n=300 too (vLLM has no prompts x n cap), where warmfleet's replicas refuse 17 images and n=257."""
    async with Fleet2(tiny_vl_dir, engine="vllm", events=False) as f:
        r = await f.client.post("/v1/chat/completions", json=images(20))
        assert r.status_code == 200, r.text
        r = await f.client.post("/v1/chat/completions", json={**chat("many samples"), "n": 300})
        assert r.status_code == 200, r.text
        assert received(f) == 2
    async with Fleet2(tiny_vl_dir, engine="vllm", events=False, limit_mm_per_prompt='{"image": 4}') as f:
        r = await f.client.post("/v1/chat/completions", json=images(5))  # an explicit flag wins
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image" and received(f) == 0
    async with Fleet2(tiny_vl_dir) as f:
        r = await f.client.post("/v1/chat/completions", json=images(17))
        assert r.status_code == 400 and "17 images, more than the limit of 16" in r.json()["error"]["message"]
        r = await f.client.post("/v1/chat/completions", json={**chat("many samples"), "n": 257})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices"
        assert received(f) == 0
    async with Fleet2(tiny_vl_dir, limit_mm_per_prompt='{"image": 20}', max_choices_per_request=300) as f:
        r = await f.client.post("/v1/chat/completions", json=images(17))  # replicas given more: the flags say so
        assert r.status_code == 200, r.text


async def test_more_images_than_the_limit_is_400_before_any_is_read(tiny_model_dir):
    async with Fleet2(tiny_model_dir, limit_mm_per_prompt='{"image": 2}') as f:
        router = f.app.state.router
        rendered = []
        real = router.render_off_loop

        async def counting(kind, body):
            rendered.append(body)
            return await real(kind, body)

        router.render_off_loop = counting
        image = {"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png"}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                                           image, image, image]}]}
        r = await f.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_image" and err["param"] == "messages.0.content.3"
        assert "3 images, more than the limit of 2" in err["message"] and "--limit-mm-per-prompt" in err["message"]
        assert rendered == [] and received(f) == 0


async def test_a_request_that_resets_its_replica_is_retried_once_on_another(tiny_model_dir):
    """A replica that dies mid-request (the connection reset after the request went out) may have died of the
    request itself: it goes to one more replica at most, never to every replica of the fleet."""
    async with Fleet2(tiny_model_dir, num_replicas=3, failures=FakeSharedFailures(3, "reset")) as f:
        r = await f.client.post("/v1/chat/completions", json=chat("a poison request"))
        assert r.status_code == 502, r.text
        assert received(f) == 2 and f.metric("warmfleet_router_retries_total") == 1
        assert all((x.in_flight, x.queued_tokens) == (0, 0) for x in f.fleet.registry.replicas.values())


async def test_a_4xx_is_relayed_never_retried(tiny_model_dir):
    async with Fleet2(tiny_model_dir, num_replicas=3, failures=FakeSharedFailures(1, "400")) as f:
        r = await f.client.post("/v1/chat/completions", json=chat("a bad request"))
        assert r.status_code == 400 and received(f) == 1 and f.metric("warmfleet_router_retries_total") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])  # the hot path and the ASGI app
async def test_a_body_sent_one_byte_per_5_s_to_the_router_is_cut_off(tiny_model_dir, path):
    async with Fleet2(tiny_model_dir, request_body_timeout_s=1.0) as f:
        body = json.dumps(chat("trickled")).encode()
        head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        assert_408(await trickle(f.router.port, head + body[:1], body[1:]), "body")
        assert received(f) == 0
        r = await f.client.post("/v1/chat/completions", json=chat("on time"))  # others are served meanwhile
        assert r.status_code == 200


async def test_router_headers_sent_one_byte_per_5_s_are_cut_off(tiny_model_dir):
    async with Fleet2(tiny_model_dir, request_header_timeout_s=1.0) as f:
        assert_408(await trickle(f.router.port, b"P", b"OST /v1/chat/completions HTTP/1.1\r\n"), "head")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("forwarded_for", [False, True])  # the hot path, and the ASGI app (behind a proxy)
async def test_a_client_leaving_a_request_closes_it_on_the_replica(tiny_model_dir, stream, forwarded_for):
    """The router closes its upstream request when its client leaves, so the replica aborts the generation (the
    replica's side: api/completions.until_disconnect); streamed or not."""
    async with Fleet2(tiny_model_dir, failures=FakeSharedFailures(1, "wait"), health_interval_s=60) as f:
        body = json.dumps(chat("a long answer", stream=stream)).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", f.router.port)
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      f"{'x-forwarded-for: 10.1.2.3' + chr(13) + chr(10) if forwarded_for else ''}"
                      f"content-length: {len(body)}\r\n\r\n").encode() + body)
        await until(lambda: received(f) == 1, "the request reaching a replica")
        writer.close()  # the client leaves before any answer
        await until(lambda: sum(x.client_left for x in f.replicas) == 1, "the replica seeing its client leave")
        await until(lambda: all(x.in_flight == 0 for x in f.fleet.registry.replicas.values()), "the booking's end")
        assert received(f) == 1 and f.metric("warmfleet_router_retries_total") == 0


class FakeSlowTextRenderer:
    """The real renderer, except that a prompt over 1 MB waits for `release` (a huge whitespace-free prompt being
    tokenized); a render on the event loop would hold every other request for as long."""

    def __init__(self, real):
        self.real, self.release, self.started = real, threading.Event(), threading.Event()
        self.finished: list[str] = []  # the order renders ended in: "huge" or "small"

    def _wait_if_huge(self, size: int) -> None:
        if size > 1 << 20:
            self.started.set()
            assert self.release.wait(10), "never released"

    def completion(self, body):
        self._wait_if_huge(len(body["prompt"]))
        out = self.real.completion(body)
        self.finished.append("huge" if len(body["prompt"]) > 1 << 20 else "small")
        return out

    def chat(self, body):
        size = sum(len(m["content"]) for m in body["messages"])
        self._wait_if_huge(size)
        out = self.real.chat(body)
        self.finished.append("huge" if size > 1 << 20 else "small")
        return out


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_a_huge_prompt_being_tokenized_does_not_hold_other_requests(tiny_model_dir, kind):
    async with Fleet2(tiny_model_dir) as f:
        router = f.app.state.router
        router.renderer = slow = FakeSlowTextRenderer(router.renderer)
        huge = "x" * (2 << 20)  # no whitespace: one pre-token of 2 MB
        path, body = (("/v1/completions", {"model": "tiny", "prompt": huge, "max_tokens": 1}) if kind == "completion"
                      else ("/v1/chat/completions", chat(huge)))
        held = asyncio.create_task(f.client.post(path, content=json.dumps(body), timeout=120,  # 2 MB to tokenize
                                                 headers={"content-type": "application/json"}))
        await until(slow.started.is_set, "the huge prompt's tokenization")
        r = await f.client.post("/v1/chat/completions", json=chat("a small question meanwhile"))
        assert r.status_code == 200 and not held.done() and slow.finished == ["small"]
        slow.release.set()
        assert (await held).status_code == 200 and slow.finished == ["small", "huge"]


def remote_client(f: Fleet2, host: str = "10.0.0.9") -> httpx.AsyncClient:
    """A client of the router's app from another host (the app served in-process, `host` as the peer address)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(f.app, client=(host, 40000)), base_url="http://router")


async def test_without_an_admin_key_admin_routes_answer_only_on_the_routers_own_host(tiny_model_dir):
    async with Fleet2(tiny_model_dir) as f:
        victim = quote(f.served[0].url, safe="")
        async with remote_client(f) as remote:
            r = await remote.post(f"/v1/router/replicas/{victim}/drain")
            assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
            assert (await remote.get("/v1/router/peer-load")).status_code == 403
            view = await remote.get("/v1/router/replicas")  # reduced to what is safe to publish
            assert view.status_code == 200 and view.json()["states"] == {"ready": 2} and view.json()["redacted"]
            assert all(s.url.split("//")[1] not in view.text for s in f.served) and "127.0.0.1" not in view.text
        forwarded = {"x-forwarded-for": "10.0.0.9"}  # a local proxy speaking for a remote client
        assert (await f.client.post(f"/v1/router/replicas/{victim}/drain", headers=forwarded)).status_code == 403
        assert not f.fleet.registry.get(f.served[0].url).draining
        full = (await f.client.get("/v1/router/replicas")).json()  # from the router's host: the full view
        assert {x["id"] for x in full["replicas"]} == {s.url for s in f.served}
        assert (await f.client.post(f"/v1/router/replicas/{victim}/drain")).status_code == 200
        assert (await f.client.get("/v1/router/peer-load")).status_code == 200


async def test_a_client_key_holder_is_refused_on_admin_routes(tiny_model_dir):
    async with Fleet2(tiny_model_dir, tenants=Tenants({"client-key": None}), admin_key="adm") as f:
        victim = quote(f.served[0].url, safe="")
        client, admin = {"authorization": "Bearer client-key"}, {"authorization": "Bearer adm"}
        for c in (f.client, remote_client(f)):  # the admin key is needed from the router's host too
            for route in (c.post(f"/v1/router/replicas/{victim}/drain", headers=client),
                          c.delete(f"/v1/router/replicas/{victim}/drain", headers=client),
                          c.get("/v1/router/peer-load", headers=client)):
                r = await route
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            view = (await c.get("/v1/router/replicas", headers=client)).json()
            assert view["redacted"] and view["replicas"] == []
            full = (await c.get("/v1/router/replicas", headers=admin)).json()
            assert {x["id"] for x in full["replicas"]} == {s.url for s in f.served}
        assert not f.fleet.registry.get(f.served[0].url).draining
        assert (await f.client.post(f"/v1/router/replicas/{victim}/drain", headers=admin)).status_code == 200
        r = await f.client.post("/v1/chat/completions", json=chat("still served"), headers=client)
        assert r.status_code == 200


def test_client_digests_on_the_wire_are_keyed_with_the_admin_key():
    from warmfleet.server.router.core.peers import PeerLoad, client_digest

    plain, keyed = client_digest("key:client-key"), client_digest("key:client-key", b"adm")
    assert plain != keyed and keyed == client_digest("key:client-key", b"adm") != client_digest("key:client-key", b"x")
    report = PeerLoad(["http://b"], digest_key=b"adm").local_report([], {"key:client-key": 2})
    assert report["clients"] == {keyed: 2}


async def test_a_keyless_router_checking_api_keys_shows_the_full_view_only_on_its_own_host(tiny_model_dir):
    async with Fleet2(tiny_model_dir, tenants=Tenants({"client-key": None})) as f:
        client = {"authorization": "Bearer client-key"}
        full = (await f.client.get("/v1/router/replicas", headers=client)).json()
        assert {x["id"] for x in full["replicas"]} == {s.url for s in f.served}
        async with remote_client(f) as remote:
            assert (await remote.get("/v1/router/replicas", headers=client)).json()["redacted"]
        victim = quote(f.served[0].url, safe="")  # tenants' keys never drain replicas, not even from the host
        assert (await f.client.post(f"/v1/router/replicas/{victim}/drain", headers=client)).status_code == 403
