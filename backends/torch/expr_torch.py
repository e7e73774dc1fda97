"""Lower a ``portakern.ir.Expr`` tree (``score_mod`` / ``mask_mod``) to torch operations.

Each node means what ``docs/ir.md`` says (the IR's numpy evaluator, ``portakern.ir.evaluate``, is the reference):
integer variables are int64, ``score`` is floating point, booleans count as 0 / 1 in arithmetic, ``div`` is true
division, ``and`` / ``or`` / ``not`` are logical. Variables are tensors that broadcast against each other, so the
same lowering serves an explicit (H, Sq, Sk) mask for SDPA and flex_attention's per-element ``score_mod``.
"""

from __future__ import annotations

from typing import Mapping

import torch

from portakern.ir.expr import Expr, Op

_UNARY = {Op.NEG: torch.neg, Op.ABS: torch.abs, Op.EXP: torch.exp, Op.TANH: torch.tanh, Op.NOT: torch.logical_not}
_BINARY = {Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.true_divide,
           Op.MIN: torch.minimum, Op.MAX: torch.maximum, Op.LT: torch.lt, Op.LE: torch.le, Op.GT: torch.gt,
           Op.GE: torch.ge, Op.EQ: torch.eq, Op.NE: torch.ne, Op.AND: torch.logical_and, Op.OR: torch.logical_or}
_NUMERIC = frozenset({Op.NEG, Op.ABS, Op.EXP, Op.TANH, Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN, Op.MAX})
_FLOAT_ONLY = frozenset({Op.EXP, Op.TANH})


def evaluate(expr: Expr, env: Mapping[str, torch.Tensor], device) -> torch.Tensor:
    """Evaluate ``expr`` over the tensors in ``env`` (every variable the tree reads must be a key of ``env``).

    Constants are float64 / int64 / bool tensors on ``device``; a floating ``score`` keeps its dtype through the
    arithmetic that mixes it with integer positions (torch's promotion), so the caller decides the precision.
    """
    memo: dict[int, torch.Tensor] = {}

    def ev(node: Expr) -> torch.Tensor:
        hit = memo.get(id(node))
        if hit is not None:
            return hit
        op = node.op
        if op is Op.VAR:
            r = env[node.value]
        elif op is Op.CONST:
            v = node.value
            dt = torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else torch.float64
            r = torch.full((), v, dtype=dt, device=device)   # a fill: no blocking host-to-device copy
        else:
            args = [ev(a) for a in node.args]
            if op in _NUMERIC:
                args = [a.to(torch.int64) if a.dtype == torch.bool else a for a in args]
            if op in _FLOAT_ONLY and not args[0].is_floating_point():
                args = [args[0].to(torch.float64)]
            if op is Op.WHERE:
                r = torch.where(args[0].to(torch.bool), args[1], args[2])
            elif op in _UNARY:
                r = _UNARY[op](args[0])
            else:
                r = _BINARY[op](args[0], args[1])
        memo[id(node)] = r
        return r

    return ev(expr)


def additive_bias(score_mod: Expr | None) -> Expr | None:
    """``X`` when ``score_mod`` is ``score + X`` or ``score - X`` with ``X`` free of ``score`` (ALiBi, a bias);
    else None. Such a score_mod is an additive float mask, which SDPA takes; any other needs flex_attention."""
    if score_mod is None or score_mod.op not in (Op.ADD, Op.SUB):
        return None
    a, b = score_mod.args

    def is_score(e: Expr) -> bool:
        return e.op is Op.VAR and e.value == "score"

    if is_score(a) and "score" not in b.variables():
        return b if score_mod.op is Op.ADD else -b
    if score_mod.op is Op.ADD and is_score(b) and "score" not in a.variables():
        return a
    return None
