"""Attention through FlashInfer's single-sequence kernels (``flashinfer.single_prefill_with_kv_cache``).

Per batch entry (pages gathered into dense K / V, varlen sequences sliced, ``seqlens_k`` applied): one
``single_prefill_with_kv_cache(q, k, v, causal, window_left, logits_soft_cap, sm_scale, return_lse)`` call in the
NHD layout, which handles grouped-query heads itself. The batch wrappers (paged, ragged) need a plan per batch
shape and a workspace; portakern does not drive them yet, so paged KV is gathered, not read through FlashInfer's
page table (one copy of the entry's keys per call). FlashInfer returns a base-2 log-sum-exp; the kernel multiplies it
by ln 2. Rows with no visible key (causal or a window with Sq > Sk) are written as 0 and ``-inf``, found from the
window itself rather than from FlashInfer's output.

Refused (``supports``): float32, head dims other than ``HEAD_DIMS``, head_dim != head_dim_v, masks other than
causal / left windows (``expr_flashinfer``), score_mods other than a softcap, GPUs older than sm_75.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

from portakern.backend import YES, Support, no
from portakern.ir.dtypes import DType
from portakern.ir.ops import Attention, KVLayout

from .expr_flashinfer import mask_flags, softcap_flag

#: head dims FlashInfer's prebuilt prefill kernels cover (others need its JIT, not exercised here)
HEAD_DIMS = (64, 128, 256)


def supports(op: Attention, device) -> Support:
    """dtype, head dims and whether the mask / score_mod are FlashInfer flags."""
    if op.dtype not in (DType.float16, DType.bfloat16):
        return no(f"FlashInfer's prefill kernels compute float16 / bfloat16, not {op.dtype.value}; use backend=None")
    if op.head_dim != op.head_dim_v or op.head_dim not in HEAD_DIMS:
        return no(f"FlashInfer's prefill kernels are built for head_dim == head_dim_v in {HEAD_DIMS}; got "
                  f"{op.head_dim} / {op.head_dim_v}; use backend=None")
    if mask_flags(op.mask_mod) is None:
        return no(f"FlashInfer takes a causal flag and a left window; mask_mod {op.mask_mod} is neither "
                  "(causal_mask(), window_mask(left, 0) or window_mask(left, -1)); use backend=None")
    if softcap_flag(op.score_mod) is None:
        return no(f"FlashInfer takes a logit softcap; score_mod {op.score_mod} is not softcap_score(cap); use "
                  "backend=None")
    return YES


def compile(op: Attention, device) -> Callable[..., None]:
    """``kernel(q, k, v, out, lse, aux)``: one ``single_prefill_with_kv_cache`` call per batch entry."""
    fi = importlib.import_module("flashinfer")
    causal, left = mask_flags(op.mask_mod)
    cap = softcap_flag(op.score_mod)
    flags = {"causal": causal, "window_left": left, "logits_soft_cap": cap or None, "sm_scale": op.scale,
             "kv_layout": "NHD", "return_lse": op.return_lse}

    def kernel(q, k, v, out, lse, aux) -> None:
        import torch

        for qb, kb, vb, ob, lb in _entries(op, q, k, v, out, lse, aux):
            Sq, Sk = qb.shape[0], kb.shape[0]
            if Sq == 0:
                continue
            seen = _visible_rows(Sq, Sk, causal, left, qb.device)
            if Sk == 0 or not bool(seen.any()):
                ob.zero_()
                if lb is not None:
                    lb.fill_(-math.inf)
                continue
            res = fi.single_prefill_with_kv_cache(qb, kb, vb, **flags)
            o, row_lse = res if isinstance(res, tuple) else (res, None)
            ob.copy_(o.masked_fill(~seen[:, None, None], 0.0))
            if lb is not None:
                lb.copy_((row_lse.float() * math.log(2.0)).T.masked_fill(~seen[None, :], -math.inf))

    return kernel


def _visible_rows(Sq: int, Sk: int, causal: bool, left: int, dev):
    """Which query rows see at least one key: ``[diag - left, diag (+ inf unless causal)]`` meets ``[0, Sk)``,
    ``diag = i + Sk - Sq``."""
    import torch

    diag = torch.arange(Sq, device=dev) + (Sk - Sq)
    lo = (diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(diag)
    hi = diag.clamp(max=Sk - 1) if causal else torch.full_like(diag, Sk - 1)
    return lo <= hi


def _entries(op: Attention, q, k, v, out, lse, aux):
    """Each batch entry as dense ``(q, k, v, out, lse (Hq, Sq))``; varlen padding rows written as 0 / -inf."""
    if op.kv_layout is KVLayout.VARLEN:
        cu_q, cu_k = aux["cu_seqlens_q"].tolist(), aux["cu_seqlens_k"].tolist()
        for b in range(op.batch):
            yield (q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], out[cu_q[b]:cu_q[b + 1]],
                   None if lse is None else lse[:, cu_q[b]:cu_q[b + 1]])
        out[cu_q[-1]:] = 0
        if lse is not None:
            lse[:, cu_q[-1]:] = -math.inf
        return
    lengths = aux["seqlens_k"].tolist() if op.has_seqlens_k else [op.seqlen_k] * op.batch
    for b in range(op.batch):
        L = lengths[b]
        if op.kv_layout is KVLayout.PAGED:
            pages = aux["block_table"][b, : -(-L // op.page_size)].long()
            kb = k[pages].reshape(-1, op.heads_kv, op.head_dim)[:L]
            vb = v[pages].reshape(-1, op.heads_kv, op.head_dim_v)[:L]
        else:
            kb, vb = k[b, :L], v[b, :L]
        yield q[b], kb, vb, out[b], None if lse is None else lse[b]
