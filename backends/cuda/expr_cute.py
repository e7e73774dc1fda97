"""Lower ``score_mod`` / ``mask_mod`` expression trees to CuTe DSL values while a kernel is traced.

CuTe DSL is Python: a ``@cute.jit`` function runs once at trace time and every DSL operation it calls becomes IR.
So an expression needs no generated source: ``CuteLowering(env).emit(tree)`` walks the tree during tracing and calls
the DSL's operations on the variables' values (``env``: ``score`` a Float32, ``b``, ``h``, ``q_idx``, ``kv_idx``,
``seqlen_q``, ``seqlen_k`` Int32), returning one DSL value -- the kernel inlines it per score element. The same walk
runs in a host ``@cute.jit`` function, which is how the tests check it against the IR's evaluator on the CPU.

Types follow the IR's evaluator as every lowering's do (``portakern.cstyle``): ``ir.expr.value_kind`` gives each
node's kind and an operand is read in one of three views -- ``num`` (booleans as 0/1), ``flt`` (as Float32) and
``truth`` (non-zero is true); ``div`` is true division; integers are Int32 (positions and lengths fit); subtrees
without variables are folded by the IR's evaluator into one constant, so constants agree with the reference exactly.

``refusal(tree)`` says, without the DSL, why a tree cannot be lowered (an op without an entry, an integer constant
outside Int32); ``band(mask)`` reads the library masks' bounds (``causal_mask()``, ``window_mask(l, r)``) out of an
AND of terms, so the kernel can skip key tiles no query row of a tile sees.
"""

from __future__ import annotations

from typing import NamedTuple

from portakern.ir.evaluate import evaluate
from portakern.ir.expr import Expr, Op, value_kind, window_bound

#: ops this lowering has an entry for (every op of the IR)
LOWERED = frozenset(Op)
INT32 = (-(2 ** 31), 2 ** 31 - 1)


def constant(node: Expr):
    """The Python value of a variable-free subtree, by the IR's evaluator, in the node's kind."""
    value = evaluate(node, {}).item()
    kind = value_kind(node)
    return bool(value) if kind == "bool" else int(value) if kind == "int" else float(value)


def refusal(tree: Expr | None) -> str | None:
    """Why ``tree`` has no CuTe DSL lowering (None when it has one, or when it is None)."""
    if tree is None:
        return None
    if not tree.variables():
        v = constant(tree)
        if isinstance(v, int) and not isinstance(v, bool) and not INT32[0] <= v <= INT32[1]:
            return (f"integer constant {v} of {tree} does not fit the Int32 of the CuTe DSL lowering: use a "
                    f"constant in [{INT32[0]}, {INT32[1]}] or a float constant")
        return None
    if tree.op not in LOWERED:
        return f"expression node {tree.op.value!r} has no CuTe DSL lowering"
    for a in tree.args:
        why = refusal(a)
        if why:
            return why
    return None


class Band(NamedTuple):
    """Keys ``diag - left <= j <= diag + right`` every visible key lies in (None: unbounded on that side), and
    whether the mask is exactly those bounds (``exact``: tiles inside the band need no per-element mask)."""

    left: int | None
    right: int | None
    exact: bool


def band(mask: Expr | None) -> Band:
    """The band of the library masks among ``mask``'s AND-ed terms (``Band(None, None, mask is None)`` when it has
    none): a term ``kv_idx <= diag + r`` bounds the right side, ``kv_idx >= diag - l`` the left."""
    if mask is None:
        return Band(None, None, True)
    terms, stack = [], [mask]
    while stack:
        t = stack.pop()
        if t.op is Op.AND:
            stack.extend(t.args)
        else:
            terms.append(t)
    found: dict[str, int] = {}
    exact = True
    for t in terms:
        b = window_bound(t)
        if b is None:
            exact = False
        else:
            found[b[0]] = min(found.get(b[0], b[1]), b[1])
    return Band(found.get("left"), found.get("right"), exact)


#: the variables that do not change within a (batch, head) tile of work
TILE_INVARIANT = frozenset({"b", "h", "seqlen_q", "seqlen_k"})


def invariant_subtrees(tree: Expr | None) -> list[Expr]:
    """The largest subtrees of ``tree`` that read variables, all of them in ``TILE_INVARIANT`` (e.g. ALiBi's slope
    chain over ``h``): a kernel evaluates them once per tile of work and every element reuses the value."""
    if tree is None or not tree.variables():
        return []
    if tree.variables() <= TILE_INVARIANT:
        return [tree]
    return [sub for a in tree.args for sub in invariant_subtrees(a)]


class CuteLowering:
    """One expression walk during tracing: ``emit(tree)`` -> a DSL value of the tree's kind, from ``env``; a
    subtree found in ``known`` (subtree -> DSL value, evaluated earlier) is taken from there."""

    def __init__(self, env: dict, known: dict | None = None):
        self.env = env
        self.known = known or {}

    # -- views of a child -----------------------------------------------------------------------------------------
    def num(self, node: Expr):
        """The child as a number: a boolean becomes Int32 0/1."""
        from cutlass import Int32

        v = self.emit(node)
        return Int32(v) if value_kind(node) == "bool" else v

    def flt(self, node: Expr):
        """The child as a Float32."""
        from cutlass import Float32

        v = self.num(node)
        return v if value_kind(node) == "float" else Float32(v)

    def truth(self, node: Expr):
        """The child's truth value as a Boolean (non-zero, NaN included, is true)."""
        v = self.emit(node)
        if value_kind(node) == "bool":
            return v
        return v != self._const(0.0 if value_kind(node) == "float" else 0, value_kind(node))

    def pair(self, x: Expr, y: Expr, kind: str):
        """Two children in the views of ``kind`` ("float": both Float32; else both numbers)."""
        return (self.flt(x), self.flt(y)) if kind == "float" else (self.num(x), self.num(y))

    # -- nodes ----------------------------------------------------------------------------------------------------
    @staticmethod
    def _const(v, kind: str):
        from cutlass import Boolean, Float32, Int32

        return {"bool": Boolean, "int": Int32, "float": Float32}[kind](v)

    def emit(self, node: Expr):
        """The DSL value of ``node`` in its own kind."""
        import cutlass
        import cutlass.cute as cute

        kind = value_kind(node)
        if not node.variables():
            return self._const(constant(node), kind)
        if node in self.known:
            return self.known[node]
        op, a = node.op, node.args
        if op is Op.VAR:
            return self.env[node.value]
        if op is Op.NEG:
            return -self.num(a[0])
        if op is Op.ABS:
            return abs(self.num(a[0]))
        if op is Op.EXP:
            return cute.math.exp(self.flt(a[0]))
        if op is Op.TANH:
            return cute.math.tanh(self.flt(a[0]))
        if op is Op.NOT:
            return cutlass.not_(self.truth(a[0]))
        if op is Op.AND:
            return cutlass.and_(self.truth(a[0]), self.truth(a[1]))
        if op is Op.OR:
            return cutlass.or_(self.truth(a[0]), self.truth(a[1]))
        if op is Op.DIV:
            return self.flt(a[0]) / self.flt(a[1])
        if op in (Op.ADD, Op.SUB, Op.MUL, Op.MIN, Op.MAX):
            x, y = self.pair(a[0], a[1], kind)
            return {Op.ADD: lambda: x + y, Op.SUB: lambda: x - y, Op.MUL: lambda: x * y,
                    Op.MIN: lambda: cutlass.min(x, y), Op.MAX: lambda: cutlass.max(x, y)}[op]()
        if op in (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE):
            x, y = self.pair(a[0], a[1], "float" if "float" in (value_kind(a[0]), value_kind(a[1])) else "int")
            return {Op.LT: lambda: x < y, Op.LE: lambda: x <= y, Op.GT: lambda: x > y, Op.GE: lambda: x >= y,
                    Op.EQ: lambda: x == y, Op.NE: lambda: x != y}[op]()
        if op is Op.WHERE:
            cond = self.truth(a[0])
            x, y = (self.truth(a[1]), self.truth(a[2])) if kind == "bool" else self.pair(a[1], a[2], kind)
            return self._const(cutlass.select_(cond, x, y), kind)
        raise NotImplementedError(f"expression node {op.value!r} has no CuTe DSL lowering")


__all__ = ["Band", "CuteLowering", "TILE_INVARIANT", "band", "constant", "invariant_subtrees", "refusal"]
