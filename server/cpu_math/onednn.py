"""fp32 projections on CPU through oneDNN's matmul (Paddle's bundled libdnnl) on weights packed once at load.

Paddle's eager CPU matmul calls MKL 2019's sgemm, which re-packs the weight on every call and, on
CPUs that are not Intel's, runs its AVX2 kernels (process_setup.py). oneDNN 3 (shipped inside the Paddle
wheel, `paddle/libs/libdnnl.so.3`) picks its kernels by the CPU's instruction sets: its brgemm
matmul runs AVX-512 where there is AVX-512, and with the weight reordered once into the blocked
layout the primitive asks for, a call only streams it. On this project's reference machine (AMD
EPYC, one thread) that is 95 against 76-81 GFLOP/s at 16 rows, 107-111 against 90-108 at 64
(docs/performance.md, "CPU matmul"; docs/history/performance-passes.md, "Fourth pass"). One packed
layout serves every row count, so a primitive is made per (in, out, bias, rows) on first use, ~0.5 ms,
and shared by every layer of that shape.

No Paddle op calls this: the binding is ctypes on oneDNN's C API. Where the library, its OpenMP
runtime or a usable implementation is missing, `available()` says why and the model keeps
Paddle's matmul (layout.py); `WARMFLEET_CPU_MATMUL=paddle` forces that path.
"""

from __future__ import annotations

import copy
import ctypes as C
import functools
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Optional

log = logging.getLogger("warmfleet.engine")

_vp = C.c_void_p
_Dims = C.c_int64 * 12  # DNNL_MAX_NDIMS
F32, FORMAT_ANY, CPU_ENGINE, IN_ORDER = 3, 1, 1, 1  # dnnl_f32, dnnl_format_tag_any, dnnl_cpu, dnnl_stream_in_order
QUERY_IMPL, QUERY_WEIGHTS_MD = 8, 131  # dnnl_query_impl_info_str, dnnl_query_weights_md
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_POST_OP_SRC1 = 32768 | 2  # DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1 (oneDNN 3's base is 32768)
SWISH, BINARY_MUL = 0x2C, 0x1FFF1  # dnnl_eltwise_swish (x * sigmoid(alpha x)), dnnl_binary_mul
EPILOGUES = (None, "silu", "mul")  # applied to x @ W (+ b) inside the matmul: silu(y), or y * other
ENV = "WARMFLEET_CPU_MATMUL"  # "paddle": never use oneDNN
ROW_COUNTS_KEPT = 16  # primitives kept per shape (LRU); each holds ~200 KB of JIT code and buffers
CHUNKS = (512, 256, 128, 64)  # rows above 64 run as chunks of these (the rest exact): prefill sizes vary per
# step, and this way they reuse a few primitives instead of making one per size (same GFLOP/s from 128 rows)


class _Arg(C.Structure):
    _fields_ = [("arg", C.c_int), ("memory", _vp)]


class OneDNN:
    """The library, one CPU engine and one in-order stream; raises OSError/RuntimeError where unusable."""

    SIGNATURES = {
        "dnnl_engine_create": ([_vp, C.c_int, C.c_size_t], C.c_int),
        "dnnl_stream_create": ([_vp, _vp, C.c_uint], C.c_int),
        "dnnl_memory_desc_create_with_strides": ([_vp, C.c_int, _vp, C.c_int, _vp], C.c_int),
        "dnnl_memory_desc_create_with_tag": ([_vp, C.c_int, _vp, C.c_int, C.c_int], C.c_int),
        "dnnl_memory_desc_get_size": ([_vp], C.c_size_t),
        "dnnl_matmul_primitive_desc_create": ([_vp, _vp, _vp, _vp, _vp, _vp, _vp], C.c_int),
        "dnnl_reorder_primitive_desc_create": ([_vp, _vp, _vp, _vp, _vp, _vp], C.c_int),
        "dnnl_primitive_desc_query": ([_vp, C.c_int, C.c_int, _vp], C.c_int),
        "dnnl_primitive_desc_query_md": ([_vp, C.c_int, C.c_int], _vp),
        "dnnl_primitive_create": ([_vp, _vp], C.c_int),
        "dnnl_memory_create": ([_vp, _vp, _vp, _vp], C.c_int),
        "dnnl_memory_set_data_handle": ([_vp, _vp], C.c_int),
        "dnnl_primitive_execute": ([_vp, _vp, C.c_int, _vp], C.c_int),
        "dnnl_stream_wait": ([_vp], C.c_int),
        "dnnl_post_ops_create": ([_vp], C.c_int),
        "dnnl_post_ops_append_eltwise": ([_vp, C.c_int, C.c_float, C.c_float], C.c_int),
        "dnnl_post_ops_append_binary": ([_vp, C.c_int, _vp], C.c_int),
        "dnnl_primitive_attr_create": ([_vp], C.c_int),
        "dnnl_primitive_attr_set_post_ops": ([_vp, _vp], C.c_int),
        "dnnl_memory_desc_destroy": ([_vp], C.c_int),
        "dnnl_memory_destroy": ([_vp], C.c_int),
        "dnnl_primitive_desc_destroy": ([_vp], C.c_int),
        "dnnl_primitive_destroy": ([_vp], C.c_int),
        "dnnl_post_ops_destroy": ([_vp], C.c_int),
        "dnnl_primitive_attr_destroy": ([_vp], C.c_int),
        "dnnl_set_primitive_cache_capacity": ([C.c_int], C.c_int),
    }

    def __init__(self, path: Path, threads: int):
        self.lib = C.CDLL(str(path))
        for name, (args, res) in self.SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, res
        # oneDNN runs on the OpenMP runtime it links (GNU's), not the one MKL uses: one math thread
        # count for both, as `--engine-threads` asks.
        C.CDLL("libgomp.so.1").omp_set_num_threads(threads)
        # primitives are kept per shape here (_Shape, bounded); the library's own cache (1,024 by default)
        # would keep every one ever made alive
        self.check(self.lib.dnnl_set_primitive_cache_capacity(0), "primitive cache capacity")
        self.engine, self.stream = _vp(), _vp()
        self.check(self.lib.dnnl_engine_create(C.byref(self.engine), CPU_ENGINE, 0), "engine")
        self.check(self.lib.dnnl_stream_create(C.byref(self.stream), self.engine, IN_ORDER), "stream")

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"oneDNN {what} failed (dnnl_status_t {status})")

    def md(self, dims: list[int], strides: Optional[list[int]] = None) -> _vp:
        """A float32 memory descriptor: plain with `strides`, else "any" (the primitive chooses)."""
        md = _vp()
        if strides is None:
            self.check(self.lib.dnnl_memory_desc_create_with_tag(C.byref(md), len(dims), _Dims(*dims), F32, FORMAT_ANY),
                       "memory descriptor")
        else:
            self.check(self.lib.dnnl_memory_desc_create_with_strides(C.byref(md), len(dims), _Dims(*dims), F32,
                                                                     _Dims(*strides)), "memory descriptor")
        return md

    def memory(self, md, ptr: Optional[int], own_md: bool = False) -> _vp:
        """A memory object over `ptr` (None: set per call); `own_md`: the descriptor was made for it, destroy it."""
        mem = _vp()
        self.check(self.lib.dnnl_memory_create(C.byref(mem), md, self.engine, _vp(ptr)), "memory")
        if own_md:
            self.lib.dnnl_memory_desc_destroy(md)
        return mem

    def plain(self, rows: int, cols: int, ptr: Optional[int] = None) -> _vp:
        """A memory object for a row-major float32 [rows, cols]."""
        return self.memory(self.md([rows, cols], [cols, 1]), ptr, own_md=True)

    def epilogue(self, kind: Optional[str], rows: int, n: int) -> Optional[_vp]:
        """The primitive attribute that applies `kind` (EPILOGUES) to the matmul's output; None for none."""
        if kind is None:
            return None
        ops, attr = _vp(), _vp()
        self.check(self.lib.dnnl_post_ops_create(C.byref(ops)), "post-ops")
        if kind == "silu":
            self.check(self.lib.dnnl_post_ops_append_eltwise(ops, SWISH, 1.0, 0.0), "swish post-op")
        else:  # "mul"
            other = self.md([rows, n], [n, 1])
            self.check(self.lib.dnnl_post_ops_append_binary(ops, BINARY_MUL, other), "mul post-op")
            self.lib.dnnl_memory_desc_destroy(other)
        self.check(self.lib.dnnl_primitive_attr_create(C.byref(attr)), "attribute")
        self.check(self.lib.dnnl_primitive_attr_set_post_ops(attr, ops), "attribute post-ops")
        self.lib.dnnl_post_ops_destroy(ops)  # the attribute keeps its own copy
        return attr

    def matmul(self, rows: int, k: int, n: int, weights_md, bias: bool,
               epilogue: Optional[str] = None) -> tuple[_vp, str]:
        """(primitive descriptor, implementation name) for epilogue(x[rows, k] @ W[k, n] (+ b[n]))."""
        pd, impl = _vp(), C.c_char_p()
        mds = [self.md([rows, k], [k, 1]), self.md([rows, n], [n, 1]), self.md([1, n], [n, 1]) if bias else None]
        attr = self.epilogue(epilogue, rows, n)
        try:
            self.check(self.lib.dnnl_matmul_primitive_desc_create(C.byref(pd), self.engine, mds[0], weights_md, mds[2],
                                                                  mds[1], attr), f"matmul {rows}x{k}x{n}")
        finally:  # the primitive descriptor holds copies
            for md in mds:
                if md is not None:
                    self.lib.dnnl_memory_desc_destroy(md)
            if attr is not None:
                self.lib.dnnl_primitive_attr_destroy(attr)
        self.lib.dnnl_primitive_desc_query(pd, QUERY_IMPL, 0, C.byref(impl))
        return pd, (impl.value or b"?").decode()

    def reorder(self, src_md, src_ptr: int, dst_md, dst_ptr: int) -> None:
        pd, prim = _vp(), _vp()
        self.check(self.lib.dnnl_reorder_primitive_desc_create(C.byref(pd), src_md, self.engine, dst_md, self.engine,
                                                               None), "reorder")
        self.check(self.lib.dnnl_primitive_create(C.byref(prim), pd), "reorder primitive")
        mems = (self.memory(src_md, src_ptr), self.memory(dst_md, dst_ptr))
        args = (_Arg * 2)(_Arg(ARG_SRC, mems[0]), _Arg(ARG_DST, mems[1]))
        try:
            self.check(self.lib.dnnl_primitive_execute(prim, self.stream, 2, args), "reorder")
            self.check(self.lib.dnnl_stream_wait(self.stream), "stream wait")
        finally:
            for obj, destroy in ((mems[0], "memory"), (mems[1], "memory"), (prim, "primitive"), (pd, "primitive_desc")):
                getattr(self.lib, f"dnnl_{destroy}_destroy")(obj)


def library_path() -> Path:
    import paddle

    return Path(paddle.__file__).parent / "libs" / "libdnnl.so.3"


_state: dict = {}


def load(threads: int = 1) -> Optional[str]:
    """Open oneDNN for this process (the engine core calls this from cpu.configure); None, or why not."""
    if os.environ.get(ENV, "onednn") == "paddle":
        _state.update(dnnl=None, reason=f"{ENV}=paddle")
        return _state["reason"]
    if "dnnl" in _state:
        return _state["reason"]
    try:
        _state.update(dnnl=OneDNN(library_path(), threads), reason=None)
    except (OSError, AttributeError, RuntimeError) as e:
        _state.update(dnnl=None, reason=f"{type(e).__name__}: {e}")
        log.warning("oneDNN matmul unavailable (%s): projections use Paddle's matmul, ~20%% slower at 16 rows; "
                    "install a Paddle CPU wheel that ships libs/libdnnl.so.3 and the system's libgomp1", _state["reason"])
    return _state["reason"]


def available(dtype: str = "float32") -> bool:
    """Whether projections of `dtype` run on oneDNN here (CPU, float32, library usable, not turned off)."""
    import paddle

    if dtype != "float32" or not paddle.device.get_device().startswith("cpu") or os.environ.get(ENV) == "paddle":
        return False
    if "dnnl" not in _state:
        load(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    return _state["dnnl"] is not None


class _Shape:
    """The primitives of one (in, out, bias, epilogue), one per row count, shared by every weight of that shape.

    A primitive's arguments: source, weights, destination, then the bias and the epilogue's operand
    where there are those; the weights (and bias) are set per call, the rest are memory objects
    whose data pointer is set per call.
    """

    def __init__(self, dnnl: OneDNN, k: int, n: int, bias: bool, epilogue: Optional[str], weights_md):
        self.dnnl, self.k, self.n, self.bias, self.epilogue, self.weights_md = dnnl, k, n, bias, epilogue, weights_md
        self.by_rows: OrderedDict[int, tuple] = OrderedDict()

    def primitive(self, rows: int) -> tuple:
        entry = self.by_rows.get(rows)
        if entry is not None:
            self.by_rows.move_to_end(rows)
            return entry
        d = self.dnnl
        pd, impl = d.matmul(rows, self.k, self.n, self.weights_md, self.bias, self.epilogue)
        prim = _vp()
        try:
            if impl.startswith("ref"):  # the reference loop is orders of magnitude slower: never silently
                raise RuntimeError(f"oneDNN offers only {impl!r} for a {rows}x{self.k}x{self.n} matmul")
            d.check(d.lib.dnnl_primitive_create(C.byref(prim), pd), "matmul primitive")
        finally:
            d.lib.dnnl_primitive_desc_destroy(pd)
        mems = [d.plain(rows, self.k), d.plain(rows, self.n)]
        args = [_Arg(ARG_SRC, mems[0]), _Arg(ARG_WEIGHTS, None), _Arg(ARG_DST, mems[1])]
        if self.bias:
            args.append(_Arg(ARG_BIAS, None))
        if self.epilogue == "mul":
            mems.append(d.plain(rows, self.n))
            args.append(_Arg(ARG_POST_OP_SRC1, mems[2]))
        entry = self.by_rows[rows] = (prim, mems, (_Arg * len(args))(*args), len(args))
        if len(self.by_rows) > ROW_COUNTS_KEPT:  # prefill row counts vary per step: keep the recent ones
            old_prim, old_mems, _, _ = self.by_rows.popitem(last=False)[1]
            d.lib.dnnl_primitive_destroy(old_prim)
            for mem in old_mems:
                d.lib.dnnl_memory_destroy(mem)
        return entry


@functools.lru_cache(maxsize=None)
def _shape(k: int, n: int, bias: bool, epilogue: Optional[str]) -> _Shape:
    d = _state["dnnl"]
    any_md = d.md([k, n])
    pd, impl = d.matmul(16, k, n, any_md, bias)  # the layout it wants for the weight serves every row count
    d.lib.dnnl_memory_desc_destroy(any_md)
    weights_md = _vp(d.lib.dnnl_primitive_desc_query_md(pd, QUERY_WEIGHTS_MD, 0))  # owned by `pd`, kept for good
    log.info("oneDNN matmul %d -> %d%s%s: %s, weights packed once", k, n, " + bias" if bias else "",
             f", then {epilogue}" if epilogue else "", impl)
    return _Shape(d, k, n, bias, epilogue, weights_md)


class PackedWeight:
    """A projection's weight in oneDNN's layout (+ its bias); call it on x [rows, in] for [rows, out] float32.

    `epilogue` "silu": the call returns silu(x @ W + b); "mul": it takes `other` [rows, out] and returns
    (x @ W + b) * other. Both run inside the matmul (oneDNN post-ops), so a gated MLP's silu(gate) * up
    costs no pass of its own over the [rows, intermediate] activations.
    """

    def __init__(self, weight, out_major: bool, bias=None, epilogue: Optional[str] = None):
        import paddle

        if epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {epilogue!r}; choose from {EPILOGUES}")
        d = _state["dnnl"]
        if out_major:  # [out, in] as in the checkpoint: read as W^T through strides, no copy
            n, k = weight.shape
            plain = d.md([k, n], [1, k])
        else:
            k, n = weight.shape
            plain = d.md([k, n], [n, 1])
        self.k, self.n = k, n
        self.shape = _shape(k, n, bias is not None, epilogue)
        size = d.lib.dnnl_memory_desc_get_size(self.shape.weights_md)
        self.packed = paddle.empty([(size + 3) // 4], dtype="float32")
        weight = weight.contiguous()
        d.reorder(plain, weight.data_ptr(), self.shape.weights_md, self.packed.data_ptr())
        d.lib.dnnl_memory_desc_destroy(plain)
        self.wmem = d.memory(self.shape.weights_md, self.packed.data_ptr())
        self.bias = bias  # kept alive: its memory object points into it
        self.bmem = d.plain(1, n, bias.data_ptr()) if bias is not None else None
        self.nbytes = size
        from paddle import _C_ops

        f32, cpu = paddle.float32, paddle.CPUPlace()
        self.empty = lambda rows: _C_ops.empty([rows, n], f32, cpu)  # paddle.empty without its checks: 1.5 vs 4.7 us
        self._plain: Optional["PackedWeight"] = None

    def without_epilogue(self) -> "PackedWeight":
        """The same packed weight called as plain x @ W (+ b): the layout does not depend on the epilogue
        (`_shape` asks oneDNN for it without one), so only the primitives differ."""
        if self.shape.epilogue is None:
            return self
        if self._plain is None:
            plain = copy.copy(self)
            plain.shape = _shape(self.k, self.n, self.bias is not None, None)
            self._plain = plain
        return self._plain

    def __call__(self, x, other=None):
        lead = x.shape[:-1]
        if len(lead) != 1:
            x = x.reshape([-1, self.k])
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.shape[0]
        y = self.empty(rows)
        if self.shape.epilogue == "mul":
            other = other.reshape([rows, self.n])
            other = other if other.is_contiguous() else other.contiguous()
        ptrs = (x.data_ptr(), y.data_ptr(), other.data_ptr() if self.shape.epilogue == "mul" else 0)
        start = 0
        for size in CHUNKS:  # row-major: a chunk of rows is a pointer offset, no copy
            while rows - start > CHUNKS[-1] and rows - start >= size:
                self._run(size, start, ptrs)
                start += size
        if rows > start:
            self._run(rows - start, start, ptrs)
        return y if len(lead) == 1 else y.reshape([*lead, self.n])

    def _run(self, rows: int, start: int, ptrs: tuple[int, int, int]) -> None:
        prim, mems, args, nargs = self.shape.primitive(rows)
        d = self.shape.dnnl
        args[1].memory = self.wmem
        if self.bmem is not None:
            args[3].memory = self.bmem
        d.lib.dnnl_memory_set_data_handle(mems[0], ptrs[0] + 4 * start * self.k)
        d.lib.dnnl_memory_set_data_handle(mems[1], ptrs[1] + 4 * start * self.n)
        if len(mems) == 3:
            d.lib.dnnl_memory_set_data_handle(mems[2], ptrs[2] + 4 * start * self.n)
        d.check(d.lib.dnnl_primitive_execute(prim, d.stream, nargs, args), f"matmul {rows}x{self.k}x{self.n}")


def pack_model(model) -> int:
    """Pack every projection of a loaded model (each layer with `pack_onednn`, the model's own last); bytes packed."""
    return sum(layer.pack_onednn() for layer in [*model.sublayers(), model] if hasattr(layer, "pack_onednn"))
