"""Server-side apply against the real API server: a field the operator stops rendering leaves the live
object, fields of other managers stay, and every child is applied under the operator's field manager."""

from __future__ import annotations

import json
from typing import Any

from conftest import Example, LocalOperator
from e2e_support import Cluster, wait_for
from test_operator import GPU_NODES, _fake_hub_module, deployments, wait_settled

FIELD_MANAGER = "warmfleet-operator"


def templates(c: Cluster, ex: Example) -> dict[str, dict[str, Any]]:
    return {n: d["spec"]["template"]["spec"] for n, d in deployments(c, ex).items()}


def test_switching_to_a_baked_path_removes_the_fetch_init_container(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str) -> None:
    """hf:// renders a `fetch-model` init container; a baked path does not. With a merge patch the
    `initContainers` key (not mentioned any more) would stay on every Deployment; applied, it goes."""
    c = e2e_cluster
    ex = Example("ssa-drop", namespace, "")
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
              "torch_dtype": "bfloat16", "vision_config": {"embed_dim": 1280}}
    with _fake_hub_module().FakeHub() as hub:
        hub.add("acme/ssa-e2e", {"config.json": json.dumps(config).encode(), "model.safetensors": b"w" * 64})
        c.apply({"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
                 "metadata": {"name": ex.name, "namespace": namespace},
                 "spec": {"model": {"source": "hf://acme/ssa-e2e@main", "hub": {"endpoint": hub.url}},
                          "replicas": 1, "nodeSelector": GPU_NODES}})
        wait_settled(c, ex, "the hf:// service to settle")
        before = deployments(c, ex)
        assert len(before) >= 2 and all("initContainers" in t for t in templates(c, ex).values())  # pools + router
        # another manager's label on a child: the operator's applies must leave it alone
        server = next(n for n in before if not n.endswith("-router"))
        c.kubectl("-n", namespace, "label", "deployment", server, "team=ml")
        c.kubectl("-n", namespace, "patch", "wfis", ex.name, "--type=json", "-p", json.dumps([
            {"op": "remove", "path": "/spec/model/source"}, {"op": "remove", "path": "/spec/model/hub"},
            {"op": "add", "path": "/spec/model/path", "value": "/models/baked"}]))
        wait_for(lambda: not any("initContainers" in t for t in templates(c, ex).values()), 120,
                 "initContainers gone from every pod template")
    wait_settled(c, ex, "the baked-path service to settle")
    after = deployments(c, ex)
    assert set(after) == set(before)  # the same Deployments, changed in place (not deleted and re-created)
    assert all(after[n]["metadata"]["uid"] == before[n]["metadata"]["uid"] for n in after)
    for t in templates(c, ex).values():
        (ctr,) = t["containers"]
        assert ctr["args"][ctr["args"].index("--model") + 1] == "/models/baked"
        assert "model-cache" not in {v["name"] for v in t["volumes"]}  # a volume of the hf:// form, gone too
    assert after[server]["metadata"]["labels"]["team"] == "ml"
    for name in after:  # kubectl hides managedFields unless asked
        d = c.kubectl_json("-n", namespace, "get", "deployment", name, "--show-managed-fields")
        appliers = {f["manager"] for f in d["metadata"]["managedFields"] if f["operation"] == "Apply"}
        assert appliers == {FIELD_MANAGER}, appliers
    # gone before the namespace: a reconcile into a terminating namespace is refused (403) and logged
    c.kubectl("-n", namespace, "delete", "wfis", ex.name, "--wait=true", "--timeout=60s")
