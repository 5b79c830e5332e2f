"""spec.engine.kind auto: vLLM on GPU pools, warmfleet's engine on CPU-only ones, an explicit kind wins; the warning for
warmfleet's engine on GPUs (condition, Event, render); the pinned default images of vLLM and FastDeploy."""

from __future__ import annotations

import re

import pytest
import yaml

from operator_fixtures.shapes import GiB, h200, l4, node, service
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import engine_choice, engine_descriptions, objects
from warmfleet.operator.planning.nodes import format_bytes, node_info
from warmfleet.operator.spec.schema import SpecError
from warmfleet.operator.planning.service_status import healthy_status, warnings

IMAGES = objects.Images(engine="registry.example/warmfleet:1.0", router="registry.example/warmfleet-slim:1.0")
CPU = node("cpu-a", memory=256 * GiB)  # no allocatable GPU


def svc(engine: dict | None = None, **spec):
    """A service whose engine is `engine` (None: the spec says nothing, so auto)."""
    body = service(spec=spec)
    body["spec"].pop("engine")
    if engine is not None:
        body["spec"]["engine"] = engine
    return body


def planned(body, nodes):
    owner, spec, plan = plan_for(body, [node_info(n) for n in nodes], IMAGES)
    status = healthy_status(plan=plan, generation=1, model="qwen", endpoint="", selector="", ready_by_pool={},
                            router_ready=0, previous={}, now="2026-01-01T00:00:00Z")
    return spec, plan, status


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def server_containers(plan):
    deps = [c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] != "qwen-router"]
    return [d["spec"]["template"]["spec"]["containers"][0] for d in deps]


def router_engine(plan):
    router = next(c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--engine") + 1]


def test_auto_is_the_default_and_picks_vllm_on_gpu_pools():
    spec, plan, status = planned(svc(), [h200(), l4()])
    assert spec.engine.kind == "vllm" and plan.engine == "vllm"
    assert status["engine"]["kind"] == "vllm" and status["engine"]["chosenBy"] == "auto"
    pools = [p["name"] for p in status["pools"]]
    assert all(name in status["engine"]["reason"] for name in pools), status["engine"]["reason"]
    fit = condition(status, "EngineFit")
    assert (fit["status"], fit["reason"]) == ("True", "AutoGPUPools")
    assert {p["engine"] for p in status["pools"]} == {"vllm"}
    assert router_engine(plan) == "vllm"  # the router indexes vLLM's own hashes
    for c in server_containers(plan):
        assert c["command"] == list(engine_descriptions.VLLM.command) and c["image"] == engine_descriptions.VLLM_IMAGE


def test_auto_picks_warmfleet_where_every_pool_is_cpu_only():
    spec, plan, status = planned(svc(), [CPU])
    assert plan.engine == "warmfleet" and status["engine"] == {
        "kind": "warmfleet", "chosenBy": "auto", "reason": "warmfleet: spec.engine.kind is auto and every pool is CPU-only"}
    fit = condition(status, "EngineFit")
    assert (fit["status"], fit["reason"]) == ("True", "AutoCPUOnly")
    assert router_engine(plan) == "warmfleet"


def test_auto_without_matching_nodes_says_so():
    _, plan, status = planned(svc(nodeSelector={"pool": "none"}), [h200()])
    assert plan.engine == "warmfleet" and "no node matches yet" in status["engine"]["reason"]


def test_one_gpu_pool_among_cpu_pools_makes_it_vllm():
    _, plan, status = planned(svc(), [CPU, l4()])
    assert plan.engine == "vllm" and len(status["pools"]) == 2
    assert condition(status, "EngineFit")["reason"] == "AutoGPUPools"


@pytest.mark.parametrize("kind,nodes", [("fastdeploy", [h200()]), ("vllm", [CPU, l4()]), ("warmfleet", [CPU])])
def test_an_explicit_kind_wins(kind, nodes):
    spec, plan, status = planned(svc({"kind": kind}), nodes)
    assert spec.engine.kind == plan.engine == kind
    assert (status["engine"]["kind"], status["engine"]["chosenBy"]) == (kind, "spec")
    fit = condition(status, "EngineFit")
    assert (fit["status"], fit["reason"]) == ("True", "EngineFromSpec")


def test_auto_on_cpu_only_nodes_runs_replicas_without_gpus():
    spec, plan, status = planned(svc(replicas=3, server={"cpus": 8}), [CPU])
    assert plan.engine == "warmfleet" and plan.placed == 3  # 64 CPUs / 8 per replica: room for 8
    (c,) = server_containers(plan)
    dep = next(d for d in plan.children if d["kind"] == "Deployment" and d["metadata"]["name"] != "qwen-router")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3 and pod["tolerations"] == []  # no GPU toleration: it takes no GPU
    for amounts in (c["resources"]["requests"], c["resources"]["limits"]):
        assert not any("gpu" in k for k in amounts) and amounts["cpu"] == "8"
    (p,) = status["pools"]
    assert p["fits"] and p["replicas"] == 3 and p["shape"]["cpuMillis"] == 64000 and p["shape"]["gpusPerNode"] == 0
    sizes, sources = p["sizes"], p["inputs"]["sources"]
    assert sizes["replicasPerNode"] == 8 and sources["replicasPerNode"].startswith("cpu")
    assert sources["encoderCache"] == "auto (host memory)" and sizes["encoderCacheTokens"] > 2048
    assert c["resources"]["limits"]["memory"] == format_bytes(sizes["memoryBytes"])
    args = c["args"]  # the sized caches reach the engine's flags
    assert args[args.index("--swap-space") + 1] == str(sizes["swapSpaceGib"])
    assert args[args.index("--max-encoder-cache") + 1] == str(sizes["encoderCacheTokens"])
    assert condition(status, "EngineFit")["reason"] == "AutoCPUOnly"


@pytest.mark.parametrize("kind", ["vllm", "fastdeploy"])
def test_a_gpu_engine_on_cpu_only_nodes_says_why_nothing_runs(kind):
    _, plan, status = planned(svc({"kind": kind}), [CPU])
    assert plan.capacity == 0 and plan.placed == 0
    fit = condition(status, "EngineFit")
    assert (fit["status"], fit["reason"]) == ("False", "NoCPUBuild")
    assert f"engine {kind} runs on GPUs" in fit["message"] and "auto or warmfleet" in fit["message"]
    assert status["pools"][0]["name"] in fit["message"]
    assert ("NoCPUBuild", fit["message"]) in warnings({}, status)
    # beside a GPU pool the CPU pool only says, in its own status, that it hosts none
    _, plan, status = planned(svc({"kind": kind}), [CPU, l4()])
    assert condition(status, "EngineFit")["reason"] == "EngineFromSpec" and plan.capacity > 0
    cpu_pool = next(p for p in status["pools"] if not p["shape"]["gpusPerNode"])
    assert not cpu_pool["fits"] and "engine.kind auto or warmfleet" in cpu_pool["message"]


@pytest.mark.parametrize("kind", ["vllm", "fastdeploy"])
def test_gpus_per_replica_0_is_refused_for_gpu_engines(kind):
    with pytest.raises(SpecError, match=f"is 0, but engine {kind} runs on GPUs"):
        planned(svc({"kind": kind}, server={"gpusPerReplica": 0}), [h200()])


def test_gpus_per_replica_0_with_auto_is_warmfleet_on_gpu_nodes_without_a_gpu_request():
    _, plan, status = planned(svc(server={"gpusPerReplica": 0, "cpus": 16}), [h200()])
    assert plan.engine == "warmfleet" and "gpusPerReplica is 0" in status["engine"]["reason"]
    assert condition(status, "EngineFit")["reason"] == "AutoCPUOnly"  # no warning: no GPU is taken
    (c,) = server_containers(plan)
    assert not any("gpu" in k for k in c["resources"]["limits"])
    assert status["pools"][0]["sizes"]["replicasPerNode"] == 4


def test_warmfleet_on_a_gpu_pool_runs_but_warns():
    _, plan, status = planned(svc({"kind": "warmfleet"}), [h200(), CPU])
    assert plan.engine == "warmfleet" and server_containers(plan)  # still rendered: a choice, not an error
    fit = condition(status, "EngineFit")
    gpu_pool = next(p["name"] for p in status["pools"] if p["shape"]["gpusPerNode"])
    cpu_pool = next(p["name"] for p in status["pools"] if not p["shape"]["gpusPerNode"])
    assert (fit["status"], fit["reason"]) == ("False", "NoGPUAttentionBackend")
    assert "no GPU attention backend" in fit["message"] and gpu_pool in fit["message"]
    assert cpu_pool not in fit["message"]  # only the GPU pools are named
    # a Warning Event when it appears, not again on the next pass with the same reason
    assert ("NoGPUAttentionBackend", fit["message"]) in warnings({}, status)
    assert all(r != "NoGPUAttentionBackend" for r, _ in warnings(status, status))


def test_render_warns_about_warmfleet_on_gpus_and_strict_fails(tmp_path, capsys):
    from warmfleet.cli import main

    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump_all([h200()]))
    f = tmp_path / "svc.yaml"
    f.write_text(yaml.safe_dump(svc({"kind": "warmfleet"})))
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes)]) == 0
    err = capsys.readouterr().err
    assert "engine warmfleet has no GPU attention backend" in err and "set spec.engine.kind to auto or vllm" in err
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes), "--strict"]) == 1
    f.write_text(yaml.safe_dump(svc()))  # auto: vLLM, nothing to warn about
    capsys.readouterr()
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes), "--strict"]) == 0
    out = capsys.readouterr()
    assert "GPU attention" not in out.err
    status = list(yaml.safe_load_all(out.out))[-1]["status"]
    assert status["engine"]["kind"] == "vllm"


def test_render_of_the_cpu_example_runs_warmfleet_without_gpus(capsys):
    from pathlib import Path

    from warmfleet.cli import main

    repo = Path(__file__).resolve().parents[1]
    example = repo / "examples/inferenceservice-cpu.yaml"
    assert main(["operator", "render", "-f", str(example), "--nodes", str(repo / "examples/nodes.yaml"), "--strict"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    status = docs[-1]["status"]
    assert status["engine"]["kind"] == "warmfleet" and status["engine"]["chosenBy"] == "auto"
    (pool,) = status["pools"]
    assert pool["nodes"] == ["cpu-a"] and pool["name"].startswith("cpu-") and pool["fits"]
    assert pool["sizes"]["replicasPerNode"] == 4  # 16 allocatable CPUs / server.cpus 4
    deps = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "qwen-cpu-router"]
    assert sum(d["spec"]["replicas"] for d in deps) == yaml.safe_load(example.read_text())["spec"]["replicas"]
    for d in deps:
        pod = d["spec"]["template"]["spec"]
        assert pod["tolerations"] == []
        assert not any("gpu" in k for c in pod["containers"] for k in c["resources"]["limits"])


# ---- default images ----

@pytest.mark.parametrize("image", [engine_descriptions.VLLM_IMAGE, engine_descriptions.FASTDEPLOY_IMAGE])
def test_default_images_are_pinned_official_releases(image):
    repo, _, tag = image.rpartition(":")
    assert repo and "/" in repo and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), image
    assert tag != "latest" and "@" not in image


def test_default_images_by_kind():
    assert engine_descriptions.VLLM.default_image == "vllm/vllm-openai:v0.32.0"  # the vllm 0.32 the flags were checked on
    assert engine_descriptions.FASTDEPLOY.default_image.endswith("/paddlepaddle/fastdeploy-cuda-12.6:2.3.0")
    assert engine_descriptions.WARMFLEET.default_image is None  # the operator's own --default-image


@pytest.mark.parametrize("kind,want", [("vllm", engine_descriptions.VLLM_IMAGE),
                                       ("fastdeploy", engine_descriptions.FASTDEPLOY_IMAGE),
                                       ("warmfleet", IMAGES.engine)])
def test_engine_image_is_optional(kind, want):
    _, plan, _ = planned(svc({"kind": kind}), [l4()])
    assert {c["image"] for c in server_containers(plan)} == {want}


def test_an_explicit_engine_image_wins_and_server_image_never_runs_a_peer_engine():
    _, plan, _ = planned(svc({"kind": "vllm", "image": "mirror.example/vllm:v0.32.0"}), [l4()])
    assert {c["image"] for c in server_containers(plan)} == {"mirror.example/vllm:v0.32.0"}
    # spec.server.image is the warmfleet image of the router and fetch step: vLLM still gets its own image
    _, plan, _ = planned(svc(server={"image": "mine.example/warmfleet:1"}), [l4()])
    assert {c["image"] for c in server_containers(plan)} == {engine_descriptions.VLLM_IMAGE}
    _, plan, _ = planned(svc({"kind": "warmfleet"}, server={"image": "mine.example/warmfleet:1"}), [l4()])
    assert {c["image"] for c in server_containers(plan)} == {"mine.example/warmfleet:1"}


def test_operator_wide_images_replace_the_pinned_defaults(tmp_path, capsys, monkeypatch):
    """An air-gapped cluster: --vllm-image / WARMFLEET_FASTDEPLOY_IMAGE (chart: operator.defaultImages) replace the pinned
    images in what `warmfleet operator render` prints; a spec's engine.image still wins; warmfleet's engine is untouched."""
    from warmfleet.cli import main

    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump_all([l4()]))
    f = tmp_path / "svc.yaml"

    def images(engine, *flags):
        f.write_text(yaml.safe_dump(svc(engine)))
        capsys.readouterr()
        assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes), *flags]) == 0
        docs = list(yaml.safe_load_all(capsys.readouterr().out))
        deps = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "qwen-router"]
        return {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in deps}

    mirror = "registry.internal/vllm/vllm-openai:v0.32.0"
    assert images(None) == {engine_descriptions.VLLM_IMAGE}
    assert images(None, "--vllm-image", mirror) == {mirror}  # auto on GPUs: vLLM, from the mirror
    assert images({"kind": "vllm", "image": "mine.example/vllm:1"}, "--vllm-image", mirror) == {"mine.example/vllm:1"}
    monkeypatch.setenv("WARMFLEET_FASTDEPLOY_IMAGE", "registry.internal/fastdeploy:2.3.0")
    assert images({"kind": "fastdeploy"}) == {"registry.internal/fastdeploy:2.3.0"}
    assert images({"kind": "fastdeploy"}, "--fastdeploy-image", "other.internal/fd:2.3.0") == {"other.internal/fd:2.3.0"}
    assert images({"kind": "warmfleet"}, "--vllm-image", mirror, "--default-image", "engine.internal/wf:1") == {
        "engine.internal/wf:1"}
    with pytest.raises(SystemExit) as exit_:  # a bad flag: argparse's one line, exit 2
        main(["operator", "render", "-f", str(f), "--nodes", str(nodes), "--vllm-image", "a b"])
    assert exit_.value.code == 2 and "not an image reference: 'a b'" in capsys.readouterr().err


def test_engine_of_refuses_an_unresolved_auto():
    from warmfleet.operator.spec.inference_service import parse_spec

    spec = parse_spec({"model": {"path": "/m"}})
    with pytest.raises(ValueError, match="not resolved"):
        engine_descriptions.engine_of(spec)
    resolved, choice = engine_choice.resolve(spec, [node_info(l4())])
    assert engine_descriptions.engine_of(resolved) is engine_descriptions.VLLM and choice.chosen_by == "auto"
    assert spec.engine.kind == "auto"  # the parsed spec itself is left as written
