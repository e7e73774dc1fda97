"""Input checks for the public ops: turn user arrays and options into a verified IR node.

Runs once per call signature (the result is cached by dispatch), before anything launches.
Every failure is a ``PortakernError`` naming the argument, the value, the rule and the way out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from portakern.ir import expr as E
from portakern.ir.dtypes import STORAGE_FLOATS, DType
from portakern.ir.expr import Expr
from portakern.ir.ops import Attention, KVLayout, QuantGemv

from .arrays import device_of, dtype_of, kind_of
from .devices import Device
from .errors import InvalidInputError, InvalidTypeError

INDEX_DTYPES = (DType.int32, DType.int64)


@dataclass(frozen=True)
class ArrayInfo:
    kind: str
    device: Device
    dtype: DType
    shape: tuple[int, ...]


_FLOAT_RULE = "float16, bfloat16 or float32"
_ANY_RULE = "float16, bfloat16, float32, float64, int8, uint8, int32 or int64"

#: float32's smallest normal and largest finite values: a scale or softcap outside them is inf / 0 / subnormal in
#: the kernels' float32 arithmetic while the float64 reference computes with it
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def check_dense_array(a: Any, kind: str, argument: str) -> None:
    """Reject the array flavours whose values a kernel cannot read as a plain strided buffer.

    A sparse torch tensor (any layout but ``torch.strided``) has no dense storage; a numpy masked
    array carries a mask every kernel would silently ignore.
    """
    if kind == "torch":
        import torch

        if a.layout != torch.strided:
            raise InvalidTypeError(f"{argument} is a torch tensor with layout={a.layout}: sparse tensors are not "
                                   f"supported; pass {argument}.to_dense()")
    elif kind == "numpy" and isinstance(a, np.ma.MaskedArray):
        raise InvalidTypeError(f"{argument} is a numpy masked array: masked arrays are not supported (the mask "
                               f"would be ignored); pass np.ma.filled({argument}, fill) or {argument}.data")


def describe(a: Any, argument: str, rule: str | None = None) -> ArrayInfo:
    """Kind, device, IR dtype and shape of an array argument.

    ``rule`` completes the dtype message when the dtype is not one portakern knows at all
    (complex, bool, str, object, ...): e.g. "attention inputs must be float16, bfloat16 or float32".
    """
    kind = kind_of(a, argument)
    check_dense_array(a, kind, argument)
    try:
        dtype = dtype_of(a, kind)
    except InvalidInputError:
        name = str(a.dtype).removeprefix("torch.")
        raise InvalidTypeError(f"{argument} has dtype {name}: {rule or 'arrays must be ' + _ANY_RULE}; "
                               f"convert {argument} to one of them first") from None
    try:
        device = device_of(a, kind)
    except InvalidTypeError as e:   # a torch device no backend runs on (meta): say which argument is there
        raise InvalidTypeError(f"{argument}: {e}") from None
    return ArrayInfo(kind, device, dtype, tuple(a.shape))


def _is_real(x: Any) -> bool:
    """A Python or numpy real scalar (int, float, np.integer, np.floating); bools are not numbers here."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    """A real scalar (``_is_real``) whose value is a finite float; an int too large for a float is not."""
    try:
        return _is_real(x) and math.isfinite(x)
    except OverflowError:  # math.isfinite(10**400) cannot convert the int
        return False


#: Largest window side: ``position + side`` must not wrap in a backend's int32 position math (Triton's does;
#: the reference's is int64), for positions up to 2**30. A longer side is unbounded in effect: -1 says so.
WINDOW_SIDE_MAX = 2 ** 30


def _as_bool(x: Any) -> Any:
    """A numpy bool as the Python bool it equals; anything else unchanged (the caller type-checks it)."""
    return bool(x) if isinstance(x, np.bool_) else x


def _is_int(x: Any) -> bool:
    """A Python or numpy integer scalar; bools are not integers here."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _same_place(infos: dict[str, ArrayInfo]) -> None:
    first_name, first = next(iter(infos.items()))
    for name, info in infos.items():
        if info.kind != first.kind:
            raise InvalidTypeError(
                f"{name} is a {info.kind} array but {first_name} is a {first.kind} array: mixed array "
                f"libraries are not allowed; convert {name} to {first.kind} first")
        if info.device != first.device:
            raise InvalidTypeError(
                f"{name} is on {info.device} but {first_name} is on {first.device}: every input must be "
                f"on one device; move {name} with .to({str(first.device)!r})")


def _check_last_dim_contiguous(a: Any, kind: str, argument: str, dim: str) -> None:
    """``dim`` names the last dimension for the message: "head_dim" for q/k/v, "K" for x.

    A 0-d array has no last dimension: it passes here and the caller's rank check names it."""
    if len(a.shape) == 0 or a.shape[-1] <= 1 or 0 in a.shape:  # 0-d, one element per row, or empty: no layout
        return
    itemsize = 0 if kind == "torch" else a.dtype.itemsize  # pyopencl arrays have no .itemsize
    if kind != "torch" and a.strides[-1] % itemsize:  # a structured array's field
        raise InvalidInputError(
            f"{argument} has a stride of {a.strides[-1]} bytes in its last ({dim}) dimension, not a multiple of its "
            f"{itemsize}-byte elements: the innermost dimension must be contiguous; pass "
            f"numpy.ascontiguousarray({argument})")
    stride = a.stride(-1) if kind == "torch" else a.strides[-1] // itemsize
    if stride != 1:
        raise InvalidInputError(
            f"{argument} has stride {stride} in its last ({dim}) dimension: the innermost dimension "
            f"must be contiguous; pass {argument}.contiguous() (torch) or numpy.ascontiguousarray({argument})")


def _host_values(a: Any, kind: str):
    """numpy copy of an index array (a device->host copy for GPU arrays: first call only)."""
    from .arrays import to_numpy

    return to_numpy(a)


def _mods(causal, window, softcap, score_mod, mask_mod) -> tuple[Expr | None, Expr | None]:
    causal = _as_bool(causal)
    if not isinstance(causal, bool):
        raise InvalidTypeError(f"causal={causal!r} must be True or False")
    if score_mod is not None and not isinstance(score_mod, Expr):
        raise InvalidTypeError(f"score_mod={score_mod!r} must be a portakern.ir.Expr (see portakern.ir.expr)")
    if mask_mod is not None and not isinstance(mask_mod, Expr):
        raise InvalidTypeError(f"mask_mod={mask_mod!r} must be a portakern.ir.Expr (see portakern.ir.expr)")
    if score_mod is not None and score_mod.is_bool():
        raise InvalidInputError(f"score_mod={score_mod} is a boolean expression: pass masks as mask_mod")
    if mask_mod is not None and not mask_mod.is_bool():
        raise InvalidInputError(f"mask_mod={mask_mod} is not a boolean expression: it must say which keys are kept")
    if not _is_finite(softcap) or softcap < 0:
        raise InvalidInputError(f"softcap={softcap!r} must be a finite number >= 0 (0 disables soft-capping)")
    if softcap and not _F32_TINY <= softcap <= _F32_MAX:
        raise InvalidInputError(f"softcap={softcap!r} is outside float32's normal range [{_F32_TINY:.3g}, "
                                f"{_F32_MAX:.3g}], in which the kernels compute it: pass 0 to disable soft-capping "
                                "or a cap in that range")
    masks = [] if mask_mod is None else [mask_mod]
    if causal:
        masks.insert(0, E.causal_mask())
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(_is_int(w) for w in window)):
            raise InvalidInputError(f"window={window!r} must be a (left, right) pair of ints; -1 means unbounded")
        if max(window) > WINDOW_SIDE_MAX:
            raise InvalidInputError(f"window={window!r}: each side must be at most {WINDOW_SIDE_MAX} (2**30) keys; "
                                    "pass -1 for a side that is unbounded")
        masks.append(E.window_mask(int(window[0]), int(window[1])))
    mask = None
    for m in masks:
        mask = m if mask is None else mask & m
    score = score_mod
    if softcap:
        cap = E.softcap_score(float(softcap))
        score = cap if score is None else E.compose_score(cap, score)
    return score, mask


def attention_op(q, k, v, *, causal=False, window=None, softcap=0.0, scale=None, score_mod=None,
                 mask_mod=None, block_table=None, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 return_lse=False, check_values=True, empty_ok=False) -> tuple[Attention, ArrayInfo]:
    """Validate the arguments of ``portakern.attention`` and build its ``Attention`` node.

    ``empty_ok``: a q of no query rows (batch 0 or seqlen_q 0; total_q 0 for varlen) is checked like any other
    and its node built for one row (the IR has no empty attention); the caller returns the empty result
    without running it."""
    rule = "attention inputs must be " + _FLOAT_RULE
    infos = {"q": describe(q, "q", rule), "k": describe(k, "k", rule), "v": describe(v, "v", rule)}
    _same_place(infos)
    qi, ki, vi = infos["q"], infos["k"], infos["v"]
    for name, info in infos.items():
        if info.dtype not in STORAGE_FLOATS:
            raise InvalidTypeError(f"{name} has dtype {info.dtype.value}: {rule}; cast {name} to one of them first")
    if not (qi.dtype == ki.dtype == vi.dtype):
        raise InvalidTypeError(f"q, k, v dtypes differ ({qi.dtype.value}, {ki.dtype.value}, {vi.dtype.value}): "
                               "cast them to one dtype")
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_last_dim_contiguous(a, infos[name].kind, name, "head_dim")
    return_lse = _as_bool(return_lse)
    if not isinstance(return_lse, bool):
        raise InvalidTypeError(f"return_lse={return_lse!r} must be True or False")

    index_args = {"block_table": block_table, "seqlens_k": seqlens_k,
                  "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    for name, a in index_args.items():
        if a is None:
            continue
        info = describe(a, name, "index arrays must be int32 or int64")
        _same_place({"q": qi, name: info})
        if info.dtype not in INDEX_DTYPES:
            raise InvalidTypeError(f"{name} has dtype {info.dtype.value}: index arrays must be int32 or int64; "
                                   f"convert {name} to one of them first")

    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    paged = block_table is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise InvalidInputError("varlen attention needs both cu_seqlens_q and cu_seqlens_k; one of them is None")
    if varlen and paged:
        raise InvalidInputError("block_table together with cu_seqlens_q/k is not supported: use paged KV with "
                                "a dense (B, Sq, Hq, D) q, or varlen with contiguous K/V")
    if varlen and seqlens_k is not None:
        raise InvalidInputError("seqlens_k must be None for varlen attention: key lengths come from cu_seqlens_k")
    if paged and seqlens_k is None:
        raise InvalidInputError("paged attention (block_table given) needs seqlens_k, the number of valid "
                                "keys per batch entry")

    want = 3 if varlen else 4
    for name, info in infos.items():
        if len(info.shape) != want:
            layout = "(total, H, D) for varlen" if varlen else "(B, S, H, D)" if not paged or name == "q" \
                else "(num_pages, page_size, Hkv, D) for paged KV"
            raise InvalidInputError(f"{name} has shape {info.shape}: expected {want} dimensions, {layout}")
    D, Dv = qi.shape[-1], vi.shape[-1]
    Hq, Hkv = qi.shape[-2], ki.shape[-2]
    if ki.shape[-1] != D:
        raise InvalidInputError(f"k head_dim {ki.shape[-1]} != q head_dim {D}: q and k must share head_dim")
    if ki.shape[:-1] != vi.shape[:-1]:
        raise InvalidInputError(f"k shape {ki.shape} and v shape {vi.shape} must agree in all but the last dimension")
    # heads and head dims divide (Hq % Hkv, 1/sqrt(D), ...): check them before anything uses them
    for name, info, what, size in (("q", qi, "heads (Hq)", Hq), ("k", ki, "heads (Hkv)", Hkv),
                                   ("q", qi, "head_dim (D)", D), ("v", vi, "head_dim (Dv)", Dv)):
        if size < 1:
            raise InvalidInputError(f"{name} has shape {info.shape} with {what} = {size}: the number of heads and the "
                                    "head dims must be >= 1; pass non-empty arrays")
    if Hq % Hkv:
        raise InvalidInputError(f"q has {Hq} heads and k has {Hkv}: the number of query heads must be a multiple "
                                "of the number of KV heads (grouped-query attention)")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if not _is_finite(scale) or scale == 0:
        raise InvalidInputError(f"scale={scale!r} must be a finite non-zero number (default 1/sqrt(head_dim))")
    if not _F32_TINY <= abs(scale) <= _F32_MAX:
        raise InvalidInputError(f"scale={scale!r} is outside float32's normal range (magnitude in [{_F32_TINY:.3g}, "
                                f"{_F32_MAX:.3g}]), in which the kernels apply it; fold the rest into q, or leave "
                                "scale=None for 1/sqrt(head_dim)")
    score, mask = _mods(causal, window, softcap, score_mod, mask_mod)
    common = dict(heads_q=Hq, heads_kv=Hkv, head_dim=D, head_dim_v=Dv, dtype=qi.dtype, scale=float(scale),
                  score_mod=score, mask_mod=mask, return_lse=return_lse)

    if varlen:
        cq = describe(cu_seqlens_q, "cu_seqlens_q").shape
        if len(cq) != 1 or cq[0] < 2:  # rank first: a 0-d array has no length to read
            raise InvalidInputError(f"cu_seqlens_q has shape {cq}: expected a 1-D (batch + 1,) array with batch >= 1, "
                                    "e.g. [0, len_0, len_0 + len_1, ...]")
        B = cq[0] - 1
        for name, a, total in (("cu_seqlens_q", cu_seqlens_q, qi.shape[0]), ("cu_seqlens_k", cu_seqlens_k, ki.shape[0])):
            shp = describe(a, name).shape
            if len(shp) != 1 or shp[0] != B + 1 or B < 1:
                raise InvalidInputError(f"{name} has shape {shp}: expected (batch + 1,) = ({B + 1},) with batch >= 1")
            if check_values:
                c = _host_values(a, qi.kind)
                if c[0] != 0 or (c[1:] < c[:-1]).any() or c[-1] != total:
                    raise InvalidInputError(f"{name}={c.tolist()[:8]}... must start at 0, never decrease and end at "
                                            f"{total} (the first dimension of {'q' if name.endswith('q') else 'k'})")
        if not empty_ok:
            _nonempty("q", qi.shape, (("total_q", qi.shape[0], _SKIP),))
        _nonempty("k", ki.shape, (("total_k", ki.shape[0], "with no keys every output row is 0 (lse -inf): skip the "
                                                           "call and use zeros"),))
        tq = max(qi.shape[0], 1)
        op = Attention(batch=B, seqlen_q=tq, seqlen_k=ki.shape[0], kv_layout=KVLayout.VARLEN,
                       total_q=tq, total_k=ki.shape[0], **common)
    elif paged:
        B, Sq = qi.shape[0], qi.shape[1]
        P, page = ki.shape[0], ki.shape[1]
        if not empty_ok:
            _nonempty("q", qi.shape, (("batch", B, _SKIP), ("seqlen_q", Sq, _SKIP)))
        if P < 1 or page < 1:  # page divides key positions below
            raise InvalidInputError(f"k has shape {ki.shape}: paged KV needs num_pages >= 1 and page_size >= 1 "
                                    "in (num_pages, page_size, Hkv, D)")
        bt = describe(block_table, "block_table").shape
        if len(bt) != 2 or bt[0] != B:
            raise InvalidInputError(f"block_table has shape {bt}: expected (batch, max_pages) = ({B}, max_pages)")
        _nonempty("block_table", bt, (("max_pages", bt[1], "give every batch entry at least one page column "
                                                           "(seqlens_k 0 marks an entry with no keys)"),))
        sk = describe(seqlens_k, "seqlens_k").shape
        if sk != (B,):
            raise InvalidInputError(f"seqlens_k has shape {sk}: expected (batch,) = ({B},)")
        if check_values:
            t, s = _host_values(block_table, qi.kind), _host_values(seqlens_k, qi.kind)
            if (s < 0).any():
                b_ = int(np.flatnonzero(s < 0)[0])
                raise InvalidInputError(f"seqlens_k[{b_}]={int(s[b_])} is negative: key lengths must be >= 0 "
                                        "(0 for a batch entry with no keys, whose rows return zeros)")
            if (s > bt[1] * page).any():
                bad = int(s.max())
                raise InvalidInputError(f"seqlens_k has a value {bad} longer than the block table holds "
                                        f"({bt[1]} pages x page_size {page} = {bt[1] * page} keys); pass a "
                                        "wider block_table")
            for b_ in range(B):
                used = t[b_, : -(-int(s[b_]) // page)]
                if used.size and (used.min() < 0 or used.max() >= P):
                    raise InvalidInputError(f"block_table[{b_}] references page {int(used.max() if used.max() >= P else used.min())} "
                                            f"but k has {P} pages (valid 0..{P - 1})")
        op = Attention(batch=max(B, 1), seqlen_q=max(Sq, 1), seqlen_k=bt[1] * page, kv_layout=KVLayout.PAGED,
                       page_size=page,
                       num_pages=P, has_seqlens_k=True, **common)
    else:
        B, Sq, Sk = qi.shape[0], qi.shape[1], ki.shape[1]
        if ki.shape[0] != B:
            raise InvalidInputError(f"k has batch {ki.shape[0]} but q has batch {B}: they must match")
        if not empty_ok:
            _nonempty("q", qi.shape, (("batch", B, _SKIP), ("seqlen_q", Sq, _SKIP)))
        _nonempty("k", ki.shape, (("seqlen_k", Sk, _KEEP_A_KEY),))
        if seqlens_k is not None:
            sk = describe(seqlens_k, "seqlens_k").shape
            if sk != (B,):
                raise InvalidInputError(f"seqlens_k has shape {sk}: expected (batch,) = ({B},)")
            if check_values:
                s = _host_values(seqlens_k, qi.kind)
                if (s < 0).any() or (s > Sk).any():
                    raise InvalidInputError(f"seqlens_k={s.tolist()[:8]} must lie in [0, {Sk}] (the key length of k)")
        op = Attention(batch=max(B, 1), seqlen_q=max(Sq, 1), seqlen_k=Sk, has_seqlens_k=seqlens_k is not None,
                       **common)
    return op.verify(), qi


_SKIP = ("portakern.attention returns the empty result for it without a kernel; there is no kernel to run or "
         "explain")
_KEEP_A_KEY = ("keep at least one key slot and pass seqlens_k (0 for an entry with no keys, whose rows return "
               "zeros)")


def _nonempty(argument: str, shape: tuple[int, ...], sizes: tuple[tuple[str, int, str], ...]) -> None:
    """Raise naming ``argument`` and its shape when a size the node needs positive is 0 (an empty array)."""
    for field, size, way_out in sizes:
        if size < 1:
            raise InvalidInputError(f"{argument} has shape {shape}: {field}={size} must be a positive int; {way_out}")


def check_prologue(prologue) -> None:
    """Raise ``InvalidInputError`` unless ``prologue`` is None or one of ``X_PROLOGUES``."""
    from portakern.ir.ops import X_PROLOGUES

    if prologue is not None and prologue not in X_PROLOGUES:
        raise InvalidInputError(f"prologue={prologue!r} is not a quant_gemv prologue: use None or one of "
                                f"{', '.join(map(repr, X_PROLOGUES))}")


def quant_gemv_op(x, w, prologue: str | None = None, empty_ok: bool = False) -> tuple[QuantGemv, ArrayInfo]:
    """Validate the arguments of ``portakern.quant_gemv`` and build its ``QuantGemv`` node.

    ``empty_ok``: an ``x`` of zero rows is checked like any other and its node built for one row (the IR has no
    empty GEMV); the caller returns the ``(0, N)`` result without running it."""
    from .quantized import QuantizedWeight

    check_prologue(prologue)
    xi = describe(x, "x", "activations must be " + _FLOAT_RULE)
    if not isinstance(w, QuantizedWeight):
        raise InvalidTypeError(f"w is a {type(w).__name__}: expected a portakern.QuantizedWeight; build one with "
                               "portakern.quantize(w) or QuantizedWeight.from_gguf/from_awq/from_gptq")
    if xi.dtype not in STORAGE_FLOATS:
        raise InvalidTypeError(f"x has dtype {xi.dtype.value}: activations must be {_FLOAT_RULE}; convert x to one "
                               "of them first")
    if len(xi.shape) != 2:
        raise InvalidInputError(f"x has shape {xi.shape}: expected (M, K) = (M, {w.K}); reshape a vector with x[None]")
    M, K = xi.shape
    if prologue == "silu_mul":
        if K != 2 * w.K:
            raise InvalidInputError(f"x has {K} columns but w is ({w.N}, {w.K}) and prologue='silu_mul' reads gate "
                                    f"and up from x: x must be (M, 2 * {w.K}) = (M, {2 * w.K}), gate first")
        K = w.K
    elif K != w.K:
        raise InvalidInputError(f"x has K={K} columns but w is ({w.N}, {w.K}): x must be (M, {w.K})")
    _check_last_dim_contiguous(x, xi.kind, "x", "K")
    for name, t in w.tensors.items():
        ti = describe(t, f"w.tensors[{name!r}]")
        if ti.device != xi.device:
            raise InvalidTypeError(f"w.tensors[{name!r}] is on {ti.device} but x is on {xi.device}: move the weight "
                                   f"with w.to({str(xi.device)!r})")
    op = QuantGemv(M=1 if empty_ok and M == 0 else M, N=w.N, K=K, dtype=xi.dtype, fmt=w.fmt, prologue=prologue)
    return op.verify(), xi
