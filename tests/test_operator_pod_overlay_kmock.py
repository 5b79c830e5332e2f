"""spec.server.pod with kopf in-process against kmock (server-side apply emulated): what kubectl sets on a field the
operator does not own survives its next apply; an overlay entry taken out of the spec leaves the pods."""

from __future__ import annotations

from operator_fixtures.cluster import ISVC, condition, eventually, operator, seed, server_deployments, status
from operator_fixtures.shapes import h200, service

TAINT = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
ENGINE = {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"}
SERVICE_URL = f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen"


def template(cluster) -> dict:
    (dep,) = server_deployments(cluster).values()
    return dep["spec"]["template"]


def env_names(cluster) -> list[str]:
    return [e["name"] for e in template(cluster)["spec"]["containers"][0]["env"]]


async def test_kubectl_edits_of_fields_the_operator_does_not_own_survive_and_dropped_overlays_leave(cluster):
    seed(cluster, h200("h1"))
    overlay = {"tolerations": [TAINT], "env": [{"name": "HF_ENDPOINT", "value": "https://mirror.example.com"}]}
    seed(cluster, service(spec={"replicas": 1, "engine": ENGINE, "server": {"pod": overlay}}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: server_deployments(cluster) and "HF_ENDPOINT" in env_names(cluster), "the overlay applied")
        assert template(cluster)["spec"]["tolerations"][-1] == TAINT
        (name,) = server_deployments(cluster)
        # kubectl (another manager) sets what the operator never applies: a priorityClass and a pod annotation
        await cluster.patch(f"/apis/apps/v1/namespaces/default/deployments/{name}", json={"spec": {"template": {
            "metadata": {"annotations": {"example.com/edited": "by-kubectl"}},
            "spec": {"priorityClassName": "set-by-kubectl"}}}})
        # a spec change makes the operator apply the Deployment again: env gains NCCL_DEBUG, the toleration goes
        await cluster.patch(SERVICE_URL, json={"metadata": {"generation": 2}, "spec": {"server": {"pod": {
            "tolerations": None, "env": [*overlay["env"], {"name": "NCCL_DEBUG", "value": "INFO"}]}}}})
        await eventually(lambda: status(cluster).get("observedGeneration") == 2, "generation 2 observed")
        assert env_names(cluster)[-2:] == ["HF_ENDPOINT", "NCCL_DEBUG"]
        pod = template(cluster)
        assert pod["spec"]["priorityClassName"] == "set-by-kubectl"
        assert pod["metadata"]["annotations"]["example.com/edited"] == "by-kubectl"
        assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


async def test_a_colliding_overlay_is_an_invalid_spec_condition_and_event(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1, "engine": ENGINE, "server": {"pod": {"env": [{"name": "HOME", "value": "/"}]}}}),
         res=ISVC)
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "True", "InvalidSpec")
        assert condition(cluster, "InvalidSpec")["message"].startswith("spec.server.pod.env[0].name:")
        assert not server_deployments(cluster)
        events = await eventually(lambda: [o.raw for (r, _, _), o in cluster.objects.items()
                                           if r.plural == "events" and not o.deleted and o.raw.get("reason") == "InvalidSpec"], "an Event")
        assert events[0]["type"] == "Warning" and "spec.server.pod.env[0].name" in events[0]["message"]
