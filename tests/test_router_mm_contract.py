"""Contract 1 for images: the router renders and hashes an image prompt exactly as a replica's frontend does."""


import pytest

from warmfleet.server.multimodal.inputs import ImageInputPreparer
from warmfleet.server.multimodal.media import MediaConfig, MediaLoader
from warmfleet.server.multimodal.processor import ImageProcessor
from warmfleet.server.router.core.prompt import PromptRenderer
from warmfleet.server.tokenizer import Tokenizer
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes


def messages(seed, uuid=None):
    part = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(112, 168, seed=seed))}}
    if uuid:
        part["uuid"] = uuid
    return [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, part, {"type": "text", "text": "What?"}]}]


@pytest.mark.parametrize("uuid, salt", [(None, None), (None, "tenant-a"), ("photo-1", None), ("photo-1", "tenant-a")])
def test_router_and_frontend_agree_on_ids_and_placeholders(tiny_vl_dir, uuid, salt):
    frontend = ImageInputPreparer(Tokenizer(tiny_vl_dir), ImageProcessor.from_model_dir(tiny_vl_dir),
                                  MediaLoader(MediaConfig()))
    replica = frontend.prepare(messages(7, uuid), cache_salt=salt, add_generation_prompt=True)
    renderer = PromptRenderer(str(tiny_vl_dir))
    routed = renderer.chat({"messages": messages(7, uuid), "cache_salt": salt})
    again = renderer.chat({"messages": messages(7, uuid), "cache_salt": salt})  # the image from the router's memo
    assert renderer.images.hits == 1 and again == routed
    assert routed.token_ids == replica.prompt.prompt_token_ids
    assert routed.mm_items == replica.prompt.mm_placeholders and len(routed.mm_items) == 1
    # equal ids and placeholders are all contract 1 hashes: the block hashes agree by construction


def test_uuid_identity_differs_per_tenant(tiny_vl_dir):
    r = PromptRenderer(str(tiny_vl_dir))
    a = r.chat({"messages": messages(7, "photo-1"), "cache_salt": "tenant-a"}).mm_items[0].mm_hash
    b = r.chat({"messages": messages(7, "photo-1"), "cache_salt": "tenant-b"}).mm_items[0].mm_hash
    assert a != b


def test_image_memo_is_keyed_by_content_uuid_and_tenant(tiny_vl_dir):
    r = PromptRenderer(str(tiny_vl_dir))

    def h(seed, uuid=None, salt=None):
        return r.chat({"messages": messages(seed, uuid), "cache_salt": salt}).mm_items[0].mm_hash

    first = h(7)
    assert h(8) != first  # other pixels
    assert h(7, "photo-1") != first  # a uuid names it
    assert h(7, "photo-1", "tenant-b") != h(7, "photo-1", "tenant-a")  # uuids are per tenant, memo or not
    assert r.images.hits == 0
    assert h(7) == first and h(7, "photo-1", "tenant-b") == h(7, "photo-1", "tenant-b") and r.images.hits == 3
