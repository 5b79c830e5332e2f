"""The CRD generated from spec.py: committed files in sync, structural schema, CEL rules, spec parsing."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from warmfleet.operator.planning.engine_descriptions import ENGINES
from warmfleet.operator.spec.chart_crd import chart_crd_template
from warmfleet.operator.spec.crd import CRD_FILE, crd, crd_yaml
from warmfleet.operator.spec.inference_service import EngineKind, InferenceServiceSpec, parse_spec
from warmfleet.operator.spec.schema import SpecError

REPO = Path(__file__).resolve().parents[1]
REGEN = "regenerate with `warmfleet operator crd --write .`"


def test_committed_crd_matches_spec_types():
    assert (REPO / "crds" / CRD_FILE).read_text() == crd_yaml(), REGEN


def test_chart_crd_template_matches_spec_types():
    assert (REPO / "charts/warmfleet/templates/crd.yaml").read_text() == chart_crd_template(), REGEN


def test_the_condition_type_enum_holds_every_condition_the_operator_writes():
    """The API server refuses a status write (HTTP 422) whose condition type is outside the CRD's enum."""
    from warmfleet.operator.planning.service_status import CONDITION_TYPES

    status = version()["schema"]["openAPIV3Schema"]["properties"]["status"]
    enum = status["properties"]["conditions"]["items"]["properties"]["type"]["enum"]
    assert set(CONDITION_TYPES) == set(enum) and "NodeTierReady" in enum


def version():
    return crd()["spec"]["versions"][0]


def walk(schema, path="$"):
    yield path, schema
    for k, v in (schema.get("properties") or {}).items():
        yield from walk(v, f"{path}.{k}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


# The one place unknown fields are kept: a pod overlay's volumes (some thirty volume sources; spec/pod_overlay.py)
PRESERVED = {"$.spec.server.pod.volumes[]", "$.spec.router.pod.volumes[]"}


def test_schema_is_structural_and_documented():
    root = version()["schema"]["openAPIV3Schema"]
    for path, node in walk(root):
        if node.get("x-kubernetes-int-or-string"):  # a Kubernetes quantity: structural without a type
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "type" in node, path
        assert not node.get("x-kubernetes-preserve-unknown-fields") or path in PRESERVED, path
        if path.startswith(("$.spec.", "$.status.")) and not path.endswith(("[]", "}")):
            assert node.get("description"), path


def test_defaults_enums_ranges_and_cel():
    spec = version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    p = spec["properties"]
    assert p["model"]["properties"]["dtype"]["enum"] == ["bfloat16", "float16", "float32"]
    assert p["cache"]["properties"]["blockSize"]["default"] == 64
    assert p["cache"]["properties"]["swapSpace"]["properties"]["mode"]["enum"] == ["Auto", "Fixed"]
    assert p["server"]["properties"]["gpusPerReplica"]["minimum"] == 0  # 0: CPU-only replicas (engine warmfleet)
    rules = {r["rule"] for r in spec["x-kubernetes-validations"]}
    assert not any("autoscaling" in r for r in rules)  # replicas beside autoscaling: the scale subresource writes it
    swap_rules = {r["rule"] for r in p["cache"]["properties"]["swapSpace"]["x-kubernetes-validations"]}
    assert "self.mode != 'Fixed' || has(self.size)" in swap_rules
    assert any("oldSelf.servedName" in r["rule"] for r in p["model"]["x-kubernetes-validations"])
    assert p["autoscaling"]["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"


def test_subresources_printer_columns_and_names():
    v = version()
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    cols = [c["name"] for c in v["additionalPrinterColumns"]]
    assert cols == ["Ready", "Reason", "Replicas", "Desired", "Model", "Engine", "Endpoint", "Age"]
    engine = next(c for c in v["additionalPrinterColumns"] if c["name"] == "Engine")
    assert engine["jsonPath"] == ".status.engine.kind"
    reason = next(c for c in v["additionalPrinterColumns"] if c["name"] == "Reason")
    assert reason["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    names = crd()["spec"]["names"]
    assert "isvc" not in names["shortNames"] and names["shortNames"]


def test_defaults_satisfy_their_own_schema():
    root = version()["schema"]["openAPIV3Schema"]
    for path, node in walk(root):
        if "default" in node and "enum" in node:
            assert node["default"] in node["enum"], path
        if "default" in node and "minimum" in node:
            assert node["default"] >= node["minimum"], path


@pytest.mark.parametrize("name", ["inferenceservice.yaml", "inferenceservice-vllm.yaml", "inferenceservice-fastdeploy.yaml",
                                  "inferenceservice-hf.yaml", "inferenceservice-cpu.yaml"])
def test_example_validates_against_the_crd_schema(name):
    import jsonschema
    example = yaml.safe_load((REPO / "examples" / name).read_text())
    jsonschema.validate(example["spec"], version()["schema"]["openAPIV3Schema"]["properties"]["spec"])
    parse_spec(example["spec"])


def test_engine_kind_image_and_extra_args():
    engine = version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert engine["properties"]["kind"]["enum"] == ["auto", "warmfleet", "vllm", "fastdeploy"]
    assert engine["properties"]["kind"]["default"] == "auto"
    assert engine["properties"]["extraArgs"]["items"] == {"type": "string"}
    assert "default" not in engine["properties"]["image"]
    assert "x-kubernetes-validations" not in engine  # the image is optional for every kind (pinned defaults)
    # one description per kind, and the schema's enum is the set of descriptions
    assert set(typing.get_args(EngineKind)) == set(ENGINES)
    s = parse_spec({"model": {"path": "/m"}})
    assert (s.engine.kind, s.engine.image, s.engine.extra_args) == ("auto", None, [])
    s = parse_spec({"model": {"path": "/m"}, "engine": {"kind": "fastdeploy"}})  # no image: the pinned default
    assert (s.engine.kind, s.engine.image) == ("fastdeploy", None)
    s = parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm", "image": "v:1"}})
    assert (s.engine.kind, s.engine.image) == ("vllm", "v:1")


def test_pool_status_carries_the_engine_and_encoder_tokens_are_optional():
    pool = version()["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["pools"]["items"]
    assert pool["properties"]["engine"]["enum"] == ["warmfleet", "vllm", "fastdeploy"]
    sizes = pool["properties"]["sizes"]
    assert "encoderCacheTokens" not in sizes["required"] and "gpuMemoryUtilization" in sizes["properties"]


def test_parse_applies_defaults():
    s = parse_spec({"model": {"path": "/m"}})
    assert isinstance(s, InferenceServiceSpec)
    assert (s.cache.block_size, s.cache.swap_space.mode, s.router.replicas, s.desired_replicas()) == (64, "Auto", 2, 1)
    assert parse_spec({"model": {"path": "/m"}, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}).desired_replicas() == 2


@pytest.mark.parametrize("replicas,want", [(None, 2), (1, 2), (4, 4), (9, 5), (0, 2)])
def test_replicas_beside_autoscaling_are_clamped_to_the_bounds(replicas, want):
    spec = {"model": {"path": "/m"}, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}
    if replicas is not None:
        spec["replicas"] = replicas
    assert parse_spec(spec).desired_replicas() == want


@pytest.mark.parametrize("spec,needle", [
    ({}, "spec.model: is required"),
    ({"model": {"path": "/m"}, "autoscaling": {"maxReplicas": 2, "pools": [{"name": "a"}, {"name": "a"}]}},
     "autoscaling pool names must be unique"),
    ({"model": {"path": "/m"}, "autoscaling": {"maxReplicas": 2, "pools": [{"name": "a", "minReplicas": 2, "maxReplicas": 1}]}},
     "spec.autoscaling.pools[0]: minReplicas must be <= maxReplicas"),
    ({"model": {"path": "/m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas must be <= maxReplicas"),
    ({"model": {"path": "/m"}, "cache": {"swapSpace": {"mode": "Fixed"}}}, "spec.cache.swapSpace: size is required"),
    ({"model": {"path": "/m"}, "cache": {"encoderCache": {"min": 10, "max": 5}}}, "min must be <= max"),
    ({"model": {"path": "/m"}, "cache": {"blockSize": 48}}, "spec.cache.blockSize"),
    ({"model": {"path": "/m", "dtype": "int8"}}, "must be one of"),
    ({"model": {"path": "/m"}, "replicas": -1}, "must be >= 0"),
    ({"model": {"path": "/m"}, "server": {"gpusPerReplica": "2"}}, "must be an integer"),
    ({"model": {"path": "/m"}, "sever": {}}, "unknown field(s) sever"),
    ({"model": {"path": "/m"}, "pools": [{"name": "a"}, {"name": "a"}]}, "pool names must be unique"),
    ({"model": {"path": "/m"}, "pools": [{"name": "Bad_Name"}]}, "must match"),
    ({"model": {"path": "/m"}, "engine": {"kind": "sglang", "image": "x"}}, "must be one of auto, warmfleet, vllm, fastdeploy"),
    ({"model": {"path": "/m"}, "server": {"gpuResource": "gpu"}}, "spec.server.gpuResource: must match"),
    ({"model": {"path": "/m"}, "server": {"gpuMemoryGib": 0}}, "spec.server.gpuMemoryGib: must be >= 1"),
])
def test_bad_specs_are_readable_errors(spec, needle):
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert needle in str(err.value)
