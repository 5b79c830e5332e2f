"""Predicted TTFT (core/ttft.py): the online fit, the policy's use of it, and the router feeding it from first tokens."""

import random

import pytest

from router_fakes import static_router
from warmfleet.server.router.core.booking import Booking
from warmfleet.server.router.core.policy import Candidate, Decision, choose
from warmfleet.server.router.core.settings import PolicyConfig
from warmfleet.server.router.core.ttft import OWN_SAMPLES, Coefficients, TtftModels

B = 16


def feed(models: TtftModels, rid: str, fixed: float, per_token: float, per_load: float, n: int, seed: int = 0,
         noise: float = 0.0) -> None:
    rnd = random.Random(seed)
    for _ in range(n):
        tokens, load = rnd.randint(0, 4000), rnd.randint(0, 8)
        y = (fixed + per_token * tokens + per_load * load) * (1 + rnd.uniform(-noise, noise))
        models.observe(rid, tokens, load, y)


def feed_pools(m: TtftModels, n: int, slow_factor: float = 3.0, seed: int = 0, replicas=("f1", "f2", "s1")) -> None:
    """Samples from replicas of one engine shape, those named s* `slow_factor` times slower, interleaved."""
    rnd = random.Random(seed)
    for _ in range(n):
        for rid in replicas:
            k = slow_factor if rid.startswith("s") else 1.0
            tokens, load = rnd.randint(0, 4000), rnd.randint(0, 8)
            m.observe(rid, tokens, load, k * (0.004 + 20e-6 * tokens + 0.003 * load))


def test_the_fit_recovers_the_shape_and_each_replicas_factor():
    m = TtftModels(min_samples=32)
    feed_pools(m, 400)
    fast, slow = m.coefficients("f1"), m.coefficients("s1")
    assert m.relative("f1") == m.relative("f2") == 1.0  # the median replica is a fast one: the unit
    assert m.relative("s1") == pytest.approx(3.0, rel=0.05)
    assert slow.per_token_s == pytest.approx(3 * fast.per_token_s, rel=0.05)
    assert slow.predict(1000, 2) / fast.predict(1000, 2) == pytest.approx(3.0, rel=0.05)
    assert fast.predict(1000, 2) == pytest.approx(0.004 + 0.020 + 0.006, rel=0.1)  # in seconds, not in units


def test_alike_replicas_read_as_one_and_a_newcomer_starts_at_one():
    m = TtftModels(min_samples=32)
    feed_pools(m, 300, slow_factor=1.1)  # within the estimate's noise band: the same accelerator
    assert m.relative("s1") == 1.0 and m.coefficients("s1") == m.coefficients("f1")
    assert m.relative("new") == 1.0 and m.coefficients("new") == m.coefficients("f1")


def test_no_model_before_enough_samples_and_no_factor_before_enough_own():
    m = TtftModels(min_samples=50)
    feed(m, "a", 0.004, 20e-6, 0.003, 49)
    assert m.coefficients("a") is None and m.describe("a") is None  # the policy keeps its fixed weights
    feed(m, "a", 0.004, 20e-6, 0.003, 1, seed=9)
    assert m.coefficients("a") is not None
    feed(m, "a", 0.004, 20e-6, 0.003, OWN_SAMPLES, seed=8)
    feed(m, "b", 0.016, 80e-6, 0.012, OWN_SAMPLES - 1, seed=3)  # 4x slower, too few samples of its own yet
    assert m.relative("b") == 1.0 and m.describe("b")["samples"] == OWN_SAMPLES - 1
    feed(m, "b", 0.016, 80e-6, 0.012, 1, seed=4)
    assert m.relative("b") > 2.0


def test_a_fit_that_says_more_work_is_faster_is_clamped():
    m = TtftModels(min_samples=8)
    for tokens in range(0, 4000, 100):  # TTFT falling with queued work (noise, a warming engine): nonsense to route on
        m.observe("r", tokens, 0, 0.1 - tokens * 1e-5)
    c = m.coefficients("r")
    assert c.per_token_s > 0 and c.fixed_s >= 0 and c.per_load_s >= 0


def test_forgetting_follows_a_replica_that_slows_down_and_one_odd_sample_does_not_swing_it():
    m = TtftModels(min_samples=32, forget=0.99)
    feed_pools(m, 300, slow_factor=1.0)
    assert m.relative("s1") == 1.0
    feed_pools(m, 600, slow_factor=2.5, seed=5)  # a noisy neighbour arrived on s1
    assert m.relative("s1") == pytest.approx(2.5, rel=0.1)
    before = m.coefficients("f1").predict(1000, 0)
    m.observe("f1", 1000, 8, 5.0)  # one 5 s first token (a stalled step)
    assert m.coefficients("f1").predict(1000, 0) == pytest.approx(before, rel=0.25)


def cands(queued_fast: int = 0, queued_slow: int = 0, load_fast: float = 0, load_slow: float = 0, sent: float = 1.0):
    return [Candidate("fast", gpu_blocks=1, queued_tokens=queued_fast, load=load_fast, sent=sent),
            Candidate("slow", gpu_blocks=1, queued_tokens=queued_slow, load=load_slow, sent=sent)]


FITTED = {"fast": Coefficients(0.004, 20e-6, 0.003), "slow": Coefficients(0.012, 60e-6, 0.009)}


def test_predicted_ttft_sends_a_request_to_the_faster_pool_the_fixed_weights_cannot_tell_apart():
    """Both hold the shared first block (nothing at stake), the slow one has less queued: the fixed weights price a
    queued token alike everywhere and pick it; 600 queued tokens on the fast replica still finish sooner there."""
    cfg = PolicyConfig(epsilon=10.0, share_epsilon=10.0)  # caps out of the way: the scores decide
    fixed = choose(cands(queued_fast=600, queued_slow=300), block_size=B, num_prompt_tokens=400, cold_key=b"k",
                   cfg=cfg)
    assert fixed.order[0] == "slow"
    fitted = choose(cands(queued_fast=600, queued_slow=300), block_size=B, num_prompt_tokens=400, cold_key=b"k",
                    cfg=cfg, ttft=FITTED)
    assert fitted.order[0] == "fast"
    # fast: 4 + 20e-3 * (600 + 384) ms = 23.7 ms; slow: 12 + 60e-3 * (300 + 384) ms = 53 ms; with 1,800 queued on
    # the fast one (44 ms) it still wins; with 2,400 (56 ms) it no longer does
    assert choose(cands(queued_fast=1800, queued_slow=300), block_size=B, num_prompt_tokens=400, cold_key=b"k",
                  cfg=cfg, ttft=FITTED).order[0] == "fast"
    assert choose(cands(queued_fast=2400, queued_slow=300), block_size=B, num_prompt_tokens=400, cold_key=b"k",
                  cfg=cfg, ttft=FITTED).order[0] == "slow"


# no cost per request of load: the scores always favour the fast replica, so only the caps can turn it away
NO_LOAD_TERM = {"fast": Coefficients(0.004, 20e-6, 0.0), "slow": Coefficients(0.012, 60e-6, 0.0)}


def test_the_caps_follow_capacity_and_still_bound_the_fast_replica():
    """At 6 in flight against 0 the fleet's load cap (ceil(1.25 x 7 / 2) = 5) would turn a request away from the
    fast replica; at 3x the slow one's speed its cap is 1.5x that (7), so it takes it; at 20 in flight it is over its
    own cap too (ceil(1.25 x 21 / 2 x 1.5) = 20)."""
    cfg = PolicyConfig(epsilon=0.25)  # no request sent yet: the share caps let both in
    assert choose(cands(load_fast=6, sent=0), block_size=B, num_prompt_tokens=400, cold_key=b"k", cfg=cfg,
                  ttft=NO_LOAD_TERM).order[0] == "fast"
    d = choose(cands(load_fast=20, sent=0), block_size=B, num_prompt_tokens=400, cold_key=b"k", cfg=cfg, ttft=NO_LOAD_TERM)
    assert d.order[0] == "slow" and d.reason == "load_spill"


def test_replicas_alike_within_the_fits_noise_keep_the_fleets_caps():
    alike = {"fast": Coefficients(0.004, 20e-6, 0.0), "slow": Coefficients(0.004, 22e-6, 0.0)}
    d = choose(cands(load_fast=6, sent=0), block_size=B, num_prompt_tokens=400, cold_key=b"k",
               cfg=PolicyConfig(epsilon=0.25), ttft=alike)
    assert d.order[0] == "slow" and d.reason == "load_spill"


@pytest.mark.asyncio
async def test_the_router_feeds_the_models_from_first_tokens_and_scores_by_them_once_fitted(tiny_model_dir):
    router = static_router(tiny_model_dir, ["http://fast:1", "http://slow:1"],
                           policy=PolicyConfig(ttft_model_samples=20, epsilon=10.0, share_epsilon=10.0))
    fast, slow = (router.fleet.registry.get(r) for r in ("http://fast:1", "http://slow:1"))
    body = {"model": "m", "prompt": "hello " * 400, "max_tokens": 1}
    hashes = router.decide("completion", body, [fast, slow])[2]
    for rep in (fast, slow):  # both hold the first block (a shared system prompt): nothing at stake
        router.fleet.index.add_blocks(rep.id, hashes[:1])
    fast.queued_tokens = 2000  # this router's queued prefill there: the fixed weights send the request away
    assert router.decide("completion", body, [fast, slow])[0].order[0] == slow.id
    for i in range(40):  # samples as the proxy makes them: enter, then the first token some time later
        for rep, k in ((fast, 1.0), (slow, 12.0)):
            booking = Booking(router, Decision([rep.id], "cold_hash", 0, num_prompt_tokens=100 + 50 * i))
            booking.enter(rep)
            t_sent, prefill, load = booking.sample
            booking.sample = (t_sent - k * (0.002 + 5e-6 * prefill), prefill, load)
            booking.first_token()
            booking.leave()
    assert router.ttft.describe(slow.id)["slowdown"] > 5 and router.ttft.describe(fast.id)["slowdown"] == 1.0
    # fast: 2 ms + 5 us x (2,000 queued + ~400 own) = 14 ms; slow: 12 x (2 ms + 5 us x ~400) = 48 ms
    assert router.decide("completion", body, [fast, slow])[0].order[0] == fast.id


def test_the_router_has_no_models_unless_asked(tiny_model_dir):
    router = static_router(tiny_model_dir, ["http://a:1"])
    assert router.ttft is None
    booking = Booking(router)
    booking.enter(router.fleet.registry.get("http://a:1"))
    assert booking.sample is None  # nothing timed, nothing learnt
    with pytest.raises(ValueError, match="ttft-model-samples"):
        PolicyConfig(ttft_model_samples=-1)
