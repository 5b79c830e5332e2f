"""Encoder cache: budget, LRU over unpinned entries, pins, oversize items, events, and row slicing."""

from __future__ import annotations

import pytest

from warmfleet.server.engine.encoder_cache import EncoderCache, chunk_end, image_slices
from warmfleet.server.events import EncoderRemoved, EncoderStored
from warmfleet.server.hashing import MMPlaceholder


def test_store_lookup_lru_eviction_and_events():
    c = EncoderCache(100)
    assert c.store("a", "A", 40) and c.store("b", "B", 40)
    assert c.lookup("a") == "A"  # a becomes most recent
    assert c.store("c", "C", 40)  # evicts b, the least recently used
    assert "b" not in c and c.lookup("b") is None and "a" in c and "c" in c
    assert c.take_events() == [EncoderStored(["a"]), EncoderStored(["b"]), EncoderRemoved(["b"]), EncoderStored(["c"])]
    assert c.take_events() == []  # drained
    s = c.stats
    assert (s.num_hits, s.num_misses, s.num_evictions, s.usage_tokens, s.num_stored) == (1, 1, 1, 80, 3)


def test_pinned_entries_survive_and_block_when_full():
    c = EncoderCache(100)
    c.store("a", "A", 60)
    c.pin("req-1", "a")
    assert not c.can_store(50)
    assert not c.store("b", "B", 50) and c.stats.num_no_room == 1 and "a" in c
    c.release("req-1")
    assert c.store("b", "B", 50) and "a" not in c


def test_shared_pin_released_only_by_last_user():
    c = EncoderCache(50)
    c.store("a", "A", 50)
    c.pin("r1", "a")
    c.pin("r2", "a")
    c.release("r1")
    assert not c.store("b", "B", 10)
    c.release("r2")
    assert c.store("b", "B", 10)


def test_item_larger_than_budget_is_not_stored():
    c = EncoderCache(10)
    c.store("small", "s", 5)
    assert not c.store("huge", "H", 11)
    assert "huge" not in c and "small" in c and c.stats.num_too_large == 1
    assert not EncoderCache(0).store("x", "X", 1)  # 0 disables storing


def test_clear_keeps_pinned():
    c = EncoderCache(100)
    c.store("a", "A", 10)
    c.store("b", "B", 10)
    c.pin("r", "b")
    c.take_events()
    c.clear()
    assert "b" in c and "a" not in c and c.usage_tokens == 10
    assert c.take_events() == [EncoderRemoved(["a"])]


def test_negative_budget_rejected():
    with pytest.raises(ValueError, match="tokens"):
        EncoderCache(-1)


PH = [MMPlaceholder("img0", 10, 20), MMPlaceholder("img1", 40, 8)]


def test_slices_for_partly_prefix_cached_image():
    # prefix cache covered tokens [0, 16): image 0 rows 0..5 are already in the KV cache
    (s,) = image_slices(PH, 16, 35)
    assert (s.index, s.mm_hash, s.rows, s.dst) == (0, "img0", (6, 20), (0, 14))


def test_slices_span_two_images_and_text():
    a, b = image_slices(PH, 5, 60)
    assert a.rows == (0, 20) and a.dst == (5, 25)
    assert b.rows == (0, 8) and b.dst == (35, 43)
    assert image_slices(PH, 30, 40) == []  # text between the images
    (tail,) = image_slices(PH, 44, 48)
    assert tail.rows == (4, 8) and tail.dst == (0, 4)


def test_chunk_end_never_inside_an_image():
    assert chunk_end(PH, 0, 20) == 10  # back off to the image's start
    assert chunk_end(PH, 0, 30) == 30  # ends exactly at the image's end
    assert chunk_end(PH, 10, 20) == 30  # the chunk starts at the image: it must take all of it
    assert chunk_end(PH, 16, 20) == 30  # starts mid-image (prefix hit): finish the image
    assert chunk_end(PH, 0, 35) == 35
