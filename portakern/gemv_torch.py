"""The GEMV layout built with torch ops on the weight's own device: unpacking every packing, the word and fragment
packers and the transposed scales, in one pass and without host memory.

The numpy packers of ``portakern.ir.gemv_layout`` (with ``portakern.ir.packing.unpack``) are the reference: these
functions give the same bits (``tests/test_gemv_prepare.py`` compares them on CPU tensors), on any torch device.
torch is imported by the caller (``portakern.gemv_weight``), which holds the only entry point here.
"""

from __future__ import annotations

import torch

from portakern.ir.gemv_layout import FRAG_CHUNK, N_ALIGN_WORDS, padded_columns, padded_rows
from portakern.ir.packing import AWQ_ORDER, GGUF_BLOCK_BYTES
from portakern.ir.quant import Packing

_IDENTITY = tuple(range(8))
#: the packings ``unpack`` reads with torch ops; others are repacked by the numpy reference on the host
PACKINGS = frozenset({Packing.NATIVE, Packing.AWQ, Packing.GPTQ, Packing.GGUF_Q4_0, Packing.GGUF_Q8_0})


def _words_to_nibbles(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 ``(R, C)`` words of eight 4-bit values -> uint8 ``(R, 8C)``: value ``8c + order[i]`` is nibble i."""
    R, C = words.shape
    out = torch.empty((R, C, 8), dtype=torch.uint8, device=words.device)
    for i, dst in enumerate(order):
        out[:, :, dst] = ((words >> (4 * i)) & 0xF).to(torch.uint8)
    return out.reshape(R, 8 * C)


def unpack(fmt, t: dict, N: int, K: int):
    """``(codes, scales, zeros, group)`` of the torch tensors ``t`` in ``fmt``, on their device: ``codes`` uint8
    ``(N, K)`` (GGUF Q8_0: int16, signed), ``scales`` ``(N, G)`` as stored, ``zeros`` ``(N, G)`` integer zero
    points or None for symmetric formats, ``group`` int64 ``(K,)`` for a GPTQ ``g_idx`` else None (groups of
    ``group_size`` consecutive columns). The same values as ``portakern.ir.packing.unpack``."""
    p = fmt.packing
    if p is Packing.NATIVE:
        q = t["qweight"]
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(N, K) if fmt.bits == 4 else q
        return codes, t["scales"], None if fmt.symmetric else t["zeros"], None
    if p is Packing.AWQ:
        codes = _words_to_nibbles(t["qweight"], AWQ_ORDER).T                     # (K, N) -> (N, K)
        zeros = _words_to_nibbles(t["qzeros"], AWQ_ORDER).T
        return codes, t["scales"].T, zeros, None
    if p is Packing.GPTQ:
        codes = _words_to_nibbles(t["qweight"].T, _IDENTITY)                     # (N, K // 8) words along K
        zeros = (_words_to_nibbles(t["qzeros"], _IDENTITY).to(torch.int16) + 1).T
        group = t["g_idx"].long() if fmt.has_g_idx else None
        return codes, t["scales"].T, zeros, group
    blocks = t["data"].reshape(N, K // 32, GGUF_BLOCK_BYTES[p])
    d = blocks[:, :, :2].contiguous().view(torch.float16).reshape(N, K // 32)  # little-endian fp16
    qs = blocks[:, :, 2:]
    if p is Packing.GGUF_Q4_0:
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(N, K)
    else:
        codes = qs.contiguous().view(torch.int8).reshape(N, K).to(torch.int16)
    return codes, d, None, None


def pack_words(codes: torch.Tensor, bits: int, interleave: int) -> torch.Tensor:
    """``portakern.ir.gemv_layout.pack_internal`` with torch ops: unsigned codes ``(N, K)`` -> int32 ``(KWP, NP)``."""
    N, K = codes.shape
    epw = 32 // bits
    kwp, np_ = padded_rows(K, bits), padded_columns(N)
    padded = torch.zeros((np_, kwp * epw), dtype=torch.uint8, device=codes.device)
    padded[:N, :K] = codes
    v = padded.reshape(np_, kwp // interleave, epw, interleave).transpose(2, 3).reshape(np_, kwp, epw)
    words = torch.zeros((np_, kwp), dtype=torch.int64, device=codes.device)
    for e in range(epw):
        words |= v[:, :, e].to(torch.int64) << (bits * e)
    return _to_int32(words.T)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same 32 bits, contiguous."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()


def pack_fragments(codes: torch.Tensor, n_align: int = N_ALIGN_WORDS) -> torch.Tensor:
    """``portakern.ir.gemv_layout.pack_fragments`` with torch ops: 4-bit codes ``(N, K)`` -> int32
    ``(KC, NP / 16, 256)``, on ``codes``' device.

    The inverse of ``unpack_fragments``: the zero-padded codes are viewed as ``(u, rb, g, c, h, t, ph, pl, cb,
    half)`` (row ``16 u + 8 rb + g``, column ``128 c + 64 h + 16 t + 4 (2 ph + pl) + 2 cb + half``), permuted into
    word order in one copy, and each pair of nibbles ``pl = 0, 1`` joined into a byte; the bytes read as
    little-endian int32 are the words. No index tensor, so no host copy."""
    N, K = codes.shape
    np_ = -(-N // n_align) * n_align
    kc = -(-K // FRAG_CHUNK)
    padded = torch.zeros((np_, kc * FRAG_CHUNK), dtype=torch.uint8, device=codes.device)
    padded[:N, :K] = codes
    # (u0, rb1, g2, c3, h4, t5, ph6, pl7, cb8, half9) -> (c, u, h, g, t, cb, rb, half, ph, pl)
    nib = padded.reshape(np_ // 16, 2, 8, kc, 2, 4, 2, 2, 2, 2).permute(3, 0, 4, 2, 5, 8, 1, 9, 6, 7)
    b = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()                 # (c, u, h, g, t, cb, rb, half, ph)
    return b.reshape(kc, np_ // 16, 1024).view(torch.int32)


def unpack_fragments(words: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """``portakern.ir.gemv_layout.unpack_fragments`` with torch ops, on ``words``' device: int32 fragment words
    ``(KC, U, 256)`` -> uint8 codes ``(N, K)`` (``N <= 16 U``, ``K <= 128 KC``). ``words`` may be a slice of whole
    16-row units (``frag[:, u0:u1]``) whose last dimension is contiguous.

    Only views, shifts and one permuting copy, with no index tensor: word ``(c, u, 128 h + 16 g + 4 t + 2 cb + rb)``
    holds, in byte ``2 half + p // 2`` (little-endian int32) at nibble ``p % 2``, the code of row ``16 u + 8 rb + g``
    and column ``128 c + 64 h + 16 t + 4 p + 2 cb + half`` (``_frag_index`` worked out: ``_frag_kcol`` of MMA k
    position ``2 (4 cb + t) + half`` is ``16 t + 4 p + 2 cb + half``). So nothing is copied from the host and the
    function can run inside CUDA stream capture."""
    kc, nu = int(words.shape[0]), int(words.shape[1])
    b = words.view(torch.uint8).reshape(kc, nu, 2, 8, 4, 2, 2, 2, 2)   # (c, u, h, g, t, cb, rb, half, p // 2)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1)                        # (..., half, p // 2, p % 2)
    # (c0, u1, h2, g3, t4, cb5, rb6, half7, ph8, pl9) -> (u, rb, g, c, h, t, p, cb, half)
    codes = nib.permute(1, 6, 3, 0, 2, 4, 8, 9, 5, 7).reshape(nu * 16, kc * FRAG_CHUNK)
    return codes[:N, :K]


def by_group(a: torch.Tensor, N: int, dtype) -> torch.Tensor:
    """``(N, G)`` -> ``(G, NP)`` in ``dtype``; columns past N repeat column 0 (finite, never stored)."""
    out = torch.empty((a.shape[1], padded_columns(N)), dtype=dtype, device=a.device)
    out[:, :N] = a.T.to(dtype)
    out[:, N:] = out[:, :1]
    return out


__all__ = ["PACKINGS", "by_group", "pack_fragments", "pack_words", "unpack", "unpack_fragments"]
