"""Hostile and random requests against a real replica (tiny Qwen2-VL, 512-token context) and a router in front of it.

A bounded slice of bench/fuzz.py: a few schemathesis cases per operation (valid and invalid data,
bodies from server/api/protocol.py's models) and the whole hand corpus (bench/fuzzing.py:
broken and hostile images, a decompression bomb, invalid UTF-8, lone surrogates, deep nesting, huge
numbers, thousands of parts, a prompt one token over the context). Required: no 5xx, an answer to
every request, OpenAI-shaped 4xx naming the problem, both processes alive, memory bounded.
"""

from __future__ import annotations

import pytest

from bench_scripts import load_bench
from warmfleet.livefleet import LiveFleet, memory_mib

fuzzing = load_bench("fuzzing.py")

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
MANY = 2000  # content parts / messages in the "thousands of parts" cases (bench/fuzz.py sends 5000)
EXAMPLES = 6  # per operation and generation mode: ~120 schema cases per server here, a few seconds


@pytest.fixture(scope="module")
def vl_fleet(tiny_vl_dir, tmp_path_factory):
    fleet = LiveFleet(tiny_vl_dir, tmp_path_factory.mktemp("fuzz"), n=1,
                      replica_args=("--max-model-len", str(MAX_MODEL_LEN)))
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.mark.parametrize("server", ["replica", "router"])
def test_hand_corpus_gets_openai_errors_naming_the_problem(vl_fleet, server):
    url = vl_fleet.replicas[0].url if server == "replica" else vl_fleet.router.url
    v = fuzzing.run_hand_corpus(url, MAX_MODEL_LEN, many_parts=MANY)
    assert not v.failures, "\n".join(v.failures)
    assert vl_fleet.replicas[0].alive() and vl_fleet.router.alive()
    cases = v.by_case
    # the messages name the problem (and the part), not just "bad request"
    assert "truncated" in cases["truncated PNG"][1] and "content[0]" in cases["truncated PNG"][1]
    assert "not a supported image" in cases["HTML as an image"][1]
    assert "more pixels than the limit" in cases["decompression bomb (20000x20000 PNG, 400 MP)"][1]
    assert "512" in cases["prompt one token over the context"][1] and "513" in cases["prompt one token over the context"][1]
    assert "Unicode" in cases["lone surrogate escape"][1]
    assert "JSON" in cases["deep JSON nesting (100000)"][1]
    assert "prompt.0" in cases["huge token id"][1] and "less than" in cases["huge token id"][1]  # not "a valid string"
    # thousands of images are refused at the first one over --limit-mm-per-prompt (16), before any is decoded
    many_images = cases[f"{MANY} image parts"][1]
    assert "content[16]" in many_images and "--limit-mm-per-prompt" in many_images
    # a 400-megapixel PNG is refused without being decoded: the API process stays small
    assert memory_mib(vl_fleet.replicas[0].popen.pid)["api"]["peak"] < 1536


@pytest.mark.parametrize("server", ["replica", "router"])
def test_schema_fuzzing_finds_no_5xx_and_no_hang(vl_fleet, server):
    url = vl_fleet.replicas[0].url if server == "replica" else vl_fleet.router.url
    v = fuzzing.run_schema_cases(url, EXAMPLES)
    print(f"\n{server}: {v.cases} schema cases, {v.by_status}, slowest {v.slowest_s:.2f} s")
    assert v.cases > 40
    assert not v.failures, "\n".join(v.failures[:20])
    assert any(k.startswith("4") for k in v.by_status) and "200" in v.by_status  # both valid and invalid data ran
    assert vl_fleet.replicas[0].alive() and vl_fleet.router.alive()
