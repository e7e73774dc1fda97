"""Attention with ``torch.nn.functional.scaled_dot_product_attention`` and explicit masks.

For each batch entry (``Sq_b`` queries, ``Sk_b`` keys after gathering pages / slicing varlen):

    keep[h, i, j] = mask_mod(b, h, i, j, Sq_b, Sk_b)           lowered from the IR to torch
    out           = SDPA(q, k, v, attn_mask=keep (+ bias), scale)  when the score_mod is absent or
                                                                  additive (score + bias, ALiBi)
    out, lse      = eager softmax in float32                       otherwise (softcap, any score_mod)
                                                                  and whenever the LSE is wanted

Query head ``h`` reads kv head ``h // (Hq // Hkv)``. Rows with no visible key return zeros and
LSE ``-inf``. Math is float32; the result is cast to the output dtype.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from portakern.backend import YES, Support, no
from portakern.ir.ops import Attention, KVLayout

from .expr_torch import additive_bias, evaluate

#: The eager path materialises one (Hq, Sq, Sk) float32 score block per batch entry.
MAX_SCORE_BYTES = 4 << 30


def supports(op: Attention, device) -> Support:
    """Every attention op whose score block fits ``MAX_SCORE_BYTES``."""
    score_bytes = 4 * op.heads_q * op.seqlen_q * op.seqlen_k
    if score_bytes > MAX_SCORE_BYTES:
        return no(f"torch-eager materialises the (Hq, Sq, Sk) = ({op.heads_q}, {op.seqlen_q}, {op.seqlen_k}) "
                  f"float32 score block per batch entry, {score_bytes / 2**30:.1f} GiB > {MAX_SCORE_BYTES >> 30} "
                  "GiB; use a flash-style backend (backend=None) or split the batch")
    return YES


def compile(op: Attention, device) -> Callable[..., None]:
    """The kernel for ``op`` (the same on every device: the tensors carry it)."""
    return attention_kernel(op)


def attention_kernel(op: Attention) -> Callable[..., None]:
    """Build ``kernel(q, k, v, out, lse, aux)`` for ``op`` (see ``portakern.backend``)."""
    bias = additive_bias(op.score_mod)
    eager = op.return_lse or (op.score_mod is not None and bias is None)

    def kernel(q, k, v, out, lse, aux) -> None:
        for b, qb, kb, vb, ob, lb in _sequences(op, q, k, v, out, lse, aux):
            _attend(op, b, qb, kb, vb, ob, lb, bias, eager)

    return kernel


def _attend(op: Attention, b: int, q, k, v, out, lse, bias, eager: bool) -> None:
    """One batch entry: q (Sq, Hq, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv) -> out (Sq, Hq, Dv), lse (Hq, Sq)."""
    Sq, Sk, Hq, dev = q.shape[0], k.shape[0], op.heads_q, q.device
    if Sq == 0:
        return
    if Sk == 0:  # nothing to attend to
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return

    # -- heads first, float32, kv heads repeated for grouped-query attention
    qh = q.permute(1, 0, 2).float()
    kh = k.permute(1, 0, 2).float().repeat_interleave(op.group_size, dim=0)
    vh = v.permute(1, 0, 2).float().repeat_interleave(op.group_size, dim=0)

    # -- the expression variables, shaped to broadcast to (Hq, Sq, Sk)
    env = {"b": torch.tensor(b, device=dev), "seqlen_q": torch.tensor(Sq, device=dev),
           "seqlen_k": torch.tensor(Sk, device=dev),
           "h": torch.arange(Hq, device=dev)[:, None, None],
           "q_idx": torch.arange(Sq, device=dev)[None, :, None],
           "kv_idx": torch.arange(Sk, device=dev)[None, None, :]}
    keep = None
    if op.mask_mod is not None:
        keep = evaluate(op.mask_mod, env, dev).to(torch.bool).expand(Hq, Sq, Sk)

    if eager:
        # -- compute scores, apply score_mod and mask, softmax in float32
        s = (qh @ kh.transpose(1, 2)) * op.scale
        if op.score_mod is not None:
            s = evaluate(op.score_mod, {**env, "score": s}, dev).to(torch.float32).expand(Hq, Sq, Sk)
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)
        # the row max, NaN when a visible score is NaN; -inf (no visible key) becomes 0
        m = s.amax(dim=-1)
        m = torch.where(m == -math.inf, 0.0, m)
        p = torch.exp(s - m[..., None])               # +inf score: inf - inf = NaN (docs/ir.md "Non-finite values")
        l = p.sum(dim=-1)
        seen = l != 0                                 # NaN != 0: a poisoned row stays NaN
        o = (p @ vh) / torch.where(seen, l, 1.0)[..., None]
        if lse is not None:
            lse.copy_(torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf))
    else:
        # -- SDPA with a boolean mask (or a float mask carrying an additive score_mod)
        visible = None
        mask = keep
        if keep is not None:
            visible = keep.any(dim=-1)                                     # (Hq, Sq)
            mask = keep | ~visible[..., None]   # fully masked rows: attend anywhere, zeroed below
        if bias is not None:
            fmask = evaluate(bias, env, dev).to(torch.float32).expand(Hq, Sq, Sk)
            mask = fmask if mask is None else fmask.masked_fill(~mask, -math.inf)
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=None if mask is None
                                           else mask[None], scale=op.scale)[0]
        if visible is not None:
            o = torch.where(visible[..., None], o, 0.0)   # never 0 * NaN: a masked row is 0 whatever q holds
    out.copy_(o.permute(1, 0, 2))


def _sequences(op: Attention, q, k, v, out, lse, aux) -> Iterator[tuple]:
    """Each batch entry of any KV layout as dense tensors (pages gathered, varlen sliced)."""
    if op.kv_layout is KVLayout.VARLEN:
        cu_q, cu_k = aux["cu_seqlens_q"].tolist(), aux["cu_seqlens_k"].tolist()
        for b in range(op.batch):
            qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            yield b, q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], None if lse is None else lse[:, qs:qe]
        out[cu_q[-1]:] = 0                  # padding rows after the last sequence see no keys
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
        yield b, q[b], kb, vb, out[b], None if lse is None else lse[b]
