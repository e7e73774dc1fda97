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
"""

from __future__ import annotations

import math

import numpy as np

from portakern.errors import UnsupportedError
from portakern.ir import expr as E
from portakern.ir.expr import Expr, Op

_BINARY_SYMBOL = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.LT: "<", Op.LE: "<=", Op.GT: ">", Op.GE: ">=",
                  Op.EQ: "==", Op.NE: "!="}

#: helpers the generated expressions call (always emitted; the compiler drops unused ones)
HELPERS = """
inline long pk_iabs(long x) { return x < 0 ? -x : x; }
inline long pk_imin(long a, long b) { return a < b ? a : b; }
inline long pk_imax(long a, long b) { return a > b ? a : b; }
inline float pk_fmin(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmin(a, b); }
inline float pk_fmax(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmax(a, b); }
"""


kind_of = E.value_kind  # the IR's typing of an expression (numpy promotion)


class _Emitter:
    """Turns a tree into one C expression string."""

    def emit(self, node: Expr) -> str:
        if not node.variables() and node.op is not Op.CONST:
            return self._literal(self._value(node))
        op, a = node.op, node.args
        if op is Op.VAR:
            return str(node.value)
        if op is Op.CONST:
            return self._literal(self._value(node))
        if op is Op.NEG:
            return f"(-{self.num(a[0])})"
        if op is Op.ABS:
            return f"fabs({self.flt(a[0])})" if kind_of(node) == "float" else f"pk_iabs({self.num(a[0])})"
        if op is Op.EXP:
            return f"exp({self.flt(a[0])})"
        if op is Op.TANH:
            return f"tanh({self.flt(a[0])})"
        if op is Op.NOT:
            return f"(!{self.truth(a[0])})"
        if op in (Op.AND, Op.OR):
            sym = "&&" if op is Op.AND else "||"
            return f"({self.truth(a[0])} {sym} {self.truth(a[1])})"
        if op in (Op.MIN, Op.MAX):
            kind = kind_of(node)
            fn = {("float", Op.MIN): "pk_fmin", ("float", Op.MAX): "pk_fmax", ("int", Op.MIN): "pk_imin",
                  ("int", Op.MAX): "pk_imax"}[(kind, op)]
            x, y = self._pair(a[0], a[1], kind)
            return f"{fn}({x}, {y})"
        if op is Op.DIV:
            return f"({self.flt(a[0])} / {self.flt(a[1])})"
        if op in _BINARY_SYMBOL:
            kind = "float" if "float" in (kind_of(a[0]), kind_of(a[1])) else "int"
            x, y = self._pair(a[0], a[1], kind)
            return f"({x} {_BINARY_SYMBOL[op]} {y})"
        if op is Op.WHERE:
            kind = kind_of(node)
            if kind == "bool":
                x, y = self.truth(a[1]), self.truth(a[2])
            else:
                x, y = self._pair(a[1], a[2], kind)
            return f"({self.truth(a[0])} ? {x} : {y})"
        raise UnsupportedError(f"expression node {node.op.value!r} has no OpenCL C lowering")

    # views of a child ----------------------------------------------------------------------------
    def num(self, node: Expr) -> str:
        """The child as a number: booleans become ``long`` 0/1."""
        s = self.emit(node)
        return f"((long){s})" if kind_of(node) == "bool" else s

    def flt(self, node: Expr) -> str:
        """The child as float32."""
        s = self.num(node)
        return s if kind_of(node) == "float" else f"((float){s})"

    def truth(self, node: Expr) -> str:
        s = self.emit(node)
        return s if kind_of(node) == "bool" else f"({s} != 0)"

    def _pair(self, x: Expr, y: Expr, kind: str) -> tuple[str, str]:
        return (self.flt(x), self.flt(y)) if kind == "float" else (self.num(x), self.num(y))

    # constants ------------------------------------------------------------------------------------
    @staticmethod
    def _value(node: Expr):
        """The value of a variable-free subtree, by the numpy reference."""
        from portakern.ir.evaluate import evaluate

        value = evaluate(node, {}).item()
        kind = kind_of(node)
        return bool(value) if kind == "bool" else int(value) if kind == "int" else float(value)

    @staticmethod
    def _literal(v) -> str:
        if isinstance(v, bool):
            return "1" if v else "0"
        if isinstance(v, int):
            if not -(2 ** 63) <= v < 2 ** 63:
                raise UnsupportedError(f"integer constant {v} does not fit the 64-bit long of the OpenCL lowering")
            return f"((long){v}L)" if v != -(2 ** 63) else "((long)(-9223372036854775807L - 1))"
        if math.isnan(v):
            return "NAN"
        with np.errstate(over="ignore"):
            f = float(np.float32(v))        # the float32 the kernel computes with (overflow: +-inf)
        if math.isinf(f):
            return "INFINITY" if f > 0 else "(-INFINITY)"
        return f"({f.hex()}f)" if f != 0 or math.copysign(1, f) > 0 else "(-0.0f)"


def lower(node: Expr) -> str:
    """One C expression for ``node`` (raises ``UnsupportedError`` for a node it cannot lower)."""
    return _Emitter().emit(node)


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
