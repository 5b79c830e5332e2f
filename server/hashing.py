"""Block and image hashing shared by engine and router (contract 1); pure Python, no paddle.

The router predicts cache hits only if it computes the very bytes the engine computes, so
both import this module and nothing else decides what a block's identity is.

    root   = H("warmfleet-kv-v1", model_fingerprint, cache_salt)                 base model
    root   = H("warmfleet-kv-v1", model_fingerprint, cache_salt, name, digest)   LoRA adapter
    block0 = H(root,   tokens[0:B],  extra_keys(0))
    block1 = H(block0, tokens[B:2B], extra_keys(1))          ... full blocks only

`extra_keys(i)` lists (mm_hash, offset) of every image whose placeholder tokens overlap block i,
so an image that straddles blocks enters each of them, and the same text with another image
diverges exactly at the first block the image touches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NewType, Optional, Sequence

import msgpack

BlockHash = NewType("BlockHash", bytes)
MMHash = NewType("MMHash", str)

_DOMAIN = b"warmfleet-kv-v1"


def _blake3(data: bytes) -> bytes:
    import blake3

    return blake3.blake3(data).digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


DIGESTS: dict[str, Callable[[bytes], bytes]] = {"blake3": _blake3, "sha256": _sha256, "xxhash": _xxhash}


def digest_fn(algo: str) -> Callable[[bytes], bytes]:
    try:
        return DIGESTS[algo]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {sorted(DIGESTS)}") from None


@dataclass(frozen=True)
class MMPlaceholder:
    """Where one image's placeholder tokens sit in a prompt."""

    mm_hash: str  # identity of the image (see mm_hash())
    offset: int  # index of the first placeholder token in the prompt's token ids
    length: int  # number of placeholder tokens


def mm_hash(data: Optional[bytes] = None, *, uuid: Optional[str] = None, params: Optional[dict] = None,
            algo: str = "blake3", namespace: Optional[str] = None) -> MMHash:
    """Identity of one media item: the client's uuid, else a digest of raw bytes + preprocessing params.

    Raw bytes (after base64 decoding or download), not decoded pixels, so the router can hash
    without decoding. `params` holds every preprocessing parameter that changes the pixels
    the model sees (min/max pixels, patch size, ...).

    A uuid names content the client chose, so it is scoped by `namespace` (the request's cache
    salt): one tenant cannot bind another tenant's uuid to different pixels, nor read its image
    back by sending the uuid alone. Content is scoped the same way: the encoder and processor caches
    are keyed by this hash, so with one shared key a tenant could tell from a hit (a faster first token,
    or the router placing it where the image's encoder output is) that another tenant sent the same
    bytes. Requests without a salt share one public namespace.
    """
    if uuid is not None:
        if not uuid:
            raise ValueError("uuid must be a non-empty string")
        if namespace:
            return MMHash("uuid:" + digest_fn(algo)(msgpack.packb([namespace, uuid])).hex())
        return MMHash("uuid:" + uuid)
    if data is None:
        raise ValueError("mm_hash needs either the media bytes or a uuid")
    p = json.dumps(params or {}, sort_keys=True, separators=(",", ":")).encode()
    h = digest_fn(algo)
    if namespace:  # the namespace's digest first: fixed width, so no public item's bytes can imitate it
        return MMHash(h(h(namespace.encode()) + h(p) + data).hex())
    return MMHash(h(h(p) + data).hex())


@dataclass(frozen=True)
class AdapterId:
    """A LoRA adapter as the hash chain sees it: its served name and the digest of its files."""

    name: str
    digest: str  # adapter_digest() of its directory


def adapter_digest(adapter_dir: str | Path) -> str:
    """Identity of a PEFT adapter's content: a digest of adapter_config.json and adapter_model.safetensors."""
    d = Path(adapter_dir)
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        h.update(name.encode() + b"\0" + (d / name).read_bytes() + b"\0")
    return h.hexdigest()[:32]


def root_hash(model_fingerprint: str, cache_salt: Optional[str] = None, algo: str = "blake3",
              adapter: Optional[AdapterId] = None) -> BlockHash:
    """Root of every chain: model identity, LoRA adapter and tenant salt, so no two of them share blocks.

    The base model's root (adapter None) is the one of chains before adapters existed."""
    parts = [_DOMAIN, model_fingerprint, cache_salt or ""]
    if adapter is not None:
        parts += [adapter.name, adapter.digest]
    return BlockHash(digest_fn(algo)(msgpack.packb(parts)))


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[tuple] = (),
               algo: str = "blake3") -> BlockHash:
    """Hash of one full block given its parent's hash."""
    payload = msgpack.packb([parent, list(token_ids), [list(k) for k in extra_keys]])
    return BlockHash(digest_fn(algo)(payload))


def block_extra_keys(start: int, end: int, mm_items: Iterable[MMPlaceholder]) -> list[tuple[str, int]]:
    """(mm_hash, offset) of every image whose placeholder range overlaps token range [start, end)."""
    return [(m.mm_hash, m.offset) for m in mm_items if m.offset < end and m.offset + m.length > start]


def block_hashes(token_ids: Sequence[int], mm_items: Sequence[MMPlaceholder], block_size: int,
                 model_fingerprint: str, cache_salt: Optional[str] = None, algo: str = "blake3",
                 start_block: int = 0, parent: Optional[bytes] = None,
                 adapter: Optional[AdapterId] = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block gets none).

    Pass `start_block` and the hash of block `start_block - 1` as `parent` to extend a chain
    already computed (a running request that just filled another block).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    items = sorted(mm_items, key=lambda m: m.offset)
    prev = parent if start_block else root_hash(model_fingerprint, cache_salt, algo, adapter)
    if prev is None:
        raise ValueError("extending a chain needs the parent hash")
    out: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        s, e = i * block_size, (i + 1) * block_size
        prev = hash_block(prev, token_ids[s:e], block_extra_keys(s, e, items), algo)
        out.append(prev)
    return out


def model_fingerprint(model_dir: str | Path) -> str:
    """Identity of a checkpoint as both engine and router see it: a digest of config and tokenizer files."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        p = d / name
        if p.exists():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:32]
