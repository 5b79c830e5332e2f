"""Operator under faults, kopf in-process against kmock: API errors for a while, children deleted or hand-edited,
the operator killed mid-reconcile and restarted, two operator replicas at once (then one of them removed). Each
converges with no duplicates.

The emulator is tests/operator_fixtures' server-side-apply kmock plus scripted faults on the
operator's writes to children (`FakeFaultyEmulator`): a queue of error statuses answered one per
write, and a gate that holds writes unanswered (an API server that stops answering; the operator
is killed while waiting on it). Behaviour is checked through the objects and status only, so the
tests hold whatever client the operator uses underneath.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncContextManager

import aiohttp.web
import attrs
import kmock
import pytest

from operator_fixtures.cluster import DEPLOY, ISVC, condition, declare, obj, seed, server_deployments, status
from operator_fixtures.kmock_apply import FakeApplyEmulator, FakeVersionedEmulator
from operator_fixtures.running import InProcessOperator, make_operator_registry, run_operator
from operator_fixtures.shapes import h200, l4, service
from waiting import poll

STOP_S = 60  # bounds a start or a stop (a stop takes ~2 s: kopf gives busy workers 2 s to finish their queues)
RETRY_WAIT_S = 60  # the operator retries a failed write after 5 s (kopf.TemporaryError); a busy host is slow
CHILDREN = [("v1/services", "qwen"), ("v1/services", "qwen-replicas"), ("v1/configmaps", "qwen-config"),
            ("policy/v1/poddisruptionbudgets", "qwen-server"), (DEPLOY, "qwen-router")]


@attrs.define(kw_only=True)
class FakeFaultyEmulator(FakeVersionedEmulator):
    """Server-side-apply kmock whose child writes can fail (`fail_with` statuses, one per write) or hang (`hold`).

    Versioned (resourceVersion bumped on each InferenceService patch): two replicas write the service in turn,
    and with a constant resourceVersion each one would run its handlers again for every queued event of those
    writes, each with a stale last-handled configuration (a backlog that grows faster than a busy host clears it).
    """

    fail_with: list[int] = attrs.field(factory=list, init=False)
    failed: list[int] = attrs.field(factory=list, init=False)
    hold: asyncio.Event | None = attrs.field(default=None, init=False)  # set: writes pass; clear: writes wait
    held: int = attrs.field(default=0, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        path = str(request.url.path) if hasattr(request, "url") else ""
        is_child_write = (request.method in (kmock.method.PATCH, kmock.method.POST, kmock.method.PUT, kmock.method.DELETE)
                          and "/inferenceservices" not in path and "/events" not in path and "/nodes" not in path)
        if is_child_write and self.hold is not None and not self.hold.is_set():
            self.held += 1
            await self.hold.wait()
        if is_child_write and self.fail_with:
            code = self.fail_with.pop(0)
            self.failed.append(code)
            reason = {409: "Conflict", 500: "InternalError", 504: "Timeout"}.get(code, "InternalError")
            return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                              "reason": reason, "message": f"scripted {reason}"}, status=code)
        return await super()._handle(request)


def operator(cluster: kmock.KubernetesEmulator) -> AsyncContextManager[InProcessOperator]:
    """Run the operator in-process until the block ends (tests/test_operator_kmock.py's, with wider bounds)."""
    return run_operator(cluster, STOP_S)


@pytest.fixture()
async def cluster():
    async with FakeFaultyEmulator() as emulator, kmock.Server(emulator):
        yield declare(emulator)


def converged(cluster, n_pools: int) -> bool:
    return (condition(cluster, "InvalidSpec").get("status") == "False" and len(server_deployments(cluster)) == n_pools
            and all(obj(cluster, res, name) is not None for res, name in CHILDREN))


def assert_no_duplicates(cluster) -> None:
    """Exactly one server Deployment per pool in status, and every child owned by the one service."""
    pools = status(cluster)["pools"]
    deps = server_deployments(cluster)
    assert len(deps) == len(pools), (sorted(deps), pools)
    for res, name in CHILDREN:
        assert obj(cluster, res, name)["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"


async def test_api_server_errors_for_a_while_then_converges(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 3}), res=ISVC)
    cluster.fail_with = [500, 409, 504]  # three writes fail in a row, each a failed pass and a retry
    async with operator(cluster):
        await eventually_for(lambda: converged(cluster, 2), "children and status after the errors", RETRY_WAIT_S)
    assert cluster.failed == [500, 409, 504]
    assert_no_duplicates(cluster)
    assert sum(d["spec"]["replicas"] for d in server_deployments(cluster).values()) == 3


async def test_child_deleted_or_hand_edited_is_restored(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 2}), res=ISVC)
    async with operator(cluster):
        await eventually_for(lambda: converged(cluster, 1), "first reconcile", RETRY_WAIT_S)
        (name,) = server_deployments(cluster)
        image = server_deployments(cluster)[name]["spec"]["template"]["spec"]["containers"][0]["image"]
        path = "/apis/apps/v1/namespaces/default/deployments/"
        # someone scales and re-images the server Deployment by hand: the operator's intent is applied again
        await cluster.patch(path + name, json={"spec": {"replicas": 7, "template": {"spec": {"containers": [
            {"name": "server", "image": "evil:latest"}]}}}})
        await eventually_for(lambda: server_deployments(cluster)[name]["spec"]["replicas"] == 2
                             and server_deployments(cluster)[name]["spec"]["template"]["spec"]["containers"][0]["image"] == image,
                             "hand edit reverted", RETRY_WAIT_S)
        # someone deletes the router Deployment: it comes back
        await cluster.delete(path + "qwen-router")
        await eventually_for(lambda: obj(cluster, DEPLOY, "qwen-router") is not None, "router Deployment recreated",
                             RETRY_WAIT_S)
    assert_no_duplicates(cluster)


async def test_killed_mid_reconcile_then_restarted_converges(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 3}), res=ISVC)
    cluster.hold = asyncio.Event()  # the API server stops answering writes
    killed = InProcessOperator(make_operator_registry(cluster))
    await killed.start(STOP_S)
    await eventually_for(lambda: cluster.held > 0, "the operator waiting on a write", RETRY_WAIT_S)
    await killed.kill(STOP_S)  # killed mid-reconcile: no cleanup, no status written; it ends however it ends
    cluster.hold.set()  # the API server answers again (the killed operator's held write may still land)
    async with operator(cluster):  # the replacement resumes and finishes the job
        await eventually_for(lambda: converged(cluster, 2), "converged after the restart", RETRY_WAIT_S)
    assert_no_duplicates(cluster)
    assert status(cluster)["observedGeneration"] == 1


async def test_two_operator_replicas_at_once_converge_without_duplicates(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 3}), res=ISVC)
    path = f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen"
    async with operator(cluster):
        async with operator(cluster):  # started by mistake: both standalone, both reconcile
            await eventually_for(lambda: converged(cluster, 2), "converged with two operators", RETRY_WAIT_S)
            await cluster.patch(path, json={"metadata": {"generation": 2}, "spec": {"replicas": 5}})
            await eventually_for(lambda: status(cluster).get("observedGeneration") == 2
                                 and sum(d["spec"]["replicas"] for d in server_deployments(cluster).values()) == 5,
                                 "the update applied once", RETRY_WAIT_S)
        assert_no_duplicates(cluster)
        assert status(cluster)["desiredReplicas"] == 5
        # one replica is removed: the other one still watches and reconciles on its own
        await cluster.patch(path, json={"metadata": {"generation": 3}, "spec": {"replicas": 4}})
        await eventually_for(lambda: status(cluster).get("observedGeneration") == 3
                             and sum(d["spec"]["replicas"] for d in server_deployments(cluster).values()) == 4,
                             "the next update applied by the remaining replica", RETRY_WAIT_S)
    assert_no_duplicates(cluster)
    assert status(cluster)["desiredReplicas"] == 4


async def test_stopping_an_operator_cancels_no_task_it_does_not_own(cluster):
    """kopf.operator() cancels, as it exits, every task of its event loop created since it started (it takes them
    for its own): run in the tests' loop, it cancelled the emulator's request handlers and the other replica's
    watchers. The harness runs each operator on a loop of its own, as production does."""
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1}), res=ISVC)
    async with operator(cluster):
        bystander = asyncio.create_task(asyncio.Event().wait(), name="bystander")  # a task of the test, not of kopf
        await eventually_for(lambda: converged(cluster, 1), "reconciled", RETRY_WAIT_S)
    try:
        assert not bystander.done(), "the operator's stop cancelled a task of the test's event loop"
    finally:
        bystander.cancel()


async def eventually_for(check, what: str, timeout_s: float) -> Any:
    """`eventually` with a longer bound (the operator's retry delay is part of the path)."""
    value = await poll(check, timeout_s, 0.05)
    if value:
        return value
    present = sorted(f"{res.plural}/{name}" for (res, ns, name), o in cluster_of(check).objects.items() if not o.deleted) \
        if cluster_of(check) is not None else "?"
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; objects: {present}")


def cluster_of(check) -> Any:
    """The emulator a check closes over (for the failure message)."""
    for cell in getattr(check, "__closure__", None) or ():
        if isinstance(cell.cell_contents, FakeApplyEmulator):
            return cell.cell_contents
    return None
