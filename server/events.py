"""KV-event wire format, replica → router (contract 2); msgpack only, never pickle; no paddle.

Framing follows vLLM's KV-event stream so tools written for it can read ours:
a ZMQ multipart message `[topic, seq (8-byte big-endian), payload]`, where payload is the
msgpack array `[ts, [event, ...], dp_rank]` and each event a tagged array:

    ["BlockStored", [hash, ...], parent_hash | None, [token ids], block_size, lora_id, medium(, lora_name)]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]
    ["EncoderStored", [mm_hash, ...]]          # warmfleet extension
    ["EncoderRemoved", [mm_hash, ...]]         # warmfleet extension
    ["Load", running, waiting, free_gpu_blocks, total_gpu_blocks(, node_copy_s_per_block)]   # warmfleet extension

`medium` is "GPU" for the primary pool, "CPU" for the swap tier and "NODE" for the node tier (server/nodetier: one
host-memory cache shared by a service's replicas on a node). The topic is the replica id, or `node:<NAME>` for the
node tier of node NAME, which publishes with its own sequence numbers (from 1 at every start, led by
AllBlocksCleared: it starts empty). The node tier serves no HTTP snapshot: a batch that begins with AllBlocksCleared
carries its whole state (a subscriber syncs from it), and it publishes one to every new subscription, so a
subscriber resyncs by subscribing to a fresh topic (`NODE_STATE_TOPIC` + anything). A replica names its node in its
snapshot (`node`, from `warmfleet serve --node-name`), which is how a router maps replicas to node tiers.
`node_copy_s_per_block` is the replica's measured cost of loading one KV block from its node tier (seconds of the
gets that served blocks over the blocks they served, since it started): sent only once it has loaded one, so Load
events without a node tier are what they were; routers price a node-tier block by it (router/core/pricing.py).
Snapshots carry Load's first four figures only (an older router reads them as it did).
`lora_name` (vLLM's field, in vLLM's position) names the LoRA adapter whose chain the blocks belong to;
it is sent only for adapter blocks, so base-model events are byte for byte what they were, and an
absent one means the base model.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Union

import msgpack

GPU = "GPU"
CPU = "CPU"
NODE = "NODE"
MEDIA = (GPU, CPU, NODE)
NODE_TOPIC_PREFIX = "node:"  # a node tier's topic: node:<node name>
NODE_STATE_TOPIC = b"\x00wf-state"  # subscribing to a topic with this prefix asks a node tier for its whole state


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]  # tokens of all stored blocks, concatenated
    block_size: int
    medium: str = GPU
    lora_id: Optional[int] = None
    lora_name: Optional[str] = None  # the adapter's served name; None: the base model


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = GPU


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class EncoderStored:
    mm_hashes: list[str]


@dataclass
class EncoderRemoved:
    mm_hashes: list[str]


@dataclass
class Load:
    num_running: int
    num_waiting: int
    free_gpu_blocks: int
    total_gpu_blocks: int
    node_copy_s_per_block: Optional[float] = None  # seconds to load one node-tier KV block, measured; None: none loaded


LOAD_FIGURES = ("num_running", "num_waiting", "free_gpu_blocks", "total_gpu_blocks")  # a snapshot's Load


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, EncoderStored, EncoderRemoved, Load]


def _event_to_wire(e: KVEvent) -> list:
    if isinstance(e, BlockStored):
        wire = ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium]
        return wire if e.lora_name is None else wire + [e.lora_name]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", e.block_hashes, e.medium]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"]
    if isinstance(e, EncoderStored):
        return ["EncoderStored", e.mm_hashes]
    if isinstance(e, EncoderRemoved):
        return ["EncoderRemoved", e.mm_hashes]
    if isinstance(e, Load):
        wire = ["Load", e.num_running, e.num_waiting, e.free_gpu_blocks, e.total_gpu_blocks]
        return wire if e.node_copy_s_per_block is None else wire + [e.node_copy_s_per_block]
    raise TypeError(f"not a KV event: {e!r}")


def _hashes(v) -> list[bytes]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(h, bytes) for h in v):
        raise ValueError("block hashes must be a list of byte strings")
    return list(v)


def _strs(v) -> list[str]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(h, str) for h in v):
        raise ValueError("mm hashes must be a list of strings")
    return list(v)


def _medium(a: list, i: int) -> str:
    m = a[i] if len(a) > i and a[i] else GPU
    if m not in MEDIA:
        raise ValueError(f"unknown medium {m!r}")
    return m


def _event_from_wire(a) -> Optional[KVEvent]:
    """One tagged array; raises ValueError on anything else (a map is another engine's dialect)."""
    if isinstance(a, dict):
        raise ValueError("KV event is a map (vLLM's dialect?): this replica needs the router's --engine vllm")
    if not isinstance(a, (list, tuple)) or not a or not isinstance(a[0], str):
        raise ValueError(f"KV event must be a tagged array, got {type(a).__name__}")
    tag = a[0]
    if tag == "BlockStored":
        parent, tokens, block_size = a[2], a[3], a[4]
        if parent is not None and not isinstance(parent, bytes):
            raise ValueError("parent hash must be bytes or nil")
        if not isinstance(tokens, (list, tuple)) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError("BlockStored needs token ids and a positive block size")
        lora_name = a[7] if len(a) > 7 else None
        if lora_name is not None and not isinstance(lora_name, str):
            raise ValueError("lora_name must be a string or nil")
        return BlockStored(_hashes(a[1]), parent, list(tokens), block_size, medium=_medium(a, 6), lora_id=a[5],
                           lora_name=lora_name)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(a[1]), _medium(a, 2))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "EncoderStored":
        return EncoderStored(_strs(a[1]))
    if tag == "EncoderRemoved":
        return EncoderRemoved(_strs(a[1]))
    if tag == "Load":
        nums = a[1:5]
        if len(nums) != 4 or not all(isinstance(n, int) and n >= 0 for n in nums):
            raise ValueError("Load needs four non-negative integers")
        copy = a[5] if len(a) > 5 else None
        if copy is not None and (type(copy) not in (int, float) or not 0 <= copy < math.inf):
            raise ValueError("Load's node copy cost must be a non-negative number of seconds or nil")
        return Load(*nums, None if copy is None else float(copy))
    return None  # unknown tags from newer peers are skipped, not fatal


@dataclass
class EventBatch:
    """One published message: a sequence number and the events since the previous one."""

    replica_id: str
    seq: int  # strictly increasing per replica, starting at 1 after every engine start
    events: list[KVEvent] = field(default_factory=list)
    ts: float = field(default_factory=time.time)


def encode(batch: EventBatch) -> list[bytes]:
    """ZMQ multipart frames for one batch."""
    payload = msgpack.packb([batch.ts, [_event_to_wire(e) for e in batch.events], 0], use_bin_type=True)
    return [batch.replica_id.encode(), struct.pack(">q", batch.seq), payload]


def decode(frames: list[bytes]) -> EventBatch:
    """Parse frames; raises ValueError on anything malformed (a subscriber must survive bad input)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"expected [topic, seq, payload] frames, got {len(frames)} frames")
    try:
        (seq,) = struct.unpack(">q", frames[1])
        payload = msgpack.unpackb(frames[2], raw=False, strict_map_key=True)
        if not isinstance(payload, (list, tuple)) or len(payload) < 2:
            raise ValueError("payload must be [ts, [events], dp_rank]")
        ts, raw_events = payload[0], payload[1]
        if not isinstance(ts, (int, float)) or not isinstance(raw_events, (list, tuple)):
            raise ValueError("payload must be [ts, [events], dp_rank]")
        events = [e for e in (_event_from_wire(a) for a in raw_events) if e is not None]
    except ValueError as exc:
        raise ValueError(f"malformed KV-event payload: {exc}") from exc
    except Exception as exc:  # msgpack raises many types; none may escape to end a subscription
        raise ValueError(f"malformed KV-event payload: {type(exc).__name__}: {exc}") from exc
    return EventBatch(frames[0].decode(errors="replace"), seq, events, float(ts))


@dataclass
class Snapshot:
    """Full cache state of a replica for resync; `seq` is the last sequence number it reflects.

    Served as JSON by `GET /v1/kv/snapshot` with hashes hex-encoded.
    """

    replica_id: str
    seq: int
    block_size: int
    model_fingerprint: str
    gpu: list[bytes]
    cpu: list[bytes]
    encoder: list[str]
    load: Optional[Load] = None
    lora: dict[bytes, str] = field(default_factory=dict)  # hash -> LoRA adapter name of adapter blocks (either tier)
    node: Optional[str] = None  # the node the replica runs on (--node-name), None: not said

    def to_json(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "seq": self.seq,
            "block_size": self.block_size,
            "model_fingerprint": self.model_fingerprint,
            "gpu": [h.hex() for h in self.gpu],
            "cpu": [h.hex() for h in self.cpu],
            "encoder": list(self.encoder),
            "load": None if self.load is None else {k: getattr(self.load, k) for k in LOAD_FIGURES},
            "lora": {h.hex(): name for h, name in self.lora.items()},
            **({"node": self.node} if self.node is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Snapshot":
        load = d.get("load")
        return cls(
            d["replica_id"], int(d["seq"]), int(d["block_size"]), d["model_fingerprint"],
            [bytes.fromhex(h) for h in d["gpu"]], [bytes.fromhex(h) for h in d["cpu"]],
            list(d.get("encoder", [])), Load(*(load[k] for k in LOAD_FIGURES)) if load else None,
            {bytes.fromhex(h): str(name) for h, name in (d.get("lora") or {}).items()},
            d["node"] if isinstance(d.get("node"), str) else None,
        )


# Batches the engine core queues per subscriber before that subscriber starts missing batches. A batch is one
# step's events (at default sizes about 1 KB: up to max_num_batched_tokens / block_size hashes), and queued
# messages are shared by every subscriber, so a reader that stops costs at most this many batches of memory
# however many there are. A subscriber that falls this far behind sees a sequence gap and resyncs (contract 2).
KV_EVENTS_SNDHWM = 1000


class EventPublisher:
    """ZMQ XPUB socket that numbers and sends event batches; owned by the engine-core process.

    Without `token_ids`, BlockStored goes out with an empty token list: the hashes (salted per tenant) are all a
    router needs, so the prompts' tokens stay in the replica. With `curve_secret_key_file` the socket is a CURVE
    server (encrypted) and only clients whose public keys lie in `curve_clients_dir` may subscribe (zmq.auth's
    certificate files). Each subscriber's queue holds at most KV_EVENTS_SNDHWM batches; past that it misses
    batches until it catches up, and each time one starts missing, `num_dropped` counts it."""

    def __init__(self, replica_id: str, endpoint: str, token_ids: bool = False,
                 curve_secret_key_file: Optional[str] = None, curve_clients_dir: Optional[str] = None,
                 verbose: bool = False):
        import zmq

        self.replica_id, self.token_ids = replica_id, token_ids
        self._zmq = zmq
        self._ctx = zmq.Context()  # its own: a CURVE authenticator serves one context
        self._auth = None
        self._sock = self._ctx.socket(zmq.XPUB)
        if curve_secret_key_file is not None:
            try:
                self._auth = _curve_server(self._ctx, self._sock, curve_secret_key_file, curve_clients_dir)
            except ValueError:  # a bad key file: nothing left open behind the error
                self._sock.close(0)
                self._ctx.term()
                raise
        self._sock.setsockopt(zmq.SNDHWM, KV_EVENTS_SNDHWM)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full subscriber queue shows as EAGAIN, so it is counted
        self._sock.setsockopt(zmq.LINGER, 0)
        if verbose:  # every subscription reaches the owner, also one to a topic another subscriber holds
            self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._sock.bind(endpoint)
        self.num_new_subscriptions = 0
        self.seq = 0
        self.num_dropped = 0  # times a send found a subscriber's queue full (it misses batches from then)

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        if not self.token_ids:
            events = [replace(e, token_ids=[]) if isinstance(e, BlockStored) and e.token_ids else e for e in events]
        self._send(encode(EventBatch(self.replica_id, self.seq, events)))

    def _send(self, frames: list[bytes]) -> None:
        """Send to every subscriber with room; a full one misses this batch (counted), never holds more memory."""
        zmq = self._zmq
        self._discard_subscriptions()
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # some subscriber's queue is full: send lossily, as PUB does, and count it
            self.num_dropped += 1
            self._sock.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                self._sock.send_multipart(frames)
            finally:
                self._sock.setsockopt(zmq.XPUB_NODROP, 1)

    def _discard_subscriptions(self) -> None:
        """XPUB hands subscription messages to its owner; unread, they would pile up (one per new topic). New
        subscriptions are counted in `num_new_subscriptions` (the node tier answers each with its whole state)."""
        try:
            while True:
                if self._sock.recv(self._zmq.NOBLOCK)[:1] == b"\x01":
                    self.num_new_subscriptions += 1
        except self._zmq.Again:
            pass

    def take_new_subscriptions(self) -> int:
        """Subscriptions made since the last call (drains the count); with `verbose`, repeated topics count too."""
        self._discard_subscriptions()
        n, self.num_new_subscriptions = self.num_new_subscriptions, 0
        return n

    def close(self) -> None:
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _curve_server(ctx, sock, secret_key_file: str, clients_dir: Optional[str]):
    """Make `sock` a CURVE server with the key pair in `secret_key_file`; a ZAP authenticator admits only the
    clients whose public-key certificates are in `clients_dir`. Returns the running authenticator. A missing or
    malformed file or directory is a ValueError naming the flag, raised before anything starts."""
    import zmq
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    if not zmq.has("curve"):
        raise ValueError("--kv-events-curve-secret-key: this libzmq was built without CURVE (libsodium)")
    public, secret = _load_curve_certificate(secret_key_file)
    if secret is None or not _z85_key(secret):
        raise ValueError(f"--kv-events-curve-secret-key {secret_key_file}: the file holds no secret key")
    try:
        clients = zmq.auth.load_certificates(clients_dir) if clients_dir is not None else {}
    except (OSError, ValueError) as exc:  # not a directory, or a certificate in it without a public key
        raise ValueError(f"--kv-events-curve-clients {clients_dir}: {exc}") from None
    if not all(_z85_key(k) for k in clients):
        raise ValueError(f"--kv-events-curve-clients {clients_dir}: a certificate holds a malformed public key")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=clients_dir)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    return auth


def _load_curve_certificate(path: str) -> tuple[bytes, Optional[bytes]]:
    """(public, secret or None) of a zmq.auth certificate file; ValueError naming the flag when it is unreadable."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:  # missing, unreadable, or without a public key
        raise ValueError(f"--kv-events-curve-secret-key {path}: {exc}") from None
    if not _z85_key(public):
        raise ValueError(f"--kv-events-curve-secret-key {path}: the public key is not a 40-character Z85 key")
    return public, secret


def _z85_key(key: bytes) -> bool:
    """A CURVE key as certificates hold it: 40 Z85 characters (32 bytes)."""
    from zmq.utils import z85

    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False
