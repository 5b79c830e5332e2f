"""Processor cache: LRU store, message handling, the real server process over IPC, restart and fallback."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from PIL import Image

from warmfleet.server.multimodal import wire
from warmfleet.server.multimodal.inputs import ImageInputPreparer
from warmfleet.server.multimodal.media import MediaConfig, MediaLoader, decode_image
from warmfleet.server.multimodal.processor import ImageProcessor, ProcessedImage
from warmfleet.server.multimodal.processor_cache import (
    LRUStore,
    ProcessorCacheClient,
    ProcessorCacheProcess,
    handle,
)
from warmfleet.server.multimodal.prompt import UnknownMediaError
from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model
from warmfleet.server.tokenizer import Tokenizer


def proc_img(rows=4, seed=0) -> ProcessedImage:
    pv = np.random.default_rng(seed).standard_normal((rows, 1176)).astype(np.float32)
    return ProcessedImage(pv, (1, 2, rows // 2))


def entry(img):
    h, b = wire.encode(img)
    return h, bytes(b)


def test_lru_evicts_least_recent_and_reads_refresh():
    a, b, c = (entry(proc_img(4, s)) for s in range(3))
    size = len(a[0]) + len(a[1])
    store = LRUStore(capacity_bytes=2 * size + 10)
    store.put(b"a", *a)
    store.put(b"b", *b)
    assert store.get(b"a") == a  # a is now most recent
    store.put(b"c", *c)  # evicts b
    assert store.get(b"b") is None and store.get(b"a") == a and store.get(b"c") == c
    s = store.stats
    assert (s.hits, s.misses, s.evictions, s.puts, s.entries) == (3, 1, 1, 3, 2)
    assert s.usage_bytes == 2 * size
    store.put(b"huge", b"h", b"x" * (3 * size))
    assert s.rejected == 1 and b"huge" not in store.items


def test_bad_messages_get_errors_not_crashes():
    store = LRUStore(1 << 20)
    assert handle(store, [b"only-id"]) is None
    assert handle(store, [b"1", b"NOPE"])[1] == b"ERR"
    assert handle(store, [b"2", b"GET"])[1] == b"ERR"  # missing key
    assert handle(store, [b"3", b"PUT", b"k", b"\xc1garbage", b"xx"])[1] == b"ERR"
    h, buf = entry(proc_img())
    assert handle(store, [b"4", b"PUT", b"k", h, buf[:-4]])[1] == b"ERR"  # truncated pixels
    assert store.items == {} and store.stats.bad_messages == 5
    assert handle(store, [b"5", b"PUT", b"k", h, buf]) is None
    assert handle(store, [b"6", b"GET", b"k"])[:2] == [b"6", b"HIT"]


def test_wire_roundtrip_and_validation():
    img = proc_img(8, 3)
    back = wire.from_msgpack(msgpack.unpackb(msgpack.packb(wire.to_msgpack(img))))
    np.testing.assert_array_equal(back.pixel_values, img.pixel_values)
    assert back.grid_thw == img.grid_thw and back.num_tokens == 2
    bad = msgpack.packb({"grid": [1, 2, 2], "dtype": "object", "shape": [4, 1176]})
    with pytest.raises(ValueError):
        wire.decode(bad, b"")


def test_client_drops_late_replies_and_times_out(tmp_path):
    ctx = zmq.Context.instance()
    addr = f"ipc://{tmp_path}/fake.sock"
    router = ctx.socket(zmq.ROUTER)
    router.bind(addr)
    client = ProcessorCacheClient(addr, timeout_s=0.2)
    try:
        # the first calls may fail fast (IMMEDIATE) until the IPC connection is up; then one times out
        deadline = time.monotonic() + 10
        while client.num_timeouts == 0 and time.monotonic() < deadline:
            assert client.get("x") is None
        assert client.num_timeouts == 1  # nobody answers
        ident, req1, *_ = router.recv_multipart()
        router.send_multipart([ident, req1, b"MISS"])  # late answer to the timed-out call
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("s", client.stats()))
        client.timeout_s = 5.0
        t.start()
        ident, req2, cmd = router.recv_multipart()
        assert cmd == b"STATS" and req2 != req1
        router.send_multipart([ident, req2, b"STATS", msgpack.packb({"hits": 7})])
        t.join()
        assert result["s"].hits == 7
    finally:
        client.close()
        router.close(0)


def _wait_up(client: ProcessorCacheClient) -> None:
    for _ in range(60):  # each ping waits up to 1 s for the (re)spawned process
        if client.ping(timeout_s=1.0):
            return
    raise AssertionError("processor cache process did not come up")


def _put(client: ProcessorCacheClient, key: str, img: ProcessedImage) -> None:
    """PUT that is not dropped: a PUT never blocks, so when the send queue is full (the server is still
    writing earlier ones) wait for a PING's round trip through the same queue, then send it again."""
    for _ in range(20):
        dropped = client.num_unavailable
        client.put(key, img)
        if client.num_unavailable == dropped:
            return
        assert client.ping(timeout_s=5.0)
    raise AssertionError(f"PUT {key} kept being dropped")


@pytest.fixture
def cache_proc(tmp_path):
    p = ProcessorCacheProcess(f"ipc://{tmp_path}/pc.sock", capacity_bytes=1 << 20).start()
    yield p
    p.stop()


def test_server_process_roundtrip_counters_and_bad_input(cache_proc):
    client = ProcessorCacheClient(cache_proc.address, timeout_s=2.0)
    _wait_up(client)
    img = proc_img(6, 1)
    assert client.get("h1") is None
    client.put("h1", img)
    got = client.get("h1")
    np.testing.assert_array_equal(got.pixel_values, img.pixel_values)
    assert got.grid_thw == img.grid_thw
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(cache_proc.address)
    raw.send_multipart([b"id", b"\x00\xffjunk", b"more"])
    raw.send(b"lonely")
    assert raw.recv_multipart()[1] == b"ERR"
    raw.close(0)
    s = client.stats()
    assert (s.hits, s.misses, s.puts, s.entries) == (1, 1, 1, 1) and s.bad_messages == 2
    assert s.usage_bytes > img.nbytes and s.capacity_bytes == 1 << 20
    for i in range(60):  # 60 × ~28 KB overflows 1 MiB
        _put(client, f"k{i}", proc_img(6, i))
    assert client.ping(timeout_s=5.0)  # every PUT before it has been handled
    s = client.stats()
    assert s.evictions > 0 and s.usage_bytes <= s.capacity_bytes
    client.close()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(make_tiny_vl_model(tmp_path_factory.mktemp("tvl"), "qwen2_vl"))


def _jpeg_uri(seed=0) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(buf, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def test_preparer_hits_uuid_reuse_and_survives_cache_death(cache_proc, tok):
    client = ProcessorCacheClient(cache_proc.address, timeout_s=1.0)
    _wait_up(client)
    prep = ImageInputPreparer(tok, ImageProcessor.from_model_dir(tok.model_dir), MediaLoader(MediaConfig()), client)
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _jpeg_uri()}, "uuid": "u1"},
                                         {"type": "text", "text": "hi"}]}]
    first = prep.prepare(msg)
    assert (first.num_processor_cache_hits, len(first.images)) == (0, 1)
    only_uuid = [{"role": "user", "content": [{"type": "image_url", "uuid": "u1"}, {"type": "text", "text": "hi"}]}]
    again = prep.prepare(only_uuid)
    assert again.num_processor_cache_hits == 1
    assert again.prompt.prompt_token_ids == first.prompt.prompt_token_ids
    np.testing.assert_array_equal(again.images[0].pixel_values, first.images[0].pixel_values)
    with pytest.raises(UnknownMediaError, match=r"messages\[0\]\.content\[0\]: unknown image uuid 'nope'"):
        prep.prepare([{"role": "user", "content": [{"type": "image_url", "uuid": "nope"}]}])

    plain = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _jpeg_uri(5)}}]}]
    prep.prepare(plain)
    assert prep.prepare(plain).num_processor_cache_hits == 1

    os.kill(cache_proc.process.pid, signal.SIGKILL)
    cache_proc.process.wait()
    local = prep.prepare(plain)  # served by local preprocessing while the cache is down/restarting
    expect = prep.processor(decode_image(base64.b64decode(_jpeg_uri(5).split(",")[1]), "p", 1 << 30))
    np.testing.assert_array_equal(local.images[0].pixel_values, expect.pixel_values)
    assert local.num_processor_cache_hits == 0
    _wait_up(client)  # same client socket reconnects to the restarted process
    assert cache_proc.num_restarts == 1
    assert prep.prepare(plain).num_processor_cache_hits in (0, 1)  # restarted cache starts empty (or holds the fallback's PUT)
    assert prep.prepare(plain).num_processor_cache_hits == 1
    client.close()


def test_server_hands_pixels_over_in_shared_memory(cache_proc):
    """A hit names a file in the server's shm directory; eviction unlinks it, a live mapping stays valid."""
    from warmfleet.server.multimodal.processor_cache import shm_dir_for

    client = ProcessorCacheClient(cache_proc.address, timeout_s=2.0)
    _wait_up(client)
    img = proc_img(6, 7)
    client.put("s1", img)
    reply = client._send([b"GET", b"s1"], expect_reply=True)
    assert reply[0].bytes == b"HIT_SHM"
    path = shm_dir_for(cache_proc.address) / reply[2].bytes.decode()
    assert path.stat().st_size == img.pixel_values.nbytes
    held = client.get("s1")
    assert not held.pixel_values.flags.writeable  # a read-only view of the shared file, not a copy
    np.testing.assert_array_equal(held.pixel_values, img.pixel_values)
    for i in range(60):  # overflow the 1 MiB budget: s1 is evicted and its file unlinked
        _put(client, f"k{i}", proc_img(6, i))
    assert client.ping(timeout_s=5.0)  # every PUT before it has been handled
    assert client.get("s1") is None and not path.exists()
    np.testing.assert_array_equal(held.pixel_values, img.pixel_values)  # the mapping outlives the unlink
    files = list(shm_dir_for(cache_proc.address).iterdir())
    assert 0 < len(files) == client.stats().entries
    cache_proc.stop()
    assert not shm_dir_for(cache_proc.address).exists()
    client.close()


def test_pixels_stay_in_memory_when_no_file_can_be_written(tmp_path):
    from warmfleet.server.multimodal.processor_cache import PixelFiles

    files = PixelFiles(tmp_path / "shm")
    files.write = lambda data: None  # e.g. /dev/shm full
    store = LRUStore(1 << 20)
    h, buf = entry(proc_img(4, 1))
    assert handle(store, [b"1", b"PUT", b"k", h, buf], files) is None
    reply = handle(store, [b"2", b"GET", b"k"], files)
    assert reply[1] == b"HIT" and reply[3] == buf
