"""Host side of the Gluon prefill kernel for sm_90 (``kernels/attention_wgmma.py``).

``blocker(op, arch)`` says why an op cannot run there (None when it can); ``launcher`` returns the
launch ``launch(q, k, v, out, lse, aux)`` for an ``AttnConfig`` with ``wgmma`` (its ``block_n``,
``num_stages`` and ``k_stages`` are the key tile and the V and K ring depths; 128 query rows and
4 + 4 + 1 warps are fixed);
``call_blocker`` checks what the signature cannot see (TMA's alignment rules on the call's tensors);
``compile_for_target`` lowers the kernel without a GPU. The kernel covers dense bf16/fp16 prefill with
``head_dim == head_dim_v`` in {64, 128, 256}, a positive scale, no score_mod, and no mask or exactly the
library causal mask with ``seqlen_k >= seqlen_q``; everything else stays on ``attn_fwd``.

Descriptors: q, K and V go as 3-D TMA descriptors over ``(B, S, H * D)`` views (heads adjacent,
last stride 1), so a tile that runs past a batch's last row reads zeros, never the next batch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from portakern.ir.ops import Attention, KVLayout

from .backend import KERNEL_OPTIONS
from .launch import KernelLaunch

QUERY_ROWS = 64          # rows per consumer warpgroup; a program owns two such halves
HEAD_DIMS = (64, 128, 256)
CONSUMER_REGS = 240      # setmaxnreg of each consumer warpgroup (232 was no better on the H200, session 10)
PRODUCER_REGS = 24       # setmaxnreg of the load warp
#: the two consumers take turns issuing their MMAs (``kernels/attention_wgmma._take_turn``)
PINGPONG = False


def blocker(op: Attention, arch: str) -> str | None:
    """Why ``op`` cannot run on this kernel for ``arch`` (None when it can)."""
    if arch != "sm_90":
        return f"needs sm_90 (wgmma), not {arch}"
    if op.kv_layout is not KVLayout.DENSE or op.has_seqlens_k:
        return "dense K/V without seqlens_k only"
    why = scores_blocker(op)
    if why is None and op.mask_mod is not None and op.seqlen_k < op.seqlen_q:
        why = "causal with seqlen_k >= seqlen_q only"
    return why


def scores_blocker(op: Attention) -> str | None:
    """What both Gluon kernels (this one and ``attention_decode_ws``) ask of ``op``'s values and scores:
    bf16/fp16, ``head_dim == head_dim_v`` in ``HEAD_DIMS``, no score_mod, a positive scale (the row maximum
    is taken on the raw scores), and no mask or the library's causal mask (None when ``op`` has them)."""
    from .expr_triton import analyse_mask

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


def call_blocker(q, k, v, out=None) -> str | None:
    """Why these tensors cannot go through the kernel's 3-D descriptors (None when they can): heads
    adjacent with the last stride 1, and TMA's alignment rules (``attention._tma_rules``)."""
    from .attention import _tma_rules

    for name, a in (("q", q), ("k", k), ("v", v)):
        B, S, H, D = a.shape
        if a.stride(3) != 1 or (H > 1 and a.stride(2) != D):
            return f"{name} with strides {tuple(a.stride())} has no (B, S, H * D) view (heads adjacent, last stride 1)"
        why = _tma_rules(name, a, a.stride()[:2])
        if why:
            return why
    return None


@functools.lru_cache(maxsize=None)
def smem_layout(shape: tuple[int, ...], dtype: str):
    """The swizzled shared-memory layout of a TMA tile of ``shape`` (computed once per shape, not per call);
    both Gluon attention kernels' descriptors take it."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(shape), {"bfloat16": gl.bfloat16, "float16": gl.float16}[dtype])


def descriptors(op: Attention, q, k, v, block_n: int):
    """The 3-D host descriptors of ``attn_fwd_wgmma``: q with ``(1, QUERY_ROWS, D)`` blocks, K and V
    with ``(1, block_n, D)``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(a, rows):
        B, S, H, D = a.shape
        return TensorDescriptor(a, [B, S, H * D], [a.stride(0), a.stride(1), 1], [1, rows, D],
                                smem_layout((1, rows, D), op.dtype.value))

    return desc(q, QUERY_ROWS), desc(k, block_n), desc(v, block_n)


def constexprs(op: Attention, cfg) -> dict[str, Any]:
    """The compile-time arguments of ``attn_fwd_wgmma`` for ``op`` under ``cfg`` (an ``AttnConfig``
    with ``wgmma``: its ``block_n`` is the key tile, ``num_stages`` the V ring's depth and ``k_stages``
    the K ring's, 0 for the same). A mask is the causal mask here: ``blocker`` admits no other."""
    return dict(QR=QUERY_ROWS, BN=cfg.block_n, D=op.head_dim, DV=op.head_dim_v, STAGES=cfg.num_stages,
                KSTAGES=cfg.k_stages or cfg.num_stages, CAUSAL=op.mask_mod is not None, RETURN_LSE=op.return_lse,
                CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, PINGPONG=PINGPONG)


def grid(op: Attention) -> tuple[int, int]:
    return (-(-op.seqlen_q // (2 * QUERY_ROWS)), op.batch * op.heads_q)


def launcher(op: Attention, cfg) -> Callable[..., None]:
    """``launch(q, k, v, out, lse, aux)`` of the kernel for ``op`` under ``cfg``, for tensors that passed
    the backend's checks and ``call_blocker`` (``attention._build_gluon`` wraps it with both)."""
    from . import kernels

    fn = kernels.load("attention_wgmma").attn_fwd_wgmma
    consts = constexprs(op, cfg)
    prefill = KernelLaunch(fn, grid(op), consts, dict(num_warps=4, **KERNEL_OPTIONS))

    def launch(q, k, v, out, lse, aux) -> None:
        qd, kd, vd = descriptors(op, q, k, v, cfg.block_n)
        sl = lse.stride() if lse is not None else (0, 0, 0)
        prefill(qd, kd, vd, out, lse, out.stride(0), out.stride(1), out.stride(2), *sl,
                op.heads_q, op.group_size, op.seqlen_q, op.seqlen_k, op.scale)

    return launch


def compile_for_target(op: Attention, cfg, cc: int) -> dict:
    """``{"attn_fwd_wgmma": artifact}`` lowered for compute capability ``cc`` as a launch on contiguous
    tensors specialises it (descriptor types from host descriptors over small stand-in tensors)."""
    from .attention_aot import _launch_scalars

    consts = constexprs(op, cfg)
    sc = _launch_scalars(op)
    ints = {f"{a}_{x}": sc[f"stride_{b}{x}"] for a, b in (("so", "o"), ("sl", "l")) for x in "bsh"}
    ints.update(HQ=op.heads_q, GROUP=op.group_size, sq=op.seqlen_q, sk=op.seqlen_k)
    pointers = {"LSE": ("*fp32", op.return_lse)}
    return lower_gluon("attention_wgmma", "attn_fwd_wgmma", op, descriptors, cfg.block_n, consts, pointers, ints, cc,
                       warps=12)


def lower_gluon(module: str, name: str, op: Attention, make_descriptors, block_n: int, consts: dict[str, Any],
                pointers: dict[str, tuple[str, bool]], ints: dict[str, int], cc: int, warps: int) -> dict:
    """``{name: artifact}``: Gluon kernel ``name`` of ``kernels/<module>.py`` lowered for compute capability
    ``cc`` as a launch on contiguous tensors of ``op``'s shapes specialises it. Its q/k/v descriptor types come
    from ``make_descriptors(op, q, k, v, block_n)`` over storage-less stand-ins, ``O`` is a pointer to the
    output dtype, each of ``pointers`` (``name: (type, present)``) a pointer or, when absent, None; ``ints``
    are the integer arguments' values. Shared by both Gluon attention kernels."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from . import kernels
    from .attention_aot import _as_launched
    from .backend import interpret_env

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
    sig, consts, attrs = _as_launched(fn, sig, consts, ints)
    with interpret_env(False):
        ck = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32),
                            options=dict(num_warps=4, **KERNEL_OPTIONS))
    md = ck.metadata
    return {name: {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
                   "shared": getattr(md, "shared", None), "num_warps": getattr(md, "num_warps", warps)}}
