"""Attention through torch's kernels: ``scaled_dot_product_attention`` (SDPA) and ``flex_attention``.

Per batch entry (pages gathered, varlen sequences sliced, ``seqlens_k`` applied):

* **SDPA** runs every problem whose score_mod is absent or additive (``score + X``: ALiBi, a bias). The mask_mod is
  evaluated into an explicit boolean mask of shape (Hq or 1, Sq, Sk) -- causal and sliding windows included -- and
  an additive score_mod into a float mask. Cost: Sq x Sk bytes per batch entry (x Hq when the mask reads ``h``;
  4 bytes per element for a float mask), built on every call, and the kernels that take a mask read it from memory
  instead of skipping masked tiles. SDPA's ``is_causal`` is not used: it aligns the diagonal top-left, portakern's
  masks are expressions over positions (``docs/ir.md``).
* **flex_attention** runs what SDPA cannot express: a score_mod that is not ``score + X`` (softcap and any other
  transform of the score), with the mask_mod folded into the score_mod as ``-inf``. Only the ``torch`` backend
  takes this path (a pinned SDPA kernel refuses such a case); it calls flex_attention eagerly, which is torch's
  unfused implementation (scores materialised, in float32), on cpu and cuda alike -- correct everywhere, fast
  nowhere. Sliding windows stay on SDPA's explicit mask (a mask SDPA can take); paged KV is gathered into dense
  K / V, because SDPA has no page table and a flex block mask built from a block table would change with it.
* **Non-finite inputs under a mask**: SDPA adds a mask as a ``-inf`` bias, so a NaN / inf score of a *hidden* key
  leaks into its row, where docs/ir.md says a hidden key never counts. The ``torch`` backend checks q and k of each
  batch entry (one pass, one host sync) and runs an entry holding NaN / inf under a mask through flex_attention,
  which replaces hidden scores. A pinned SDPA kernel (``torch-math``, ...) runs as it is, so its conformance report
  shows that behaviour (the ``nf-*`` cases with a mask).
* **LSE** (``return_lse``): torch's CPU flash kernel (``torch-flash`` on cpu) returns it; every other SDPA kernel
  does not, so it is computed in float32 as ``m + log(sum(exp(s - m)))`` over ``s = scale * q k^T + bias`` with
  hidden keys replaced by ``-inf``: one more pass over the scores (their block materialised). flex_attention returns it.

Grouped-query attention repeats each KV head for its query heads (memory: G x the K / V of one entry). Rows with no
visible key return 0 and LSE ``-inf`` (fully masked rows are given a dummy key set and zeroed after, since the
kernels differ on them). On cpu every kernel computes in float32 (inputs upcast, result rounded to the output
dtype); on cuda SDPA kernels take the inputs' dtype.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from portakern.backend import YES, Support, no
from portakern.errors import BackendError
from portakern.ir.dtypes import DType
from portakern.ir.expr import Expr
from portakern.ir.ops import Attention, KVLayout

from .expr_torch import additive_bias, evaluate
from .tuning import MAX_BLOCK_BYTES

_HALF = (DType.float16, DType.bfloat16)
_TORCH_DTYPE = {DType.float16: torch.float16, DType.bfloat16: torch.bfloat16, DType.float32: torch.float32}


def _needs_flex(op: Attention) -> bool:
    return op.score_mod is not None and additive_bias(op.score_mod) is None


def kernel_limits(kernel: str | None, op: Attention, device) -> Support:
    """The limits of SDPA kernel ``kernel`` (an ``SDPBackend`` member name; None: torch's own choice, with
    flex_attention behind it) for ``op`` on ``device``: dtype, head dims, masks and score_mods it cannot take."""
    if kernel is None:
        if _needs_flex(op) and _flex_attention() is None:
            return no(f"score_mod {op.score_mod} is not 'score + bias', which SDPA cannot apply; it needs "
                      f"flex_attention (torch >= 2.5), and this torch is {torch.__version__}; use backend=None")
        return YES
    if _needs_flex(op):
        return no(f"SDPA's {kernel} kernel takes a mask, not a score transform: score_mod {op.score_mod} is not "
                  "'score + bias'; backend='torch' runs it through flex_attention")
    D, Dv, dt = op.head_dim, op.head_dim_v, op.dtype.value
    if device.type == "cpu":   # the math and CPU flash kernels take every mask, in float32 here
        if kernel == "FLASH_ATTENTION" and D != Dv:
            return no(f"torch's CPU flash kernel needs head_dim == head_dim_v; got {D} / {Dv}; use "
                      "backend='torch-math' or 'torch'")
        return YES
    if op.score_mod is not None and op.dtype in _HALF:
        return no(f"SDPA takes an additive score_mod as a float mask of the query's dtype, so on cuda it would be "
                  f"rounded to {dt}; backend='torch' runs it through flex_attention in float32")
    if kernel == "FLASH_ATTENTION":
        if op.dtype not in _HALF:
            return no(f"SDPA's flash kernel takes float16 / bfloat16, not {dt}; use backend='torch-efficient' or "
                      "'torch-math'")
        if D != Dv or D > 256 or D % 8:
            return no(f"SDPA's flash kernel needs head_dim == head_dim_v <= 256, a multiple of 8; got {D} / {Dv}; "
                      "use backend='torch-efficient' or 'torch-math'")
        if op.mask_mod is not None:
            return no(f"SDPA's flash kernel takes no attention mask (only a top-left is_causal), and mask_mod "
                      f"{op.mask_mod} needs one; use backend='torch-efficient', 'torch-cudnn' or 'torch'")
    if kernel == "EFFICIENT_ATTENTION":
        align = 4 if op.dtype is DType.float32 else 8
        if D % align or Dv % align:
            return no(f"SDPA's memory-efficient kernel needs head dims that are multiples of {align} for {dt}; got "
                      f"{D} / {Dv}; use backend='torch-math'")
    if kernel == "CUDNN_ATTENTION":
        if op.dtype not in _HALF:
            return no(f"SDPA's cuDNN kernel takes float16 / bfloat16, not {dt}; use backend='torch-efficient'")
        if D > 128 or Dv > 128 or D % 8 or Dv % 8:
            return no(f"SDPA's cuDNN kernel needs head dims <= 128, multiples of 8; got {D} / {Dv}; use "
                      "backend='torch-efficient' or 'torch-math'")
    return YES


def supports(op: Attention, device) -> Support:
    """Every variant: the (heads x query rows x keys) block an explicit mask, the logsumexp pass or eager
    flex_attention materialises must fit ``tuning.MAX_BLOCK_BYTES`` per batch entry."""
    if op.mask_mod is None and op.score_mod is None and not op.return_lse:
        return YES
    block = 4 * op.heads_q * op.seqlen_q * op.seqlen_k
    if block > MAX_BLOCK_BYTES:
        return no(f"the torch backends materialise a float32 (Hq, Sq, Sk) = ({op.heads_q}, {op.seqlen_q}, "
                  f"{op.seqlen_k}) mask / score block per batch entry for masks, score_mods and the LSE: "
                  f"{block / 2**30:.1f} GiB > {MAX_BLOCK_BYTES >> 30} GiB; use a flash-style backend (backend=None)")
    return YES


def compile(op: Attention, device) -> Callable[..., None]:
    """The ``torch`` backend's kernel (torch's SDPA kernel choice): ``build(op, device, None)``."""
    return build(op, device, None)


@dataclass(frozen=True)
class _Plan:
    op: Attention
    kernel: str | None        # SDPBackend member name, None: torch's choice
    flex: bool                # run through flex_attention
    bias: Expr | None         # additive score_mod term
    cpu_flash: bool           # torch's CPU flash kernel through its aten op (returns the LSE)
    dtype: torch.dtype        # compute dtype


def build(op: Attention, device, kernel: str | None) -> Callable[..., None]:
    """``kernel(q, k, v, out, lse, aux)`` for ``op`` on ``device`` through SDPA kernel ``kernel`` (an
    ``SDPBackend`` member name, or None for torch's choice with flex_attention for non-additive score_mods)."""
    cpu = device.type == "cpu"
    bias = additive_bias(op.score_mod)
    flex = _needs_flex(op) or (kernel is None and not cpu and bias is not None and op.dtype in _HALF)
    plan = _Plan(op, kernel, flex, bias, cpu and kernel == "FLASH_ATTENTION",
                 torch.float32 if cpu or flex else _TORCH_DTYPE[op.dtype])

    def run(q, k, v, out, lse, aux) -> None:
        for b, qb, kb, vb, ob, lb in _sequences(op, q, k, v, out, lse, aux):
            _attend(plan, b, qb, kb, vb, ob, lb)

    return run


def _attend(plan: _Plan, b: int, q, k, v, out, lse) -> None:
    """One batch entry: q (Sq, Hq, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv) -> out (Sq, Hq, Dv), lse (Hq, Sq)."""
    op = plan.op
    Sq, Sk = q.shape[0], k.shape[0]
    if Sq == 0:
        return
    if Sk == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return
    qh = q.permute(1, 0, 2).to(plan.dtype)[None]                                     # (1, Hq, Sq, D)
    kh, vh = (t.permute(1, 0, 2).to(plan.dtype) for t in (k, v))
    if op.group_size > 1:                                                              # grouped heads: each KV head
        kh, vh = (t.repeat_interleave(op.group_size, dim=0) for t in (kh, vh))      # serves group_size query heads
    kh, vh = kh[None], vh[None]
    flex = plan.flex or (plan.kernel is None and op.mask_mod is not None and not _finite(q, k))
    o, row_lse = (_flex if flex else _sdpa)(plan, b, qh, kh, vh, lse is not None)
    out.copy_(o[0].permute(1, 0, 2))
    if lse is not None:
        lse.copy_(row_lse[0])


def _finite(q, k) -> bool:
    """Whether q and k hold no NaN / inf (one pass and one host sync per batch entry). SDPA applies a mask as a
    ``-inf`` bias, so a non-finite score of a hidden key leaks into its row (``NaN + -inf``); docs/ir.md says a
    hidden key never counts, which flex_attention's ``where(mask, score, -inf)`` keeps."""
    return bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())


def _logsumexp(s: torch.Tensor) -> torch.Tensor:
    """``m + log(sum(exp(s - m)))`` over the last axis as docs/ir.md writes it: ``-inf`` for a row of ``-inf``,
    NaN for a row holding ``+inf`` or NaN (``torch.logsumexp`` returns ``+inf`` there)."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    return (m + torch.log(torch.exp(s - m).sum(dim=-1, keepdim=True)))[..., 0]


def _plus_inf_is_nan(row_lse: torch.Tensor) -> torch.Tensor:
    """A kernel's ``+inf`` LSE as NaN. Only a visible ``+inf`` score makes a finite-input LSE overflow to ``+inf``
    (finite scores give ``m + log(sum) <= m + log(Sk)``), and there docs/ir.md's ``exp(inf - inf)`` is NaN; the CPU
    flash kernel and flex_attention return ``+inf``."""
    return row_lse.masked_fill(row_lse == math.inf, math.nan)


def _scalar(value: int, dev) -> torch.Tensor:
    """A 0-d int64 tensor on ``dev`` made by a fill, not copied from the host: ``torch.tensor(v, device=cuda)`` is a
    blocking host-to-device copy, which waits for the stream and cannot be captured in a CUDA graph."""
    return torch.full((), value, dtype=torch.int64, device=dev)


def _env(plan: _Plan, b: int, Sq: int, Sk: int, dev) -> dict[str, Any]:
    """The expression variables, shaped to broadcast to (Hq, Sq, Sk)."""
    return {"b": _scalar(b, dev), "seqlen_q": _scalar(Sq, dev), "seqlen_k": _scalar(Sk, dev),
            "h": torch.arange(plan.op.heads_q, device=dev)[:, None, None],
            "q_idx": torch.arange(Sq, device=dev)[None, :, None], "kv_idx": torch.arange(Sk, device=dev)[None, None, :]}


def _block(expr: Expr, env, dev, Sq: int, Sk: int, Hq: int) -> torch.Tensor:
    """``expr`` over the grid, as (Hq, Sq, Sk) when it reads ``h``, else (1, Sq, Sk) (a broadcast view)."""
    heads = Hq if "h" in expr.variables() else 1
    return torch.broadcast_to(evaluate(expr, env, dev), (heads, Sq, Sk))


def _sdpa(plan: _Plan, b: int, qh, kh, vh, want_lse: bool):
    op, dev = plan.op, qh.device
    Hq, Sq, Sk = qh.shape[1], qh.shape[2], kh.shape[2]
    env = _env(plan, b, Sq, Sk, dev) if op.mask_mod is not None or plan.bias is not None else None
    keep = _block(op.mask_mod, env, dev, Sq, Sk, Hq).to(torch.bool) if op.mask_mod is not None else None
    bias = _block(plan.bias, env, dev, Sq, Sk, Hq).to(torch.float32) if plan.bias is not None else None
    visible = keep.any(dim=-1) if keep is not None else None                          # (Hq or 1, Sq)
    mask = None if keep is None else keep | ~visible[..., None]   # a row with no key attends anywhere, zeroed below
    if bias is not None:
        mask = (bias if mask is None else bias.masked_fill(~mask, -math.inf)).to(plan.dtype)
    row_lse = None
    try:
        if plan.cpu_flash:
            if mask is not None and mask.dtype == torch.bool:   # the CPU flash kernel takes a float mask only
                mask = torch.zeros(mask.shape, dtype=plan.dtype, device=dev).masked_fill_(~mask, -math.inf)
            o, row_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qh, kh, vh, attn_mask=None if mask is None else mask[None], scale=op.scale)
            row_lse = _plus_inf_is_nan(row_lse)
        else:
            with _pinned(plan.kernel):
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=None if mask is None else mask[None],
                                                   scale=op.scale)
    except RuntimeError as e:
        raise BackendError(f"torch SDPA kernel {plan.kernel or '(torch choice)'} failed on {op.dtype.value} "
                           f"head dims {op.head_dim} / {op.head_dim_v}, Sq={Sq}, Sk={Sk}: {e}") from e
    if want_lse and row_lse is None:
        s = (qh.float() @ kh.float().transpose(-1, -2)) * op.scale
        if bias is not None:
            s = s + bias
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)
        row_lse = _logsumexp(s)
    if visible is not None:                    # masked_fill, not a product: a NaN q must not reach such a row
        o = o.masked_fill(~visible[None, ..., None], 0.0)
        if row_lse is not None:
            row_lse = row_lse.masked_fill(~visible[None], -math.inf)
    return o, row_lse


def _pinned(kernel: str | None):
    if kernel is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, kernel)])


def _flex_attention():
    """``torch.nn.attention.flex_attention.flex_attention``, or None on a torch without it (before 2.5)."""
    try:
        from torch.nn.attention import flex_attention as fx
    except ImportError:
        return None
    return fx.flex_attention


def _flex(plan: _Plan, b: int, qh, kh, vh, want_lse: bool):
    import torch.nn.attention.flex_attention as fx

    op, dev = plan.op, qh.device
    consts = {"b": _scalar(b, dev), "seqlen_q": _scalar(qh.shape[2], dev), "seqlen_k": _scalar(kh.shape[2], dev)}

    def score_mod(score, _batch, h, q_idx, kv_idx):
        env = {**consts, "score": score, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        s = evaluate(op.score_mod, env, dev).to(score.dtype) if op.score_mod is not None else score
        if op.mask_mod is not None:
            s = torch.where(evaluate(op.mask_mod, env, dev).to(torch.bool), s, -math.inf)
        return s

    with warnings.catch_warnings():   # eager flex_attention warns that it is unfused; that is the documented cost
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if hasattr(fx, "AuxRequest"):    # torch >= 2.9; before it, return_lse=True
            o, aux = fx.flex_attention(qh, kh, vh, score_mod=score_mod, scale=op.scale,
                                       return_aux=fx.AuxRequest(lse=True))
            lse = aux.lse
        else:
            o, lse = fx.flex_attention(qh, kh, vh, score_mod=score_mod, scale=op.scale, return_lse=True)
    row_lse = _plus_inf_is_nan(lse.float())
    dead = row_lse == -math.inf                                      # no visible key: 0 and -inf
    return o.masked_fill(dead[..., None], 0.0), row_lse


def _sequences(op: Attention, q, k, v, out, lse, aux) -> Iterator[tuple]:
    """Each batch entry of any KV layout as dense tensors: pages gathered, varlen sliced, ``seqlens_k`` applied."""
    if op.kv_layout is KVLayout.VARLEN:
        cu_q, cu_k = aux["cu_seqlens_q"].tolist(), aux["cu_seqlens_k"].tolist()
        for b in range(op.batch):
            qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            yield b, q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], None if lse is None else lse[:, qs:qe]
        out[cu_q[-1]:] = 0                  # rows after the last sequence see no keys
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
