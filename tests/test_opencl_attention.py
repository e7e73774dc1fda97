"""The opencl backend's attention on the OpenCL device (PoCL in CI) against float64 references written in
``opencl_helpers`` (not the cpu backend): layouts, masks, GQA, head dims, LSE, empty rows, poisoned outputs,
array kinds."""

from __future__ import annotations

import math

import numpy as np
import pytest

import portakern
from portakern.ir import expr as E

from opencl_helpers import ref_attention, require_opencl, to_cl, tol


@pytest.fixture(scope="module")
def cl_dev():
    return require_opencl()


def _inputs(rng, B, Sq, Sk, Hq, Hkv, D, Dv, dtype):
    q = rng.standard_normal((B, Sq, Hq, D)).astype(dtype)
    k = rng.standard_normal((B, Sk, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, Sk, Hkv, Dv)).astype(dtype)
    return q, k, v


def _causal(b, h, i, j, sq, sk):
    return j <= i + sk - sq


MASKS = {
    "none": (dict(), None, None),
    "causal": (dict(causal=True), _causal, None),
    "window": (dict(window=(5, 2)), lambda b, h, i, j, sq, sk: i + sk - sq - 5 <= j <= i + sk - sq + 2, None),
    "softcap": (dict(softcap=2.5), None, lambda s, *a: 2.5 * math.tanh(s / 2.5)),
    "alibi": (dict(score_mod=E.alibi_score([0.5, 0.25, 0.125, 0.0625])),
              None, lambda s, b, h, i, j, sq, sk: s - [0.5, 0.25, 0.125, 0.0625][h] * abs(i + sk - sq - j)),
    "custom": (dict(mask_mod=((E.var("kv_idx") - E.var("q_idx")) * 2 > -7) | E.var("b").eq(1),
                    score_mod=E.where(E.var("h") > 1, E.var("score") * 0.5, E.var("score") + E.var("kv_idx") / 16)),
               lambda b, h, i, j, sq, sk: ((j - i) * 2 > -7) or b == 1,
               lambda s, b, h, i, j, sq, sk: s * 0.5 if h > 1 else s + j / 16),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(2, 5, 37, 4, 2, 59, 59), (1, 1, 70, 4, 1, 111, 64), (1, 21, 9, 4, 4, 32, 96)],
                         ids=["gqa2-d59", "mqa-decode-d111", "mha-more-q-than-k"])
@pytest.mark.parametrize("variant", list(MASKS))
def test_dense_against_float64(cl_dev, rng, dtype, shape, variant):
    _, queue = cl_dev
    B, Sq, Sk, Hq, Hkv, D, Dv = shape
    q, k, v = _inputs(rng, B, Sq, Sk, Hq, Hkv, D, Dv, dtype)
    kw, mask, score = MASKS[variant]
    out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), return_lse=True, **kw)
    assert type(out).__module__.startswith("pyopencl") and out.dtype == dtype and lse.dtype == np.float32
    ref, ref_lse = ref_attention(q, k, v, mask=mask, score=score)
    o, l = out.get().astype(np.float64), lse.get()
    assert np.array_equal(np.isinf(l), np.isinf(ref_lse))
    np.testing.assert_allclose(o, ref, atol=tol(dtype), rtol=tol(dtype))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(l[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)


def test_scale_and_head_dim_v(cl_dev, rng):
    _, queue = cl_dev
    q, k, v = _inputs(rng, 2, 19, 67, 4, 2, 192, 128, np.float32)
    out = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), scale=-0.3, causal=True)
    ref, _ = ref_attention(q, k, v, scale=-0.3, mask=_causal)
    np.testing.assert_allclose(out.get(), ref, atol=2e-5, rtol=2e-5)


def test_fully_masked_rows_are_zero_with_minus_inf_lse(cl_dev, rng):
    """Causal with Sq > Sk: the first Sq - Sk rows see nothing; a score_mod of -inf hides every key too."""
    _, queue = cl_dev
    q, k, v = _inputs(rng, 1, 12, 5, 2, 2, 16, 16, np.float32)
    out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), causal=True, return_lse=True)
    o, l = out.get(), lse.get()
    assert np.all(o[:, :7] == 0) and np.all(np.isneginf(l[:, :, :7]))
    assert np.all(np.isfinite(l[:, :, 7:])) and np.abs(o[:, 7:]).max() > 0
    hide = E.where(E.var("h").eq(1), E.const(-math.inf), E.var("score"))
    out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), score_mod=hide, return_lse=True)
    o, l = out.get(), lse.get()
    assert np.all(o[:, :, 1] == 0) and np.all(np.isneginf(l[:, 1])) and not np.isnan(o).any()


def test_dense_seqlens_k_including_empty(cl_dev, rng):
    _, queue = cl_dev
    q, k, v = _inputs(rng, 3, 7, 40, 4, 4, 64, 64, np.float16)
    lens = np.array([40, 0, 23], np.int32)
    out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), seqlens_k=to_cl(queue, lens),
                                   causal=True, return_lse=True)
    ref, ref_lse = ref_attention(q, k, v, mask=_causal, lens_k=lens)
    np.testing.assert_allclose(out.get().astype(np.float64), ref, atol=2e-3)
    assert np.all(np.isneginf(lse.get()[1])) and np.all(out.get()[1] == 0)


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_with_shuffled_block_table(cl_dev, rng, page_size):
    _, queue = cl_dev
    B, Sq, Hq, Hkv, D = 3, 4, 4, 2, 48
    lens = np.array([1, 37, 0], np.int32)
    max_pages = -(-40 // page_size)
    P = B * max_pages + 2
    kp = rng.standard_normal((P, page_size, Hkv, D)).astype(np.float32)
    vp = rng.standard_normal((P, page_size, Hkv, D)).astype(np.float32)
    table = rng.permutation(P)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    q = rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)
    out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, kp), to_cl(queue, vp), block_table=to_cl(queue, table),
                                   seqlens_k=to_cl(queue, lens), causal=True, return_lse=True)
    # gather the pages into dense K/V here, then the dense float64 reference
    kd = np.stack([kp[table[b]].reshape(-1, Hkv, D) for b in range(B)])
    vd = np.stack([vp[table[b]].reshape(-1, Hkv, D) for b in range(B)])
    ref, ref_lse = ref_attention(q, kd, vd, mask=_causal, lens_k=lens)
    np.testing.assert_allclose(out.get(), ref, atol=2e-5)
    assert np.array_equal(np.isinf(lse.get()), np.isinf(ref_lse))


def test_varlen_with_empty_sequences(cl_dev, rng):
    _, queue = cl_dev
    q_lens, k_lens = [3, 0, 5, 2], [4, 6, 0, 9]
    Hq, Hkv, D = 4, 2, 40
    cu_q, cu_k = np.cumsum([0] + q_lens).astype(np.int32), np.cumsum([0] + k_lens).astype(np.int64)
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], Hkv, D)).astype(np.float16)
    out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), cu_seqlens_q=to_cl(queue, cu_q),
                                   cu_seqlens_k=to_cl(queue, cu_k), causal=True, return_lse=True)
    o, l = out.get().astype(np.float64), lse.get()
    for b in range(4):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        ref, ref_lse = ref_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], mask=_causal)
        np.testing.assert_allclose(o[qs:qe], ref[0], atol=2e-3)
        assert np.array_equal(np.isinf(l[:, qs:qe]), np.isinf(ref_lse[0]))


def test_kernel_overwrites_poisoned_outputs_including_varlen_padding(cl_dev, rng):
    """Called below the API: out / lse start as NaN; rows past cu_seqlens_q[-1] must become 0 / -inf."""
    import pyopencl.array as cla

    from portakern.ir.ops import Attention, KVLayout
    dev, queue = cl_dev
    be = portakern.api.registry().get("opencl")
    op = Attention(batch=2, seqlen_q=10, seqlen_k=12, heads_q=2, heads_kv=1, head_dim=8, head_dim_v=8,
                   dtype="float32", scale=0.3, kv_layout=KVLayout.VARLEN, total_q=10, total_k=12, return_lse=True)
    kernel = be.compile(op, dev)
    q = to_cl(queue, rng.standard_normal((10, 2, 8)).astype(np.float32))
    k = to_cl(queue, rng.standard_normal((12, 1, 8)).astype(np.float32))
    v = to_cl(queue, rng.standard_normal((12, 1, 8)).astype(np.float32))
    out, lse = cla.empty(queue, (10, 2, 8), np.float32), cla.empty(queue, (2, 10), np.float32)
    out.fill(np.float32(np.nan))
    lse.fill(np.float32(np.nan))
    aux = {"cu_seqlens_q": to_cl(queue, np.array([0, 3, 7], np.int32)),
           "cu_seqlens_k": to_cl(queue, np.array([0, 5, 12], np.int32))}
    kernel(q, k, v, out, lse, aux)
    o, l = out.get(), lse.get()
    assert not np.isnan(o).any() and not np.isnan(l).any()
    assert np.all(o[7:] == 0) and np.all(np.isneginf(l[:, 7:])) and np.all(np.isfinite(l[:, :7]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_poisoned_dense_outputs_are_fully_written(cl_dev, rng, dtype):
    from portakern.dispatch import poison_outputs
    _, queue = cl_dev
    q, k, v = _inputs(rng, 2, 33, 70, 8, 2, 64, 40, dtype)
    with poison_outputs():
        out, lse = portakern.attention(to_cl(queue, q), to_cl(queue, k), to_cl(queue, v), window=(7, 0),
                                       return_lse=True, backend="opencl")
    assert not np.isnan(out.get()).any() and not np.isnan(lse.get()).any()


def test_array_kinds_round_trip(cl_dev, rng):
    """pyopencl in -> pyopencl out on its queue; numpy in with backend='opencl' -> numpy out; torch bf16 in ->
    torch bf16 out (carried as float32); numpy without backend= stays on the cpu reference."""
    import torch

    _, queue = cl_dev
    q, k, v = _inputs(rng, 1, 6, 11, 2, 1, 16, 16, np.float32)
    ref, _ = ref_attention(q, k, v)
    qc = to_cl(queue, q)
    out = portakern.attention(qc, to_cl(queue, k), to_cl(queue, v))
    assert type(out).__name__ == "Array" and out.queue.context == qc.context
    out_np = portakern.attention(q, k, v, backend="opencl")
    assert type(out_np) is np.ndarray and out_np.dtype == np.float32
    np.testing.assert_allclose(out_np, ref, atol=2e-5)
    np.testing.assert_array_equal(out_np, out.get())
    tq, tk, tv = (torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v))
    out_t = portakern.attention(tq, tk, tv, backend="opencl")
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.bfloat16
    ref_bf, _ = ref_attention(tq.float().numpy(), tk.float().numpy(), tv.float().numpy())
    np.testing.assert_allclose(out_t.float().numpy(), ref_bf, atol=1e-2)
    assert portakern.explain(portakern.attention, q, k, v).chosen == "cpu"
    assert portakern.explain(portakern.attention, qc, to_cl(queue, k), to_cl(queue, v)).chosen == "opencl"
