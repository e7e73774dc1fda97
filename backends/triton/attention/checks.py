"""Per-call checks of an attention kernel's operands: what a compiled signature cannot see.

A kernel checks a call's shapes, dtypes and inner strides (``check_operands``) and which index arrays it got
(``check_aux``) only when the call's ``layout_key`` differs from the last call that passed: equal keys get equal
verdicts, so a steady stream of calls pays one tuple compare.
"""

from __future__ import annotations

from portakern.errors import InvalidInputError
from portakern.ir.ops import Attention, KVLayout

AUX_NAMES = ("block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
#: the index arrays every kernel reads at unit stride (``SEQLENS_K + b``, ``CU_K + b``); the block table goes to
#: the kernels with its strides
UNIT_STRIDE_AUX = ("seqlens_k", "cu_seqlens_q", "cu_seqlens_k")


def unit_stride_aux(aux: dict) -> dict:
    """``aux`` with its 1-D index arrays at unit stride, as the kernels read them: a strided view (a column of a
    larger table, ``lens[::2]``) is copied for this call (an allocation, only for such a view); contiguous arrays
    and None pass as they are."""
    for name in UNIT_STRIDE_AUX:
        a = aux.get(name)
        if a is not None and a.stride(0) != 1 and a.shape[0] > 1:
            aux = dict(aux, **{name: a.contiguous()})
    return aux


def layout_key(q, k, v, out, lse, aux: dict) -> tuple:
    """Everything ``check_operands``, ``check_aux`` and a Gluon kernel's ``call_blocker`` read from a call: the
    shapes and strides and dtypes of q, k, v, out (and lse), where each of the four starts against a 16-byte
    boundary (one value per tensor: the Gluon kernels' ``call_blocker`` requires q, k and v aligned but not
    ``out``), which index arrays are given. Equal keys get equal verdicts, so a call whose key matches one that
    passed skips them (they cost ~10-20 us of host time a call; the element size is the op's)."""
    return (q.shape, k.shape, v.shape, out.shape, q.stride(), k.stride(), v.stride(), out.stride(),
            q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, out.data_ptr() & 15,
            q.dtype, k.dtype, v.dtype, out.dtype,
            None if lse is None else (lse.shape, lse.dtype), tuple(aux.get(n) is None for n in AUX_NAMES))


def check_operands(op: Attention, shapes: dict, q, k, v, out, lse) -> None:
    """Cheap per-call checks of what the signature cache cannot see (shapes, dtypes, inner strides)."""
    want = str(op.dtype.value)
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if str(a.dtype).rpartition(".")[2] != want:
            raise InvalidInputError(f"{name} has dtype {a.dtype}, but this attention op was compiled for {want}; "
                                    f"pass {want} arrays or compile the op for {a.dtype}")
        if tuple(a.shape) != shapes[name]:
            raise InvalidInputError(f"{name} has shape {tuple(a.shape)}, expected {shapes[name]} for this "
                                    f"{op.kv_layout.value} attention op")
        if a.shape[-1] > 1 and a.stride(-1) != 1:
            raise InvalidInputError(f"{name} has stride {a.stride(-1)} in its last dimension: the triton "
                                    f"backend needs it contiguous; pass {name}.contiguous()")
    if op.return_lse and (lse is None or tuple(lse.shape) != shapes["lse"]
                          or str(lse.dtype).rpartition(".")[2] != "float32"):
        raise InvalidInputError(f"lse must be a float32 array of shape {shapes['lse']} when return_lse=True")


def check_aux(op: Attention, bt, sk, cu_q, cu_k) -> None:
    """Raise unless the call passes exactly the index arrays ``op``'s KV layout reads."""
    lay = op.kv_layout
    need = {"block_table": lay is KVLayout.PAGED, "seqlens_k": op.has_seqlens_k,
            "cu_seqlens_q": lay is KVLayout.VARLEN, "cu_seqlens_k": lay is KVLayout.VARLEN}
    for name, a in (("block_table", bt), ("seqlens_k", sk), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if need[name] and a is None:
            raise InvalidInputError(f"aux[{name!r}] is missing: this {lay.value} attention op needs it")
        if not need[name] and a is not None:
            raise InvalidInputError(f"aux[{name!r}] was given but this {lay.value} attention op does not read it")
