"""The IR's expression evaluator (``portakern.ir.evaluate``), the cpu backend's lowering built on it,
JSON round trips and ``bool(expr)``.

Expected values are written by hand or computed by an independent scalar Python interpreter.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portakern.ir.evaluate import evaluate
from portakern.backends.cpu.expr_numpy import lower
from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir import expr as E
from portakern.ir.expr import ARITH, COMPARE, LOGIC, UNARY, VARIABLES, Expr, Op


def grid(sq: int, sk: int, **extra) -> dict:
    """Environment over a (1, sq, sk) grid of query rows x keys."""
    env = {"b": 0, "h": 0, "seqlen_q": sq, "seqlen_k": sk,
           "q_idx": np.arange(sq)[None, :, None], "kv_idx": np.arange(sk)[None, None, :]}
    env.update(extra)
    return env


# -- library expressions on hand-computed grids ---------------------------------------------------

def test_causal_mask_is_bottom_right_aligned():
    got = evaluate(E.causal_mask(), grid(2, 4))[0]
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, [[1, 1, 1, 0],
                                        [1, 1, 1, 1]])


def test_causal_mask_more_queries_than_keys():
    got = evaluate(E.causal_mask(), grid(4, 2))[0]
    np.testing.assert_array_equal(got, [[0, 0],
                                        [0, 0],
                                        [1, 0],
                                        [1, 1]])


def test_window_mask_left_and_right():
    got = evaluate(E.window_mask(1, 1), grid(4, 4))[0]
    np.testing.assert_array_equal(got, [[1, 1, 0, 0],
                                        [1, 1, 1, 0],
                                        [0, 1, 1, 1],
                                        [0, 0, 1, 1]])
    left_only = evaluate(E.window_mask(1, -1), grid(3, 3))[0]
    np.testing.assert_array_equal(left_only, [[1, 1, 1],
                                              [1, 1, 1],
                                              [0, 1, 1]])
    assert evaluate(E.window_mask(-1, -1), grid(2, 2)).all()


def test_softcap_score():
    scores = np.array([0.0, 10.0, -100.0])
    got = evaluate(E.softcap_score(20.0), {"score": scores})
    want = [0.0, 20.0 * math.tanh(0.5), 20.0 * math.tanh(-5.0)]
    np.testing.assert_allclose(got, want, rtol=1e-15)


def test_alibi_score_per_head_slopes():
    env = grid(2, 3, h=np.array([0, 1])[:, None, None], score=np.zeros((2, 2, 3)))
    got = evaluate(E.alibi_score((0.5, 0.25)), env)
    # diag = q + 3 - 2 = q + 1; bias = -slope * |q + 1 - k|
    want = np.array([[[-0.5, 0.0, -0.5], [-1.0, -0.5, 0.0]],
                     [[-0.25, 0.0, -0.25], [-0.5, -0.25, 0.0]]])
    np.testing.assert_array_equal(got, want)


def test_alibi_slopes_series():
    assert E.alibi_slopes(4) == (0.25, 0.0625, 0.015625, 0.00390625)


def test_document_mask_block_diagonal():
    got = evaluate(E.document_mask((2,)), grid(4, 4))[0]
    np.testing.assert_array_equal(got, [[1, 1, 0, 0],
                                        [1, 1, 0, 0],
                                        [0, 0, 1, 1],
                                        [0, 0, 1, 1]])


def test_prefix_lm_mask():
    got = evaluate(E.prefix_lm_mask(2), grid(3, 3))[0]
    np.testing.assert_array_equal(got, [[1, 1, 0],
                                        [1, 1, 0],
                                        [1, 1, 1]])


def test_compose_score_applies_inner_first():
    tree = E.compose_score(E.score * 2.0, E.score + 1.0)
    assert float(evaluate(tree, {"score": 3.0})) == 8.0


# -- types and ops ------------------------------------------------------------------------------

def test_variable_types():
    assert evaluate(E.q_idx, {"q_idx": np.arange(3, dtype=np.int32)}).dtype == np.int64
    assert evaluate(E.score, {"score": np.ones(2, np.float32)}).dtype == np.float64
    assert evaluate(E.const(2), {}).dtype == np.int64
    assert evaluate(E.const(2.0), {}).dtype == np.float64
    assert evaluate(E.const(True), {}).dtype == np.bool_
    assert evaluate(E.const(1), {}).shape == ()


def test_division_is_true_division():
    got = evaluate(E.q_idx / 2, {"q_idx": np.array([3, 4, -3])})
    np.testing.assert_array_equal(got, [1.5, 2.0, -1.5])
    assert got.dtype == np.float64


def test_arithmetic_and_unary_ops():
    env = {"q_idx": np.array([0, 1, 2, 3]), "kv_idx": np.array([2, 2, 2, 2])}
    np.testing.assert_array_equal(evaluate(E.q_idx - E.kv_idx, env), [-2, -1, 0, 1])
    np.testing.assert_array_equal(evaluate(abs(E.q_idx - E.kv_idx), env), [2, 1, 0, 1])
    np.testing.assert_array_equal(evaluate(-E.q_idx * 3, env), [0, -3, -6, -9])
    np.testing.assert_array_equal(evaluate(E.minimum(E.q_idx, E.kv_idx), env), [0, 1, 2, 2])
    np.testing.assert_array_equal(evaluate(E.maximum(E.q_idx, 1.5), env), [1.5, 1.5, 2, 3])
    np.testing.assert_allclose(evaluate(E.exp(E.q_idx), env), [1, math.e, math.e ** 2, math.e ** 3])
    np.testing.assert_allclose(evaluate(E.tanh(E.q_idx), env), [math.tanh(i) for i in range(4)])


def test_comparisons_and_logic():
    env = {"q_idx": np.array([0, 1, 2, 3])}
    q = E.q_idx
    np.testing.assert_array_equal(evaluate(q < 2, env), [1, 1, 0, 0])
    np.testing.assert_array_equal(evaluate(q <= 2, env), [1, 1, 1, 0])
    np.testing.assert_array_equal(evaluate(q > 2, env), [0, 0, 0, 1])
    np.testing.assert_array_equal(evaluate(q >= 2, env), [0, 0, 1, 1])
    np.testing.assert_array_equal(evaluate(q.eq(2), env), [0, 0, 1, 0])
    np.testing.assert_array_equal(evaluate(q.ne(2), env), [1, 1, 0, 1])
    np.testing.assert_array_equal(evaluate((q > 0) & (q < 3), env), [0, 1, 1, 0])
    np.testing.assert_array_equal(evaluate((q < 1) | (q > 2), env), [1, 0, 0, 1])
    np.testing.assert_array_equal(evaluate(~(q < 1), env), [0, 1, 1, 1])
    assert evaluate((q < 1) | (q > 2), env).dtype == np.bool_


def test_where_selects_elementwise():
    env = {"q_idx": np.array([0, 1, 2]), "score": np.array([10.0, 20.0, 30.0])}
    got = evaluate(E.where(E.q_idx.eq(1), -1.0, E.score), env)
    np.testing.assert_array_equal(got, [10.0, -1.0, 30.0])


def test_booleans_count_as_integers_in_arithmetic():
    env = {"q_idx": np.array([0, 1, 2])}
    got = evaluate((E.q_idx > 0) + (E.q_idx > 1), env)
    np.testing.assert_array_equal(got, [0, 1, 2])
    np.testing.assert_array_equal(evaluate(-(E.q_idx > 0), env), [0, -1, -1])
    assert evaluate(E.tanh(E.q_idx > 0), env).dtype == np.float64


def test_broadcasting_over_variables():
    env = {"h": np.arange(2)[:, None, None], "q_idx": np.arange(3)[None, :, None],
           "kv_idx": np.arange(4)[None, None, :], "score": np.zeros((2, 3, 4))}
    assert evaluate(E.h + E.q_idx + E.kv_idx, env).shape == (2, 3, 4)
    assert evaluate(E.kv_idx <= E.q_idx, env).shape == (1, 3, 4)
    got = evaluate(E.h * 100 + E.q_idx * 10 + E.kv_idx, env)
    assert got[1, 2, 3] == 123 and got[0, 1, 0] == 10


def test_ieee_results_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = evaluate(E.score / E.q_idx, {"score": np.array([1.0, -1.0, 0.0]), "q_idx": 0})
        big = evaluate(E.exp(E.score), {"score": 1000.0})
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])
    assert big == np.inf


def test_missing_variable_is_named():
    with pytest.raises(InvalidInputError, match="kv_idx"):
        evaluate(E.causal_mask(), {"q_idx": 0, "seqlen_q": 1, "seqlen_k": 1})


def test_unknown_env_name_is_rejected():
    with pytest.raises(InvalidInputError, match="'pos'"):
        evaluate(E.q_idx, {"q_idx": 0, "pos": 1})


def test_float_index_is_rejected():
    with pytest.raises(InvalidTypeError, match="q_idx"):
        evaluate(E.q_idx, {"q_idx": np.array([0.5])})


def test_malformed_node_is_named():
    with pytest.raises(InvalidInputError, match="takes 2"):
        evaluate(Expr(Op.ADD, (E.q_idx,)), {"q_idx": 1})


def test_constant_of_another_type_is_named():
    with pytest.raises(InvalidTypeError, match=r"expression constant 'x' must be an int, float or bool"):
        evaluate(Expr(Op.CONST, (), "x"), {})


# -- truth value ---------------------------------------------------------------------------------

def test_bool_of_expr_raises_type_error():
    with pytest.raises(TypeError, match="truth value"):
        bool(E.q_idx < 3)
    with pytest.raises(TypeError, match="truth value"):
        if E.kv_idx <= E.q_idx:  # noqa: SIM102 - the point is the implicit bool()
            pass
    with pytest.raises(TypeError, match="truth value"):
        _ = (E.q_idx < 1) and (E.kv_idx < 1)
    with pytest.raises(TypeError, match="truth value"):
        _ = 0 <= E.kv_idx < 4  # a chained comparison needs bool() of the first half


# -- random trees: JSON round trip and an independent scalar interpreter -------------------------

_numbers = st.one_of(st.booleans(), st.integers(-5, 5),
                     st.floats(-4.0, 4.0, allow_nan=False, allow_infinity=False))
_leaves = st.one_of(st.sampled_from(VARIABLES).map(E.var), _numbers.map(E.const))


def _trees(unary, binary) -> st.SearchStrategy[Expr]:
    def extend(children):
        return st.one_of(
            st.builds(lambda op, a: Expr(op, (a,)), st.sampled_from(unary), children),
            st.builds(lambda op, a, b: Expr(op, (a, b)), st.sampled_from(binary), children, children),
            st.builds(lambda c, a, b: Expr(Op.WHERE, (c, a, b)), children, children, children),
        )
    return st.recursive(_leaves, extend, max_leaves=12)


ALL_TREES = _trees(UNARY, ARITH + COMPARE + LOGIC)
#: without div and exp, so the scalar interpreter below never divides by zero or overflows
SAFE_TREES = _trees(tuple(o for o in UNARY if o is not Op.EXP),
                    tuple(o for o in ARITH + COMPARE + LOGIC if o is not Op.DIV))


@settings(max_examples=150, deadline=None)
@given(ALL_TREES)
def test_json_round_trip(tree):
    text = json.dumps(tree.to_json())
    back = Expr.from_json(json.loads(text))
    assert back == tree
    assert json.dumps(back.to_json()) == text


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_json_round_trip_non_finite_constants(value):
    tree = E.score + value
    assert Expr.from_json(json.loads(json.dumps(tree.to_json()))) == tree


def test_json_round_trip_library_expressions():
    for tree in (E.causal_mask(), E.window_mask(3, 1), E.softcap_score(30.0),
                 E.alibi_score(E.alibi_slopes(8)), E.document_mask((5, 9)), E.prefix_lm_mask(4)):
        assert Expr.from_json(json.loads(json.dumps(tree.to_json()))) == tree


_SCALAR = {
    Op.NEG: lambda a: -a, Op.ABS: abs, Op.TANH: math.tanh, Op.EXP: math.exp, Op.NOT: lambda a: not a,
    Op.ADD: lambda a, b: a + b, Op.SUB: lambda a, b: a - b, Op.MUL: lambda a, b: a * b,
    Op.DIV: lambda a, b: a / b, Op.MIN: min, Op.MAX: max,
    Op.LT: lambda a, b: a < b, Op.LE: lambda a, b: a <= b, Op.GT: lambda a, b: a > b,
    Op.GE: lambda a, b: a >= b, Op.EQ: lambda a, b: a == b, Op.NE: lambda a, b: a != b,
    Op.AND: lambda a, b: bool(a) and bool(b), Op.OR: lambda a, b: bool(a) or bool(b),
    Op.WHERE: lambda c, a, b: a if c else b,
}


def _scalar_eval(tree: Expr, point: dict):
    """Plain-Python meaning of a tree at one point (bools count as 0/1 in arithmetic)."""
    if tree.op is Op.VAR:
        return point[tree.value]
    if tree.op is Op.CONST:
        return tree.value
    return _SCALAR[tree.op](*(_scalar_eval(a, point) for a in tree.args))


_ENV = {"score": np.array([[[-1.5, 0.0]], [[0.25, 3.0]]]),        # (2, 1, 2)
        "b": 1, "h": np.array([0, 3])[:, None, None],              # (2, 1, 1)
        "q_idx": np.array([0, 2, 5])[None, :, None],               # (1, 3, 1)
        "kv_idx": np.array([1, 4])[None, None, :],                 # (1, 1, 2)
        "seqlen_q": 6, "seqlen_k": 7}


@settings(max_examples=200, deadline=None)
@given(SAFE_TREES)
def test_evaluator_matches_scalar_python(tree):
    got = np.broadcast_to(evaluate(tree, _ENV), (2, 3, 2))
    for idx in np.ndindex(2, 3, 2):
        point = {name: (np.broadcast_to(v, (2, 3, 2))[idx].item() if isinstance(v, np.ndarray) else v)
                 for name, v in _ENV.items()}
        want = _scalar_eval(tree, point)
        assert math.isclose(float(got[idx]), float(want), rel_tol=1e-12, abs_tol=1e-12), (tree, idx)


# -- the cpu backend's lowering ---------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(SAFE_TREES)
def test_cpu_lowering_is_the_evaluator(tree):
    np.testing.assert_array_equal(lower(tree)(_ENV), evaluate(tree, _ENV))


def test_cpu_lowering_checks_the_tree_once_when_lowered():
    with pytest.raises(InvalidInputError, match="cpu expression lowering: node add has 1 arguments; it takes 2"):
        lower(Expr(Op.ADD, (E.q_idx,)))
    fn = lower(E.causal_mask())
    with pytest.raises(InvalidInputError, match="kv_idx"):
        fn({"q_idx": 0, "seqlen_q": 1, "seqlen_k": 1})


# -- window_bound: the inverse of the library masks' terms ---------------------------------------

@pytest.mark.parametrize("left,right", [(0, 0), (3, -1), (-1, 5), (7, 2), (0, -1)])
def test_window_bound_reads_back_each_term_of_window_mask(left, right):
    mask = E.window_mask(left, right)
    terms = list(mask.args) if mask.op is Op.AND else [mask]
    found = dict(E.window_bound(t) for t in terms)
    assert found == {k: v for k, v in (("left", left), ("right", right)) if v >= 0}


def test_window_bound_reads_causal_mask_as_right_zero():
    assert E.window_bound(E.causal_mask()) == ("right", 0)


@pytest.mark.parametrize("term", [
    E.kv_idx <= E.q_idx,                                                       # not the bottom-right diagonal
    E.q_idx <= E.q_idx + E.seqlen_k - E.seqlen_q,                              # not kv_idx on the left
    E.kv_idx < E.q_idx + E.seqlen_k - E.seqlen_q,                              # strict: not a library term
    E.kv_idx <= E.q_idx + E.seqlen_k - E.seqlen_q + E.const(-2),               # negative width
    E.kv_idx <= E.q_idx + E.seqlen_k - E.seqlen_q + E.const(2.0),              # float width
    E.kv_idx <= E.q_idx + E.seqlen_k - E.seqlen_q + E.const(True),             # bool width
    E.kv_idx >= E.q_idx + E.seqlen_k - E.seqlen_q + E.const(2),                # left side widened with +
    E.document_mask((0, 4, 9)),
])
def test_window_bound_refuses_every_other_term(term):
    assert E.window_bound(term) is None
