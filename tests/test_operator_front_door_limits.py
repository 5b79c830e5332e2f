"""The operator hands the replicas' per-request limits (from spec.engine/server.extraArgs) to the router and the endpoint picker (issue 40)."""

from __future__ import annotations

import argparse
import json

import pytest

from operator_fixtures.shapes import h200, l4, service
from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.front_door_limits import flag_value, front_door_limits
from warmfleet.operator.planning.nodes import node_info
from warmfleet.server import flagfields
from warmfleet.server.router.core.admission import request_limits
from warmfleet.server.router.epp.settings import EppSettings
from warmfleet.server.router.http import main

IMAGES = objects.Images(engine="engine:1", router="slim:1")
NODES = [node_info(h200("h1")), node_info(l4("l1"))]


def front_door_settings(items, name):
    """The settings a front-door Deployment's args parse to (`warmfleet route` or `warmfleet epp`)."""
    (dep,) = [o for o in items if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    if args[0] == "route":
        main.add_arguments(parser)
        from warmfleet.server.router.core import runtime
        return runtime.settings_from_args(parser.parse_args(args[1:]))
    flagfields.add_arguments(parser, EppSettings)
    return flagfields.from_namespace(parser.parse_args(args[1:]), EppSettings)


@pytest.mark.parametrize("mode,name", [("proxy", "qwen-router"), ("gateway", "qwen-epp")])
def test_the_pools_limit_mm_per_prompt_from_extra_args_reaches_the_router_and_the_picker(mode, name):
    body = service(spec={"replicas": 2, "router": {"mode": mode},
                         "engine": {"kind": "vllm", "extraArgs": ["--limit-mm-per-prompt", '{"image": 40}']}})
    got = front_door_settings(render(body, NODES, IMAGES), name)
    assert got.engine == "vllm" and json.loads(got.limit_mm_per_prompt) == {"image": 40}
    assert request_limits(got).max_images == 40 and got.max_choices_per_request is None
    body = service(spec={"replicas": 2, "router": {"mode": mode}, "server": {"extraArgs": ["--max-num-seqs=100"]}})
    got = front_door_settings(render(body, NODES, IMAGES), name)  # warmfleet: its cap is 4 x --max-num-seqs
    assert (got.max_choices_per_request, got.limit_mm_per_prompt) == (400, None)
    assert request_limits(got).max_images == 16  # the engine's default, not rendered


@pytest.mark.parametrize("mode,name", [("proxy", "qwen-router"), ("gateway", "qwen-epp")])
def test_without_limits_in_extra_args_nothing_is_rendered_and_the_engine_default_applies(mode, name):
    items = render(service(spec={"replicas": 2, "router": {"mode": mode}, "engine": {"kind": "vllm"}}), NODES, IMAGES)
    got = front_door_settings(items, name)
    assert (got.max_choices_per_request, got.limit_mm_per_prompt) == (None, None)
    assert (request_limits(got).max_choices, request_limits(got).max_images) == (None, 999)


def test_the_most_permissive_pool_wins_and_the_last_flag_counts():
    assert flag_value(["--max-num-seqs", "8", "--max-num-seqs=32"], "--max-num-seqs") == "32"
    pools = [["--max-num-seqs", "8", "--limit-mm-per-prompt", '{"image": 2, "video": 1}'],
             ["--max-choices-per-request", "50", "--limit-mm-per-prompt", '{"image": {"count": 30}}']]
    # warmfleet: pool 1 allows 4 x 8 = 32 choices, pool 2 50; images 2 and 30; video 1 and (not limited) none
    assert front_door_limits(pools, "warmfleet") == {"max_choices_per_request": 50,
                                                     "limit_mm_per_prompt": '{"image": 30}'}
    # a pool left at the engine's default counts with it: warmfleet 16 images, 256 choices
    assert front_door_limits([["--limit-mm-per-prompt", '{"image": 4}', "--max-num-seqs", "2"], []], "warmfleet") == {
        "max_choices_per_request": 256, "limit_mm_per_prompt": '{"image": 16}'}
    # vLLM has no prompts x n cap: --max-num-seqs renders nothing; FastDeploy: an unlimited pool leaves it unlimited
    assert front_door_limits([["--max-num-seqs", "8"]], "vllm") == {}
    assert front_door_limits([["--limit-mm-per-prompt", '{"image": 3}'], []], "fastdeploy") == {}
    assert front_door_limits([["--limit-mm-per-prompt", "not json", "--max-num-seqs", "x"]], "warmfleet") == {
        "max_choices_per_request": 256}  # malformed: the replica refuses to start, nothing to follow
