"""A real `warmfleet serve` on the tiny Qwen2-VL checkpoint, answered by the official openai client with images.

Covers data: URIs, http URLs from an allow-listed loopback server, uuid-only reuse, streaming,
image-aware prefix caching as seen in `cached_tokens`, the encoder and processor caches in
/metrics, and a processor-cache process that dies (requests keep working, it is restarted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes, image_part
from warmfleet.livefleet import MediaServer, wait_for
from serve_replica import START_TIMEOUT_S, Replica

pytestmark = pytest.mark.slow

BLOCK = 16


def messages(part: dict, question: str = "What is shown here?", system: str = "You describe pictures.") -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": [part, {"type": "text", "text": question}]}]


def image_tokens(usage) -> int:
    return usage.prompt_tokens_details.model_dump()["image_tokens"]


def metric(text: str, name: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return None


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-vl-serve") / "model"
    cmd = [sys.executable, "-c", "import sys; from warmfleet.cli import main; sys.exit(main())",
           "make-tiny-model", str(out), "--arch", "qwen2_vl"]
    subprocess.run(cmd, cwd=out.parent, check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def image_server(tmp_path_factory) -> Iterator[str]:
    """A plain http.server on loopback serving a few PNGs."""
    with MediaServer(tmp_path_factory.mktemp("images")) as media:
        media.put("cat.png", image_bytes(96, 80, seed=11))
        yield media.url


@pytest.fixture(scope="module")
def vl_replica(vl_dir, tmp_path_factory) -> Iterator[Replica]:
    extra = ("--allowed-media-host", "127.0.0.1", "--max-processor-cache", "0.25", "--max-encoder-cache", "4096")
    with Replica(vl_dir, tmp_path_factory.mktemp("vl-serve-cwd"), extra) as r:
        r.cache_record = r.wait_for_log("processor cache started", START_TIMEOUT_S)
        r.wait_for_log("ready", START_TIMEOUT_S)
        yield r


@pytest.fixture(scope="module")
def client(vl_replica) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=vl_replica.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client: openai.OpenAI, msgs: list[dict], **kw):
    return client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=2, temperature=0, **kw)


def test_data_uri_image(client):
    r = chat(client, messages(image_part(data_uri(image_bytes(64, 48, seed=1)))))
    assert r.choices[0].finish_reason in ("stop", "length")
    assert image_tokens(r.usage) == 4  # 64x48 → 56x56 → 2x2 merged tokens
    assert r.usage.prompt_tokens > 4


def test_url_image_from_an_allow_listed_loopback_server(client, image_server):
    r = chat(client, messages(image_part(f"{image_server}/cat.png")))
    assert image_tokens(r.usage) > 0
    with pytest.raises(openai.BadRequestError) as exc:  # 127.0.0.2 is loopback too, but not allow-listed
        chat(client, messages(image_part(image_server.replace("127.0.0.1", "127.0.0.2") + "/cat.png")))
    assert exc.value.body["param"] == "messages.1.content.0" and "non-public address" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, messages(image_part(f"{image_server}/missing.png")))
    assert "HTTP 404" in exc.value.body["message"]


def test_uuid_only_reuse(client):
    uri = data_uri(image_bytes(120, 90, seed=2))
    first = chat(client, messages(image_part(uri, uuid="live-cat")))
    again = chat(client, messages(image_part(uuid="live-cat")))
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert image_tokens(again.usage) == image_tokens(first.usage) > 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # same uuid, same prompt: the prefix cache hits
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, messages(image_part(uuid="never-sent")))
    assert exc.value.body["code"] == "unknown_image" and "never-sent" in exc.value.body["message"]


def test_streaming_with_an_image(client):
    stream = chat(client, messages(image_part(data_uri(image_bytes(64, 64, seed=3)))), stream=True,
                  stream_options={"include_usage": True})
    finish, usage = None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
    assert finish in ("stop", "length") and usage is not None and image_tokens(usage) == 4


def test_bad_image_is_a_400_naming_the_part(client):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, messages(image_part("data:image/png;base64,!!!")))
    assert exc.value.body["param"] == "messages.1.content.0"
    assert exc.value.body["message"].startswith("messages[1].content[0]: ")


def test_cached_tokens_follow_the_image(client, vl_replica):
    system = "You look at pictures very carefully and answer in one word. " * 3
    question = "Which colour covers most of this picture, and what else do you notice?"
    x, y = data_uri(image_bytes(224, 224, seed=20)), data_uri(image_bytes(224, 224, seed=21))
    tokens = httpx.post(vl_replica.url + "/tokenize", json={"messages": messages(image_part(x), question, system)},
                        timeout=60).json()["tokens"]
    pad = max(set(tokens), key=tokens.count)  # the image pads are the most frequent token
    first_pad, n_pads = tokens.index(pad), tokens.count(pad)
    assert n_pads == 64 and first_pad >= BLOCK  # 224x224 → 16x16 patches → 64 tokens, after a full text block
    assert len(tokens) - (first_pad + n_pads) > BLOCK  # text after the image

    cold = chat(client, messages(image_part(x), question, system))
    assert cold.usage.prompt_tokens == len(tokens) and cold.usage.prompt_tokens_details.cached_tokens == 0
    same = chat(client, messages(image_part(x), question, system))
    cached = same.usage.prompt_tokens_details.cached_tokens
    assert cached == (len(tokens) - 1) // BLOCK * BLOCK and cached >= first_pad + n_pads  # through the image
    other = chat(client, messages(image_part(y), question, system))
    assert other.usage.prompt_tokens == len(tokens)
    assert other.usage.prompt_tokens_details.cached_tokens == first_pad // BLOCK * BLOCK  # stops before its block

    before = metric(httpx.get(vl_replica.url + "/metrics").text, "warmfleet:encoder_cache_hits_total")
    fresh_text = chat(client, messages(image_part(x), question, "Another system prompt, so no KV prefix is shared."))
    assert fresh_text.usage.prompt_tokens_details.cached_tokens < first_pad
    after = metric(httpx.get(vl_replica.url + "/metrics").text, "warmfleet:encoder_cache_hits_total")
    assert after > before  # the vision encoder was skipped: its output for image x was cached


def test_metrics_cover_images_and_both_caches(client, vl_replica):
    uri = data_uri(image_bytes(64, 48, seed=30))
    chat(client, messages(image_part(uri)))
    chat(client, messages(image_part(uri), "Again?"))
    text = httpx.get(vl_replica.url + "/metrics").text
    assert metric(text, "warmfleet:image_tokens_total") > 0
    assert metric(text, "warmfleet:request_images_total") > 0
    assert metric(text, "warmfleet:image_hash_seconds_count") > 0
    assert metric(text, "warmfleet:processor_cache_up") == 1
    assert metric(text, "warmfleet:processor_cache_hits_total") >= 1
    assert metric(text, "warmfleet:processor_cache_usage_bytes") > 0
    assert metric(text, "warmfleet:processor_cache_capacity_bytes") == int(0.25 * (1 << 30))
    assert metric(text, "warmfleet:encoder_cache_budget_tokens") == 4096
    assert metric(text, "warmfleet:encoder_cache_misses_total") > 0


def test_processor_cache_death_keeps_serving_and_shutdown_stops_it(client, vl_replica):
    """Runs last: kills the pod's processor cache, then stops the server."""
    pid = vl_replica.cache_record["pid"]
    os.kill(pid, signal.SIGKILL)
    r = chat(client, messages(image_part(data_uri(image_bytes(64, 48, seed=40)))))  # preprocessed by the frontend itself
    assert image_tokens(r.usage) == 4
    vl_replica.wait_for_log("processor cache process exited", 60, prefix=True)
    # the restarted process answers again (it starts empty)
    wait_for(lambda: metric(httpx.get(vl_replica.url + "/metrics").text, "warmfleet:processor_cache_up") == 1,
             "the processor cache restarted", [vl_replica.proc], 60, poll_s=0.2)
    text = httpx.get(vl_replica.url + "/metrics").text
    assert metric(text, "warmfleet:processor_cache_restarts_total") == 1
    uri = data_uri(image_bytes(64, 48, seed=41))
    chat(client, messages(image_part(uri)))
    chat(client, messages(image_part(uri)))
    text = httpx.get(vl_replica.url + "/metrics").text
    assert metric(text, "warmfleet:processor_cache_hits_total") >= 1  # counters of the new process

    socket_dir = Path(vl_replica.cache_record["address"][len("ipc://"):]).parent
    assert socket_dir.is_dir()
    vl_replica.proc.send_signal(signal.SIGTERM)
    assert vl_replica.proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
    assert any('"processor cache stopped"' in line for line in vl_replica.log)
    assert not socket_dir.exists()
