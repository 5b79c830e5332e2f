"""Images through the engine: image-aware prefix hits, encoder cache, mid-image prefix hits, chunking."""


import pytest

from warmfleet import LLM, SamplingParams
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def conv(text_before, uri, question):
    return [{"role": "user", "content": [
        {"type": "text", "text": text_before},
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "text", "text": question}]}]


LONG = "Describe the picture below in great detail, paying attention to colour and shape. " * 2


def test_image_aware_prefix_hits(tiny_vl_dir):
    llm = LLM(str(tiny_vl_dir), block_size=16, num_gpu_blocks=256)
    a = llm.chat(conv(LONG, data_uri(image_bytes(112, 168, seed=1)), "What is it?"), GREEDY)[0]
    assert a.num_cached_tokens == 0
    prep = llm._image_preparer().prepare(conv(LONG, data_uri(image_bytes(112, 168, seed=1)), "What is it?"))
    (ph,) = prep.prompt.mm_placeholders
    # same text, same image, other question: hits through the image
    b = llm.chat(conv(LONG, data_uri(image_bytes(112, 168, seed=1)), "And the colours?"), GREEDY)[0]
    assert b.num_cached_tokens >= ph.offset + ph.length - 16
    # same text, different image: hits only the blocks that end before the image starts
    c = llm.chat(conv(LONG, data_uri(image_bytes(112, 168, seed=2)), "What is it?"), GREEDY)[0]
    assert c.num_cached_tokens == (ph.offset // 16) * 16
    st = llm.stats()
    assert st.encoder_cache_hits >= 1 and st.encoder_cache_misses >= 2


def test_outputs_identical_with_and_without_caches(tiny_vl_dir):
    # block size 8 puts block boundaries inside the image: a later hit starts mid-image and must
    # splice exactly the image rows it still needs
    msgs = conv(LONG, data_uri(image_bytes(112, 168, seed=3)), "What is it?")
    cold = LLM(str(tiny_vl_dir), block_size=8, num_gpu_blocks=256, enable_prefix_caching=False, max_encoder_cache=0)
    ref = cold.chat(msgs, GREEDY)[0].outputs[0].token_ids
    warm = LLM(str(tiny_vl_dir), block_size=8, num_gpu_blocks=256)
    warm.chat(msgs, GREEDY)
    again = warm.chat(msgs, GREEDY)[0]
    assert again.outputs[0].token_ids == ref and again.num_cached_tokens > 0
    # encoder cache alone (no prefix cache): the encoder is skipped, output unchanged
    enc = LLM(str(tiny_vl_dir), block_size=8, num_gpu_blocks=256, enable_prefix_caching=False)
    enc.chat(msgs, GREEDY)
    out = enc.chat(msgs, GREEDY)[0]
    assert out.outputs[0].token_ids == ref and enc.stats().encoder_cache_hits >= 1


def test_chunks_never_end_inside_an_image(tiny_vl_dir):
    msgs = conv(LONG, data_uri(image_bytes(224, 224, seed=4)), "What is it?")  # 64 image tokens > the 20-token budget
    ref = LLM(str(tiny_vl_dir), block_size=8, num_gpu_blocks=256).chat(msgs, GREEDY)[0].outputs[0].token_ids
    llm = LLM(str(tiny_vl_dir), block_size=8, num_gpu_blocks=256, max_num_batched_tokens=20)
    prep = llm._image_preparer().prepare(msgs)
    (ph,) = prep.prompt.mm_placeholders
    ends = []
    orig = llm.engine.scheduler.schedule

    def spy():
        out = orig()
        ends.extend(s.num_computed_before + s.num_tokens for s in out.scheduled)
        return out

    llm.engine.scheduler.schedule = spy
    assert llm.chat(msgs, GREEDY)[0].outputs[0].token_ids == ref
    assert len(ends) > 5 and ph.length == 64  # the prompt really was chunked around an image over budget
    assert not any(ph.offset < e < ph.offset + ph.length for e in ends)


def test_text_model_refuses_images(tiny_model_dir):
    from warmfleet.server.engine.protocol import GenerateRequest
    from warmfleet.server.hashing import MMPlaceholder

    llm = LLM(str(tiny_model_dir), block_size=16, num_gpu_blocks=32)
    with pytest.raises(ValueError, match="does not accept images"):
        llm.engine.add_request(GenerateRequest("x", [1, 2, 3], GREEDY, None, [MMPlaceholder("h", 1, 1)], [None]))


def test_uuids_are_scoped_by_tenant(tiny_vl_dir):
    from warmfleet.server.multimodal.prompt import UnknownMediaError

    llm = LLM(str(tiny_vl_dir), block_size=16, num_gpu_blocks=256)
    part = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(112, 168, seed=5))}, "uuid": "cat-photo"}
    llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], GREEDY, cache_salt="tenant-a")
    only_uuid = [{"role": "user", "content": [{"type": "image_url", "image_url": {}, "uuid": "cat-photo"},
                                              {"type": "text", "text": "hi"}]}]
    assert llm.chat(only_uuid, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens > 0  # same tenant: reuse
    with pytest.raises(UnknownMediaError):  # another tenant cannot read tenant-a's image by its uuid
        llm.chat(only_uuid, GREEDY, cache_salt="tenant-b")
