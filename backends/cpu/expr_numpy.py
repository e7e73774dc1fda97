"""The cpu backend's expression lowering: an ``ir.expr.Expr`` tree to a numpy function.

The cpu backend is the reference, so its lowering adds nothing to the IR's meaning: the function
``lower(expr)`` returns evaluates the tree with ``portakern.ir.evaluate.evaluate`` (float64 score,
int64 positions and lengths, numpy broadcasting; see that module for the types). What it adds is
the backend shape every backend shares: ``backends/<name>/expr_<lang>.py`` turns a tree into
something its kernels call (Triton source, OpenCL C, here a Python callable), and checks the tree
once when it is lowered rather than on every call.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from portakern.ir.evaluate import evaluate
from portakern.ir.expr import Expr

#: A lowered expression: the values of the variables it reads, by name -> the result array.
NumpyExpr = Callable[[Mapping[str, object]], np.ndarray]


def lower(expr: Expr) -> NumpyExpr:
    """The numpy function of ``expr``: ``lower(expr)(env)`` is ``portakern.ir.evaluate.evaluate(expr, env)``.

    Args:
        expr: a ``score_mod`` or ``mask_mod`` tree.

    Returns:
        A function of one argument, ``env`` (the value of each variable the tree reads: a Python
        scalar or a numpy array, broadcast against each other), returning a float64, int64 or
        bool array of the broadcast shape.

    Raises:
        InvalidInputError: a node has the wrong arity, an unknown variable or a bad constant
            (checked here, once); the function itself raises it for a variable missing from
            ``env`` and ``InvalidTypeError`` for non-integer index values.
    """
    expr.check("cpu expression lowering")

    def run(env: Mapping[str, object]) -> np.ndarray:
        return evaluate(expr, env)

    run.__qualname__ = run.__name__ = f"numpy_expr_{expr.op.value}"
    return run
