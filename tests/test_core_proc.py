"""The engine-core process's step loop: one outputs message per step, bad messages and failing adds never stop it."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmfleet.server.engine import serde
from warmfleet.server.engine.core_proc import step_loop
from warmfleet.server.engine.protocol import EngineStats, GenerateRequest
from warmfleet.server.engine.request import RequestOutput
from warmfleet.server.engine.sampling_params import SamplingParams


@dataclass
class FakeLink:
    """Hands the loop one batch of messages per receive() call; records what it sends."""

    batches: list[list[tuple]]
    sent: list[tuple] = field(default_factory=list)

    def receive(self, timeout_ms: int):
        yield from (self.batches.pop(0) if self.batches else [("shutdown", None)])

    def send(self, kind: str, payload) -> None:
        self.sent.append((kind, payload))

    def send_outputs(self, outputs: list) -> None:
        self.send("outputs", [serde.output_to_wire(o) for o in outputs])


class FakeCore:
    """Adds requests (or refuses some), and finishes every running request in one step."""

    def __init__(self, refuse: dict[str, Exception]):
        self.refuse = refuse
        self.running: list[str] = []
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def add_request(self, req: GenerateRequest) -> None:
        if req.request_id in self.refuse:
            raise self.refuse[req.request_id]
        self.running.append(req.request_id)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        done, self.running = self.running, []
        return [RequestOutput(rid, [7], True, "length", 2) for rid in done]

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running))

    def publish_load(self) -> None:
        pass


def add(rid: str) -> tuple:
    return ("adds", [serde.request_to_wire(GenerateRequest(rid, [1, 2], SamplingParams(max_tokens=1)))])


def test_a_steps_outputs_go_out_as_one_message_and_failures_stay_with_their_request():
    core = FakeCore({"bad-value": ValueError("prompt too long"), "bad-bug": RuntimeError("boom")})
    link = FakeLink([[add("a"), add("bad-value"), ("adds", [{"request_id": "x"}]), add("b"), add("bad-bug"),
                      ("call", [3, "stats"]), ("nonsense", 1)]])
    step_loop(core, link)
    outputs = [p for k, p in link.sent if k == "outputs"]
    errors = {o[0]: o[8] for batch in outputs for o in batch if o[8]}
    assert errors == {"bad-value": "prompt too long", "bad-bug": "RuntimeError: boom"}
    steps = [batch for batch in outputs if not any(o[8] for o in batch)]
    assert core.steps == 1 and [[o[0] for o in batch] for batch in steps] == [["a", "b"]]
    assert ("reply", [3, {**EngineStats(num_running=2).__dict__}]) in link.sent


def test_an_engine_whose_api_process_died_during_load_stops_at_its_first_loop(monkeypatch, caplog):
    import os

    core = FakeCore({})
    link = FakeLink([[add("a")]] * 5)
    monkeypatch.setattr(os, "getppid", lambda: 1)  # re-parented to init while the model loaded
    with caplog.at_level("WARNING", logger="warmfleet.engine"):
        step_loop(core, link, parent=4242)
    assert core.steps == 0 and len(link.batches) == 5 and "API process exited" in caplog.text


def test_one_adds_message_puts_all_its_requests_into_the_same_first_step():
    core = FakeCore({"bad": ValueError("prompt too long")})
    wires = [add(rid)[1][0] for rid in ("a", "bad", "b", "c")]
    step_loop(core, FakeLink([[("adds", wires)]]))
    assert core.steps == 1  # a, b and c ran together; the refused one failed alone


async def test_requests_started_in_one_event_loop_tick_reach_the_engine_as_one_message(monkeypatch):
    """A multi-prompt request starts one task per choice; the engine must see them together (one step)."""
    import asyncio

    from warmfleet.server.engine.async_engine import AsyncEngine

    engine = AsyncEngine.__new__(AsyncEngine)
    engine.dead, engine._queues, engine._adds, engine._adds_sent, engine._flushes = None, {}, [], None, set()
    sent = []

    async def fake_send(kind, payload):
        sent.append((kind, [w["request_id"] for w in payload] if kind == "adds" else payload))

    monkeypatch.setattr(engine, "_send", fake_send)

    async def first_output(rid):
        gen = engine.generate(GenerateRequest(rid, [1, 2], SamplingParams(max_tokens=1)))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        engine._queues[rid].put_nowait(RequestOutput(rid, [7], True, "length", 2))
        return (await task).request_id, await gen.aclose()

    done = await asyncio.gather(*(first_output(r) for r in ("a", "b", "c")))
    assert [d[0] for d in done] == ["a", "b", "c"]
    assert sent == [("adds", ["a", "b", "c"])]
