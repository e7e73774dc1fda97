"""What the two Gluon attention kernels for sm_90 share (``wgmma.py``: prefill, ``decode_ws.py``: split decode):
the ops whose scores they can compute, the shared-memory layout of their TMA tiles, and their lowering without
the device."""

from __future__ import annotations

import functools
from typing import Any

from portakern.ir.ops import Attention

from ..common.launch import KERNEL_OPTIONS
from .specialise import as_launched

#: Head dimensions the Gluon kernels are written for (``head_dim == head_dim_v``)
HEAD_DIMS = (64, 128, 256)


def scores_blocker(op: Attention) -> str | None:
    """What both Gluon kernels ask of ``op``'s values and scores: bf16/fp16, ``head_dim == head_dim_v`` in
    ``HEAD_DIMS``, no score_mod, a positive scale (the row maximum is taken on the raw scores), and no mask or
    the library's causal mask (None when ``op`` has them)."""
    from ..expr_triton import analyse_mask

    if op.dtype.value not in ("bfloat16", "float16"):
        return f"bf16/fp16 only, not {op.dtype.value}"
    if op.head_dim != op.head_dim_v or op.head_dim not in HEAD_DIMS:
        return f"head_dim == head_dim_v in {HEAD_DIMS} only"
    if op.score_mod is not None or not op.scale > 0:
        return "no score_mod and a positive scale only"
    if op.mask_mod is not None:
        mb = analyse_mask(op.mask_mod)
        if not (mb.right == 0 and mb.left is None and not mb.residual and not mb.never):
            return "no mask or the causal mask only"
    return None


@functools.lru_cache(maxsize=None)
def smem_layout(shape: tuple[int, ...], dtype: str):
    """The swizzled shared-memory layout of a TMA tile of ``shape`` (computed once per shape, not per call);
    both Gluon attention kernels' descriptors take it."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(shape), {"bfloat16": gl.bfloat16, "float16": gl.float16}[dtype])


def lower_gluon(module: str, name: str, op: Attention, make_descriptors, block_n: int, consts: dict[str, Any],
                pointers: dict[str, tuple[str, bool]], ints: dict[str, int], cc: int, warps: int) -> dict:
    """``{name: artifact}``: Gluon kernel ``name`` of ``kernels/<module>.py`` lowered for compute capability
    ``cc`` as a launch on contiguous tensors of ``op``'s shapes specialises it. Its q/k/v descriptor types come
    from ``make_descriptors(op, q, k, v, block_n)`` over storage-less stand-ins, ``O`` is a pointer to the
    output dtype, each of ``pointers`` (``name: (type, present)``) a pointer or, when absent, None; ``ints``
    are the integer arguments' values."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from .. import kernels

    fn = getattr(kernels.load(module), name)
    consts = dict(consts)
    dt = getattr(torch, op.dtype.value)
    shapes = op.shapes()
    # contiguous stand-ins without storage: a descriptor's type needs shapes and strides, not data
    qd, kd, vd = make_descriptors(op, *(torch.empty(shapes[n], dtype=dt, device="meta") for n in "qkv"), block_n)
    elt = {"float16": "fp16", "bfloat16": "bf16"}[op.dtype.value]
    sig = {"q_desc": mangle_type(qd), "k_desc": mangle_type(kd), "v_desc": mangle_type(vd), "O": "*" + elt}
    for arg, (typ, present) in pointers.items():
        if present:
            sig[arg] = typ
        else:
            consts[arg] = None
    sig, consts, attrs = as_launched(fn, sig, consts, ints)
    ck = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32),
                        options=dict(num_warps=4, **KERNEL_OPTIONS))
    md = ck.metadata
    return {name: {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
                   "shared": getattr(md, "shared", None), "num_warps": getattr(md, "num_warps", warps)}}
