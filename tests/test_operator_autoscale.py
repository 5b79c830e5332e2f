"""Cache-aware autoscaling: the pure decision (bounds, targets, stabilisation, hit-ratio protection, pools), the
router-metrics contract, deletion costs and warm-up summary, and the loop against kmock with a scripted FakeRouter."""

from __future__ import annotations

import asyncio
import math
from typing import Any, AsyncContextManager, Callable

import kmock
import pytest

from fakerouter import FakeRouter
from operator_fixtures.cluster import ISVC, PODS, declare
from operator_fixtures.kmock_apply import FakeVersionedEmulator
from operator_fixtures.running import InProcessOperator, run_operator
from operator_fixtures.shapes import h200, l4, service
from router_fakes import synced
from waiting import poll, until
from warmfleet.operator.planning import autoscale_policy as a
from warmfleet.operator.planning.sizing import assign_replicas
from warmfleet.operator.spec.inference_service import Autoscaling, parse_spec
from warmfleet.server.router.core.metrics import RouterMetrics


def cfg(**kw: Any) -> Autoscaling:
    base = {"minReplicas": 1, "maxReplicas": 10, "targetQueuedPrefillTokens": 1000, "scaleDownStabilizationSeconds": 0}
    return parse_spec({"model": {"path": "/m"}, "autoscaling": {**base, **kw}}).autoscaling


def sample(t: float, queued: float = 0.0, cached: float = 0.0, prompt: float = 0.0, buckets=(), src=("r",)) -> a.Sample:
    return a.Sample(t=t, sources=frozenset(src), queued_tokens=queued, cached_tokens=cached,
                    usage_prompt_tokens=prompt, ttft_buckets=tuple(buckets))


def decide(current: int | dict[str, int], samples, *, c: Autoscaling | None = None, recs=(), now: float = 100.0,
           caps: dict[str, int] | None = None, floors: dict[str, int] | None = None) -> a.Decision:
    cur = current if isinstance(current, dict) else {"p": current}
    return a.decide(current=cur, capacities=caps or {k: 64 for k in cur}, floors=floors, cfg=c or cfg(),
                    samples=samples, recommendations=list(recs), now=now)


# ---- bounds and targets ----

def test_no_metrics_holds_within_the_bounds():
    d = decide(3, [])
    assert (d.total, d.reason) == (3, "NoMetrics")
    assert (decide(0, [], c=cfg(minReplicas=2)).total, decide(0, [], c=cfg(minReplicas=2)).reason) == (2, "BelowMin")
    assert decide(12, [], c=cfg(maxReplicas=5)).total == 5


def test_queued_prefill_tokens_scale_out_to_target_per_replica():
    d = decide(2, [sample(95, queued=4000), sample(100, queued=4000)])
    assert (d.total, d.reason) == (4, "ScaleOut")
    assert "queued prefill tokens per replica 2000 (target 1000)" in d.message


def test_within_tolerance_changes_nothing():
    d = decide(4, [sample(100, queued=4200)])  # 1050 per replica: within 10%
    assert (d.total, d.reason) == (4, "WithinTarget")


def test_scale_out_step_is_limited_and_max_replicas_caps():
    assert decide(1, [sample(100, queued=100_000)], c=cfg(maxReplicas=50)).total == 5  # 1 + 4
    assert decide(10, [sample(100, queued=100_000)], c=cfg(maxReplicas=50)).total == 20  # doubled
    assert decide(2, [sample(100, queued=100_000)], c=cfg(maxReplicas=5)).total == 5


def test_scale_to_the_minimum_when_idle():
    d = decide(4, [sample(100, queued=0)], c=cfg(minReplicas=2))
    assert (d.total, d.reason) == (2, "ScaleIn")


def test_ttft_p90_target_scales_proportionally():
    before = [(0.5, 0), (1.0, 0), (2.0, 0), (4.0, 0), (math.inf, 0)]
    after = [(0.5, 0), (1.0, 10), (2.0, 100), (4.0, 100), (math.inf, 100)]  # p90 in (1, 2]: 1 + 80/90
    c = cfg(targetQueuedPrefillTokens=None, targetTtftP90Seconds=1.0)
    d = decide(2, [sample(40, buckets=before), sample(100, buckets=after)], c=c, now=100)
    p90 = 1 + (90 - 10) / 90
    assert (d.total, d.reason) == (math.ceil(2 * p90), "ScaleOut") and "TTFT p90 1.889 s" in d.message
    # no streamed request in the window: no TTFT figure, the replicas are held
    assert decide(2, [sample(40, buckets=after), sample(100, buckets=after)], c=c).reason == "NoMetrics"
    # a router restarted (counters went down) or another router answered: no rate across the two samples
    assert decide(2, [sample(40, buckets=after), sample(100, buckets=before)], c=c).reason == "NoMetrics"
    assert decide(2, [sample(40, buckets=before), sample(100, buckets=after, src=("r", "s"))], c=c).reason == "NoMetrics"


def test_quantile_interpolates_like_prometheus():
    assert a.quantile(0.5, [(1.0, 50), (2.0, 100), (math.inf, 100)]) == 1.0
    assert a.quantile(0.9, [(1.0, 50), (2.0, 100), (math.inf, 100)]) == pytest.approx(1.8)
    assert a.quantile(0.9, [(1.0, 0), (math.inf, 10)]) == 1.0  # beyond the last bound: the bound
    assert a.quantile(0.9, [(1.0, 0), (math.inf, 0)]) is None


def test_both_targets_take_the_larger_recommendation():
    after = [(0.5, 0), (1.0, 100), (math.inf, 100)]
    c = cfg(targetTtftP90Seconds=0.5)  # p90 0.95 s: asks ceil(2 * 1.9) = 4; the queue asks 3
    d = decide(2, [sample(40, queued=3000), sample(100, queued=3000, buckets=after)], c=c)
    assert d.total == 4 and d.message.startswith("TTFT p90")


# ---- stabilisation ----

def test_scale_down_stabilisation_keeps_the_highest_recent_recommendation():
    c = cfg(scaleDownStabilizationSeconds=300)
    d = decide(4, [sample(100, queued=0)], c=c, recs=[(-250, 1), (50, 4), (90, 3)])  # -250: watched the whole window
    assert (d.total, d.reason) == (4, "Stabilizing")
    d = decide(4, [sample(100, queued=0)], c=c, recs=[(-250, 1), (50, 3), (90, 2)])
    assert (d.total, d.reason) == (3, "ScaleIn")
    assert decide(4, [sample(500, queued=0)], c=c, recs=[(50, 4)], now=500).total == 1  # outside the window
    # an operator that just started has not seen the whole window: no scale-in yet
    d = decide(4, [sample(500, queued=0)], c=c, recs=[(450, 1)], now=500)
    assert (d.total, d.reason) == (4, "Stabilizing") and "not yet watched whole" in d.message


def test_scale_up_stabilisation_keeps_the_lowest_recent_recommendation():
    c = cfg(scaleUpStabilizationSeconds=30)
    assert decide(2, [sample(100, queued=6000)], c=c, recs=[(80, 2)]).reason == "Stabilizing"
    assert decide(2, [sample(100, queued=6000)], c=c, recs=[(80, 4)]).total == 4
    assert decide(2, [sample(100, queued=6000)], c=cfg()).total == 6  # no window: at once


# ---- hit-ratio protection ----

def falling(queued: float = 0.0) -> list[a.Sample]:
    # cached ratio 0.8 in the first half of the window, 0.4 in the second
    return [sample(50, queued, 0, 0), sample(75, queued, 800, 1000), sample(100, queued, 1200, 2000)]


def test_no_scale_in_while_the_hit_ratio_falls():
    d = decide(4, falling())
    assert (d.total, d.reason) == (4, "HitRatioFalling") and "0.80 -> 0.40" in d.message
    assert decide(4, falling(), c=cfg(protectHitRatio=False)).reason == "ScaleIn"
    assert decide(4, falling(), c=cfg(hitRatioDrop=0.5)).reason == "ScaleIn"  # a fall of 0.4 is allowed
    steady = [sample(50, 0, 0, 0), sample(75, 0, 800, 1000), sample(100, 0, 1600, 2000)]
    assert decide(4, steady).reason == "ScaleIn"
    # protection never blocks scale-out
    assert decide(2, falling(queued=8000)).reason == "ScaleOut"


# ---- pools ----

def test_per_pool_split_respects_floors_caps_and_is_monotone():
    caps, floors = {"h200": 8, "l4": 2}, {"l4": 1}
    d = decide({"h200": 1, "l4": 1}, [sample(100, queued=5000)], caps=caps, floors=floors)
    assert d.total == 5 and d.pools["l4"] >= 1 and sum(d.pools.values()) == 5
    prev = None
    for total in range(1, 11):
        split = assign_replicas(total, [8, 2], [0, 1])
        assert split[1] >= 1 and split[1] <= 2
        if prev is not None:
            assert all(x >= y for x, y in zip(split, prev)), (total, split, prev)
        prev = split
    # the pools' maxima bound the total; their minima raise the floor
    assert decide({"h200": 8, "l4": 2}, [sample(100, queued=50_000)], caps=caps, floors=floors).total == 10
    assert decide({"h200": 0, "l4": 0}, [], c=cfg(minReplicas=0), caps=caps, floors={"h200": 2, "l4": 1}).total == 3


def test_assign_replicas_floors_are_handed_out_first():
    assert assign_replicas(2, [3, 3, 3], [0, 0, 2]) == [0, 0, 2]
    assert assign_replicas(4, [3, 3, 3], [0, 0, 2]) == [1, 1, 2]
    assert assign_replicas(1, [3, 3], [2, 0]) == [2, 0]  # floors win over a smaller total
    assert assign_replicas(3, [1, 3, 3]) == [1, 1, 1] and assign_replicas(4, [1, 3, 3]) == [1, 2, 1]


# ---- the router's own metrics, parsed ----

def test_parse_metrics_reads_what_the_real_router_exports():
    m = RouterMetrics()
    m.replica_queued_tokens.labels("http://10.0.0.1:8000").set(1500)
    m.replica_queued_tokens.labels("http://10.0.0.2:8000").set(500)
    m.actual_cached_tokens.inc(300)
    m.usage_prompt_tokens.inc(1000)
    for v in (0.2, 0.3, 1.2):
        m.ttft.observe(v)
    got = a.parse_metrics(m.render().decode())
    assert (got["queued"], got["cached"], got["usage_prompt"]) == (2000, 300, 1000)
    assert got["buckets"][0.25] == 1 and got["buckets"][0.5] == 2 and got["buckets"][math.inf] == 3
    s = a.make_sample(1.0, {"r1": got, "r2": got})
    assert s.queued_tokens == 4000 and dict(s.ttft_buckets)[math.inf] == 6 and s.sources == {"r1", "r2"}


async def test_the_real_router_exports_what_the_autoscaler_reads(tiny_model_dir):
    """Router on bench/simfleet.py replicas (the engine's scheduler and KV manager): TTFT of streamed requests,
    the cached-token ratio's two counters, and /v1/router/replicas in the shape deletion_costs reads."""
    import random

    import httpx
    import uvicorn

    from bench_scripts import load_bench
    from warmfleet.localprocs import free_port
    from warmfleet.server.hashing import model_fingerprint
    from warmfleet.server.router.core.prompt import HashConfig, PromptRenderer
    from warmfleet.server.router.core.registry import ReplicaSpec
    from warmfleet.server.router.core.runtime import RouterRuntime
    from warmfleet.server.router.core.settings import RouterSettings
    from warmfleet.server.router.http.app import build_app

    sim = load_bench("simfleet.py")

    fleet = sim.SimFleet(str(tiny_model_dir), 2, block_size=16, gpu_blocks=256, tm=sim.TimeModel(step_s=0.01))
    await fleet.start()
    specs = [ReplicaSpec(u, r.events_endpoint) for u, r in zip(fleet.urls, fleet.replicas)]
    app = build_app(RouterRuntime(hash_cfg=HashConfig(16, model_fingerprint(str(tiny_model_dir))), replicas=specs,
                                  renderer=PromptRenderer(str(tiny_model_dir)), settings=RouterSettings(health_interval_s=0.1)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started and synced(app.state.fleet.index, fleet.urls),
                    "router start and initial resync", timeout_s=TIMEOUT_S, interval_s=0.02)
        prompt = [random.Random(7).randrange(5, 900) for _ in range(200)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for stream in (False, False, True, True, True):  # the same prompt: every repeat hits the cache
                body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            got = a.parse_metrics((await client.get("/metrics")).text)
            views = [(await client.get("/v1/router/replicas")).json()]
        assert got["buckets"][math.inf] == 3  # one TTFT observation per streamed request, none for the others
        assert got["usage_prompt"] == 5 * 200 and 0 < got["cached"] < got["usage_prompt"]
        pods = [pod(f"p{i}", httpx.URL(u).host) for i, u in enumerate(fleet.urls)]
        costs = a.deletion_costs(views, pods)
        assert set(costs) == {"p0", "p1"} and max(costs.values()) >= 200 // 16  # the prompt's blocks, on its replica
    finally:
        server.should_exit = True
        await task
        await fleet.stop()


# ---- deletion cost and warm-up summary ----

def pod(name: str, ip: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": annotations or {}}, "status": {"podIP": ip}}


def test_deletion_cost_follows_cached_blocks_max_over_routers():
    r = FakeRouter()
    views = [{"replicas": [r.replica("http://10.0.0.1:8000", gpu_blocks=120, cpu_blocks=3456),
                           r.replica("http://10.0.0.2:8000", gpu_blocks=7)]},
             {"replicas": [r.replica("http://10.0.0.2:8000", gpu_blocks=9)]}]
    costs = a.deletion_costs(views, [pod("a", "10.0.0.1"), pod("b", "10.0.0.2"), pod("c", "10.0.0.3")])
    assert costs == {"a": 3500, "b": 9}  # 3576 at two significant digits; c is unknown to the routers
    r.server.server_close()


def test_warmup_summary_merges_routers():
    r = FakeRouter()
    w = {"prefixes": 3, "tokens": 640, "seconds": 1.5, "budget_tokens": 65536, "budget_s": 30}
    views = [{"replicas": [r.replica("x", state="warming"), r.replica("y", last_warmup=w), r.replica("z", state="down")]},
             {"replicas": [r.replica("x", state="ready"), r.replica("y", last_warmup={**w, "tokens": 100})]}]
    s = a.warmup_summary(views)
    assert (s.warming, s.warm, s.down, s.warmed_replicas, s.replayed_tokens, s.longest_seconds) == (1, 1, 1, 1, 640, 1.5)
    r.server.server_close()


# ---- the loop against kmock, with a scripted router ----

TIMEOUT_S = 30

pytestmark = pytest.mark.kmock(cls=FakeVersionedEmulator)


@pytest.fixture()
def cluster(kmock: FakeVersionedEmulator) -> FakeVersionedEmulator:
    return declare(kmock)  # the resources the kmock operator tests run against


def operator(cluster: kmock.KubernetesEmulator, router_url: str) -> AsyncContextManager[InProcessOperator]:
    return run_operator(cluster, TIMEOUT_S, router_url_template=router_url, autoscale_interval_s=1.0)


async def eventually(check: Callable[[], Any], what: str) -> Any:
    value = await poll(check, TIMEOUT_S, 0.05)
    if not value:
        raise AssertionError(f"timed out waiting for {what}")
    return value


def raw(cluster, res: str, name: str, ns: str | None = "default") -> dict[str, Any]:
    try:
        found = cluster.objects[res, ns, name]
    except KeyError:
        return {}
    return {} if found.deleted else found.raw


def server_replicas(cluster) -> dict[str, int]:
    return {name: o.raw["spec"]["replicas"] for (res, ns, name), o in cluster.objects.items()
            if res.plural == "deployments" and not o.deleted
            and o.raw["metadata"]["labels"].get("app.kubernetes.io/component") == "server"}


def server_pod(name: str, ip: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "resourceVersion": "1", "uid": f"uid-{name}",
                         "labels": {"serving.warmfleet.io/service": "qwen", "app.kubernetes.io/component": "server",
                                    "app.kubernetes.io/managed-by": "warmfleet-operator"}},
            "spec": {"containers": [{"name": "server", "image": "img:test"}]},
            "status": {"phase": "Running", "podIP": ip}}


AUTOSCALING = {"minReplicas": 1, "maxReplicas": 4, "targetQueuedPrefillTokens": 1000, "metricsWindowSeconds": 10,
               "scaleDownStabilizationSeconds": 0}


async def test_loop_scales_out_on_queued_tokens_then_in_when_idle(cluster):
    cluster.objects["v1/nodes", None, "h1"] = h200("h1")
    cluster.objects[ISVC, "default", "qwen"] = service(spec={"autoscaling": AUTOSCALING})
    for i in (1, 2):
        cluster.objects[PODS, "default", f"qwen-p{i}"] = server_pod(f"qwen-p{i}", f"10.0.0.{i}")
    with FakeRouter() as router:
        router.replicas = [router.replica("http://10.0.0.1:8000", gpu_blocks=500),
                           router.replica("http://10.0.0.2:8000", state="warming", gpu_blocks=20)]
        router.set_queued({"http://10.0.0.1:8000": 2500, "http://10.0.0.2:8000": 500})
        async with operator(cluster, router.url):
            # 3000 queued prefill tokens, target 1000 per replica: spec.replicas 3, and the Deployment follows
            await eventually(lambda: raw(cluster, ISVC, "qwen")["spec"].get("replicas") == 3, "spec.replicas 3")
            await eventually(lambda: sum(server_replicas(cluster).values()) == 3, "the Deployment at 3")
            st = await eventually(lambda: raw(cluster, ISVC, "qwen")["status"].get("autoscaling"), "status.autoscaling")
            assert st["reason"] in ("ScaleOut", "WithinTarget") and st["desiredReplicas"] == 3 and st["lastScaleTime"]
            warm = await eventually(lambda: raw(cluster, ISVC, "qwen")["status"].get("warmup"), "status.warmup")
            assert (warm["warming"], warm["warm"]) == (1, 1)
            # scale-in removes the replica with the fewest cached blocks first: its pod-deletion cost is lowest
            cost = "controller.kubernetes.io/pod-deletion-cost"
            await eventually(lambda: raw(cluster, PODS, "qwen-p1")["metadata"].get("annotations", {}).get(cost) == "500",
                             "deletion cost on p1")
            await eventually(lambda: raw(cluster, PODS, "qwen-p2")["metadata"].get("annotations", {}).get(cost) == "20",
                             "deletion cost on p2")
            # load goes away: back to minReplicas once the window's mean falls
            router.set_queued({"http://10.0.0.1:8000": 0, "http://10.0.0.2:8000": 0})
            await eventually(lambda: raw(cluster, ISVC, "qwen")["spec"].get("replicas") == 1, "spec.replicas back to 1")
            await eventually(lambda: sum(server_replicas(cluster).values()) == 1, "the Deployment at 1")


async def test_scale_subresource_writes_are_clamped_to_the_bounds(cluster):
    """`kubectl scale` writes spec.replicas; without a target the operator only keeps it within the bounds."""
    cluster.objects["v1/nodes", None, "h1"] = h200("h1")
    cluster.objects["v1/nodes", None, "l1"] = l4("l1")
    bounds = {"minReplicas": 2, "maxReplicas": 5}
    cluster.objects[ISVC, "default", "qwen"] = service(spec={"replicas": 9, "autoscaling": bounds})
    with FakeRouter() as router:
        async with operator(cluster, router.url):
            await eventually(lambda: sum(server_replicas(cluster).values()) == 5, "clamped to maxReplicas 5")
            await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                                json={"spec": {"replicas": 1}})
            await eventually(lambda: sum(server_replicas(cluster).values()) == 2, "raised to minReplicas 2")
            await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                                json={"spec": {"replicas": 3}})
            await eventually(lambda: sum(server_replicas(cluster).values()) == 3, "3, within the bounds")
            # no target: the operator never writes spec.replicas itself
            await eventually(lambda: router.scrapes >= 3, "a few autoscaler passes")
            assert raw(cluster, ISVC, "qwen")["spec"]["replicas"] == 3
            assert "autoscaling" not in raw(cluster, ISVC, "qwen").get("status", {})
