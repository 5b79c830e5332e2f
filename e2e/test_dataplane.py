"""The data plane, started from the operator's own output.

Pods under kwok never run, so this test takes the Deployments the operator actually created
for examples/inferenceservice.yaml (container command, args, env, probes), and starts them as
local processes on loopback: one replica of each server pool (H200 and L4) and one router. It
substitutes only what cannot work on this machine; every substitution is listed in
``SUBSTITUTIONS`` below, applied by flag name, and asserted to hit a flag the operator rendered.
Then the official ``openai`` client holds a multimodal conversation through the router: the
repeated prefix and image land on the same replica with ``cached_tokens`` > 0, streamed too.
This proves the flags the operator renders are flags ``warmfleet serve`` / ``route`` accept.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from conftest import Example
from e2e_support import (Cluster, LocalProcess, container_env, expand_k8s_vars, free_port, wait_for,
                         warmfleet_command)

SERVICE_LABEL = "serving.warmfleet.io/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
LOCAL_SWAP_GIB = "0.25"
START_TIMEOUT_S = 240

# What cannot work locally, and what stands in for it (each is asserted to replace a rendered value).
SUBSTITUTIONS = """
server --model /models/...        -> the tiny Qwen2-VL checkpoint (the model-store PVC is not on this machine)
server --host 0.0.0.0             -> 127.0.0.1 (loopback only; there is no pod network)
server --kv-events-host 0.0.0.0   -> 127.0.0.1 (same)
server containerPort http 8000    -> --port <free port> (the rendered args rely on the default 8000; two
                                     replicas on one host cannot share it)
server --kv-events-port 5557      -> a free port (same reason)
server --dtype bfloat16           -> float32 (Paddle's CPU kernels run float32 only; the server says so)
server --swap-space <pool GiB>    -> 0.25 (the swap tier is allocated up front; the pod's memory limit of
                                     tens of GiB per replica does not exist on this machine)
router --discover-service NS/NAME -> --replica URL,events=tcp://... of the two local replicas (EndpointSlice
                                     discovery would hand out kwok's fake pod IPs)
router --model /models/...        -> the tiny checkpoint (tokenizer and chat template)
router --host 0.0.0.0, --port 8000 -> 127.0.0.1 and a free port
command ["warmfleet"]             -> this environment's `warmfleet` console script
env                               -> the container's env resolved like the kubelet does (POD_NAME from a real
                                     pod of the Deployment, the API key from the cluster's Secret, HOME as
                                     rendered), layered over the test's own environment (PATH, venv)
"""


def substitute(args: list[str], flag: str, value: str, log: list[str], *, expect: str | None = None) -> list[str]:
    """Replace the value of `flag` (which the operator must have rendered) with `value`."""
    assert flag in args, f"the operator did not render {flag}: {args}"
    i = args.index(flag)
    old = args[i + 1]
    if expect is not None:
        assert old.startswith(expect), f"{flag} rendered as {old!r}, expected {expect!r}..."
    log.append(f"{flag} {old} -> {value}")
    return [*args[: i + 1], value, *args[i + 2:]]


def container_of(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def probe_path(container: dict[str, Any], kind: str) -> str:
    probe = container[kind]["httpGet"]
    assert probe["port"] == "http", probe
    return probe["path"]


def a_pod_of(cluster: Cluster, ns: str, deployment: dict[str, Any]) -> dict[str, Any]:
    sel = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    pods = wait_for(lambda: cluster.kubectl_json("-n", ns, "get", "pods", "-l", sel)["items"], 60,
                    f"a pod of {deployment['metadata']['name']}")
    return sorted(pods, key=lambda p: p["metadata"]["name"])[0]


def png(seed: int, w: int = 112, h: int = 84) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class Fleet:
    def __init__(self) -> None:
        self.procs: list[LocalProcess] = []
        self.replicas: dict[str, dict[str, Any]] = {}  # replica id (pod name) -> url, events, pool, args
        self.router_url = ""
        self.router_args: list[str] = []
        self.substitutions: list[str] = []

    def check(self) -> None:
        for p in self.procs:
            p.check_alive()


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-vl") / "model"
    work = out.parent
    from warmfleet.operator.wiring.command import ENGINE_REPOSITORY

    proc = LocalProcess("make-tiny-model", [*warmfleet_command(ENGINE_REPOSITORY), "make-tiny-model", str(out), "--arch", "qwen2_vl"],
                        env=dict(os.environ), cwd=work, log_path=work / "make-tiny-model.log")
    assert proc.proc.wait(timeout=180) == 0, proc.log()
    proc.stop()
    return out


@pytest.fixture(scope="module")
def fleet(e2e_cluster: Cluster, example: Example, tiny_vl: Path, tmp_path_factory) -> Iterator[Fleet]:
    c, ns = e2e_cluster, example.namespace
    deps = c.kubectl_json("-n", ns, "get", "deployments", "-l", f"{SERVICE_LABEL}={example.name}")["items"]
    servers = sorted((d for d in deps if d["metadata"]["labels"][COMPONENT_LABEL] == "server"),
                     key=lambda d: d["metadata"]["name"])
    router = next(d for d in deps if d["metadata"]["labels"][COMPONENT_LABEL] == "router")
    products = {d["metadata"]["name"]: _product(d) for d in servers}
    assert sorted(products.values()) == ["NVIDIA-H200", "NVIDIA-L4"], products
    work = tmp_path_factory.mktemp("dataplane")  # cwd outside the repo (operator/ shadows the stdlib)
    f = Fleet()
    try:
        for dep in servers:  # one replica of each pool: both pools' rendered flags must be accepted
            ctr = container_of(dep, "server")
            pod = a_pod_of(c, ns, dep)
            env = container_env(c, ns, ctr, pod)
            assert ctr["command"] == ["warmfleet"], ctr["command"]
            args = [expand_k8s_vars(a, env) for a in ctr["args"]]
            assert args[0] == "serve", args
            http_port = next(p["containerPort"] for p in ctr["ports"] if p["name"] == "http")
            assert "--port" not in args and http_port == 8000, (args, http_port)  # served on the default port
            port, events = free_port(), free_port()
            subs: list[str] = []
            args = substitute(args, "--model", str(tiny_vl), subs, expect="/models/")
            args = substitute(args, "--host", "127.0.0.1", subs, expect="0.0.0.0")
            args = substitute(args, "--kv-events-host", "127.0.0.1", subs, expect="0.0.0.0")
            args = substitute(args, "--kv-events-port", str(events), subs, expect="5557")
            args = substitute(args, "--swap-space", LOCAL_SWAP_GIB, subs)
            args = substitute(args, "--dtype", "float32", subs)
            args += ["--port", str(port)]
            subs.append(f"containerPort {http_port} -> --port {port}")
            replica_id = args[args.index("--replica-id") + 1]
            assert replica_id == pod["metadata"]["name"], "$(POD_NAME) expands to the pod's name"
            f.substitutions += [f"{dep['metadata']['name']}: {s}" for s in subs]
            proc = LocalProcess(f"replica {replica_id}", [*warmfleet_command(ctr["image"]), *args],
                                env={**os.environ, **env}, cwd=work, log_path=work / f"{replica_id}.log")
            f.procs.append(proc)
            f.replicas[replica_id] = {"url": f"http://127.0.0.1:{port}", "events": f"tcp://127.0.0.1:{events}",
                                      "pool": dep["metadata"]["labels"]["serving.warmfleet.io/pool"],
                                      "product": products[dep["metadata"]["name"]], "args": args,
                                      "ready": probe_path(ctr, "readinessProbe"),
                                      "health": probe_path(ctr, "livenessProbe")}
        for rid, r in f.replicas.items():  # the pod's own probes, unauthenticated like the kubelet's
            wait_for(lambda: (f.check(), httpx.get(r["url"] + r["ready"], timeout=5).status_code == 200)[1],
                     START_TIMEOUT_S, f"replica {rid} readiness probe {r['ready']}")
            assert httpx.get(r["url"] + r["health"], timeout=5).status_code == 200

        ctr = container_of(router, "router")
        env = container_env(c, ns, ctr, a_pod_of(c, ns, router))
        assert ctr["command"] == ["warmfleet"], ctr["command"]
        args = [expand_k8s_vars(a, env) for a in ctr["args"]]
        assert args[0] == "route", args
        port = free_port()
        subs = []
        i = args.index("--discover-service")
        assert args[i + 1] == f"{ns}/{example.name}-replicas", args
        subs.append(f"--discover-service {args[i + 1]} -> --replica URL,events=... x{len(f.replicas)}")
        args = args[:i] + args[i + 2:]
        for r in f.replicas.values():
            args += ["--replica", f"{r['url']},events={r['events']}"]
        args = substitute(args, "--model", str(tiny_vl), subs, expect="/models/")
        args = substitute(args, "--host", "127.0.0.1", subs, expect="0.0.0.0")
        args = substitute(args, "--port", str(port), subs, expect="8000")
        f.substitutions += [f"{router['metadata']['name']}: {s}" for s in subs]
        f.router_args = args
        proc = LocalProcess("router", [*warmfleet_command(ctr["image"]), *args], env={**os.environ, **env}, cwd=work,
                            log_path=work / "router.log")
        f.procs.append(proc)
        f.router_url = f"http://127.0.0.1:{port}"
        ready = probe_path(ctr, "readinessProbe")
        wait_for(lambda: (f.check(), httpx.get(f.router_url + ready, timeout=5).status_code == 200)[1],
                 START_TIMEOUT_S, f"router readiness probe {ready}")
        # the full replicas view is an admin route: the router's admin key when the operator gave it one (else the
        # router answers it on its own host, as here)
        admin = env.get("WARMFLEET_ADMIN_KEY")
        headers = {"authorization": f"Bearer {admin}"} if admin else {}

        def synced() -> bool:
            f.check()
            resp = httpx.get(f.router_url + "/v1/router/replicas", headers=headers, timeout=5)
            reps = resp.json()["replicas"]
            return len(reps) == len(f.replicas) and all(x["synced"] and x["healthy"] for x in reps)

        wait_for(synced, 90, "the router synced with both replicas' KV events")
        yield f
    finally:
        for p in reversed(f.procs):
            p.stop()
        for p in f.procs:
            print(f"==== {p.name}: {' '.join(p.argv)}\n{p.log(40)}")


def _product(dep: dict[str, Any]) -> str:
    terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    expr = next(e for e in terms[0]["matchExpressions"] if e["key"] == "nvidia.com/gpu.product")
    return expr["values"][0]


SYSTEM = ("You are the warmfleet vision assistant. You describe pictures precisely, name colours and shapes, "
          "and answer follow-up questions about the same picture briefly. ") * 6


def test_operator_rendered_fleet_serves_multimodal_conversation_with_prefix_hits(
        fleet: Fleet, example: Example, e2e_cluster: Cluster) -> None:
    status = e2e_cluster.kubectl_json("-n", example.namespace, "get", "wfis", example.name)["status"]
    model = status["model"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(7)).decode()}}
    with openai.OpenAI(base_url=fleet.router_url + "/v1", api_key=example.api_key, max_retries=0, timeout=180) as client:
        # The endpoint enforces the key from the Secret the example names.
        with openai.OpenAI(base_url=fleet.router_url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert model in [m.id for m in client.models.list().data]

        turns: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]},
        ]
        raw = client.chat.completions.with_raw_response.create(model=model, messages=turns, max_tokens=4, temperature=0)
        first = raw.parse()
        first_replica = raw.headers["x-warmfleet-replica"]
        assert first_replica in fleet.replicas, (first_replica, list(fleet.replicas))
        assert first.usage.prompt_tokens_details.model_dump().get("image_tokens", 0) > 0

        # Turn 2 repeats the system prompt, the image and turn 1: same replica, cached prefix.
        turns += [{"role": "assistant", "content": first.choices[0].message.content or "a picture"},
                  {"role": "user", "content": "Which colour dominates?"}]

        def second_turn_hits() -> Any:
            r = client.chat.completions.with_raw_response.create(model=model, messages=turns, max_tokens=4, temperature=0)
            return r if r.parse().usage.prompt_tokens_details.cached_tokens > 0 else None

        raw2 = wait_for(second_turn_hits, 30, "a prefix hit on turn 2 (the replica's KV events reaching the router)")
        second = raw2.parse()
        assert raw2.headers["x-warmfleet-replica"] == first_replica
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens

        # Turn 3, streamed: usage arrives in the last chunk.
        turns += [{"role": "assistant", "content": second.choices[0].message.content or "red"},
                  {"role": "user", "content": "Describe it in one word."}]
        with client.chat.completions.with_streaming_response.create(
                model=model, messages=turns, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}) as resp:
            replica = resp.headers["x-warmfleet-replica"]
            chunks = list(resp.parse())
        assert replica == first_replica
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens_details.cached_tokens
        assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)

    print("substitutions:\n  " + "\n  ".join(fleet.substitutions))
