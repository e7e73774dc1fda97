"""The OpenCL C lowering of score_mod / mask_mod expressions (``backends/opencl/expr_opencl.py``), evaluated
on the OpenCL device over a grid of variable values and compared with the numpy reference evaluator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from portakern.ir.evaluate import evaluate
from portakern.backends.opencl import expr_opencl
from portakern.errors import UnsupportedError
from portakern.ir import expr as E

from opencl_helpers import require_opencl

_KERNEL = """
__kernel void grid(__global const float *score, __global const long *iv, __global float *s_out, __global int *m_out)
{
    const int t = get_global_id(0);
    const long b = iv[6 * t], h = iv[6 * t + 1], qi = iv[6 * t + 2], kj = iv[6 * t + 3], sq = iv[6 * t + 4],
               sk = iv[6 * t + 5];
#ifdef PK_HAS_SCORE_MOD
    s_out[t] = pk_score_mod(score[t], b, h, qi, kj, sq, sk);
#endif
#ifdef PK_HAS_MASK_MOD
    m_out[t] = pk_mask_mod(b, h, qi, kj, sq, sk);
#endif
}
"""
S, B_, H, Q, KV, SQ, SK = (E.var(n) for n in ("score", "b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k"))

SCORE_MODS = {
    "softcap": E.softcap_score(7.5),
    "alibi": E.alibi_score(E.alibi_slopes(4)),
    "arith": (S * 2 - KV / 3 + (-H)) * abs(Q - KV) + E.exp(S / 8) - E.tanh(S),
    "minmax": E.minimum(S, KV * 0.25) + E.maximum(Q, H) - E.minimum(Q, 3),
    "where-bool-arith": E.where(KV > Q, S, S - 1) + (KV < 4) * 2.0 - ~(Q > 2),
    "div-by-zero": S + (KV - Q) / (Q - Q) * 0.0 + E.where(KV.eq(Q), 1.0 / (Q - Q), 0.0),
    "consts": S + E.const(1e-3) + E.const(-7) + E.where(KV > 5, E.const(-math.inf), E.const(2.5)),
    "int-result": E.where(H > 1, KV * Q, Q - KV) + B_,
}
MASK_MODS = {
    "causal": E.causal_mask(),
    "window": E.window_mask(3, 1),
    "prefix": E.prefix_lm_mask(2),
    "document": E.document_mask([3, 5]),
    "logic": ((KV < Q) | (H.eq(2) & ~(Q > 4))) & (SK - SQ >= 0),
    "int-truth": E.where(KV - Q, Q, KV) > 1,
    "const": E.const(True) & (KV >= 0),
}


@pytest.fixture(scope="module")
def grid_env():
    dev, queue = require_opencl()
    rng = np.random.default_rng(7)
    n = 4 * 3 * 6 * 8
    b, h, qi, kj = (a.ravel() for a in np.meshgrid(np.arange(2), np.arange(3), np.arange(6), np.arange(8),
                                                   indexing="ij"))
    b, h, qi, kj = (np.tile(a, 2)[:n] for a in (b, h, qi, kj))
    sq = np.full(n, 6, np.int64)
    sk = np.full(n, 8, np.int64)
    score = rng.standard_normal(n).astype(np.float32) * 4
    env = {"score": score.astype(np.float64), "b": b, "h": h, "q_idx": qi, "kv_idx": kj, "seqlen_q": sq,
           "seqlen_k": sk}
    return queue, env, score


def _run(queue, env, score, score_mod, mask_mod):
    import pyopencl as cl
    import pyopencl.array as cla

    n = score.size
    src = expr_opencl.source(score_mod, mask_mod) + _KERNEL
    prg = cl.Program(queue.context, src).build()
    iv = np.stack([env[k] for k in ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")], 1).astype(np.int64)
    s_out, m_out = cla.empty(queue, n, np.float32), cla.empty(queue, n, np.int32)
    prg.grid(queue, (n,), None, cla.to_device(queue, score).data, cla.to_device(queue, np.ascontiguousarray(iv)).data,
             s_out.data, m_out.data)
    return s_out.get(), m_out.get()


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mod_matches_the_reference(grid_env, name):
    queue, env, score = grid_env
    got, _ = _run(queue, env, score, SCORE_MODS[name], None)
    want = np.broadcast_to(evaluate(SCORE_MODS[name], env), got.shape).astype(np.float64)
    same_special = (np.isnan(got) == np.isnan(want)) & (np.isinf(got) == np.isinf(want))
    assert same_special.all(), name
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.sign(got[np.isinf(want)]), np.sign(want[np.isinf(want)]))


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mod_matches_the_reference(grid_env, name):
    queue, env, score = grid_env
    _, got = _run(queue, env, score, None, MASK_MODS[name])
    want = np.broadcast_to(evaluate(MASK_MODS[name], env), got.shape)
    assert np.array_equal(got.astype(bool), want.astype(bool)), name


def test_float_constants_round_to_float32_and_ints_stay_64_bit():
    assert expr_opencl.lower(E.const(0.1)) == f"({float(np.float32(0.1)).hex()}f)"
    assert expr_opencl.lower(E.const(1e300)) == "INFINITY"
    assert expr_opencl.lower(E.const(2 ** 40)) == f"((long){2 ** 40}L)"
    assert expr_opencl.lower(E.const(-(2 ** 63))) == "((long)(-9223372036854775807L - 1))"
    with pytest.raises(UnsupportedError, match="64-bit"):
        expr_opencl.OpenCLEmitter().literal(2 ** 70)
    with pytest.raises(UnsupportedError, match="64-bit"):
        expr_opencl.lower(E.const(2 ** 70))
