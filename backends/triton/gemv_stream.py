"""Host side of the stream-K TMA GEMV (``kernels/gemv_stream.py``): who it serves, its descriptors, launch.

``blocker(op, layout, arch)`` names why an op or prepared weight cannot run on it (None: it can);
``Launcher`` holds the descriptors' layouts, the constexprs, the grid and the workspace of one
signature and launches the kernel; ``compile_for_target`` lowers it without a GPU.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

#: the architectures whose TMA and mbarriers the kernel uses
ARCHS = ("sm_90", "sm_100")
#: shared memory a program may take (H200: 227 KiB per block), less the compiler's reduction scratch
SMEM_BUDGET = 227 * 1024 - 8 * 1024
#: the largest column tile a single TMA box covers (256 elements)
MAX_BLOCK_N = 256


def smem_bytes(K: int, group_size: int, block_n: int, stages: int, warp_rows: int, scale_bytes: int,
               has_z: bool) -> int:
    """Shared memory of one program: the ring (words, scales, zeros per stage), x and its sums."""
    tr = group_size // 8
    per_stage = tr * block_n * 4 + block_n * scale_bytes * 2   # the zeros' slot exists either way
    gp = 1 << (K // group_size - 1).bit_length()     # x is staged for a power of two of groups
    return stages * per_stage + gp * group_size * 4 + gp * tr * 4 + stages * 8


def blocker(op, layout, arch: str, block_n: int = 256, stages: int = 4, warp_rows: int = 4) -> str | None:
    """Why ``op`` with prepared weight ``layout`` cannot run on the stream-K kernel (None: it can)."""
    f = op.fmt
    if arch not in ARCHS:
        return f"needs TMA (sm_90 or sm_100), not {arch}"
    if op.M != 1:
        return f"serves M = 1, not M = {op.M}"
    if op.dtype.value not in ("bfloat16", "float16"):
        return f"serves bfloat16 / float16 x, not {op.dtype.value}"
    if f.bits != 4:
        return f"serves int4 weights, not {f.bits} bits"
    if layout.has_perm or layout.kgroup is not None:
        return "serves weights without act-order (g_idx)"
    if f.group_size % 64 or (f.group_size // 8) % warp_rows:
        return f"needs groups of a multiple of 64 columns split over {warp_rows} warp rows, not {f.group_size}"
    if layout.interleave not in (1, 2, 4, 8):
        return f"needs an interleave of 1, 2, 4 or 8 word rows, not {layout.interleave}"
    if op.K % f.group_size or layout.KWP * 8 != op.K:
        return f"needs K a multiple of {8 * 64} (whole word-row tiles), not {op.K}"
    if block_n > MAX_BLOCK_N or block_n % 128:
        return f"block_n must be 128 or 256, not {block_n}"
    sb = 2
    need = smem_bytes(op.K, f.group_size, block_n, stages, warp_rows, sb, layout.has_z)
    if need > SMEM_BUDGET:
        return f"K = {op.K} needs {need} bytes of shared memory with {stages} stages (budget {SMEM_BUDGET})"
    return None


@lru_cache(maxsize=None)
def _layouts(tr: int, block_n: int, sdt: str):
    """Shared-memory layouts of the word tile and the scale row (unswizzled: rows read as 16-byte runs)."""
    from triton.experimental.gluon import language as gl

    w = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    s = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    return w, s


def descriptors(w, block_n: int):
    """Host TMA descriptors of ``w`` (``PreparedGemvWeight``): words ``(TR, block_n)`` per unit, scales and
    zeros ``(1, block_n)``; the zeros' descriptor is the scales' for symmetric weights."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tr = w.group_size // 8
    lw, ls = _layouts(tr, block_n, str(w.scales.dtype))
    qw, s = w.qweight, w.scales
    wd = TensorDescriptor(qw, list(qw.shape), [qw.stride(0), 1], [tr, block_n], lw)
    sd = TensorDescriptor(s, list(s.shape), [s.stride(0), 1], [1, block_n], ls)
    zd = sd if w.zeros is None else TensorDescriptor(w.zeros, list(w.zeros.shape), [w.zeros.stride(0), 1],
                                                      [1, block_n], ls)
    return wd, sd, zd


def constexprs(op, layout, block_n: int, stages: int, warps: int, warp_rows: int) -> dict[str, Any]:
    """The compile-time arguments of ``gemv_stream_kernel``."""
    tr = op.fmt.group_size // 8
    g = op.K // op.fmt.group_size
    return dict(G=g, GP=1 << (g - 1).bit_length(), TR=tr, BN=block_n, WR=warp_rows, WC=warps // warp_rows,
                STAGES=stages, IW=layout.interleave, ZP=layout.zero_point, HAS_Z=layout.has_z)


class Launcher:
    """The stream-K kernel for one op and weight layout: one program per SM, its workspace and counters."""

    def __init__(self, op, layout, block_n: int, stages: int, warps: int, warp_rows: int, programs: int,
                 tdev: str, mode: int = 0):
        import torch

        from . import kernels

        self.fn = kernels.load("gemv_stream").gemv_stream_kernel
        self.block_n, self.warps = block_n, warps
        self.consts = constexprs(op, layout, block_n, stages, warps, warp_rows)
        if mode:
            self.consts["MODE"] = mode   # measurement variants (kernel docstring)
        self.n_tiles = -(-op.N // block_n)
        self.programs = min(programs, self.n_tiles * self.consts["G"])
        self.N = op.N
        self.ws = torch.empty((self.programs * 2, block_n), dtype=torch.float32, device=tdev)
        self.cnt = torch.zeros((self.n_tiles,), dtype=torch.int32, device=tdev)
        self._desc: dict[int, tuple] = {}

    def __call__(self, x, w, out) -> None:
        d = self._desc.get(id(w))
        if d is None or d[0] is not w:
            d = self._desc[id(w)] = (w, *descriptors(w, self.block_n))
        self.fn[(self.programs,)](x, d[1], d[2], d[3], out, self.ws, self.cnt, self.N, self.n_tiles,
                                  **self.consts, num_warps=self.warps)
