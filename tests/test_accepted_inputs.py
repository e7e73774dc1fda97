"""What the public API accepts beyond plain Python values and contiguous arrays, and what it makes of it: numpy
scalars and numpy bools as options give exactly the results of the equal Python values, any negative window side
is unbounded and the largest allowed side unbounded in effect, quantize takes numpy integers, and numpy views that
torch cannot wrap (negative strides, strides not a multiple of the item size) reach a torch backend as their
values. Results are checked against a plain float64 numpy attention written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portakern
from portakern.arrays import convert_for_backend
from portakern.devices import CPU

F32 = np.float32


def rand(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def attention64(q, k, v, window=None):
    """Dense BSHD float64 attention, GQA, bottom-right aligned ``window=(left, right)`` (negative = unbounded)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    k, v = np.repeat(k, Hq // Hkv, axis=2), np.repeat(v, Hq // Hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    d = i + Sk - Sq
    keep = np.ones((Sq, Sk), bool)
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= d - left
        if right >= 0:
            keep &= j <= d + right
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", np.divide(p, den, out=np.zeros_like(p), where=den > 0), v)



# -- numpy scalars and bools are numbers and bools ------------------------------------------------------------------

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


def test_numpy_bools_for_causal_and_return_lse_act_like_python_bools(fresh_registry):
    # they used to be rejected with the self-contradicting 'causal=np.True_ must be True or False'
    q, k, v = rand(1, 5, 4, 8, seed=7), rand(1, 9, 2, 8, seed=8), rand(1, 9, 2, 8, seed=9)
    out, lse = portakern.attention(q, k, v, causal=np.bool_(True), return_lse=np.bool_(True), backend="cpu")
    np.testing.assert_allclose(out, attention64(q, k, v, window=(-1, 0)), rtol=2e-6, atol=2e-6)
    assert lse.shape == (1, 4, 5) and lse.dtype == np.float32
    plain = portakern.attention(q, k, v, causal=np.bool_(False), return_lse=np.bool_(False))
    np.testing.assert_allclose(plain, attention64(q, k, v), rtol=2e-6, atol=2e-6)


def test_quantize_takes_numpy_int_group_size_and_bits(fresh_registry):
    W = rand(16, 64)
    a = portakern.quantize(W, bits=np.int64(4), group_size=np.int64(32))
    b = portakern.quantize(W, bits=4, group_size=32)
    assert a.fmt == b.fmt and (a.N, a.K) == (b.N, b.K)
    for name in b.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name])



# -- windows --------------------------------------------------------------------------------------------------------

def test_any_negative_window_side_is_unbounded_as_the_ir_says():
    import portakern
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    np.testing.assert_array_equal(portakern.attention(q, q, q, window=(-2, 0), backend="cpu"),
                                  portakern.attention(q, q, q, window=(-1, 0), backend="cpu"))


def test_the_largest_window_side_is_unbounded_in_effect(fresh_registry):
    q, k, v = rand(1, 5, 4, 8, seed=1), rand(1, 9, 2, 8, seed=2), rand(1, 9, 2, 8, seed=3)
    for window in [(0, 2 ** 30), (2 ** 30, 0), (2 ** 30, 2 ** 30)]:
        got = portakern.attention(q, k, v, window=window, backend="cpu")
        np.testing.assert_allclose(got, attention64(q, k, v, window), rtol=2e-6, atol=2e-6)



# -- numpy views a torch backend cannot wrap ------------------------------------------------------------------------

class _TorchKind:
    name, array_kind = "torch-kind", "torch"


def _odd_row_stride(a):
    """A view of ``a``'s values whose rows are 2 bytes apart more than the elements' size allows."""
    rows, cols = a.shape
    buf = np.zeros(rows * (cols * a.itemsize + 2), np.uint8)
    view = np.ndarray((rows, cols), a.dtype, buffer=buf, strides=(cols * a.itemsize + 2, a.itemsize))
    view[...] = a
    return view


@pytest.mark.parametrize("make", [lambda: rand(2, 5, 3, 8)[:, ::-1], lambda: _odd_row_stride(rand(6, 8))],
                         ids=["negative_stride", "stride_not_a_multiple_of_itemsize"])
def test_a_numpy_view_torch_cannot_wrap_converts_for_a_torch_backend(make):
    a = make()
    t = convert_for_backend(a, _TorchKind(), CPU)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), a)


def test_a_negative_stride_view_runs_on_a_torch_backend(fresh_registry):
    if "torch-eager" not in {b.name for b in portakern.list_backends()}:
        pytest.skip("the example torch-eager plugin is not installed")
    q, k, v = rand(1, 6, 4, 8, seed=4)[:, ::-1], rand(1, 7, 2, 8, seed=5), rand(1, 7, 2, 8, seed=6)[:, ::-1]
    got = portakern.attention(q, k, v, backend="torch-eager")
    np.testing.assert_allclose(got, attention64(q, k, v), rtol=2e-5, atol=2e-5)
