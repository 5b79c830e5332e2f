"""Two real vLLM 0.32 replicas started from the rendered spec.lora container, two PEFT adapters loaded by the
operator's adapter pass, behind `warmfleet route --engine vllm`: the router's prediction (vLLM's ("lora", name,
path) extra key on every block) equals vLLM's cached_tokens per adapter, and adapters never share blocks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from warmfleet.livefleet import wait_for
from warmfleet.operator.passes import adapters_pass
from warmfleet.server.tiny_checkpoints.lora import make_tiny_adapter

from .conftest import routed_fleet
from .test_vllm_lora_runtime import LoraReplica

SYSTEM = "You are the warmfleet assistant. Answer briefly and precisely about adapters and routing. " * 8
A = {"authorization": "Bearer key-tenant-a"}


@pytest.fixture(scope="module")
def lora_fleet(vllm_python, tmp_path_factory):
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    work = tmp_path_factory.mktemp("vllm-lora-router")
    model = make_tiny_vl_model(work / "vl-bench", arch="qwen2_vl", size="bench", seed=0)
    wanted = {name: str(make_tiny_adapter(model, work / "adapters" / name, seed=seed))
              for seed, name in enumerate(("sql", "chat"))}
    reps = [LoraReplica(vllm_python, model, work / f"vllm-lora-{i}.log") for i in range(2)]

    def load_adapters(reps: list) -> None:
        async def load_all():
            async with httpx.AsyncClient() as http:
                return [await adapters_pass.sync_pod(http, r.url, wanted, {}) for r in reps]

        assert all(res.errors == {} for res in asyncio.run(load_all()))

    with routed_fleet(reps, model, work, load_adapters,
                      ready=lambda x: (x["adapters"] or {}).get("served") == ["chat", "sql"],
                      what="the router synced with both vLLM replicas and learned their adapters") as fleet:
        yield fleet


def ask(fleet, model: str, question: str, system: str) -> tuple[str, int, int]:
    """(replica, predicted cached tokens, vLLM's cached tokens) of one chat request through the router."""
    r = httpx.post(fleet.router + "/v1/chat/completions", headers=A, timeout=120, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                      {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    predicted = int(r.headers["x-warmfleet-route"].rsplit("predicted_cached_tokens=", 1)[1])
    return r.headers["x-warmfleet-replica"], predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prediction_equals_vllms_cached_tokens_per_adapter(lora_fleet):
    f = lora_fleet
    system = "LoRA prediction test. " + SYSTEM
    for model in ("sql", "chat", "tiny"):
        before = {rid: x["gpu_blocks"] for rid, x in f.replicas_view().items()}
        home, predicted, cached = ask(f, model, "What is an adapter?", system)
        assert predicted == 0 and cached == 0, model  # the same text under another adapter: none of its blocks
        wait_for(lambda: f.replicas_view()[home]["gpu_blocks"] > before[home], "vLLM's BlockStored events indexed",
                 [], 10)
        for q in ("And a slot?", "And a rank?"):
            replica, predicted, cached = ask(f, model, q, system)
            assert replica == home, model
            assert cached > 0 and predicted == cached, model  # vLLM's own count equals the router's prediction
    check = httpx.get(f.router + "/v1/router/replicas").json()["hash_check"]
    assert check["mismatched_blocks"] == 0
