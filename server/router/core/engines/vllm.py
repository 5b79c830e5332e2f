"""vLLM replicas: vLLM's own block hashes reproduced, its KV-event stream decoded, resync by its replay socket.

Block hashes (vllm/v1/core/kv_cache_utils.py, checked against vLLM 0.32.0): with
`--prefix-caching-hash-algo sha256_cbor`, block i of a request is

    h_i = sha256(cbor_canonical((h_{i-1} or NONE_HASH, tuple(block tokens), extra_keys_i or None)))
    NONE_HASH = sha256(cbor_canonical(seed)),  seed = $PYTHONHASHSEED, else "vllm-none-hash"

where extra_keys_i is a tuple of tagged keys, in this order: ("lora", name, path) on every block
of a LoRA request (path: the adapter's lora_path, which vLLM's /v1/models lists as the entry's
`root`), ("mm", identifier, offset of the item relative to the block start) for every item
overlapping the block, ("cache_salt", salt) on block 0 only. Events publish the low 64 bits of each digest as an integer
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default), so the router keys its index by those
8 bytes. Reproducing the hash (rather than re-keying stored blocks by the token ids their
events carry) lets the router hash a new request once, with no per-replica map from vLLM's
names to ours, and `check_stored` verifies the reproduction against every replica's first
events, so a vLLM that changes its recipe is reported instead of silently missing.

Events: frames `[topic, seq (8-byte big-endian, from 0), payload]`, payload `[ts, [event], dp_rank]`,
each event a msgpack map tagged by `type` (BlockStored, BlockRemoved, AllBlocksCleared).
Replay: a DEALER sends `["", start_seq]` to the replica's ROUTER socket and receives every
buffered batch from that seq, then an end marker with seq -1.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from typing import Any, Optional, Sequence

import cbor2
import msgpack
import zmq
import zmq.asyncio

from ....events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Snapshot
from ....hashing import MMPlaceholder
from ..prompt import BoundedMemo, HashConfig, Prompt

log = logging.getLogger(__name__)

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for sha256/sha256_cbor when PYTHONHASHSEED is unset
END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
VERIFY_BLOCKS = 256  # stored blocks per replica whose names are checked against the reproduced hash


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: Optional[str]) -> bytes:
    """vLLM's NONE_HASH: the parent of every first block."""
    return sha256_cbor(DEFAULT_SEED if seed is None else seed)


def key_of(digest_or_int: Any) -> bytes:
    """The index key of a vLLM block: the low 64 bits of its digest, 8 bytes big-endian."""
    if isinstance(digest_or_int, int):
        return (digest_or_int & (2**64 - 1)).to_bytes(8, "big")
    if isinstance(digest_or_int, (bytes, bytearray)) and digest_or_int:
        return bytes(digest_or_int[-8:]).rjust(8, b"\0")
    raise ValueError(f"not a vLLM block hash: {type(digest_or_int).__name__}")


def extra_keys(start: int, end: int, mm_items: Sequence[MMPlaceholder], cache_salt: Optional[str],
               lora: Optional[tuple] = None) -> Optional[tuple]:
    """vLLM 0.32's generate_block_hash_extra_keys: LoRA key, image keys, then the salt (block 0)."""
    keys: list[tuple] = [lora] if lora is not None else []
    keys += [("mm", m.mm_hash, m.offset - start) for m in mm_items if m.offset < end and m.offset + m.length > start]
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def vllm_block_digests(token_ids: Sequence[int], mm_items: Sequence[MMPlaceholder], block_size: int,
                       cache_salt: Optional[str], seed: Optional[str], memo: Optional[BoundedMemo] = None,
                       lora: Optional[tuple] = None) -> list[bytes]:
    """Full 32-byte digests of every full block, as vLLM computes them with sha256_cbor (`lora`: ("lora", name,
    path) of a LoRA request)."""
    items = sorted(mm_items, key=lambda m: m.offset)
    prev = none_hash(seed)
    out = []
    for i in range(len(token_ids) // block_size):
        s, e = i * block_size, (i + 1) * block_size
        block = tuple(token_ids[s:e])
        extra = extra_keys(s, e, items, cache_salt, lora)
        key = (prev, block, extra)
        h = memo.get(key) if memo is not None else None
        if h is None:
            h = sha256_cbor(key)
            if memo is not None:
                memo.put(key, h)
        out.append(h)
        prev = h
    return out


def _event(e: Any, verify=None):
    if not isinstance(e, dict):
        raise ValueError("vLLM KV event must be a map")
    kind = e.get("type")
    medium = CPU if e.get("medium") == "CPU" else GPU
    if kind == "BlockStored":
        size = e.get("block_size")
        if not isinstance(size, int) or size < 1:
            raise ValueError("BlockStored needs a positive block_size")
        tokens = e.get("token_ids") or []
        if not isinstance(tokens, list):
            raise ValueError("token_ids must be a list")
        if verify is not None:
            verify(e)
        return BlockStored([key_of(h) for h in e["block_hashes"]], None, tokens, size, medium=medium)
    if kind == "BlockRemoved":
        return BlockRemoved([key_of(h) for h in e["block_hashes"]], medium)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # event types this router does not use


def decode_vllm(frames: list[bytes], verify=None) -> EventBatch:
    """vLLM's three-part frames → EventBatch; raises ValueError on anything malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"expected [topic, seq, payload] frames, got {len(frames)} frames")
    try:
        (seq,) = struct.unpack(">q", frames[1])
        payload = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        if not isinstance(payload, (list, tuple)) or len(payload) < 2 or not isinstance(payload[1], list):
            raise ValueError("payload must be [ts, [events], dp_rank]")
        ts = payload[0]
        if not isinstance(ts, (int, float)):
            raise ValueError("ts must be a number")
        events = [ev for ev in (_event(e, verify) for e in payload[1]) if ev is not None]
    except ValueError as exc:
        raise ValueError(f"malformed vLLM KV-event payload: {exc}") from exc
    except Exception as exc:
        raise ValueError(f"malformed vLLM KV-event payload: {type(exc).__name__}: {exc}") from exc
    return EventBatch(frames[0].decode(errors="replace"), seq, events, float(ts))


class VllmDialect:
    kind = "vllm"
    contract = "exact"
    lora_running_busy = True  # vllm:lora_requests_info's running label names adapters with requests
    ready_path = "/health"  # vLLM listens only once its engine is up; /health is its readiness probe too

    def __init__(self, seed: Optional[str], memo_capacity: int = 200_000):
        self.seed = seed  # the replicas' PYTHONHASHSEED (the operator pins it); None: unset there
        self.memo = BoundedMemo(memo_capacity)
        self.checked = self.mismatched = 0  # stored blocks whose published names were recomputed; how many differed

    @classmethod
    def from_settings(cls, settings) -> "VllmDialect":
        return cls(seed=settings.hash_seed)

    def block_hashes(self, prompt: Prompt, cache_salt: Optional[str], cfg: HashConfig,
                     adapter: Optional[tuple] = None) -> list[bytes]:
        digests = vllm_block_digests(prompt.token_ids, prompt.mm_items, cfg.block_size, cache_salt, self.seed,
                                     self.memo, adapter)
        return [key_of(d) for d in digests]

    def adapter_identity(self, card: dict) -> Optional[tuple]:
        """vLLM's LoRA extra key ("lora", name, lora_path) of a /v1/models adapter entry (`root` is its lora_path)."""
        root = card.get("root")
        return ("lora", card["id"], root) if isinstance(root, str) and root else None

    def prepare_body(self, body: dict, prompt: Prompt) -> bool:
        """Give every image part the identity the router hashed it under (vLLM's `uuid`); True if changed.

        vLLM keys an image by a client `uuid` when one is given (and no per-request processor
        kwargs change its pixels), and puts that identifier in the block extra keys. Setting it
        to the router's mm_hash (a content digest, namespaced by the tenant's salt) makes vLLM's
        extra keys the ones the router predicted, and keeps one tenant's images apart from another's.
        """
        if not prompt.mm_items or not isinstance(body.get("messages"), list):
            return False
        parts = [p for m in body["messages"] if isinstance(m, dict) and isinstance(m.get("content"), list)
                 for p in m["content"] if isinstance(p, dict) and p.get("type") in ("image_url", "image")]
        items = sorted(prompt.mm_items, key=lambda m: m.offset)
        if len(parts) != len(items):
            return False  # the router could not account for every image: leave the request as sent
        for part, item in zip(parts, items):
            part["uuid"] = item.mm_hash
        return True

    def served(self, index, rid: str, hashes) -> None:
        """Nothing to predict: the replica's own events say what it stored."""

    def forget(self, rid: str) -> None:
        """Nothing kept per replica outside the index."""

    async def poll_load(self, rep, http):
        """None: load figures ride on the KV events (warmfleet) or are this router's in-flight counts (vLLM)."""
        return None

    def hash_check(self) -> dict:
        """Published block names recomputed so far, and how many differed from the router's reproduction."""
        return {"checked_blocks": self.checked, "mismatched_blocks": self.mismatched}

    def decode(self, frames: list[bytes]) -> EventBatch:
        return decode_vllm(frames, self.check_stored if self.checked < VERIFY_BLOCKS else None)

    async def fetch_state(self, rep, http, headers: dict) -> Optional[Snapshot]:
        """Replay the replica's buffered batches from seq 0 into a snapshot; None if the replay fails."""
        endpoint = rep.spec.replay
        if not endpoint:
            log.warning("vLLM replica %s has no replay endpoint (replay=tcp://HOST:PORT or --kv-replay-port): "
                        "gaps and restarts cannot be recovered, its index is rebuilt from live events only", rep.id)
            return Snapshot(rep.id, -1, 0, "", [], [], [])
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        gpu: set = set()
        cpu: set = set()
        last, block_size = -1, 0
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        try:
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    log.info("replay from %s timed out", rep.id)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) >= 3 and frames[-2:] == [(END_SEQ).to_bytes(8, "big", signed=True), b""]:
                    break
                try:
                    batch = decode_vllm(frames[1:])
                except ValueError as exc:
                    log.warning("bad replayed batch from %s: %s", rep.id, exc)
                    continue
                if batch.seq <= last:
                    continue
                last = batch.seq
                for e in batch.events:
                    if isinstance(e, BlockStored):
                        (cpu if e.medium == CPU else gpu).update(e.block_hashes)
                        block_size = e.block_size
                    elif isinstance(e, BlockRemoved):
                        (cpu if e.medium == CPU else gpu).difference_update(e.block_hashes)
                    elif isinstance(e, AllBlocksCleared):
                        gpu.clear()
                        cpu.clear()
        finally:
            sock.close(0)
        return Snapshot(rep.id, last, block_size, "", list(gpu), list(cpu), [])

    def check_stored(self, event: dict) -> None:
        """Recompute the names a replica published for a chain that starts at the root.

        Checkable: no parent and no LoRA; image keys and a cache salt are rebuilt from the untagged
        extra keys the event carries ((identifier, offset) pairs; a bare salt string on block 0).
        Those chains depend only on the seed, the keys, the encoding and the digest, so the first
        few prove the reproduction right, or report that the replicas' settings differ.
        """
        if self.checked >= VERIFY_BLOCKS or event.get("parent_block_hash") is not None or event.get("lora_name"):
            return
        size, tokens, names = event["block_size"], event.get("token_ids") or [], event["block_hashes"]
        extra = event.get("extra_keys") or [None] * len(names)
        if len(tokens) != size * len(names) or len(extra) != len(names):
            return
        prev, bad = none_hash(self.seed), 0
        for i, name in enumerate(names):
            keys = []
            for k in extra[i] or ():
                if isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and isinstance(k[1], int):
                    keys.append(("mm", k[0], k[1]))
                elif isinstance(k, str) and i == 0:
                    keys.append(("cache_salt", k))
                else:
                    return  # prompt embeddings or a key this check does not know: not rebuilt here
            prev = sha256_cbor((prev, tuple(tokens[i * size:(i + 1) * size]), tuple(keys) or None))
            bad += key_of(prev) != key_of(name)
        self.checked += len(names)
        if bad:
            self.mismatched += bad
            log.error("vLLM block names differ from the router's reproduction (%d of %d blocks): the replicas must run "
                      "--prefix-caching-hash-algo sha256_cbor with PYTHONHASHSEED equal to the router's --vllm-hash-seed "
                      "(%r); until then every prediction misses", bad, len(names), self.seed)
