"""Per-call checks of an attention kernel's operands: what a compiled signature cannot see.

A kernel checks a call's shapes, dtypes and inner strides (``check_operands``) and which index arrays it got
(``check_aux``) only when the call's ``layout_key`` differs from the last call that passed: equal keys get equal
verdicts, so a steady stream of calls pays one tuple compare.
"""

from __future__ import annotations

from portakern.ir.ops import Attention

from ..kernels import attention_args
from ..kernels.attention_args import AUX_NAMES, UNIT_STRIDE_AUX, check_aux, unit_stride_aux  # noqa: F401


def check_operands(op: Attention, shapes: dict, q, k, v, out, lse) -> None:
    """Raise ``InvalidInputError`` for an operand of another dtype or shape than the op's, or a last dimension
    that is not contiguous (``kernels.attention_args.check_operands``, naming this backend; ``AUX_NAMES``,
    ``unit_stride_aux`` and ``check_aux`` are that module's too)."""
    attention_args.check_operands(op, shapes, q, k, v, out, lse, backend="triton")


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

