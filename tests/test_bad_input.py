"""Bad input: every public entry point rejects it before launching anything, with an error that is a portakern
error *and* the builtin a caller expects (ValueError / TypeError), of the specific portakern type, and a message
naming the argument, the value, the rule and the way out. Covers array types, dtypes, devices, shapes and head
layouts, options (their types and ranges: float32 must hold scale and softcap, window sides at most 2**30),
paged and varlen index arrays (0-d, negative, out of range), degenerate and empty dimensions, sparse and masked
arrays, the quantized GEMV and quantization formats, explain's arguments, and the forced backend."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import portakern
from error_helpers import rejects
from portakern.devices import parse_device
from portakern.errors import InvalidInputError, InvalidTypeError, PortakernError, UnsupportedError
from portakern.ir import Packing, QuantFormat
from portakern.ir import expr as E

F32 = np.float32


def arr(*shape, dtype=F32):
    return np.zeros(shape, dtype=dtype)


def qkv(B=2, Sq=3, Sk=8, Hq=4, Hkv=2, D=16, Dv=None, dtype=F32):
    return arr(B, Sq, Hq, D, dtype=dtype), arr(B, Sk, Hkv, D, dtype=dtype), arr(B, Sk, Hkv, Dv or D, dtype=dtype)


def paged(block_table, seqlens, pages=4, page=4, B=2, table_dtype=np.int32):
    """Paged attention with a pool of ``pages`` pages of ``page`` keys."""
    q = arr(B, 1, 4, 16)
    k = v = arr(pages, page, 2, 16)
    return lambda: portakern.attention(q, k, v, block_table=np.asarray(block_table, table_dtype),
                                       seqlens_k=np.asarray(seqlens, np.int32))


def varlen(cu_q, cu_k, total_q=5, total_k=9, **kw):
    q, k, v = arr(total_q, 4, 16), arr(total_k, 2, 16), arr(total_k, 2, 16)
    return lambda: portakern.attention(q, k, v, cu_seqlens_q=None if cu_q is None else np.asarray(cu_q, np.int32),
                                       cu_seqlens_k=None if cu_k is None else np.asarray(cu_k, np.int32), **kw)


def att(**kw) -> Callable[[], Any]:
    q, k, v = qkv()
    return lambda: portakern.attention(q, k, v, **kw)


def att_with(q=None, k=None, v=None, **kw) -> Callable[[], Any]:
    dq, dk, dv = qkv()
    return lambda: portakern.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kw)


def weight(N=16, K=64, bits=4, group_size=32):
    return portakern.quantize(np.random.default_rng(0).standard_normal((N, K)).astype(F32), bits=bits,
                              group_size=group_size)


def gemv(x, w=None) -> Callable[[], Any]:
    return lambda: portakern.quant_gemv(x, weight() if w is None else w)


def rand(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def att_of(q, k, v, **kw) -> Callable[[], Any]:
    return lambda: portakern.attention(q, k, v, **kw)



Q = rand(1, 4, 2, 16)
TQ = torch.from_numpy(Q)
VARLEN = (Q[0], Q[0], Q[0])
Q8 = rand(1, 4, 2, 8)
T = torch.zeros


# -- the tables: each case's error type and message -----------------------------------------------------------------

CASES = [
    # -- array types, dtypes, devices ---------------------------------------------------------------
    ("q_is_a_list", att_with(q=[[1.0]]), InvalidTypeError, "q is a builtins.list: expected a numpy array"),
    ("q_int32", att_with(q=arr(2, 3, 4, 16, dtype=np.int32)), InvalidTypeError,
     "q has dtype int32: attention inputs must be float16, bfloat16 or float32"),
    ("v_float64", att_with(v=arr(2, 8, 2, 16, dtype=np.float64)), InvalidTypeError, "v has dtype float64"),
    ("qk_dtypes_differ", att_with(k=arr(2, 8, 2, 16, dtype=np.float16)), InvalidTypeError,
     "q, k, v dtypes differ (float32, float16, float32): cast them to one dtype"),
    ("mixed_numpy_torch", att_with(k=T(2, 8, 2, 16)), InvalidTypeError,
     "k is a torch array but q is a numpy array: mixed array libraries are not allowed"),
    ("index_array_other_library", lambda: portakern.attention(*qkv(), seqlens_k=T(2, dtype=torch.int32)),
     InvalidTypeError, "seqlens_k is a torch array but q is a numpy array"),
    ("meta_device", lambda: portakern.attention(T(1, 2, 2, 8, device="meta"), T(1, 2, 2, 8, device="meta"),
                                                T(1, 2, 2, 8, device="meta")),
     InvalidTypeError, "torch device meta is not supported: use a cpu or cuda tensor"),
    ("absent_device", lambda: parse_device("cuda:7"),
     InvalidInputError, "device='cuda:7' is not present on this machine"),
    ("block_table_float", paged([[0, 1], [2, 3]], [4, 4], table_dtype=F32), InvalidTypeError,
     "block_table has dtype float32: index arrays must be int32 or int64"),
    # -- shapes and head layout ---------------------------------------------------------------------
    ("q_3d_dense", att_with(q=arr(3, 4, 16)), InvalidInputError,
     "q has shape (3, 4, 16): expected 4 dimensions, (B, S, H, D)"),
    ("head_dim_mismatch", att_with(k=arr(2, 8, 2, 32)), InvalidInputError,
     "k head_dim 32 != q head_dim 16: q and k must share head_dim"),
    ("k_v_disagree", att_with(v=arr(2, 7, 2, 16)), InvalidInputError,
     "k shape (2, 8, 2, 16) and v shape (2, 7, 2, 16) must agree in all but the last dimension"),
    ("head_ratio", att_with(k=arr(2, 8, 3, 16), v=arr(2, 8, 3, 16)), InvalidInputError,
     "q has 4 heads and k has 3: the number of query heads must be a multiple of the number of KV heads"),
    ("batch_mismatch", att_with(k=arr(3, 8, 2, 16), v=arr(3, 8, 2, 16)), InvalidInputError,
     "k has batch 3 but q has batch 2: they must match"),
    ("empty_keys", att_with(k=arr(2, 0, 2, 16), v=arr(2, 0, 2, 16)), InvalidInputError,
     "seqlen_k=0 must be a positive int"),
    ("non_contiguous_numpy", att_with(q=arr(2, 3, 4, 32)[..., ::2]), InvalidInputError,
     "q has stride 2 in its last (head_dim) dimension: the innermost dimension must be contiguous"),
    ("non_contiguous_torch", lambda: portakern.attention(T(1, 2, 16, 2).transpose(-1, -2), T(1, 2, 2, 16),
                                                         T(1, 2, 2, 16)),
     InvalidInputError, "pass q.contiguous()"),
    # -- options --------------------------------------------------------------------------------------
    ("causal_not_bool", att(causal="yes"), InvalidTypeError, "causal='yes' must be True or False"),
    ("window_one_value", att(window=(3,)), InvalidInputError, "window=(3,) must be a (left, right) pair of ints"),
    ("window_float", att(window=(1.5, 0)), InvalidInputError, "window=(1.5, 0) must be a (left, right) pair"),
    ("softcap_negative", att(softcap=-1.0), InvalidInputError, "softcap=-1.0 must be a finite number >= 0"),
    ("softcap_string", att(softcap="30"), InvalidInputError, "softcap='30' must be a finite number"),
    ("scale_zero", att(scale=0.0), InvalidInputError, "scale=0.0 must be a finite non-zero number"),
    ("scale_nan", att(scale=float("nan")), InvalidInputError, "scale=nan must be a finite non-zero number"),
    ("scale_string", att(scale="0.1"), InvalidInputError, "scale='0.1' must be a finite non-zero number"),
    ("score_mod_string", att(score_mod="score * 2"), InvalidTypeError,
     "score_mod='score * 2' must be a portakern.ir.Expr"),
    ("score_mod_boolean", att(score_mod=E.kv_idx < 3), InvalidInputError,
     "is a boolean expression: pass masks as mask_mod"),
    ("mask_mod_numeric", att(mask_mod=E.kv_idx + 1), InvalidInputError,
     "is not a boolean expression: it must say which keys are kept"),
    ("mask_mod_reads_score", att(mask_mod=E.score > 0), InvalidInputError,
     "mask_mod reads 'score': masks may depend on positions and heads only"),
    ("return_lse_not_bool", att(return_lse=1), InvalidTypeError, "return_lse=1 must be True or False"),
    ("unknown_expr_variable", lambda: E.var("token"), InvalidInputError,
     "expression variable 'token' is unknown: expected one of score, b, h"),
    # -- paged KV --------------------------------------------------------------------------------------
    ("paged_without_seqlens", lambda: portakern.attention(arr(2, 1, 4, 16), arr(4, 4, 2, 16), arr(4, 4, 2, 16),
                                                          block_table=np.zeros((2, 2), np.int32)),
     InvalidInputError, "paged attention (block_table given) needs seqlens_k"),
    ("block_table_out_of_range", paged([[0, 7], [1, 2]], [8, 8]), InvalidInputError,
     "block_table[0] references page 7 but k has 4 pages (valid 0..3)"),
    ("block_table_negative", paged([[0, 1], [-1, 2]], [8, 8]), InvalidInputError,
     "block_table[1] references page -1"),
    ("seqlens_longer_than_table", paged([[0, 1], [2, 3]], [8, 9]), InvalidInputError,
     "seqlens_k has a value 9 longer than the block table holds (2 pages x page_size 4 = 8 keys)"),
    ("block_table_wrong_batch", paged([[0, 1]], [4, 4]), InvalidInputError,
     "block_table has shape (1, 2): expected (batch, max_pages) = (2, max_pages)"),
    ("paged_seqlens_wrong_shape", paged([[0, 1], [2, 3]], [4, 4, 4]), InvalidInputError,
     "seqlens_k has shape (3,): expected (batch,) = (2,)"),
    # -- dense lengths, varlen -------------------------------------------------------------------------
    ("dense_seqlens_too_long", att(seqlens_k=np.array([3, 9], np.int32)), InvalidInputError,
     "seqlens_k=[3, 9] must lie in [0, 8]"),
    ("varlen_needs_both", varlen([0, 2, 5], None), InvalidInputError,
     "varlen attention needs both cu_seqlens_q and cu_seqlens_k"),
    ("cu_seqlens_not_monotone", varlen([0, 4, 2, 5], [0, 3, 6, 9]), InvalidInputError,
     "cu_seqlens_q=[0, 4, 2, 5]... must start at 0, never decrease and end at 5"),
    ("cu_seqlens_wrong_end", varlen([0, 2, 5], [0, 3, 8]), InvalidInputError,
     "cu_seqlens_k=[0, 3, 8]... must start at 0, never decrease and end at 9 (the first dimension of k)"),
    ("cu_seqlens_wrong_shape", varlen([0, 2, 5], [[0, 3, 9]]), InvalidInputError,
     "cu_seqlens_k has shape (1, 3): expected (batch + 1,) = (3,)"),
    ("varlen_with_seqlens_k", varlen([0, 2, 5], [0, 3, 9], seqlens_k=np.array([3, 6], np.int32)),
     InvalidInputError, "seqlens_k must be None for varlen attention"),
    ("varlen_with_block_table", varlen([0, 2, 5], [0, 3, 9], block_table=np.zeros((2, 1), np.int32)),
     InvalidInputError, "block_table together with cu_seqlens_q/k is not supported"),
    # -- backends and dispatch ---------------------------------------------------------------------------
    ("unknown_backend", att(backend="tpu"), InvalidInputError,
     "backend='tpu' is not registered: registered backends are"),
    ("use_backend_not_a_string", lambda: portakern.use_backend(3).__enter__(), InvalidInputError,
     "use_backend(3): the backend name must be a string"),
    ("explain_unknown_fn", lambda: portakern.explain(len, *qkv()), InvalidTypeError,
     "fn must be portakern.attention or portakern.quant_gemv"),
    ("mask_mod_not_an_expr", att(mask_mod="causal"), InvalidTypeError,
     "mask_mod='causal' must be a portakern.ir.Expr (see portakern.ir.expr)"),
    ("dense_seqlens_k_wrong_length", att(seqlens_k=np.array([8, 8, 8], np.int32)), InvalidInputError,
     "seqlens_k has shape (3,): expected (batch,) = (2,)"),
    # -- quantized GEMV -----------------------------------------------------------------------------------
    ("weight_not_quantized", gemv(arr(1, 64), arr(16, 64)), InvalidTypeError,
     "w is a ndarray: expected a portakern.QuantizedWeight"),
    ("x_int8", gemv(arr(1, 64, dtype=np.int8)), InvalidTypeError,
     "x has dtype int8: activations must be float16, bfloat16 or float32"),
    ("x_1d", gemv(arr(64)), InvalidInputError, "x has shape (64,): expected (M, K) = (M, 64); reshape a vector"),
    ("x_wrong_k", gemv(arr(2, 48)), InvalidInputError, "x has K=48 columns but w is (16, 64): x must be (M, 64)"),
    ("x_non_contiguous", gemv(arr(2, 128)[:, ::2]), InvalidInputError, "x has stride 2 in its last"),
    ("x_is_a_list", gemv([[0.0] * 64]), InvalidTypeError, "x is a builtins.list"),
    ("group_size_not_dividing_k", lambda: weight(K=64, group_size=48), InvalidInputError,
     "group_size=48 does not divide K=64"),
    ("bits_unsupported_by_packing", lambda: QuantFormat(bits=3, group_size=32, symmetric=False).verify(),
     InvalidInputError, "bits=3 is not supported by packing native"),
    ("gguf_group_size", lambda: QuantFormat(4, 64, True, Packing.GGUF_Q4_0).verify(K=128), InvalidInputError,
     "group_size=64 must be 32 for gguf_q4_0"),
    ("awq_n_not_multiple_of_8", lambda: QuantFormat(4, 32, False, Packing.AWQ).verify(K=64, N=12),
     InvalidInputError, "N=12 must be a multiple of 8 for awq"),
    ("gptq_symmetric", lambda: QuantFormat(4, 32, True, Packing.GPTQ).verify(), InvalidInputError,
     "symmetric=True is not a gptq layout"),
]



@pytest.mark.parametrize("call, exc, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_a_teaching_message(fresh_registry, call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    err = info.value
    assert isinstance(err, PortakernError), f"{type(err).__name__} is not a PortakernError"
    builtin = ValueError if issubclass(exc, InvalidInputError) else TypeError if issubclass(exc, InvalidTypeError) \
        else NotImplementedError
    assert isinstance(err, builtin)
    assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)



# (id, call, exception type, fragments the message must contain: argument, value/shape, rule, way out)
CASES_SPECIFIC = [
    # 1. heads / head_dim of 0 are checked before they divide anything
    ("hkv_zero", att_of(rand(1, 4, 2, 16), rand(1, 4, 0, 16), rand(1, 4, 0, 16)), InvalidInputError,
     ["k has shape (1, 4, 0, 16)", "Hkv", "must be >= 1"]),
    ("hq_zero", att_of(rand(1, 4, 0, 16), rand(1, 4, 2, 16), rand(1, 4, 2, 16)), InvalidInputError,
     ["q has shape (1, 4, 0, 16)", "Hq", "must be >= 1"]),
    ("d_zero", att_of(rand(1, 4, 2, 0), rand(1, 4, 2, 0), rand(1, 4, 2, 0)), InvalidInputError,
     ["q has shape (1, 4, 2, 0)", "head_dim", "must be >= 1"]),
    ("paged_page_size_zero", att_of(Q, rand(2, 0, 2, 16), rand(2, 0, 2, 16), block_table=np.zeros((1, 1), np.int32),
                                 seqlens_k=np.array([0], np.int32)), InvalidInputError,
     ["k has shape (2, 0, 2, 16)", "page_size >= 1"]),
    # 2. rank before indexing
    ("cu_seqlens_q_0d", att_of(*VARLEN, cu_seqlens_q=np.int32(0), cu_seqlens_k=np.array([0, 4], np.int32)),
     InvalidInputError, ["cu_seqlens_q has shape ()", "1-D", "batch >= 1"]),
    ("cu_seqlens_q_2d", att_of(*VARLEN, cu_seqlens_q=np.array([[0, 4]], np.int32),
                            cu_seqlens_k=np.array([0, 4], np.int32)),
     InvalidInputError, ["cu_seqlens_q has shape (1, 2)", "1-D", "batch >= 1"]),
    ("cu_seqlens_k_0d", att_of(*VARLEN, cu_seqlens_q=np.array([0, 4], np.int32), cu_seqlens_k=np.int32(0)),
     InvalidInputError, ["cu_seqlens_k has shape ()", "batch + 1"]),
    ("paged_block_table_0d", att_of(Q, rand(3, 4, 2, 16), rand(3, 4, 2, 16), block_table=np.int32(0),
                                 seqlens_k=np.array([4], np.int32)),
     InvalidInputError, ["block_table has shape ()", "(batch, max_pages)"]),
    # 3. numpy bools are not numbers
    ("scale_np_bool", att_of(Q, Q, Q, scale=np.bool_(True)), InvalidInputError, ["scale=", "finite non-zero number"]),
    ("softcap_np_bool", att_of(Q, Q, Q, softcap=np.bool_(True)), InvalidInputError, ["softcap=", "finite number >= 0"]),
    ("window_np_bool", att_of(Q, Q, Q, window=(np.bool_(True), 1)), InvalidInputError,
     ["window=", "pair of ints"]),
    # 4. sparse tensors and the x stride wording
    ("sparse_q", att_of(TQ.to_sparse(), TQ, TQ), InvalidTypeError,
     ["q is a torch tensor with layout=torch.sparse_coo", "sparse tensors are not supported", "q.to_dense()"]),
    ("sparse_v", att_of(TQ, TQ, TQ.to_sparse()), InvalidTypeError,
     ["v is a torch tensor", "sparse tensors are not supported", "v.to_dense()"]),
    ("sparse_seqlens_k", att_of(TQ, TQ, TQ, seqlens_k=torch.tensor([2], dtype=torch.int32).to_sparse()),
     InvalidTypeError, ["seqlens_k is a torch tensor", "sparse tensors are not supported", "seqlens_k.to_dense()"]),
    ("sparse_x", lambda: portakern.quant_gemv(torch.from_numpy(rand(1, 64)).to_sparse(), weight()), InvalidTypeError,
     ["x is a torch tensor", "sparse tensors are not supported", "x.to_dense()"]),
    ("x_stride_names_k", lambda: portakern.quant_gemv(rand(2, 128)[:, ::2], weight()), InvalidInputError,
     ["x has stride 2 in its last (K) dimension", "contiguous"]),
    # 5. dtypes outside the IR are type errors naming the argument and the accepted dtypes
    ("torch_complex_q", att_of(*(TQ.to(torch.complex64),) * 3), InvalidTypeError,
     ["q has dtype complex64", "float16, bfloat16 or float32"]),
    ("numpy_bool_k", att_of(Q, Q > 0, Q), InvalidTypeError, ["k has dtype bool", "float16, bfloat16 or float32"]),
    ("numpy_str_q", att_of(Q.astype(str), Q, Q), InvalidTypeError, ["q has dtype <U", "float16, bfloat16 or float32"]),
    ("numpy_bool_seqlens_k", att_of(Q, Q, Q, seqlens_k=np.array([True])), InvalidTypeError,
     ["seqlens_k has dtype bool", "int32 or int64"]),
    ("numpy_bool_x", lambda: portakern.quant_gemv(rand(1, 64) > 0, weight()), InvalidTypeError,
     ["x has dtype bool", "float16, bfloat16 or float32"]),
    ("torch_complex_x", lambda: portakern.quant_gemv(torch.ones(1, 64, dtype=torch.complex64), weight()),
     InvalidTypeError, ["x has dtype complex64", "float16, bfloat16 or float32"]),
    # 6. masked arrays
    ("masked_q", att_of(np.ma.masked_array(Q, mask=Q > 0), Q, Q), InvalidTypeError,
     ["q is a numpy masked array", "masked arrays are not supported", "np.ma.filled(q, fill)", "q.data"]),
    ("masked_x", lambda: portakern.quant_gemv(np.ma.masked_array(rand(1, 64)), weight()), InvalidTypeError,
     ["x is a numpy masked array", "masked arrays are not supported", "np.ma.filled(x, fill)"]),
    # 7. quantize: sparse, masked, empty weights
    ("quantize_sparse", lambda: portakern.quantize(torch.from_numpy(rand(16, 64)).to_sparse()), InvalidTypeError,
     ["w is a torch tensor with layout=torch.sparse_coo", "sparse tensors are not supported", "w.to_dense()"]),
    ("quantize_masked", lambda: portakern.quantize(np.ma.masked_array(rand(16, 64))), InvalidTypeError,
     ["w is a numpy masked array", "masked arrays are not supported"]),
    ("quantize_k0", lambda: portakern.quantize(rand(16, 64)[:, :0]), InvalidInputError,
     ["w has shape (16, 0)", "N >= 1", "K >= 1"]),
    ("quantize_n0", lambda: portakern.quantize(rand(16, 64)[:0]), InvalidInputError,
     ["w has shape (0, 64)", "N >= 1", "K >= 1"]),
    ("quantize_float_bits", lambda: portakern.quantize(rand(16, 64), bits=4.0, group_size=32), InvalidInputError,
     ["bits=4.0", "choose 4 or 8"]),
]



@pytest.mark.parametrize("call, exc, fragments", [c[1:] for c in CASES_SPECIFIC],
                         ids=[c[0] for c in CASES_SPECIFIC])
def test_rejected_with_specific_error_and_message(fresh_registry, call, exc, fragments):
    with pytest.raises(PortakernError) as info:
        call()
    err = info.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError if exc is InvalidInputError else TypeError)
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"



# -- option values out of range -------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: np.zeros((), F32), lambda: np.float32(1.0), lambda: torch.zeros(())],
                         ids=["numpy_0d", "numpy_scalar", "torch_0d"])
def test_a_0d_q_is_named_by_the_rank_check(fresh_registry, make):
    q = make()
    kv = torch.from_numpy(Q8) if isinstance(q, torch.Tensor) else Q8
    rejects(lambda: portakern.attention(q, kv, kv), InvalidInputError, "q has shape ()", "expected 4 dimensions")


@pytest.mark.parametrize("option", ["scale", "softcap"])
def test_an_int_too_large_for_a_float_is_an_invalid_input(fresh_registry, option):
    rejects(lambda: portakern.attention(Q8, Q8, Q8, **{option: 10 ** 400}), InvalidInputError,
            f"{option}=1000", "must be a finite")


@pytest.mark.parametrize("window", [(0, 2 ** 63 - 1), (2 ** 63, 0), (0, 2 ** 31 - 1), (2 ** 30 + 1, 0)])
def test_a_window_side_past_2_30_is_rejected_not_wrapped(fresh_registry, window):
    # (0, 2**63 - 1) wrapped in the reference's int64 position math, (0, 2**31 - 1) in Triton's int32 one:
    # both hid every key right of the diagonal
    rejects(lambda: portakern.attention(Q8, Q8, Q8, window=window), InvalidInputError,
            f"window={window!r}", "at most 1073741824", "-1")


@pytest.mark.parametrize("kw, fragment", [(dict(scale=1e39), r"scale=1e\+39 is outside float32"),
                                          (dict(scale=-1e-39), "scale=-1e-39 is outside float32"),
                                          (dict(softcap=1e-40), "softcap=1e-40 is outside float32"),
                                          (dict(softcap=1e39), r"softcap=1e\+39 is outside float32")])
def test_a_scale_or_softcap_float32_cannot_hold_is_refused(kw, fragment):
    """The kernels compute in float32: a scale of 1e39 is inf there (NaN scores) while the float64 reference used
    it; before, such values were accepted."""
    q = np.ones((1, 2, 2, 8), np.float32)
    with pytest.raises(InvalidInputError, match=fragment):
        portakern.attention(q, q, q, **kw)
    portakern.attention(q, q, q, scale=1e-30, softcap=0)          # in range: runs



# -- index arrays and empty dimensions ------------------------------------------------------------------------------

def test_a_negative_paged_length_is_named_with_its_index(fresh_registry):
    k = v = rand(4, 4, 2, 8)
    msg = rejects(lambda: portakern.attention(rand(2, 1, 2, 8), k, v, block_table=np.zeros((2, 2), np.int32),
                                              seqlens_k=np.array([4, -1], np.int32)),
                  InvalidInputError, "seqlens_k[1]=-1", ">= 0")
    assert "longer" not in msg  # it used to call the longest valid length (4) too long


@pytest.mark.parametrize("q, k, fragments", [
    (rand(1, 4, 2, 8), rand(1, 0, 2, 8), ["k has shape (1, 0, 2, 8)", "seqlen_k=0 must be a positive int",
                                          "seqlens_k"]),
    (rand(1, 4, 0, 8), rand(1, 4, 1, 8), ["q has shape (1, 4, 0, 8)", "heads (Hq) = 0"]),
    (rand(0, 4, 2, 0), rand(0, 4, 2, 0), ["head_dim (D) = 0"]),
], ids=["seqlen_k", "heads", "head_dim-of-empty-q"])
def test_an_empty_dense_dimension_names_the_argument(fresh_registry, q, k, fragments):
    rejects(lambda: portakern.attention(q, k, k), InvalidInputError, *fragments)


def test_empty_varlen_keys_name_the_argument(fresh_registry):
    rejects(lambda: portakern.attention(rand(4, 2, 8), rand(0, 2, 8), rand(0, 2, 8),
                                        cu_seqlens_q=np.array([0, 4], np.int32),
                                        cu_seqlens_k=np.array([0, 0], np.int32)),
            InvalidInputError, "k has shape (0, 2, 8)", "total_k=0", "use zeros")


def test_a_block_table_of_no_pages_names_the_argument(fresh_registry):
    k = v = rand(4, 4, 2, 8)
    rejects(lambda: portakern.attention(rand(1, 3, 2, 8), k, v, block_table=np.zeros((1, 0), np.int32),
                                        seqlens_k=np.array([0], np.int32)),
            InvalidInputError, "block_table has shape (1, 0)", "max_pages=0", "at least one page")



# -- array types, dtypes and strides --------------------------------------------------------------------------------

@pytest.mark.parametrize("call, fragments", [
    (lambda: portakern.attention(Q8.astype(np.float64), Q8.astype(np.float64), Q8.astype(np.float64)),
     ["q has dtype float64", "float16, bfloat16 or float32", "cast q to one of them"]),
    (lambda: portakern.attention(torch.from_numpy(Q8), torch.from_numpy(Q8).to(torch.int32), torch.from_numpy(Q8)),
     ["k has dtype int32", "cast k to one of them"]),
    (lambda: portakern.attention(Q8, Q8, Q8, seqlens_k=np.array([4], np.int16)),
     ["seqlens_k has dtype int16", "int32 or int64", "convert seqlens_k to one of them"]),
    (lambda: portakern.attention(Q8, rand(2, 4, 2, 8), rand(2, 4, 2, 8), block_table=np.zeros((1, 1), np.float32),
                                 seqlens_k=np.array([4], np.int32)),
     ["block_table has dtype float32", "int32 or int64", "convert block_table to one of them"]),
], ids=["q_float64", "k_int32_torch", "seqlens_k_int16", "block_table_float32"])
def test_a_dtype_error_says_what_to_convert(fresh_registry, call, fragments):
    rejects(call, InvalidTypeError, *fragments)


def test_a_last_dimension_strided_by_an_odd_byte_count_is_not_contiguous(fresh_registry):
    rec = np.zeros((1, 4, 2, 8), dtype=[("a", F32), ("b", np.int16)])
    rec["a"] = Q8  # a field view: float32 values 6 bytes apart, which used to pass as stride 6 // 4 = 1
    rejects(lambda: portakern.attention(rec["a"], Q8, Q8), InvalidInputError,
            "q has a stride of 6 bytes in its last (head_dim) dimension", "must be contiguous",
            "numpy.ascontiguousarray(q)")


def test_a_sparse_csr_tensor_is_named_before_any_stride_is_read():
    torch = pytest.importorskip("torch")
    import portakern
    q = torch.zeros((1, 4, 2, 8))
    with pytest.raises(portakern.InvalidTypeError, match="sparse"):
        portakern.attention(q.reshape(4, 16).to_sparse_csr(), q, q)
    w = portakern.quantize(np.ones((16, 64), np.float32), bits=4, group_size=32)
    with pytest.raises(portakern.InvalidTypeError, match="sparse"):
        portakern.quant_gemv(torch.ones((2, 64)).to_sparse_csr(), w)



# -- explain takes exactly the arguments of the op it explains ------------------------------------------------------

def test_explain_rejects_what_attention_rejects(fresh_registry):
    with pytest.raises(TypeError) as direct:
        portakern.attention(Q8, Q8, Q8, window_size=(1, 0))
    rejects(lambda: portakern.explain(portakern.attention, Q8, Q8, Q8, window_size=(1, 0)), InvalidTypeError,
            "window_size", "portakern.attention")
    assert "window_size" in str(direct.value)
    # a keyword of the internal validator is not an attention argument: it used to skip the index checks
    cu = np.array([0, 9], np.int32)
    rejects(lambda: portakern.explain("attention", Q8[0], Q8[0], Q8[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      check_values=False), InvalidTypeError, "check_values")
    with pytest.raises(InvalidInputError, match="must start at 0, never decrease and end at 4"):
        portakern.explain("attention", Q8[0], Q8[0], Q8[0], cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_explain_checks_the_backend_argument_as_attention_does(fresh_registry):
    want = rejects(lambda: portakern.attention(Q8, Q8, Q8, backend=3), InvalidTypeError, "backend=3", "a str")
    assert rejects(lambda: portakern.explain(portakern.attention, Q8, Q8, Q8, backend=3), InvalidTypeError) == want



# -- backends: forced, and never handed bad input -------------------------------------------------------------------

def test_forced_backend_that_cannot_run_here(fresh_registry, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedError, match="is not supported by triton on cpu.*pass backend='cpu'") as e:
        portakern.attention(*qkv(), backend="triton")
    assert isinstance(e.value, NotImplementedError)


def test_nothing_launches_before_validation(register_plugin):
    """A kernel never sees bad input: validation runs before compile and launch."""
    launched = []

    class Spy(portakern.Backend):
        name, array_kind, priority = "spy", "numpy", 99

        def supports(self, op, device):
            return portakern.Support(True)

        def compile(self, op, device):
            launched.append("compile")
            return lambda *a: launched.append("run")

    class Plugin:
        @portakern.hookimpl
        def portakern_register_backends(self):
            return [Spy()]

    register_plugin(Plugin(), name="spy")
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"window=\(1, 2, 3\) must be a \(left, right\) pair"):
        portakern.attention(q, k, v, window=(1, 2, 3))
    with pytest.raises(InvalidInputError, match="the number of query heads must be a multiple"):
        portakern.attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    assert launched == []
