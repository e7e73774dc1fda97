"""Host side of the Gluon prefill kernel for sm_90 (``kernels/attention_wgmma.py``).

``blocker(op, arch)`` says why an op cannot run there (None when it can); ``launcher`` returns the
launch ``launch(q, k, v, out, lse, aux)`` for an ``AttnConfig`` with ``wgmma`` (its ``block_n``,
``num_stages`` and ``k_stages`` are the key tile and the V and K ring depths; 128 query rows and
4 + 4 + 1 warps are fixed);
``call_blocker`` checks what the signature cannot see (TMA's alignment rules on the call's tensors);
``compile_for_target`` lowers the kernel without a GPU. The kernel covers dense bf16/fp16 prefill with
``head_dim == head_dim_v`` in {64, 128, 256}, a positive scale, no score_mod, and no mask or exactly the
library causal mask with ``seqlen_k >= seqlen_q`` (``gluon.scores_blocker``); everything else stays on
``attn_fwd``.

Descriptors: q, K and V go as 3-D TMA descriptors over ``(B, S, H * D)`` views (heads adjacent,
last stride 1), so a tile that runs past a batch's last row reads zeros, never the next batch.
"""

from __future__ import annotations

from typing import Any, Callable

from portakern.ir.ops import Attention, KVLayout

from ..common.launch import KERNEL_OPTIONS, KernelLaunch
from .gluon import lower_gluon, scores_blocker, smem_layout
from .specialise import launch_scalars
from .tma import tma_rules

QUERY_ROWS = 64          # rows per consumer warpgroup; a program owns two such halves
CONSUMER_REGS = 240      # setmaxnreg of each consumer warpgroup (232 was no better on the H200)
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


def call_blocker(q, k, v, out=None) -> str | None:
    """Why these tensors cannot go through the kernel's 3-D descriptors (None when they can): heads
    adjacent with the last stride 1, and TMA's alignment rules (``tma.tma_rules``)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        B, S, H, D = a.shape
        if a.stride(3) != 1 or (H > 1 and a.stride(2) != D):
            return f"{name} with strides {tuple(a.stride())} has no (B, S, H * D) view (heads adjacent, last stride 1)"
        why = tma_rules(name, a, a.stride()[:2])
        if why:
            return why
    return None


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
    the backend's checks and ``call_blocker`` (``forward.build_gluon`` wraps it with both)."""
    from .. import kernels

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
    consts = constexprs(op, cfg)
    sc = launch_scalars(op)
    ints = {f"{a}_{x}": sc[f"stride_{b}{x}"] for a, b in (("so", "o"), ("sl", "l")) for x in "bsh"}
    ints.update(HQ=op.heads_q, GROUP=op.group_size, sq=op.seqlen_q, sk=op.seqlen_k)
    pointers = {"LSE": ("*fp32", op.return_lse)}
    return lower_gluon("attention_wgmma", "attn_fwd_wgmma", op, descriptors, cfg.block_n, consts, pointers, ints, cc,
                       warps=12)

