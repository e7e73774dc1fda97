"""A weight held only as fragments (``layout="fragments"``, the default on CUDA) where no fragment kernel runs the
call: ``portakern.gemv_torch.unpack_fragments`` (torch) against the numpy reference, and the triton backend's
``FragmentsDense`` path (dequantize the fragments for the call, one matmul) against float64, on CPU tensors. The same
calls on a CUDA device (M = 2048 through ``QuantLinear``, fp16 x at M = 8, a prologue) at the end, skipped without
one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portakern
from portakern.devices import CPU, detect_devices
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.gemv_weight import dequantize_prepared, prepare_gemv_weight
from portakern.ir import DType
from portakern.ir.gemv_layout import pack_fragments, unpack_fragments
from portakern.ir.ops import QuantGemv


@pytest.mark.parametrize("N,K", [(1000, 1024), (16, 128), (300, 384), (129, 2048)])
def test_torch_unpack_fragments_matches_the_numpy_reference(N, K):
    from portakern import gemv_torch

    codes = np.random.default_rng(N + K).integers(0, 16, (N, K)).astype(np.uint8)
    words = pack_fragments(codes)
    got = gemv_torch.unpack_fragments(torch.from_numpy(words), N, K)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (N, K)
    np.testing.assert_array_equal(got.numpy(), unpack_fragments(words, N, K))
    np.testing.assert_array_equal(got.numpy(), codes)
    # the torch packer's words too, and a slice of whole 16-row units (what the dense path unpacks step by step)
    t = gemv_torch.pack_fragments(torch.from_numpy(codes))
    np.testing.assert_array_equal(gemv_torch.unpack_fragments(t, N, K).numpy(), codes)
    rows = min(N, 48) - 16
    np.testing.assert_array_equal(gemv_torch.unpack_fragments(t[:, 1:], rows, K).numpy(), codes[16:16 + rows])


def _fragments_only(N=1000, K=1024, symmetric=False, scale_dtype="float16", seed=0):
    w = portakern.quantize(np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32), bits=4,
                           group_size=128, symmetric=symmetric, scale_dtype=scale_dtype)
    p = prepare_gemv_weight(w, CPU, fragments=True, layout="fragments")
    assert p.qweight is None and p.frag is not None
    return w, p


def _op(M, w, dtype, prologue=None):
    return QuantGemv(M=M, N=w.N, K=w.K, dtype=DType(dtype), fmt=w.fmt, prologue=prologue)


@pytest.mark.parametrize("symmetric,scale_dtype", [(False, "float16"), (True, "bfloat16"), (False, "float32")])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2), ("float16", 2e-3)])
def test_fragments_dense_matches_float64_at_m_32(monkeypatch, symmetric, scale_dtype, dtype, tol):
    from portakern.backends.triton.quant_gemv import fragments_dense

    monkeypatch.setattr(fragments_dense, "ROWS_PER_STEP", 256)       # several steps, the last one partial (1000)
    w, p = _fragments_only(symmetric=symmetric, scale_dtype=scale_dtype)
    exact = dequantize_prepared(p)
    np.testing.assert_allclose(exact, w.dequantize(), rtol=0, atol=1e-6)
    dt = getattr(torch, dtype)
    np.testing.assert_allclose(fragments_dense.dequantize_fragments(p, torch.float32).double().numpy(), exact,
                               rtol=1e-6, atol=1e-6)
    x = torch.randn(32, w.K, generator=torch.Generator().manual_seed(1)).to(dt)
    out = torch.full((32, w.N), float("nan"), dtype=dt)
    fragments_dense.FragmentsDense(_op(32, w, dtype), "test")(x, p, out)
    ref = x.double().numpy() @ exact.T
    assert np.abs(out.double().numpy() - ref).max() / np.abs(ref).max() < tol


def test_triton_serves_a_fragments_only_weight_where_its_frag_kernel_cannot():
    # on the CPU (Triton's interpreter cannot run the Gluon "frag" kernel) and for a prologue, compile's kernel takes
    # the dense path; nothing of the weight is kept by it (a resident dense copy would undo the layout)
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig

    w, p = _fragments_only()
    exact = dequantize_prepared(p)
    x = torch.randn(32, w.K, generator=torch.Generator().manual_seed(2))
    kern = Q.compile(_op(32, w, "float32"), CPU)
    out = torch.empty(32, w.N)
    kern(x, p, out)
    np.testing.assert_allclose(out.double().numpy(), x.double().numpy() @ exact.T, rtol=1e-4, atol=1e-3)
    (ln,) = kern.launchers.values()
    assert ln.kind == "fragments-dense" and "interpreter" in ln.why
    assert not any(isinstance(v, torch.Tensor) for v in vars(ln).values())
    gu = torch.randn(3, 2 * w.K, generator=torch.Generator().manual_seed(3))
    glu = Q.compile(_op(3, w, "float32", prologue="silu_mul"), CPU)
    out3 = torch.empty(3, w.N)
    glu(gu, p, out3)
    xin = torch.nn.functional.silu(gu[:, : w.K].double()) * gu[:, w.K:].double()
    np.testing.assert_allclose(out3.double().numpy(), xin.numpy() @ exact.T, rtol=1e-4, atol=1e-3)
    assert "prologue='silu_mul'" in next(iter(glu.launchers.values())).why
    assert Q.fragments_refusal(_op(32, w, "bfloat16"), p, interpret=False).startswith("M=32")
    assert Q.fragments_refusal(_op(8, w, "float16"), p, interpret=False).startswith("dtype=float16")
    assert Q.fragments_refusal(_op(8, w, "bfloat16"), p, interpret=False) is None       # the "frag" kernel's call
    # a forced configuration of a word kernel cannot read it: refused, naming the way out
    with pytest.raises(UnsupportedError, match=r"GemvConfig\(kind='dot'\) reads the word layout.*force kind='frag'"):
        Q.compile(_op(32, w, "float32"), CPU, GemvConfig("dot", 64, 16))(x, p, out)


def test_dequantize_fragments_refuses_a_weight_without_fragments():
    from portakern.backends.triton.quant_gemv.fragments_dense import dequantize_fragments

    w = portakern.quantize(np.ones((256, 256), np.float32), bits=4, group_size=128)
    words = prepare_gemv_weight(w, CPU, fragments=False)
    with pytest.raises(InvalidInputError, match="no fragment layout.*layout='fragments'"):
        dequantize_fragments(words, torch.float32)


# -- on a CUDA device ------------------------------------------------------------------------------------------------

GPU = [d for d in detect_devices() if d.type == "cuda"]


@pytest.mark.skipif(not GPU, reason="no CUDA device on this machine: the CPU tests above cover the dense path")
@pytest.mark.parametrize("M,dtype", [(2048, "bfloat16"), (8, "float16"), (2, "float16"), (24, "float16")])
def test_gpu_default_layout_serves_every_m_and_dtype(M, dtype):
    from portakern.gemv_weight import DEFAULT_LAYOUT, GEMV_LAYOUT
    from portakern.torch_ops import QuantLinear, quant_linear

    assert DEFAULT_LAYOUT == "fragments"
    N, K = 1536, 2048
    g = torch.Generator().manual_seed(M)
    w = portakern.quantize(torch.randn(N, K, generator=g).cuda(), bits=4, group_size=128)
    lin = QuantLinear(w)
    assert lin.qweight is None and lin.frag is not None and "frag" in lin.state_dict()
    assert w.prepared[(GEMV_LAYOUT, "cuda:0")].qweight is None
    x = torch.randn(M, K, generator=g).to(getattr(torch, dtype)).cuda()
    ref = x.double() @ torch.as_tensor(w.dequantize()).double().cuda().T
    for y in (lin(x), portakern.quant_gemv(x, w)):
        assert torch.isfinite(y).all()
        assert (y.double() - ref).abs().max() / ref.abs().max() < 2e-2
    glu = quant_linear(torch.cat([x, x], dim=1), w, prologue="silu_mul")
    xin = torch.nn.functional.silu(x.double()) * x.double()
    ref_glu = xin @ torch.as_tensor(w.dequantize()).double().cuda().T
    assert (glu.double() - ref_glu).abs().max() / ref_glu.abs().max() < 2e-2
