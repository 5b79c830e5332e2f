"""KV events from a real engine: sequence numbers, contract-1 hashes, tiers, snapshot agreement."""

import time

import zmq

from warmfleet.localprocs import free_port
from warmfleet.server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from warmfleet.server.engine.core import EngineCore
from warmfleet.server.engine.protocol import GenerateRequest
from warmfleet.server.engine.sampling_params import SamplingParams
from warmfleet.server.events import CPU, GPU, BlockRemoved, BlockStored, EventPublisher, Load, decode
from warmfleet.server.hashing import block_hashes, model_fingerprint




def drain(sub, until, timeout_s=10.0):
    """Receive batches until `until(batches)` holds (or fail at the deadline)."""
    batches, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            batches.append(decode(sub.recv_multipart()))
            if until(batches):
                return batches
    raise AssertionError(f"condition not met; got {len(batches)} batches")


def run(core, rid, prompt, salt=None):
    core.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), salt))
    while core.has_work:
        core.step()


def engine_with_subscriber(model_dir, token_ids: bool = False):
    """An engine core publishing on a free port, a subscriber joined to it, and the first batch it saw (a Load)."""
    port = free_port()
    pub = EventPublisher("replica-a", f"tcp://127.0.0.1:{port}", token_ids=token_ids)
    cfg = EngineConfig(ModelConfig(model=str(model_dir)),
                       CacheConfig(block_size=16, num_gpu_blocks=8, swap_space=0.01), server=ServerConfig())
    core = EngineCore(cfg, pub)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    # PUB/SUB joins asynchronously: publish load until the subscriber sees one
    deadline = time.monotonic() + 10
    while not sub.poll(50):
        core.publish_load()
        assert time.monotonic() < deadline
    return pub, core, sub, decode(sub.recv_multipart())


def test_events_carry_contract_hashes_sequence_and_tiers(tiny_model_dir):
    pub, core, sub, first = engine_with_subscriber(tiny_model_dir)
    assert isinstance(first.events[0], Load)

    prompt = list(range(40, 90))  # 50 tokens: 3 full blocks of 16
    run(core, "a", prompt, salt="s")
    expected = block_hashes(prompt, [], 16, model_fingerprint(tiny_model_dir), "s")
    batches = drain(sub, lambda bs: sum(len(e.block_hashes) for b in bs for e in b.events
                                        if isinstance(e, BlockStored)) >= 3)
    stored = [h for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == GPU
              for h in e.block_hashes]
    assert stored[:3] == expected
    seqs = [first.seq] + [b.seq for b in batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    run(core, "filler", [7] * 127)  # 8 blocks: pushes a's blocks into the CPU tier
    batches = drain(sub, lambda bs: any(isinstance(e, BlockStored) and e.medium == CPU for b in bs for e in b.events))
    removed_gpu = {h for b in batches for e in b.events if isinstance(e, BlockRemoved) and e.medium == GPU
                   for h in e.block_hashes}
    assert set(expected) <= removed_gpu
    snap = core.snapshot()
    assert set(expected) <= set(snap.cpu) and not set(expected) & set(snap.gpu)
    assert snap.seq == pub.seq
    sub.close(0)
    pub.close()


def test_block_stored_carries_no_token_ids_unless_asked(tiny_model_dir):
    """The event port is unauthenticated: by default BlockStored's token list is empty (the hashes are unchanged);
    --kv-events-token-ids publishes the prompt's tokens for consumers that rebuild hashes from them."""
    prompt = list(range(40, 90))  # 3 full blocks of 16
    seen = {}
    for token_ids in (False, True):
        pub, core, sub, _ = engine_with_subscriber(tiny_model_dir, token_ids)
        run(core, "a", prompt)
        batches = drain(sub, lambda bs: sum(len(e.block_hashes) for b in bs for e in b.events
                                            if isinstance(e, BlockStored)) >= 3)
        stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
        seen[token_ids] = ([h for e in stored for h in e.block_hashes][:3], [t for e in stored for t in e.token_ids])
        sub.close(0)
        pub.close()
    assert seen[False][0] == seen[True][0] == block_hashes(prompt, [], 16, model_fingerprint(tiny_model_dir), None)
    assert seen[False][1] == [] and seen[True][1][:48] == prompt[:48]
