"""The launcher of one quantized GEMV kernel for one op and weight layout: its constexprs, grid and split-K
workspace (``Launcher``), and the compile-time arguments a launch passes (``constexprs``, shared with AOT lowering).

CUDA-graph contract: a launcher is built on the first call of a signature (with, for split-K, its fp32 workspace
and arrival counters, which the kernel resets itself; one set per CUDA stream, made on the stream's first call:
``stream_workspace``); every later call on a stream launches one kernel with no allocation, no host
synchronisation and no tensor created on the host (except for an x view whose rows lie 2^31 or more elements
apart, past the kernels' 32-bit offsets: it is copied each call).
"""

from __future__ import annotations

from portakern.errors import UnsupportedError
from portakern.gemv_weight import PreparedGemvWeight
from portakern.ir.dtypes import DType
from portakern.ir.ops import QuantGemv
from portakern.stream_workspace import StreamWorkspace, stream_index

from ..common.launch import KERNEL_OPTIONS, KernelLaunch
from .checks import max_row_stride, raise_out_stride
from .config import GemvConfig, block_m, split_merge


class Launcher:
    """One kernel, its constexprs, grid and (split-K) workspace, for one op and weight layout."""

    def __init__(self, op: QuantGemv, layout, cfg: GemvConfig, interpret: bool, tdev: str,
                 num_sms: int = 132):
        import torch

        self.cfg = cfg
        check_prologue(op, cfg)
        if cfg.kind == "stream":   # its own launcher (stream.py)
            from .stream import Launcher as StreamLauncher

            self.kind, self.stream = cfg.kind, StreamLauncher(op, layout, cfg, num_sms, tdev)
            return
        self.fn = kernel_fn(cfg)
        self.kind = cfg.kind
        self.consts = constexprs(op, layout, cfg, interpret)
        bm = self.consts["BM"]
        tiles_m = -(-op.M // bm)
        tiles_n = -(-op.N // cfg.block_n)
        self.grid = (tiles_n, cfg.split_k, tiles_m)
        self.ksw = slice_words(layout.KWP, cfg)
        self.opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **KERNEL_OPTIONS)
        if cfg.pdl:
            self.opts["launch_pdl"] = True
        # split-K partials and arrival counters (the kernel's last slice resets its counter after each use) and
        # the silu_mul prologue's per-program scratch rows: one set per stream, made on its first call there
        glu = self.consts.get("GLU") == 2
        self.glu_len = self.ksw * layout.codes_per_word if glu else 0

        def make():
            ws = lock = scratch = None
            if cfg.split_k > 1:
                ws = torch.empty((cfg.split_k, tiles_m * bm, op.N), dtype=torch.float32, device=tdev)
                lock = torch.zeros((tiles_m * tiles_n,), dtype=torch.int32, device=tdev)
            if glu:
                scratch = torch.empty((glu_scratch_values(op, layout, cfg),), dtype=torch.float32, device=tdev)
            return ws, lock, scratch

        self.buffers = StreamWorkspace(make, stream_index(tdev)) if cfg.split_k > 1 or glu else None
        self.dims = (op.M, op.N, op.K, layout.KWP, layout.stride_qk)
        # the largest row strides whose last element the kernels' 32-bit offsets still reach
        self.x_stride_max = max_row_stride(op.M, op.x_columns)
        self.out_stride_max = max_row_stride(op.M, op.N)
        self.mask_rt = (1 << layout.bits) - 1
        if self.kind == "frag":   # chunks, chunks per slice, word strides of a unit and of a chunk
            kc, nu = int(layout.frag.shape[0]), int(layout.frag.shape[1])
            self.frag_dims = (kc, -(-kc // cfg.split_k), 256, nu * 256)
            self.opts.pop("num_stages", None)
        self.launch = KernelLaunch(self.fn, self.grid, self.consts, self.opts, interpret)

    def __call__(self, x, w: PreparedGemvWeight, out) -> None:
        if self.kind == "stream":
            return self.stream(x, w, out)
        M, N, K, KWP, sqk = self.dims
        sx, so = x.stride(0), out.stride(0)
        if sx > self.x_stride_max:   # a view whose rows lie 2^31 elements apart: its contiguous copy fits
            x = x.contiguous()
            sx = x.stride(0)
        if so > self.out_stride_max:
            raise_out_stride(M, so)
        ws = lock = glu = None
        if self.buffers is not None:
            ws, lock, glu = self.buffers.get()
        ws = out if ws is None else ws
        words = w.frag if w.qweight is None else w.qweight   # an int32 stand-in for unused pointer arguments
        lock = words if lock is None else lock
        z = zero_table(w)
        perm = words if w.perm is None else w.perm
        launch = self.launch
        if self.kind == "frag":
            kc, kcs, su, sc = self.frag_dims
            launch(x, w.frag, w.scales, z, out, ws, lock, M, N, K, kc, sqk, sx, so, kcs, su, sc)
        elif self.kind == "mma":
            launch(x, w.qweight, w.scales, z, out, ws, lock, M, N, K, KWP, sqk, sx, so, self.ksw)
        elif self.kind == "fma":
            kg = w.qweight if w.kgroup is None else w.kgroup
            glu = ws if glu is None else glu
            launch(x, w.qweight, w.scales, z, perm, kg, out, ws, lock, M, N, K, KWP, sqk,
                   sx, so, self.ksw, self.mask_rt, glu, self.glu_len)
        else:
            launch(x, w.qweight, w.scales, z, perm, out, ws, lock, M, N, K, KWP, sqk,
                   sx, so, self.ksw, self.mask_rt)


def zero_table(w: PreparedGemvWeight):
    """What the kernels read through ``z_ptr``: the float minimums of a K-quant weight (``MINS``), else the zero
    points, else (symmetric: never read) the scales as a stand-in pointer."""
    if w.mins is not None:
        return w.mins
    return w.scales if w.zeros is None else w.zeros


def slice_words(kwp: int, cfg: GemvConfig) -> int:
    """Word rows per split-K slice: whole tiles."""
    tiles = -(-kwp // cfg.block_kw)
    return -(-tiles // cfg.split_k) * cfg.block_kw


def kernel_fn(cfg: GemvConfig):
    """The ``@triton.jit`` kernel of ``cfg.kind``, in this process's Triton flavour."""
    from .. import kernels

    if cfg.kind == "frag":
        return kernels.load("gemv_frag").gemv_frag_kernel
    if cfg.kind == "stream":
        return kernels.load("gemv_stream").gemv_stream_kernel
    if cfg.kind == "mma":
        return kernels.load("gemv_mma").gemv_mma_kernel
    mod = kernels.load("gemv_quant")
    return mod.gemv_fma_kernel if cfg.kind == "fma" else mod.gemv_dot_kernel


#: The silu_mul prologue formed once per program (GLU mode 2) needs one fp32 scratch row per program; above this
#: many bytes the kernel forms it per tile instead (mode 1)
GLU_SCRATCH_MAX_BYTES = 64 << 20


def glu_mode(op: QuantGemv, layout, cfg: GemvConfig) -> int:
    """The CUDA-core kernel's ``GLU`` constexpr for ``op``: 0 no prologue; 2 ``silu(gate) * up`` formed once per
    program into a scratch row (one row of x per program, no act-order permutation, whole interleave blocks per
    tile, and a scratch of at most ``GLU_SCRATCH_MAX_BYTES``); 1 formed by every thread for the x it holds."""
    if op.prologue != "silu_mul":
        return 0
    staged = (block_m(cfg.kind, op.M) == 1 and not layout.has_perm and layout.kgroup is None
              and cfg.block_kw >= layout.interleave and glu_scratch_values(op, layout, cfg) * 4 <= GLU_SCRATCH_MAX_BYTES)
    return 2 if staged else 1


def glu_scratch_values(op: QuantGemv, layout, cfg: GemvConfig) -> int:
    """fp32 values of the GLU scratch: one row of ``K_SPLIT_W * EPW`` per program of the grid."""
    programs = -(-op.N // cfg.block_n) * cfg.split_k * op.M
    return programs * slice_words(layout.KWP, cfg) * layout.codes_per_word


def check_prologue(op: QuantGemv, cfg: GemvConfig) -> None:
    """Raise when ``op`` has an x prologue and ``cfg`` names a kernel that does not read x through one."""
    if op.prologue is not None and cfg.kind != "fma":
        raise UnsupportedError(f"GemvConfig(kind={cfg.kind!r}) has no x prologue; the {op.prologue!r} prologue runs "
                               f"on the CUDA-core kernel: use kind='fma' (the table chooses it for such ops)")


def constexprs(op: QuantGemv, layout, cfg: GemvConfig, interpret: bool = False) -> dict:
    """The constexpr arguments a launch of ``cfg`` passes (shared by launches and AOT lowering).
    ``interpret``: Triton's CPU interpreter (which computes bf16 wrongly and runs no PTX)."""
    even_k = layout.KWP * layout.codes_per_word == op.K
    f32 = op.dtype is DType.float32 or (interpret and op.dtype is DType.bfloat16)
    mins = getattr(layout, "has_mins", False)   # GGUF Q4_K / Q5_K: z_ptr holds float minimums (fma and dot only)
    if cfg.kind == "stream":
        raise ValueError("constexprs(kind='stream'): the stream kernel's constexprs depend on the grid; "
                         "use stream.constexprs")
    if cfg.kind == "frag":
        return dict(BM=block_m(cfg.kind, op.M), W=cfg.num_warps, NT=cfg.block_n // (16 * cfg.num_warps),
                    GS=layout.group_size, HAS_Z=layout.has_z, ZP=layout.zero_point, SPLIT_K=cfg.split_k,
                    PDL=cfg.pdl, MODE=0, MERGE=split_merge("frag", op.N, op.K))
    if cfg.kind == "mma":
        return dict(GS=layout.group_size, ZP=layout.zero_point, HAS_Z=layout.has_z, BM=block_m(cfg.kind, op.M),
                    BN=cfg.block_n, BKW=cfg.block_kw, SPLIT_K=cfg.split_k, EVEN_K=even_k, IW=layout.interleave,
                    ASM=not interpret, COMPUTE_F32=f32, PDL=cfg.pdl, X_RUNS=cfg.x_runs)
    c = dict(BITS=layout.bits, GS=layout.group_size, ZP=layout.zero_point, HAS_Z=layout.has_z or mins,
             HAS_PERM=layout.has_perm, BM=block_m(cfg.kind, op.M), BN=cfg.block_n,
             BKW=cfg.block_kw, SPLIT_K=cfg.split_k, DQ=cfg.dq, EVEN_K=even_k, PDL=cfg.pdl, IW=layout.interleave,
             MINS=mins)
    if cfg.kind == "fma":
        c.update(PER_ELEM_GROUP=layout.per_elem_group, HAS_KG=layout.kgroup is not None, PIPE=cfg.num_stages,
                 PREFETCH=cfg.prefetch, GROUP_ROWS=cfg.group_rows, NMASK=layout.stride_qk % cfg.block_n != 0,
                 GLU=glu_mode(op, layout, cfg), MERGE=0 if interpret else split_merge("fma", op.N, op.K))
    else:
        c.update(COMPUTE_F32=f32, SWAP_AB=cfg.swap_ab)
    return c
