"""The shared C-like expression emitter (``portakern.cstyle``) and the two languages built on it: what the
base decides for every language (views, folding, promotion, errors) and what each subclass states.
The numeric meaning of the generated code is checked against the IR's evaluator on the devices by
tests/test_opencl_expr.py and the triton conformance cases."""

from __future__ import annotations

import pytest

from portakern.backends.opencl.expr_opencl import OpenCLEmitter
from portakern.backends.triton.expr_triton import TritonEmitter, generate_source
from portakern.cstyle import CStyleEmitter
from portakern.errors import UnsupportedError
from portakern.ir import expr as E
from portakern.ir.expr import Expr, Op

LANGUAGES = [TritonEmitter, OpenCLEmitter]
EVERY_OP = [op for op in Op if op not in (Op.VAR, Op.CONST)]


@pytest.mark.parametrize("emitter", LANGUAGES, ids=lambda c: c.language)
def test_every_op_has_an_entry(emitter):
    assert sorted(set(EVERY_OP) - set(emitter.code_for_op)) == []
    v = [E.score, E.kv_idx, E.q_idx]
    for op in EVERY_OP:
        n = 1 if op in E.UNARY else 3 if op is Op.WHERE else 2
        assert emitter().emit(Expr(op, tuple(v[:n]))), op


def test_an_op_without_an_entry_names_the_language_and_the_op():
    with pytest.raises(UnsupportedError, match=r"expression node 'abs' has no C lowering: .*backend=\"cpu\""):
        CStyleEmitter().emit(abs(E.score))

    class NoTanh(OpenCLEmitter):
        language = "Test C"
        code_for_op = {k: v for k, v in OpenCLEmitter.code_for_op.items() if k is not Op.TANH}

    with pytest.raises(UnsupportedError, match="'tanh' has no Test C lowering"):
        NoTanh().emit(E.score + E.tanh(E.score))


def test_the_base_is_plain_c():
    em = CStyleEmitter()
    assert em.emit(E.where(E.kv_idx > 1, E.score, 0.5)) == "((kv_idx > (1)) ? score : (0.5))"
    assert em.emit(~E.h.eq(0) | (E.b > 1)) == "((!(h == (0))) || (b > (1)))"
    assert em.emit((E.kv_idx < 2) + E.q_idx) == "(((long)(kv_idx < (2))) + q_idx)"   # a boolean counts 0/1


def test_explicit_promotion_is_a_capability():
    """OpenCL C writes the int -> float conversion of a mixed operator; Triton leaves it to its promotion
    (the divisor of a division likewise)."""
    assert OpenCLEmitter().emit(E.score + E.kv_idx) == "(score + ((float)kv_idx))"
    assert TritonEmitter().emit(E.score + E.kv_idx) == "(score + kv_idx)"
    assert OpenCLEmitter().emit(E.score / E.kv_idx) == "(score / ((float)kv_idx))"
    assert TritonEmitter().emit(E.score / E.kv_idx) == "(score / kv_idx)"


def test_views_use_each_languages_casts():
    assert TritonEmitter().emit((E.kv_idx < 2) + E.q_idx) == "((kv_idx < (2)).to(tl.int32) + q_idx)"
    assert OpenCLEmitter().emit((E.kv_idx < 2) + E.q_idx) == "(((long)(kv_idx < ((long)2L))) + q_idx)"
    assert TritonEmitter().emit(E.exp(E.q_idx)) == "tl.exp(q_idx.to(tl.float32))"
    assert OpenCLEmitter().emit(E.exp(E.q_idx)) == "exp(((float)q_idx))"
    for em in (TritonEmitter(), OpenCLEmitter()):
        assert em.truth(E.q_idx - E.kv_idx) == "((q_idx - kv_idx) != 0)"


def test_triton_writes_constant_children_in_the_views_type():
    """A Python literal has no .to(): Triton's num/flt of a constant give the literal of the converted value."""
    em = TritonEmitter()
    assert (em.num(E.const(True)), em.flt(E.const(3))) == ("(1)", "(3.0)")
    assert (OpenCLEmitter().num(E.const(True)), OpenCLEmitter().flt(E.const(3))) == ("((long)1)",
                                                                                     "((float)((long)3L))")


def test_variable_free_subtrees_fold_by_the_evaluator():
    assert TritonEmitter().emit(E.const(1) / 0) == "_INF"
    assert OpenCLEmitter().emit(E.const(-1) / 0) == "(-INFINITY)"
    assert OpenCLEmitter().emit(E.const(0.0) / 0) == "NAN"
    assert TritonEmitter().emit(E.score + E.const(2) * 3) == "(score + (6))"
    assert TritonEmitter().emit(E.const(True) & E.const(False)) == "False"


def test_literals_follow_the_languages_types():
    t, o = TritonEmitter(), OpenCLEmitter()
    assert (t.literal(True), o.literal(True), t.literal(-3), o.literal(-3)) == ("True", "1", "(-3)", "((long)-3L)")
    assert o.literal(-(2 ** 63)) == "((long)(-9223372036854775807L - 1))"
    assert (t.literal(1e300), o.literal(1e300)) == ("(1e+300)", "INFINITY")    # OpenCL rounds to float32 first
    assert (t.literal(-0.0), o.literal(-0.0)) == ("(-0.0)", "(-0.0f)")
    with pytest.raises(UnsupportedError, match=r"2147483648 does not fit the 32-bit int32 of the Triton lowering"):
        t.literal(2 ** 31)
    assert t.literal(-(2 ** 31)) == f"({-(2 ** 31)})"
    with pytest.raises(UnsupportedError, match=r"does not fit the 64-bit long of the OpenCL C lowering"):
        o.literal(2 ** 63)


def test_generated_text_of_the_library_mods():
    """The text both languages generate for two library expressions, as the kernels receive it."""
    assert TritonEmitter().truth(E.causal_mask()) == "(kv_idx <= ((q_idx + seqlen_k) - seqlen_q))"
    assert OpenCLEmitter().truth(E.causal_mask()) == "(kv_idx <= ((q_idx + seqlen_k) - seqlen_q))"
    assert TritonEmitter().flt(E.softcap_score(30.0)) == "((30.0) * _tanh((score / (30.0))))"
    assert OpenCLEmitter().flt(E.softcap_score(30.0)) == \
        "((0x1.e000000000000p+4f) * tanh((score / (0x1.e000000000000p+4f))))"
    src = generate_source(E.softcap_score(30.0), E.const(False))
    assert "    return ((30.0) * _tanh((score / (30.0))))\n" in src and "    return kv_idx < 0\n" in src
