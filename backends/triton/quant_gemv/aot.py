"""Lowering the quantized GEMV kernels for a target without the device (``compile_for_target``).

The layout facts a launch depends on come from the op alone (``LayoutStub``: what ``prepare_weight`` would build
on a CUDA device), the configuration from the target family's table, and the signature is specialised as a launch
on 16-byte aligned tensors would be.
"""

from __future__ import annotations

from portakern.errors import UnsupportedError
from portakern.gemv_weight import fragment_kernel_available as frag_kernel_available
from portakern.ir.gemv_layout import K_ALIGN_WORDS, N_ALIGN_WORDS, frag_eligible, interleave_words
from portakern.ir.gguf_kquants import gemv_bits, prepared_scale_dtype
from portakern.ir.ops import QuantGemv
from portakern.ir.quant import Packing

from ..common.arch import arch_family, check_pdl, default_sms
from ..common.launch import KERNEL_OPTIONS
from .config import GemvConfig, choose, fit, frag_usable
from .launcher import check_prologue, constexprs, kernel_fn

TARGETS = {"sm_80": 80, "sm_90a": 90, "sm_100a": 100, "sm_120": 120}


class LayoutStub:
    """The layout facts a launch depends on, derived from the op alone (no weight data)."""

    def __init__(self, op: QuantGemv):
        f = op.fmt
        self.bits, self.group_size, self.N, self.K = gemv_bits(f), f.group_size, op.N, op.K
        self.codes_per_word = 32 // self.bits
        kw = -(-op.K // self.codes_per_word)
        self.KWP = -(-kw // K_ALIGN_WORDS) * K_ALIGN_WORDS
        self.stride_qk = -(-op.N // N_ALIGN_WORDS) * N_ALIGN_WORDS
        self.has_mins = f.has_mins                     # GGUF Q4_K / Q5_K: float minimums, no zero points
        self.has_z = not f.symmetric and not f.has_mins
        self.has_perm = f.has_g_idx
        self.kgroup = None
        self.zero_point = f.zero_point + ((1 << (f.bits - 1)) if f.packing is Packing.GGUF_Q8_0 else 0)
        self.per_elem_group = self.group_size % self.codes_per_word != 0
        self.interleave = interleave_words(self.bits, self.group_size, False)
        # what prepare_weight builds on a CUDA device: a fragment layout for the eligible formats
        eligible = frag_kernel_available() and frag_eligible(self.bits, f.group_size, f.has_g_idx, False) is None
        self.frag = True if eligible else None


def compile_for_target(op: QuantGemv, target: str, config: GemvConfig | None = None) -> dict:
    """Lower ``op`` for ``target`` ("sm_80", "sm_90a", "sm_100a", "sm_120") with Triton, no GPU needed.

    ``config`` forces a launch configuration (as in ``compile``; static instruction counts of a
    variant); by default the target's tuning table chooses.

    Returns ``{"target", "config", "kernels": {name: {"cubin", "ptx", "shared", "num_warps"}}}``.
    A ``g_idx`` format is lowered for the regular act-order layout (K permuted, x gathered).
    """
    try:
        cc = TARGETS[target]
    except KeyError:
        raise UnsupportedError(f"compile_for_target(target={target!r}): the triton backend lowers "
                               f"quant_gemv for {', '.join(sorted(TARGETS))}") from None
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    op.verify()
    arch = arch_family(cc)
    lay = LayoutStub(op)
    if config is not None:
        check_pdl(config, arch)
        cfg = fit(config, lay, op.M)
    else:
        cfg = choose(lay, op.M, op.N, arch, default_sms(arch), dtype=op.dtype.value, cuda_core=op.prologue is not None)
    check_prologue(op, cfg)
    fn = kernel_fn(cfg)
    act = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[op.dtype.value]
    outp = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[op.result_dtype.value]
    sdt = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[prepared_scale_dtype(op.fmt).value]
    ptrs = {"x_ptr": act, "qw_ptr": "*i32", "fw_ptr": "*i32", "s_ptr": sdt, "z_ptr": sdt, "perm_ptr": "*i32",
            "kg_ptr": "*i32", "out_ptr": outp, "ws_ptr": "*fp32", "lock_ptr": "*i32", "cnt_ptr": "*i32",
            "glu_ptr": "*fp32"}
    if cfg.kind == "stream":   # fit refused the weights the kernel cannot serve (config._fit_stream)
        from . import stream

        programs = stream.grid_programs(op, lay, cfg, default_sms(arch))
        return _compile_gluon_for_target(op, target, cc, cfg, fn, stream.constexprs(op, lay, cfg, programs), ptrs,
                                         {"stride_qk"} | ({"N"} if op.N % 16 == 0 else set()))
    consts = constexprs(op, lay, cfg)   # exactly what a launch passes
    if cfg.kind == "frag":
        why = frag_usable(lay, op.M, op.dtype.value)
        if why is not None:
            raise UnsupportedError(f"compile_for_target: GemvConfig(kind='frag') cannot lower this op: {why}")
        return _compile_frag_for_target(op, target, cc, cfg, fn, consts, ptrs)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            sig[name] = "i32"
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl, **KERNEL_OPTIONS)
    # what a launch specializes on: 16-byte aligned tensors, row stride and padded K multiples of 16,
    # and the row strides of contiguous x and out when K and N are
    aligned = set(ptrs) | {"KWP", "stride_qk", "K_SPLIT_W"}
    aligned |= {"stride_xm"} if op.K % 16 == 0 else set()
    aligned |= {"stride_om"} if op.N % 16 == 0 else set()
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
    ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32), options=options)
    md = ck.metadata
    return {"target": target, "config": cfg.to_json(),
            "kernels": {fn.__name__: {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
                                      "shared": getattr(md, "shared", None), "num_warps": cfg.num_warps}}}


def _compile_frag_for_target(op: QuantGemv, target: str, cc: int, cfg: GemvConfig, fn, consts: dict,
                             ptrs: dict) -> dict:
    """``compile_for_target`` for the Gluon kernel of kind "frag" (``kernels/gemv_frag.py``)."""
    return _compile_gluon_for_target(op, target, cc, cfg, fn, consts, ptrs, {"stride_s", "stride_u", "stride_c", "K"})


def _compile_gluon_for_target(op: QuantGemv, target: str, cc: int, cfg: GemvConfig, fn, consts: dict,
                              ptrs: dict, aligned_ints: set[str]) -> dict:
    """``compile_for_target`` for a Gluon kernel (kinds "frag", "stream"): ``aligned_ints`` are the integer
    arguments a launch specialises as multiples of 16 (strides of padded layouts)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    aligned = set(ptrs) | aligned_ints
    aligned |= {"stride_xm"} if op.K % 16 == 0 else set()
    aligned |= {"stride_om"} if op.N % 16 == 0 else set()
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
    ck = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32),
                        options=dict(num_warps=cfg.num_warps, **KERNEL_OPTIONS))
    md = ck.metadata
    return {"target": target, "config": cfg.to_json(),
            "kernels": {fn.__name__: {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
                                      "shared": getattr(md, "shared", None), "num_warps": cfg.num_warps}}}
