"""KV index under stored/removed/cleared/gap/restart event sequences and snapshot resync."""

import random

from router_fakes import synced
from warmfleet.server.events import (
    CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, EncoderRemoved, EncoderStored, EventBatch, Load, Snapshot,
)
from warmfleet.server.router.core.index import Applied, KVIndex, PrefixMatch


def H(i: int) -> bytes:
    return bytes([i]) * 8


def stored(*ids, medium=GPU):
    return BlockStored([H(i) for i in ids], None, [], 4, medium=medium)


def snap(seq, gpu=(), cpu=(), encoder=()):
    return Snapshot("r", seq, 4, "fp", [H(i) for i in gpu], [H(i) for i in cpu], list(encoder))


def synced_index(rid="a", seq=0):
    idx = KVIndex()
    assert idx.apply_snapshot(rid, snap(seq)) is Applied.OK
    return idx


def test_unsynced_replica_buffers_until_snapshot_then_replays_newer_batches():
    idx = KVIndex()
    assert idx.apply_batch("a", EventBatch("a", 5, [stored(1)])) is Applied.BUFFERED
    assert idx.apply_batch("a", EventBatch("a", 6, [stored(2)])) is Applied.BUFFERED
    assert idx.match([H(1), H(2)], ["a"])["a"] == PrefixMatch(0, 0)
    # snapshot at seq 5 already contains block 1; batch 6 must be replayed on top
    assert idx.apply_snapshot("a", snap(5, gpu=[1])) is Applied.OK
    assert idx.match([H(1), H(2)], ["a"])["a"] == PrefixMatch(2, 0)
    assert idx.state("a").seq == 6


def test_stored_removed_and_tiers():
    idx = synced_index()
    assert idx.apply_batch("a", EventBatch("a", 1, [stored(1, 2, 3)])) is Applied.OK
    assert idx.apply_batch("a", EventBatch("a", 2, [BlockRemoved([H(2)], GPU), stored(2, medium=CPU)])) is Applied.OK
    m = idx.match([H(1), H(2), H(3), H(4)], ["a"])["a"]
    assert m == PrefixMatch(gpu_blocks=2, cpu_blocks=1)
    idx.apply_batch("a", EventBatch("a", 3, [BlockRemoved([H(2)], CPU)]))
    assert idx.match([H(1), H(2), H(3)], ["a"])["a"] == PrefixMatch(1, 0)  # prefix stops at the hole
    assert idx.num_blocks() == 2


def test_match_is_per_replica_longest_prefix():
    idx = synced_index("a")
    idx.apply_snapshot("b", snap(0))
    idx.apply_batch("a", EventBatch("a", 1, [stored(1, 2)]))
    idx.apply_batch("b", EventBatch("b", 1, [stored(1, 2, 3)]))
    got = idx.match([H(1), H(2), H(3), H(9)], ["a", "b", "c"])
    assert (got["a"].blocks, got["b"].blocks, got["c"].blocks) == (2, 3, 0)


def reference_match(idx, hashes, replicas):
    """Block by block, replica by replica: the longest prefix each holds, a block in both tiers counted GPU."""
    out = {}
    for r in replicas:
        st, gpu, cpu = idx.replicas.get(r), 0, 0
        for h in hashes:
            if st is not None and h in st.gpu:
                gpu += 1
            elif st is not None and h in st.cpu:
                cpu += 1
            else:
                break
        out[r] = PrefixMatch(gpu, cpu)
    return out


def test_match_over_runs_of_blocks_held_alike_equals_the_block_by_block_answer():
    rng = random.Random(7)
    idx, seqs = KVIndex(), {}
    rids = [f"r{i}" for i in range(6)]
    for r in rids:
        idx.apply_snapshot(r, snap(0))
        seqs[r] = 0
    for _ in range(300):  # shared prefixes, partial copies, tier moves and holes
        r = rng.choice(rids)
        start, n = rng.randrange(0, 20), rng.randrange(1, 12)
        events = [stored(*range(start, start + n), medium=rng.choice([GPU, GPU, CPU]))]
        if rng.random() < 0.3:
            events.append(BlockRemoved([H(rng.randrange(0, 30))], rng.choice([GPU, CPU])))
        seqs[r] += 1
        assert idx.apply_batch(r, EventBatch(r, seqs[r], events)) is Applied.OK
        hashes = [H(i) for i in range(rng.randrange(0, 3), 30)]
        wanted = rng.sample(rids + ["gone"], rng.randrange(1, 7))
        assert idx.match(hashes, wanted) == reference_match(idx, hashes, wanted)


def test_gap_requests_resync_keeps_state_and_snapshot_restores():
    idx = synced_index()
    idx.apply_batch("a", EventBatch("a", 1, [stored(1)]))
    assert idx.apply_batch("a", EventBatch("a", 3, [stored(3)])) is Applied.NEED_RESYNC
    assert synced(idx, ["a"]) and idx.match([H(1)], ["a"])["a"].blocks == 1  # still predicting from what it knew
    assert idx.apply_batch("a", EventBatch("a", 4, [stored(4)])) is Applied.NEED_RESYNC
    assert idx.apply_snapshot("a", snap(3, gpu=[1, 2, 3]), seq_at_request=1) is Applied.OK
    assert idx.match([H(1), H(2), H(3), H(4)], ["a"])["a"].blocks == 4
    assert idx.state("a").seq == 4


def test_snapshot_older_than_buffer_needs_another_resync():
    idx = KVIndex()
    idx.apply_batch("a", EventBatch("a", 10, [stored(1)]))
    assert idx.apply_snapshot("a", snap(7)) is Applied.NEED_RESYNC  # 8 and 9 were never seen


def test_all_blocks_cleared_purges_replica_only():
    idx = synced_index("a")
    idx.apply_snapshot("b", snap(0, gpu=[1]))
    idx.apply_batch("a", EventBatch("a", 1, [stored(1, 2), stored(3, medium=CPU)]))
    idx.apply_batch("a", EventBatch("a", 2, [AllBlocksCleared()]))
    got = idx.match([H(1), H(2)], ["a", "b"])
    assert got["a"].blocks == 0 and got["b"].blocks == 1
    assert synced(idx, ["a"])  # clearing is an ordinary event: no resync needed


def test_restart_is_settled_by_the_snapshot_and_later_batches_replay():
    idx = synced_index()
    for q in range(1, 6):
        idx.apply_batch("a", EventBatch("a", q, [stored(q)]))
    # the engine restarted: its seq starts over; nothing is forgotten on the word of one message
    assert idx.apply_batch("a", EventBatch("a", 1, [stored(7)])) is Applied.NEED_RESYNC
    assert idx.apply_batch("a", EventBatch("a", 2, [stored(8)])) is Applied.NEED_RESYNC
    assert idx.match([H(1)], ["a"])["a"].blocks == 1
    assert idx.apply_snapshot("a", snap(1, gpu=[7]), seq_at_request=5) is Applied.OK
    assert idx.match([H(1)], ["a"])["a"].blocks == 0
    assert idx.match([H(7), H(8)], ["a"])["a"].blocks == 2 and idx.state("a").seq == 2


def test_junk_sequence_numbers_cost_a_resync_not_the_state():
    idx = synced_index()
    idx.apply_batch("a", EventBatch("a", 1, [stored(1, 2)]))
    for junk in (2**62, 0, 1, -5, 1):  # far ahead, behind, duplicated
        assert idx.apply_batch("a", EventBatch("a", junk, [stored(99)])) is Applied.NEED_RESYNC
    assert idx.match([H(1), H(2)], ["a"])["a"].blocks == 2 and idx.match([H(99)], ["a"])["a"].blocks == 0
    # the real stream goes on in order meanwhile
    assert idx.apply_batch("a", EventBatch("a", 2, [stored(3)])) is Applied.OK
    # the snapshot (fetched before batch 2 was applied) is stale and ignored; a fresh one settles it
    assert idx.apply_snapshot("a", snap(1, gpu=[1, 2]), seq_at_request=1) is Applied.STALE
    assert idx.match([H(1), H(2), H(3)], ["a"])["a"].blocks == 3
    assert idx.apply_snapshot("a", snap(2, gpu=[1, 2, 3]), seq_at_request=2) is Applied.NEED_RESYNC  # 2**62 kept aside
    assert idx.apply_snapshot("a", snap(2, gpu=[1, 2, 3]), seq_at_request=2) is Applied.OK  # dropped: converged
    assert idx.match([H(1), H(2), H(3)], ["a"])["a"].blocks == 3 and idx.match([H(99)], ["a"])["a"].blocks == 0
    assert idx.apply_batch("a", EventBatch("a", 3, [stored(4)])) is Applied.OK


def test_purge_and_remove_forget_the_replica():
    idx = synced_index("a")
    idx.apply_batch("a", EventBatch("a", 1, [stored(1), EncoderStored(["img"])]))
    idx.purge("a")
    assert not synced(idx, ["a"]) and idx.num_blocks() == 0 and not idx.encoder_hits("a", ["img"])
    idx.remove("a")
    assert "a" not in idx.replicas


def test_encoder_and_load_events():
    idx = synced_index()
    idx.apply_batch("a", EventBatch("a", 1, [EncoderStored(["x", "y"]), Load(2, 3, 10, 100)]))
    idx.apply_batch("a", EventBatch("a", 2, [EncoderRemoved(["x"])]))
    assert idx.encoder_hits("a", ["x", "y", "z"]) == {"y"}
    assert idx.state("a").load == Load(2, 3, 10, 100)
