"""`warmfleet route` settings: declared once (server/router/core/settings.py), read from flags and rendered back to them."""

from __future__ import annotations

import argparse

import pytest

from warmfleet.server import flagfields
from warmfleet.server.router.core.settings import PolicyConfig, ProxyConfig, RouterSettings, WarmupConfig
from warmfleet.server.router.http import main


def parse(args: list[str]) -> RouterSettings:
    p = argparse.ArgumentParser()
    main.add_arguments(p)
    return flagfields.from_namespace(p.parse_args(args), RouterSettings)


def test_settings_round_trip_through_rendered_args():
    """CLI → settings → rendered args → CLI gives the same settings, for a value off its default in every group."""
    s = RouterSettings(
        model="/m", replicas=["http://a:1", "http://b:2,events=tcp://b:3"], kv_events_port=5557, engine="vllm",
        predicted_capacity_blocks=99, predicted_ttl_s=1.5, index_max_blocks=7, vllm_hash_seed="unset",
        discover_service="ns/svc", host="0.0.0.0", port=9000, block_size=32, prefix_hash_algo="sha256",
        policy=PolicyConfig(cpu_weight=0.25, cold_queue_weight=2.0, epsilon=0.5, common_prefix_free=False, max_share_slack=3),
        proxy=ProxyConfig(cold_key_blocks=2, read_timeout_s=5.0),
        health_failures=4, max_request_bytes=1000, api_keys=["k1", "k2"], admin_key="adm",
        warmup=WarmupConfig(enabled=False, budget_s=2.5), peers="http://p:1,http://q:2", peer_jitter=0.0,
        log_level="debug",
    )
    args = flagfields.to_args(s)
    assert "--no-warmup" in args and "--no-common-prefix-free" in args and args.count("--replica") == 2
    assert parse(args) == s
    assert flagfields.to_args(RouterSettings(model="/m")) == ["--model", "/m"]  # defaults are left out


def test_named_fields_render_in_the_given_order_default_or_not():
    s = RouterSettings(model="/m", port=8000)
    assert flagfields.to_args(s, ("port", "engine", "policy.epsilon")) == [
        "--port", "8000", "--engine", "warmfleet", "--balance-epsilon", "0.25"]


def test_every_flag_is_declared_once_with_help():
    flags = [f.metadata["flag"] for _, f in flagfields.flag_fields(RouterSettings)]
    assert len(flags) == len(set(flags)) == 69
    assert all(f.metadata["help"] for path, f in flagfields.flag_fields(RouterSettings) if path != "log_level")
    assert flagfields.flag_of(RouterSettings, "policy.epsilon") == "--balance-epsilon"
    assert flagfields.flag_of(RouterSettings, "proxy.read_timeout_s") == "--upstream-timeout-s"


def test_defaults_are_the_dataclasses():
    """No flag repeats a default: what argparse gives for no flags is the dataclasses' own defaults."""
    assert parse(["--model", "/m"]) == RouterSettings(model="/m")


@pytest.mark.parametrize("make, message", [
    (lambda: PolicyConfig(cpu_weight=1.5), "--cpu-tier-weight must be in [0, 1]"),
    (lambda: PolicyConfig(share_epsilon=-0.1), "--balance-share-epsilon"),
    (lambda: PolicyConfig(cold_queue_weight=-1), "--cold-queue-weight"),
    (lambda: PolicyConfig(epsilon=-1), "--balance-epsilon must be >= 0"),
    (lambda: ProxyConfig(max_attempts=0), "--cold-key-blocks and --max-attempts must be >= 1"),
    (lambda: WarmupConfig(budget_s=-1), "--warmup-budget-tokens and --warmup-budget-s must be >= 0"),
    (lambda: RouterSettings(block_size=0), "--block-size must be >= 1"),
    (lambda: RouterSettings(index_max_blocks=0), "--index-max-blocks must be >= 1"),
    (lambda: RouterSettings(predicted_ttl_s=0), "--predicted-ttl-s > 0"),
    (lambda: RouterSettings(health_failures=0), "--health-failures must be >= 1"),
    (lambda: RouterSettings(peer_interval_s=0), "--peer-interval-s must be > 0"),
    (lambda: RouterSettings(max_choices_per_request=0), "--max-choices-per-request must be >= 1"),
    (lambda: RouterSettings(limit_mm_per_prompt='{"image": -1}'), "--limit-mm-per-prompt takes a JSON object"),
    (lambda: RouterSettings(request_body_timeout_s=0), "--request-body-timeout-s must be > 0"),
])
def test_impossible_values_are_refused_by_the_dataclasses(make, message):
    with pytest.raises(ValueError) as exc:
        make()
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_none_cold_queue_weight_still_means_queue_weight():
    assert PolicyConfig(cold_queue_weight=None).cold_queue_weight is None  # not refused: policy.py reads it as such
