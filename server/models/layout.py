"""The vocabulary projection's layout on CPU: whichever of [vocab, hidden] and [hidden, vocab] multiplies faster here, timed once per shape at load."""

from __future__ import annotations

import functools
import logging
import time

import paddle

log = logging.getLogger("warmfleet.engine")

ROWS = (1, 16, 64)  # a decode step's rows: one request, a small and a large batch


def _best_ms(fn, reps: int = 2) -> float:
    fn()  # first call: allocation and kernel selection, not timed
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@functools.lru_cache(maxsize=16)
def vocab_major_is_faster(vocab: int, hidden: int, dtype: str) -> bool:
    """True: keep the checkpoint's [vocab, hidden] and multiply with `transpose_y`; False: store [hidden, vocab].

    MKL's sgemm picks different kernels for the two: on Qwen2.5-0.5B's 151,936 x 896 the plain
    [hidden, vocab] product was 1.1-1.5x faster at 1-64 rows, on the bench checkpoint's 4,096 x 512
    `transpose_y` was 1.5-1.9x faster at 16-64 rows (docs/performance.md). Devices other than the
    CPU, and dtypes other than float32, keep the checkpoint's layout untimed.
    """
    if dtype != "float32" or not paddle.device.get_device().startswith("cpu"):
        return True
    t0 = time.perf_counter()
    with paddle.no_grad():
        vocab_major = paddle.full([vocab, hidden], 0.01, dtype="float32")
        hidden_major = paddle.full([hidden, vocab], 0.01, dtype="float32")
        nt = nn = 0.0
        for rows in ROWS:  # interleaved, so a burst of load on the machine hits both
            x = paddle.full([rows, hidden], 0.5, dtype="float32")
            nt += _best_ms(lambda: paddle.matmul(x, vocab_major, transpose_y=True))
            nn += _best_ms(lambda: paddle.matmul(x, hidden_major))
    del vocab_major, hidden_major
    choice = nt <= nn
    log.info("vocabulary projection %d x %d: [vocab, hidden] %.1f ms, [hidden, vocab] %.1f ms over %s rows: "
             "keeping %s (timed in %.1f s)", vocab, hidden, nt, nn, "/".join(map(str, ROWS)),
             "[vocab, hidden]" if choice else "[hidden, vocab]", time.perf_counter() - t0)
    return choice
