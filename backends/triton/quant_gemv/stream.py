"""Host side of the stream-K int4 GEMV (``kernels/gemv_stream.py``, kind "stream"): who it serves, its
compile-time arguments, its launch.

``usable(layout, M, dtype)`` names why a prepared weight and op cannot run on it (None: it can);
``Launcher`` holds the constexprs, the grid and the split-K workspace of one signature and launches
the kernel (``launcher.Launcher`` builds one per signature; the benchmarks build their own variants).
"""

from __future__ import annotations

from typing import Any

#: warps along the word rows of a unit (each thread holds ``group_size / 8 / WARP_ROWS`` rows)
WARP_ROWS = 4
#: shared memory a program may take on sm_80 and later (the smallest per-block limit, sm_86/89: 99 KiB)
SMEM_BUDGET = 99 * 1024


def x_slots(groups: int, units: int, programs: int) -> tuple[int, bool]:
    """``(XS, BY_UNIT)`` of ``gemv_stream_kernel``: x is staged per unit of a program's range when the range
    (at most ``ceil(units / programs)`` units) is shorter than K's groups, else per group; XS is the
    slot count rounded up to a power of two."""
    most = -(-units // programs)
    by_unit = most < groups
    n = most if by_unit else groups
    return 1 << (n - 1).bit_length(), by_unit


def smem_bytes(group_size: int, slots: int) -> int:
    """Shared memory of one program: x (fp32) and its per-row sums for ``slots`` groups."""
    return slots * group_size * 4 + slots * (group_size // 8) * 4


def usable(layout, M: int, dtype: str | None = None) -> str | None:
    """Why the stream-K kernel cannot serve ``layout`` (a ``PreparedGemvWeight`` or its stand-in) at ``M``
    rows of ``dtype`` x, or None if it can. ``dtype`` None accepts any activation dtype."""
    if M != 1:
        return f"M={M} (the kernel serves one row of x)"
    if layout.bits != 4:
        return f"bits={layout.bits} (int4 only)"
    if getattr(layout, "has_mins", False):
        return "a float minimum per group (GGUF Q4_K; the 'fma' and 'dot' kernels subtract it)"
    if layout.has_perm or getattr(layout, "kgroup", None) is not None:
        return "an act-order permutation (x is staged in the words' plain order)"
    gs = layout.group_size
    if gs % (8 * WARP_ROWS) or layout.K % gs:
        return f"group_size={gs} with K={layout.K} (needs groups of a multiple of 32 columns dividing K)"
    need = smem_bytes(gs, 1 << (layout.K // gs - 1).bit_length())
    if need > SMEM_BUDGET:
        return f"K={layout.K} (x of every group takes {need} bytes of shared memory, over {SMEM_BUDGET})"
    if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
        return f"dtype={dtype}"
    return None


def constexprs(op, layout, cfg, programs: int, mode: int = 0) -> dict[str, Any]:
    """The compile-time arguments of ``gemv_stream_kernel`` for ``cfg`` (a fitted ``GemvConfig`` of kind
    "stream") over a grid of ``programs``; ``mode`` selects a measurement variant (kernel docstring)."""
    g = op.K // layout.group_size
    xs, by_unit = x_slots(g, -(-op.N // cfg.block_n) * g, programs)
    return dict(G=g, XS=xs, BY_UNIT=by_unit, TR=layout.group_size // 8, BN=cfg.block_n, WR=WARP_ROWS,
                WC=cfg.num_warps // WARP_ROWS, AHEAD=cfg.prefetch, IW=layout.interleave, ZP=layout.zero_point,
                HAS_Z=layout.has_z, PDL=cfg.pdl, L2_AHEAD=cfg.l2_prefetch, MODE=mode)


def grid_programs(op, layout, cfg, num_sms: int, programs: int | None = None) -> int:
    """Programs of the launch: ``programs`` if given, else ``per_sm`` per SM; at most one per unit (every
    program owns a unit: a tile's arrival count counts the programs whose ranges meet it)."""
    units = -(-op.N // cfg.block_n) * (op.K // layout.group_size)
    return min(programs or cfg.per_sm * num_sms, units)


class Launcher:
    """The stream-K kernel for one op and weight layout, its split-K workspace (two partials of
    ``block_n`` per program) and arrival counters (one per column tile, reset by the kernel), one set
    per CUDA stream (``stream_workspace``).
    ``programs`` (tests, measurements) overrides the grid; it is capped at the units."""

    def __init__(self, op, layout, cfg, num_sms: int, tdev: str, mode: int = 0, programs: int | None = None):
        import torch

        from portakern.stream_workspace import StreamWorkspace, stream_index

        from .. import kernels
        from ..common.launch import KERNEL_OPTIONS, KernelLaunch

        self.fn = kernels.load("gemv_stream").gemv_stream_kernel
        self.programs = grid_programs(op, layout, cfg, num_sms, programs)
        self.consts = constexprs(op, layout, cfg, self.programs, mode)
        self.opts = dict(num_warps=cfg.num_warps, launch_pdl=cfg.pdl, **KERNEL_OPTIONS)
        self.n_tiles = -(-op.N // cfg.block_n)
        self.N = op.N
        programs, block_n, n_tiles = self.programs, cfg.block_n, self.n_tiles
        self.buffers = StreamWorkspace(
            lambda: (torch.empty((programs * 2, block_n), dtype=torch.float32, device=tdev),
                     torch.zeros((n_tiles,), dtype=torch.int32, device=tdev)),
            stream_index(tdev))
        self.launch = KernelLaunch(self.fn, (self.programs,), self.consts, self.opts)

    def __call__(self, x, w, out) -> None:
        z = w.scales if w.zeros is None else w.zeros
        ws, cnt = self.buffers.get()
        self.launch(x, w.qweight, w.scales, z, out, ws, cnt, self.N, self.n_tiles, w.stride_qk)
