"""Expression mini-language for attention ``score_mod`` and ``mask_mod``.

An expression is a small frozen tree over the variables

    score    the scaled score ``scale * q.k`` (float; score_mod only)
    b, h     batch index and *query* head index (int)
    q_idx    query position within its sequence (int)
    kv_idx   key position within its sequence (int)
    seqlen_q, seqlen_k   the actual lengths of this batch entry's sequences (int)

constants, and the ops below. ``score_mod`` evaluates to a float (the new score); ``mask_mod``
evaluates to a boolean (True = the key is visible). Backends lower a tree to their own language
(numpy, Triton, OpenCL C, ...); the IR's evaluator ``portakern.ir.evaluate`` is the reference.

Python operators build trees: ``kv_idx <= q_idx + seqlen_k - seqlen_q``, ``(a) & (b)``, ``-x``.
``==`` keeps its Python meaning (structural equality) so nodes stay hashable; use ``.eq()`` /
``.ne()`` to build comparison nodes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Union

from .errors import InvalidInputError, InvalidTypeError


class Op(str, enum.Enum):
    # leaves
    VAR = "var"
    CONST = "const"
    # unary
    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    TANH = "tanh"
    NOT = "not"
    # binary arithmetic
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MIN = "min"
    MAX = "max"
    # binary comparison -> bool
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    # boolean
    AND = "and"
    OR = "or"
    # ternary
    WHERE = "where"


VARIABLES = ("score", "b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
UNARY = (Op.NEG, Op.ABS, Op.EXP, Op.TANH, Op.NOT)
ARITH = (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN, Op.MAX)
COMPARE = (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE)
LOGIC = (Op.AND, Op.OR)

Operand = Union["Expr", int, float, bool]


@dataclass(frozen=True)
class Expr:
    """One node: ``op`` with child nodes ``args``; ``value`` holds a VAR name or a CONST."""

    op: Op
    args: tuple["Expr", ...] = ()
    value: object = None
    vtype: str = ""  # CONST only: "bool" | "int" | "float", so True, 1 and 1.0 stay distinct


    def __hash__(self) -> int:  # trees are hashed on every dispatch: compute once
        try:
            return self.__dict__["_hash"]
        except KeyError:
            hv = hash((self.op, self.args, self.value, self.vtype))
            object.__setattr__(self, "_hash", hv)
            return hv

    # -- construction sugar ------------------------------------------------------------------
    def __add__(self, o: Operand) -> "Expr": return Expr(Op.ADD, (self, lift(o)))
    def __radd__(self, o: Operand) -> "Expr": return Expr(Op.ADD, (lift(o), self))
    def __sub__(self, o: Operand) -> "Expr": return Expr(Op.SUB, (self, lift(o)))
    def __rsub__(self, o: Operand) -> "Expr": return Expr(Op.SUB, (lift(o), self))
    def __mul__(self, o: Operand) -> "Expr": return Expr(Op.MUL, (self, lift(o)))
    def __rmul__(self, o: Operand) -> "Expr": return Expr(Op.MUL, (lift(o), self))
    def __truediv__(self, o: Operand) -> "Expr": return Expr(Op.DIV, (self, lift(o)))
    def __rtruediv__(self, o: Operand) -> "Expr": return Expr(Op.DIV, (lift(o), self))
    def __neg__(self) -> "Expr": return Expr(Op.NEG, (self,))
    def __abs__(self) -> "Expr": return Expr(Op.ABS, (self,))
    def __lt__(self, o: Operand) -> "Expr": return Expr(Op.LT, (self, lift(o)))
    def __le__(self, o: Operand) -> "Expr": return Expr(Op.LE, (self, lift(o)))
    def __gt__(self, o: Operand) -> "Expr": return Expr(Op.GT, (self, lift(o)))
    def __ge__(self, o: Operand) -> "Expr": return Expr(Op.GE, (self, lift(o)))
    def __and__(self, o: Operand) -> "Expr": return Expr(Op.AND, (self, lift(o)))
    def __rand__(self, o: Operand) -> "Expr": return Expr(Op.AND, (lift(o), self))
    def __or__(self, o: Operand) -> "Expr": return Expr(Op.OR, (self, lift(o)))
    def __ror__(self, o: Operand) -> "Expr": return Expr(Op.OR, (lift(o), self))
    def __invert__(self) -> "Expr": return Expr(Op.NOT, (self,))

    def eq(self, o: Operand) -> "Expr":
        return Expr(Op.EQ, (self, lift(o)))

    def ne(self, o: Operand) -> "Expr":
        return Expr(Op.NE, (self, lift(o)))

    def __bool__(self) -> bool:
        raise TypeError("an Expr has no truth value; combine conditions with & and |, not and/or")

    # -- inspection --------------------------------------------------------------------------
    def variables(self) -> frozenset[str]:
        """Names of the variables this tree reads."""
        if self.op is Op.VAR:
            return frozenset([self.value])
        out: frozenset[str] = frozenset()
        for a in self.args:
            out |= a.variables()
        return out

    def check(self, where: str = "expression") -> None:
        """Raise ``InvalidInputError`` unless every node has the arity and payload of its op."""
        arity = 0 if self.op in (Op.VAR, Op.CONST) else 1 if self.op in UNARY else 3 if self.op is Op.WHERE else 2
        if len(self.args) != arity:
            raise InvalidInputError(f"{where}: node {self.op.value} has {len(self.args)} arguments; it takes {arity}")
        if self.op is Op.VAR and self.value not in VARIABLES:
            raise InvalidInputError(f"{where}: variable {self.value!r} is unknown: expected one of {', '.join(VARIABLES)}")
        if self.op is Op.CONST and not isinstance(self.value, (int, float, bool)):
            raise InvalidInputError(f"{where}: constant {self.value!r} must be an int, float or bool")
        for a in self.args:
            a.check(where)

    def is_bool(self) -> bool:
        """Whether the tree evaluates to a boolean."""
        if self.op in COMPARE or self.op in LOGIC or self.op is Op.NOT:
            return True
        if self.op is Op.CONST:
            return isinstance(self.value, bool)
        if self.op is Op.WHERE:
            return self.args[1].is_bool()
        return False

    def to_json(self) -> object:
        """Plain JSON form: ``["var", name]``, ``["const", v]`` or ``[op, child, ...]``."""
        if self.op in (Op.VAR, Op.CONST):
            v = self.value
            if isinstance(v, float) and not math.isfinite(v):
                v = repr(v)
            return [self.op.value, v]
        return [self.op.value, *(a.to_json() for a in self.args)]

    @staticmethod
    def from_json(data: object) -> "Expr":
        op = Op(data[0])
        if op is Op.VAR:
            return var(data[1])
        if op is Op.CONST:
            v = data[1]
            if isinstance(v, str):
                v = float(v)
            return const(v)
        return Expr(op, tuple(Expr.from_json(a) for a in data[1:]))

    def __str__(self) -> str:
        if self.op is Op.VAR:
            return str(self.value)
        if self.op is Op.CONST:
            return repr(self.value)
        return f"{self.op.value}({', '.join(str(a) for a in self.args)})"


def value_kind(node: Expr) -> str:
    """"bool", "int" or "float": the type ``node`` evaluates to under numpy's promotion rules (what the cpu reference
    computes). Lowerings to typed languages (Triton, OpenCL C) use it to pick casts and literals."""
    op = node.op
    if op is Op.VAR:
        return "float" if node.value == "score" else "int"
    if op is Op.CONST:
        v = node.value
        return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float"
    if op in COMPARE or op in LOGIC or op is Op.NOT:
        return "bool"
    if op in (Op.EXP, Op.TANH, Op.DIV):
        return "float"
    kinds = [value_kind(a) for a in (node.args[1:] if op is Op.WHERE else node.args)]
    if op is Op.WHERE and all(k == "bool" for k in kinds):
        return "bool"
    return "float" if "float" in kinds else "int"


def lift(x: Operand) -> Expr:
    """Wrap a Python number or bool as a constant node; pass nodes through."""
    if isinstance(x, Expr):
        return x
    return const(x)


def var(name: str) -> Expr:
    if name not in VARIABLES:
        raise InvalidInputError(f"expression variable {name!r} is unknown: expected one of {', '.join(VARIABLES)}")
    return Expr(Op.VAR, (), name)


def const(value: int | float | bool) -> Expr:
    if not isinstance(value, (int, float, bool)):
        raise InvalidTypeError(f"expression constant {value!r} must be an int, float or bool")
    return Expr(Op.CONST, (), value, type(value).__name__)


def where(cond: Operand, a: Operand, b: Operand) -> Expr:
    return Expr(Op.WHERE, (lift(cond), lift(a), lift(b)))


def minimum(a: Operand, b: Operand) -> Expr:
    return Expr(Op.MIN, (lift(a), lift(b)))


def maximum(a: Operand, b: Operand) -> Expr:
    return Expr(Op.MAX, (lift(a), lift(b)))


def tanh(a: Operand) -> Expr:
    return Expr(Op.TANH, (lift(a),))


def exp(a: Operand) -> Expr:
    return Expr(Op.EXP, (lift(a),))


score = var("score")
b = var("b")
h = var("h")
q_idx = var("q_idx")
kv_idx = var("kv_idx")
seqlen_q = var("seqlen_q")
seqlen_k = var("seqlen_k")

#: The query row aligned with the last key: bottom-right alignment offset.
_diag = q_idx + seqlen_k - seqlen_q


# -- library expressions -------------------------------------------------------------------

def causal_mask() -> Expr:
    """Bottom-right aligned causal mask: query i sees key j iff ``j <= i + Sk - Sq``."""
    return kv_idx <= _diag


def window_mask(left: int, right: int) -> Expr:
    """Sliding window ``(left, right)``: ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``.

    A negative ``left`` or ``right`` means unbounded on that side (as in FlashAttention's -1).
    """
    parts = []
    if left >= 0:
        parts.append(kv_idx >= _diag - left)
    if right >= 0:
        parts.append(kv_idx <= _diag + right)
    if not parts:
        return const(True)
    return parts[0] if len(parts) == 1 else parts[0] & parts[1]


def window_bound(term: Expr) -> tuple[str, int] | None:
    """The side and width of one term of ``causal_mask()`` / ``window_mask(l, r)``, or None for any other term.

    ``("right", r)`` for ``kv_idx <= diag + r`` (``r = 0`` for ``kv_idx <= diag``), ``("left", l)`` for
    ``kv_idx >= diag - l``, with ``diag = q_idx + seqlen_k - seqlen_q`` and ``r``, ``l`` non-negative integer constants:
    the inverse of ``window_mask``'s terms, so a backend can read a band off a mask and skip the key tiles outside it.
    """
    if term.op not in (Op.LE, Op.GE) or term.args[0] != kv_idx:
        return None
    rhs = term.args[1]
    side, combine = ("right", Op.ADD) if term.op is Op.LE else ("left", Op.SUB)
    if rhs == _diag:
        return side, 0
    if rhs.op is combine and rhs.args[0] == _diag:
        width = rhs.args[1]
        if width.op is Op.CONST and type(width.value) is int and width.value >= 0:
            return side, width.value
    return None


def softcap_score(cap: float) -> Expr:
    """Logit soft-capping ``cap * tanh(score / cap)`` (Gemma 2, Grok)."""
    return cap * tanh(score / cap)


def alibi_score(slopes: tuple[float, ...]) -> Expr:
    """ALiBi bias ``score - slope[h] * |(i + Sk - Sq) - j|`` with one slope per query head.

    The slopes are folded into a select chain over ``h`` so the expression stays closed.
    """
    slope: Expr = const(float(slopes[-1]))
    for head in range(len(slopes) - 2, -1, -1):
        slope = where(h.eq(head), float(slopes[head]), slope)
    return score - slope * abs(_diag - kv_idx)


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """The standard ALiBi slope series ``2^(-8 (i+1) / H)`` for a power-of-two head count."""
    return tuple(2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads))


def prefix_lm_mask(prefix: int) -> Expr:
    """Prefix-LM: every query sees the first ``prefix`` keys, the rest causally."""
    return (kv_idx < prefix) | causal_mask()


def document_mask(boundaries: tuple[int, ...]) -> Expr:
    """Block-diagonal document mask: query and key must lie in the same document.

    ``boundaries`` are the start positions of documents 1.. (document 0 starts at 0), in the
    key coordinate frame; queries are mapped to that frame by bottom-right alignment.
    """
    def doc(pos: Expr) -> Expr:
        d: Expr = const(0)
        for start in boundaries:
            d = d + where(pos >= start, 1, 0)
        return d

    return doc(_diag).eq(doc(kv_idx))


def compose_score(outer: Expr, inner: Expr) -> Expr:
    """Substitute ``inner`` for every ``score`` in ``outer`` (apply inner first)."""
    if outer.op is Op.VAR and outer.value == "score":
        return inner
    if not outer.args:
        return outer
    return Expr(outer.op, tuple(compose_score(a, inner) for a in outer.args), outer.value)
