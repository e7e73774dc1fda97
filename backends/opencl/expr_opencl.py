"""Lower an ``ir.expr.Expr`` tree to OpenCL C: the ``score_mod`` / ``mask_mod`` functions of the attention kernel.

``source(score_mod, mask_mod)`` returns C text defining::

    float pk_score_mod(float score, long b, long h, long q_idx, long kv_idx, long seqlen_q, long seqlen_k);
    int   pk_mask_mod(long b, long h, long q_idx, long kv_idx, long seqlen_q, long seqlen_k);   // 1 keeps the key

plus ``#define PK_HAS_SCORE_MOD`` / ``PK_HAS_MASK_MOD`` for the trees that are present; the kernel
(``kernels/attention.cl``) calls them once per (query row, key).

Types follow the IR's evaluator (``portakern.ir.evaluate``): integer variables and constants are 64-bit
(``long``, as in the reference), ``score`` and float arithmetic are float32 (the reference: float64); booleans
are C ``int`` 0/1 and read as 0/1 in arithmetic; ``div`` is true division in float; ``and``/``or``/``not`` act
on truth values (non-zero, NaN included, is true); ``min``/``max`` of floats propagate NaN like
``numpy.minimum``. Subtrees without variables are folded with the reference evaluator (then rounded to float32
where they are float), so both agree on them exactly.

``OpenCLEmitter`` is the shared C-like emitter (``portakern.cstyle.CStyleEmitter``) with OpenCL C's entries:
``abs``/``min``/``max`` by kind (``fabs`` and the ``pk_*`` helpers below), 64-bit integer and hex float32 literals.
"""

from __future__ import annotations

import math

import numpy as np

from portakern.cstyle import CStyleEmitter
from portakern.ir.expr import Expr, Op, value_kind

#: helpers the generated expressions call (always emitted; the compiler drops unused ones)
HELPERS = """
inline long pk_iabs(long x) { return x < 0 ? -x : x; }
inline long pk_imin(long a, long b) { return a < b ? a : b; }
inline long pk_imax(long a, long b) { return a > b ? a : b; }
inline float pk_fmin(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmin(a, b); }
inline float pk_fmax(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmax(a, b); }
"""

#: min / max by the kind of their result: the NaN-propagating float helpers, the long ones
_MIN_MAX = {("float", Op.MIN): "pk_fmin", ("float", Op.MAX): "pk_fmax", ("int", Op.MIN): "pk_imin",
            ("int", Op.MAX): "pk_imax"}


def _min_max(em: CStyleEmitter, node: Expr, a: tuple) -> str:
    kind = value_kind(node)
    x, y = em.pair(a[0], a[1], kind)
    return f"{_MIN_MAX[(kind, node.op)]}({x}, {y})"


class OpenCLEmitter(CStyleEmitter):
    """OpenCL C: the C defaults, 64-bit ``long`` integers, float32 constants in hex, and the ``pk_*`` helpers."""

    language = "OpenCL C"
    int_bits = 64
    int_type = "long"
    code_for_op = {
        **CStyleEmitter.code_for_op,
        Op.ABS: lambda em, n, a: f"fabs({em.flt(a[0])})" if value_kind(n) == "float" else f"pk_iabs({em.num(a[0])})",
        Op.MIN: _min_max,
        Op.MAX: _min_max,
    }

    def int_literal(self, v: int) -> str:
        # -2**63 has no literal in C (2**63 overflows before the minus applies)
        return f"((long){v}L)" if v != -(2 ** 63) else "((long)(-9223372036854775807L - 1))"

    def round_float(self, v: float) -> float:
        with np.errstate(over="ignore"):
            return float(np.float32(v))        # the float32 the kernel computes with (overflow: +-inf)

    def float_literal(self, v: float) -> str:
        return f"({v.hex()}f)" if v != 0 or math.copysign(1, v) > 0 else "(-0.0f)"


def lower(node: Expr) -> str:
    """One C expression for ``node`` (raises ``UnsupportedError`` for a node it cannot lower)."""
    return OpenCLEmitter().emit(node)


def source(score_mod: Expr | None, mask_mod: Expr | None) -> str:
    """The C text of ``pk_score_mod`` / ``pk_mask_mod`` for the attention kernel (see the module docstring)."""
    out = [HELPERS]
    if score_mod is not None:
        body = lower(score_mod)
        out.append("#define PK_HAS_SCORE_MOD 1\n"
                   "inline float pk_score_mod(float score, long b, long h, long q_idx, long kv_idx, long seqlen_q,"
                   f" long seqlen_k) {{\n  return (float)({body});\n}}\n")
    if mask_mod is not None:
        body = lower(mask_mod)
        out.append("#define PK_HAS_MASK_MOD 1\n"
                   "inline int pk_mask_mod(long b, long h, long q_idx, long kv_idx, long seqlen_q, long seqlen_k) {\n"
                   f"  return ({body}) ? 1 : 0;\n}}\n")
    return "\n".join(out)
