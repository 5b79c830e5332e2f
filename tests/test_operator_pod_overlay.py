"""spec.server.pod and spec.router.pod: each field merged into the rendered pods beside the operator's own entries, each
collision refused with an error naming the field, the shapes held against Kubernetes' own schemas."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from operator_fixtures.shapes import h200, l4, service
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec import pod_overlay as po
from warmfleet.operator.spec.constants import COMPONENT_LABEL, SIZING_HASH_ANNOTATION
from warmfleet.operator.spec.crd import crd
from warmfleet.operator.spec.schema import SpecError, camel

IMAGES = objects.Images(engine="engine:1", router="slim:1")
ENGINE = {"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"}
NODES = [h200("h200-a"), l4("l4-a", labels={"pool": "small"})]


def rendered(server_pod=None, router_pod=None, mode="proxy", **spec):
    body = {"replicas": 2, "engine": ENGINE, **spec}
    if server_pod is not None:
        body.setdefault("server", {})["pod"] = server_pod
    router = {"mode": mode, **({"pod": router_pod} if router_pod is not None else {})}
    body["router"] = {**router, **body.get("router", {})}
    return render(service(spec=body), [node_info(n) for n in NODES], IMAGES)


def deployments(items, component):
    return [o for o in items if o["kind"] == "Deployment" and o["metadata"]["labels"][COMPONENT_LABEL] == component]


def pod(dep):
    return dep["spec"]["template"]["spec"]


def main(dep):
    return pod(dep)["containers"][0]


def refused(needle_path, server_pod=None, router_pod=None, **kw):
    with pytest.raises(SpecError) as exc:
        rendered(server_pod, router_pod, **kw)
    assert exc.value.path == needle_path, str(exc.value)
    return exc.value


# ---- merged: every field reaches every pool's pods, the operator's own entries stay ----

def test_tolerations_are_added_after_the_operators_gpu_toleration():
    taint = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
    servers = deployments(rendered({"tolerations": [taint]}), "server")
    assert len(servers) == 2
    for dep in servers:
        tol = pod(dep)["tolerations"]
        assert tol[0] == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        assert tol[1] == taint


def test_labels_and_annotations_join_the_operators_and_the_selector_is_untouched():
    items = rendered({"labels": {"team": "vision"}, "annotations": {"example.com/owner": "ml"}})
    for dep in deployments(items, "server"):
        meta = dep["spec"]["template"]["metadata"]
        assert meta["labels"]["team"] == "vision" and meta["labels"][COMPONENT_LABEL] == "server"
        assert meta["annotations"]["example.com/owner"] == "ml" and SIZING_HASH_ANNOTATION in meta["annotations"]
        assert "team" not in dep["spec"]["selector"]["matchLabels"]


def test_node_selector_narrows_the_pools_and_pins_their_pods():
    items = rendered({"nodeSelector": {"pool": "small"}})
    (dep,) = deployments(items, "server")  # only the L4 node carries pool=small: one pool, not two
    exprs = pod(dep)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert {"key": "pool", "operator": "In", "values": ["small"]} in exprs["matchExpressions"]
    assert "nodeSelector" not in pod(dep)  # merged with spec.nodeSelector, rendered as the pool's affinity


def test_router_node_selector_is_the_pods_own():
    (router,) = deployments(rendered(router_pod={"nodeSelector": {"node-role": "system"}}), "router")
    assert pod(router)["nodeSelector"] == {"node-role": "system"}


def test_required_node_affinity_is_anded_with_the_pool_term():
    term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}
    other = {"matchExpressions": [{"key": "rack", "operator": "Exists"}]}
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term, other]},
                            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "preference": term}]},
           "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
               {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                  "labelSelector": {"matchLabels": {"app": "other"}}}}]}}
    for dep in deployments(rendered({"affinity": aff}), "server"):
        got = pod(dep)["affinity"]
        terms = got["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert len(terms) == 2  # ORed: each of the user's terms, each with the pool's expressions
        for t, user in zip(terms, (term, other)):
            assert t["matchExpressions"][-len(user["matchExpressions"]):] == user["matchExpressions"]
            assert any(e["key"] == "nvidia.com/gpu.product" for e in t["matchExpressions"])
        assert got["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10
        assert got["podAntiAffinity"] == aff["podAntiAffinity"]


def test_topology_spread_constraints_follow_the_operators():
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "x"}}}
    for dep in deployments(rendered({"topologySpreadConstraints": [zone]}), "server"):
        spread = pod(dep)["topologySpreadConstraints"]
        assert spread[0]["topologyKey"] == "kubernetes.io/hostname" and spread[1] == zone


def test_env_and_env_from_reach_the_main_container_only_after_the_operators():
    env = [{"name": "HF_ENDPOINT", "value": "https://hf-mirror.example.com"},
           {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    env_from = [{"configMapRef": {"name": "nccl"}, "prefix": "X_"}]
    for dep in deployments(rendered({"env": env, "envFrom": env_from}), "server"):
        c = main(dep)
        assert c["env"][-3:] == env and c["env"][0]["name"] != "HF_ENDPOINT"
        assert c["envFrom"] == env_from
        assert all("HF_ENDPOINT" not in json.dumps(i.get("env")) for i in pod(dep).get("initContainers", []))


@pytest.mark.parametrize("mode,component", [("proxy", "router"), ("gateway", "epp")])
def test_router_overlay_reaches_router_and_endpoint_picker_pods(mode, component):
    overlay = {"tolerations": [{"key": "infra", "operator": "Exists"}], "priorityClassName": "infra-critical",
               "env": [{"name": "LOG_LEVEL", "value": "debug"}], "imagePullSecrets": [{"name": "regcred"}],
               "resources": {"requests": {"cpu": "500m", "memory": "3Gi"}, "limits": {"cpu": 4, "memory": "3Gi"}}}
    (dep,) = deployments(rendered(router_pod=overlay, mode=mode), component)
    spec = pod(dep)
    assert spec["tolerations"] == overlay["tolerations"] and spec["priorityClassName"] == "infra-critical"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["serviceAccountName"] == dep["metadata"]["name"]
    c = main(dep)
    assert c["name"] == component and c["env"][0]["name"] == "HOME" and c["env"][-1] == overlay["env"][0]
    assert c["resources"]["requests"]["cpu"] == "500m" and c["resources"]["limits"]["cpu"] == 4
    assert c["resources"]["limits"]["memory"] == "3Gi" and "ephemeral-storage" in c["resources"]["limits"]
    for server in deployments(rendered(router_pod=overlay, mode=mode), "server"):
        assert "priorityClassName" not in pod(server)  # the router's overlay stays on the router


def test_pull_secrets_priority_runtime_class_and_service_account():
    overlay = {"imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "gpu-serving",
               "runtimeClassName": "nvidia", "serviceAccountName": "inference"}
    for dep in deployments(rendered(overlay), "server"):
        spec = pod(dep)
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert (spec["priorityClassName"], spec["runtimeClassName"], spec["serviceAccountName"]) == ("gpu-serving", "nvidia", "inference")
        assert spec["automountServiceAccountToken"] is False


def test_volumes_and_mounts_beside_the_operators():
    vols = [{"name": "certs", "secret": {"secretName": "ca"}}, {"name": "scratch", "emptyDir": {}}]
    mounts = [{"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}, {"name": "scratch", "mountPath": "/scratch"}]
    for dep in deployments(rendered({"volumes": vols, "volumeMounts": mounts}), "server"):
        names = [v["name"] for v in pod(dep)["volumes"]]
        assert names[:2] == ["dshm", "tmp"] and names[-2:] == ["certs", "scratch"]
        assert pod(dep)["volumes"][-1] == {"name": "scratch", "emptyDir": {}}  # kept as written
        assert main(dep)["volumeMounts"][0]["mountPath"] == "/dev/shm" and main(dep)["volumeMounts"][-2:] == mounts


def test_server_resources_add_devices_and_accept_the_sizings_own_values():
    (dep, _) = deployments(rendered({"resources": {"limits": {"rdma/hca": 1}, "requests": {"rdma/hca": 1}}}), "server")
    res = main(dep)["resources"]
    assert res["limits"]["rdma/hca"] == 1 and res["limits"]["nvidia.com/gpu"] == "1"
    sized = res["limits"]["cpu"]
    (again, _) = deployments(rendered({"resources": {"limits": {"cpu": int(sized)}}}), "server")
    assert main(again)["resources"]["limits"]["cpu"] == int(sized)


def test_no_overlay_renders_no_empty_fields():
    """Fields the operator does not own stay out of its intent: edited with kubectl, they survive server-side apply."""
    for dep in [*deployments(rendered(), "server"), *deployments(rendered(), "router")]:
        for key in ("imagePullSecrets", "priorityClassName", "runtimeClassName", "nodeSelector"):
            assert key not in pod(dep)
        assert "envFrom" not in main(dep) and "annotations" not in deployments(rendered(), "router")[0]["spec"]["template"]["metadata"]
    empties = {"labels": {}, "tolerations": [{"key": "a", "operator": "Exists"}],
               "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}}
    (dep, _) = deployments(rendered(empties), "server")
    assert "podAffinity" not in pod(dep)["affinity"] and "values" not in json.dumps(pod(dep)["tolerations"])


# ---- refused: a collision with the operator's entries names the field ----

@pytest.mark.parametrize("overlay,path", [
    ({"env": [{"name": "HOME", "value": "/root"}]}, "spec.server.pod.env[0].name"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "spec.server.pod.env[1].name"),
    ({"labels": {COMPONENT_LABEL: "mine"}}, f"spec.server.pod.labels.{COMPONENT_LABEL}"),
    ({"labels": {"serving.warmfleet.io/extra": "x"}}, "spec.server.pod.labels.serving.warmfleet.io/extra"),
    ({"labels": {"bad key!": "x"}}, "spec.server.pod.labels.bad key!"),
    ({"annotations": {SIZING_HASH_ANNOTATION: "x"}}, f"spec.server.pod.annotations.{SIZING_HASH_ANNOTATION}"),
    ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.server.pod.volumes[0].name"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/tmp"}]},
     "spec.server.pod.volumeMounts[0].mountPath"),
    ({"volumeMounts": [{"name": "nowhere", "mountPath": "/data"}]}, "spec.server.pod.volumeMounts[0].name"),
    ({"topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
                                     "whenUnsatisfiable": "ScheduleAnyway"}]}, "spec.server.pod.topologySpreadConstraints[0]"),
    ({"resources": {"limits": {"memory": "1Gi"}}}, "spec.server.pod.resources.limits.memory"),
    ({"resources": {"requests": {"nvidia.com/gpu": 2}}}, "spec.server.pod.resources.requests.nvidia.com/gpu"),
    ({"resources": {"requests": {"rdma/hca": 2}, "limits": {"rdma/hca": 1}}}, "spec.server.pod.resources.requests.rdma/hca"),
    ({"imagePullSecrets": [{"name": "a"}, {"name": "a"}]}, "spec.server.pod.imagePullSecrets[1].name"),
])
def test_server_collisions_are_refused_naming_the_field(overlay, path):
    refused(path, overlay)


def test_node_selector_against_the_services_with_another_value_is_refused():
    err = refused("spec.server.pod.nodeSelector.pool", {"nodeSelector": {"pool": "small"}}, nodeSelector={"pool": "big"})
    assert "big" in err.message
    (dep,) = deployments(rendered({"nodeSelector": {"pool": "small"}}, nodeSelector={"pool": "small"}), "server")


@pytest.mark.parametrize("overlay,path", [
    ({"env": [{"name": "HOME", "value": "/"}]}, "spec.router.pod.env[0].name"),
    ({"resources": {"limits": {"ephemeral-storage": "1Gi"}}}, "spec.router.pod.resources.limits.ephemeral-storage"),
    ({"resources": {"requests": {"memory": "8Gi"}}}, "spec.router.pod.resources.requests.memory"),  # above the 2Gi limit
    ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.router.pod.volumes[0].name"),
])
def test_router_collisions_are_refused_naming_the_field(overlay, path):
    refused(path, router_pod=overlay)


@pytest.mark.parametrize("overlay,path", [
    ({"tolerations": [{"effect": "Sometimes"}]}, "spec.server.pod.tolerations[0].effect"),
    ({"volumes": [{"name": "only-a-name"}]}, "spec.server.pod.volumes[0]"),
    ({"resources": {"limits": {"cpu": "lots"}}}, "spec.server.pod.resources.limits.cpu"),
    ({"envFrom": [{"secretRef": {"name": "s"}, "extra": 1}]}, "spec.server.pod.envFrom[0]"),
    ({"serviceAccountName": "Bad_Name"}, "spec.server.pod.serviceAccountName"),
])
def test_malformed_overlays_are_spec_errors(overlay, path):
    refused(path, overlay)


def test_router_overlay_has_no_service_account_name():
    refused("spec.router.pod", router_pod={"serviceAccountName": "mine"})  # the router's RBAC is the operator's


# ---- Kubernetes' own shapes ----

K8S_DEFS = None


def k8s_definitions():
    import kubernetes_validate
    global K8S_DEFS
    if K8S_DEFS is None:
        root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.37.0-local-strict"
        K8S_DEFS = json.loads((root / "_definitions.json").read_text())["$defs"]
    return K8S_DEFS


MIRRORS = {
    po.Toleration: "io.k8s.api.core.v1.Toleration", po.Affinity: "io.k8s.api.core.v1.Affinity",
    po.NodeAffinity: "io.k8s.api.core.v1.NodeAffinity", po.NodeSelector: "io.k8s.api.core.v1.NodeSelector",
    po.NodeSelectorTerm: "io.k8s.api.core.v1.NodeSelectorTerm",
    po.NodeSelectorRequirement: "io.k8s.api.core.v1.NodeSelectorRequirement",
    po.PreferredSchedulingTerm: "io.k8s.api.core.v1.PreferredSchedulingTerm",
    po.PodAffinity: "io.k8s.api.core.v1.PodAntiAffinity", po.PodAffinityTerm: "io.k8s.api.core.v1.PodAffinityTerm",
    po.WeightedPodAffinityTerm: "io.k8s.api.core.v1.WeightedPodAffinityTerm",
    po.LabelSelector: "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector",
    po.LabelSelectorRequirement: "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelectorRequirement",
    po.TopologySpreadConstraint: "io.k8s.api.core.v1.TopologySpreadConstraint", po.EnvVar: "io.k8s.api.core.v1.EnvVar",
    po.EnvVarSource: "io.k8s.api.core.v1.EnvVarSource", po.KeySelector: "io.k8s.api.core.v1.SecretKeySelector",
    po.ObjectFieldSelector: "io.k8s.api.core.v1.ObjectFieldSelector",
    po.ResourceFieldSelector: "io.k8s.api.core.v1.ResourceFieldSelector",
    po.FileKeySelector: "io.k8s.api.core.v1.FileKeySelector", po.EnvFromSource: "io.k8s.api.core.v1.EnvFromSource",
    po.EnvSourceRef: "io.k8s.api.core.v1.SecretEnvSource", po.VolumeMount: "io.k8s.api.core.v1.VolumeMount",
    po.LocalObjectReference: "io.k8s.api.core.v1.LocalObjectReference",
}
# Kubernetes fields left out on purpose: DRA claims (the operator sizes the server's devices), bind-mount options (alpha)
OMITTED = {"io.k8s.api.core.v1.VolumeMount": {"bindMountOptions"}}


@pytest.mark.parametrize("cls", list(MIRRORS), ids=lambda c: c.__name__)
def test_overlay_shapes_are_kubernetes_own(cls):
    theirs = k8s_definitions()[MIRRORS[cls]]
    ours = {camel(f.name) for f in dataclasses.fields(cls)}
    assert ours == set(theirs["properties"]) - OMITTED.get(MIRRORS[cls], set())
    hints = typing.get_type_hints(cls)
    required = {camel(f.name) for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                and type(None) not in typing.get_args(hints[f.name])}
    stricter = {"name"} if cls is po.LocalObjectReference else set()  # a pull secret without a name means nothing
    assert required - stricter == set(theirs.get("required") or ())


def test_overlay_pod_fields_are_pod_spec_fields():
    pod_spec = k8s_definitions()["io.k8s.api.core.v1.PodSpec"]["properties"]
    container = k8s_definitions()["io.k8s.api.core.v1.Container"]["properties"]
    for cls in (po.ServerPodOverlay, po.RouterPodOverlay):
        for f in dataclasses.fields(cls):
            key = camel(f.name)
            assert key in pod_spec or key in container or key in ("labels", "annotations"), key


def test_the_crd_keeps_unknown_fields_only_in_volumes():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for part in ("server", "router"):
        overlay = spec[part]["properties"]["pod"]
        assert "docs/pod-overlays.md" in spec[part]["properties"]["pod"]["description"]
        text = json.dumps({k: v for k, v in overlay["properties"].items() if k != "volumes"})
        assert "preserve-unknown-fields" not in text
        assert overlay["properties"]["volumes"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
        assert "serviceAccountName" in overlay["properties"] if part == "server" else "serviceAccountName" not in overlay["properties"]


def test_every_overlay_field_renders_pods_kubernetes_accepts():
    import kubernetes_validate as kv
    server = {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
              "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                             "whenUnsatisfiable": "ScheduleAnyway"}],
              "labels": {"team": "ml"}, "annotations": {"a": "b"}, "nodeSelector": {"pool": "small"},
              "env": [{"name": "HF_ENDPOINT", "value": "https://mirror"}], "envFrom": [{"secretRef": {"name": "s"}}],
              "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "gpu", "runtimeClassName": "nvidia",
              "serviceAccountName": "sa", "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
              "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
              "resources": {"limits": {"rdma/hca": 1}, "requests": {"rdma/hca": 1}}}
    router = {**{k: v for k, v in server.items() if k not in ("serviceAccountName", "resources")},
              "resources": {"requests": {"cpu": 1, "memory": "1Gi"}}}
    items = rendered(server, router)
    assert deployments(items, "server") and deployments(items, "router")
    for o in items:
        kv.validate(o, "1.32", strict=True)


def test_tainted_gpu_example_validates_and_renders_its_overlays():
    import jsonschema
    import yaml

    repo = Path(__file__).resolve().parents[1]
    body = yaml.safe_load((repo / "examples/inferenceservice-tainted-gpu.yaml").read_text())
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    jsonschema.validate(body["spec"], spec_schema)
    nodes = [node_info(n) for n in yaml.safe_load((repo / "examples/nodes.yaml").read_text())["items"]]
    items = render(body, nodes, IMAGES)
    servers, (router,) = deployments(items, "server"), deployments(items, "router")
    assert servers
    for dep in servers:
        spec = pod(dep)
        assert {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["priorityClassName"] == "gpu-inference"
        assert {"name": "HF_ENDPOINT", "value": "https://hf-mirror.example.com"} in main(dep)["env"]
    assert pod(router)["priorityClassName"] == "gpu-inference" and "tolerations" not in pod(router)
    assert main(router)["resources"]["limits"]["memory"] == "4Gi"


def closed(schema):
    """The schema as kubeconform -strict sees it (its openapi2jsonschema.py closes every object with properties)."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    return [closed(v) for v in schema] if isinstance(schema, list) else schema


def test_kubeconform_strict_takes_volume_sources_and_quantities_and_refuses_typos():
    import jsonschema

    spec_schema = closed(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])
    overlay = {"volumes": [{"name": "certs", "secret": {"secretName": "ca"}}, {"name": "scratch", "emptyDir": {}}],
               "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/custom"}],
               "resources": {"limits": {"rdma/hca": 1, "hugepages-2Mi": "1Gi"}}}
    jsonschema.validate({"model": {"path": "/m"}, "server": {"pod": overlay}}, spec_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": {"path": "/m"}, "server": {"pod": {"tolerations": [{"keys": "typo"}]}}}, spec_schema)
