"""The base of every C-like expression lowering: an ``ir.expr.Expr`` tree to one source expression.

A backend whose kernels take ``score_mod`` / ``mask_mod`` as source text (Triton, OpenCL C, ...)
subclasses ``CStyleEmitter`` in its ``expr_<lang>.py`` and states only what its language says
differently: the capabilities below (literal spellings, casts, integer width, whether binary operands
are converted explicitly) and the entries of ``code_for_op`` it changes. The model is tinygrad's
``renderer/cstyle.py``: capabilities as class attributes and a table from op to code.

What every lowering shares, and why:

* **Types follow the IR's evaluator** (``portakern.ir.evaluate``): ``ir.expr.value_kind`` gives each
  node's kind (``bool``, ``int`` or ``float``) under numpy promotion, and the emitter picks one of
  three *views* of a child from it: ``num`` (a number: booleans read as integer 0/1), ``flt`` (as a
  float) and ``truth`` (its truth value: non-zero is true). The table's entries say which view each
  operand takes, so ``True + True`` is 2 and ``and`` acts on truth values in every language.
* **Variable-free subtrees are folded** by the IR's evaluator and written as one literal, so every
  lowering agrees with the reference on constants exactly (``1 / 0`` is ``inf``, not a C error).
* **Errors name the node and the language**: an op without an entry, or an integer constant the
  language's integer type cannot hold, raises ``UnsupportedError``; the attention ``supports()`` of the
  backend turns that into its reason.
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar

from portakern.errors import UnsupportedError
from portakern.ir.evaluate import evaluate
from portakern.ir.expr import Expr, Op, value_kind

__all__ = ["CStyleEmitter", "OpCode", "BINARY_SYMBOL"]

#: One entry of ``code_for_op``: the emitter (for the operand views), the node, its children -> source text.
OpCode = Callable[["CStyleEmitter", Expr, tuple], str]

#: The ops written as an infix operator, the same symbol in every C-like language.
BINARY_SYMBOL = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.LT: "<", Op.LE: "<=", Op.GT: ">", Op.GE: ">=",
                 Op.EQ: "==", Op.NE: "!="}


def _infix(sym: str) -> OpCode:
    def code(em: "CStyleEmitter", node: Expr, a: tuple) -> str:
        x, y = em.operands(a[0], a[1])
        return f"({x} {sym} {y})"

    return code


class CStyleEmitter:
    """Turns an expression tree into one expression of a C-like language (see the module docstring).

    Subclasses set the capabilities and extend ``code_for_op``; ``emit(node)`` is the entry point,
    and ``num`` / ``flt`` / ``truth`` give the source of a child in the view an entry needs.
    """

    # -- capabilities ----------------------------------------------------------------------------------
    #: the language's name, as errors say it ("no OpenCL C lowering")
    language: ClassVar[str] = "C"
    #: width of the integer type positions, lengths and integer constants are computed in
    int_bits: ClassVar[int] = 64
    #: that integer type, as errors name it
    int_type: ClassVar[str] = "long"
    #: spelling of the boolean constants
    true_literal: ClassVar[str] = "1"
    false_literal: ClassVar[str] = "0"
    #: spelling of a NaN and of +infinity (-infinity is ``(-inf_literal)``)
    nan_literal: ClassVar[str] = "NAN"
    inf_literal: ClassVar[str] = "INFINITY"
    #: whether both operands of an arithmetic or comparison operator (and a division's divisor) are
    #: converted to their common kind in the text (C style), or left to the language's own promotion
    explicit_promotion: ClassVar[bool] = True

    #: op -> code; ops without an entry have no lowering in this language
    code_for_op: ClassVar[dict[Op, OpCode]] = {
        Op.NEG: lambda em, n, a: f"(-{em.num(a[0])})",
        Op.EXP: lambda em, n, a: f"exp({em.flt(a[0])})",
        Op.TANH: lambda em, n, a: f"tanh({em.flt(a[0])})",
        Op.NOT: lambda em, n, a: f"(!{em.truth(a[0])})",
        Op.AND: lambda em, n, a: f"({em.truth(a[0])} && {em.truth(a[1])})",
        Op.OR: lambda em, n, a: f"({em.truth(a[0])} || {em.truth(a[1])})",
        Op.DIV: lambda em, n, a: f"({em.flt(a[0])} / {em.flt(a[1]) if em.explicit_promotion else em.num(a[1])})",
        **{op: _infix(sym) for op, sym in BINARY_SYMBOL.items()},
        Op.WHERE: lambda em, n, a: "({} ? {} : {})".format(em.truth(a[0]), *em.select(n)),
    }

    # -- language specifics a subclass states --------------------------------------------------------
    def to_int(self, s: str) -> str:
        """``s`` (a boolean) as the integer type."""
        return f"(({self.int_type}){s})"

    def to_float(self, s: str) -> str:
        """``s`` (an integer) as the float type."""
        return f"((float){s})"

    def int_literal(self, v: int) -> str:
        """An integer constant already known to fit ``int_bits``."""
        return f"({v})"

    def round_float(self, v: float) -> float:
        """The value a float constant takes in the language's float type (overflow gives +-inf)."""
        return v

    def float_literal(self, v: float) -> str:
        """A finite float constant (already rounded by ``round_float``)."""
        return f"({v!r})"

    # -- the lowering ----------------------------------------------------------------------------------
    def emit(self, node: Expr) -> str:
        """The source of ``node`` in its own kind (raises ``UnsupportedError`` for an op without an entry)."""
        if not node.variables() and node.op is not Op.CONST:
            return self.literal(self.value(node))
        if node.op is Op.VAR:
            return str(node.value)
        if node.op is Op.CONST:
            return self.literal(node.value)
        code = self.code_for_op.get(node.op)
        if code is None:
            raise UnsupportedError(f"expression node {node.op.value!r} has no {self.language} lowering: lower the "
                                   f"expression with another backend (backend=\"cpu\") or rewrite it without "
                                   f"{node.op.value!r}")
        return code(self, node, node.args)

    # views of a child ----------------------------------------------------------------------------------
    def num(self, node: Expr) -> str:
        """The child as a number: a boolean becomes integer 0/1."""
        s = self.emit(node)
        return self.to_int(s) if value_kind(node) == "bool" else s

    def flt(self, node: Expr) -> str:
        """The child as a float."""
        s = self.num(node)
        return s if value_kind(node) == "float" else self.to_float(s)

    def truth(self, node: Expr) -> str:
        """The child's truth value as a boolean (non-zero, NaN included, is true)."""
        s = self.emit(node)
        return s if value_kind(node) == "bool" else f"({s} != 0)"

    def pair(self, x: Expr, y: Expr, kind: str) -> tuple[str, str]:
        """Two children in the views of ``kind``: both floats, or both numbers."""
        return (self.flt(x), self.flt(y)) if kind == "float" else (self.num(x), self.num(y))

    def operands(self, x: Expr, y: Expr) -> tuple[str, str]:
        """The operands of an infix operator: converted to their common kind with ``explicit_promotion``,
        else numbers the language promotes itself."""
        if not self.explicit_promotion:
            return self.num(x), self.num(y)
        kind = "float" if "float" in (value_kind(x), value_kind(y)) else "int"
        return self.pair(x, y, kind)

    def select(self, node: Expr) -> tuple[str, str]:
        """The two branches of a ``where`` in the node's kind (truth values when it is boolean)."""
        _, x, y = node.args
        kind = value_kind(node)
        return (self.truth(x), self.truth(y)) if kind == "bool" else self.pair(x, y, kind)

    # constants -----------------------------------------------------------------------------------------
    @staticmethod
    def value(node: Expr):
        """The Python value of a variable-free subtree, by the IR's evaluator, in the node's kind."""
        value = evaluate(node, {}).item()
        kind = value_kind(node)
        return bool(value) if kind == "bool" else int(value) if kind == "int" else float(value)

    def literal(self, v) -> str:
        """The source of a constant: bool, int (``UnsupportedError`` when it does not fit ``int_bits``) or float."""
        if isinstance(v, bool):
            return self.true_literal if v else self.false_literal
        if isinstance(v, int):
            bound = 2 ** (self.int_bits - 1)
            if not -bound <= v < bound:
                raise UnsupportedError(f"integer constant {v} does not fit the {self.int_bits}-bit {self.int_type} "
                                       f"of the {self.language} lowering: use a constant in [{-bound}, {bound - 1}] "
                                       "or a float constant")
            return self.int_literal(v)
        if math.isnan(v):
            return self.nan_literal
        v = self.round_float(v)
        if math.isinf(v):
            return self.inf_literal if v > 0 else f"(-{self.inf_literal})"
        return self.float_literal(v)
