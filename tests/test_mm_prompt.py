"""Image placeholder expansion (frontend `expand`, router `render`) and its effect on block hashes."""

from __future__ import annotations

import base64

import pytest

from warmfleet.server.hashing import block_hashes, mm_hash
from warmfleet.server.multimodal.media import MediaError
from warmfleet.server.multimodal.processor import ImageProcessorConfig
from warmfleet.server.multimodal.prompt import (
    IMAGE_PAD,
    ImageInfo,
    describe_image_bytes,
    expand,
    image_parts,
    render,
)
from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model
from warmfleet.server.tokenizer import Tokenizer
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(make_tiny_vl_model(tmp_path_factory.mktemp("tvl"), "qwen2_vl"))


@pytest.fixture(scope="module")
def cfg(tok):
    return ImageProcessorConfig.from_model_dir(tok.model_dir)


def msgs(*parts):
    return [{"role": "user", "content": list(parts)}]


def img_part(b: bytes, **extra):
    return {"type": "image_url", "image_url": {"url": data_uri(b)}, **extra}


def infos_for(tok, cfg, messages):
    return [describe_image_bytes(base64.b64decode(p.url.split(",", 1)[1]), p, cfg) for p in image_parts(messages)]


def test_single_image_expansion(tok, cfg):
    m = msgs(img_part(image_bytes(100, 60)), {"type": "text", "text": "what is this?"})
    res = expand(tok, m, infos_for(tok, cfg, m), cfg.merge_size, add_generation_prompt=True)
    (ph,) = res.mm_placeholders
    n = cfg.num_image_tokens(100, 60)
    pad = tok.token_to_id(IMAGE_PAD)
    ids = res.prompt_token_ids
    assert ph.length == n == res.num_image_tokens and n > 1
    assert ids[ph.offset:ph.offset + n] == [pad] * n
    assert ids[ph.offset - 1] == tok.token_to_id("<|vision_start|>")
    assert ids[ph.offset + n] == tok.token_to_id("<|vision_end|>")
    assert ids.count(pad) == n
    assert ph.mm_hash == mm_hash(image_bytes(100, 60), params=cfg.hash_params())


def test_two_images_in_order_with_distinct_sizes(tok, cfg):
    m = [{"role": "user", "content": [img_part(image_bytes(56, 56)), {"type": "text", "text": "and"}]},
         {"role": "assistant", "content": "ok"},
         {"role": "user", "content": [img_part(image_bytes(300, 120, 1))]}]
    res = expand(tok, m, infos_for(tok, cfg, m), cfg.merge_size)
    a, b = res.mm_placeholders
    assert (a.length, b.length) == (cfg.num_image_tokens(56, 56), cfg.num_image_tokens(300, 120))
    assert a.offset + a.length < b.offset and a.mm_hash != b.mm_hash


def test_router_render_equals_frontend_expand(tok, cfg):
    m = msgs({"type": "text", "text": "compare"}, img_part(image_bytes(90, 70)), img_part(image_bytes(70, 90, 2)))
    front = expand(tok, m, infos_for(tok, cfg, m), cfg.merge_size, add_generation_prompt=True)
    ids, items = render(tok, m, add_generation_prompt=True)
    assert ids == front.prompt_token_ids and items == front.mm_placeholders


def test_router_cuts_before_unresolvable_image(tok, cfg):
    m = msgs(img_part(image_bytes(90, 70)), {"type": "text", "text": "then"},
             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, {"type": "text", "text": "x"})
    ids, items = render(tok, m)
    assert len(items) == 1
    pad = tok.token_to_id(IMAGE_PAD)
    assert ids[-1] == tok.token_to_id("<|vision_start|>")  # cut just before the second image's pads
    assert ids.count(pad) == items[0].length


def test_uuid_parts(tok, cfg):
    raw = image_bytes(80, 80)
    with_uuid = msgs(img_part(raw, uuid="cat-1"), {"type": "text", "text": "hi"})
    ids, items = render(tok, with_uuid)
    assert items[0].mm_hash == mm_hash(uuid="cat-1") == "uuid:cat-1"
    only_uuid = msgs({"type": "image_url", "uuid": "cat-1"}, {"type": "text", "text": "hi"})
    grid = cfg.grid_thw(80, 80)
    ids2, items2 = render(tok, only_uuid, grid_lookup={"uuid:cat-1": grid}.get)
    assert (ids2, items2) == (ids, items)
    ids3, items3 = render(tok, only_uuid, grid_lookup={}.get)
    assert items3 == [] and len(ids3) < len(ids)
    nested = msgs({"type": "image_url", "image_url": {"uuid": "cat-1"}})
    assert image_parts(nested)[0].uuid == "cat-1" and image_parts(nested)[0].url is None


def test_text_smuggling_image_pad_is_rejected(tok, cfg):
    m = msgs(img_part(image_bytes(60, 60)), {"type": "text", "text": f"sneaky {IMAGE_PAD}"})
    with pytest.raises(ValueError, match="2 image placeholders but the request carries 1"):
        expand(tok, m, infos_for(tok, cfg, m), cfg.merge_size)


def test_bad_parts_name_themselves(tok):
    with pytest.raises(MediaError, match=r"messages\[0\]\.content\[1\]: video"):
        image_parts(msgs({"type": "text", "text": "a"}, {"type": "video_url", "video_url": {"url": "x"}}))
    with pytest.raises(MediaError, match=r"messages\[0\]\.content\[0\]: image part needs"):
        image_parts(msgs({"type": "image_url", "image_url": {}}))
    with pytest.raises(MediaError, match="uuid must be"):
        image_parts(msgs({"type": "image_url", "image_url": {"url": "data:,"}, "uuid": ""}))


def test_pydantic_style_none_fields_are_not_images(tok, cfg):
    m = msgs({"type": "text", "text": "hello", "image_url": None, "uuid": None}, img_part(image_bytes(60, 60)))
    assert len(image_parts(m)) == 1
    res = expand(tok, m, infos_for(tok, cfg, m), cfg.merge_size)
    assert len(res.mm_placeholders) == 1


def _hashes(tok, cfg, m, bs=16):
    res = expand(tok, m, infos_for(tok, cfg, m), cfg.merge_size)
    return res, block_hashes(res.prompt_token_ids, res.mm_placeholders, bs, "fp")


def test_block_hashes_diverge_exactly_where_the_image_starts(tok, cfg):
    text = {"type": "text", "text": "a fairly long shared question prefix " * 4}
    r1, h1 = _hashes(tok, cfg, msgs(text, img_part(image_bytes(300, 200, 1)), {"type": "text", "text": "tail " * 30}))
    r2, h2 = _hashes(tok, cfg, msgs(text, img_part(image_bytes(300, 200, 2)), {"type": "text", "text": "tail " * 30}))
    r3, h3 = _hashes(tok, cfg, msgs(text, img_part(image_bytes(300, 200, 1)), {"type": "text", "text": "tail " * 30}))
    assert r1.prompt_token_ids == r2.prompt_token_ids  # same sizes → same ids; only the image identity differs
    first_img_block = r1.mm_placeholders[0].offset // 16
    common = next(i for i, (a, b) in enumerate(zip(h1, h2)) if a != b)
    assert common == first_img_block > 0
    assert h1 == h3  # same image at the same position hits through it
    ph = r1.mm_placeholders[0]
    assert (ph.offset + ph.length - 1) // 16 > first_img_block  # the image straddles several blocks


def test_image_info_token_count():
    assert ImageInfo("h", (1, 8, 12)).num_tokens(2) == 24
