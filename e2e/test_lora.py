"""LoRA adapters against a real control plane (issue 25, CRD and operator): spec.lora renders the adapter fetch steps
and the engine's LoRA flags; changing spec.adapters rolls nothing (same Deployment generation, pod template and
ReplicaSets), it only rewrites the adapters ConfigMap the fetch steps read."""

from __future__ import annotations

import json
from typing import Any

from conftest import Example, LocalOperator
from e2e_support import Cluster, wait_for
from test_operator import GPU_NODES, deployments, replica_sets, wait_settled, wfis

SHAPE = {"numLayers": 24, "intermediateSize": 4864, "numAttentionHeads": 14, "numKeyValueHeads": 2}


def lora_service(namespace: str, adapters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "qwen-lora", "namespace": namespace},
        "spec": {
            "model": {"path": "/models/qwen", "hiddenSize": 896},  # a path stands for one baked into the image
            "lora": {"maxLoras": 2, "maxCpuLoras": 4, "maxLoraRank": 16, "modelShape": SHAPE},
            "adapters": adapters,
            "replicas": 2,
            "nodeSelector": GPU_NODES,
        },
    }


def server_deployments(c: Cluster, ex: Example) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in deployments(c, ex).items()
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"}


def adapters_listed(c: Cluster, ex: Example) -> list[str]:
    cm = c.kubectl_json("-n", ex.namespace, "get", "configmap", f"{ex.name}-adapters")
    return [a["name"] for a in json.loads(cm["data"]["adapters.json"])]


def test_adapters_render_fetch_steps_and_flags_and_changing_them_rolls_nothing(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str) -> None:
    c = e2e_cluster
    obj = lora_service(namespace, [{"name": "sql", "source": "hf://example-org/sql-lora"}])
    ex = Example(obj["metadata"]["name"], namespace, "")
    c.apply(obj)
    wait_settled(c, ex, "the LoRA service to settle")

    deps = server_deployments(c, ex)
    assert deps
    for dep in deps.values():
        ps = dep["spec"]["template"]["spec"]
        server = next(x for x in ps["containers"] if x["name"] == "server")
        args = server["args"]
        assert "--enable-lora" in args and "--lora-modules" not in args
        assert [args[args.index(f) + 1] for f in ("--max-loras", "--max-cpu-loras", "--max-lora-rank")] == ["2", "4", "16"]
        (init,) = [x for x in ps.get("initContainers", []) if x["name"] == "fetch-adapters"]
        assert init["args"][:3] == ["fetch-model", "--adapters", "/etc/warmfleet/adapters/adapters.json"]
        assert any(x["name"] == "adapter-fetch" and "--watch-s" in x["args"] for x in ps["containers"])
        assert any(m["mountPath"] == "/adapters" and m["readOnly"] for m in server["volumeMounts"])
    assert adapters_listed(c, ex) == ["sql"]

    before = {n: (d["metadata"]["generation"], d["spec"]["template"]) for n, d in deps.items()}
    rs_before = replica_sets(c, ex)
    gen = wfis(c, ex)["metadata"]["generation"]
    for i, adapters in enumerate(([{"name": "sql", "source": "hf://example-org/sql-lora"},
                                   {"name": "chat", "source": "s3://adapters/chat"}],
                                  [{"name": "chat", "source": "s3://adapters/chat"}]), start=1):
        c.kubectl("-n", namespace, "patch", "wfis", ex.name, "--type", "merge",
                  "-p", json.dumps({"spec": {"adapters": adapters}}))
        wait_for(lambda: wfis(c, ex)["status"].get("observedGeneration") == gen + i, 60, "the operator to see the change")
        wait_for(lambda: adapters_listed(c, ex) == [a["name"] for a in adapters], 60, "the adapters ConfigMap to follow")
        after = server_deployments(c, ex)
        assert set(after) == set(before)
        for name, (generation, template) in before.items():
            assert after[name]["metadata"]["generation"] == generation, name  # the Deployment was not even patched
            assert after[name]["spec"]["template"] == template, name
        assert replica_sets(c, ex) == rs_before  # no new ReplicaSet: nothing rolled
    wait_settled(c, ex, "the service to stay settled")
