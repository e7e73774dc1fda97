"""The public ops: ``attention``, ``quant_gemv``, and the introspection calls around them."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from numpy import ndarray as _ndarray

from portakern.ir.dtypes import DType

from . import dispatch
from .arrays import _KINDS, adopt, convert_for_backend, empty, kind_of, to_caller
from .backend import Backend
from .devices import Device, detect_devices
from .dispatch import Decision, Plan
from .errors import InvalidTypeError, PortakernError, UnsupportedError
from .lengths import attention_axes
from .plugins import registry
from .validate import attention_op, quant_gemv_op


def _sig(a: Any) -> tuple | None:
    """Hashable signature of one array: type, shape, dtype, device, strides."""
    if a is None:
        return None
    if type(a) is _ndarray:  # hot path: a plain numpy array lives on the host
        return (a.shape, a.dtype, a.strides)
    try:
        return (a.shape, a.dtype, a.device, a.stride())  # torch
    except AttributeError:
        pass
    except RuntimeError:   # a sparse torch tensor has no strides: the plan miss validates it and names it
        return (type(a), id(a))
    except TypeError:
        return (type(a), a.shape, a.dtype, a.strides, a.device)
    try:
        # numpy subclass / cupy / pyopencl (its device is its queue's: the context names it)
        return (type(a), a.shape, a.dtype, a.strides, getattr(a, "device", None) or getattr(a, "context", None))
    except AttributeError:
        return (type(a), id(a))  # not an array: the plan miss validates it and names the argument


# -- attention ---------------------------------------------------------------------------------

def attention(q, k, v, *, causal=False, window=None, softcap=0.0, scale=None, score_mod=None, mask_mod=None,
              block_table=None, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, return_lse=False,
              backend=None):
    """Scaled dot-product attention, on the fastest backend that supports the inputs.

    Args:
      q: ``(B, Sq, Hq, D)`` queries (``(total_q, Hq, D)`` for varlen); numpy, torch or cupy,
        float16 / bfloat16 / float32. The output has the same array type, device and dtype. Any other
        DLPack array (JAX, MLX) is read through DLPack, and the output is then a numpy array (host) or
        torch tensor (device): ``portakern.arrays.adopt``.
      k, v: ``(B, Sk, Hkv, D)`` / ``(B, Sk, Hkv, Dv)`` keys and values; ``(num_pages, page_size,
        Hkv, D)`` when ``block_table`` is given; ``(total_k, Hkv, D)`` for varlen. ``Hq % Hkv == 0``.
      causal: bottom-right aligned causal mask (query i sees key j iff ``j <= i + Sk - Sq``).
      window: ``(left, right)`` sliding window around the aligned diagonal; -1 = unbounded; each side
        at most ``2**30``.
      softcap: if > 0, scores become ``softcap * tanh(score / softcap)``.
      scale: score scale, default ``1 / sqrt(D)``.
      score_mod, mask_mod: ``portakern.ir.Expr`` trees (see ``portakern.ir.expr``) applied to
        every score / deciding which keys are visible; combined with the flags above.
      block_table, seqlens_k: paged KV: key t of batch b lives at
        ``k[block_table[b, t // page_size], t % page_size]`` for ``t < seqlens_k[b]``. With
        dense k, ``seqlens_k`` alone gives per-batch key lengths.
      cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` cumulative lengths for varlen (packed) batches.
      return_lse: also return the natural-log sum-exp of the scores, float32 ``(B, Hq, Sq)``
        (``(Hq, total_q)`` for varlen); ``-inf`` for rows with every key masked.
      backend: run on this backend by name (no fallback); see ``portakern.list_backends()``.

    Returns:
      ``out`` ``(B, Sq, Hq, Dv)``, or ``(out, lse)`` when ``return_lse``. Rows with every key
      masked are zeros. A ``q`` of no query rows (B or Sq 0; total_q 0 for varlen) is checked like
      any other and gives empty results without a kernel.

    Raises:
      InvalidInputError / InvalidTypeError for bad arguments; UnsupportedError when no backend
      (or not the one named) can run the problem; BackendError when a forced backend fails.
    """
    if not (type(q) in _KINDS and type(k) in _KINDS and type(v) in _KINDS):  # DLPack-only arrays (JAX, MLX)
        q, k, v, block_table, seqlens_k, cu_seqlens_q, cu_seqlens_k = (
            adopt(a, n) for a, n in zip((q, k, v, block_table, seqlens_k, cu_seqlens_q, cu_seqlens_k), _ATT_ARRAYS))
    has_aux = not (block_table is None and seqlens_k is None and cu_seqlens_q is None and cu_seqlens_k is None)
    key = _attention_key(q, k, v, causal, window, softcap, scale, score_mod, mask_mod, block_table, seqlens_k,
                         cu_seqlens_q, cu_seqlens_k, return_lse, backend, has_aux)

    def options() -> dict:
        return dict(causal=causal, window=window, softcap=softcap, scale=scale, score_mod=score_mod,
                    mask_mod=mask_mod, block_table=block_table, seqlens_k=seqlens_k, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, return_lse=return_lse)

    try:
        plan = dispatch.get_plan(key, lambda: _attention_node(q, k, v, options(), has_aux), backend)
    except _EmptyBatch:  # found on the plan miss, so a cached call pays nothing for it
        return _empty_attention(key, q, k, v, options(), backend, has_aux)
    aux = {"block_table": block_table, "seqlens_k": seqlens_k, "cu_seqlens_q": cu_seqlens_q,
           "cu_seqlens_k": cu_seqlens_k}
    if has_aux and plan.decision.device.type == "cpu":
        attention_op(q, k, v, **options())  # index values are re-checked on the host every call
    while True:
        try:
            return _run_attention(plan, q, k, v, aux, has_aux)
        except PortakernError:
            raise
        except Exception as e:
            plan = dispatch.fall_back(key, plan, e)


def _attention_key(q, k, v, causal, window, softcap, scale, score_mod, mask_mod, block_table, seqlens_k,
                   cu_seqlens_q, cu_seqlens_k, return_lse, backend, has_aux) -> tuple:
    """The plan key of an attention call: its shape class (``portakern.lengths``: every sequence length as its
    class, ``k`` and ``v`` of one key length or not) and its scalar options with their types (1 == True == 1.0
    hash alike, and a plan hit skips validation)."""
    if has_aux:
        qa, ka, ba = attention_axes(block_table is not None, not (cu_seqlens_q is None and cu_seqlens_k is None))
        aux = (_csig(block_table, ba), _sig(seqlens_k), _sig(cu_seqlens_q), _sig(cu_seqlens_k))
    else:
        qa = ka = 1
        aux = None
    return ("attention", _csig(q, qa), _csig(k, ka), _csig(v, ka), _same_length(k, v, ka), aux,
            causal, type(causal), None if window is None else _window_key(window),
            softcap, type(softcap), scale, type(scale), score_mod, mask_mod, return_lse, type(return_lse),
            dispatch.override_key(backend))


def _csig(a: Any, axis: int | None) -> tuple | None:
    """The shape-class signature of one numpy or torch array: its shape with the length ``axis`` (None: none) as
    ``length_class`` of it, dtype, device and innermost stride (validation reads no other stride; kernels take
    strides at run time). Other array types: their exact signature (``_sig``)."""
    if type(a) is _ndarray:
        s = a.shape
        if axis is not None and len(s) > axis and s[axis] > 2:
            s = (*s[:axis], 2, *s[axis + 1:])
        return (s, a.dtype, a.strides[-1:])
    try:
        s, st = a.shape, a.stride()[-1:]  # torch
        if axis is not None and len(s) > axis and s[axis] > 2:
            s = (*s[:axis], 2, *s[axis + 1:])
        return (type(a), s, a.dtype, a.device, st)
    except (AttributeError, RuntimeError, TypeError):
        return _sig(a)


def _same_length(k: Any, v: Any, axis: int | None) -> bool | None:
    """Whether ``k`` and ``v`` have one length along their length ``axis`` (a relation validation checks, kept in
    the key as the lengths are not); None when there is no such axis or no shapes to compare."""
    if axis is None:
        return None
    try:
        return k.shape[axis] == v.shape[axis]
    except (AttributeError, IndexError, TypeError):
        return None


def _window_key(window) -> Any:
    """``window`` as part of a plan key: a tuple of its items (with their types), or itself when it is not a
    sequence (validation then names it)."""
    try:
        return tuple((w, type(w)) for w in window)
    except TypeError:
        return window


def _attention_node(q, k, v, kwargs, has_aux):
    """On a plan miss: the op, its device, and a runner for measuring (fresh outputs and aux per run)."""
    if _no_query_rows(q, kwargs["cu_seqlens_q"] is not None or kwargs["cu_seqlens_k"] is not None):
        raise _EmptyBatch
    op, qi = attention_op(q, k, v, **kwargs)
    names = ("block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
    return op, qi.device, lambda trial: _run_attention(trial, q, k, v, {n: kwargs[n] for n in names}, has_aux)


def _no_query_rows(q, varlen: bool) -> bool:
    """Whether ``q`` has no query rows: batch or seqlen_q 0 in ``(B, Sq, Hq, D)``, total_q 0 in varlen's
    ``(total_q, Hq, D)`` (empty heads or head dims are errors, left to validation)."""
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) != (3 if varlen else 4):
        return False
    rows = shape[:1] if varlen else shape[:2]
    return 0 in tuple(rows)


def _empty_attention(key, q, k, v, kwargs, backend, has_aux):
    """The empty result of a q without query rows, after the checks any other call gets. Like a plan, the checks run
    on a signature's first call only (no host read of CUDA index arrays after it, so the call can be captured in a
    CUDA graph); on the CPU index values are checked every call, as for a call with rows."""
    make = dispatch.empty_result(key)              # None too for a key that cannot be hashed: validation names it
    if make is not None:
        return make(q)
    _check_backend_name(backend)
    op, qi = attention_op(q, k, v, **kwargs, empty_ok=True)
    _check_forced_support(op, qi.device, backend)
    rows = tuple(qi.shape[:-2])                    # (B, Sq), or (total_q,) for varlen
    out_shape = (*rows, op.heads_q, op.head_dim_v)
    lse_shape = None
    if op.return_lse:
        lse_shape = (op.heads_q, rows[0]) if kwargs["cu_seqlens_q"] is not None else (rows[0], op.heads_q, rows[1])
    kind, device, dtype = qi.kind, qi.device, op.dtype

    def make(q):
        like = q if kind == "torch" else None
        out = to_caller(empty(kind, out_shape, dtype, device, like=like), kind, q, dtype)
        if lse_shape is None:
            return out
        return out, to_caller(empty(kind, lse_shape, _F32, device, like=like), kind, q, _F32)

    if not (has_aux and device.type == "cpu"):
        dispatch.remember_empty_result(key, make)
    return make(q)


def _check_backend_name(backend) -> None:
    """The backend checks a call without a kernel still makes: backend='s type, and that the forced name (backend=,
    else ``use_backend()``'s, else ``$PORTAKERN_BACKEND``) is registered, as ``dispatch.decide`` checks it."""
    dispatch.override_key(backend)
    forced, _ = dispatch.override(backend)
    if forced is not None:
        registry().get(forced)


def _check_forced_support(op, device, backend) -> None:
    """An empty call with a forced backend (backend=, ``use_backend()``, ``$PORTAKERN_BACKEND``) is refused where the
    same call with rows would be: that backend must support the one-row problem the call stands for (``op``, built by
    validation with ``empty_ok``), else ``UnsupportedError`` with the backend's reason and the way out. Nothing is
    compiled; without a forced backend an empty call needs no backend at all."""
    if dispatch.override(backend)[0] is None:
        return
    try:
        dispatch.decide(op, device, backend)
    except UnsupportedError as e:
        raise UnsupportedError(f"{e} (a call without rows is checked as its problem with one row)") from None


def _same_arrays(caller: str, kind: str, dtype: DType) -> bool:
    """Whether the caller's arrays are already what the backend receives (no conversion at all).

    The plan's signature fixed the array types and devices, and every input is on the plan's
    device; only numpy's bfloat16 (ml_dtypes) still needs converting to float32 for numpy backends.
    """
    return caller == kind and (kind == "torch" or dtype is not DType.bfloat16)


def _run_attention(plan: Plan, q, k, v, aux: dict, has_aux: bool):
    op, device, be = plan.decision.op, plan.decision.device, plan.backend
    kind, caller = be.array_kind, kind_of(q)
    if _same_arrays(caller, kind, op.dtype):
        qb, kb, vb, auxb = q, k, v, aux  # aux is a fresh dict per call
    else:
        qb, kb, vb = (convert_for_backend(q, be, device), convert_for_backend(k, be, device),
                      convert_for_backend(v, be, device))
        auxb = {n: None if a is None else convert_for_backend(a, be, device) for n, a in aux.items()} \
            if has_aux else aux
    bound, bt = plan.last, aux["block_table"]  # the kernel and output shapes at the lengths of the last call
    if be.runtime_lengths:
        lengths = q.shape  # its kernel reads the lengths; the output shapes follow q alone
    else:
        lengths = (q.shape, k.shape) if bt is None else (q.shape, k.shape, bt.shape)
    if bound is None or bound[0] != lengths:
        bound = dispatch.bind(plan, lengths, q.shape, k.shape, None if bt is None else bt.shape)
    shapes, poison = bound[2], dispatch.poisoning()
    out = empty(kind, shapes["out"], op.dtype, device, poison, like=qb)
    lse = empty(kind, shapes["lse"], _F32, device, poison, like=qb) if op.return_lse else None
    (plan.kernel if be.runtime_lengths else bound[1])(qb, kb, vb, out, lse, auxb)
    res = to_caller(out, caller, q, op.dtype)
    if lse is None:
        return res
    return res, to_caller(lse, caller, q, _F32)


# -- quantized GEMV ----------------------------------------------------------------------------

def quant_gemv(x, w, *, prologue=None, backend=None):
    """``x @ dequant(w).T`` for activations ``x (M, K)`` and a ``QuantizedWeight`` ``w (N, K)``.

    Accumulates in float32 (or better); returns ``(M, N)`` with the array type, device and dtype
    of ``x``. M from 1 to 16 is the decode regime the device kernels are tuned for; any M works.
    A backend may repack ``w`` once on first use (cached on ``w.prepared``).

    ``prologue="silu_mul"``: ``x`` is ``(M, 2K)``, gate then up (a fused gate/up projection's output),
    and the GEMV's input is ``silu(gate) * up`` formed in float32 inside the kernel -- an MLP's
    down projection without a separate activation kernel. Only backends that list the prologue in
    ``x_prologues`` are offered it (cpu and triton do).

    An ``x`` of zero rows is checked like any other and gives an empty ``(0, N)`` result without a
    kernel (as ``torch.ops.portakern.quant_gemv`` does).

    Raises:
      InvalidInputError / InvalidTypeError for bad arguments (shape, dtype, device, weight type);
      UnsupportedError when no backend (or not the one named) supports the problem.
    """
    if type(x) not in _KINDS:
        x = adopt(x, "x")  # a DLPack-only array (JAX, MLX)
    key = _gemv_key(x, w, prologue, backend)
    try:
        plan = dispatch.get_plan(key, lambda: _gemv_node(x, w, prologue), backend)
    except _EmptyBatch:  # found on the plan miss, so a cached call pays nothing for it
        return _empty_gemv(key, x, w, prologue, backend)
    while True:
        try:
            return _run_gemv(plan, x, w)
        except PortakernError:
            raise
        except Exception as e:
            plan = dispatch.fall_back(key, plan, e)


def _gemv_key(x, w, prologue, backend) -> tuple:
    """The plan key of a quant_gemv call (M stays exact: backends' support depends on it)."""
    return ("quant_gemv", _sig(x), getattr(w, "fmt", None), getattr(w, "N", None), getattr(w, "K", None),
            _weight_place(w), prologue, dispatch.override_key(backend))


def _empty_gemv(key, x, w, prologue, backend):
    """The ``(0, N)`` result of an empty batch, after the checks a batch of rows gets (on a signature's first call
    only, as for a plan)."""
    make = dispatch.empty_result(key)
    if make is None:
        _check_backend_name(backend)
        op, xi = quant_gemv_op(x, w, prologue, empty_ok=True)
        _check_forced_support(op, xi.device, backend)
        kind, device, shape, dtype = xi.kind, xi.device, (0, op.N), op.result_dtype

        def make(x):
            return to_caller(empty(kind, shape, dtype, device, like=x if kind == "torch" else None), kind, x, dtype)

        dispatch.remember_empty_result(key, make)
    return make(x)


def _weight_place(w) -> tuple:
    t = next(iter(getattr(w, "tensors", {}).values()), None)
    return (type(t), getattr(t, "device", None))


class _EmptyBatch(Exception):
    """Raised on a plan miss by ``_gemv_node`` for an ``x`` of zero rows and by ``_attention_node`` for a ``q`` of no
    query rows, which have no plan (the IR has no empty GEMV or attention)."""


def _gemv_node(x, w, prologue=None):
    """On a plan miss: the op, its device, and a runner for measuring (fresh output per run)."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] == 0:
        raise _EmptyBatch
    op, xi = quant_gemv_op(x, w, prologue)
    return op, xi.device, lambda trial: _run_gemv(trial, x, w)


def _run_gemv(plan: Plan, x, w):
    op, device, be = plan.decision.op, plan.decision.device, plan.backend
    pkey = (be.weight_layout or be.name, str(device))   # backends of one layout share the prepared copy
    prepared = w.prepared.get(pkey)
    if prepared is None:
        prepared = w.prepared[pkey] = be.prepare_weight(w, device)
    caller = kind_of(x)
    xb = x if _same_arrays(caller, be.array_kind, op.dtype) else convert_for_backend(x, be, device)
    out = empty(be.array_kind, (op.M, op.N), op.result_dtype, device, dispatch.poisoning(), like=xb)
    plan.kernel(xb, prepared, out)
    return to_caller(out, caller, x, op.result_dtype)


# -- introspection -----------------------------------------------------------------------------

def explain(fn, *args, **kwargs) -> Decision:
    """Run dispatch for ``fn(*args, **kwargs)`` without executing, and return the decision.

    ``fn`` is ``portakern.attention`` or ``portakern.quant_gemv`` (or their names). The
    decision lists every candidate with its priority and, when rejected, the reason; the chosen
    backend; and any fallbacks that happened. ``str(decision)`` is a readable table.

    When a call of this shape class (``portakern.lengths``) has already run, the decision is the one its cached
    plan runs: the backend it actually ran after any fallback, the fallbacks, and the plan's one-time cost
    (``plan_ms``, ``compile_ms``); ``op`` is the node at these arguments' own lengths. Before that call, the
    decision dispatch would make (``plan_ms`` None).

    Under ``use_policy("fastest")`` the ranking stored by an earlier call (this process or a
    previous one) orders the candidates and ``measured_us`` shows the times; before any call has
    measured, ``ranked_by`` is "not measured yet" and the order shown is by priority.

    Raises:
      InvalidTypeError when ``fn`` is neither op, or the arguments are not ones ``fn`` takes; otherwise
      what ``fn(*args, **kwargs)`` itself would raise before running (bad input, nothing supports it).
    """
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", "")
    public = {"attention": attention, "quant_gemv": quant_gemv}.get(name)
    if public is None:
        raise InvalidTypeError(f"explain(fn={fn!r}): fn must be portakern.attention or portakern.quant_gemv")
    try:  # the op's own arguments, no more (the validators take internal keywords such as check_values)
        call = inspect.signature(public).bind(*args, **kwargs)
    except TypeError as e:
        raise InvalidTypeError(f"explain(portakern.{name}, ...): {e}; pass the arguments of portakern.{name}") \
            from None
    backend = kwargs.pop("backend", None)
    dispatch.override_key(backend)  # a backend= that is not a str is the type error attention() raises
    if name == "attention":
        op, info = attention_op(*args, **kwargs)
    else:
        op, info = quant_gemv_op(*args, **kwargs)
    cached = _cached_decision(name, call)
    if cached is not None:
        return replace(cached, op=op, candidates=list(cached.candidates), fallbacks=list(cached.fallbacks))
    plan = dispatch.decide(op, info.device, backend)
    plan.decision.chosen = plan.order[0].name  # decide() raised if nothing supports the problem
    return plan.decision


def _cached_decision(name: str, call: inspect.BoundArguments) -> Decision | None:
    """The decision of the plan a call with these arguments runs (its shape class's, after any fallback), or None
    when no call has planned it yet."""
    call.apply_defaults()
    a = call.arguments
    if name == "attention":
        has_aux = not (a["block_table"] is None and a["seqlens_k"] is None and a["cu_seqlens_q"] is None
                       and a["cu_seqlens_k"] is None)
        key = _attention_key(a["q"], a["k"], a["v"], a["causal"], a["window"], a["softcap"], a["scale"],
                             a["score_mod"], a["mask_mod"], a["block_table"], a["seqlens_k"], a["cu_seqlens_q"],
                             a["cu_seqlens_k"], a["return_lse"], a["backend"], has_aux)
    else:
        key = _gemv_key(a["x"], a["w"], a["prologue"], a["backend"])
    plan = dispatch.cached_plan(key)
    return None if plan is None or plan.backend is None else plan.decision


def list_backends() -> list[Backend]:
    """Every registered backend, sorted by name (plugins that failed to load: ``plugin_errors()``)."""
    reg = registry()
    return [reg.backends[n] for n in sorted(reg.backends)]


def plugin_errors() -> list[tuple[str, str]]:
    """``(plugin, error)`` for each plugin that failed to import or register."""
    return list(registry().errors)


def devices() -> list[Device]:
    """Every device visible on this machine (CPU first)."""
    return detect_devices()


_F32 = DType.float32
_ATT_ARRAYS = ("q", "k", "v", "block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
