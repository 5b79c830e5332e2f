"""KV-event wire format: round trip, and every malformed or foreign frame rejected with ValueError (never another error)."""

import struct

import msgpack
import pytest

from warmfleet.server.events import CPU, BlockRemoved, BlockStored, EventBatch, Load, decode, encode


def frames(payload, seq=1, topic=b"r"):
    return [topic, struct.pack(">q", seq), msgpack.packb(payload, use_bin_type=True)]


def test_round_trip():
    batch = EventBatch("r", 7, [BlockStored([b"\x01" * 32], None, [1, 2], 2, medium=CPU),
                                BlockRemoved([b"\x01" * 32], CPU), Load(1, 2, 3, 4)], ts=12.5)
    got = decode(encode(batch))
    assert (got.replica_id, got.seq, got.ts, got.events) == ("r", 7, 12.5, batch.events)


VLLM_EVENT = {"type": "BlockStored", "block_hashes": [2**63 + 5], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU"}


@pytest.mark.parametrize("bad", [
    [b"only one frame"],
    [b"r", b"\x00" * 7, b""],                                   # seq is not 8 bytes
    [b"r", b"\x00" * 8, b"\xc1"],                               # not msgpack
    frames({"ts": 1}),                                          # payload not an array
    frames([1.0]),                                              # no events
    frames(["now", []]),                                        # ts not a number
    frames([1.0, "events"]),                                    # events not an array
    frames([1.0, [VLLM_EVENT], 0]),                             # vLLM's dialect: maps
    frames([1.0, [[1, 2, 3]], 0]),                              # untagged
    frames([1.0, [["BlockStored", [2**40], None, [], 4, None, "GPU"]], 0]),   # int hashes
    frames([1.0, [["BlockStored", [b"h"], None, [], 0, None, "GPU"]], 0]),    # block size 0
    frames([1.0, [["BlockStored", [b"h"], None, [], 4, None, "DISK"]], 0]),   # unknown medium
    frames([1.0, [["BlockRemoved", "not-a-list"]], 0]),
    frames([1.0, [["BlockStored"]], 0]),                        # truncated
    frames([1.0, [["Load", -1, 0, 0, 0]], 0]),
    frames([1.0, [["EncoderStored", [1, 2]]], 0]),
])
def test_malformed_and_foreign_frames_raise_value_error(bad):
    with pytest.raises(ValueError):
        decode(bad)


def test_unknown_tags_are_skipped():
    got = decode(frames([1.0, [["FutureEvent", 1], ["AllBlocksCleared"]], 0]))
    assert len(got.events) == 1
