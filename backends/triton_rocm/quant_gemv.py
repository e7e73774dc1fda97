"""The triton-rocm quantized GEMV lowering: ``supports``, ``prepare_weight``, ``compile``, ``compile_for_target``.

Every packing is repacked once into the core's GEMV layout (``portakern.gemv_weight``, shared with the triton
backend: ``weight_layout``), so two kernel bodies of the triton backend's ``kernels/gemv_quant.py`` serve every
format: ``gemv_fma_kernel`` (FMAs on the vector ALUs; M up to ``tuning.FMA_MAX_M``, per-element groups and the
``silu_mul`` x prologue) and ``gemv_dot_kernel`` (``tl.dot`` over 16-row tiles of x: MFMA on CDNA). GGUF Q4_K and
Q5_K run on both with their float minimum per group (``PreparedGemvWeight.mins``, the kernels' ``MINS`` constexpr),
Q6_K as 8-bit codes with zero point 32 (``portakern.gemv_kquants``), as on the triton backend. The NVIDIA
tables' other kernels are never chosen here: "mma" dequantizes with inline PTX, "frag" and "stream" are Gluon
kernels written for NVIDIA's MMA layouts and programmatic dependent launch.

A split-K launch keeps fp32 partials and arrival counters (which the kernel resets itself), one set per stream,
made on the stream's first call (``portakern.stream_workspace``); later calls allocate nothing.
"""

from __future__ import annotations

import threading

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.gemv_weight import PreparedGemvWeight
from portakern.ir.dtypes import DType
from portakern.ir.gguf_kquants import gemv_bits, prepared_scale_dtype
from portakern.ir.ops import QuantGemv

from .common import plan as plans
from .common.launch import Launch, compile_options

#: The kernels compute element offsets into x and the output as 32-bit integers.
MAX_OFFSET = 2**31 - 1


def supports(op: QuantGemv, device: Device) -> Support:
    """4- and 8-bit codes of every packing (GGUF Q5_K and Q6_K held as 8-bit codes: ``gemv_bits``), fp16 / bf16 /
    fp32 activations, any N and K, M while x and the output each hold at most 2^31 elements."""
    if gemv_bits(op.fmt) not in (4, 8):
        return no(f"quant_gemv(bits={op.fmt.bits}) is not supported by triton-rocm: bits must be 4 or 8")
    if op.dtype not in (DType.float16, DType.bfloat16, DType.float32):
        return no(f"quant_gemv(dtype={op.dtype.value}) is not supported by triton-rocm: use float16, bfloat16 or "
                  f"float32 activations")
    widest = max(op.x_columns, op.N)
    if op.M * widest > MAX_OFFSET + 1:
        return no(f"quant_gemv(M={op.M}) with x of {op.x_columns} and an output of {op.N} columns is not supported "
                  f"by triton-rocm: x and the output must hold at most 2^31 elements each (the kernels' 32-bit "
                  f"offsets); split M into chunks of at most {(MAX_OFFSET + 1) // widest} rows")
    if device.type == "cpu":
        from . import kernels

        if not kernels.interpreted():
            return no("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                      "quant_gemv here; set TRITON_INTERPRET=1 before the first import of triton")
    return YES


def prepare_weight(weight, device: Device) -> PreparedGemvWeight:
    """``weight`` repacked once into the GEMV layout on ``device`` (no fragment copy: no kernel here reads it)."""
    from portakern.gemv_weight import prepare_gemv_weight, wants_fragments

    return prepare_gemv_weight(weight, device, fragments=wants_fragments(device))


def constexprs(op: QuantGemv, layout, plan: plans.GemvPlan, interpret: bool) -> dict:
    """The compile-time arguments of the plan's kernel (shared by launches and lowering)."""
    even_k = layout.KWP * layout.codes_per_word == op.K
    mins = layout.has_mins   # GGUF Q4_K / Q5_K: z_ptr holds the float minimums (the kernels' MINS)
    c = dict(BITS=layout.bits, GS=layout.group_size, ZP=layout.zero_point, HAS_Z=layout.has_z or mins,
             HAS_PERM=layout.has_perm, BM=plans.block_m(plan.kind, op.M), BN=plan.block_n, BKW=plan.block_kw,
             SPLIT_K=plan.split_k, DQ=plan.dq, EVEN_K=even_k, PDL=False, IW=layout.interleave, MINS=mins)
    if plan.kind == "fma":
        c.update(PER_ELEM_GROUP=layout.per_elem_group, HAS_KG=layout.kgroup is not None, PIPE=plan.num_stages,
                 PREFETCH=1, GROUP_ROWS=False, NMASK=layout.stride_qk % plan.block_n != 0,
                 GLU=1 if op.prologue == "silu_mul" else 0, MERGE=0)
    else:
        f32 = op.dtype is DType.float32 or (interpret and op.dtype is DType.bfloat16)
        c.update(COMPUTE_F32=f32, SWAP_AB=False)
    return c


def kernel_fn(kind: str):
    """The ``@triton.jit`` kernel of ``kind`` in this process's flavour."""
    from . import kernels

    mod = kernels.load("gemv_quant")
    return mod.gemv_fma_kernel if kind == "fma" else mod.gemv_dot_kernel


def compile(op: QuantGemv, device: Device):
    """The kernel ``kernel(x, prepared, out)`` for ``op`` on ``device``: one launcher per weight layout, built on
    the layout's first call (the table's plan)."""
    op.verify()
    target = plans.target_of(device)
    interpret = device.type == "cpu"
    tdev = "cpu" if interpret else f"cuda:{device.index}"   # torch names HIP devices "cuda"
    cus = plans.compute_units(device, target) if not interpret else None
    launchers: dict[tuple, _Launcher] = {}
    lock = threading.Lock()

    def kernel(x, w: PreparedGemvWeight, out) -> None:
        key = w.key()
        ln = launchers.get(key)
        if ln is None:
            with lock:
                ln = launchers.get(key)
                if ln is None:
                    check_weight(op, w, tdev)
                    plan = plans.gemv(w, op.M, op.N, target, cus, op.prologue)
                    ln = launchers[key] = _Launcher(op, w, plan, interpret, tdev)
        ln(x, w, out)

    kernel.__name__ = f"triton_rocm_quant_gemv_{op.content_hash()}"
    kernel.launchers = launchers
    return kernel


class _Launcher:
    """One kernel for one op and weight layout: its constexprs, grid and split-K workspace."""

    def __init__(self, op: QuantGemv, w, plan: plans.GemvPlan, interpret: bool, tdev: str):
        import torch

        from portakern.stream_workspace import StreamWorkspace, stream_index

        self.kind, self.plan = plan.kind, plan
        consts = constexprs(op, w, plan, interpret)
        bm = consts["BM"]
        tiles_m, tiles_n = -(-op.M // bm), -(-op.N // plan.block_n)
        tiles = -(-w.KWP // plan.block_kw)
        self.ksw = -(-tiles // plan.split_k) * plan.block_kw
        self.dims = (op.M, op.N, op.K, w.KWP, w.stride_qk)
        self.mask_rt = (1 << w.bits) - 1
        self.x_rows_max = _max_row_stride(op.M, op.x_columns)
        self.out_rows_max = _max_row_stride(op.M, op.N)
        self.buffers = None
        if plan.split_k > 1:
            def make():
                return (torch.empty((plan.split_k, tiles_m * bm, op.N), dtype=torch.float32, device=tdev),
                        torch.zeros((tiles_m * tiles_n,), dtype=torch.int32, device=tdev))

            self.buffers = StreamWorkspace(make, stream_index(tdev))
        self.launch = Launch(kernel_fn(plan.kind), (tiles_n, plan.split_k, tiles_m), consts,
                             compile_options(plan.num_warps, plan.num_stages, plan.hip), interpret)

    def __call__(self, x, w: PreparedGemvWeight, out) -> None:
        M, N, K, KWP, sqk = self.dims
        if x.stride(0) > self.x_rows_max:   # a view whose rows lie 2^31 elements apart: its contiguous copy fits
            x = x.contiguous()
        if out.stride(0) > self.out_rows_max:
            raise InvalidInputError(f"out has row stride {out.stride(0)}: its {M} rows span past the 2^31 elements "
                                    f"the kernels' 32-bit offsets reach; pass a contiguous out and copy it into "
                                    f"the view")
        ws, lock = self.buffers.get() if self.buffers is not None else (out, w.qweight)
        z = w.mins if w.mins is not None else (w.scales if w.zeros is None else w.zeros)
        perm = w.qweight if w.perm is None else w.perm
        if self.kind == "fma":
            kg = w.qweight if w.kgroup is None else w.kgroup
            self.launch(x, w.qweight, w.scales, z, perm, kg, out, ws, lock, M, N, K, KWP, sqk,
                        x.stride(0), out.stride(0), self.ksw, self.mask_rt, ws, 0)
        else:
            self.launch(x, w.qweight, w.scales, z, perm, out, ws, lock, M, N, K, KWP, sqk,
                        x.stride(0), out.stride(0), self.ksw, self.mask_rt)


def _max_row_stride(rows: int, cols: int) -> int:
    """The largest row stride whose last element the 32-bit offsets still reach (one row: any)."""
    return 1 << 62 if rows <= 1 else (MAX_OFFSET - cols + 1) // (rows - 1)


def check_weight(op: QuantGemv, w: PreparedGemvWeight, tdev: str) -> None:
    """Raise unless ``w`` is a word-layout weight of ``op`` on ``tdev``."""
    f = op.fmt
    for what, got, want in (("(N, K)", (w.N, w.K), (op.N, op.K)), ("bits", w.bits, gemv_bits(f)),
                            ("group_size", w.group_size, f.group_size)):
        if got != want:
            raise InvalidInputError(f"prepared weight has {what} = {got} but this quant_gemv op was compiled for "
                                    f"{want}; prepare the weight of this op, or compile the op of this weight")
    if w.qweight is None:
        raise InvalidInputError("prepared weight holds its codes only in the fragment layout, which no triton-rocm "
                                "kernel reads; prepare it with the default layout (prepare_weight(weight, device))")
    for name, t in w.tensors().items():
        if str(t.device) != tdev:
            raise InvalidTypeError(f"prepared weight's {name} is on {t.device} but this quant_gemv kernel was "
                                   f"compiled for {tdev}; prepare the weight on {tdev} or compile the op for it")


class LayoutStub:
    """The layout facts a launch depends on, from the op alone (what ``prepare_weight`` builds; no data)."""

    def __init__(self, op: QuantGemv):
        from portakern.ir.gemv_layout import K_ALIGN_WORDS, N_ALIGN_WORDS, interleave_words
        from portakern.ir.quant import Packing

        f = op.fmt
        self.bits, self.group_size, self.N, self.K = gemv_bits(f), f.group_size, op.N, op.K
        self.codes_per_word = 32 // self.bits
        words = -(-op.K // self.codes_per_word)
        self.KWP = -(-words // K_ALIGN_WORDS) * K_ALIGN_WORDS
        self.stride_qk = -(-op.N // N_ALIGN_WORDS) * N_ALIGN_WORDS
        self.has_mins = f.has_mins
        self.has_z, self.has_perm, self.kgroup = not f.symmetric and not f.has_mins, f.has_g_idx, None
        self.zero_point = f.zero_point + ((1 << (f.bits - 1)) if f.packing is Packing.GGUF_Q8_0 else 0)
        self.per_elem_group = self.group_size % self.codes_per_word != 0
        self.interleave = interleave_words(self.bits, self.group_size, False)


def compile_for_target(op: QuantGemv, target: str) -> dict:
    """``op`` lowered for ``target`` ("gfx942", "gfx950") to hsaco with Triton's HIP backend, no GPU needed.
    A ``g_idx`` format is lowered for the regular act-order layout (K permuted, x gathered).

    Returns ``{"target", "config", "kernels": {name: {"hsaco", "amdgcn", "shared", "num_warps", "options"}}}``.
    """
    from dataclasses import asdict

    from .common.hip import POINTER, check_target, compiler_kernel, lower

    check_target(target)
    op.verify()
    lay = LayoutStub(op)
    plan = plans.gemv(lay, op.M, op.N, target, prologue=op.prologue)
    fn = compiler_kernel("gemv_quant", "gemv_fma_kernel" if plan.kind == "fma" else "gemv_dot_kernel")
    consts = constexprs(op, lay, plan, False)
    sdt = POINTER[prepared_scale_dtype(op.fmt).value]
    ptrs = {"x_ptr": POINTER[op.dtype.value], "qw_ptr": "*i32", "s_ptr": sdt, "z_ptr": sdt, "perm_ptr": "*i32",
            "kg_ptr": "*i32", "out_ptr": POINTER[op.result_dtype.value], "ws_ptr": "*fp32", "lock_ptr": "*i32",
            "glu_ptr": "*fp32"}
    aligned = set(ptrs) | {"KWP", "stride_qk", "K_SPLIT_W"}
    aligned |= {"stride_xm"} if op.K % 16 == 0 else set()
    aligned |= {"stride_om"} if op.N % 16 == 0 else set()
    art = lower(fn, target, ptrs, consts, aligned, plan.num_warps, plan.num_stages, plan.hip)
    return {"target": target, "config": asdict(plan), "kernels": {fn.__name__: art}}
