"""M-RoPE positions for Qwen2-VL / Qwen2.5-VL prompts (HF's `get_rope_index` for images); numpy only, no paddle.

Text tokens advance all three axes (t, h, w) together; an image's tokens take
(t, row, col) of its merged grid, offset by the position where the image starts; the text
after an image resumes at 1 + the largest position used so far:

    tokens     a  b  [img 2x3 merged]        c
    t          0  1  2  2  2  2  2  2        5
    h          0  1  2  2  2  3  3  3        5
    w          0  1  2  3  4  2  3  4        5

Generated token i (0-based over the whole sequence, i >= prompt length) sits at i + delta
on every axis, delta = max position + 1 - prompt length.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..hashing import MMPlaceholder


def mrope_positions(num_tokens: int, placeholders: Sequence[MMPlaceholder], grids: Sequence[Sequence[int]],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """(int64 [3, num_tokens] positions of the prompt, delta for tokens after it)."""
    if len(placeholders) != len(grids):
        raise ValueError(f"{len(placeholders)} placeholders but {len(grids)} grids")
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cursor, next_pos = 0, 0
    for ph, (t, h, w) in sorted(zip(placeholders, grids), key=lambda pg: pg[0].offset):
        gh, gw = h // merge_size, w // merge_size
        if t * gh * gw != ph.length:
            raise ValueError(f"image at {ph.offset} has {ph.length} tokens but grid {(t, h, w)} gives {t * gh * gw}")
        if ph.offset < cursor or ph.offset + ph.length > num_tokens:
            raise ValueError(f"image placeholder at {ph.offset} (+{ph.length}) overlaps another or the end")
        n_text = ph.offset - cursor
        pos[:, cursor:ph.offset] = next_pos + np.arange(n_text)
        base = next_pos + n_text
        pos[0, ph.offset:ph.offset + ph.length] = base + np.repeat(np.arange(t), gh * gw)
        pos[1, ph.offset:ph.offset + ph.length] = base + np.tile(np.repeat(np.arange(gh), gw), t)
        pos[2, ph.offset:ph.offset + ph.length] = base + np.tile(np.arange(gw), t * gh)
        next_pos = int(pos[:, ph.offset:ph.offset + ph.length].max()) + 1
        cursor = ph.offset + ph.length
    pos[:, cursor:] = next_pos + np.arange(num_tokens - cursor)
    top = int(pos.max()) + 1 if num_tokens else 0
    return pos, top - num_tokens


def positions_for_span(prompt_positions: np.ndarray, delta: int, start: int, end: int) -> np.ndarray:
    """int64 [3, end - start] positions of tokens [start, end): prompt rows, then i + delta for generated ones."""
    n_prompt = prompt_positions.shape[1]
    out = np.empty((3, end - start), dtype=np.int64)
    p_end = min(end, n_prompt)
    if start < p_end:
        out[:, :p_end - start] = prompt_positions[:, start:p_end]
    g_start = max(start, n_prompt)
    if g_start < end:
        out[:, g_start - start:] = np.arange(g_start, end) + delta
    return out
