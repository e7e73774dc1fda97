"""Host side of the stream-K TMA GEMV (``kernels/gemv_stream.py``): who it serves, its descriptors, launch.

``blocker(op, layout, arch)`` names why an op or prepared weight cannot run on it (None: it can);
``Launcher`` holds the constexprs, the grid and the workspace of one signature and launches the kernel.
"""

from __future__ import annotations

from typing import Any

#: the architectures with asynchronous copies to shared memory (cp.async)
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")
#: shared memory a program may take (H200: 227 KiB per block), less the compiler's reduction scratch
SMEM_BUDGET = 227 * 1024 - 8 * 1024
#: column tiles: 4 columns per thread, 32 threads, one or two warps along the columns
MAX_BLOCK_N = 256


def smem_bytes(K: int, group_size: int, block_n: int, stages: int, warp_rows: int, scale_bytes: int,
               has_z: bool) -> int:
    """Shared memory of one program: the ring (words, and a row of scales and of zeros per warp row and
    stage), x and its sums."""
    tr = group_size // 8
    per_stage = tr * block_n * 4 + block_n * scale_bytes * warp_rows * (2 if has_z else 1)
    gp = 1 << (K // group_size - 1).bit_length()     # x is staged for a power of two of groups
    return stages * per_stage + gp * group_size * 4 + gp * tr * 4 + stages * 8


def blocker(op, layout, arch: str, block_n: int = 256, stages: int = 4, warp_rows: int = 4) -> str | None:
    """Why ``op`` with prepared weight ``layout`` cannot run on the stream-K kernel (None: it can)."""
    f = op.fmt
    if arch not in ARCHS:
        return f"needs cp.async (sm_80 and later), not {arch}"
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
    need = smem_bytes(op.K, f.group_size, block_n, stages, warp_rows, 2, layout.has_z)
    if need > SMEM_BUDGET:
        return f"K = {op.K} needs {need} bytes of shared memory with {stages} stages (budget {SMEM_BUDGET})"
    return None


def x_slots(groups: int, units: int, programs: int) -> tuple[int, bool]:
    """``(XS, BY_UNIT)`` of ``gemv_stream_kernel``: x is staged per unit of a program's range when the range
    (at most ``ceil(units / programs)`` units) is shorter than K's groups, else per group; XS is the
    slot count rounded up to a power of two."""
    most = -(-units // programs)
    by_unit = most < groups
    n = most if by_unit else groups
    return 1 << (n - 1).bit_length(), by_unit


def constexprs(op, layout, block_n: int, stages: int, warps: int, warp_rows: int, programs: int,
               pdl: bool = False, ring: bool = False, mode: int = 0) -> dict[str, Any]:
    """The compile-time arguments of ``gemv_stream_kernel`` for a grid of ``programs``."""
    tr = op.fmt.group_size // 8
    g = op.K // op.fmt.group_size
    xs, by_unit = x_slots(g, -(-op.N // block_n) * g, programs)
    return dict(G=g, XS=xs, BY_UNIT=by_unit, TR=tr, BN=block_n, WR=warp_rows, WC=warps // warp_rows,
                STAGES=stages, IW=layout.interleave, ZP=layout.zero_point, HAS_Z=layout.has_z, PDL=pdl, RING=ring,
                MODE=mode)


class Launcher:
    """The stream-K kernel for one op and weight layout: one program per SM, its workspace and counters."""

    def __init__(self, op, layout, block_n: int, stages: int, warps: int, warp_rows: int, programs: int,
                 tdev: str, mode: int = 0, pdl: bool = False, ring: bool = False):
        import torch

        from . import kernels

        self.fn = kernels.load("gemv_stream").gemv_stream_kernel
        self.block_n, self.warps = block_n, warps
        self.n_tiles = -(-op.N // block_n)
        self.programs = min(programs, self.n_tiles * (op.K // op.fmt.group_size))
        self.consts = constexprs(op, layout, block_n, stages, warps, warp_rows, self.programs, pdl, ring, mode)
        self.opts = dict(num_warps=warps, launch_pdl=True) if pdl else dict(num_warps=warps)
        self.N = op.N
        self.ws = torch.empty((self.programs * 2, block_n), dtype=torch.float32, device=tdev)
        self.cnt = torch.zeros((self.n_tiles,), dtype=torch.int32, device=tdev)

    def __call__(self, x, w, out) -> None:
        z = w.scales if w.zeros is None else w.zeros
        self.fn[(self.programs,)](x, w.qweight, w.scales, z, out, self.ws, self.cnt, self.N, self.n_tiles,
                                  w.stride_qk, **self.consts, **self.opts)
