"""The numpy meaning of every expression node: ``evaluate(expr, env)``.

This is the IR's own evaluator and the reference every backend's expression lowering meets
(``backends/<name>/expr_<lang>.py``); the lowerings also fold variable-free subtrees with it, so
they agree with it on constants exactly.

Types: ``score`` is float64; ``b``, ``h``, ``q_idx``, ``kv_idx``, ``seqlen_q``, ``seqlen_k`` are
int64; constants keep their Python type (bool, int64 or float64). Arithmetic follows numpy's
promotion with booleans read as 0/1 integers; ``div`` is true division (always float); ``min`` /
``max`` are elementwise; comparisons give booleans; ``and`` / ``or`` / ``not`` are logical ops on
the truth value of their operands; ``where(c, a, b)`` selects elementwise. Floating point follows
IEEE 754 (``1/0 = inf``, ``exp(1000) = inf``) without warnings.

Variables may be scalars or arrays of any broadcast-compatible shapes; the result has the
broadcast shape of the variables the tree actually reads (a constant tree gives a 0-d array).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .errors import InvalidInputError, InvalidTypeError
from .expr import VARIABLES, Expr, Op

__all__ = ["FLOAT_VARIABLES", "evaluate"]

#: The only float variable; every other variable is an integer index or length.
FLOAT_VARIABLES = frozenset({"score"})

# -- the op -> numpy table ---------------------------------------------------------------------
_UNARY: dict[Op, Callable] = {
    Op.NEG: np.negative,
    Op.ABS: np.abs,
    Op.EXP: np.exp,
    Op.TANH: np.tanh,
    Op.NOT: np.logical_not,
}
_BINARY: dict[Op, Callable] = {
    Op.ADD: np.add,
    Op.SUB: np.subtract,
    Op.MUL: np.multiply,
    Op.DIV: np.true_divide,
    Op.MIN: np.minimum,
    Op.MAX: np.maximum,
    Op.LT: np.less,
    Op.LE: np.less_equal,
    Op.GT: np.greater,
    Op.GE: np.greater_equal,
    Op.EQ: np.equal,
    Op.NE: np.not_equal,
    Op.AND: np.logical_and,
    Op.OR: np.logical_or,
}
#: Ops whose boolean operands are read as the integers 0 / 1 (numpy would otherwise refuse
#: ``-True`` and ``True - False``, compute ``True + True`` as ``True`` and ``tanh(True)`` in float16).
_NUMERIC = frozenset({Op.NEG, Op.ABS, Op.EXP, Op.TANH, Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN,
                      Op.MAX})


def evaluate(expr: Expr, env: Mapping[str, object]) -> np.ndarray:
    """Evaluate ``expr`` elementwise over the arrays in ``env`` and return the result array.

    Args:
        expr: the expression tree (a ``score_mod`` or ``mask_mod``).
        env: value of each variable the tree reads, by name (``score``, ``b``, ``h``, ``q_idx``,
            ``kv_idx``, ``seqlen_q``, ``seqlen_k``): a Python scalar or a numpy array. Arrays
            broadcast against each other. Extra entries are ignored.

    Returns:
        A numpy array (float64, int64 or bool) with the broadcast shape of the variables read.

    Raises:
        InvalidInputError: the tree reads a variable missing from ``env``, an ``env`` name is not
            an expression variable, or a node is malformed.
        InvalidTypeError: an integer variable was given non-integer values.
    """
    values = {name: _variable(name, v) for name, v in env.items()}
    memo: dict[int, np.ndarray] = {}
    with np.errstate(all="ignore"):
        return np.asarray(_eval(expr, values, memo))


def _variable(name: str, value: object) -> np.ndarray:
    """Convert one environment entry to its array type (float64 for score, int64 otherwise)."""
    if name not in VARIABLES:
        raise InvalidInputError(f"env[{name!r}] is not an expression variable: expected one of "
                                f"{', '.join(VARIABLES)}")
    arr = np.asarray(value)
    if name in FLOAT_VARIABLES:
        return arr.astype(np.float64, copy=False)
    if arr.dtype.kind not in "biu":
        raise InvalidTypeError(f"env[{name!r}] has dtype {arr.dtype}: the variable {name} is an "
                               "integer index or length; pass an integer array")
    return arr.astype(np.int64, copy=False)


def _eval(node: Expr, values: dict[str, np.ndarray], memo: dict[int, np.ndarray]) -> np.ndarray:
    """Evaluate one node; ``memo`` shares the results of subtrees reused by identity."""
    key = id(node)
    if key in memo:
        return memo[key]
    op = node.op
    if op is Op.VAR:
        try:
            result = values[node.value]
        except KeyError:
            raise InvalidInputError(f"the expression reads variable {node.value!r}, which is not in "
                                    f"env (given: {', '.join(sorted(values)) or 'nothing'})") from None
    elif op is Op.CONST:
        result = _constant(node.value)
    else:
        args = [_eval(a, values, memo) for a in node.args]
        _check_arity(node, len(args))
        if op in _NUMERIC:
            args = [a.astype(np.int64) if a.dtype == np.bool_ else a for a in args]
        if op is Op.WHERE:
            result = np.where(args[0].astype(bool, copy=False), args[1], args[2])
        elif op in _UNARY:
            result = _UNARY[op](args[0])
        else:
            result = _BINARY[op](args[0], args[1])
    memo[key] = result
    return result


def _constant(value: object) -> np.ndarray:
    """A 0-d array of the constant's own type: bool, int64 or float64."""
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, (int, np.integer)):
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, (float, np.floating)):
        return np.asarray(value, dtype=np.float64)
    raise InvalidTypeError(f"expression constant {value!r} must be an int, float or bool")


def _check_arity(node: Expr, n: int) -> None:
    """Raise naming the node when it has the wrong number of children for its op."""
    if node.op is Op.WHERE:
        want = 3
    elif node.op in _UNARY:
        want = 1
    elif node.op in _BINARY:
        want = 2
    else:
        raise InvalidInputError(f"expression node {node.op!r} has no meaning in the IR evaluator: expected one of "
                                "the ops of portakern.ir.expr.Op")
    if n != want:
        raise InvalidInputError(f"expression node {node}: op {node.op.value} takes {want} "
                                f"argument(s), got {n}")
