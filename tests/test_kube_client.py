"""The shared Kubernetes client (warmfleet.kube) against kmock: credentials refreshed after a 401 and when due,
a conflict logged then forced, no write when the intent is unchanged, errors with the server's message."""

from __future__ import annotations

import logging

import kmock as kmock_lib  # the module; `kmock` is kmock's pytest fixture (a server)
import kopf
import pytest

from operator_fixtures.kmock_apply import FakeApplyEmulator
from warmfleet import kube as k
from warmfleet.kube import APPLIED_DIGEST_ANNOTATION, Kube, KubeError

CM_PATH = "/api/v1/namespaces/default/configmaps/cm"
RESOURCES = {"ConfigMap": ("v1", "configmaps")}


def cm(**data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "default"}, "data": data}


class FakeLogin:
    """kopf's login handler as the client sees it: hands out the next token on each call."""

    def __init__(self, server: str, *tokens: str):
        self.server, self.tokens, self.calls = server, list(tokens), 0

    async def __call__(self) -> kopf.ConnectionInfo:
        token = self.tokens[min(self.calls, len(self.tokens) - 1)]
        self.calls += 1
        return kopf.ConnectionInfo(server=self.server, token=token)


def auth(request: kmock_lib.Request) -> str | None:
    return {k.lower(): v for k, v in request.headers.items()}.get("authorization")


@pytest.mark.kmock(cls=kmock_lib.RawHandler)  # scripted answers only, no emulated objects
async def test_a_401_logs_in_again_and_retries_once_with_the_new_token(kmock):
    kmock[f"get {CM_PATH}"][kmock_lib.headers(Authorization="Bearer old")] << kmock_response(401, "token expired")
    kmock[f"get {CM_PATH}"][kmock_lib.headers(Authorization="Bearer new")] << {"metadata": {"name": "cm"}}
    login = FakeLogin(str(kmock.url), "new")
    kube = Kube.from_connection(kopf.ConnectionInfo(server=str(kmock.url), token="old"), RESOURCES,
                                field_manager="test", login=login)
    try:
        assert await kube.get("ConfigMap", "default", "cm") == {"metadata": {"name": "cm"}}
    finally:
        await kube.close()
    assert login.calls == 1
    assert [auth(r) for r in kmock] == ["Bearer old", "Bearer new"]


@pytest.mark.kmock(cls=kmock_lib.RawHandler)  # scripted answers only, no emulated objects
async def test_credentials_are_read_again_when_due_without_waiting_for_a_401(kmock, monkeypatch):
    kmock[f"get {CM_PATH}"] << {"metadata": {"name": "cm"}}
    login = FakeLogin(str(kmock.url), "rotated")
    kube = Kube.from_connection(kopf.ConnectionInfo(server=str(kmock.url), token="first"), RESOURCES,
                                field_manager="test", login=login)
    try:
        await kube.get("ConfigMap", "default", "cm")
        monkeypatch.setattr(k.time, "monotonic", lambda: 1e12)  # REFRESH_S later (far later)
        await kube.get("ConfigMap", "default", "cm")
    finally:
        await kube.close()
    assert [auth(r) for r in kmock] == ["Bearer first", "Bearer rotated"] and login.calls == 1


@pytest.mark.kmock(cls=kmock_lib.RawHandler)  # scripted answers only, no emulated objects
async def test_a_401_without_a_login_is_an_error_with_the_servers_message(kmock):
    kmock[f"get {CM_PATH}"] << kmock_response(401, "token expired")
    kube = Kube.from_connection(kopf.ConnectionInfo(server=str(kmock.url), token="old"), RESOURCES, field_manager="test")
    try:
        with pytest.raises(KubeError) as err:
            await kube.get("ConfigMap", "default", "cm")
    finally:
        await kube.close()
    assert err.value.status == 401 and "token expired" in str(err.value)


@pytest.mark.kmock(cls=kmock_lib.RawHandler)  # scripted answers only, no emulated objects
async def test_a_conflict_is_logged_then_the_fields_are_taken_over(kmock, caplog):
    kmock[f"get {CM_PATH}"] << {**cm(a="theirs"), "metadata": {"name": "cm", "namespace": "default"}}
    kmock[f"patch {CM_PATH}"][kmock_lib.params(force="false")] << kmock_response(
        409, 'Apply failed with 1 conflict: conflict with "kubectl-edit" using v1: .data.a')
    kmock[f"patch {CM_PATH}"][kmock_lib.params(force="true")] << cm(a="1")
    kube = Kube.from_connection(kopf.ConnectionInfo(server=str(kmock.url)), RESOURCES, field_manager="test")
    caplog.set_level(logging.WARNING, logger="warmfleet.kube")
    try:
        live, action = await kube.apply(cm(a="1"))
    finally:
        await kube.close()
    patches = [r for r in kmock if r.method == kmock_lib.method.PATCH]
    assert [(r.params["fieldManager"], r.params["force"]) for r in patches] == [("test", "false"), ("test", "true")]
    assert all(r.headers["Content-Type"] == "application/apply-patch+yaml" for r in patches)
    assert action == "patched" and live["data"] == {"a": "1"}
    assert any('conflict with "kubectl-edit"' in r.getMessage() and "taking these fields over" in r.getMessage()
               for r in caplog.records)


@pytest.fixture()
async def emulator():
    async with FakeApplyEmulator() as emu, kmock_lib.Server(emu):
        emu.resources["v1/configmaps"] = kmock_lib.ResourceInfo(kind="ConfigMap", namespaced=True,
                                                                verbs={"get", "list", "watch", "patch", "delete"})
        yield emu


async def test_apply_writes_only_a_changed_intent_and_drops_what_it_no_longer_sets(emulator):
    kube = Kube.from_connection(kopf.ConnectionInfo(server=str(emulator.url)), RESOURCES, field_manager="test")
    try:
        assert (await kube.apply(cm(a="1", b="2")))[1] == "created"
        assert (await kube.apply(cm(a="1", b="2")))[1] == "unchanged"
        assert emulator.applies == 1
        # someone else changed a field we set: applied again, though our intent did not change
        await emulator.patch(CM_PATH, json={"data": {"a": "edited"}})
        assert (await kube.apply(cm(a="1", b="2")))[1] == "patched"
        live, action = await kube.apply(cm(a="1"))
        assert action == "patched" and live["data"] == {"a": "1"} and emulator.applies == 3
        stored = emulator.objects["v1/configmaps", "default", "cm"].raw
        assert stored["data"] == {"a": "1"}
        assert stored["metadata"]["annotations"][APPLIED_DIGEST_ANNOTATION] == k.with_digest(cm(a="1"))[1]
    finally:
        await kube.close()


def test_the_digest_ignores_its_own_annotation_and_sees_every_other_field():
    intent, digest = k.with_digest(cm(a="1"))
    assert k.with_digest(intent) == (intent, digest)  # applying the annotated intent again: same digest
    assert k.with_digest(cm(a="2"))[1] != digest
    assert k.with_digest({**cm(a="1"), "metadata": {**cm()["metadata"], "annotations": {"x": "y"}}})[1] != digest



def kmock_response(status: int, message: str) -> kmock_lib.Response:
    return kmock_lib.Response(status=status, payload={"kind": "Status", "status": "Failure", "message": message,
                                                  "code": status}, headers={"Content-Type": "application/json"})
