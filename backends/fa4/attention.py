"""Attention through FlashAttention-4 (``flash_attn.cute``: CuTe DSL kernels for Hopper and Blackwell).

One call per problem: ``flash_attn_func`` for dense KV without ``seqlens_k``; ``flash_attn_varlen_func`` for varlen
(``cu_seqlens_q`` / ``cu_seqlens_k``), paged KV (``page_table`` + ``seqused_k``) and dense KV with ``seqlens_k``
(``seqused_k``). Masks and score_mods become FA4's flags (``expr_fa4``): causal, a sliding window
``(left, right)`` (both bottom-right aligned, as portakern's), a logit softcap; the LSE comes from
``return_lse=True``. FA4 marks a row with no visible key by an infinite LSE; the kernel writes such rows as 0 and
``-inf`` (portakern's rule).

Refused, with the reason (``supports``): float32 (FA4 is float16 / bfloat16), head dims other than
``HEAD_DIMS`` (the pairs FA4's forward kernels are built for), any other mask or score_mod (FA4's own ``mask_mod`` /
``score_mod`` are CuTe DSL callables, which portakern does not generate), and GPUs outside sm_90 / sm_100 / sm_110.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

from portakern.backend import YES, Support, no
from portakern.ir.dtypes import DType
from portakern.ir.ops import Attention, KVLayout

from .expr_fa4 import mask_window, softcap_of

#: (head_dim, head_dim_v) pairs FA4's forward kernels are built for: 64, 96, 128 on every supported arch, and
#: DeepSeek's (192, 128) on Blackwell (sm_100 and newer)
HEAD_DIMS = {(64, 64), (96, 96), (128, 128)}
HEAD_DIMS_SM100 = {(192, 128)}
#: compute capability majors FA4's forward runs on (Hopper, Blackwell datacenter, Thor)
ARCH_MAJORS = (9, 10, 11)


def supports(op: Attention, device) -> Support:
    """dtype, head dims, the GPU generation and whether the mask / score_mod are FA4 flags."""
    if op.dtype not in (DType.float16, DType.bfloat16):
        return no(f"FlashAttention-4 computes float16 / bfloat16, not {op.dtype.value}; use backend=None")
    cap = device.capability
    if cap is not None and cap[0] not in ARCH_MAJORS:
        return no(f"FlashAttention-4 runs on sm_90, sm_100 and sm_110 GPUs; {device} is {device.arch}; use "
                  "backend=None")
    dims = (op.head_dim, op.head_dim_v)
    allowed = HEAD_DIMS | (HEAD_DIMS_SM100 if cap is None or cap[0] >= 10 else set())
    if dims not in allowed:
        return no(f"FlashAttention-4 is built for head dims {sorted(allowed)}; (head_dim, head_dim_v) = {dims}; use "
                  "backend=None")
    if mask_window(op.mask_mod) is None:
        return no(f"FlashAttention-4 takes causal and sliding-window masks as flags; mask_mod {op.mask_mod} is neither "
                  "(FA4's own mask_mod is a CuTe DSL callable portakern does not generate); use backend=None")
    if softcap_of(op.score_mod) is None:
        return no(f"FlashAttention-4 takes a logit softcap as a flag; score_mod {op.score_mod} is not "
                  "softcap_score(cap); use backend=None")
    return YES


def compile(op: Attention, device) -> Callable[..., None]:
    """``kernel(q, k, v, out, lse, aux)`` calling ``flash_attn.cute`` with the flags read off ``op``."""
    fa = importlib.import_module("flash_attn.cute")
    w = mask_window(op.mask_mod)
    flags = {"softmax_scale": op.scale, "causal": w.causal, "softcap": softcap_of(op.score_mod),
             "window_size": (None, None) if w.causal else (w.left, w.right)}
    if op.return_lse:
        flags["return_lse"] = True
    dense = op.kv_layout is KVLayout.DENSE and not op.has_seqlens_k

    def kernel(q, k, v, out, lse, aux) -> None:
        import torch

        if dense:
            res = fa.flash_attn_func(q, k, v, **flags)
        else:
            i32 = {n: None if aux.get(n) is None else aux[n].to(torch.int32).contiguous()
                   for n in ("cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "block_table")}
            varlen = op.kv_layout is KVLayout.VARLEN
            res = fa.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=i32["cu_seqlens_q"], cu_seqlens_k=i32["cu_seqlens_k"],
                max_seqlen_q=op.seqlen_q if varlen else None, max_seqlen_k=op.seqlen_k if varlen else None,
                seqused_k=i32["seqlens_k"], page_table=i32["block_table"], **flags)
        o, row_lse = res if isinstance(res, tuple) else (res, None)
        if op.kv_layout is KVLayout.VARLEN:
            end = int(aux["cu_seqlens_q"][-1])
            out[end:] = 0                   # rows after the last sequence see no keys
            out, o = out[:end], o[:end]
            if lse is not None:
                lse[:, end:] = -math.inf
                lse, row_lse = lse[:, :end], None if row_lse is None else row_lse[:, :end]
        if lse is None:
            out.copy_(o)
            return
        if row_lse is None:
            raise NotImplementedError("this flash_attn.cute returned no LSE for return_lse=True; install a "
                                      "FlashAttention-4 with return_lse (flash-attn-cute >= the 2025-10 interface)")
        empty = torch.isinf(row_lse) & (row_lse > 0)        # FA4's mark of a row with no visible key
        lse.copy_(row_lse.masked_fill(empty, -math.inf))
        out.copy_(o.masked_fill(empty.transpose(-1, -2)[..., None], 0.0))   # lse (.., H, S) -> out (.., S, H, Dv)

    return kernel
