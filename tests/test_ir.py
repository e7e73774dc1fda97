"""The kernel IR: verify() messages, JSON round trip, stable content hash, library expressions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir import Attention, DType, KVLayout, Packing, QuantFormat, QuantGemv, content_hash, op_from_json
from portakern.ir import expr as E
from portakern.ir.expr import ARITH, COMPARE, LOGIC, UNARY, Expr, Op
from portakern.ir.quant import GGUF_LAYOUT, PACKING_BITS

FLOATS = [DType.float16, DType.bfloat16, DType.float32]
POSITIONS = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")

# -- strategies -------------------------------------------------------------------------------------

constants = st.one_of(st.integers(-1000, 1000), st.booleans(),
                      st.floats(allow_nan=False, allow_infinity=True, width=64)).map(E.const)


def trees(leaves):
    """Any expression tree (well-formed arity) over ``leaves``."""
    return st.recursive(leaves, lambda c: st.one_of(
        st.builds(lambda op, a: Expr(op, (a,)), st.sampled_from(UNARY), c),
        st.builds(lambda op, a, b: Expr(op, (a, b)), st.sampled_from(ARITH + COMPARE + LOGIC), c, c),
        st.builds(E.where, c, c, c)), max_leaves=10)


any_expr = trees(st.one_of(st.sampled_from(E.VARIABLES).map(E.var), constants))
position_expr = trees(st.one_of(st.sampled_from(POSITIONS).map(E.var), st.integers(-64, 64).map(E.const)))
numeric_position = st.builds(lambda op, a, b: Expr(op, (a, b)), st.sampled_from(ARITH), position_expr, position_expr)

library_masks = st.one_of(
    st.just(E.causal_mask()),
    st.builds(E.window_mask, st.integers(-1, 64), st.integers(-1, 64)).filter(lambda m: m.is_bool()),
    st.builds(E.prefix_lm_mask, st.integers(0, 64)),
    st.builds(lambda bs: E.document_mask(tuple(sorted(set(bs)))), st.lists(st.integers(1, 100), max_size=4)),
)
masks = st.one_of(library_masks,
                  st.builds(lambda op, a, b: Expr(op, (a, b)), st.sampled_from(COMPARE), position_expr, position_expr),
                  st.builds(lambda a, b: a & b, library_masks, library_masks))
score_mods = st.one_of(
    st.builds(E.softcap_score, st.floats(0.5, 100)),
    st.builds(lambda n: E.alibi_score(E.alibi_slopes(n)), st.sampled_from([1, 2, 4, 8])),
    st.builds(lambda c: E.score * c, st.floats(-4, 4, allow_nan=False)),
    st.builds(lambda x: E.score + x, numeric_position),
)

dims = st.integers(1, 300)


@st.composite
def attention_nodes(draw) -> Attention:
    hkv = draw(st.integers(1, 8))
    layout = draw(st.sampled_from(list(KVLayout)))
    kw = dict(batch=draw(st.integers(1, 16)), seqlen_q=draw(dims), heads_q=hkv * draw(st.integers(1, 8)),
              heads_kv=hkv, head_dim=draw(st.integers(1, 512)), head_dim_v=draw(st.integers(1, 512)),
              dtype=draw(st.sampled_from(FLOATS)), scale=draw(st.floats(1e-4, 10)),
              score_mod=draw(st.none() | score_mods), mask_mod=draw(st.none() | masks),
              return_lse=draw(st.booleans()), kv_layout=layout)
    if layout is KVLayout.PAGED:
        page = draw(st.sampled_from([1, 8, 16, 64]))
        kw.update(page_size=page, seqlen_k=page * draw(st.integers(1, 32)), num_pages=draw(st.integers(1, 999)),
                  has_seqlens_k=True)
    elif layout is KVLayout.VARLEN:
        kw.update(seqlen_k=draw(dims), total_q=draw(dims), total_k=draw(dims))
    else:
        kw.update(seqlen_k=draw(dims), has_seqlens_k=draw(st.booleans()))
    return Attention(**kw)


@st.composite
def quant_formats(draw) -> QuantFormat:
    packing = draw(st.sampled_from(list(Packing)))
    bits = draw(st.sampled_from(PACKING_BITS[packing]))
    if packing in GGUF_LAYOUT:
        return QuantFormat(bits, GGUF_LAYOUT[packing][0], GGUF_LAYOUT[packing][1], packing)
    sym = False if packing in (Packing.AWQ, Packing.GPTQ) else draw(st.booleans())
    return QuantFormat(bits, draw(st.sampled_from([32, 64, 128])), sym, packing,
                       scale_dtype=draw(st.sampled_from(FLOATS)),
                       has_g_idx=packing is Packing.GPTQ and draw(st.booleans()))


@st.composite
def quant_gemv_nodes(draw) -> QuantGemv:
    fmt = draw(quant_formats())
    K = GGUF_LAYOUT.get(fmt.packing, (0, 0, fmt.group_size))[2] * draw(st.integers(1, 64))  # whole GGUF blocks
    return QuantGemv(M=draw(st.integers(1, 16)), N=8 * draw(st.integers(1, 1024)), K=K,
                     dtype=draw(st.sampled_from(FLOATS)), fmt=fmt,
                     out_dtype=draw(st.none() | st.sampled_from(FLOATS)))


nodes = st.one_of(attention_nodes(), quant_gemv_nodes())
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- properties -------------------------------------------------------------------------------------

@SETTINGS
@given(nodes)
def test_generated_nodes_verify(node):
    assert node.verify() is node


@SETTINGS
@given(nodes)
def test_json_round_trip_and_stable_hash(node):
    text = json.dumps(node.to_json())
    back = op_from_json(json.loads(text))
    assert back == node and hash(back) == hash(node)
    assert back.content_hash() == node.content_hash() == content_hash(node)
    assert len(node.content_hash()) == 16 and int(node.content_hash(), 16) >= 0
    assert back.verify() == node


@SETTINGS
@given(nodes, nodes)
def test_hash_separates_distinct_nodes(a, b):
    assert (a == b) == (a.content_hash() == b.content_hash())


@SETTINGS
@given(any_expr)
def test_expression_json_round_trip(e):
    back = Expr.from_json(json.loads(json.dumps(e.to_json())))
    assert back == e and hash(back) == hash(e) and str(back) == str(e)


@SETTINGS
@given(any_expr, any_expr)
def test_expression_equality_is_structural(a, b):
    assert (a == b) == (json.dumps(a.to_json()) == json.dumps(b.to_json()))


def test_constants_of_different_types_stay_distinct():
    one, true, one_f = E.const(1), E.const(True), E.const(1.0)
    assert len({one, true, one_f}) == 3
    assert E.where(E.kv_idx < 3, True, False).is_bool() and not E.where(E.kv_idx < 3, 1, 0).is_bool()
    a = Attention(1, 1, 1, 1, 1, 8, 8, DType.float32, 0.5, mask_mod=E.where(E.kv_idx < 3, True, False))
    assert a.content_hash() != a.replace(mask_mod=E.where(E.kv_idx < 3, 1, 0)).content_hash()


def test_content_hash_does_not_depend_on_the_process():
    code = ("from portakern.ir import Attention, DType, expr as E;"
            "print(Attention(2, 3, 5, 4, 2, 64, 64, DType.bfloat16, 0.125, score_mod=E.softcap_score(30.0),"
            " mask_mod=E.causal_mask()).content_hash())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("0", "1", "2")}
    here = Attention(2, 3, 5, 4, 2, 64, 64, DType.bfloat16, 0.125, score_mod=E.softcap_score(30.0),
                     mask_mod=E.causal_mask()).content_hash()
    assert outs == {here}


# -- verify messages name the field, the value and the rule -----------------------------------------

def _att(**kw):
    base = dict(batch=1, seqlen_q=4, seqlen_k=8, heads_q=4, heads_kv=2, head_dim=64, head_dim_v=64,
                dtype=DType.float32, scale=0.125)
    return Attention(**{**base, **kw})


BAD_ATTENTION = [
    ({"batch": 0}, "batch=0 must be a positive int"),
    ({"seqlen_q": -3}, "seqlen_q=-3 must be a positive int"),
    ({"head_dim": 2.0}, "head_dim=2.0 must be a positive int"),
    ({"heads_kv": True}, "heads_kv=True must be a positive int"),
    ({"heads_q": 6, "heads_kv": 4}, "heads_q=6 is not a multiple of heads_kv=4: grouped-query attention needs Hq % Hkv == 0"),
    ({"dtype": DType.float64}, "must be one of float16, bfloat16, float32"),
    ({"scale": 0.0}, "scale=0.0 must be a finite non-zero float"),
    ({"scale": math.inf}, "scale=inf must be a finite non-zero float"),
    ({"scale": 1}, "scale=1 must be a finite non-zero float"),
    ({"score_mod": E.kv_idx < 2}, "must be a numeric Expr (it returns the new score)"),
    ({"mask_mod": E.kv_idx + 1}, "must be a boolean Expr (True keeps the key)"),
    ({"mask_mod": E.score > 0}, "mask_mod reads 'score': masks may depend on positions and heads only"),
    ({"mask_mod": Expr(Op.LT, (E.kv_idx,))}, "node lt has 1 arguments; it takes 2"),
    ({"score_mod": E.score + Expr(Op.VAR, (), "pos")},
     "Attention.score_mod: variable 'pos' is unknown: expected one of score, b, h, q_idx, kv_idx"),
    ({"score_mod": E.score + Expr(Op.CONST, (), "x")},
     "Attention.score_mod: constant 'x' must be an int, float or bool"),
    ({"kv_layout": KVLayout.PAGED}, "page_size=0, num_pages=0 must be positive for paged KV"),
    ({"kv_layout": KVLayout.PAGED, "page_size": 3, "num_pages": 4, "has_seqlens_k": True},
     "seqlen_k=8 must equal max_pages * page_size=3"),
    ({"kv_layout": KVLayout.PAGED, "page_size": 4, "num_pages": 4}, "paged KV needs seqlens_k"),
    ({"page_size": 16}, "page_size=16 / num_pages=0 are only meaningful for paged KV"),
    ({"kv_layout": KVLayout.VARLEN}, "total_q=0, total_k=0 must be positive for varlen"),
    ({"kv_layout": KVLayout.VARLEN, "total_q": 4, "total_k": 8, "has_seqlens_k": True},
     "varlen takes its key lengths from cu_seqlens_k; seqlens_k must be None"),
    ({"total_q": 3}, "total_q / total_k are only meaningful for varlen"),
]


@pytest.mark.parametrize("change, fragment", BAD_ATTENTION, ids=[next(iter(c)) + f"-{i}" for i, (c, _) in enumerate(BAD_ATTENTION)])
def test_attention_verify_messages(change, fragment):
    with pytest.raises(InvalidInputError) as e:
        _att(**change).verify()
    assert str(e.value).startswith("Attention") and fragment in str(e.value)
    assert isinstance(e.value, ValueError)


BAD_GEMV = [
    (dict(M=0), "QuantGemv: M=0 must be a positive int"),
    (dict(K=100), "group_size=32 does not divide K=100; pick a group size that divides K (or pad K to a multiple of 32)"),
    (dict(dtype=DType.int8), "QuantGemv: dtype=DType.int8 must be one of float16, bfloat16, float32"),
    (dict(out_dtype=DType.float64), "out_dtype=DType.float64 must be one of float16, bfloat16, float32"),
    (dict(fmt=QuantFormat(8, 32, False, Packing.AWQ)), "bits=8 is not supported by packing awq: allowed (4,)"),
    (dict(fmt=QuantFormat(4, 32, True, Packing.GGUF_Q8_0)), "bits=4 is not supported by packing gguf_q8_0"),
    (dict(fmt=QuantFormat(4, 32, False, Packing.GGUF_Q4_0)), "symmetric=False is impossible for gguf_q4_0"),
    (dict(fmt=QuantFormat(4, 1, True)), "group_size=1 must be an int >= 2"),
    (dict(fmt=QuantFormat(4, 32, True, has_g_idx=True)), "has_g_idx=True is only meaningful for packing gptq"),
    (dict(fmt=QuantFormat(4, 32, True, scale_dtype=DType.int8)), "scale_dtype=int8 must be float16, bfloat16 or float32"),
    (dict(fmt=QuantFormat(4, 32, False, Packing.GPTQ), K=96, N=12), "N=12 must be a multiple of 8 for gptq"),
    (dict(fmt=QuantFormat(4, 32, True, Packing.GGUF_Q4_0, scale_dtype=DType.float32)),
     "QuantFormat: scale_dtype=float32 is impossible for gguf_q4_0: GGUF blocks embed float16 scales; use float16"),
]


@pytest.mark.parametrize("change, fragment", BAD_GEMV, ids=[f"gemv-{i}" for i in range(len(BAD_GEMV))])
def test_quant_gemv_verify_messages(change, fragment):
    node = QuantGemv(**{**dict(M=1, N=64, K=128, dtype=DType.float16, fmt=QuantFormat(4, 32, True)), **change})
    with pytest.raises(InvalidInputError, match=None) as e:
        node.verify()
    assert fragment in str(e.value)


def test_unknown_op_in_json():
    with pytest.raises(InvalidInputError, match="op='conv2d' is unknown: expected one of attention, quant_gemv"):
        op_from_json({"op": "conv2d"})


# -- errors ---------------------------------------------------------------------------------------

def test_ir_errors_are_the_core_errors():
    """The IR defines the errors it raises; portakern.errors re-exports the same classes."""
    import portakern.errors as core
    import portakern.ir.errors as ir_errors

    for name, builtin in (("PortakernError", Exception), ("InvalidInputError", ValueError),
                          ("InvalidTypeError", TypeError)):
        assert getattr(core, name) is getattr(ir_errors, name)
        assert issubclass(getattr(ir_errors, name), builtin)
    assert issubclass(ir_errors.InvalidInputError, ir_errors.PortakernError)
    assert issubclass(core.UnsupportedError, ir_errors.PortakernError)
    with pytest.raises(core.InvalidInputError, match="dtype"):
        DType.parse("int3", argument="dtype")


# -- expressions ------------------------------------------------------------------------------------

def test_expression_has_no_truth_value():
    with pytest.raises(TypeError, match="combine conditions with & and |"):
        bool(E.kv_idx < E.q_idx)


def test_bad_constants_and_variables():
    with pytest.raises(InvalidTypeError, match="expression constant 'x' must be an int, float or bool"):
        E.const("x")
    with pytest.raises(InvalidInputError, match="expression variable 'pos' is unknown"):
        E.var("pos")


def test_operator_sugar_builds_nodes():
    e = (E.kv_idx <= E.q_idx + 1) & ~(E.h.eq(0)) | E.b.ne(2)
    assert e.op is Op.OR and e.args[0].op is Op.AND and e.args[0].args[1].op is Op.NOT
    assert e.variables() == {"kv_idx", "q_idx", "h", "b"} and e.is_bool()
    assert (2 - E.score).op is Op.SUB and (2 - E.score).args[0] == E.const(2)
    assert E.compose_score(E.softcap_score(5.0), E.score * 2).variables() == {"score"}


def _grid(Sq, Sk, H=1):
    return {"q_idx": np.arange(Sq)[None, :, None], "kv_idx": np.arange(Sk)[None, None, :],
            "h": np.arange(H)[:, None, None], "b": 0, "seqlen_q": Sq, "seqlen_k": Sk}


@pytest.mark.parametrize("Sq, Sk", [(1, 1), (4, 9), (9, 4), (7, 7)])
def test_library_masks_mean_what_docs_say(Sq, Sk):
    from portakern.ir.evaluate import evaluate

    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    d = i + Sk - Sq                                             # bottom-right alignment
    env = _grid(Sq, Sk)
    cases = [(E.causal_mask(), j <= d), (E.window_mask(2, 1), (d - 2 <= j) & (j <= d + 1)),
             (E.window_mask(-1, 0), j <= d), (E.window_mask(3, -1), j >= d - 3),
             (E.prefix_lm_mask(2), (j < 2) | (j <= d)),
             (E.document_mask((3, 5)), (np.searchsorted([3, 5], d, "right") == np.searchsorted([3, 5], j, "right")))]
    for expr, want in cases:
        np.testing.assert_array_equal(np.broadcast_to(evaluate(expr, env), (1, Sq, Sk))[0], want, err_msg=str(expr))
    assert E.window_mask(-1, -1) == E.const(True)


def test_library_scores_mean_what_docs_say():
    from portakern.ir.evaluate import evaluate

    s = np.linspace(-50, 50, 7)
    np.testing.assert_allclose(evaluate(E.softcap_score(30.0), {"score": s}), 30 * np.tanh(s / 30))
    slopes = E.alibi_slopes(4)
    assert slopes == tuple(2.0 ** (-8.0 * (i + 1) / 4) for i in range(4))
    env = {**_grid(3, 5, H=4), "score": np.zeros((4, 3, 5))}
    got = evaluate(E.alibi_score(slopes), env)
    d = np.arange(3)[:, None] + 5 - 3
    want = -np.asarray(slopes)[:, None, None] * np.abs(d - np.arange(5)[None, :])[None]
    np.testing.assert_allclose(got, want)


# -- quant formats ----------------------------------------------------------------------------------

@SETTINGS
@given(quant_formats())
def test_quant_format_round_trip(fmt):
    fmt.verify(K=fmt.group_size * 16, N=64)  # whole GGUF K-quant blocks of 256
    assert QuantFormat.from_json(json.loads(json.dumps(fmt.to_json()))) == fmt


def test_zero_points_and_weight_bytes():
    assert QuantFormat(4, 32, True).zero_point == 8 and QuantFormat(8, 32, True).zero_point == 128
    assert QuantFormat(8, 32, True, Packing.GGUF_Q8_0).zero_point == 0
    g = QuantGemv(1, 64, 128, DType.float16, QuantFormat(4, 32, False))
    assert g.weight_bytes == 64 * 128 // 2 + 64 * 4 * 2 + 64 * 4 // 2
    assert g.shapes() == {"x": (1, 128), "out": (1, 64)}


def test_attention_shapes_per_layout():
    a = _att(return_lse=True)
    assert a.shapes() == {"q": (1, 4, 4, 64), "k": (1, 8, 2, 64), "v": (1, 8, 2, 64), "out": (1, 4, 4, 64),
                          "lse": (1, 4, 4)}
    p = _att(kv_layout=KVLayout.PAGED, page_size=4, num_pages=7, has_seqlens_k=True)
    assert p.shapes()["k"] == (7, 4, 2, 64) and p.shapes()["block_table"] == (1, 2) and p.max_pages == 2
    v = _att(kv_layout=KVLayout.VARLEN, total_q=10, total_k=20, return_lse=True)
    assert v.shapes()["q"] == (10, 4, 64) and v.shapes()["lse"] == (4, 10) and v.shapes()["cu_seqlens_k"] == (2,)
    assert a.group_size == 2 and a.flops == 2 * 1 * 4 * 4 * 8 * 128


def test_op_from_json_names_what_is_wrong_with_the_dict():
    """A dict an op's to_json() did not make is InvalidInputError naming the key or value (before: a bare KeyError,
    ValueError or TypeError from the node's from_json)."""
    from portakern.errors import InvalidInputError
    from portakern.ir import DType, QuantFormat, QuantGemv, op_from_json

    good = QuantGemv(M=1, N=64, K=128, dtype=DType.float16, fmt=QuantFormat(bits=4, group_size=32, symmetric=True)).to_json()
    assert op_from_json(good).to_json() == good
    with pytest.raises(InvalidInputError, match=r"op_from_json: the quant_gemv dict lacks the key 'K'"):
        op_from_json({k: v for k, v in good.items() if k != "K"})
    with pytest.raises(InvalidInputError, match=r"op_from_json: the quant_gemv dict holds a value .*'f17'"):
        op_from_json({**good, "dtype": "f17"})
    with pytest.raises(InvalidInputError, match=r"op_from_json: got a list"):
        op_from_json([good])
    with pytest.raises(InvalidInputError, match=r"op='conv' is unknown"):
        op_from_json({**good, "op": "conv"})
