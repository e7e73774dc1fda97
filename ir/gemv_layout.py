"""The NVIDIA GEMV weight layout ("gemv-tiled"): the one internal form that the GPU quantized-GEMV kernels read.

Every packing of ``portakern.ir.Packing`` is repacked once into it (``portakern.gemv_weight.prepare_gemv_weight``
reads the packing with ``portakern.ir.packing.unpack``, then calls the packers of this module), so the kernels
know a single format. This module is its executable definition: numpy pack / unpack pairs, pure and
device-free. Notation: ``N`` output columns, ``K`` input channels, ``BITS`` 4 or 8, ``EPW = 32 // BITS`` codes
per word, ``G`` groups.

Words (``qweight``, int32 ``(KWP, NP)``, K-major, ``pack_internal``)
    Codes are unsigned (GGUF Q8_0's signed codes and zero point are offset by ``2^(BITS-1)``). Word ``(j, n)``
    holds ``EPW`` codes of column ``n``, code ``e`` in bits ``BITS*e .. BITS*e + BITS-1``. Word rows are
    interleaved in blocks of ``IW`` rows (``interleave_words``): code ``e`` of row ``j`` is ``W[n, k]`` with
    ``k = (j // IW) * IW * EPW + e * IW + j % IW`` (``IW = 1``: ``k = EPW j + e``), so the x values that
    meet code position ``e`` of ``IW`` consecutive rows are contiguous (one vector load), and a block of
    ``IW * EPW`` columns lies in one group. int4 with groups of whole words: ``IW`` is the largest power
    of two, at most ``MAX_INTERLEAVE`` (8), dividing the words per group; int8, and groups that are not
    whole words or are irregular: ``IW = 1``.

Padding
    ``KWP`` (word rows) is ``ceil(K / EPW)`` rounded up to a multiple of ``K_ALIGN_WORDS`` (64, the largest
    K tile) and ``NP`` (the row stride) is N rounded up to ``N_ALIGN_WORDS`` (128, the largest unmasked
    column tile), so tiles need no K mask and tiles of up to 128 columns no N mask. Padding codes are 0.

Scales and zero points (``scales``, ``zeros``: ``(G, NP)``, transposed)
    Row ``g`` holds the scale (zero point, as an integer value) of group ``g`` for every column, in the
    format's scale dtype; columns past N repeat column 0 (finite, never stored). Symmetric formats have no
    ``zeros`` and use the constant zero point of the format. ``dequant[n, k] = (code - zero) * scale``.

Act-order GPTQ (``g_idx``)
    When every group has ``group_size`` columns, K is permuted so that groups are contiguous: ``perm``
    int32 ``(K,)``, internal column ``k`` multiplies ``x[:, perm[k]]`` (the words hold the permuted
    codes). Otherwise (irregular groups) K keeps its order and ``kgroup`` int32 ``(K,)`` is the group of
    each column (a per-element group lookup).

Fragment layout (``frag``, int32 ``(KC, NP / 16, 256)``, ``pack_fragments``)
    A second copy of int4 codes for the tensor-core GEMV, laid out as ``mma.m16n8k16`` A fragments, so one
    16-byte load per lane is that lane's share of four fragments. A unit is 16 rows x 64 columns of K
    (128 words): word ``4 lane + reg`` (``lane = 4 g + t``, ``reg = 2 cb + rb``) is row ``8 rb + g`` and word
    column ``4 cb + t`` of the tf32-shaped A tile; its nibbles ``p`` and ``p + 4`` are the codes at MMA
    k positions ``2c, 2c + 1`` (c its word column) of k16 step ``p``, and MMA k position ``kk`` of step
    ``p`` is column ``16 ((kk % 8) // 2) + 4 p + 2 (kk // 8) + kk % 2`` of the unit. A chunk is two units
    along K (``FRAG_CHUNK`` = 128 columns), stored chunk-major: word ``(c, u, 128 h + 4 lane + reg)`` is
    in unit ``h`` of chunk ``c``, rows ``16 u ..``. Rows are padded to ``NP``, K to whole chunks, with
    code 0. Only formats ``frag_eligible`` accepts (int4, groups a multiple of 128, no act-order) have one.
"""

from __future__ import annotations

import numpy as np


#: word rows are padded to a multiple of this (the largest K tile), so tiles need no K mask
K_ALIGN_WORDS = 64
#: the row stride is N rounded up to this (the largest unmasked column tile)
N_ALIGN_WORDS = 128
#: largest interleave of word rows (8 rows: the x values of one code position are 16 bytes of bf16)
MAX_INTERLEAVE = 8
#: K columns per fragment-layout chunk (two 64-column units)
FRAG_CHUNK = 128


def padded_rows(K: int, bits: int) -> int:
    """``KWP``: the word rows of a weight of ``K`` columns at ``bits`` bits, padded to ``K_ALIGN_WORDS``."""
    kw = -(-K // (32 // bits))
    return -(-kw // K_ALIGN_WORDS) * K_ALIGN_WORDS


def padded_columns(N: int) -> int:
    """``NP``: the row stride of a weight of ``N`` output columns (``N`` rounded up to ``N_ALIGN_WORDS``)."""
    return -(-N // N_ALIGN_WORDS) * N_ALIGN_WORDS


def interleave_words(bits: int, group_size: int, irregular_groups: bool) -> int:
    """Word rows per interleaved block of the internal layout: for int4, the largest power of two,
    at most ``MAX_INTERLEAVE``, dividing the words per group (so a block lies in one group); 1 (plain
    order) for int8 and when groups are not whole words or irregular (per-element group lookup).
    int8 keeps the plain order: its tables use the per-word-row tile, whose x indexing the interleave
    slows (H200, int8 28672x8192: 76% of the memory floor interleaved, 87% plain)."""
    epw = 32 // bits
    if bits != 4 or irregular_groups or group_size % epw:
        return 1
    wpg = group_size // epw
    return min(MAX_INTERLEAVE, wpg & -wpg)


def pack_internal(codes: np.ndarray, bits: int, interleave: int = 1) -> np.ndarray:
    """Unsigned codes ``(N, K)`` -> int32 words ``(KWP, NP)``, zero-padded to whole tiles and aligned
    rows: code ``e`` (bits ``bits * e``) of word ``(j, n)`` is column
    ``k = (j // iw) * iw * epw + e * iw + j % iw`` of row n (``iw = interleave``; 1: ``k = epw j + e``)."""
    N, K = codes.shape
    epw = 32 // bits
    kwp = padded_rows(K, bits)
    np_ = padded_columns(N)
    padded = np.zeros((np_, kwp * epw), dtype=np.uint32)
    padded[:N, :K] = codes
    # (n, block, e, j) -> (n, block, j, e): word row block * iw + j, code position e
    v = padded.reshape(np_, kwp // interleave, epw, interleave).transpose(0, 1, 3, 2).reshape(np_, kwp, epw)
    words = np.zeros((np_, kwp), dtype=np.uint32)
    for e in range(epw):
        words |= v[:, :, e] << np.uint32(bits * e)
    return np.ascontiguousarray(words.T).view(np.int32)


def unpack_internal(words: np.ndarray, bits: int, interleave: int, N: int, K: int) -> np.ndarray:
    """Inverse of ``pack_internal``: the codes ``(N, K)`` of int32 words ``(KWP, NP)``."""
    epw = 32 // bits
    u = words.view(np.uint32)
    codes = np.stack([(u >> np.uint32(bits * e)) & np.uint32((1 << bits) - 1) for e in range(epw)], axis=1)
    kwp = u.shape[0]
    # (block, j, e, n) -> (block, e, j, n): column k of the block in order
    codes = codes.reshape(kwp // interleave, interleave, epw, -1).transpose(0, 2, 1, 3).reshape(kwp * epw, -1)
    return codes[:K, :N].T


# -- the fragment layout ---------------------------------------------------------------------------

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


def pack_fragments(codes: np.ndarray, n_align: int = N_ALIGN_WORDS) -> np.ndarray:
    """4-bit codes ``(N, K)`` -> int32 words ``(KC, NP / 16, 256)`` in the fragment layout: chunk-major, rows
    padded to ``NP``, a multiple of ``n_align`` (a multiple of 16; ``N_ALIGN_WORDS``, the scales' padded row
    count, in the prepared weight), K to 128 columns, padding codes 0. Word ``(c, u, 128 h + 4 lane + reg)``
    holds, at nibble ``p`` (+ 4 for the pair's second half), the code of row ``16 u + row`` and column
    ``128 c + 64 h + k`` (``_frag_index``)."""
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
            codes[:, row[:, :, p, half], :, :, k[:, :, p, half]] = q
    return codes.reshape(nu * 16, kc * FRAG_CHUNK)[:N, :K]


__all__ = ["FRAG_CHUNK", "K_ALIGN_WORDS", "MAX_INTERLEAVE", "N_ALIGN_WORDS", "frag_eligible", "interleave_words",
           "pack_fragments", "pack_internal", "padded_columns", "padded_rows", "unpack_fragments",
           "unpack_internal"]
