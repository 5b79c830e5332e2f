"""The chart's Grafana dashboard (charts/warmfleet/files/dashboard.json): every series it reads is one our code
registers or one vLLM / FastDeploy export, every query is scoped by the namespace and InferenceService variables,
and no panel hides a series behind `or`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "charts" / "warmfleet" / "files" / "dashboard.json"

# Series of the other engines, by their exposition names (pinned from their docs: vLLM's "Production Metrics",
# FastDeploy's "Monitoring Metrics"). The vLLM names warmfleet's server also registers are checked against our code.
VLLM = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    *(f"vllm:{h}_{s}" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                "time_per_output_token_seconds", "e2e_request_latency_seconds")
      for s in ("bucket", "sum", "count")),
}
FASTDEPLOY = {
    "fastdeploy:num_requests_running", "fastdeploy:num_requests_waiting", "fastdeploy:gpu_cache_usage_perc",
    "fastdeploy:prompt_tokens_total", "fastdeploy:generation_tokens_total",
    *(f"fastdeploy:{h}_{s}" for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                                      "e2e_request_latency_seconds") for s in ("bucket", "sum", "count")),
}
SCOPE = ('namespace=~"$namespace"', 'inferenceservice=~"$service"')
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
ENGINE_PREFIX = re.compile(r"\b(?:vllm:|fastdeploy:|warmfleet:|warmfleet_)[a-zA-Z0-9_:]*")
AGGREGATION = re.compile(r"^\(*\s*(sum|avg|min|max|count|stddev|stdvar|group)\s*\(")


def registered_series() -> set[str]:
    """Exposition names (with _total, _bucket, ...) of every series warmfleet's server and router register."""
    from warmfleet.server.api.metrics import CacheConfigInfo, Metrics, ProcessorCacheView
    from warmfleet.server.engine.protocol import EngineStats
    from warmfleet.server.router.core.metrics import RouterMetrics

    server = Metrics("m")
    server.set_cache_config(CacheConfigInfo(block_size=16, enable_prefix_caching=True))
    cache = SimpleNamespace(hits=0, misses=0, evictions=0, usage_bytes=0, capacity_bytes=0, entries=0)
    server.render(EngineStats(max_loras=1), ProcessorCacheView(stats=cache))  # the scrape-time collectors' series too
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}
    return {family.name + s for registry in (server.registry, RouterMetrics().registry)
            for family in registry.collect() for s in suffixes[family.type]}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += [p] if p["type"] != "row" else p.get("panels", [])
    return out


def unlabelled_or(expr: str) -> bool:
    """True when `expr` is `A or B` with an operand aggregated to no labels: both sides then yield one series with
    the same (empty) label set, and `or` keeps only the left one, so the right one is never plotted."""
    depth, parts, start = 0, [], 0
    for m in re.finditer(r"[()]|\bor\b", expr):
        if m.group() == "(":
            depth += 1
        elif m.group() == ")":
            depth -= 1
        elif depth == 0:
            parts.append(expr[start:m.start()])
            start = m.end()
    parts.append(expr[start:])
    return len(parts) > 1 and any(AGGREGATION.match(p.strip()) and not re.search(r"\b(by|without)\s*\(", p)
                                  for p in parts)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def targets(dashboard) -> list[tuple[str, dict]]:
    out = [(p["title"], t) for p in panels(dashboard) for t in p["targets"]]
    assert len(out) >= 20
    return out


def test_every_series_is_registered_by_our_code_or_an_engines_own(targets):
    ours = registered_series()
    assert {"vllm:time_to_first_token_seconds_bucket", "warmfleet_router_decisions_total",
            "warmfleet:swap_out_blocks_total"} <= ours  # the collection found what it is meant to
    used = {name for _, t in targets for name, _ in SELECTOR.findall(t["expr"])}
    unknown = used - ours - VLLM - FASTDEPLOY
    assert not unknown, f"series no engine exports: {sorted(unknown)}"
    # the vLLM names warmfleet's server registers are vLLM's exactly; none of ours is pinned by mistake
    assert {n for n in ours if n.startswith("vllm:")} & used <= VLLM
    assert not {n for n in ours if n.startswith(("warmfleet:", "warmfleet_"))} & (VLLM | FASTDEPLOY)


def test_the_panels_people_need_are_there(dashboard, targets):
    used = {name for _, t in targets for name, _ in SELECTOR.findall(t["expr"])}
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "warmfleet:prefix_cache_hits_total", "warmfleet:encoder_cache_hits_total",
                 "warmfleet:processor_cache_lookups_total", "warmfleet_router_decisions_total",
                 "warmfleet_router_route_seconds_bucket", "fastdeploy:time_to_first_token_seconds_bucket"):
        assert name in used, name
    tiers = [t for _, t in targets if "warmfleet:prefix_cache_hits_total" in t["expr"]]
    assert tiers and all("by (tier)" in t["expr"] for t in tiers)
    decisions = [t for _, t in targets if "warmfleet_router_decisions_total" in t["expr"]]
    assert decisions and all("by (reason)" in t["expr"] for t in decisions)
    # a panel showing a series only warmfleet's engine exports says so
    for p in panels(dashboard):
        exprs = " ".join(t["expr"] for t in p["targets"])
        only_ours = re.findall(r"warmfleet:\w+", exprs)
        if only_ours and not re.search(r"vllm:|fastdeploy:", exprs):
            assert "only warmfleet's engine" in p["description"], p["title"]


def test_namespace_and_service_variables_scope_every_query(dashboard, targets):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for name in ("namespace", "service"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"]["uid"] == "${datasource}"
    assert variables["service"]["definition"].endswith(", inferenceservice)")
    assert '$namespace' in variables["service"]["definition"]  # the services of the chosen namespace
    assert variables["service"]["allValue"] == ".+"  # "All" still requires the label: no stray vLLM deployment
    for title, t in targets:
        selectors = SELECTOR.findall(t["expr"])
        assert selectors, (title, t["expr"])
        for name, matchers in selectors:
            assert all(s in matchers for s in SCOPE), f"{title}: {name}{{{matchers}}} is not scoped"
        # no series named without a selector (it would escape the scope)
        bare = ENGINE_PREFIX.findall(SELECTOR.sub("", t["expr"]))
        assert not bare, (title, bare)
        assert t["datasource"]["uid"] == "${datasource}"


def test_no_series_is_hidden_behind_or(targets):
    old_swap = "sum(rate(warmfleet:swap_in_blocks_total[5m])) or sum(rate(warmfleet:swap_out_blocks_total[5m]))"
    assert unlabelled_or(old_swap)  # the checker catches the swap panel this dashboard used to have
    assert not unlabelled_or("sum by (tier) (rate(a[5m])) or sum by (tier) (rate(b[5m]))")
    assert not unlabelled_or("sum(rate(a[5m])) / sum(rate(b[5m]))")
    for title, t in targets:
        assert not unlabelled_or(t["expr"]), (title, t["expr"])


def test_swap_in_and_out_are_two_named_series(dashboard):
    (swap,) = [p for p in panels(dashboard) if "swap" in p["title"].lower()]
    by_series = {name: t["legendFormat"] for t in swap["targets"] for name, _ in SELECTOR.findall(t["expr"])}
    assert by_series["warmfleet:swap_in_blocks_total"] != by_series["warmfleet:swap_out_blocks_total"]


def test_panels_are_well_formed(dashboard):
    ps = panels(dashboard)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in ps:
        assert p["description"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        legends = [t["legendFormat"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and len(legends) == len(set(legends)), p["title"]
        assert all("[5m]" not in t["expr"] and "$__rate_interval" in t["expr"] for t in p["targets"]
                   if "rate(" in t["expr"]), p["title"]
