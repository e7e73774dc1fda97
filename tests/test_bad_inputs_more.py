"""More bad input (review round 21): degenerate dims used as divisors, 0-d index arrays, numpy
scalar options, sparse / masked / non-IR-dtype arrays, empty weights. Every rejection is a
specific portakern error whose message names the argument and the rule; every numpy scalar that
is a valid option gives exactly the result of the equal Python scalar."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import portakern
from portakern.errors import InvalidInputError, InvalidTypeError, PortakernError

F32 = np.float32


def rand(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def att(q, k, v, **kw) -> Callable[[], Any]:
    return lambda: portakern.attention(q, k, v, **kw)


def weight(N=16, K=64):
    return portakern.quantize(rand(N, K), bits=4, group_size=32)


Q = rand(1, 4, 2, 16)
TQ = torch.from_numpy(Q)
VARLEN = (Q[0], Q[0], Q[0])

# (id, call, exception type, fragments the message must contain: argument, value/shape, rule, way out)
CASES = [
    # 1. heads / head_dim of 0 are checked before they divide anything
    ("hkv_zero", att(rand(1, 4, 2, 16), rand(1, 4, 0, 16), rand(1, 4, 0, 16)), InvalidInputError,
     ["k has shape (1, 4, 0, 16)", "Hkv", "must be >= 1"]),
    ("hq_zero", att(rand(1, 4, 0, 16), rand(1, 4, 2, 16), rand(1, 4, 2, 16)), InvalidInputError,
     ["q has shape (1, 4, 0, 16)", "Hq", "must be >= 1"]),
    ("d_zero", att(rand(1, 4, 2, 0), rand(1, 4, 2, 0), rand(1, 4, 2, 0)), InvalidInputError,
     ["q has shape (1, 4, 2, 0)", "head_dim", "must be >= 1"]),
    ("paged_page_size_zero", att(Q, rand(2, 0, 2, 16), rand(2, 0, 2, 16), block_table=np.zeros((1, 1), np.int32),
                                 seqlens_k=np.array([0], np.int32)), InvalidInputError,
     ["k has shape (2, 0, 2, 16)", "page_size >= 1"]),
    # 2. rank before indexing
    ("cu_seqlens_q_0d", att(*VARLEN, cu_seqlens_q=np.int32(0), cu_seqlens_k=np.array([0, 4], np.int32)),
     InvalidInputError, ["cu_seqlens_q has shape ()", "1-D", "batch >= 1"]),
    ("cu_seqlens_q_2d", att(*VARLEN, cu_seqlens_q=np.array([[0, 4]], np.int32),
                            cu_seqlens_k=np.array([0, 4], np.int32)),
     InvalidInputError, ["cu_seqlens_q has shape (1, 2)", "1-D", "batch >= 1"]),
    ("cu_seqlens_k_0d", att(*VARLEN, cu_seqlens_q=np.array([0, 4], np.int32), cu_seqlens_k=np.int32(0)),
     InvalidInputError, ["cu_seqlens_k has shape ()", "batch + 1"]),
    ("paged_block_table_0d", att(Q, rand(3, 4, 2, 16), rand(3, 4, 2, 16), block_table=np.int32(0),
                                 seqlens_k=np.array([4], np.int32)),
     InvalidInputError, ["block_table has shape ()", "(batch, max_pages)"]),
    # 3. numpy bools are not numbers
    ("scale_np_bool", att(Q, Q, Q, scale=np.bool_(True)), InvalidInputError, ["scale=", "finite non-zero number"]),
    ("softcap_np_bool", att(Q, Q, Q, softcap=np.bool_(True)), InvalidInputError, ["softcap=", "finite number >= 0"]),
    ("window_np_bool", att(Q, Q, Q, window=(np.bool_(True), 1)), InvalidInputError,
     ["window=", "pair of ints"]),
    # 4. sparse tensors and the x stride wording
    ("sparse_q", att(TQ.to_sparse(), TQ, TQ), InvalidTypeError,
     ["q is a torch tensor with layout=torch.sparse_coo", "sparse tensors are not supported", "q.to_dense()"]),
    ("sparse_v", att(TQ, TQ, TQ.to_sparse()), InvalidTypeError,
     ["v is a torch tensor", "sparse tensors are not supported", "v.to_dense()"]),
    ("sparse_seqlens_k", att(TQ, TQ, TQ, seqlens_k=torch.tensor([2], dtype=torch.int32).to_sparse()),
     InvalidTypeError, ["seqlens_k is a torch tensor", "sparse tensors are not supported", "seqlens_k.to_dense()"]),
    ("sparse_x", lambda: portakern.quant_gemv(torch.from_numpy(rand(1, 64)).to_sparse(), weight()), InvalidTypeError,
     ["x is a torch tensor", "sparse tensors are not supported", "x.to_dense()"]),
    ("x_stride_names_k", lambda: portakern.quant_gemv(rand(2, 128)[:, ::2], weight()), InvalidInputError,
     ["x has stride 2 in its last (K) dimension", "contiguous"]),
    # 5. dtypes outside the IR are type errors naming the argument and the accepted dtypes
    ("torch_complex_q", att(*(TQ.to(torch.complex64),) * 3), InvalidTypeError,
     ["q has dtype complex64", "float16, bfloat16 or float32"]),
    ("numpy_bool_k", att(Q, Q > 0, Q), InvalidTypeError, ["k has dtype bool", "float16, bfloat16 or float32"]),
    ("numpy_str_q", att(Q.astype(str), Q, Q), InvalidTypeError, ["q has dtype <U", "float16, bfloat16 or float32"]),
    ("numpy_bool_seqlens_k", att(Q, Q, Q, seqlens_k=np.array([True])), InvalidTypeError,
     ["seqlens_k has dtype bool", "int32 or int64"]),
    ("numpy_bool_x", lambda: portakern.quant_gemv(rand(1, 64) > 0, weight()), InvalidTypeError,
     ["x has dtype bool", "float16, bfloat16 or float32"]),
    ("torch_complex_x", lambda: portakern.quant_gemv(torch.ones(1, 64, dtype=torch.complex64), weight()),
     InvalidTypeError, ["x has dtype complex64", "float16, bfloat16 or float32"]),
    # 6. masked arrays
    ("masked_q", att(np.ma.masked_array(Q, mask=Q > 0), Q, Q), InvalidTypeError,
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


@pytest.mark.parametrize("call, exc, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_with_specific_error_and_message(fresh_registry, call, exc, fragments):
    with pytest.raises(PortakernError) as info:
        call()
    err = info.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError if exc is InvalidInputError else TypeError)
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"


# -- 3. numpy scalars are numbers: same result as the Python scalar -----------------------------------

NUMPY_OPTIONS = [
    ("scale_np_float32", dict(scale=np.float32(0.25)), dict(scale=0.25)),
    ("scale_np_float64", dict(scale=np.float64(0.1)), dict(scale=0.1)),
    ("scale_np_int", dict(scale=np.int64(1)), dict(scale=1.0)),
    ("softcap_np_float32", dict(softcap=np.float32(2.0)), dict(softcap=2.0)),
    ("softcap_np_int", dict(softcap=np.int32(3)), dict(softcap=3.0)),
    ("window_np_ints", dict(window=(np.int64(1), np.int32(0))), dict(window=(1, 0))),
    ("window_np_unbounded", dict(window=(np.int64(-1), np.int64(2)), causal=True), dict(window=(-1, 2), causal=True)),
]


@pytest.mark.parametrize("numpy_kw, python_kw", [c[1:] for c in NUMPY_OPTIONS], ids=[c[0] for c in NUMPY_OPTIONS])
def test_numpy_scalar_options_match_python_scalars(fresh_registry, numpy_kw, python_kw):
    q, k, v = rand(2, 5, 4, 16, seed=1), rand(2, 7, 2, 16, seed=2), rand(2, 7, 2, 16, seed=3)
    got = portakern.attention(q, k, v, backend="cpu", **numpy_kw)
    want = portakern.attention(q, k, v, backend="cpu", **python_kw)
    np.testing.assert_array_equal(got, want)
    # the default dispatch takes the numpy scalar too, and agrees with the cpu backend
    np.testing.assert_allclose(portakern.attention(q, k, v, **numpy_kw), want, rtol=1e-5, atol=1e-5)


def test_quantize_takes_numpy_int_group_size_and_bits(fresh_registry):
    W = rand(16, 64)
    a = portakern.quantize(W, bits=np.int64(4), group_size=np.int64(32))
    b = portakern.quantize(W, bits=4, group_size=32)
    assert a.fmt == b.fmt and (a.N, a.K) == (b.N, b.K)
    for name in b.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name])


def test_any_negative_window_side_is_unbounded_as_the_ir_says():
    import portakern
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    np.testing.assert_array_equal(portakern.attention(q, q, q, window=(-2, 0), backend="cpu"),
                                  portakern.attention(q, q, q, window=(-1, 0), backend="cpu"))


def test_a_sparse_csr_tensor_is_named_before_any_stride_is_read():
    torch = pytest.importorskip("torch")
    import portakern
    q = torch.zeros((1, 4, 2, 8))
    with pytest.raises(portakern.InvalidTypeError, match="sparse"):
        portakern.attention(q.reshape(4, 16).to_sparse_csr(), q, q)
    w = portakern.quantize(np.ones((16, 64), np.float32), bits=4, group_size=32)
    with pytest.raises(portakern.InvalidTypeError, match="sparse"):
        portakern.quant_gemv(torch.ones((2, 64)).to_sparse_csr(), w)
