"""msgpack encoding of engine messages (requests, outputs, numpy arrays); never pickle."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from ..hashing import MMPlaceholder
from .protocol import GenerateRequest
from .request import RequestOutput
from .sampling_params import SamplingParams

_NDARRAY = 1


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        header = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(_NDARRAY, len(header).to_bytes(4, "little") + header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


_ALLOWED_DTYPES = {"<f4", "<f2", "<f8", "<i8", "<i4", "|u1", "<u2", "<i2", "|b1"}


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _NDARRAY:
        raise ValueError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgpack.unpackb(data[4:4 + n])
    if dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"refusing array dtype {dtype!r}")
    return np.frombuffer(data[4 + n:], dtype=np.dtype(dtype)).reshape(shape).copy()


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def request_to_wire(g: GenerateRequest) -> dict:
    return {
        "request_id": g.request_id, "prompt_token_ids": list(g.prompt_token_ids),
        "sampling_params": dataclasses.asdict(g.sampling_params), "cache_salt": g.cache_salt,
        "mm_placeholders": [[m.mm_hash, m.offset, m.length] for m in g.mm_placeholders],
        "mm_inputs": list(g.mm_inputs), "lora_name": g.lora_name,
    }


def request_from_wire(d: dict) -> GenerateRequest:
    return GenerateRequest(
        d["request_id"], list(d["prompt_token_ids"]), SamplingParams(**d["sampling_params"]), d.get("cache_salt"),
        [MMPlaceholder(h, o, n) for h, o, n in d.get("mm_placeholders", [])], list(d.get("mm_inputs", [])),
        d.get("lora_name"),
    )


def output_to_wire(o: RequestOutput) -> list:
    return [o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.num_prompt_tokens, o.num_cached_tokens,
            o.num_cached_tokens_cpu, o.new_logprobs, o.error, o.error_status]


def output_from_wire(a: list) -> RequestOutput:
    lp = a[7]
    if lp is not None:
        lp = [None if x is None else (x[0], [tuple(t) for t in x[1]]) for x in lp]
    return RequestOutput(a[0], list(a[1]), a[2], a[3], a[4], a[5], a[6], lp, a[8], a[9])
