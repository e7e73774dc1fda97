"""The cpu reference attention kernel against independent float64 references.

References: torch SDPA (math) in float64 with an explicit boolean mask built from ``np.arange``
(never from the IR expressions), ``torch.logsumexp`` of the masked scores for LSE, and a plain
numpy softmax where SDPA cannot express the variant (softcap, custom score_mod).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from portakern.backends.cpu.attention import attention_kernel
from portakern.errors import InvalidInputError
from portakern.ir import Attention, DType, KVLayout
from portakern.ir import expr as E

ATOL, RTOL = 2e-6, 2e-6           # float32 outputs of float64 math
NP_DTYPE = {DType.float16: np.float16, DType.float32: np.float32, DType.bfloat16: np.float32}


# -- helpers --------------------------------------------------------------------------------------

def make_op(B=1, Sq=8, Sk=8, Hq=2, Hkv=2, D=32, Dv=None, dtype=DType.float32, **kw) -> Attention:
    kw.setdefault("scale", 1.0 / math.sqrt(D))
    return Attention(batch=B, seqlen_q=Sq, seqlen_k=Sk, heads_q=Hq, heads_kv=Hkv, head_dim=D,
                     head_dim_v=Dv or D, dtype=dtype, return_lse=kw.pop("return_lse", True), **kw).verify()


def inputs(op: Attention, seed=0):
    """Random q, k, v of the op's shapes and storage dtype."""
    rng = np.random.default_rng(seed)
    shapes, dt = op.shapes(), NP_DTYPE[op.dtype]
    return tuple(rng.standard_normal(shapes[n]).astype(dt) for n in ("q", "k", "v"))


def run(op: Attention, q, k, v, **aux):
    """Call the kernel directly on NaN-poisoned outputs."""
    shapes = op.shapes()
    out = np.full(shapes["out"], np.nan, dtype=NP_DTYPE[op.dtype])
    lse = np.full(shapes["lse"], np.nan, dtype=np.float32) if op.return_lse else None
    attention_kernel(op)(q, k, v, out, lse, aux)
    assert not np.isnan(out).any(), "the kernel left out elements unwritten or produced NaN"
    if lse is not None:
        assert not np.isnan(lse).any(), "the kernel left lse elements unwritten or produced NaN"
    return out, lse


def causal(Sq, Sk):
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    return j <= i + Sk - Sq


def window(Sq, Sk, left, right):
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    d = i + Sk - Sq
    keep = np.ones((Sq, Sk), bool)
    if left >= 0:
        keep &= j >= d - left
    if right >= 0:
        keep &= j <= d + right
    return keep


def _t(a):
    """BSHD numpy -> BHSD float64 torch."""
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).transpose(1, 2)


def sdpa(q, k, v, scale, mask=None, bias=None):
    """torch SDPA in float64 on BSHD arrays; mask (bool) / bias broadcast to (B, Hq, Sq, Sk)."""
    attn_mask = None if mask is None else torch.from_numpy(np.asarray(mask))
    if bias is not None:
        bias = torch.from_numpy(np.asarray(bias, dtype=np.float64))
        attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, -math.inf)
    o = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=attn_mask, scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2).numpy()


def scores(q, k, scale):
    """float64 scaled scores (B, Hq, Sq, Sk) with kv heads repeated for GQA."""
    qt, kt = _t(q), _t(k)
    kt = kt.repeat_interleave(qt.shape[1] // kt.shape[1], dim=1)
    return (qt @ kt.transpose(-1, -2) * scale).numpy()


def ref_lse(s, mask=None):
    """torch.logsumexp of the masked scores (B, Hq, Sq)."""
    st = torch.from_numpy(np.array(s, dtype=np.float64))
    if mask is not None:
        st = st.masked_fill(~torch.from_numpy(np.broadcast_to(mask, st.shape).copy()), -math.inf)
    return torch.logsumexp(st, dim=-1).numpy()


def manual(s, v, mask):
    """Plain numpy softmax(s) v for already-modded scores s (B, Hq, Sq, Sk); rows without keys -> 0."""
    mask = np.broadcast_to(mask, s.shape)
    s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(mask, np.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    vt = _t(v).numpy()
    vt = np.repeat(vt, s.shape[1] // vt.shape[1], axis=1)
    o = np.divide(p @ vt, l, out=np.zeros(s.shape[:3] + (vt.shape[-1],)), where=l > 0)
    return o.transpose(0, 2, 1, 3)


def close(got, want, atol=ATOL, rtol=RTOL):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol)


# -- dense ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("Sq,Sk,D", [(1, 1, 64), (1, 33, 64), (17, 1, 64), (13, 40, 59), (9, 9, 128)])
def test_no_mask(Sq, Sk, D):
    op = make_op(B=2, Sq=Sq, Sk=Sk, Hq=3, Hkv=3, D=D)
    q, k, v = inputs(op)
    out, lse = run(op, q, k, v)
    close(out, sdpa(q, k, v, op.scale))
    close(lse, ref_lse(scores(q, k, op.scale)))


def test_causal_bottom_right_fewer_queries_than_keys():
    op = make_op(B=2, Sq=5, Sk=12, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=1)
    out, lse = run(op, q, k, v)
    mask = causal(5, 12)
    close(out, sdpa(q, k, v, op.scale, mask))
    close(lse, ref_lse(scores(q, k, op.scale), mask))


def test_causal_more_queries_than_keys_masks_whole_rows():
    Sq, Sk = 12, 5
    op = make_op(B=2, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=2)
    out, lse = run(op, q, k, v)
    mask = causal(Sq, Sk)
    rows = mask.any(axis=1)                 # rows 7.. see at least one key
    assert rows.sum() == Sk
    close(out[:, rows], sdpa(q, k, v, op.scale, mask)[:, rows])
    close(lse[:, :, rows], ref_lse(scores(q, k, op.scale), mask)[:, :, rows])
    assert (out[:, ~rows] == 0).all()
    assert np.isneginf(lse[:, :, ~rows]).all()


@pytest.mark.parametrize("left,right", [(3, 0), (2, 2), (-1, 1), (4, -1), (0, 0)])
def test_sliding_window(left, right):
    op = make_op(B=1, Sq=10, Sk=16, Hq=2, Hkv=1, mask_mod=E.window_mask(left, right))
    q, k, v = inputs(op, seed=3)
    out, lse = run(op, q, k, v)
    mask = window(10, 16, left, right)
    close(out, sdpa(q, k, v, op.scale, mask))
    close(lse, ref_lse(scores(q, k, op.scale), mask))


def test_softcap_with_causal():
    cap = 2.0
    op = make_op(B=2, Sq=7, Sk=11, score_mod=E.softcap_score(cap), mask_mod=E.causal_mask(), scale=1.0)
    q, k, v = inputs(op, seed=4)
    out, lse = run(op, q, k, v)
    s = cap * np.tanh(scores(q, k, 1.0) / cap)
    mask = causal(7, 11)
    close(out, manual(s, v, mask))
    close(lse, ref_lse(s, mask))


@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1)])
def test_gqa(Hq, Hkv):
    op = make_op(B=2, Sq=6, Sk=9, Hq=Hq, Hkv=Hkv, D=16, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=5)
    out, lse = run(op, q, k, v)
    mask = causal(6, 9)
    close(out, sdpa(q, k, v, op.scale, mask))
    close(lse, ref_lse(scores(q, k, op.scale), mask))
    # the same numbers with k/v repeated by hand: query head h reads kv head h // (Hq // Hkv)
    kr, vr = (np.repeat(a, Hq // Hkv, axis=2) for a in (k, v))
    close(out, sdpa(q, kr, vr, op.scale, mask))


def test_alibi_with_causal():
    Hq, Sq, Sk = 4, 6, 10
    op = make_op(B=1, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=2, score_mod=E.alibi_score(E.alibi_slopes(Hq)),
                 mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=6)
    out, lse = run(op, q, k, v)
    slopes = np.array([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)])
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    bias = -slopes[:, None, None] * np.abs(i + Sk - Sq - j)[None]     # (Hq, Sq, Sk)
    mask = causal(Sq, Sk)
    close(out, sdpa(q, k, v, op.scale, mask, bias[None]))
    close(lse, ref_lse(scores(q, k, op.scale) + bias, mask))


def test_custom_score_mod_and_mask_mod():
    # score_mod: halve the score and add a head-dependent relative-position term
    score_mod = E.score * 0.5 + E.where(E.h.eq(0), 1.0, -1.0) * (E.q_idx - E.kv_idx) / 8
    # mask_mod: head 1 sees only the first 3 keys; other heads see keys at distance >= 2 or key 0
    mask_mod = (E.h.eq(1) & (E.kv_idx < 3)) | (E.h.ne(1) & (((E.q_idx - E.kv_idx) >= 2) | E.kv_idx.eq(0)))
    Sq, Sk, Hq = 6, 8, 3
    op = make_op(B=2, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=1, score_mod=score_mod, mask_mod=mask_mod)
    q, k, v = inputs(op, seed=7)
    out, lse = run(op, q, k, v)
    i, j = np.arange(Sq)[None, :, None], np.arange(Sk)[None, None, :]
    sign = np.array([1.0, -1.0, -1.0])[:, None, None]
    s = scores(q, k, op.scale) * 0.5 + sign * (i - j) / 8
    hh = np.arange(Hq)[:, None, None]
    mask = ((hh == 1) & (j < 3)) | ((hh != 1) & (((i - j) >= 2) | (j == 0)))
    close(out, manual(s, v, mask))
    close(lse, ref_lse(s, mask))


def test_mask_that_hides_everything():
    op = make_op(B=1, Sq=3, Sk=4, mask_mod=E.kv_idx < 0)
    q, k, v = inputs(op)
    out, lse = run(op, q, k, v)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_value_head_dim_differs():
    op = make_op(B=2, Sq=5, Sk=7, Hq=4, Hkv=2, D=24, Dv=40, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=8)
    out, lse = run(op, q, k, v)
    assert out.shape == (2, 5, 4, 40)
    close(out, sdpa(q, k, v, op.scale, causal(5, 7)))


def test_float16_storage():
    op = make_op(B=1, Sq=9, Sk=9, D=64, dtype=DType.float16, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=9)
    out, _ = run(op, q, k, v)
    assert out.dtype == np.float16
    close(out, sdpa(q, k, v, op.scale, causal(9, 9)), atol=1e-3, rtol=1e-3)


def test_query_chunking_matches_one_block(monkeypatch):
    import portakern.backends.cpu.tuning as tuning

    op = make_op(B=1, Sq=37, Sk=29, Hq=4, Hkv=2, mask_mod=E.window_mask(5, 2))
    q, k, v = inputs(op, seed=10)
    whole, whole_lse = run(op, q, k, v)
    monkeypatch.setattr(tuning, "SCORE_BLOCK_ELEMENTS", 2 * 29 * 3)    # 3 query rows per block
    chunked, chunked_lse = run(op, q, k, v)
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(chunked_lse, whole_lse)


# -- per-batch lengths, paged, varlen -------------------------------------------------------------

def test_dense_with_seqlens_k():
    B, Sq, Sk = 3, 4, 10
    lengths = np.array([10, 6, 0], dtype=np.int32)
    op = make_op(B=B, Sq=Sq, Sk=Sk, Hq=4, Hkv=2, has_seqlens_k=True, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=11)
    for b, L in enumerate(lengths):         # keys past the length are never read
        k[b, L:], v[b, L:] = np.nan, np.nan
    out, lse = run(op, q, k, v, seqlens_k=lengths)
    for b, L in enumerate(lengths[:2]):
        mask = causal(Sq, L)   # aligned to the actual key length
        sl = slice(b, b + 1)
        close(out[sl], sdpa(q[sl], k[sl, :L], v[sl, :L], op.scale, mask))
        close(lse[sl], ref_lse(scores(q[sl], k[sl, :L], op.scale), mask))
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()


def test_paged_with_shuffled_block_table():
    B, Sq, page, max_pages, Hkv, D = 3, 5, 4, 4, 2, 16
    lengths = np.array([13, 16, 3])
    op = make_op(B=B, Sq=Sq, Sk=page * max_pages, Hq=4, Hkv=Hkv, D=D, kv_layout=KVLayout.PAGED,
                 page_size=page, num_pages=14, has_seqlens_k=True, mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=12)
    table = np.random.default_rng(13).permutation(14)[: B * max_pages].reshape(B, max_pages)
    table[2, 1:] = -1                       # unused entries past the length are never read
    unused = np.ones(14, bool)
    unused[table[table >= 0]] = False
    k[unused], v[unused] = np.nan, np.nan   # nor are pages outside the table ...
    k[table[0, 3], 1:], v[table[0, 3], 1:] = np.nan, np.nan   # ... or slots past seqlens_k
    out, lse = run(op, q, k, v, block_table=table.astype(np.int32), seqlens_k=lengths)
    for b, L in enumerate(lengths):
        pages = table[b, : -(-L // page)]
        kb = k[pages].reshape(-1, Hkv, D)[None, :L]
        vb = v[pages].reshape(-1, Hkv, D)[None, :L]
        mask = causal(Sq, L)
        rows = mask.any(axis=1)
        close(out[b][rows], sdpa(q[b:b + 1], kb, vb, op.scale, mask)[0][rows])
        close(lse[b][:, rows], ref_lse(scores(q[b:b + 1], kb, op.scale), mask)[0][:, rows])
        assert (out[b][~rows] == 0).all() and np.isneginf(lse[b][:, ~rows]).all()


def test_varlen_per_sequence():
    q_lens, k_lens = [3, 1, 6], [5, 4, 6]
    cu_q, cu_k = np.cumsum([0] + q_lens), np.cumsum([0] + k_lens)
    total_q = cu_q[-1] + 2                  # two padding rows after the last sequence
    op = make_op(B=3, Sq=max(q_lens), Sk=max(k_lens), Hq=4, Hkv=2, D=16, kv_layout=KVLayout.VARLEN,
                 total_q=int(total_q), total_k=int(cu_k[-1]), mask_mod=E.causal_mask())
    q, k, v = inputs(op, seed=14)
    out, lse = run(op, q, k, v, cu_seqlens_q=cu_q.astype(np.int32), cu_seqlens_k=cu_k.astype(np.int32))
    assert lse.shape == (4, total_q)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        mask = causal(q_lens[b], k_lens[b])
        close(out[qs], sdpa(q[None, qs], k[None, ks], v[None, ks], op.scale, mask)[0])
        close(lse[:, qs], ref_lse(scores(q[None, qs], k[None, ks], op.scale), mask)[0])
    assert (out[cu_q[-1]:] == 0).all() and np.isneginf(lse[:, cu_q[-1]:]).all()


def test_varlen_lengths_are_the_expression_variables():
    # a mask on seqlen_q / seqlen_k sees each sequence's own lengths
    q_lens, k_lens = [2, 4], [3, 7]
    cu_q, cu_k = np.cumsum([0] + q_lens), np.cumsum([0] + k_lens)
    op = make_op(B=2, Sq=4, Sk=7, kv_layout=KVLayout.VARLEN, total_q=6, total_k=10,
                 mask_mod=(E.kv_idx >= E.seqlen_k - 2) & (E.q_idx < E.seqlen_q - 1))
    q, k, v = inputs(op, seed=15)
    out, lse = run(op, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for b in range(2):
        Lq, Lk = q_lens[b], k_lens[b]
        i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
        mask = (j >= Lk - 2) & (i < Lq - 1)
        s = scores(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]], op.scale)
        close(out[cu_q[b]:cu_q[b + 1]], manual(s, v[None, cu_k[b]:cu_k[b + 1]], mask)[0])


# -- bad input ------------------------------------------------------------------------------------

def test_wrong_shape_names_the_operand():
    op = make_op()
    q, k, v = inputs(op)
    with pytest.raises(InvalidInputError, match="k has shape"):  # head_dim: the key length is the call's own
        run(op, q, k[..., :16], v)


def test_missing_seqlens_k():
    op = make_op(has_seqlens_k=True)
    with pytest.raises(InvalidInputError, match="seqlens_k"):
        run(op, *inputs(op))


def test_block_table_entry_outside_the_pool():
    op = make_op(B=1, Sq=2, Sk=8, kv_layout=KVLayout.PAGED, page_size=4, num_pages=3, has_seqlens_k=True)
    with pytest.raises(InvalidInputError, match=r"block_table\[0, 1\]=7"):
        run(op, *inputs(op), block_table=np.array([[0, 7]]), seqlens_k=np.array([8]))


def test_seqlens_k_longer_than_capacity():
    op = make_op(B=1, Sq=2, Sk=8, has_seqlens_k=True)
    with pytest.raises(InvalidInputError, match=r"seqlens_k\[0\]=9"):
        run(op, *inputs(op), seqlens_k=np.array([9]))


def test_missing_lse_when_the_op_returns_it():
    op = make_op(return_lse=True)
    q, k, v = inputs(op)
    out = np.zeros(op.shapes()["out"], np.float32)
    with pytest.raises(InvalidInputError, match=r"lse is None but the op has return_lse=True: pass a float32 "
                                                r"array of shape \(1, 2, 8\)"):
        attention_kernel(op)(q, k, v, out, None, {})


@pytest.mark.parametrize("seqlens_k, fragment", [
    (np.array([3.0]), r"aux\['seqlens_k'\] has dtype float64: it must hold integers; convert it"),
    (np.array([3, 3]), r"aux\['seqlens_k'\] has shape \(2,\), expected \(1,\): index arrays are sized"),
], ids=["float-dtype", "wrong-shape"])
def test_index_array_dtype_and_shape(seqlens_k, fragment):
    op = make_op(B=1, has_seqlens_k=True)
    with pytest.raises(InvalidInputError, match=fragment):
        run(op, *inputs(op), seqlens_k=seqlens_k)


def test_index_array_of_another_layout_is_rejected():
    op = make_op(B=1)
    with pytest.raises(InvalidInputError, match=r"aux\['block_table'\] was given but this attention op does not "
                                                r"read it: pass it only with the KV layout that uses it"):
        run(op, *inputs(op), block_table=np.zeros((1, 1), np.int32))


def _varlen_op():
    return make_op(B=2, Sq=4, Sk=5, kv_layout=KVLayout.VARLEN, total_q=6, total_k=8)


@pytest.mark.parametrize("cu_q, fragment", [
    ([1, 3, 6], r"cu_seqlens_q\[0\]=1 must be 0: cumulative lengths start at 0"),
    ([0, 4, 3], r"cu_seqlens_q decreases at index 2: cumulative lengths never decrease"),
    ([0, 3, 7], r"cu_seqlens_q\[-1\]=7 exceeds the 6 packed rows: the last cumulative length"),
    ([0, 5, 6], r"cu_seqlens_q: sequence 0 has length 5, more than the op's maximum 4 \(seqlen_q\)"),
], ids=["nonzero-start", "decreasing", "past-the-end", "longer-than-seqlen_q"])
def test_bad_cumulative_lengths(cu_q, fragment):
    op = _varlen_op()
    with pytest.raises(InvalidInputError, match=fragment):
        run(op, *inputs(op), cu_seqlens_q=np.array(cu_q), cu_seqlens_k=np.array([0, 3, 8]))
