"""The fragment layout of int4 weights for the tensor-core GEMV kernel "frag" (``kernels/gemv_frag.py``):
packing, unpacking (tests) and which formats it can hold. Pure numpy; ``quant_gemv.prepare_weight``
builds it once per weight on CUDA devices."""

from __future__ import annotations

import numpy as np


#: K columns per fragment-layout chunk (two 64-column units: ``kernels/gemv_frag.py``)
FRAG_CHUNK = 128


def frag_eligible(bits: int, group_size: int, has_perm: bool, irregular_groups: bool) -> str | None:
    """Why the fragment layout (tensor-core kernel "frag") cannot hold a weight, or None if it can:
    int4 codes, groups a multiple of 128 columns (one chunk never spans two groups), no act-order
    permutation or irregular groups (x is read in whole 64-column tiles)."""
    if bits != 4:
        return f"bits={bits} (the fragment layout holds int4 codes)"
    if group_size % FRAG_CHUNK:
        return f"group_size={group_size} (needs a multiple of {FRAG_CHUNK})"
    if has_perm or irregular_groups:
        return "an act-order g_idx (x would be gathered, not read in whole tiles)"
    return None


def _frag_kcol(kk, p):
    """Column of the 64-column unit that MMA k position ``kk`` of k16 step ``p`` multiplies."""
    return 16 * ((kk % 8) // 2) + 4 * p + 2 * (kk // 8) + kk % 2


def _frag_index():
    """For each (lane, reg, p, half) of a unit: the row ``r`` (0..15) and column (0..63) of its code."""
    lane = np.arange(32)[:, None, None, None]
    reg = np.arange(4)[None, :, None, None]
    p = np.arange(4)[None, None, :, None]
    half = np.arange(2)[None, None, None, :]
    g, t = lane // 4, lane % 4
    cb, rb = reg // 2, reg % 2
    row = 8 * rb + g
    col = 4 * cb + t                       # word column: MMA k positions 2 col + half
    k = _frag_kcol(2 * col + half, p)
    shape = (32, 4, 4, 2)
    return np.broadcast_to(row, shape), np.broadcast_to(k, shape)


def pack_fragments(codes: np.ndarray, n_align: int) -> np.ndarray:
    """4-bit codes ``(N, K)`` -> int32 words ``(KC, NP / 16, 256)`` in the fragment layout of
    ``kernels/gemv_frag.py``: chunk-major, rows padded to ``NP``, a multiple of ``n_align`` (a multiple of
    16: the scales' padded row count), K to 128 columns, padding codes 0. Word ``(c, u, 128 h + 4 lane + reg)`` holds, at nibble ``p`` (+ 4 for the pair's second
    half), the code of row ``16 u + row`` and column ``128 c + 64 h + k`` (``_frag_index``)."""
    N, K = codes.shape
    np_ = -(-N // n_align) * n_align
    kc = -(-K // FRAG_CHUNK)
    padded = np.zeros((np_, kc * FRAG_CHUNK), dtype=np.uint32)
    padded[:N, :K] = codes
    units = padded.reshape(np_ // 16, 16, kc * 2, 64)           # (u, r, unit along K, k)
    row, k = _frag_index()
    vals = units[:, row, :, k]                                  # (32, 4, 4, 2, u, units along K)
    shift = (4 * np.arange(4)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint32)   # (p, half)
    words = (vals << shift[None, None, :, :, None, None]).sum(axis=(2, 3), dtype=np.uint64).astype(np.uint32)
    # (lane, reg, u, 2 kc) -> (kc, u, half, lane, reg)
    words = words.reshape(32, 4, np_ // 16, kc, 2).transpose(3, 2, 4, 0, 1)
    return np.ascontiguousarray(words.reshape(kc, np_ // 16, 256)).view(np.int32)


def unpack_fragments(words: np.ndarray, N: int, K: int) -> np.ndarray:
    """Inverse of ``pack_fragments``: the codes ``(N, K)``."""
    kc, nu, _ = words.shape
    w = words.view(np.uint32).reshape(kc, nu, 2, 32, 4).transpose(3, 4, 1, 0, 2)     # (lane, reg, u, kc, half)
    row, k = _frag_index()
    codes = np.zeros((nu, 16, kc, 2, 64), dtype=np.uint32)
    for p in range(4):
        for half in range(2):
            q = (w >> np.uint32(4 * p + 16 * half)) & np.uint32(15)                    # (32, 4, u, kc, 2)
            codes[:, row[:, :, p, half], :, :, k[:, :, p, half]] = q.transpose(0, 1, 2, 3, 4)
    return codes.reshape(nu * 16, kc * FRAG_CHUNK)[:N, :K]
