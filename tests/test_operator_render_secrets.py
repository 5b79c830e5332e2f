"""`warmfleet operator render` lists the Secrets the operator generates once per service (admin key, CURVE keys, node
tier token) in a comment, never as manifests or key material; the list is what a reconcile really creates."""

from __future__ import annotations

import json

import yaml

from operator_fixtures.cluster import ISVC, eventually, obj, operator, seed, status
from operator_fixtures.rendered import HF
from operator_fixtures.shapes import l4, service
from warmfleet.cli import main
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.generated_secrets import generated_secrets
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec.inference_service import parse_spec

OWNER = objects.Owner("qwen", "default")
IMAGES = objects.Images(engine="engine:1", router="slim:1")
EVERYTHING = {"engine": {"kind": "warmfleet"}, "replicas": 1, "cache": {"nodeTier": {"mode": "Auto"}},
              "router": {"kvEventsCurve": True}}


def render(tmp_path, spec: dict, *flags: str) -> int:
    nodes, f = tmp_path / "nodes.yaml", tmp_path / "svc.yaml"
    nodes.write_text(yaml.safe_dump(l4("l1")))
    f.write_text(yaml.safe_dump(service(spec=spec)))
    return main(["operator", "render", "-f", str(f), "--nodes", str(nodes), *flags])


def test_render_lists_the_generated_secrets_in_a_comment_above_the_service(tmp_path, capsys):
    assert render(tmp_path, EVERYTHING) == 0
    out = capsys.readouterr().out
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]  # no placeholder to apply: it would become the key
    last = out.rsplit("\n---\n", 1)[1]
    comment = [line for line in last.splitlines() if line.startswith("#")]
    assert "InferenceService default/qwen" in comment[0]
    listed = {line.split()[2]: line for line in comment if line.startswith("#   Secret ")}
    assert set(listed) == {"qwen-admin", "qwen-kv-curve", "qwen-node-tier"}
    assert "keys admin-key:" in listed["qwen-admin"] and "keys token:" in listed["qwen-node-tier"]
    assert "replica.key_secret" in listed["qwen-kv-curve"]
    assert docs[-1]["kind"] == "InferenceService" and "do not create them" in " ".join(comment)


def test_a_plain_service_lists_only_its_admin_key_and_json_output_says_it_on_stderr(tmp_path, capsys):
    assert render(tmp_path, {"engine": {"kind": "warmfleet"}, "replicas": 1}, "-o", "json") == 0
    captured = capsys.readouterr()
    items = json.loads(captured.out)["items"]  # the List itself stays plain JSON
    assert items[-1]["kind"] == "InferenceService" and not [i for i in items if i["kind"] == "Secret"]
    assert "Secret qwen-admin" in captured.err and "qwen-kv-curve" not in captured.err
    assert "node-tier" not in captured.err


def test_a_named_admin_key_secret_is_not_generated():
    spec = parse_spec({"model": HF, "lora": {"adminKeySecret": {"name": "mine"}}})
    assert [s.name for s in generated_secrets(OWNER, spec, [])] == []


async def test_the_list_is_what_a_reconcile_creates(cluster):
    body = service(spec=EVERYTHING)
    _, spec, plan = plan_for(body, [node_info(l4("l1"))], IMAGES)
    listed = generated_secrets(OWNER, spec, plan.pools)
    seed(cluster, l4("l1"))
    seed(cluster, body, res=ISVC)
    async with operator(cluster):
        await eventually(lambda: status(cluster).get("pools"), "the first reconcile done")
        created = await eventually(lambda: all(obj(cluster, "v1/secrets", s.name) for s in listed)
                                   and [obj(cluster, "v1/secrets", s.name) for s in listed], "every listed Secret")
    assert [s.name for s in listed] == ["qwen-admin", "qwen-kv-curve", "qwen-node-tier"]
    for s, secret in zip(listed, created):
        assert set(secret.get("data") or secret.get("stringData")) == set(s.keys), s.name
    generated = {o.raw["metadata"]["name"] for (r, _, _), o in cluster.objects.items()
                 if r.plural == "secrets" and not o.deleted}
    assert generated == {s.name for s in listed}
