"""Weight layouts for projections on Paddle's CPU matmul: [in, out] or [out, in], whichever multiplies faster here, timed once per shape at load.

Used where oneDNN's packed matmul (onednn.py) is not: without the library, or WARMFLEET_CPU_MATMUL=paddle.
"""

from __future__ import annotations

import functools
import logging
import time

import paddle

log = logging.getLogger("warmfleet.engine")

ROWS = (1, 16, 64)  # a decode step's rows: one request, a small and a large batch
SMALL_ROWS = 16  # up to this many rows an [out, in] weight multiplies as W @ x^T (MKL's faster form there)
TIMED_WIDTH = 32768  # outputs timed at most: a vocabulary's 152k x 3,584 would be a 4 GB transient


def project(x: paddle.Tensor, weight: paddle.Tensor, out_major: bool) -> paddle.Tensor:
    """x @ W for W stored [in, out] (`out_major` False) or [out, in]; [rows, out]."""
    if not out_major:
        return paddle.matmul(x, weight)
    if x.ndim == 2 and x.shape[0] <= SMALL_ROWS:
        return paddle.matmul(weight, x, transpose_y=True).T
    return paddle.matmul(x, weight, transpose_y=True)


def timed_width(out_features: int) -> int:
    """The outputs to time for a projection: all of them up to TIMED_WIDTH, else the widest narrower count
    with the same power-of-two factor. An [in, out] weight's row stride decides its cache-set conflicts:
    [896, 32,768] (a 128 KiB stride) multiplies 3x slower at 16 rows than [896, 32,640] or the whole
    151,936-wide vocabulary, so timing a power-of-two slice of a vocabulary picked the wrong layout.
    """
    if out_features <= TIMED_WIDTH:
        return out_features
    two = out_features & -out_features  # the largest power of two dividing out_features
    if two >= TIMED_WIDTH:  # a power-of-two-heavy width: its slice keeps a conflicting stride too
        return TIMED_WIDTH
    return (TIMED_WIDTH // two - (TIMED_WIDTH // two + 1) % 2) * two  # an odd multiple of it


def _best_ms(fn, reps: int = 2) -> float:
    fn()  # first call: allocation and kernel selection, not timed
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@functools.lru_cache(maxsize=64)
def out_major_is_faster(in_features: int, out_features: int, dtype: str) -> bool:
    """True: store the weight as the checkpoint has it, [out, in]; False: transposed once at load, [in, out].

    MKL's sgemm picks different kernels for the two, by shape and row count: on the bench checkpoint
    [out, in] is faster for the q/o/down projections and its 4,096-token lm_head, [in, out] for
    gate/up; on Qwen2.5-0.5B's 151,936 x 896 vocabulary [in, out] is 1.1-1.5x faster
    (docs/performance.md). Devices other than the CPU, and dtypes other than float32, keep [in, out]
    untimed (and the vocabulary projection its [vocab, hidden]: the callers decide that case).
    """
    if dtype != "float32" or not paddle.device.get_device().startswith("cpu"):
        return False
    t0 = time.perf_counter()
    width = timed_width(out_features)
    with paddle.no_grad():
        weights = {True: paddle.full([width, in_features], 0.01, dtype="float32"),
                   False: paddle.full([in_features, width], 0.01, dtype="float32")}
        total = {True: 0.0, False: 0.0}
        for rows in ROWS:  # interleaved, so a burst of load on the machine hits both
            x = paddle.full([rows, in_features], 0.5, dtype="float32")
            for major, w in weights.items():
                total[major] += _best_ms(lambda: project(x, w, major))
    del weights
    choice = total[True] < total[False]
    log.info("projection %d -> %d: [out, in] %.2f ms, [in, out] %.2f ms over %s rows (%d outputs timed): keeping %s "
             "(timed in %.2f s)", in_features, out_features, total[True], total[False], "/".join(map(str, ROWS)), width,
             "[out, in]" if choice else "[in, out]", time.perf_counter() - t0)
    return choice
