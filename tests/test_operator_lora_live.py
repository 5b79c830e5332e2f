"""The operator's adapter pass against a real `warmfleet serve` (tiny checkpoint, the golden PEFT adapters): started
with the LoRA flags and key variables the operator renders for spec.lora, adapters loaded, re-pointed and unloaded at
run time through the admin key while /v1/models takes the API key."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from operator_fixtures.shapes import a100, service
from serve_replica import START_TIMEOUT_S, Replica
from warmfleet.operator.passes import adapters_pass
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.spec import constants
from warmfleet.server.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "golden_lora"
NUM_GREEDY = json.loads((GOLDEN / "manifest.json").read_text())["num_greedy"]
USER, ADMIN = "user-key", "admin-key"
LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-cpu-loras", "--max-lora-rank")


def rendered_server() -> dict:
    body = service(spec={"model": {"path": "/models/qwen", "hiddenSize": 64},
                         "lora": {"maxLoras": 1, "maxCpuLoras": 2, "maxLoraRank": 8,
                                  "modelShape": {"numLayers": 2, "intermediateSize": 128},
                                  "adminKeySecret": {"name": "admin", "key": "k"}},
                         "router": {"apiKeySecret": {"name": "keys", "key": "api-key"}}, "replicas": 1})
    (dep,) = [o for o in render(body, [node_info(a100())], objects.Images("e", "r")) if o["kind"] == "Deployment"
              and o["metadata"]["labels"][constants.COMPONENT_LABEL] == "server"]
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server")


def lora_args(args: list[str]) -> list[str]:
    """The rendered LoRA flags and values (the sizes are the node's, not this machine's: the rest is Replica's)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == "--enable-lora":
            out.insert(0, args[i])
        elif args[i] in LORA_FLAGS:
            out += args[i:i + 2]
            i += 1
        i += 1
    return out


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory):
    container = rendered_server()
    env = {e["name"]: e["valueFrom"].get("secretKeyRef") for e in container["env"] if "valueFrom" in e}
    assert env["WARMFLEET_API_KEY"] == {"name": "keys", "key": "api-key"}
    assert env["WARMFLEET_ADMIN_KEY"] == {"name": "admin", "key": "k"}
    args = lora_args(container["args"])
    assert args[0] == "--enable-lora"
    assert dict(zip(args[1::2], args[2::2])) == {"--max-loras": "1", "--max-cpu-loras": "2", "--max-lora-rank": "8"}
    mp = pytest.MonkeyPatch()
    mp.setenv("WARMFLEET_API_KEY", USER)  # what the Secrets hold; the pod reads them through these variables
    mp.setenv("WARMFLEET_ADMIN_KEY", ADMIN)
    try:
        with Replica(tiny_model_dir, tmp_path_factory.mktemp("serve-cwd"), tuple(args)) as r:
            r.wait_for_log("ready", START_TIMEOUT_S)
            yield r
    finally:
        mp.undo()


def sync(url: str, wanted: dict[str, str]) -> adapters_pass.PodResult:
    async def go():
        async with httpx.AsyncClient() as http:
            return await adapters_pass.sync_pod(http, url, wanted, {"Authorization": f"Bearer {USER}"},
                                                {"Authorization": f"Bearer {ADMIN}"})
    return asyncio.run(go())


def text_of(url: str, model: str) -> httpx.Response:
    prompt = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")["prompt_0"].tolist()
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {USER}"}, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": NUM_GREEDY, "temperature": 0, "ignore_eos": True})


def expected(tiny_model_dir, label: str) -> str:
    return Tokenizer(str(tiny_model_dir)).decode(np.load(GOLDEN / "qwen2_tiny" / "golden.npz")[f"{label}_tokens_0"].tolist())


def test_the_pass_loads_repoints_and_unloads_on_a_real_server(replica, tiny_model_dir, tmp_path):
    a, b = str(GOLDEN / "qwen2_tiny" / "a"), str(GOLDEN / "qwen2_tiny" / "b")
    res = sync(replica.url, {"x": a})
    assert (res.loaded, res.errors, res.actions) == ({"x"}, {}, ["load x"])
    r = text_of(replica.url, "x")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(tiny_model_dir, "a")

    # the same name at a new path (its source changed): unloaded, loaded from the new directory, now serving b
    moved = tmp_path / "b-2"
    shutil.copytree(b, moved)
    res = sync(replica.url, {"x": str(moved)})
    assert res.actions == ["unload x", "load x"] and res.errors == {}
    assert text_of(replica.url, "x").json()["choices"][0]["text"] == expected(tiny_model_dir, "b")

    # a directory without the files yet (the sidecar has not fetched it): reported, not fatal
    res = sync(replica.url, {"x": str(moved), "y": str(tmp_path / "not-there")})
    assert res.loaded == {"x"} and "y" in res.errors and "HTTP 400" in res.errors["y"]

    res = sync(replica.url, {})
    assert res.actions == ["unload x"] and res.errors == {}
    assert text_of(replica.url, "x").status_code == 404
    models = httpx.get(replica.url + "/v1/models", headers={"Authorization": f"Bearer {USER}"}).json()["data"]
    assert [c["id"] for c in models] == ["tiny"]


def test_load_with_the_api_key_alone_is_refused(replica):
    async def go():
        async with httpx.AsyncClient() as http:
            return await adapters_pass.sync_pod(http, replica.url, {"z": str(GOLDEN / "qwen2_tiny" / "a")},
                                                {"Authorization": f"Bearer {USER}"})
    res = asyncio.run(go())
    assert res.loaded == set() and "HTTP 401" in res.errors["z"]
