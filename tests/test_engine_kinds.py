"""Engine kinds: one registry (server/engine_kinds.py) that the router, the operator and the CRD agree with, and
every registered dialect keeps the router's Dialect contract (llm-d's `var _ framework.Scorer = &X{}`, checked by
behaviour since a Protocol cannot be)."""

from __future__ import annotations

import argparse
import asyncio
import inspect

import httpx
import pytest

from warmfleet.operator.planning.engine_descriptions import ENGINES
from warmfleet.operator.spec.crd import crd
from warmfleet.server import engine_kinds
from warmfleet.server.events import EventBatch, Snapshot
from warmfleet.server.router.core.engines import Dialect, dialect_for
from warmfleet.server.router.core.index import KVIndex
from warmfleet.server.router.core.prompt import HashConfig, Prompt
from warmfleet.server.router.core.registry import Replica, ReplicaSpec
from warmfleet.server.router.core.settings import RouterSettings
from warmfleet.server.router.http import main

CFG = HashConfig(16, "fp")
PROMPT = Prompt(list(range(100, 170)), [], 70)  # four full blocks of 16 and a partial one
PROTOCOL = [name for name in vars(Dialect) if not name.startswith("_")]  # methods, then from_settings
ATTRIBUTES = list(Dialect.__annotations__)  # kind, contract, ready_path


def test_router_operator_and_crd_name_the_same_kinds():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    enum = spec["properties"]["engine"]["properties"]["kind"]["enum"]
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    (engine_flag,) = [a for a in parser._actions if "--engine" in a.option_strings]
    assert tuple(engine_kinds.DIALECTS) == engine_kinds.KINDS == ("warmfleet", "vllm", "fastdeploy")
    assert tuple(ENGINES) == tuple(engine_flag.choices) == engine_kinds.KINDS
    assert tuple(enum) == ("auto", *engine_kinds.KINDS)  # the CRD adds `auto`: the operator picks by the pools' GPUs
    assert all(e.kind == kind for kind, e in ENGINES.items())


def test_an_unknown_kind_is_refused_in_one_line():
    for make in (lambda: engine_kinds.dialect_class("tgi"), lambda: RouterSettings(engine="tgi")):
        with pytest.raises(ValueError, match="^unknown engine kind 'tgi'; choose one of warmfleet, vllm, fastdeploy$"):
            make()


@pytest.mark.parametrize("kind", engine_kinds.KINDS)
def test_every_registered_dialect_keeps_the_dialect_contract(kind):
    d = dialect_for(RouterSettings(engine=kind))
    # the shape: every attribute and method of the protocol, async where the protocol's is, same arity
    assert type(d).__name__ == engine_kinds.DIALECTS[kind].rpartition(":")[2]
    assert all(hasattr(d, a) for a in ATTRIBUTES), [a for a in ATTRIBUTES if not hasattr(d, a)]
    for name in PROTOCOL:
        want, got = inspect.getattr_static(Dialect, name), getattr(d, name)
        want_fn = want.__func__ if isinstance(want, classmethod) else want
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want_fn), name
        n_args = len(inspect.signature(want_fn).parameters) - 1  # without self / cls
        inspect.signature(got).bind(*range(n_args))  # TypeError if it cannot be called as the protocol is
    # its identity, as the fleet and /v1/router/replicas read it
    assert d.kind == kind and d.contract in ("exact", "predicted") and d.ready_path.startswith("/")
    assert isinstance(type(d).from_settings(RouterSettings(engine=kind)), type(d))
    # block names: one per full block, bytes, stable, and never shared across cache salts (tenants)
    names = d.block_hashes(PROMPT, None, CFG)
    assert len(names) == 4 and all(isinstance(h, bytes) for h in names) and len(set(names)) == 4
    assert d.block_hashes(PROMPT, None, CFG) == names
    assert set(d.block_hashes(PROMPT, "tenant-b", CFG)).isdisjoint(names)
    body = {"model": "m", "prompt": PROMPT.token_ids}
    assert isinstance(d.prepare_body(body, PROMPT), bool)
    # malformed frames are refused with ValueError (the subscriber drops and counts them), never anything else
    for frames in ([b"\xff\x00junk"], [b"topic", b"\x00" * 8, b"\xc1"]):
        with pytest.raises(ValueError):
            d.decode(frames)
    assert isinstance(d.hash_check(), dict)
    # what the router tells it about a replica, and an unreachable replica: no exception escapes
    index = KVIndex()
    d.served(index, "r0", names)
    d.forget("r0")
    asyncio.run(_unreachable(d))


async def _unreachable(d) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    rep = Replica(ReplicaSpec("http://127.0.0.1:9", metrics="http://127.0.0.1:9"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
        state = await d.fetch_state(rep, http, {})
        load = await d.poll_load(rep, http)
    assert state is None or isinstance(state, Snapshot)
    assert load is None


def test_a_decoded_message_is_an_event_batch():
    """What `decode` returns on success (the protocol's other half), for the dialects that have events."""
    from warmfleet.server.events import BlockStored, encode

    batch = EventBatch("r0", 1, [BlockStored([b"\x01" * 32], None, [1] * 16, 16)])
    assert isinstance(dialect_for(RouterSettings(engine="warmfleet")).decode(encode(batch)), EventBatch)


def test_every_kind_has_its_request_limits_and_warmfleets_are_its_replicas_defaults():
    """The router's and the picker's default per-request limits (issue 40) are keyed by the same kinds; warmfleet's
    are exactly what a `warmfleet serve` replica refuses without flags."""
    from warmfleet.server.config import EngineConfig

    assert tuple(engine_kinds.REQUEST_LIMITS) == engine_kinds.KINDS
    cfg, ours = EngineConfig(), engine_kinds.REQUEST_LIMITS["warmfleet"]
    assert ours.max_choices() == cfg.scheduler.choice_limit
    assert ours.max_choices(10) == 40 and ours.mm_limit({}, "image") == cfg.server.mm_limits()["image"]
    assert engine_kinds.REQUEST_LIMITS["vllm"].max_choices(10) is None
