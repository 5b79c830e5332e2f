"""Images sent by URL: the replica's media header, the router's per-tenant memo of it, and the prompt it renders."""

import pytest

from warmfleet.server.hashing import block_hashes
from warmfleet.server.multimodal import url_hashes
from warmfleet.server.multimodal.inputs import ImageInputPreparer
from warmfleet.server.multimodal.media import MediaConfig, MediaLoader
from warmfleet.server.multimodal.processor import ImageProcessor
from warmfleet.server.router.core.prompt import PromptRenderer
from warmfleet.server.router.core.url_memo import UrlHashMemo
from warmfleet.server.tiny_checkpoints.images import data_uri, image_bytes
from warmfleet.server.tokenizer import Tokenizer

URL = "https://cdn.example.com/photos/cat.png?sig=secret-token"


class FakeFetcher:
    """Serves one object per URL from a dict (what an object store would answer), counting fetches."""

    def __init__(self, objects: dict):
        self.objects, self.num_fetches = objects, 0

    def fetch(self, url: str, where: str) -> bytes:
        self.num_fetches += 1
        return self.objects[url]

    def close(self) -> None:
        pass


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def messages(url: str) -> list[dict]:
    return [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]


@pytest.fixture
def replica(tiny_vl_dir):
    """A frontend's image preparer whose http fetches come from a FakeFetcher."""
    fetcher = FakeFetcher({URL: image_bytes(112, 168, seed=7)})
    prep = ImageInputPreparer(Tokenizer(tiny_vl_dir), ImageProcessor.from_model_dir(tiny_vl_dir),
                              MediaLoader(MediaConfig(), fetcher))
    return prep, fetcher


def answer_header(prep, salt):
    """What the replica's answer to a request for URL, salted `salt`, carries in x-warmfleet-media."""
    out = prep.prepare(messages(URL), cache_salt=salt, add_generation_prompt=True)
    return out, url_hashes.encode_header((u, i.mm_hash, i.grid_thw) for u, i in out.fetched)


def test_header_round_trip_names_urls_by_digest_only():
    value = url_hashes.encode_header([(URL, "abc", (1, 4, 6)), (URL, "abc", (1, 4, 6)), ("http://b/x", "d", (1, 2, 2))])
    assert "secret-token" not in value and "cdn.example.com" not in value  # signed URLs stay out of headers
    assert url_hashes.parse_header(value) == [(url_hashes.url_key(URL), "abc", (1, 4, 6)),
                                              (url_hashes.url_key("http://b/x"), "d", (1, 2, 2))]
    assert url_hashes.encode_header([]) is None


@pytest.mark.parametrize("value", [None, "", "v2 []", "v1 not json", 'v1 {"a": 1}', 'v1 [["short", "h", 1, 1, 1]]',
                                   'v1 [["' + "0" * 32 + '", "h", 1, 1, 0]]', 'v1 [["' + "0" * 32 + '", "h", 1, 1]]',
                                   'v1 [["' + "0" * 32 + '", 5, 1, 1, 1]]', 'v1 [["' + "0" * 32 + '", "h", 1.5, 1, 1]]'])
def test_malformed_or_foreign_headers_teach_nothing(value):
    assert url_hashes.parse_header(value) == []


def test_only_fetched_urls_without_uuid_are_reported(tiny_vl_dir):
    fetcher = FakeFetcher({URL: image_bytes(64, 64, seed=1)})
    prep = ImageInputPreparer(Tokenizer(tiny_vl_dir), ImageProcessor.from_model_dir(tiny_vl_dir),
                              MediaLoader(MediaConfig(), fetcher))
    msgs = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image_bytes(64, 64, seed=2))}},
        {"type": "image_url", "image_url": {"url": URL}, "uuid": "named"},
        {"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "?"}]}]
    out = prep.prepare(msgs, add_generation_prompt=True)
    assert [u for u, _ in out.fetched] == [URL] and out.fetched[0][1] == ImageInfoOf(out, 2)


def ImageInfoOf(out, k):  # noqa: N802 - reads like the type it builds
    from warmfleet.server.multimodal.prompt import ImageInfo

    return ImageInfo(out.prompt.mm_placeholders[k].mm_hash, out.images[k].grid_thw)


def test_a_learned_url_renders_as_the_replica_rendered_it(tiny_vl_dir, replica):
    prep, _ = replica
    renderer = PromptRenderer(str(tiny_vl_dir))
    before = renderer.chat({"messages": messages(URL), "cache_salt": "tenant-a"})
    assert before.mm_items == []  # cut before the image
    out, header = answer_header(prep, "tenant-a")
    renderer.urls.learn("tenant-a", url_hashes.parse_header(header))
    routed = renderer.chat({"messages": messages(URL), "cache_salt": "tenant-a"})
    assert routed.token_ids == out.prompt.prompt_token_ids and routed.mm_items == out.prompt.mm_placeholders
    assert len(routed.token_ids) > len(before.token_ids) + routed.mm_items[0].length
    # and as warm as the same bytes sent as data: (the image's identity is its bytes, not how it came)
    as_data = renderer.chat({"messages": messages(data_uri(image_bytes(112, 168, seed=7))), "cache_salt": "tenant-a"})
    assert as_data == routed


def test_what_one_tenant_taught_another_cannot_use(tiny_vl_dir, replica):
    prep, _ = replica
    renderer = PromptRenderer(str(tiny_vl_dir))
    _, header = answer_header(prep, "tenant-a")
    renderer.urls.learn("tenant-a", url_hashes.parse_header(header))
    for salt in ("tenant-b", None):
        assert renderer.chat({"messages": messages(URL), "cache_salt": salt}).mm_items == []
    # only tenant b's own answer teaches b (an entry of its own; both name the bytes' content hash)
    out_b, header_b = answer_header(prep, "tenant-b")
    renderer.urls.learn("tenant-b", url_hashes.parse_header(header_b))
    b = renderer.chat({"messages": messages(URL), "cache_salt": "tenant-b"}).mm_items[0].mm_hash
    assert len(renderer.urls) == 2 and b == out_b.prompt.mm_placeholders[0].mm_hash
    assert renderer.chat({"messages": messages(URL)}).mm_items == []  # the unsalted namespace still knows nothing


def test_memo_expires_and_stays_bounded():
    clock = FakeClock()
    memo = UrlHashMemo(capacity=2, ttl_s=10, clock=clock)
    k = url_hashes.url_key
    memo.learn("s", [(k("http://a"), "ha", (1, 2, 2)), (k("http://b"), "hb", (1, 2, 2))])
    assert memo.get("s", "http://a") == ("ha", (1, 2, 2))  # a is now the most recently used
    memo.learn("s", [(k("http://c"), "hc", (1, 2, 2))])
    assert len(memo) == 2 and memo.get("s", "http://b") is None and memo.get("s", "http://a") is not None
    clock.t = 10.5
    assert memo.get("s", "http://a") is None and memo.get("s", "http://c") is None and len(memo) == 0


def test_a_changed_object_is_a_miss_never_a_wrong_hit(tiny_vl_dir, replica):
    prep, fetcher = replica
    renderer = PromptRenderer(str(tiny_vl_dir))
    fp, bs = "fp", 16
    old_out, header = answer_header(prep, None)
    renderer.urls.learn(None, url_hashes.parse_header(header))
    fetcher.objects[URL] = image_bytes(112, 168, seed=8)  # the object behind the URL changes
    predicted = renderer.chat({"messages": messages(URL)})  # the router still believes the old bytes
    new_out, new_header = answer_header(prep, None)  # the replica fetches and hashes again
    served = block_hashes(new_out.prompt.prompt_token_ids, new_out.prompt.mm_placeholders, bs, fp)
    cached_before = block_hashes(old_out.prompt.prompt_token_ids, old_out.prompt.mm_placeholders, bs, fp)
    guess = block_hashes(predicted.token_ids, predicted.mm_items, bs, fp)
    image_block = predicted.mm_items[0].offset // bs
    assert guess == cached_before  # the router predicts the old image's blocks ...
    assert served[:image_block] == guess[:image_block]  # ... the text before the image still hits ...
    assert not set(served[image_block:]) & set(cached_before)  # ... the rest can never match the old KV: a miss
    renderer.urls.learn(None, url_hashes.parse_header(new_header))  # that answer corrects the memo
    assert renderer.urls.num_changed == 1
    fixed = renderer.chat({"messages": messages(URL)})
    assert block_hashes(fixed.token_ids, fixed.mm_items, bs, fp) == served
