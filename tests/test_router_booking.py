"""The Booking a front door holds for one request (core/booking.py): what it books, where, and that every step is
idempotent and harmless out of order."""

import pytest

from router_fakes import static_router
from warmfleet.server.router.core.booking import Booking
from warmfleet.server.router.core.policy import Decision, least_loaded
from warmfleet.server.router.core.settings import PolicyConfig

A, B, C = "http://a:1", "http://b:1", "http://c:1"


@pytest.fixture
def router(tiny_model_dir):
    return static_router(tiny_model_dir, [A, B, C])


def rep(router, rid):
    return router.fleet.registry.get(rid)


def load(router) -> dict:
    return {r.id: (r.in_flight, r.queued_tokens) for r in router.fleet.registry.replicas.values()}


def decision(order=(A, B, C), predicted=64, hits=None, prompt=100, adapter=None) -> Decision:
    return Decision(list(order), "prefix_hit", predicted, hits or {A: 64, B: 16}, prompt, adapter)


def metric(router, name):
    return router.metrics.registry.get_sample_value(name) or 0


def test_enter_books_the_request_and_leave_gives_it_back_once(router):
    b = Booking(router, decision())
    b.enter(rep(router, A))
    b.enter(rep(router, A))  # already there: nothing more
    assert load(router)[A] == (1, 100 - 64) and rep(router, A).sent > 0
    b.prefilled()
    b.prefilled()
    assert load(router)[A] == (1, 0)
    b.leave()
    b.leave()
    b.first_token()  # after leave: harmless
    b.prefilled()
    b.usage(10)  # nothing booked: nothing counted
    assert load(router) == {A: (0, 0), B: (0, 0), C: (0, 0)}
    assert metric(router, "warmfleet_router_actual_cached_tokens_total") == 0


def test_leave_before_the_first_token_also_gives_the_queued_prompt_back(router):
    b = Booking(router, decision())
    b.enter(rep(router, B))
    assert load(router)[B] == (1, 100 - 16)  # a fallback's own prediction
    b.leave()
    assert load(router)[B] == (0, 0)


def test_entering_another_replica_moves_the_load_as_one_retry(router):
    b = Booking(router, decision())
    b.enter(rep(router, A))
    b.enter(rep(router, B))  # the next replica after a failure, or the endpoint the gateway served
    assert load(router) == {A: (0, 0), B: (1, 100 - 16), C: (0, 0)}
    assert metric(router, "warmfleet_router_retries_total") == 1 and b.tries == 2
    b.usage(20)  # counted against B's own prediction
    assert metric(router, "warmfleet_router_predicted_cached_tokens_total") == 16
    assert metric(router, "warmfleet_router_actual_cached_tokens_total") == 20
    b.leave()
    assert load(router) == {A: (0, 0), B: (0, 0), C: (0, 0)}


def test_a_failed_replica_is_reported_and_left(router):
    b = Booking(router, decision())
    b.enter(rep(router, A))
    b.failed("a: refused")
    assert not rep(router, A).healthy and load(router)[A] == (0, 0)
    b.enter(rep(router, B))
    b.failed("b: ConnectTimeout", timeout=True)  # one failed check, not death
    assert rep(router, B).healthy and rep(router, B).failed_checks == 1 and load(router)[B] == (0, 0)
    b.failed("again")  # nothing booked: nothing reported
    assert rep(router, B).failed_checks == 1


def test_the_replicas_to_try_are_the_healthy_ones_at_their_turn(router):
    b = Booking(router, decision())
    order = b.replicas(2)
    assert next(order).id == A
    rep(router, B).healthy = False  # went down while A was tried
    assert [r.id for r in order] == [C]
    assert [r.id for r in Booking(router, decision()).replicas(1)] == [A]


def test_an_unrouted_booking_books_load_but_learns_nothing(router):
    b = Booking(router)  # routed by load (the picker's models/tokenize requests)
    b.enter(rep(router, C))
    b.served("ignored")
    b.usage(5)
    assert load(router)[C] == (1, 0) and rep(router, C).answered_at == 0.0
    b.leave()
    assert load(router)[C] == (0, 0)


def test_served_marks_the_replica_answering(router):
    b = Booking(router, decision())
    b.enter(rep(router, A))
    b.served(None)
    assert rep(router, A).answered_at > 0


def test_an_adapter_request_is_counted_on_its_adapter_until_it_leaves(router):
    b = Booking(router, decision(adapter="sql"))
    b.enter(rep(router, A))
    assert router.fleet.adapters.replicas[A].in_flight == {"sql": 1}
    b.enter(rep(router, B))
    assert router.fleet.adapters.replicas[A].in_flight == {} and router.fleet.adapters.replicas[B].in_flight == {"sql": 1}
    b.leave()
    b.leave()
    assert router.fleet.adapters.replicas[B].in_flight == {}


def test_the_first_token_feeds_the_ttft_model_once(tiny_model_dir):
    router = static_router(tiny_model_dir, [A], policy=PolicyConfig(ttft_model_samples=4))
    b = Booking(router, decision(order=(A,)))
    b.enter(rep(router, A))
    b.first_token()
    b.first_token()
    b.leave()
    b.first_token()
    assert router.ttft.shape.n == 1


def test_least_loaded_orders_by_in_flight_then_name(router):
    a, b, c = (rep(router, x) for x in (A, B, C))
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    assert [r.id for r in least_loaded([a, c, b], 2)] == [B, C]
