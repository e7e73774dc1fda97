"""NaN and infinities in attention and quantized GEMV: docs/ir.md "Non-finite values".

References: a float64 numpy formula written here with an explicit boolean mask (masked keys removed, the rest IEEE
arithmetic; a row whose visible scores are all -inf counts as one with no visible key), and torch's SDPA math
backend in float64 with the same mask. The cpu reference must agree with both on where NaN and infinities land and
on every finite value; the other backends are held to the same through the ``nf-*`` conformance cases (cpu and
OpenCL here, triton under the interpreter in the ``interpreter`` tier).
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.conformance import tolerance as T

NAN, INF = np.nan, np.inf


# -- references -----------------------------------------------------------------------------------

def ref_attention(q, k, v, visible, scale=None, softcap=0.0):
    """float64 attention on BSHD arrays; ``visible`` (B, Hq, Sq, Sk) bool. Returns ``(out, lse)``."""
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros((B, Sq, Hq, Dv))
    lse = np.full((B, Hq, Sq), -INF)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(B):
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                for i in range(Sq):
                    keys = np.flatnonzero(visible[b, h, i])
                    s = scale * (k[b, keys, kv].astype(np.float64) @ q[b, i, h].astype(np.float64))
                    if softcap:
                        s = softcap * np.tanh(s / softcap)
                    if keys.size == 0 or (s == -INF).all():
                        continue
                    m = s.max()                                  # NaN when any score is NaN
                    e = np.exp(s - m)
                    out[b, i, h] = e @ v[b, keys, kv].astype(np.float64) / e.sum()
                    lse[b, h, i] = m + np.log(e.sum())
    return out, lse


def sdpa(q, k, v, visible):
    """torch SDPA (math backend) in float64 with the boolean mask; ``out`` as BSHD numpy."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).transpose(1, 2) for a in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.from_numpy(visible),
                                                             enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2).numpy()


def causal_visible(B, Hq, Sq, Sk):
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    return np.broadcast_to(j <= i + Sk - Sq, (B, Hq, Sq, Sk)).copy()


def same(a, b, atol=1e-5):
    """NaN exactly where ``b`` is NaN, the same infinity where ``b`` is infinite, close elsewhere."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(a[np.isinf(b)], b[np.isinf(b)])
    fin = np.isfinite(b)
    assert np.isfinite(a[fin]).all()
    np.testing.assert_allclose(a[fin], b[fin], atol=atol, rtol=0)


def inputs(B=2, Sq=9, Sk=12, Hq=4, Hkv=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.uniform(-1, 1, shape).astype(np.float32)
                 for shape in ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)))


# -- the cpu reference ------------------------------------------------------------------------------

def test_the_issues_example_is_nan_not_zeros():
    q = np.ones((1, 2, 1, 4), np.float32)
    q[0, 0, 0, 0] = NAN
    out, lse = pk.attention(q, q, q, return_lse=True, backend="cpu")
    # q is also k and v: key 0 is NaN and both rows see it, so both rows are NaN (torch SDPA says the same)
    assert np.isnan(out).all() and np.isnan(lse).all()
    assert np.isnan(sdpa(q, q, q, np.ones((1, 1, 2, 2), bool))).all()


def test_nan_in_q_poisons_only_its_row():
    q, k, v = inputs()
    q[1, 4, 3, 7] = NAN
    out, lse = pk.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    vis = causal_visible(2, 4, 9, 12)
    want, want_lse = ref_attention(q, k, v, vis)
    same(out, want)
    same(lse, want_lse)
    same(out, sdpa(q, k, v, vis))
    bad = np.argwhere(np.isnan(out).any(axis=-1))
    assert bad.tolist() == [[1, 4, 3]] and np.isnan(out[1, 4, 3]).all()


def test_nan_in_k_reaches_the_rows_that_see_the_key_only():
    q, k, v = inputs(B=1, Sq=12, Sk=12)
    k[0, 5, 1, 0] = NAN                                   # kv head 1: query heads 2 and 3
    out, lse = pk.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    vis = causal_visible(1, 4, 12, 12)
    same(out, ref_attention(q, k, v, vis)[0])
    # torch's SDPA math adds the mask as a -inf bias, and NaN + -inf is NaN: there the hidden key leaks into
    # rows 0..4; portakern replaces a hidden key's score (as the flash kernels do), so those rows stay finite
    assert np.isnan(sdpa(q, k, v, vis)[0, :5, 2:]).all()
    rows_nan = np.isnan(lse[0])                           # (Hq, Sq)
    assert not rows_nan[:2].any() and rows_nan[2:, 5:].all() and not rows_nan[2:, :5].any()


@pytest.mark.parametrize("value", [INF, -INF])
def test_infinite_k_gives_nan_rows_for_plus_inf_scores_and_zero_weight_for_minus_inf(value):
    q, k, v = inputs(B=1, Sq=8, Sk=10, Hq=2, Hkv=1)
    k[0, 3, 0, 2] = value
    out, lse = pk.attention(q, k, v, return_lse=True, backend="cpu")
    vis = np.ones((1, 2, 8, 10), bool)
    want, want_lse = ref_attention(q, k, v, vis)
    same(out, want)
    same(lse, want_lse)
    same(out, sdpa(q, k, v, vis))
    plus = np.sign(q[0, :, :, 2]).T * np.sign(value) > 0    # (Hq, Sq): score +inf
    assert np.isnan(lse[0][plus]).all() and np.isfinite(lse[0][~plus]).all()
    assert plus.any() and (~plus).any()
    # a -inf score weighs 0: those rows equal attention without key 3
    keep = np.ones(10, bool)
    keep[3] = False
    rest = pk.attention(q, k[:, keep], v[:, keep], backend="cpu")
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3)[0][~plus], rest.transpose(0, 2, 1, 3)[0][~plus], atol=1e-6)


def test_a_row_whose_visible_scores_are_all_minus_inf_has_no_visible_key():
    q, k, v = inputs(B=1, Sq=2, Sk=1, Hq=1, Hkv=1)
    q[0, :, 0, 0] = (1.0, -1.0)
    k[0, 0, 0, 0] = -INF                                   # row 0: score -inf; row 1: +inf
    out, lse = pk.attention(q, k, v, return_lse=True, backend="cpu")
    assert (out[0, 0] == 0).all() and lse[0, 0, 0] == -INF
    assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, 0, 1])
    same(out, sdpa(q, k, v, np.ones((1, 1, 2, 1), bool)))   # torch's SDPA math: the same choice


def test_softcap_maps_infinite_scores_to_finite():
    q, k, v = inputs(B=1, Sq=6, Sk=10, Hq=2, Hkv=2)
    k[0, 4, 1, 0] = INF
    out, lse = pk.attention(q, k, v, softcap=3.0, return_lse=True, backend="cpu")
    want, want_lse = ref_attention(q, k, v, np.ones((1, 2, 6, 10), bool), softcap=3.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    same(out, want)
    same(lse, want_lse)


def test_infinite_v_of_a_visible_key_lands_in_its_column():
    q, k, v = inputs(B=1, Sq=5, Sk=7, Hq=2, Hkv=1)
    v[0, 0, 0, 1] = INF                                    # every causal row sees key 0
    v[0, 1, 0, 2], v[0, 2, 0, 2] = INF, -INF               # inf - inf in column 2 of rows seeing both
    out, lse = pk.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    vis = causal_visible(1, 2, 5, 7)
    same(out, ref_attention(q, k, v, vis)[0])
    same(out, sdpa(q, k, v, vis))
    assert (out[0, :, :, 1] == INF).all() and np.isnan(out[0, :, :, 2]).all() and np.isfinite(lse).all()


def test_fully_masked_rows_stay_zero_even_with_nan_q():
    q, k, v = inputs(B=1, Sq=9, Sk=4, Hq=2, Hkv=2)        # causal with Sq > Sk: rows 0..4 see nothing
    q[0, :, 0, 0] = NAN
    out, lse = pk.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    assert (out[0, :5] == 0).all() and (lse[0, :, :5] == -INF).all()
    assert np.isnan(out[0, 5:, 0]).all() and np.isfinite(out[0, 5:, 1]).all()
    same(out, ref_attention(q, k, v, causal_visible(1, 2, 9, 4))[0])


def test_keys_past_a_sequence_length_are_never_read():
    q, k, v = inputs(B=2, Sq=3, Sk=16)
    lens = np.array([16, 5], np.int32)
    clean = pk.attention(q, k, v, seqlens_k=lens, return_lse=True, backend="cpu")
    k[1, 5:], v[1, 5:] = NAN, INF
    dirty = pk.attention(q, k, v, seqlens_k=lens, return_lse=True, backend="cpu")
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(a, b)


def test_paged_pages_no_sequence_owns_are_never_read():
    rng = np.random.default_rng(3)
    kp = rng.uniform(-1, 1, (6, 4, 2, 16)).astype(np.float32)
    vp = rng.uniform(-1, 1, (6, 4, 2, 16)).astype(np.float32)
    q = rng.uniform(-1, 1, (2, 1, 4, 16)).astype(np.float32)
    table = np.array([[4, 1, 0], [2, 0, 0]], np.int32)
    lens = np.array([6, 3], np.int32)                      # reads pages 4, 1[:2], 2[:3]
    clean = pk.attention(q, kp, vp, block_table=table, seqlens_k=lens, return_lse=True, backend="cpu")
    for a in (kp, vp):
        a[[0, 3, 5]] = NAN
        a[1, 2:] = NAN
        a[2, 3:] = NAN
    dirty = pk.attention(q, kp, vp, block_table=table, seqlens_k=lens, return_lse=True, backend="cpu")
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(a, b)


# -- quantized GEMV ---------------------------------------------------------------------------------

def _weight(N=24, K=256, seed=1):
    w = np.random.default_rng(seed).normal(size=(N, K)).astype(np.float32)
    return pk.quantize(w, bits=4, group_size=64, symmetric=False, scale_dtype="float32")


def _dequant(qw):
    from portakern.ir.packing import dequantize

    return np.asarray(dequantize(qw.fmt, qw.tensors, qw.N, qw.K), np.float64)


def test_gemv_nan_in_x_poisons_that_row():
    qw = _weight()
    x = np.random.default_rng(2).normal(size=(3, 256)).astype(np.float32)
    x[1, 100] = NAN
    out = pk.quant_gemv(x, qw, backend="cpu")
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()
    with np.errstate(invalid="ignore"):
        same(out, x.astype(np.float64) @ _dequant(qw).T, atol=1e-4)


def test_gemv_nan_scale_poisons_that_output_column():
    from portakern.quantized import QuantizedWeight

    qw = _weight()
    tensors = {name: np.array(t) for name, t in qw.tensors.items()}
    tensors["scales"][7, 2] = NAN                        # row n = 7, group 2
    bad = QuantizedWeight(qw.fmt, qw.N, qw.K, tensors)
    x = np.random.default_rng(2).normal(size=(4, 256)).astype(np.float32)
    out = pk.quant_gemv(x, bad, backend="cpu")
    assert np.isnan(out[:, 7]).all() and np.isfinite(np.delete(out, 7, axis=1)).all()


# -- the comparison and the goldens -----------------------------------------------------------------

@pytest.mark.parametrize("out,gold,ok", [
    ([NAN, 1.0], [NAN, 1.0], True),
    ([0.0, 1.0], [NAN, 1.0], False),                    # a zero where the gold is NaN: the bug of issue 40
    ([NAN, 1.0], [0.0, 1.0], False),
    ([-INF, 1.0], [-INF, 1.0], True),
    ([NAN, 1.0], [-INF, 1.0], False),
    ([INF, 1.0], [-INF, 1.0], False),
    ([INF, 1.0], [NAN, 1.0], False),
])
def test_compare_requires_nan_and_infinities_exactly(out, gold, ok):
    v = T.compare(np.array(out), np.array(gold), tol=1e-3)
    assert v.ok is ok
    if not ok:
        assert "but the gold is" in v.reason


def test_stored_goldens_hold_nan_rows_in_one_canonical_nan():
    from portakern.conformance.cases import by_id
    from portakern.conformance.goldens import Store

    store = Store()
    g = store.get("nf-qnan-attn-d64-sq33-sk80-h4g2-b2-causal-fp16-lse")
    nan = np.isnan(g.out)
    assert nan.sum() == 64 and np.isnan(g.out[1, 7, 2]).all()        # one row of one head
    assert (g.out[nan].view(np.uint32) == 0x7FC00000).all()
    assert np.isnan(g.lse[1, 2, 7]) and np.isnan(g.lse).sum() == 1
    assert by_id("nf-qnan-attn-d64-sq33-sk80-h4g2-b2-causal-fp16-lse", "cpu").inputs()["q"][1, 7, 2, 5] != 0


# -- every backend on the nf-* cases ----------------------------------------------------------------

def _run_nf(backend, device, cases="nf-*"):
    from portakern.conformance.runner import run

    rep, status = run(backends=[backend], device=device, cases_glob=cases, progress=False, out=None)
    results = rep["results"]
    failing = [(r["case"], r["status"], r.get("reason")) for r in results if r["status"] not in ("pass", "unsupported")]
    assert not failing and status == 0, failing
    return results


def test_nf_cases_pass_on_the_cpu_reference():
    results = _run_nf("cpu", "cpu")
    assert len(results) == 26 and all(r["status"] == "pass" for r in results)


def test_nf_cases_pass_on_opencl():
    from opencl_helpers import require_opencl

    dev, _ = require_opencl()
    results = _run_nf("opencl", str(dev))
    assert sum(r["status"] == "pass" for r in results) >= 15


@pytest.mark.interpreter
def test_nf_cases_pass_on_triton_under_the_interpreter():
    """The kernels' epilogue (a NaN row sum is no empty row) and the split-KV merge of a decode over 4096 keys;
    CI's interpreter conformance step runs every nf-* case."""
    pytest.importorskip("triton")
    results = _run_nf("triton", "cpu", "nf-*-attn-d64-sq1-sk4096-*,nf-qnan-attn-d64-sq33-*")
    assert len(results) == 3 and all(r["status"] == "pass" for r in results)
