"""LoRA through a real `warmfleet serve` on loopback: vLLM's surface (models, model selection, runtime load/unload, metric)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from serve_replica import START_TIMEOUT_S, Replica
from warmfleet.server.hashing import adapter_digest
from warmfleet.server.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "golden_lora"
NUM_GREEDY = json.loads((GOLDEN / "manifest.json").read_text())["num_greedy"]
USER, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory) -> Iterator[Replica]:
    """The golden checkpoint (tests/golden's qwen2_tiny) with adapter a at start, one device slot."""
    args = ("--lora-modules", f"a={GOLDEN / 'qwen2_tiny' / 'a'}", "--max-loras", "1", "--max-cpu-loras", "2",
            "--api-key", USER, "--admin-key", ADMIN)
    with Replica(tiny_model_dir, tmp_path_factory.mktemp("serve-cwd"), args) as r:
        r.wait_for_log("ready", START_TIMEOUT_S)
        yield r


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def golden(label: str) -> tuple[list[int], list[int]]:
    g = np.load(GOLDEN / "qwen2_tiny" / "golden.npz")
    return g["prompt_0"].tolist(), g[f"{label}_tokens_0"].tolist()


def completion(url: str, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_GREEDY, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, headers=auth(USER), timeout=60)


def expected_text(tiny_model_dir, label: str) -> str:
    return Tokenizer(str(tiny_model_dir)).decode(golden(label)[1])


def test_models_list_adapters_with_parent(replica):
    data = httpx.get(replica.url + "/v1/models", headers=auth(USER)).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("a", "tiny")]
    assert data[1]["root"].endswith("qwen2_tiny/a")
    # the router's key for the adapter's chain root: the engine's digest of its files
    assert data[1]["lora_digest"] == adapter_digest(GOLDEN / "qwen2_tiny" / "a") and data[0]["lora_digest"] is None


def test_model_selects_the_adapter(replica, tiny_model_dir):
    prompt, _ = golden("a")
    for label, model in (("a", "a"), ("base", "tiny")):
        r = completion(replica.url, model, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == expected_text(tiny_model_dir, label)


def test_unknown_model_is_404_in_openai_shape(replica):
    r = completion(replica.url, "nope", [1, 2, 3])
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and err["type"] == "invalid_request_error"


def test_admin_routes_need_the_admin_key(replica):
    body = {"lora_name": "b", "lora_path": str(GOLDEN / "qwen2_tiny" / "b")}
    for headers in ({}, auth(USER)):
        r = httpx.post(replica.url + "/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(replica.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=auth(USER))
    assert r.status_code == 401


def test_unreadable_adapter_is_refused(replica, tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "adapter_config.json").write_text((GOLDEN / "qwen2_tiny" / "a" / "adapter_config.json").read_text())
    (d / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    r = httpx.post(replica.url + "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(d)},
                   headers=auth(ADMIN), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora_adapter"
    assert "broken" not in [m["id"] for m in httpx.get(replica.url + "/v1/models", headers=auth(USER)).json()["data"]]


def test_load_run_concurrently_and_unload_at_runtime(replica, tiny_model_dir):
    url = replica.url
    body = {"lora_name": "b", "lora_path": str(GOLDEN / "qwen2_tiny" / "b")}
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth(ADMIN))
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    ids = [m["id"] for m in httpx.get(url + "/v1/models", headers=auth(USER)).json()["data"]]
    assert ids == ["tiny", "a", "b"]

    # one device slot, two adapters at once: the second waits for the slot, neither is refused
    prompt, _ = golden("a")

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [c.post(url + "/v1/completions", headers=auth(USER), json={
                "model": m, "prompt": prompt, "max_tokens": NUM_GREEDY, "temperature": 0, "ignore_eos": True})
                for m in ("a", "b", "a", "b")]
            return list(await asyncio.gather(*reqs))

    for r, label in zip(asyncio.run(both()), ("a", "b", "a", "b")):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text(tiny_model_dir, label)

    metrics = httpx.get(url + "/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels["max_lora"] == "1" and labels["running_lora_adapters"] in ("a", "b")
    assert labels["waiting_lora_adapters"] == ""
    assert float(line.rsplit(" ", 1)[1]) > 1.7e9  # a timestamp, as vLLM sets it
    # one slot shared by a and b: each switch between them copied one into the slot (the bench's adapter loads)
    loads = next(ln for ln in metrics.splitlines() if ln.startswith("warmfleet:lora_device_loads_total{"))
    assert float(loads.rsplit(" ", 1)[1]) >= 2

    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    assert completion(url, "b", prompt).status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth(ADMIN))
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/nonexistent"},
                     headers=auth(ADMIN))
    assert bad.status_code == 400 and "PEFT adapter directory" in bad.json()["error"]["message"]

