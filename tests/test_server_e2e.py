"""A real `warmfleet serve` on loopback with the tiny checkpoint, answered by the official openai client."""

from __future__ import annotations

import signal
import time
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_replica import START_TIMEOUT_S, Replica

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory) -> Iterator[Replica]:
    with Replica(tiny_model_dir, tmp_path_factory.mktemp("serve-cwd")) as r:
        r.wait_for_log("ready", START_TIMEOUT_S)
        yield r


@pytest.fixture(scope="module")
def client(replica) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_probes_and_replica_header(replica):
    r = httpx.get(replica.url + "/ready")
    assert r.status_code == 200 and r.headers["x-warmfleet-replica"] == "e2e-replica"
    assert httpx.get(replica.url + "/health").status_code == 200
    metrics = httpx.get(replica.url + "/metrics").text
    assert "vllm:num_requests_running" in metrics and "vllm:kv_cache_usage_perc" in metrics


def test_chat_completion(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                          max_completion_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert isinstance(chat.choices[0].message.content, str)
    assert 0 < chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0


def test_chat_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == full.choices[0].message.content  # greedy: same tokens either way
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_and_n(client):
    comp = client.completions.create(model="tiny", prompt=["Once upon", "a time"], max_tokens=4, n=2, seed=3)
    assert sorted(c.index for c in comp.choices) == [0, 1, 2, 3]
    assert comp.usage.completion_tokens <= 16


def test_repeated_long_prefix_reports_cached_tokens(client):
    system = {"role": "system", "content": "You answer questions about the warmfleet serving engine. " * 12}
    first = client.chat.completions.create(
        model="tiny", messages=[system, {"role": "user", "content": "first question"}], max_tokens=2)
    second = client.chat.completions.create(
        model="tiny", messages=[system, {"role": "user", "content": "second question"}], max_tokens=2)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def scrape(replica) -> dict:
    """The server's /metrics parsed by prometheus_client: family name -> family."""
    return {f.name: f for f in text_string_to_metric_families(httpx.get(replica.url + "/metrics").text)}


def value(families: dict, name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def test_model_server_protocol_metrics_follow_a_request(replica, client):
    """GIE's model-server protocol as the reference EPP scrapes it: three gauges that move while a
    request runs, and vllm:cache_config_info with the server's own block size and pool size."""
    names = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    idle = scrape(replica)
    assert all(idle[n].type == "gauge" for n in (*names, "vllm:cache_config_info"))
    (info,) = idle["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "256"  # Replica's flags
    assert [value(idle, n) for n in names] == [0, 0, 0]

    stream = client.completions.create(model="tiny", prompt="Once upon a time " * 40, max_tokens=1500,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request has been scheduled and is generating
    busy = scrape(replica)
    stream.close()  # the server sees the disconnect and aborts the request
    assert value(busy, "vllm:num_requests_running") == 1 and value(busy, "vllm:num_requests_waiting") == 0
    assert 0 < value(busy, "vllm:kv_cache_usage_perc") < 1  # a fraction of the 256 blocks, not a percentage

    deadline = time.monotonic() + 60
    while [value(now := scrape(replica), n) for n in names] != [0, 0, 0]:
        assert time.monotonic() < deadline, {n: value(now, n) for n in names}
        time.sleep(0.05)


def test_errors_from_the_real_server(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=[5] * 3000, max_tokens=1)
    assert "2048" in exc.value.message and "3000" in exc.value.message


def test_sigterm_drains_in_flight_stream(replica, client):
    """Last in this module: SIGTERM lets a running stream finish, then the process exits."""
    stream = client.completions.create(model="tiny", prompt="Once", max_tokens=64, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)  # the request is running
    replica.proc.send_signal(signal.SIGTERM)
    replica.wait_for_log("draining", 30)
    rest = list(it)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    replica.wait_for_log("engine stopped", 60)
    replica.proc.wait(timeout=30)
